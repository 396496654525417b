"""Mirrored with gradient compression, mixed precision and sparse gradients: accuracy and
bytes on the wire.

    python benchmarks/compression.py [--epochs 8] [--seeds 0 1 2] [--workers 2]

1. MNIST-5k (``stratagem.demo``: 4,000 train / 1,000 test real digits, MLP 784-256-256-10,
   Adam lr 2e-3, global batch 128) under ``Mirrored`` on real worker processes: fp32 wire
   vs fp16 / bf16 compression (Micikevicius et al. 2018), each with and without error
   feedback (Seide et al. 2014; Karimireddy et al. 2019), and fp32 vs bf16 vs fp16 (dynamic
   loss scaling) precision. Test accuracy (mean over seeds) and gradient bytes sent per step
   (counted by the strategy, prepare's initial broadcast excluded).
2. A sparse embedding (``nn.Embedding(100_000, 32)``, Zipf-distributed ids, a linear head):
   bytes per step and step time with ``sparse=True`` (rows exchanged as indices + values)
   against ``sparse=False`` (the whole table all-reduced).

Writes ``benchmarks/results/compression.{json,md}`` (``--smoke``: a temporary folder) and prints the tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_ledger_args, output_dir, write_result  # noqa: E402

RUNS: list[tuple[str, dict[str, Any]]] = [
    ("fp32 wire (no compression)", {}),
    ("fp16 compression", {"compression": "fp16"}),
    ("fp16 compression + error feedback", {"compression": "fp16", "error_feedback": True}),
    ("bf16 compression", {"compression": "bf16"}),
    ("bf16 compression + error feedback", {"compression": "bf16", "error_feedback": True}),
    ("precision bf16", {"precision": "bf16"}),
    ("precision fp16 (loss scaling)", {"precision": "fp16"}),
    ("precision fp16 + fp16 compression", {"precision": "fp16", "compression": "fp16"}),
]


def mnist_worker(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every MNIST run in one process per worker (spawning costs ~20 s here): each run builds
    its own strategy on the job's default process group."""
    from stratagem.demo import load_mnist5k

    torch.set_num_threads(1)
    data = load_mnist5k()
    return [_mnist_run(cfg, data) for cfg in jobs]


def _mnist_run(cfg: dict[str, Any], data: Any) -> dict[str, Any]:
    """The ``stratagem.demo.train_worker`` loop, with bytes counted from after ``prepare`` so
    the initial parameter broadcast does not blur the per-step ratio."""
    import stratagem as sg
    from stratagem.demo import MLP, evaluate

    strategy = sg.Mirrored(**cfg["strategy_args"])
    (X_train, y_train), (X_test, y_test) = data
    with strategy.scope():
        torch.manual_seed(cfg["seed"])
        model = MLP(256)
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
        model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset((X_train, y_train), 128, shuffle=True, seed=cfg["seed"])
    start_bytes = strategy.metrics()["bytes_sent"]
    t0 = time.perf_counter()
    steps, max_steps = 0, cfg.get("max_steps")
    for epoch in range(cfg["epochs"]):
        loader.set_epoch(epoch)
        for x, y in loader:
            strategy.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        if max_steps is not None and steps >= max_steps:
            break
    wall = time.perf_counter() - t0
    metrics = strategy.metrics()
    attempted = metrics["steps"] + metrics["skipped_steps"]  # a skipped step still communicated
    accuracy = evaluate(strategy, model, X_test, y_test)
    strategy.close()
    return {"accuracy": accuracy, "bytes_sent_per_step": (metrics["bytes_sent"] - start_bytes)
            / max(1, attempted), "steps": metrics["steps"], "skipped": metrics["skipped_steps"],
            "wall_seconds": wall}


class EmbeddingNet(nn.Module):
    def __init__(self, sparse: bool, rows: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=sparse)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(dim=1))


def sparse_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """SGD on a bag-of-ids classifier; bytes and step time per step (after a warm-up)."""
    import stratagem as sg

    torch.set_num_threads(1)
    strategy = sg.Mirrored()
    torch.manual_seed(0)
    model = EmbeddingNet(cfg["sparse"], cfg["rows"], cfg["dim"])
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(1 + strategy.replica_id)
    # Zipf-like ids: a few popular rows shared by the replicas, a long tail of rare ones.
    ranks = torch.arange(1, cfg["rows"] + 1, dtype=torch.float64)
    probs = (1.0 / ranks) / (1.0 / ranks).sum()
    batches = [(torch.multinomial(probs, cfg["batch"] * cfg["bag"], replacement=True,
                                  generator=gen).view(cfg["batch"], cfg["bag"]),
                torch.randint(0, 2, (cfg["batch"],), generator=gen))
               for _ in range(cfg["steps"] + 5)]

    def step(ids: torch.Tensor, y: torch.Tensor) -> None:
        strategy.backward(F.cross_entropy(model(ids), y))
        opt.step()
        opt.zero_grad()

    for ids, y in batches[:5]:
        step(ids, y)
    strategy.comm.barrier()
    before = strategy.metrics()["bytes_sent"]
    t0 = time.perf_counter()
    for ids, y in batches[5:]:
        step(ids, y)
    strategy.comm.barrier()
    seconds = (time.perf_counter() - t0) / cfg["steps"]
    sent = (strategy.metrics()["bytes_sent"] - before) / cfg["steps"]
    strategy.close()
    return {"bytes_sent_per_step": sent, "step_ms": 1e3 * seconds}


def smoke_worker(jobs: list[dict[str, Any]], sparse_cfgs: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``--smoke``: the MNIST runs and the sparse ones in one process per worker."""
    return mnist_worker(jobs), [sparse_worker(cfg) for cfg in sparse_cfgs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    add_ledger_args(parser, smoke="1 seed, 2 steps of the first 2 rows, 2 sparse-embedding steps on "
                                  "1,000 rows, all in one launch")
    args = parser.parse_args(argv)
    out_dir = output_dir(args)
    max_steps = sparse_steps = None
    runs = RUNS
    if args.smoke:
        runs = RUNS[:2]
        args.epochs, args.seeds, args.workers, args.rows = 1, [0], 2, 1_000
        max_steps = sparse_steps = 2
    from stratagem.launcher import launch

    jobs = [{"strategy_args": strategy_args, "seed": seed, "epochs": args.epochs,
             "max_steps": max_steps} for _, strategy_args in runs for seed in args.seeds]
    sparse_cfgs = [{"sparse": sparse, "rows": args.rows, "dim": 32, "batch": 64, "bag": 8,
                    "steps": sparse_steps or 30} for sparse in (False, True)]
    sparse_out: list[dict[str, Any]] | None = None
    if args.smoke:  # one launch for everything: process start-up is most of a smoke
        mnist_out, sparse_out = launch(smoke_worker, nprocs=args.workers,
                                       args=(jobs, sparse_cfgs), timeout=600)[0]
    else:
        mnist_out = launch(mnist_worker, nprocs=args.workers, args=(jobs,), timeout=3600)[0]
    results = iter(mnist_out)
    rows: list[dict[str, Any]] = []
    for label, strategy_args in runs:
        per_seed = [next(results) for _ in args.seeds]
        accs = [r["accuracy"] for r in per_seed]
        row = {"run": label, "strategy_args": strategy_args, "accuracies": accs,
               "accuracy": statistics.mean(accs),
               "bytes_sent_per_step": statistics.mean(r["bytes_sent_per_step"] for r in per_seed),
               "skipped_steps": sum(r["skipped"] for r in per_seed),
               "wall_seconds": statistics.mean(r["wall_seconds"] for r in per_seed)}
        rows.append(row)
        print(f"{label}: accuracy {row['accuracy']:.4f} {[round(a, 4) for a in accs]}, "
              f"{row['bytes_sent_per_step']:,.0f} bytes sent/step", flush=True)
    base = rows[0]
    for row in rows:
        row["accuracy_delta_points"] = 100 * (row["accuracy"] - base["accuracy"])
        row["bytes_ratio"] = row["bytes_sent_per_step"] / base["bytes_sent_per_step"]

    sparse_rows = []
    for i, cfg in enumerate(sparse_cfgs):
        sparse = cfg["sparse"]
        res = (sparse_out[i] if sparse_out is not None else
               launch(sparse_worker, nprocs=args.workers, args=(cfg,), timeout=600)[0])
        sparse_rows.append({"embedding": "sparse=True" if sparse else "sparse=False (dense)",
                            **res})
        print(f"embedding sparse={sparse}: {res['bytes_sent_per_step']:,.0f} bytes sent/step, "
              f"{res['step_ms']:.2f} ms/step", flush=True)
    sparse_ratio = sparse_rows[1]["bytes_sent_per_step"] / sparse_rows[0]["bytes_sent_per_step"]

    md = ["# Mirrored: gradient compression, mixed precision, sparse gradients", "",
          f"MNIST-5k (4,000 train / 1,000 test), MLP 784-256-256-10, Adam lr 2e-3, global batch "
          f"128, {args.epochs} epochs, {args.workers} worker processes (gloo, CPU), seeds "
          f"{args.seeds}. Accuracy: mean test accuracy over seeds (per seed in brackets). "
          "Bytes: gradient bytes sent per step per worker as counted by the strategy "
          "(ring all-reduce payload; prepare's broadcast excluded).", "",
          "| run | test accuracy | Δ vs fp32 wire (points) | per seed | bytes sent/step | "
          "ratio | skipped steps |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['run']} | {r['accuracy']:.4f} | {r['accuracy_delta_points']:+.2f} | "
                  f"{', '.join(f'{a:.3f}' for a in r['accuracies'])} | "
                  f"{r['bytes_sent_per_step']:,.0f} | {r['bytes_ratio']:.3f} | "
                  f"{r['skipped_steps']} |")
    md += ["", f"Sparse gradients: `nn.Embedding({args.rows:,}, 32)` + linear head, bags of 8 "
           "Zipf-distributed ids, 64 samples per worker per step, SGD, 30 timed steps after 5 "
           "of warm-up.", "",
           "| embedding | bytes sent/step | ms/step |", "|---|---|---|"]
    for r in sparse_rows:
        md.append(f"| {r['embedding']} | {r['bytes_sent_per_step']:,.0f} | {r['step_ms']:.2f} |")
    md += ["", f"Sparse / dense bytes: {sparse_ratio:.4f}."]
    write_result("compression", {"mnist": rows, "sparse": sparse_rows,
                                 "sparse_over_dense_bytes": sparse_ratio}, md, out_dir=out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
