"""Real multi-node runs, each "node" a network namespace behind a bridge.

Every test builds its own namespaces (``stratagem.testing.netns``, names unique to this
process) and runs ``stratagem run --nproc 2 --nnodes 2 --node-rank i --master-addr <node 0>``
in namespace ``i``: two torchrun agents, four workers, the store on node 0's address, gloo on
each node's veth (derived from the route to the master address). The two processes of a node
share its namespace, so their traffic stays on that node; what crosses between nodes is counted
on the veths. Checks: the node environment each worker saw, the consensus model equal on every
rank (and different from the initial one), and inter-node bytes at least what the strategy's
synchronisation must send. Skipped with the reason where namespaces cannot be built (not root,
no iproute2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stratagem.testing.netns import NetnsUnavailable, Topology, netns_unavailable_reason

SRC = str(Path(__file__).resolve().parent.parent / "src")
JOB = str(Path(__file__).resolve().parent / "multinode_job.py")
NPROC, NNODES, PORT = 2, 2, 29500
#: fp32 bytes of the job's model (16*32 + 32 + 32*4 + 4 parameters).
PARAM_BYTES = 4 * (16 * 32 + 32 + 32 * 4 + 4)

_REASON: list[str | None] = []


def _skip_unless_netns() -> None:
    if not _REASON:
        _REASON.append(netns_unavailable_reason())
    if _REASON[0] is not None:
        pytest.skip(f"multi-node tests need network namespaces: {_REASON[0]}")


@pytest.fixture
def topo() -> Iterator[Topology]:
    """Three namespaces (two worker nodes and one for PS shards) on a bridge; always removed."""
    _skip_unless_netns()
    t = Topology(3, subnet="10.78.0", bridge_ip=False)
    with t:
        yield t


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GLOO_", "NCCL_", "STRATAGEM_", "TORCHELASTIC_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def run_nodes(topo: Topology, out: Path, strategy: str, strategy_args: list[str], steps: int,
              *, env: dict[str, str] | None = None, timeout: float = 60.0,
              then: tuple[tuple[str, int, dict[str, Any]], ...] = ()
              ) -> list[dict[str, Any]]:
    """``stratagem run`` on nodes 0 and 1; returns the workers' reports in rank order. Each
    ``then`` entry (name, steps, arguments) is trained afterwards in the same job (see
    ``multinode_job.py``); read its reports with :func:`reports_of`."""
    out.mkdir(exist_ok=True)
    procs = []
    for node in range(NNODES):
        cmd = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(NPROC),
               "--nnodes", str(NNODES), "--node-rank", str(node),
               "--master-addr", topo.node_ip(0), "--master-port", str(PORT),
               "--strategy", strategy]
        for arg in strategy_args:
            cmd += ["--strategy-arg", arg]
        more = [str(x) if not isinstance(x, dict) else json.dumps(x) for t in then for x in t]
        procs.append(topo.popen(node, [*cmd, JOB, str(out), str(steps), *more],
                                env=_env(**(env or {})),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop(procs)
                text = p.communicate()[0]
                outputs.append(text)
                raise AssertionError(f"the job did not finish within {timeout:g} s:\n"
                                     + "\n----\n".join(o[-2000:] for o in outputs)) from None
            outputs.append(text)
    finally:
        _stop(procs)
    for node, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}:\n{text[-4000:]}"
    return reports_of(out)


def reports_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(NPROC * NNODES)]


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in state.items()}


def check_consensus(reports: list[dict[str, Any]], topo: Topology) -> None:
    """Every worker saw its node's torchrun environment and holds the same trained model."""
    for rank, r in enumerate(reports):
        node, local = divmod(rank, NPROC)
        assert r["env"]["GROUP_RANK"] == str(node) and r["env"]["LOCAL_RANK"] == str(local), r
        assert r["env"]["LOCAL_WORLD_SIZE"] == str(NPROC) and r["env"]["WORLD_SIZE"] == "4"
        # gloo was pinned to the interface holding the node's address (derived by the CLI).
        assert r["env"]["GLOO_SOCKET_IFNAME"] == topo.node_ifname(node), r["env"]
        torch.testing.assert_close(_tensors(r["final"]), _tensors(reports[0]["final"]),
                                   rtol=0, atol=1e-6, msg=f"rank {rank} differs from rank 0")
        # Nothing of the job listens on every interface; the store (node 0) and gloo
        # listen on the node's own address only (the node's namespace also has loopback).
        wild = [a for a in r["listening"] if a[0] in ("0.0.0.0", "::")]
        assert not wild, (rank, r["listening"])
        assert {a for a, _ in r["listening"]} <= {topo.node_ip(node), "127.0.0.1"}, r
        assert any(a == topo.node_ip(node) for a, _ in r["listening"]), r  # gloo was found
    store = [p for a, p in reports[0]["listening"] if p == PORT]
    assert store == [PORT], ("node 0's store not found on its address", reports[0]["listening"])
    moved = max((_tensors(reports[0]["final"])[k] - _tensors(reports[0]["initial"])[k])
                .abs().max().item() for k in reports[0]["final"])
    assert moved > 1e-3, "training did not change the model"


def _crossed(topo: Topology, before: list[tuple[int, int]], node: int) -> tuple[int, int]:
    sent, received = topo.link_bytes(node)
    return sent - before[node][0], received - before[node][1]


@pytest.mark.timeout(180)
def test_mirrored_diloco_and_hierarchical_across_two_namespaces(topo: Topology,
                                                                tmp_path: Path) -> None:
    # One job, three strategies in turn (each built after the previous one is closed): a job
    # start-up costs ~15-20 s here. Node 0's bytes per strategy are counted inside its
    # namespace by the job, between two collectives; the whole job's on the bridge side.
    before = [topo.link_bytes(i) for i in range(3)]
    steps = 8
    out = tmp_path / "out"
    reports = run_nodes(topo, out, "mirrored", [], steps, timeout=120.0,
                        then=(("diloco", 8, {"period": 4, "outer_lr": 0.7,
                                             "outer_momentum": 0.9}),
                              ("hierarchical", 8, {"inner": "mirrored", "outer": "diloco",
                                                   "outer_period": 4})))
    check_consensus(reports, topo)
    mirrored = reports[0]["link_bytes"]
    sent, received = mirrored
    # Each step all-reduces the gradients across the nodes: at least the gradient bytes leave
    # and enter node 0 every step (heartbeats only add to it).
    assert sent >= steps * PARAM_BYTES and received >= steps * PARAM_BYTES, (sent, received)
    whole = _crossed(topo, before, 0)
    assert whole[0] >= sent and whole[1] >= received, (whole, mirrored)
    assert topo.link_bytes(2) == before[2] or _crossed(topo, before, 2)[0] < 2000  # idle node

    diloco = reports_of(out / "diloco")
    check_consensus(diloco, topo)
    sent, received = diloco[0]["link_bytes"]
    # Two outer steps, each an all-reduce of the pseudo-gradient across the nodes; far less
    # than Mirrored's every step.
    assert sent >= 2 * PARAM_BYTES and received >= 2 * PARAM_BYTES, (sent, received)
    assert sent < mirrored[0], (sent, mirrored)
    for r in diloco:
        assert r["metrics"]["steps"] == 8, r["metrics"]

    hierarchical = reports_of(out / "hierarchical")
    check_consensus(hierarchical, topo)
    sent, received = hierarchical[0]["link_bytes"]
    # Two outer steps: at least the pseudo-gradient crosses each way (node 0 holds 2 of them,
    # relayed: half the model per local rank), and far less than Mirrored's per-step sync.
    assert sent >= PARAM_BYTES and received >= PARAM_BYTES, (sent, received)
    assert sent < mirrored[0], (sent, mirrored)
    for r in hierarchical:
        m = r["metrics"]
        assert m["intra_node_bytes_sent"] > 0 and m["inter_node_bytes_sent"] > 0, m
        # Mirrored inside the node every step, DiLoCo across nodes twice.
        assert m["inter_node_bytes_sent"] < m["intra_node_bytes_sent"], m


_NO_TOKEN_PROBE = """
import sys, grpc
from stratagem.ps import wire
with grpc.insecure_channel(sys.argv[1]) as ch:
    try:
        ch.unary_unary(wire.METHOD)(wire.encode("health"), timeout=10)
    except grpc.RpcError as e:
        print(e.code().name)
"""


@pytest.mark.timeout(120)
def test_ps_shard_on_a_third_namespace_with_a_token(topo: Topology, tmp_path: Path) -> None:
    token = tmp_path / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("multinode-test-token-0123456789")
    port_file = tmp_path / "ps.port"
    shard = topo.popen(2, [sys.executable, "-m", "stratagem.cli", "ps", "--host", topo.node_ip(2),
                           "--port", "0", "--port-file", str(port_file), "--token-file",
                           str(token)], env=_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert shard.poll() is None, shard.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the shard did not start within 30 s"
            time.sleep(0.05)
        address = f"{topo.node_ip(2)}:{int(port_file.read_text())}"
        before = [topo.link_bytes(i) for i in range(3)]
        reports = run_nodes(topo, tmp_path / "out", "ps-sync", [], 6,
                            env={"STRATAGEM_PS_ADDRS": address,
                                 "STRATAGEM_PS_TOKEN_FILE": str(token),
                                 # Namespaces on this machine: a network we trust.
                                 "STRATAGEM_PS_ALLOW_PLAINTEXT": "1"})
        check_consensus(reports, topo)  # eval_model is the global model, read from the shard
        assert {r["env"]["STRATAGEM_PS_ADDRS"] for r in reports} == {address}
        # Every worker pushes gradients to and pulls parameters from the third namespace.
        to_ps = _crossed(topo, before, 2)[1]
        assert to_ps >= 4 * 6 * PARAM_BYTES, to_ps
        # The same shard, reached from node 0 without the token, refuses on the metadata alone.
        probe = topo.popen(0, [sys.executable, "-c", _NO_TOKEN_PROBE, address], env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text = probe.communicate(timeout=60)[0]
        assert probe.returncode == 0 and "UNAUTHENTICATED" in text, text[-2000:]
    finally:
        _stop([shard])


# ----------------------------------------------------------------- the helper itself


def _names() -> tuple[set[str], set[str]]:
    netns = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               timeout=30).stdout.split())
    return netns, set(os.listdir("/sys/class/net"))


def test_topology_names_are_unique_and_a_failed_up_leaves_nothing() -> None:
    _skip_unless_netns()
    a, b = Topology(2, bridge_ip=False), Topology(2, bridge_ip=False)
    assert a.prefix != b.prefix and len(a.prefix) <= 6
    bad = Topology(2, subnet="10.78.300", bridge_ip=False)  # 10.78.300.10 is no address
    with pytest.raises(NetnsUnavailable, match=r"10\.78\.300\.10"):
        bad.up()
    netns, links = _names()
    mine = {bad.netns(0), bad.netns(1)} | {bad.bridge, bad.node_ifname(0), f"{bad.prefix}v0"}
    assert not mine & (netns | links), mine & (netns | links)


def test_unavailable_reason_names_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns_unavailable_reason() == (
        "network namespaces need root (CAP_NET_ADMIN); running as uid 1000")
