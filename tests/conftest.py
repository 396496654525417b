import os

import pytest
import torch

# Ranks run as threads: keep torch's own intra-op pool small on a 2-core machine.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torchft's Rust servers log every quorum at INFO unless RUST_LOG says otherwise, and read it
# once, at torchft's first import (which a test module may do before stratagem sets it).
os.environ.setdefault("RUST_LOG", "warn")


#: The slowest test files (launched processes: 20-100 s each in a fresh clone), started first.
#: `make test` runs two pytest workers that take whole files in collection order
#: (``--dist loadfile``); in alphabetical order the two slowest files came last, and one worker
#: finished them alone while the other sat idle.
_SLOW_FILES_FIRST = (
    # By their measured seconds in one `make test` run (longest first), so that the two
    # pytest workers (--dist loadfile: a file at a time) do not end with one long file
    # running alone: 304, 114, 102, 87, 71, 69, 68, 57, 54, 53, 52, 47, 45, 43, 38, 38 s.
    "test_bench_smoke.py", "test_ray.py", "test_slurm.py", "test_sharded.py", "test_ft_processes.py",
    "test_ft_intrusion.py", "test_multinode.py", "test_launch.py", "test_examples.py",
    "test_chaos.py", "test_async_diloco.py", "test_multinode_ft.py", "test_resume.py",
    "test_cli.py",
    "test_hostile.py", "test_ft.py", "test_rpc.py", "test_dead_peer.py",
    "test_sharded_hierarchical.py", "test_network_exposure.py", "test_clean_exit.py",
    "test_ft_group_processes.py", "test_hierarchical.py")


#: Test tiers. A test is ``unit`` unless its file is listed here or it carries the
#: ``integration`` / ``chaos`` marker itself; a unit test that launches a process fails (see
#: ``_unit_tests_launch_nothing``), so the unit tier stays what ``make test-unit`` promises.
_CHAOS_FILES = frozenset({
    "test_chaos.py", "test_ft_processes.py", "test_ft_group_processes.py", "test_multinode.py",
    "test_multinode_ft.py", "test_resume.py", "test_ps_faults.py", "test_network_exposure.py",
    "test_clean_exit.py", "test_faults.py", "test_ft_intrusion.py", "test_ray.py"})
_INTEGRATION_FILES = frozenset({
    "test_gpu.py", "test_hostile_poisoning_and_bloat.py", "test_rpc.py", "test_security.py", "test_shm.py",
    "test_hostile.py", "test_shard_hostile_peers.py", "test_bad_inputs.py", "test_cli.py", "test_examples.py",
    "test_hierarchical.py", "test_import_cost.py", "test_nanogpt_loop.py", "test_ports.py",
    "test_sharded.py", "test_sharded_hierarchical.py", "test_state_protocol.py",
    "test_startup_timeout.py", "test_launch.py", "test_argcheck.py", "test_hook_order.py",
    "test_bench_smoke.py"})
_TIERS = ("unit", "integration", "chaos")


def _tier(item: pytest.Item) -> str:
    for tier in ("chaos", "integration"):
        if item.get_closest_marker(tier) is not None:
            return tier
    name = item.path.name
    return ("chaos" if name in _CHAOS_FILES else
            "integration" if name in _INTEGRATION_FILES else "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
    first = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
    # A stable sort: the order inside a file, and of the other files, is unchanged.
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


@pytest.fixture(autouse=True)
def _unit_tests_launch_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A unit test may not start a process (subprocess and multiprocessing both go through
    ``_posixsubprocess.fork_exec``): mark it ``integration`` (or ``chaos``) instead."""
    if _tier(request.node) != "unit":
        yield
        return
    import _posixsubprocess

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"the unit test {request.node.nodeid} launched a process; unit tests run ranks "
            "as threads. Fix: mark it @pytest.mark.integration (or chaos), or list its file "
            "in tests/conftest.py")

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shards():
    """Two in-process parameter-server shards; yields their addresses (tests/ps has its own
    fixture of the same name, yielding the servers too)."""
    from stratagem.ps.server import start_local_shards

    servers, addrs = start_local_shards(2)
    yield addrs
    for s in servers:
        s.stop(0)
