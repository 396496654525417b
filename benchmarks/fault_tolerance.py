"""Fault tolerance, measured: what a fault-tolerant step costs without failures,
and what a SIGKILLed worker costs with them.

Runs ``tests/ft_scripts/train_ft.py`` (an MLP on 3000 synthetic 10-class digits) on N workers:

- ``plain``: ``stratagem run --nproc N`` (torchrun, Mirrored on DDP);
- ``ft``: ``stratagem run --nproc N --fault-tolerant`` (the same Mirrored on torchft, with
  its defaults: quorum elision, ``quorum_every=32``: no quorum and commit calls while every
  replica is present);
- ``ft-every-step``: the same with ``STRATAGEM_FT_QUORUM_EVERY=1`` (a quorum and a commit
  vote at every step, torchft's own schedule; the ``ft-elided`` row of
  ``git show 6fa400f:benchmarks/results/fault_tolerance_s6.md`` is today's ``ft``);
- ``ft+kill``: ``ft``, with worker 1 SIGKILLed once training is under way.

``--rounds R`` runs the fault-free modes R times, in turn (plain, ft-every-step, ft, plain,
...), and reports each mode's median and the per-round ratios to the plain run of the round.

Reports the median step time (from each worker's per-step timestamps, after warm-up), the
fault-tolerant/plain ratio, the time lost to the kill (the longest gap between committed
steps on the survivors minus the median step), the replacement's time from kill to its first
step, and the final accuracy. Results: ``benchmarks/results/fault_tolerance.{json,md}``
(``--smoke``: a temporary folder).

Not measured here (see docs/status.md): torchft written by hand, restart-all + resume.

    python benchmarks/fault_tolerance.py [--nproc 4] [--steps 300] [--width 256] [--rounds 1]
        [--modes plain,ft-every-step,ft,ft+kill]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import add_ledger_args, output_dir, write_result  # noqa: E402

SCRIPT = ROOT / "tests" / "ft_scripts" / "train_ft.py"


def run(mode: str, nproc: int, steps: int, width: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"ftbench-{mode}-"))
    cmd = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(nproc)]
    if mode != "plain":
        cmd.append("--fault-tolerant")
    cmd += [str(SCRIPT), "--out", str(out), "--steps", str(steps), "--width", str(width),
            "--timeout", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if mode == "ft-every-step":
        env["STRATAGEM_FT_QUORUM_EVERY"] = "1"

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
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default="plain,ft-every-step,ft,ft+kill")
    p.add_argument("--out", dest="out_dir", help=argparse.SUPPRESS)  # the old --out-dir
    add_ledger_args(p, smoke="plain mode only, 2 workers, 2 steps, width 16")
    args = p.parse_args()
    if args.smoke:
        args.nproc, args.steps, args.width, args.rounds, args.modes = 2, 2, 16, 1, "plain"
    out_dir = output_dir(args)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        plain = None
        for mode in modes:
            if mode == "ft+kill":
                continue
            r = run(mode, args.nproc, args.steps, args.width)
            runs[mode].append(r)
            if mode == "plain":
                plain = r["median_step_ms"]
            elif plain is not None:
                ratios[mode].append(r["median_step_ms"] / plain)
    if "ft+kill" in modes:
        runs["ft+kill"].append(run("ft+kill", args.nproc, args.steps, args.width))
    rows = []
    for mode in modes:
        rs = runs[mode]
        row = dict(rs[len(rs) // 2]) if len(rs) % 2 else dict(rs[0])
        row["median_step_ms"] = statistics.median(r["median_step_ms"] for r in rs)
        row["round_step_ms"] = [r["median_step_ms"] for r in rs]
        row["round_ratios_vs_plain"] = ratios[mode]
        rows.append(row)
    base = next((r["median_step_ms"] for r in rows if r["mode"] == "plain"), None)
    for r in rows:
        r["step_vs_plain"] = (statistics.median(r["round_ratios_vs_plain"])
                              if r["round_ratios_vs_plain"] else
                              (r["median_step_ms"] / base if base else float("nan")))
    lines = ["| mode | median step ms (per round) | vs plain (median of per-round ratios; "
             "each) | time lost per failure s | kill -> replacement's first step s | "
             "accuracy | wall s |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lost = r.get("time_lost_per_failure_s")
        back = r.get("kill_to_replacement_step_s")
        each = ", ".join(f"{x:.2f}" for x in r["round_ratios_vs_plain"])
        steps_each = ", ".join(f"{x:.1f}" for x in r["round_step_ms"])
        lines.append(f"| {r['mode']} | {r['median_step_ms']:.1f} ({steps_each}) | "
                     f"{r['step_vs_plain']:.3f}{f' ({each})' if each else ''} | "
                     f"{'' if lost is None else f'{lost:.2f}'} | "
                     f"{'' if back is None else f'{back:.1f}'} | {r['accuracy']:.4f} | "
                     f"{r['wall_s']:.1f} |")
    write_result("fault_tolerance", rows, lines, out_dir=out_dir)


if __name__ == "__main__":
    main()
