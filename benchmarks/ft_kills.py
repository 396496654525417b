"""Fault tolerance per strategy: a 4-worker job under
``stratagem run --fault-tolerant`` with three SIGKILLs, side by side with the same job without
failures, for each synchronous strategy that runs fault tolerant.

Each job runs ``tests/ft_scripts/train_ft.py`` (an MLP on MNIST-5k, ``--data mnist``) for
``--steps`` steps with ``--step-sleep`` seconds of simulated extra compute per step (so the
job lasts long enough for three kills and three replacements on this 2-core machine). The
kills hit slots 1, 2 and 3 in turn, once each slot's progress passes 15 %, 35 % and 55 % of
the steps; slot 0 is never killed. Checked and reported per strategy:

- no survivor restarted: every slot has one PID except the killed one, which has two;
- the final consensus models (``eval_model``) of the 4 replicas are bitwise equal;
- test accuracy against the fault-free run's (target: within 0.5 point);
- goodput: committed samples per second over the fault-free job's (a slot's share of a
  global batch counts for each step the slot took part in; while a slot is away its share
  is lost, unless ``mirrored_keep``, Mirrored with ``keep_global_batch=True``, where a live
  replica trains on it), and the time lost per kill: on slot 0, the longest gap between two committed
  steps after each kill, minus the median step.

``--strategies hierarchical,hierarchical_sharded``: ``Hierarchical(Mirrored|Sharded, DiLoCo)``
on 2 replica groups of 2 processes (``--replica-group-size 2``); the kills hit group 1's
processes and each restarts that whole group.

    PYTHONPATH=src python benchmarks/ft_kills.py [--strategies mirrored,local_sgd,diloco,easgd]
        [--steps 1000] [--step-sleep 0.03]

Writes benchmarks/results/ft_kills.{json,md} (``--smoke``: a temporary folder).
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
from typing import Any

from _common import (
    add_ledger_args,
    ft_progress,
    ft_stamps,
    output_dir,
    split_list,
    write_report,
)
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ft_scripts" / "train_ft.py"
NPROC = 4
KILLS = ((1, 0.15), (2, 0.35), (3, 0.55))  # (slot, fraction of the steps)
#: Hierarchical: 2 replica groups of 2 processes (a node each); the kills hit group 1's
#: processes (slot 0, whose steps are timed, is in group 0, which is never killed).
GROUP_KILLS = ((2, 0.15), (3, 0.35), (2, 0.55))


def _group(strategy: str) -> int:
    return 2 if strategy.startswith("hierarchical") else 1


def run(strategy: str, steps: int, sleep: float, kills: bool,
        model: str = "mlp") -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"ftkills-{strategy}-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    group = _group(strategy)
    plan = GROUP_KILLS if group > 1 else KILLS
    cmd = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(NPROC),
           "--fault-tolerant", "--replica-group-size", str(group),
           str(SCRIPT), "--out", str(out), "--steps", str(steps),
           "--strategy", strategy, *(["--model", "gpt", "--data", "charlm"] if model == "gpt"
                                     else ["--data", "mnist"]),
           "--step-sleep", str(sleep),
           "--timeout", "30"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed: list[tuple[int, float]] = []
    if kills:
        for slot, frac in plan:
            deadline = time.monotonic() + 600
            while ft_progress(out, slot) < frac * steps:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    text = proc.communicate()[0].decode(errors="replace")
                    raise SystemExit(f"{strategy}: slot {slot} never reached {frac:.0%}:\n"
                                     f"{text[-3000:]}")
                time.sleep(0.02)
            pid = int((out / f"pids.{slot}").read_text().split()[-1])
            os.kill(pid, signal.SIGKILL)
            killed.append((slot, time.time()))
    output, _ = proc.communicate(timeout=1800)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{output.decode(errors='replace')[-3000:]}")
    pids = {s: (out / f"pids.{s}").read_text().split() for s in range(NPROC)}
    # A replacement that starts after the others finished finds nobody to heal from and
    # ends without a result (docs/reliability.md): it counts as not equal.
    finished = [s for s in range(NPROC) if (out / f"final.{s}.safetensors").exists()]
    states = [load_file(out / f"final.{s}.safetensors") for s in finished]
    equal = len(finished) == NPROC and all(
        (v == st[k]).all() for st in states[1:] for k, v in states[0].items())
    accs = [float((out / f"acc.{s}").read_text().split()[0]) for s in finished]
    rows = ft_stamps(out, 0)
    stamps = [t for _, t in rows]
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    step = statistics.median(diffs[len(diffs) // 10:])
    # Committed samples: each slot's share of the global batch for every step it took part
    # in (a slot logs a step once it is applied; a missing slot's share is lost).
    if strategy.endswith("_keep"):  # keep_global_batch: every committed step trains N shares
        slot_steps = NPROC * len({step for step, _ in ft_stamps(out, 0)})
    else:
        slot_steps = sum(len({step for step, _ in ft_stamps(out, s)}) for s in range(NPROC))
    result: dict[str, Any] = {
        "committed_slot_steps": slot_steps,
        "committed_slot_steps_per_s": slot_steps / (stamps[-1] - stamps[0]),
        "strategy": strategy, "kills": len(killed), "wall_s": wall,
        "train_s": stamps[-1] - stamps[0], "median_step_ms": step * 1e3,
        "accuracy": accs[0], "bitwise_equal": bool(equal),
        "pids_per_slot": [len(pids[s]) for s in range(NPROC)],
        # Every process of a group that lost one is restarted with it (one life each).
        "survivors_never_restarted": all(
            len(pids[s]) == 1 + sum(1 for k, _ in killed if k // group == s // group)
            for s in range(NPROC)),
        "finished": finished,
        "heals": [(out / f"acc.{s}").read_text().splitlines()[2] for s in finished],
    }
    if killed:
        lost = []
        for _, at in killed:
            after = [(a, b) for a, b in zip(stamps, stamps[1:]) if b > at]
            window = [b - a for a, b in after[:60]]  # the steps right after the kill
            lost.append(max(window) - step if window else float("nan"))
        result["time_lost_per_kill_s"] = lost
        back = []
        for slot, at in killed:
            later = [t for _, t in ft_stamps(out, slot) if t > at]
            back.append(later[0] - at if later else float("nan"))
        result["kill_to_replacement_step_s"] = back
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategies", default="mirrored,local_sgd,diloco,easgd")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-sleep", type=float, default=0.03)
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp",
                   help="mlp: MNIST-5k MLP (accuracy); gpt: the character-level GPT on the LM "
                        "demo's corpus (validation loss)")
    p.add_argument("--out", default="ft_kills", help="the result's name: OUT.{json,md}")
    add_ledger_args(p, smoke="mirrored only, fault-free (no kill), 2 workers, 3 steps")
    args = p.parse_args()
    if args.smoke:
        global NPROC
        NPROC = 2
        args.steps, args.step_sleep = 3, 0.0
        if args.strategies == p.get_default("strategies"):
            args.strategies = "mirrored"
    out_dir = output_dir(args)
    rows = []
    for strategy in split_list(args.strategies):
        free = run(strategy, args.steps, args.step_sleep, kills=False, model=args.model)
        if args.smoke:  # the kill plan (slots 1, 2, 3) needs 4 workers
            rows.append(free)
            continue
        hit = run(strategy, args.steps, args.step_sleep, kills=True, model=args.model)
        # The GPT's metric is the validation loss: its change is in percent of fault-free's.
        hit["accuracy_delta_points"] = (
            100 * (hit["accuracy"] - free["accuracy"]) / (free["accuracy"]
                                                          if args.model == "gpt" else 1.0))
        hit["goodput_vs_fault_free"] = (hit["committed_slot_steps_per_s"]
                                        / free["committed_slot_steps_per_s"])
        rows += [free, hit]
        print(free, hit, sep="\n", flush=True)
    lines = [f"`PYTHONPATH=src python benchmarks/ft_kills.py --strategies {args.strategies} "
             f"--steps {args.steps} --step-sleep {args.step_sleep} --model {args.model}` "
             f"({NPROC} workers, "
             + ("the character-level GPT (2 layers, 64 wide, AdamW) on the LM demo's corpus"
                if args.model == "gpt" else "MNIST-5k MLP")
             + ", kills of slots 1, 2, 3 at 15/35/55 % of the steps; hierarchical rows: 2 "
             "replica groups of 2 processes, kills of slots 2, 3, 2 (group 1), each "
             "restarting the whole group)", "",
             "| strategy | kills | survivors never restarted | final replicas bitwise equal "
             + ("| validation loss | vs fault-free (%) " if args.model == "gpt"
                else "| accuracy | vs fault-free (points) ")
             + "| goodput vs fault-free | time lost per kill s "
             "| kill -> replacement's first step s | median step ms |",
             "|---|---:|---|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        lost = r.get("time_lost_per_kill_s")
        back = r.get("kill_to_replacement_step_s")
        lines.append(
            f"| {r['strategy']} | {r['kills']} | {r['survivors_never_restarted']} | "
            f"{r['bitwise_equal']} | {r['accuracy']:.4f} | "
            f"{r.get('accuracy_delta_points', 0.0):+.2f} | "
            f"{r.get('goodput_vs_fault_free', 1.0):.2f} | "
            f"{'' if lost is None else ', '.join(f'{x:.2f}' for x in lost)} | "
            f"{'' if back is None else ', '.join(f'{x:.1f}' for x in back)} | "
            f"{r['median_step_ms']:.1f} |")
    write_report(args.out, {"argv": sys.argv[1:], "nproc": NPROC}, rows, lines,
                 out_dir=out_dir)


if __name__ == "__main__":
    main()
