"""The demo's parameter-server job by data path: gRPC, shared memory with each step's small
message on gRPC, and shared memory with the doorbell (the default on one machine), beside
Mirrored on the same job; rounds alternate so machine load hits every row alike.

The job is ``stratagem demo``'s (MNIST-5k MLP, Adam, 2 workers, global batch 128; 1 shard for
the PS rows), through the demo's own ``train_worker`` minus its per-epoch evaluation. Per row:
training wall time, ms per step, the shard's CPU per push and a worker's CPU per step (read
from ``/proc``; the shard's pid from its ``health``), and PS / Mirrored in the same round.

    PYTHONPATH=src python benchmarks/ps_demo_path.py [--rounds 3] [--epochs 16]

Writes benchmarks/results/ps_demo_path.{json,md}; prints the table.
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

import stratagem as sg
from stratagem.demo import MLP, load_mnist5k

#: row -> (registry name, environment of the workers)
ROWS: dict[str, tuple[str, dict[str, str]]] = {
    "mirrored": ("mirrored", {}),
    "ps grpc": ("ps-async", {"STRATAGEM_PS_SHM": "0"}),
    "ps shm + grpc message": ("ps-async", {"STRATAGEM_PS_SHM": "1", "STRATAGEM_PS_BELL": "0"}),
    "ps shm + doorbell": ("ps-async", {"STRATAGEM_PS_SHM": "1", "STRATAGEM_PS_BELL": "1"}),
}


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(name: str, epochs: int, max_steps: int | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    strategy = sg.from_name(name)
    (X, y), _ = load_mnist5k()
    with strategy.scope():
        torch.manual_seed(0)
        model = MLP(256)
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset((X, y), 128, shuffle=True, seed=0)
    shard_pid = None
    if name.startswith("ps"):
        table = strategy._prepared[0].state["ps"].table
        shard_pid = int(table.client.health()[0]["pid"])
    shard0 = _cpu_seconds(shard_pid) if shard_pid else 0.0
    me0 = _cpu_seconds(os.getpid())
    steps = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, target in loader:
            strategy.backward(F.cross_entropy(model(x), target))
            opt.step()
            opt.zero_grad()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        if max_steps is not None and steps >= max_steps:
            break
    wall = time.perf_counter() - start
    shard = _cpu_seconds(shard_pid) - shard0 if shard_pid else None
    me = _cpu_seconds(os.getpid()) - me0
    bells = (int(table.client.health()[0].get("shm_bells", 0)) if shard_pid else None)
    strategy.close()
    workers = strategy.num_replicas_in_sync
    return {"wall_s": wall, "steps": steps, "ms_per_step": 1e3 * wall / steps,
            "worker_cpu_ms_per_step": 1e3 * me / steps,
            "shard_cpu_ms_per_push": None if shard is None else 1e3 * shard / (workers * steps),
            "shard_doorbells": bells}


def run_row(row: str, epochs: int, max_steps: int | None = None) -> dict[str, Any]:
    """One job of ``row`` (the switches are read by the workers: they decide the path)."""
    name, env = ROWS[row]
    ranks = sg.launch(worker, nprocs=2, num_ps=1 if name.startswith("ps") else 0,
                      args=(name, epochs, max_steps), env=env)
    return {"row": row, **ranks[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated, of: " + ", ".join(ROWS))
    add_ledger_args(p, smoke="1 round of 2 steps of the default path (shm + doorbell) alone")
    args = p.parse_args(argv)
    max_steps = None
    if args.smoke:
        args.rounds, args.epochs, max_steps = 1, 1, 2
        if args.rows == p.get_default("rows"):
            args.rows = "ps shm + doorbell"
    out_dir = output_dir(args)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or ("mirrored" not in rows and not args.smoke):
        p.error(f"--rows must include mirrored and name only {list(ROWS)}; got {unknown or rows}")
    results: list[dict[str, Any]] = []
    t0 = time.time()
    for rnd in range(args.rounds):
        order = rows if rnd % 2 == 0 else rows[::-1]
        got = {r: run_row(r, args.epochs, max_steps) for r in order}
        for r in rows:
            got[r]["round"] = rnd
            got[r]["vs_mirrored"] = (got[r]["wall_s"] / got["mirrored"]["wall_s"]
                                     if "mirrored" in got else None)
            results.append(got[r])
            vs = got[r]["vs_mirrored"]
            print(f"round {rnd}: {r}: {got[r]['wall_s']:.2f} s"
                  + ("" if vs is None else f", {vs:.2f}x Mirrored"), flush=True)

    def cell(row: str, key: str, fmt: str) -> str:
        vals = [x[key] for x in results if x["row"] == row and x[key] is not None]
        if not vals:
            return "-"
        return f"{format(statistics.median(vals), fmt)} ({', '.join(format(v, fmt) for v in vals)})"

    lines = [f"# The demo's PS job by data path ({args.rounds} alternating rounds, "
             f"{args.epochs} epochs, 2 workers + 1 shard)", "",
             "Median (per round).", "",
             "| row | wall s | / Mirrored (same round) | ms/step | shard CPU ms/push | "
             "worker CPU ms/step |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r} | {cell(r, 'wall_s', '.2f')} | {cell(r, 'vs_mirrored', '.2f')} | "
                     f"{cell(r, 'ms_per_step', '.1f')} | {cell(r, 'shard_cpu_ms_per_push', '.2f')} "
                     f"| {cell(r, 'worker_cpu_ms_per_step', '.2f')} |")
    meta = {"rounds": args.rounds, "epochs": args.epochs, "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0))}
    write_report("ps_demo_path", meta, results, lines, out_dir=out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
