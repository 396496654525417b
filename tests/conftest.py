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
_SLOW_FILES_FIRST = ("test_sharded.py", "test_sharded_hierarchical.py", "test_ft_processes.py",
                     "test_ft_group_processes.py", "test_chaos.py", "test_resume.py", "test_multinode.py", "test_cli.py",
                     "test_examples.py", "test_hierarchical.py", "test_launch.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(_SLOW_FILES_FIRST)}
    # A stable sort: the order inside a file, and of the other files, is unchanged.
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


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
