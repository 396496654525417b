"""A real one-node Slurm cluster for the tests: Debian's ``slurmctld`` and ``slurmd``, started
by the test that needs them on free loopback ports with a private state folder, and stopped
(with every job they ran) when it is done.

Installed by the project's own files (``scripts/install-slurm.sh``, run by ``make install``
as root where ``apt-get`` is available). A test without the daemons skips, except under
``CI=true``, where a missing Slurm fails the suite.

The cluster authenticates nothing (``auth/none``): it listens on 127.0.0.1 only and lives as
long as the test. Its one node declares 8 CPUs on this 2-core machine
(``SlurmdParameters=config_overrides``) and the partition oversubscribes, so a 4-task job
runs here. Several clusters may run at once (the suite's parallel workers): each has its
own ports, folder and configuration, and stops only the processes it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

_DAEMONS = ("slurmctld", "slurmd")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def require_slurm() -> None:
    """Skip (fail under ``CI=true``) when Slurm's daemons and commands are not installed or
    this process cannot run them (they run as root here)."""
    missing = [n for n in (*_DAEMONS, "srun", "sbatch", "scontrol", "squeue", "scancel")
               if _binary(n) is None]
    why = None
    if missing:
        why = (f"Slurm is not installed ({', '.join(missing)} missing). Fix: make install as "
               "root (scripts/install-slurm.sh: apt-get install slurm-wlm)")
    elif os.geteuid() != 0:
        why = "the test Slurm cluster's slurmd runs jobs as root: run the tests as root"
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {why}")
    pytest.skip(why)


class SlurmCluster:
    """One controller and one node on 127.0.0.1, configured under ``root``."""

    def __init__(self, root: Path, *, cpus: int = 8) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        ctld_port, node_port = _free_ports(2)
        for d in ("state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=stratagemtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_port}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "KillWait=5",
            "MinJobAge=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=8000 "
            "State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE",
            ""]))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
                  and k != "SLURM_CONF"]:
            del self.env[k]  # a test run inside a Slurm job must not leak that job's
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, timeout: float = 60.0) -> None:
        for name, extra in (("slurmctld", ["-i"]), ("slurmd", [])):
            binary = _binary(name)
            assert binary is not None
            log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - kept open
            self._procs.append(subprocess.Popen([binary, "-D", *extra, "-f", str(self.conf)],
                                                env=self.env, stdout=log, stderr=log,
                                                start_new_session=True))
        due = time.monotonic() + timeout
        while True:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args[0]}: {p.returncode}): "
                                       f"{self.logs()}")
            state = self.run(["sinfo", "-h", "-o", "%t"], check=False, timeout=10).stdout
            if state.strip() in ("idle", "mix", "alloc"):
                return
            if time.monotonic() > due:
                raise RuntimeError(f"the test Slurm node is not idle within {timeout:g} s "
                                   f"(state {state.strip()!r}): {self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 3000) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            with contextlib.suppress(OSError):
                out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60.0,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        """A Slurm command (``srun``, ``sbatch``, ...) against this cluster."""
        done = subprocess.run(argv, env=kwargs.pop("env", self.env), capture_output=True,
                              text=True, timeout=timeout, check=False, **kwargs)  # type: ignore[call-overload]
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}"
                                 f"\n{done.stderr}\n{self.logs()}")
        return done

    def job_state(self, job: str) -> str:
        out = self.run(["scontrol", "show", "job", job], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: str, states: tuple[str, ...] = ("COMPLETED",),
                 timeout: float = 180.0) -> str:
        """Wait for job ``job`` to reach one of ``states`` (or any end state); returns it."""
        ends = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
        due = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states or state in ends:
                return state
            if time.monotonic() > due:
                raise AssertionError(f"job {job} is {state} after {timeout:g} s\n{self.logs()}")
            time.sleep(0.3)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(["scancel", "--full", "-u", "root"], check=False, timeout=20)
        time.sleep(0.5)
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self._procs.clear()
