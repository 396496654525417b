"""A single-node job listens on loopback only.

The real-process tests read the listening TCP sockets of the whole job while it runs
(``/proc/net/tcp`` and ``/proc/net/tcp6`` joined with ``/proc/<pid>/fd``: the launcher or
torchrun's agent, every worker, the parameter-server shard) and assert that none listens on a
non-loopback address — torch's own ``TCPStore`` listens on every interface (``*:port``).
They also check that the sockets they expect (the store, one per worker, the shard) were
found, so an empty reading cannot pass.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from stratagem import cli
from stratagem._rendezvous import (
    bound_tcp_store,
    interface_of_address,
    interface_towards,
    is_loopback,
    is_wildcard,
    loopback_env,
    loopback_tcp_store,
)
from stratagem.launcher import launch, worker_env
from stratagem.testing.netns import listening_sockets

SRC = str(Path(cli.__file__).resolve().parent.parent)

# One job body for every launcher: join through Comm.from_env (the store, heartbeats, gloo),
# all-reduce once, report, and stay up until the test has read the sockets.
JOB = """
import json, os, sys, time
from pathlib import Path
import torch
import stratagem as sg

def job(tmp):
    comm = sg.Comm.from_env(timeout=30)
    t = torch.ones(1)
    comm.all_reduce(t)
    report = {"pid": os.getpid(), "master_port": int(os.environ["MASTER_PORT"]),
              "ps": os.environ.get("STRATAGEM_PS_ADDRS"), "sum": t.item(),
              "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    Path(tmp, f"ready{comm.rank}.tmp").write_text(json.dumps(report))
    os.replace(Path(tmp, f"ready{comm.rank}.tmp"), Path(tmp, f"ready{comm.rank}"))
    deadline = time.monotonic() + 60
    while not Path(tmp, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    comm.close()
    return t.item()

if __name__ == "__main__":
    job(sys.argv[1])
"""


def _launched_job(tmp: str) -> float:
    """The sg.launch worker: the same body as JOB."""
    namespace: dict[str, Any] = {"__name__": "job"}
    exec(compile(JOB, "job", "exec"), namespace)
    return float(namespace["job"](tmp))


# ----------------------------------------------------------------- reading the sockets
def _listeners(pids: set[int], ignore: frozenset[int] = frozenset()
               ) -> dict[int, list[tuple[str, int]]]:
    """pid -> [(address, port)] of its listening TCP sockets (but the inodes in ``ignore``)."""
    table = listening_sockets()
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in table and inode not in ignore:
                    out.setdefault(pid, []).append(table[inode])
    return out


def _descendants(root: int) -> set[int]:
    children: dict[int, set[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, set()).add(int(d.name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _wait_ready(tmp: Path, nprocs: int, proc: subprocess.Popen[str] | None = None,
                timeout: float = 90) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not all((tmp / f"ready{r}").exists() for r in range(nprocs)):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise AssertionError(f"the job was not ready within {timeout:g} s")
        time.sleep(0.1)
    return [json.loads((tmp / f"ready{r}").read_text()) for r in range(nprocs)]


def _non_loopback(listeners: dict[int, list[tuple[str, int]]],
                  names: dict[int, str] | None = None) -> list[str]:
    return [f"pid {pid} ({(names or {}).get(pid) or _cmdline(pid)}) listens on {addr}:{port}"
            for pid, socks in listeners.items() for addr, port in socks
            if not is_loopback(addr)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:120]
    except OSError:
        return "?"


def _ports(listeners: dict[int, list[tuple[str, int]]], pid: int) -> set[int]:
    return {port for _, port in listeners.get(pid, [])}


# ----------------------------------------------------------------- fast checks


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.0.2.2", "fd00::2", "example.org", ""):
        assert not is_loopback(host), host


def test_loopback_store_binds_loopback_only_and_names_a_busy_port() -> None:
    store = loopback_tcp_store("127.0.0.1", 0, timeout=timedelta(seconds=5))
    try:
        listeners = _listeners({os.getpid()})
        mine = [a for a, p in listeners.get(os.getpid(), []) if p == store.port]
        assert mine == ["127.0.0.1"], listeners
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=5))
        client.set("k", "v")
        assert store.get("k") == b"v"
        with pytest.raises(OSError, match=rf"EADDRINUSE.*127\.0\.0\.1:{store.port}.*--master-port"):
            loopback_tcp_store("127.0.0.1", store.port, timeout=timedelta(seconds=5))
        del client
    finally:
        del store
    with pytest.raises(ValueError, match=r"loopback host.*got '0\.0\.0\.0'"):
        loopback_tcp_store("0.0.0.0", 0)


def test_bound_store_listens_on_its_address_only_and_refuses_wildcards() -> None:
    """A multi-node store listens on the master address alone (127.0.0.2 stands in
    for node 0's private address: specific, but not the 127.0.0.1 of the loopback path)."""
    store = bound_tcp_store("127.0.0.2", 0, timeout=timedelta(seconds=5))
    try:
        mine = [a for a, p in _listeners({os.getpid()}).get(os.getpid(), []) if p == store.port]
        assert mine == ["127.0.0.2"]
    finally:
        del store
    for host in ("0.0.0.0", "::", ""):
        assert is_wildcard(host)
        with pytest.raises(ValueError, match=r"must listen on one address.*--master-addr"):
            bound_tcp_store(host, 0)
    # 192.0.2.0/24 is TEST-NET-1, documentation only: no interface here holds it.
    with pytest.raises(OSError, match=r"EADDRNOTAVAIL.*192\.0\.2\.254.*--node-rank 0"):
        bound_tcp_store("192.0.2.254", 0, timeout=timedelta(seconds=5))


def test_interface_lookup() -> None:
    if not loopback_env({}):
        pytest.skip("no loopback interface named lo/lo0 on this machine")
    assert interface_of_address("127.0.0.1") == "lo"
    assert interface_of_address("192.0.2.254") is None and interface_of_address("::1") is None
    assert interface_towards("127.0.0.1") == ("127.0.0.1", "lo")


@pytest.mark.parametrize(("argv", "message"), [
    (["--master-addr", "10.0.0.1"],
     r"--master-addr 10\.0\.0\.1 is not a loopback address.*single-node.*Fix: omit"),
    (["--iface", "lo"], r"--iface lo is for jobs on several nodes"),
    (["--nnodes", "2", "--node-rank", "0"], r"--nnodes 2 needs --master-addr.*got None"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "0.0.0.0"],
     r"needs --master-addr.*got '0\.0\.0\.0'.*never on every interface"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1"], r"needs --node-rank between 0 and 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
     r"needs --node-rank between 0 and 1 \(got 2\)"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.254"],
     r"--node-rank 0 hosts.*192\.0\.2\.254.*no interface of this machine"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--iface", "nosuch9"],
     r"--iface nosuch9: no such interface"),
])
def test_run_refuses_exposed_or_incomplete_addresses(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--nproc", "2", *argv, "t.py"]) == 2
    assert re.search(message, capsys.readouterr().err, re.S), argv


def test_multi_node_run_pins_collectives_to_the_route_to_the_master() -> None:
    """The interface comes from the route to --master-addr (loopback here, standing
    in for the private network), a user's GLOO_SOCKET_IFNAME is kept, --iface wins over it."""
    if not loopback_env({}):
        pytest.skip("no loopback interface named lo/lo0 on this machine")
    parser = cli.build_parser()
    multi = ["run", "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
             "--master-addr", "127.0.0.1"]
    env: dict[str, str] = {}
    assert cli.network_env(parser.parse_args([*multi, "t.py"]), env) is None
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    env = {"GLOO_SOCKET_IFNAME": "eth9"}
    assert cli.network_env(parser.parse_args([*multi, "t.py"]), env) is None
    assert env == {"GLOO_SOCKET_IFNAME": "eth9", "NCCL_SOCKET_IFNAME": "lo"}
    assert cli.network_env(parser.parse_args([*multi, "--iface", "lo", "t.py"]), env) is None
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_worker_env_pins_collectives_to_loopback_unless_set() -> None:
    if not loopback_env({}):
        pytest.skip("no loopback interface named lo/lo0 on this machine")
    env = worker_env(rank=0, world_size=2, master_port=1234, base={})
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == loopback_env({})[
        "GLOO_SOCKET_IFNAME"]
    mine = worker_env(rank=0, world_size=2, master_port=1234, base={"GLOO_SOCKET_IFNAME": "eth9"})
    assert "GLOO_SOCKET_IFNAME" not in mine and "NCCL_SOCKET_IFNAME" in mine
    remote = worker_env(rank=0, world_size=2, master_port=1234, master_addr="10.0.0.1", base={})
    assert "GLOO_SOCKET_IFNAME" not in remote and "NCCL_SOCKET_IFNAME" not in remote


def test_run_uses_the_loopback_torchrun_for_single_node_only() -> None:
    parser = cli.build_parser()
    single = cli.torchrun_command(parser.parse_args(["run", "--nproc", "2", "t.py"]))
    assert single[1:3] == ["-m", "stratagem._torchrun"]
    assert single[single.index("--master-addr") + 1] == "127.0.0.1"
    # Several nodes with the static rendezvous also bind the store themselves (on
    # --master-addr only); the c10d backend's store stays torch's (a warning says so).
    multi = cli.torchrun_command(parser.parse_args(
        ["run", "--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
         "t.py"]))
    assert multi[1:3] == ["-m", "stratagem._torchrun"]
    for argv in (["--master-addr", "10.0.0.1"], ["--rdzv-backend", "c10d"]):
        cmd = cli.torchrun_command(parser.parse_args(["run", "--nproc", "2", *argv, "t.py"]))
        assert cmd[1:3] == ["-m", "torch.distributed.run"], argv
    help_text = subprocess.run([sys.executable, "-m", "stratagem.cli", "run", "--help"],
                               capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": SRC}).stdout
    assert "network exposure" in help_text and "firewall" in help_text


# ----------------------------------------------------------------- real jobs


@pytest.mark.timeout(150)
def test_sg_launch_listens_on_loopback_only(tmp_path: Path) -> None:
    pytest.importorskip("stratagem.ps.server")
    me = os.getpid()
    before = frozenset(listening_sockets())  # the test process's own, from earlier tests
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(launch(_launched_job, nprocs=2, num_ps=1, args=(str(tmp_path),),
                              timeout=120))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        reports = _wait_ready(tmp_path, 2)
        pids = _descendants(me)
        listeners = _listeners(pids | {me}, ignore=before)
    finally:
        (tmp_path / "go").write_text("")
        thread.join(timeout=60)
    assert not errors, errors
    assert out == [[2.0, 2.0]]
    assert not _non_loopback(listeners), "\n".join(_non_loopback(listeners))
    port = reports[0]["master_port"]
    assert port in _ports(listeners, me), ("the launcher's store was not found", listeners)
    for r in reports:
        assert r["pid"] in pids and _ports(listeners, r["pid"]), ("no gloo listener", r)
        assert r["gloo_ifname"] == "lo"
    shard_port = int(reports[0]["ps"].rsplit(":", 1)[1])
    assert any(shard_port in _ports(listeners, p) for p in pids), ("shard not found", listeners)


def _run_cli_job(tmp_path: Path, argv: list[str], nprocs: int
                 ) -> tuple[list[dict[str, Any]], dict[int, list[tuple[str, int]]],
                            dict[int, str]]:
    """Run ``stratagem ARGV job.py`` and read its listeners while every worker is up;
    returns the workers' reports, the listeners and the job's pids with their command lines."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen([sys.executable, "-m", "stratagem.cli", *argv, str(script),
                             str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reports = _wait_ready(tmp_path, nprocs, proc)
        pids = _descendants(proc.pid) | {proc.pid}
        listeners = _listeners(pids)
        cmdlines = {p: _cmdline(p) for p in pids}
        (tmp_path / "go").write_text("")
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-3000:]
    finally:
        (tmp_path / "go").write_text("")
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return reports, listeners, cmdlines


@pytest.mark.timeout(150)
def test_stratagem_run_listens_on_loopback_only(tmp_path: Path) -> None:
    pytest.importorskip("stratagem.ps.server")
    reports, listeners, pids = _run_cli_job(
        tmp_path, ["run", "--nproc", "2", "--num-ps", "1"], 2)
    assert not _non_loopback(listeners, pids), "\n".join(_non_loopback(listeners, pids))
    agents = [p for p, cmd in pids.items() if "stratagem._torchrun" in cmd]
    assert len(agents) == 1, pids
    assert reports[0]["master_port"] in _ports(listeners, agents[0]), listeners
    for r in reports:
        assert r["sum"] == 2.0 and r["pid"] in pids and _ports(listeners, r["pid"]), r
        assert r["gloo_ifname"] == "lo"
    shard_port = int(reports[0]["ps"].rsplit(":", 1)[1])
    assert any(shard_port in _ports(listeners, p) for p in pids), ("shard not found", listeners)


@pytest.mark.timeout(150)
def test_plain_env_rank0_hosts_a_loopback_store(tmp_path: Path) -> None:
    """No agent store (MASTER_ADDR/PORT set by hand): rank 0's Comm.from_env hosts it."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items()
            if k not in ("TORCHELASTIC_USE_AGENT_STORE", "GLOO_SOCKET_IFNAME")}
    base.update(PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
                WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        reports = _wait_ready(tmp_path, 2, procs[0])
        listeners = _listeners({p.pid for p in procs})
        (tmp_path / "go").write_text("")
        for p in procs:
            output, _ = p.communicate(timeout=60)
            assert p.returncode == 0, output[-3000:]
    finally:
        (tmp_path / "go").write_text("")
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert not _non_loopback(listeners), "\n".join(_non_loopback(listeners))
    assert port in _ports(listeners, procs[0].pid), listeners
    assert reports[0]["sum"] == 2.0


def test_rank0_store_from_env_binds_master_addr_only(monkeypatch):
    """Comm.from_env hosting the store itself (no launcher agent) binds MASTER_ADDR only: an
    address this machine does not hold is an error naming it, never a listener on every
    interface (192.0.2.1 is TEST-NET-1, assigned to nobody)."""
    import errno

    from stratagem.comm import Comm

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "192.0.2.1",
                       "MASTER_PORT": "29577"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(OSError, match="192.0.2.1") as info:
        Comm.from_env(timeout=5)
    assert info.value.errno == errno.EADDRNOTAVAIL


def _ft_replica_listeners(comm: Any) -> list[tuple[str, int]]:
    """A fault-tolerant replica (a thread) takes two Mirrored steps, then reports every TCP
    socket this process listens on (the test's own, every replica's: one process)."""
    import torch

    import stratagem as sg

    strategy = sg.Mirrored(comm=comm)
    model = torch.nn.Linear(4, 2)
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        strategy.backward(model(torch.ones(3, 4)).sum())
        opt.step()
        opt.zero_grad()
    return _listeners({os.getpid()}).get(os.getpid(), [])


@pytest.mark.timeout(120)
def test_fault_tolerant_replicas_listen_on_loopback_only() -> None:
    # Torchft's reconfigurable group hosts its rendezvous store with torch's
    # TCPStore(host_name=<host name>, is_master=True), which listens on every interface;
    # stratagem's group (stratagem.ft.comm.loopback_gloo_group) binds it to loopback.
    pytest.importorskip("torchft")
    from stratagem.testing.ft import run_replicas

    results = run_replicas(_ft_replica_listeners, 2)
    seen = {addr for r in results for addr in r}
    assert seen, "no listening socket found: the check saw nothing"
    exposed = sorted(a for a in seen if not is_loopback(a[0]))
    assert not exposed, exposed
