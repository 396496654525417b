"""A fault-tolerant job across two real network stacks (namespaces behind a bridge,
``stratagem.testing.netns``): ``stratagem run --nproc 2 --nnodes 2 --node-rank i
--master-addr <node 0> --fault-tolerant --ft-token-file T`` in namespace ``i``, one launcher per
node. A worker of node 1 is SIGKILLed mid-run: node 1's launcher restarts it alone, it heals
from a peer, the survivors are never restarted, and the four final models are bitwise equal.
While the job runs, every listening socket of each namespace is read: nothing listens on a
wildcard address, everything on the node's own address (node 0: the job store at the master
port, the quorum service at the next one). Skipped where namespaces cannot be built, as
``test_multinode.py`` is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ft_pids, ft_progress

pytest.importorskip("torchft")

from safetensors.torch import load_file  # noqa: E402
from test_multinode import _env, _skip_unless_netns, _stop  # noqa: E402

from stratagem.testing.netns import Topology, listening_sockets  # noqa: E402

SCRIPT = str(Path(__file__).parent / "ft_scripts" / "train_ft.py")
NPROC, NNODES, PORT, STEPS = 2, 2, 29610, 50


def _v4(address: str) -> str:
    """``address``, with an IPv4-mapped IPv6 address (``::ffff:a4f:a``) as IPv4."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else str(ip)


def _token(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("multinode-ft-test-token-0123456789abcdef")
    return path


@pytest.mark.timeout(180)
def test_sigkilled_worker_on_node_1_is_restarted_by_its_node_and_heals(tmp_path: Path) -> None:
    _skip_unless_netns()
    token = _token(tmp_path / "ft.token")
    out = tmp_path / "out"
    out.mkdir()
    with Topology(NNODES, subnet="10.79.0", bridge_ip=False) as topo:
        procs: list[subprocess.Popen[str]] = []
        logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(NNODES)]  # noqa: SIM115
        try:
            for node in range(NNODES):
                # --min-replicas 4: the survivors wait for the replacement, so the heal
                # always happens before the job ends (the shrinking quorum is
                # test_ft_processes.py's and test_ft.py's).
                cmd = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(NPROC),
                       "--nnodes", str(NNODES), "--node-rank", str(node),
                       "--master-addr", topo.node_ip(0), "--master-port", str(PORT),
                       "--fault-tolerant", "--min-replicas", str(NPROC * NNODES),
                       "--ft-token-file", str(token), SCRIPT, "--out", str(out),
                       "--steps", str(STEPS), "--step-sleep", "0.02", "--timeout", "60"]
                procs.append(topo.popen(node, cmd, env=_env(),
                                        stdout=logs[node], stderr=subprocess.STDOUT,
                                        text=True))
            seen: list[set[tuple[str, int]]] = [set() for _ in range(NNODES)]

            spaces = [f"net:[{os.stat(f'/run/netns/{topo.netns(i)}').st_ino}]"
                      for i in range(NNODES)]

            def inside(pid: int, node: int) -> bool:
                try:
                    return os.readlink(f"/proc/{pid}/ns/net") == spaces[node]
                except OSError:
                    return False

            def look() -> None:
                # A launcher's table only once it is inside its namespace (between fork and
                # `ip netns exec`'s setns it still reads the root namespace's), never after.
                for node, p in enumerate(procs):
                    if inside(p.pid, node):
                        table = set(listening_sockets(p.pid).values())
                        if inside(p.pid, node):
                            seen[node] |= table

            def output() -> str:
                text = []
                for node, f in enumerate(logs):
                    f.flush()
                    f.seek(0)
                    text.append(f"---- node {node}\n{f.read()[-3000:]}")
                return "\n".join(text)

            slots = range(NPROC * NNODES)
            deadline = time.monotonic() + 120
            while min(ft_progress(out, s) for s in slots) < 10:
                assert all(p.poll() is None for p in procs), output()
                assert time.monotonic() < deadline, "no progress to step 10:\n" + output()
                look()
                time.sleep(0.1)
            survivors = {s: ft_pids(out, s) for s in (0, 1, 2)}
            victim = 3  # node 1's second worker
            os.kill(ft_pids(out, victim)[-1], signal.SIGKILL)
            while any(p.poll() is None for p in procs):
                assert time.monotonic() < deadline + 60, "the job did not finish:\n" + output()
                look()
                time.sleep(0.1)
            text = output()
            assert [p.returncode for p in procs] == [0, 0], text
        finally:
            _stop(procs)
            for f in logs:
                f.close()

    assert "restarting worker 3 alone" in text, text
    assert token.read_text().startswith("multinode-ft-test")  # the user's file: not removed
    assert {s: ft_pids(out, s) for s in (0, 1, 2)} == survivors  # never restarted
    assert len(ft_pids(out, victim)) == 2, text  # restarted once, by node 1's launcher
    stats = (out / f"acc.{victim}").read_text()
    assert "heals=1" in stats and "world=4" in stats, stats
    states = [load_file(out / f"final.{s}.safetensors") for s in slots]
    for slot, state in enumerate(states[1:], 1):
        assert state.keys() == states[0].keys()
        for k, v in states[0].items():
            assert (v == state[k]).all(), (slot, k)
    # Nothing listens on a wildcard address or on loopback; everything on the node's own
    # address: node 0 the store and the quorum service among them.
    for node in range(NNODES):
        assert seen[node], f"no listening socket seen on node {node}"
        # An IPv6 socket bound to the v4-mapped form of the address (gRPC's, the quorum
        # service's) listens on that one address too.
        assert {_v4(a) for a, _ in seen[node]} == {topo.node_ip(node)}, (node, seen[node])
    assert {(topo.node_ip(0), PORT), (topo.node_ip(0), PORT + 1)} <= {
        (_v4(a), p) for a, p in seen[0]}, seen[0]
    assert not {p for _, p in seen[1]} & {PORT, PORT + 1}, seen[1]


# ----------------------------------------------------------------- refusals (no job starts)

_MULTI = ["run", "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
          "--master-addr", "127.0.0.1", "--master-port", "29610", "--fault-tolerant"]


def test_refusals_name_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stratagem import cli

    def refused(argv: list[str]) -> str:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Fix:" in err, err  # one line, naming the fix
        return err

    assert "--ft-token-file" in refused([*_MULTI, "t.py"])
    token = _token(tmp_path / "ft.token")
    loose = tmp_path / "loose.token"
    loose.write_text("x" * 40)
    loose.chmod(0o644)
    assert "chmod 600" in refused([*_MULTI, "--ft-token-file", str(loose), "t.py"])
    link = tmp_path / "link.token"
    link.symlink_to(token)
    assert "symbolic link" in refused([*_MULTI, "--ft-token-file", str(link), "t.py"])
    short = _token(tmp_path / "short.token")
    short.write_text("abc")
    assert "shorter than 16" in refused([*_MULTI, "--ft-token-file", str(short), "t.py"])
    assert "on one node the launcher makes" in refused(
        ["run", "--nproc", "2", "--fault-tolerant", "--ft-token-file", str(token), "t.py"])
    assert "--nnodes MIN:MAX" in refused(
        ["run", "--nproc", "2", "--nnodes", "1:2", "--node-rank", "1", "--master-addr",
         "127.0.0.1", "--fault-tolerant", "--ft-token-file", str(token), "t.py"])
    assert "never spans nodes" in refused(
        [*_MULTI, "--replica-group-size", "3", "--ft-token-file", str(token), "t.py"])
    assert "more than the job's 4 replica groups" in refused(
        [*_MULTI, "--min-replicas", "5", "--ft-token-file", str(token), "t.py"])
    top = [a if a != "29610" else "65535" for a in _MULTI]
    assert "the next port" in refused([*top, "--ft-token-file", str(token), "t.py"])


def test_node_places_its_servers_on_the_route_to_the_master(tmp_path: Path) -> None:
    from stratagem import cli

    token = _token(tmp_path / "ft.token")
    args = cli.build_parser().parse_args(
        [*_MULTI, "--replica-group-size", "2", "--ft-token-file", str(token), "t.py"])
    node = cli._ft_node(args, 2)
    assert (node.node_rank, node.nnodes, node.group) == (1, 2, 2)
    assert (node.master_addr, node.master_port, node.quorum_port) == ("127.0.0.1", 29610, 29611)
    assert node.host == "127.0.0.1"  # the local address that routes to the master
    assert node.token_file == str(token)
