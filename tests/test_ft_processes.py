"""Fault tolerance with real processes: ``stratagem run --fault-tolerant``, a worker
SIGKILLed mid-run and one SIGSTOPped. The process is the point here; every other fault path is
tested with replicas as threads in ``test_ft.py``."""

from __future__ import annotations

import contextlib
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

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).parent / "ft_scripts" / "train_ft.py"
STEPS = 60


def _start(out: Path, *extra: str, min_replicas: int = 1, steps: int = STEPS,
           nproc: int = 3, group: int = 1) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(nproc),
         "--fault-tolerant", "--min-replicas", str(min_replicas),
         "--replica-group-size", str(group),
         str(SCRIPT), "--out", str(out), "--steps", str(steps), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_progress(out: Path, slots: list[int], at_least: int, deadline: float) -> None:
    end = time.monotonic() + deadline
    while min(ft_progress(out, s) for s in slots) < at_least:
        assert time.monotonic() < end, f"no progress to step {at_least} in {deadline}s"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen[bytes]) -> str:
    output, _ = proc.communicate(timeout=240)
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def _final(out: Path, n: int = 3) -> tuple[list[dict], list[float]]:
    states = [load_file(out / f"final.{s}.safetensors") for s in range(n)]
    accs = [float((out / f"acc.{s}").read_text().split()[0]) for s in range(n)]
    return states, accs


def _assert_bitwise_equal(states: list[dict]) -> None:
    for state in states[1:]:
        for k, v in states[0].items():
            assert (v == state[k]).all(), k


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> float:
    out = tmp_path_factory.mktemp("ft_ref")
    _finish(_start(out))
    states, accs = _final(out)
    _assert_bitwise_equal(states)
    return accs[0]


def test_sigkilled_worker_is_restarted_alone_heals_and_the_job_finishes(tmp_path, fault_free):
    # --min-replicas 3: the survivors wait for the replacement (however long its start-up
    # takes on a loaded machine), so the heal always happens before the job ends. The
    # shrinking quorum is tested with a stalled worker below and with threads.
    proc = _start(tmp_path, "--step-sleep", "0.02", "--timeout", "120", min_replicas=3)
    _wait_progress(tmp_path, [0, 1, 2], 10, deadline=150)
    survivors = {s: ft_pids(tmp_path, s) for s in (0, 2)}
    os.kill(ft_pids(tmp_path, 1)[-1], signal.SIGKILL)
    text = _finish(proc)
    assert "worker 1" in text and "restarting worker 1 alone" in text
    assert {s: ft_pids(tmp_path, s) for s in (0, 2)} == survivors  # survivors never restarted
    assert len(ft_pids(tmp_path, 1)) == 2  # the killed one was restarted once
    states, accs = _final(tmp_path)
    _assert_bitwise_equal(states)
    assert abs(accs[0] - fault_free) <= 0.005
    stats = (tmp_path / "acc.1").read_text()
    assert "heals=1" in stats, stats


def _job_output(proc: subprocess.Popen[bytes]) -> str:
    """The job's output so far (stopping it): what a failed wait shows."""
    if proc.poll() is None:
        proc.kill()
    output, _ = proc.communicate(timeout=30)
    return output.decode(errors="replace")[-6000:]


def test_a_stalled_worker_is_evicted_the_others_go_on_and_it_heals_when_it_wakes(tmp_path):
    proc = _start(tmp_path, "--step-sleep", "0.03", "--timeout", "4", steps=120)
    try:
        _wait_progress(tmp_path, [0, 1, 2], 8, deadline=150)
        pid = ft_pids(tmp_path, 1)[-1]
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped_at = ft_progress(tmp_path, 1)
            # The strategy's timeout is 4 s: the others go on without the stalled worker.
            _wait_progress(tmp_path, [0, 2], stopped_at + 8, deadline=60)
            assert ft_progress(tmp_path, 1) == stopped_at
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the job's output ---\n{_job_output(proc)}") from e
    text = _finish(proc)
    # Woke up and caught up, not restarted (the job's output says why when it was).
    assert len(ft_pids(tmp_path, 1)) == 1, text[-4000:]
    states, _ = _final(tmp_path)
    _assert_bitwise_equal(states)

