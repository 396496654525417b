"""stratagem under a real Slurm (Debian's slurm-wlm, started by the test on loopback: see
tests/slurm_cluster.py): `srun python train.py` forms one job of 4 tasks from Slurm's
variables alone; `srun stratagem run --fault-tolerant` restarts a SIGKILLed worker alone and
heals it; a job warned with SIGUSR1 saves, requeues itself and resumes bitwise, position in
the epoch included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ft_pids, ft_progress
from safetensors.torch import load_file
from slurm_cluster import SlurmCluster, require_slurm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
TRAIN = HERE / "cluster_scripts" / "slurm_train.py"
TRAIN_FT = HERE / "ft_scripts" / "train_ft.py"
SRC = str(HERE.parent / "src")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require_slurm()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    cluster.env["OMP_NUM_THREADS"] = "1"
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _final(out: Path, world: int) -> tuple[list[dict], list[dict]]:
    states = [load_file(out / f"final.{r}.safetensors") for r in range(world)]
    infos = [json.loads((out / f"final.{r}.json").read_text()) for r in range(world)]
    return states, infos


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(bool((a[k] == b[k]).all()) for k in a)


@pytest.fixture(scope="module")
def four_tasks(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`srun -n 4 python train.py`, uninterrupted: the 4-task job, and the reference the
    requeued job must equal."""
    out = tmp_path_factory.mktemp("four_tasks")
    slurm.run(["srun", "-n", "4", "--time=3", sys.executable, str(TRAIN), str(out),
               "--steps", "20"], timeout=180)
    return out


def test_srun_python_forms_one_job_of_four_tasks(four_tasks: Path) -> None:
    starts = [json.loads((four_tasks / f"start.{r}.0").read_text()) for r in range(4)]
    assert [(s["world"], s["rank"]) for s in starts] == [(4, r) for r in range(4)]
    states, infos = _final(four_tasks, 4)
    assert all(_equal(states[0], s) for s in states[1:])  # one model, four replicas
    assert infos[0]["steps"] == 20 and infos[0]["losses"][-1] < infos[0]["losses"][0]


def _progress(out: Path) -> int:
    try:
        return int((out / "progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _wait(cond: object, what: str, timeout: float, slurm: SlurmCluster) -> None:
    due = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < due, f"{what} not within {timeout:g} s\n{slurm.logs()}"
        time.sleep(0.1)


def test_requeued_job_resumes_bitwise(slurm: SlurmCluster, four_tasks: Path,
                                      tmp_path: Path) -> None:
    """sbatch --requeue; SIGUSR1 to the job's tasks at step >= 6 (of 8 per epoch) (what --signal=USR1@60 sends
    before the time limit): every replica saves at the same step boundary, rank 0 requeues
    the job, which restarts, restores and ends equal to an uninterrupted run, bit for bit."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nsrun {sys.executable} {TRAIN} {out} --steps 20 "
                      f"--ckpt {ckpt} --requeue --sleep 0.08\n")
    job = slurm.run(["sbatch", "--parsable", "--requeue", "-n", "4", "--time=5",
                     "-o", str(tmp_path / "job-%j.log"), str(script)]).stdout.strip()
    _wait(lambda: _progress(out) >= 6, "step 6", 120, slurm)
    slurm.run(["scancel", "--signal=USR1", job])
    # Requeued: Slurm holds a requeued job 120 s before it is eligible again; let it go now.
    _wait(lambda: slurm.job_state(job) == "PENDING", "the requeue", 60, slurm)
    requeued_at = time.time()
    # Only once the first run's processes are gone (Slurm refuses to launch a job whose
    # previous run it is still killing).
    first_pids = [json.loads((out / f"start.{r}.0").read_text())["pid"] for r in range(4)]
    _wait(lambda: not any(os.path.exists(f"/proc/{p}") for p in first_pids),
          "the first run's end", 60, slurm)
    _wait(lambda: not slurm.run(["squeue", "-h", "-s", "-j", job], check=False).stdout.strip(),
          "the first run's steps to end", 60, slurm)
    # The requeue revoked the first run's job credential on the node (slurmd keeps the revoke
    # time, in whole seconds), and a credential issued in that same second is refused too:
    # the run started within it died with "Job credential revoked" (seen once on a quiet
    # machine). Slurm's own hold (120 s) is there for this; a start 2 s after the requeue
    # was seen (PENDING) is enough, once the node has finished with the first run.
    _wait(lambda: "COMPLETING" not in slurm.run(["sinfo", "-h", "-N", "-o", "%T"],
                                                 check=False).stdout.upper(),
          "the node's cleanup of the first run", 60, slurm)
    time.sleep(max(0.0, requeued_at + 2.0 - time.time()))
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    state = slurm.wait_job(job, timeout=180)
    logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("job-*.log"))
    assert state == "COMPLETED", f"{state}\n{logs}\n{slurm.logs()}"
    first = [json.loads((out / f"start.{r}.0").read_text()) for r in range(4)]
    second = [json.loads((out / f"start.{r}.1").read_text()) for r in range(4)]
    assert [s["step"] for s in first] == [0] * 4
    resumed = second[0]["step"]
    assert 6 <= resumed < 20 and {s["step"] for s in second} == {resumed}, (first, second)
    states, infos = _final(out, 4)
    ref_states, ref_infos = _final(four_tasks, 4)
    assert infos[0]["restart"] == "1" and infos[0]["steps"] == 20
    assert infos[0]["losses"] == ref_infos[0]["losses"]  # every step's loss, before and after
    assert all(_equal(ref_states[0], s) for s in states)


def test_srun_stratagem_run_fault_tolerant_heals_a_killed_worker(slurm: SlurmCluster,
                                                                  tmp_path: Path) -> None:
    """One launcher per node (`srun --ntasks-per-node=1 stratagem run --fault-tolerant`): a
    SIGKILLed worker is restarted alone and healed; the survivor never restarts; the
    replicas end bitwise equal."""
    proc = subprocess.Popen(
        ["srun", "-N", "1", "--ntasks-per-node=1", "--time=5", sys.executable, "-m",
         "stratagem.cli", "run", "--nproc", "2", "--fault-tolerant", "--min-replicas", "2",
         str(TRAIN_FT), "--out", str(tmp_path), "--steps", "40", "--step-sleep", "0.02",
         "--timeout", "120"],
        env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: min(ft_progress(tmp_path, s) for s in (0, 1)) >= 10, "step 10", 150,
              slurm)
        survivor = ft_pids(tmp_path, 0)
        os.kill(ft_pids(tmp_path, 1)[-1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "restarting worker 1 alone" in text, text[-3000:]
    assert ft_pids(tmp_path, 0) == survivor and len(ft_pids(tmp_path, 1)) == 2
    states = [load_file(tmp_path / f"final.{s}.safetensors") for s in (0, 1)]
    assert _equal(states[0], states[1])
    assert "heals=1" in (tmp_path / "acc.1").read_text()
