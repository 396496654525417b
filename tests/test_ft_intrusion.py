"""Intrusion: a separate process without the job's secret, running torchft's own Manager,
against a fault-tolerant job (``tests/ft_scripts/intruder.py``).

It never enters a quorum the replicas accept, the store it names never receives a
connection from them, its values never reach a committed step (the replicas' results equal
a run without it, bitwise), and training stalls at most the fault-tolerant
``quorum_timeout``. The same for forged commit votes sent to a replica group of two
processes, and for an intruder on a third node (network namespaces) against a two-node job.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402

from stratagem.testing.ft import run_replicas  # noqa: E402

INTRUDER = str(Path(__file__).parent / "ft_scripts" / "intruder.py")
QUORUM_TIMEOUT = 10.0


class Honeypot:
    """A listening socket that counts the connections it receives."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _train(comm: Any, steps: int, sleep: float, hook: Any = None) -> tuple[float, int]:
    if hook is not None:
        hook(comm)
    total = torch.zeros(1, dtype=torch.float64)
    for step in range(steps):
        comm.begin()
        value = torch.tensor([float(comm.slot + 1) * (step + 1)], dtype=torch.float64)
        comm.all_reduce(value)
        if comm.commit():
            total += value
        time.sleep(sleep)
    return float(total.item()), comm.failed_steps


def _intruder(mode: str, out: Path, **kw: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, INTRUDER, mode, "--out", str(out), "--ready", f"{out}.ready"]
    for k, v in kw.items():
        cmd += [f"--{k}", v]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _await_attack(proc: subprocess.Popen[bytes], out: Path, timeout: float = 90.0) -> float:
    """Wait (bounded) until the intruder has made its first attempt; the seconds waited."""
    t0 = time.monotonic()
    while not Path(f"{out}.ready").exists():
        assert proc.poll() is None, f"the intruder exited ({proc.returncode}) before attacking"
        assert time.monotonic() - t0 < timeout, "the intruder did not start attacking"
        time.sleep(0.05)
    return time.monotonic() - t0


def _report(proc: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    """Stop the intruder (it writes its report after every attempt) and read it."""
    proc.terminate()
    proc.wait(timeout=30)
    return json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_an_intruder_without_the_secret_never_joins_and_changes_nothing(tmp_path: Path) -> None:
    steps, sleep = 30, 0.1
    t0 = time.monotonic()
    clean = run_replicas(_train, 2, args=(steps, sleep), quorum_every=1,
                         quorum_timeout=QUORUM_TIMEOUT, deadline=120)
    clean_s = time.monotonic() - t0

    honeypot = Honeypot()
    out = tmp_path / "intruder.json"
    procs: list[subprocess.Popen[bytes]] = []

    def attack(service: Any) -> None:
        # It found the quorum service's port (as /proc/net/tcp shows any local user); it is
        # asking before the replicas start.
        procs.append(_intruder("join", out, lighthouse=service.address(),
                               honeypot=honeypot.address))
        waited.append(_await_attack(procs[-1], out))

    services: list[Any] = []
    waited: list[float] = []
    try:
        t0 = time.monotonic()
        attacked = run_replicas(_train, 2, args=(steps, sleep), quorum_every=1,
                                quorum_timeout=QUORUM_TIMEOUT, deadline=240,
                                on_service=lambda s: (services.append(s), attack(s)))
        attacked_s = time.monotonic() - t0 - sum(waited)
        report = _report(procs[0], out)
    finally:
        for p in procs:
            p.kill()
        honeypot.close()
    assert report["attempts"] >= 2 and report["admitted"] == 0, report
    assert services[0]._server.refused >= 1
    assert honeypot.connections == 0  # no replica ever connected to the store it named
    assert attacked == clean  # bitwise: its values reached no committed step
    assert all(failed == 0 for _, failed in attacked)
    assert attacked_s <= clean_s + QUORUM_TIMEOUT, (attacked_s, clean_s)


@pytest.mark.timeout(240)
def test_forged_commit_votes_do_not_reach_a_replica_group_of_two(tmp_path: Path) -> None:
    steps, sleep = 30, 0.1
    t0 = time.monotonic()
    clean = run_replicas(_train, 2, args=(steps, sleep), group_size=2,
                         quorum_timeout=QUORUM_TIMEOUT, deadline=120)
    clean_s = time.monotonic() - t0

    out = tmp_path / "votes.json"
    managers: dict[int, str] = {}
    procs: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()

    waited: list[float] = []

    def publish(comm: Any) -> None:
        if comm.replica_group_rank == 0:
            with lock:
                managers[comm.replica] = comm._pg.claim()["address"]
                if len(managers) == 2:  # both groups' manager servers: attack them
                    procs.append(_intruder("vote", out, managers=",".join(managers.values())))
                    # Training starts once it is voting (the other processes wait for this
                    # one at their first quorum).
                    waited.append(_await_attack(procs[-1], out))

    try:
        t0 = time.monotonic()
        attacked = run_replicas(_train, 2, args=(steps, sleep, publish), group_size=2,
                                quorum_timeout=QUORUM_TIMEOUT, deadline=240)
        attacked_s = time.monotonic() - t0 - sum(waited)
        report = _report(procs[0], out)
    finally:
        for p in procs:
            p.kill()
    assert report["attempts"] >= 16, report  # it did send forged votes, False and True
    assert attacked == clean  # bitwise; and no step failed for a forged False
    assert all(failed == 0 for _, failed in attacked)
    assert attacked_s <= clean_s + QUORUM_TIMEOUT, (attacked_s, clean_s)


@pytest.mark.timeout(300)
def test_an_intruder_on_another_node_never_joins_a_two_node_job(tmp_path: Path) -> None:
    """Two nodes (namespaces) run one job with ``--ft-token-file``; a third runs the
    intruder against node 0's quorum service, naming a store on its own address."""
    from test_multinode import _env, _skip_unless_netns, _stop
    from test_multinode_ft import SCRIPT, _token

    from stratagem.testing.netns import Topology

    _skip_unless_netns()
    token = _token(tmp_path / "ft.token")
    out = tmp_path / "out"
    out.mkdir()
    port, nodes, steps = 29640, 2, 100
    with Topology(nodes + 1, subnet="10.81.0", bridge_ip=False) as topo:
        procs: list[subprocess.Popen[Any]] = []
        logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(nodes)]  # noqa: SIM115
        report_path = tmp_path / "intruder.json"
        stop = tmp_path / "honeypot.stop"
        honeypot_script = (  # counts connections until the stop file appears (at most 120 s)
            "import os,socket,sys,json,time\n"
            "s=socket.create_server((sys.argv[1],0));s.settimeout(0.2)\n"
            "print(s.getsockname()[1],flush=True);n=0;end=time.time()+float(sys.argv[2])\n"
            "while time.time()<end and not os.path.exists(sys.argv[4]):\n"
            "    try: c,_=s.accept();n+=1;c.close()\n"
            "    except OSError: pass\n"
            "open(sys.argv[3],'w').write(json.dumps({'connections':n}))\n")
        hp_out = tmp_path / "honeypot.json"
        try:
            intruder_ip = topo.node_ip(nodes)
            honeypot = topo.popen(nodes, [sys.executable, "-c", honeypot_script, intruder_ip,
                                          "120", str(hp_out), str(stop)], env=_env(),
                                  stdout=subprocess.PIPE, text=True)
            procs.append(honeypot)
            hp_port = int(honeypot.stdout.readline())
            for node in range(nodes):
                cmd = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", "1",
                       "--nnodes", str(nodes), "--node-rank", str(node),
                       "--master-addr", topo.node_ip(0), "--master-port", str(port),
                       "--fault-tolerant", "--min-replicas", str(nodes),
                       "--ft-token-file", str(token), SCRIPT, "--out", str(out),
                       "--steps", str(steps), "--step-sleep", "0.1", "--timeout", "60"]
                procs.append(topo.popen(node, cmd, env=_env(), stdout=logs[node],
                                        stderr=subprocess.STDOUT, text=True))
            intruder = topo.popen(nodes, [
                sys.executable, INTRUDER, "join", "--out", str(report_path),
                "--ready", f"{report_path}.ready",
                "--lighthouse", f"http://{topo.node_ip(0)}:{port + 1}",
                "--honeypot", f"{intruder_ip}:{hp_port}", "--host", intruder_ip],
                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(intruder)
            jobs = procs[1:nodes + 1]
            deadline = time.monotonic() + 180
            while any(p.poll() is None for p in jobs):
                assert time.monotonic() < deadline, "the job did not finish"
                time.sleep(0.2)
            assert Path(f"{report_path}.ready").exists(), "the intruder never attacked"
            intruder.terminate()
            intruder.wait(timeout=30)
            text = ""
            for f in logs:
                f.flush()
                f.seek(0)
                text += f.read()[-3000:]
            assert [p.returncode for p in jobs] == [0, 0], text
            stop.write_text("")
            honeypot.wait(timeout=30)
        finally:
            _stop(procs)
            for f in logs:
                f.close()
    report = json.loads(report_path.read_text())
    assert report["attempts"] >= 2 and report["admitted"] == 0, report
    assert json.loads(hp_out.read_text())["connections"] == 0
    from safetensors.torch import load_file

    states = [load_file(out / f"final.{s}.safetensors") for s in range(nodes)]
    for k, v in states[0].items():
        assert (v == states[1][k]).all(), k
