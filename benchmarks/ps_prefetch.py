"""Parameter-server prefetch: step time with the next parameters pulled in the background
(overlapping the next forward/backward) against pulling them in the step, same run.

One shard runs as a separate process (its own GIL, as in a real job); the worker trains an
MLP in this process with ``sg.ParameterServer(prefetch=True|False)``. Rounds alternate between
the two settings so a change in machine load hits both alike; each round builds a fresh
strategy on the same shard and times ``--steps`` steps after a short warm-up.

    PYTHONPATH=src python benchmarks/ps_prefetch.py [--hidden 1024] [--batch 256] [--rounds 4]

Writes benchmarks/results/ps_prefetch.{json,md}; prints the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from _common import add_ledger_args, output_dir, write_report
from torch import nn

from stratagem.comm import Comm
from stratagem.launcher import start_ps_shards
from stratagem.strategies.parameter_server import ParameterServer


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def run_round(addrs: list[str], mode: str, prefetch: bool, hidden: int, batch: int,
              steps: int, warmup: int) -> dict[str, float]:
    s = ParameterServer(mode=mode, prefetch=prefetch, ps_addresses=addrs, comm=Comm.single())
    with s.scope():
        model = make_model(hidden)
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 784, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        s.backward(loss)
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    before = s.metrics()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    s.eval_model(model)  # the last fetch lands inside the timed region too
    elapsed = time.perf_counter() - t0
    after = s.metrics()
    s.close()
    return {"step_ms": 1e3 * elapsed / steps,
            "ps_seconds_per_step": (after["comm_seconds"] - before["comm_seconds"]) / steps,
            "staleness": after["staleness"]}


def compute_only_ms(hidden: int, batch: int, steps: int) -> float:
    model = make_model(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))
    t0 = time.perf_counter()
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", default="async,sync")
    add_ledger_args(ap, smoke="async only, hidden 64, batch 8, 1 round of 3 steps")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.batch, args.steps, args.warmup, args.rounds = 64, 8, 3, 1, 1
        if args.modes == ap.get_default("modes"):
            args.modes = "async"
    out_dir = output_dir(args)
    torch.set_num_threads(1)
    params = sum(p.numel() for p in make_model(args.hidden).parameters())
    rows: list[dict[str, Any]] = []
    with start_ps_shards(1) as shards:
        os.environ.update(shards.env())  # the strategy's PSClient reads the token file
        for mode in args.modes.split(","):
            got: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            compute: list[float] = []
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                for prefetch in order:
                    got[prefetch].append(run_round(shards.addresses, mode, prefetch,
                                                   args.hidden, args.batch, args.steps,
                                                   args.warmup))
                compute.append(compute_only_ms(args.hidden, args.batch, args.steps // 3))
            off = statistics.median(g["step_ms"] for g in got[False])
            on = statistics.median(g["step_ms"] for g in got[True])
            row = {"mode": mode, "step_ms_prefetch_off": round(off, 2),
                   "step_ms_prefetch_on": round(on, 2), "speedup": round(off / on, 3),
                   "compute_only_ms": round(statistics.median(compute), 2),
                   "ps_ms_per_step_off": round(1e3 * statistics.median(
                       g["ps_seconds_per_step"] for g in got[False]), 2),
                   "staleness_prefetch_on": got[True][-1]["staleness"],
                   "staleness_prefetch_off": got[False][-1]["staleness"],
                   "rounds_ms_off": [round(g["step_ms"], 2) for g in got[False]],
                   "rounds_ms_on": [round(g["step_ms"], 2) for g in got[True]]}
            rows.append(row)
            print(row, flush=True)
    meta = {"params": params, "param_MB": round(params * 4 / 1e6, 2), "hidden": args.hidden,
            "batch": args.batch, "steps_per_round": args.steps, "rounds": args.rounds,
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__,
            "command": " ".join(["python", "benchmarks/ps_prefetch.py", *sys.argv[1:]])}
    lines = [f"# Parameter-server prefetch ({meta['param_MB']} MB of parameters, batch "
             f"{args.batch}, 1 worker, 1 shard process)", "",
             "| mode | step ms, prefetch off | step ms, prefetch on | speed-up | compute-only "
             "ms | staleness (on) |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['mode']} | {r['step_ms_prefetch_off']} | {r['step_ms_prefetch_on']} | "
              f"{r['speedup']:.2f}x | {r['compute_only_ms']} | {r['staleness_prefetch_on']} |"
              for r in rows]
    lines += ["", f"Medians of {args.rounds} alternating rounds of {args.steps} steps. Async prefetch "
              "overlaps the pull with the next forward/backward (the forward uses parameters "
              "one fetch older: staleness 1); sync prefetch only overlaps the code between "
              "`optimizer.step()` and the next forward, so it gains ~nothing in a tight loop "
              "and gives identical results."]
    write_report("ps_prefetch", meta, rows, lines, out_dir=out_dir)


if __name__ == "__main__":
    main()
