"""Fault tolerance, measured (issue 22): what a fault-tolerant step costs without failures,
and what a SIGKILLed worker costs with them.

Runs ``tests/ft_scripts/train_ft.py`` (an MLP on 3000 synthetic 10-class digits) on N workers:

- ``plain``: ``stratagem run --nproc N`` (torchrun, Mirrored on DDP);
- ``ft``: ``stratagem run --nproc N --fault-tolerant`` (the same Mirrored on torchft);
- ``ft+kill``: the same, with worker 1 SIGKILLed once training is under way.

Reports the median step time (from each worker's per-step timestamps, after warm-up), the
fault-tolerant/plain ratio, the time lost to the kill (the longest gap between committed
steps on the survivors minus the median step), the replacement's time from kill to its first
step, and the final accuracy. Results: ``benchmarks/results/fault_tolerance.{json,md}``.

Not measured here (see docs/status.md): torchft written by hand, restart-all + resume.

    python benchmarks/fault_tolerance.py [--nproc 4] [--steps 300] [--width 256]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ft_scripts" / "train_ft.py"


def run(mode: str, nproc: int, steps: int, width: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"ftbench-{mode}-"))
    cmd = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(nproc)]
    if mode != "plain":
        cmd.append("--fault-tolerant")
    cmd += [str(SCRIPT), "--out", str(out), "--steps", str(steps), "--width", str(width),
            "--timeout", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed_at = None
    if mode == "ft+kill":
        while True:
            try:
                if int((out / "progress.1").read_text() or 0) >= steps // 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        pid = int((out / "pids.1").read_text().split()[-1])
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
    output, _ = proc.communicate(timeout=1800)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{output.decode()[-3000:]}")
    per_step, gaps = [], []
    for slot in range(nproc):
        rows = [tuple(map(float, line.split()))
                for line in (out / f"times.{slot}").read_text().splitlines()]
        if slot == 1 and mode == "ft+kill":
            continue
        stamps = [t for _, t in rows][steps // 10:]  # after warm-up
        diffs = [b - a for a, b in zip(stamps, stamps[1:])]
        per_step.append(statistics.median(diffs))
        gaps.append(max(diffs))
    step = statistics.median(per_step)
    result = {"mode": mode, "wall_s": wall, "median_step_ms": step * 1e3,
              "accuracy": float((out / "acc.0").read_text().split()[0])}
    if killed_at is not None:
        rows = [tuple(map(float, line.split()))
                for line in (out / "times.1").read_text().splitlines()]
        after = [t for _, t in rows if t > killed_at]
        result["kill_to_replacement_step_s"] = (after[0] - killed_at) if after else None
        result["time_lost_per_failure_s"] = statistics.median(gaps) - step
        stats = out / "acc.1"
        # A replacement that starts after the others finished finds nobody to heal from and
        # is not restarted (docs/reliability.md): then it has no result.
        result["replacement"] = (stats.read_text().splitlines()[2] if stats.exists()
                                 else "joined after the job ended")
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    rows = [run(mode, args.nproc, args.steps, args.width)
            for mode in ("plain", "ft", "ft+kill")]
    base = rows[0]["median_step_ms"]
    for r in rows:
        r["step_vs_plain"] = r["median_step_ms"] / base
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fault_tolerance.json").write_text(json.dumps(rows, indent=1))
    lines = ["| mode | median step ms | vs plain | time lost per failure s | kill -> "
             "replacement's first step s | accuracy | wall s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lost = r.get("time_lost_per_failure_s")
        back = r.get("kill_to_replacement_step_s")
        lines.append(f"| {r['mode']} | {r['median_step_ms']:.1f} | {r['step_vs_plain']:.2f} | "
                     f"{'' if lost is None else f'{lost:.2f}'} | "
                     f"{'' if back is None else f'{back:.1f}'} | {r['accuracy']:.4f} | "
                     f"{r['wall_s']:.1f} |")
    text = "\n".join(lines)
    cmd = " ".join(["python", "benchmarks/fault_tolerance.py", *sys.argv[1:]])
    (Path(args.out) / "fault_tolerance.md").write_text(f"`{cmd}`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
