"""Sharded (FSDP2) vs Mirrored memory, and Sharded vs hand-written FSDP2 step time.

    python benchmarks/sharded_memory.py [--procs 2 4] [--layers 14] [--rounds 6] [--steps 2]

A GPT-style transformer (tied embedding / output head, pre-norm blocks; 105 M parameters at
the defaults) trained with AdamW on 2 and 4 processes (gloo, CPU):

- **Memory** (one launch per strategy, so peak RSS belongs to one strategy): per-rank bytes
  of parameters + gradients + optimizer state, counted from the tensors this rank holds (the
  local shards under Sharded), after ``--steps`` steps; the process's peak RSS (VmHWM) and its
  RSS after those steps (VmRSS). Sharded is measured twice: the model built on the CPU (the
  peak then includes the full model every worker builds before ``prepare`` shards it) and
  built under ``torch.device("meta")`` (``prepare`` materialises only the shards, with the
  same values from the same seed). Sharded runs with its default ``release_host_memory=True`` (glibc
  returns freed blocks of 1 MiB or more to the OS; without it the per-step gathered buffers
  fragment the heap and resident memory grows to Mirrored's level); Mirrored leaves the
  allocator alone.
- **Step time**: ``sg.Sharded`` against raw ``fully_shard`` written by hand (same units: each
  block, then the root; same AdamW), in the same processes (so under the same allocator
  setting), rounds alternating ABBA; the ratio is the median of the per-round Sharded/raw
  ratios.

Writes ``benchmarks/results/sharded_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
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


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # GPT's tie

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]


def _build(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=cfg["vocab"], width=cfg["width"], layers=cfg["layers"], heads=cfg["heads"],
               seq=cfg["seq"])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds: parameters, gradients, optimizer state (local shards)."""
    params = {id(p): p for p in model.parameters()}.values()
    nb = {"params": sum(_local(p).numel() * p.element_size() for p in params),
          "grads": sum(_local(p.grad).numel() * p.grad.element_size()
                       for p in params if p.grad is not None),
          "optimizer": sum(_local(v).numel() * v.element_size()
                           for s in opt.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor))}
    nb["total"] = nb["params"] + nb["grads"] + nb["optimizer"]
    return nb


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> dict[str, int]:
    """Peak RSS (VmHWM), RSS now, and RSS once glibc returned the memory it keeps after
    frees (``malloc_trim``): the full model built before ``prepare`` and freed by sharding
    otherwise stays counted."""
    out = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "rss": _vm_rss()}
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: report the untrimmed value
        pass
    out["rss_trimmed"] = _vm_rss()
    return out


def _batch(cfg: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def memory_worker(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    import stratagem as sg

    torch.set_num_threads(1)
    strategy = sg.Mirrored() if kind == "mirrored" else sg.Sharded()
    x, y = _batch(cfg, strategy.replica_id)
    if kind == "sharded-meta":  # built on the meta device: prepare materialises the shards
        with torch.device("meta"):
            model = _build(cfg)
        torch.manual_seed(0)  # the same values as the eager build (reset_parameters draws)
    else:
        model = _build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = strategy.prepare(model, opt)
    for _ in range(cfg["steps"]):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        strategy.backward(loss)
        opt.step()
    # Before zero_grad: the gradients are part of what a step holds.
    result = {**_bytes(strategy.unwrap(model), opt), **_rss()}
    opt.zero_grad()
    strategy.close()
    return result


def all_kinds_worker(cfg: dict[str, Any], kinds: list[str]) -> dict[str, dict[str, Any]]:
    """``--smoke``: every kind in one process, one after the other (saves two launches; the
    peak RSS is then the process's, not one strategy's)."""
    return {kind: memory_worker(cfg, kind) for kind in kinds}


def time_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import stratagem as sg

    torch.set_num_threads(1)
    strategy = sg.Sharded()
    rank = strategy.replica_id  # joins the job: initialises the default process group
    x, y = _batch(cfg, rank)

    model = _build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = strategy.prepare(model, opt)

    raw = _build(cfg)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for block in raw.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(raw, mesh=mesh)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)

    def sharded_step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()

    def raw_step() -> None:
        loss = F.cross_entropy(raw(x).flatten(0, 1), y.flatten())
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()

    def block(step_fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["round_steps"]):
            step_fn()
        dist.barrier()
        return (time.perf_counter() - t0) / cfg["round_steps"]

    sharded_step(), raw_step()  # warm-up: allocations, first all-gathers
    times: dict[str, list[float]] = {"sharded": [], "raw": []}
    for r in range(cfg["rounds"]):
        order = ("sharded", "raw") if r % 2 == 0 else ("raw", "sharded")  # ABBA
        for name in order:
            times[name].append(block(sharded_step if name == "sharded" else raw_step))
    strategy.close()
    return times


def main(argv: list[str] | None = None) -> int:
    from stratagem.launcher import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per replica")
    parser.add_argument("--steps", type=int, default=2, help="steps before counting memory")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--round-steps", type=int, default=2)
    parser.add_argument("--skip-timing", action="store_true")
    add_ledger_args(parser, smoke="2 processes, a 1-block model of width 32, 1 step, the three "
                                  "strategies in one launch, no timing")
    args = parser.parse_args(argv)
    if args.smoke:
        args.procs, args.layers, args.width, args.vocab, args.heads = [2], 1, 32, 64, 2
        args.seq, args.batch, args.steps, args.skip_timing = 8, 1, 1, True
    out_dir = output_dir(args)
    cfg = {"vocab": args.vocab, "width": args.width, "layers": args.layers, "heads": args.heads,
           "seq": args.seq, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
           "round_steps": args.round_steps}
    numel = sum(p.numel() for p in _build(cfg).parameters())
    rows: list[dict[str, Any]] = []
    for procs in args.procs:
        kinds = ["mirrored", "sharded", "sharded-meta"]
        if args.smoke:
            together = launch(all_kinds_worker, nprocs=procs, args=(cfg, kinds))
            mem = {kind: [r[kind] for r in together] for kind in kinds}
        else:
            mem = {kind: launch(memory_worker, nprocs=procs, args=(cfg, kind)) for kind in kinds}
        row: dict[str, Any] = {"procs": procs}
        for kind, results in mem.items():
            row[kind] = {"bytes_max": max(r["total"] for r in results),
                         "params_max": max(r["params"] for r in results),
                         "grads_max": max(r["grads"] for r in results),
                         "optimizer_max": max(r["optimizer"] for r in results),
                         "peak_rss_max": max(r["peak_rss"] for r in results),
                         "rss_max": max(r["rss"] for r in results),
                         "rss_trimmed_max": max(r["rss_trimmed"] for r in results)}
        row["bytes_ratio"] = row["sharded"]["bytes_max"] / row["mirrored"]["bytes_max"]
        row["bytes_ratio_x_n"] = row["bytes_ratio"] * procs
        row["peak_rss_ratio"] = row["sharded"]["peak_rss_max"] / row["mirrored"]["peak_rss_max"]
        row["peak_rss_ratio_meta"] = (row["sharded-meta"]["peak_rss_max"]
                                      / row["mirrored"]["peak_rss_max"])
        row["rss_ratio"] = row["sharded"]["rss_max"] / row["mirrored"]["rss_max"]
        row["rss_trimmed_ratio"] = (row["sharded"]["rss_trimmed_max"]
                                    / row["mirrored"]["rss_trimmed_max"])
        if not args.skip_timing:
            times = launch(time_worker, nprocs=procs, args=(cfg,))[0]
            ratios = [a / b for a, b in zip(times["sharded"], times["raw"])]
            row["sharded_s_per_step"] = statistics.median(times["sharded"])
            row["raw_fsdp2_s_per_step"] = statistics.median(times["raw"])
            row["time_ratio_median"] = statistics.median(ratios)
            row["time_ratio_range"] = [min(ratios), max(ratios)]
        rows.append(row)
        print(json.dumps(row), flush=True)

    meta = {"parameters": numel, "config": cfg, "cpus": os.cpu_count(),
            "torch": torch.__version__}
    mib = 1 << 20
    lines = [
        "# Sharded (FSDP2) vs Mirrored memory; Sharded vs hand-written FSDP2 step time", "",
        f"Model: GPT-style transformer, {numel:,} parameters ({cfg['layers']} blocks of width "
        f"{cfg['width']}, vocab {cfg['vocab']}, tied head), AdamW, {cfg['batch']} sequences of "
        f"{cfg['seq']} tokens per replica, gloo on CPU ({os.cpu_count()} cores). Bytes are "
        "parameters + gradients + optimizer state held by the rank (local shards), after "
        f"{cfg['steps']} steps, max over ranks; RSS from /proc (peak = VmHWM; S = Sharded with "
        "the model built on the CPU, so the peak includes the full model each worker builds "
        "before prepare shards it; S-meta = built under torch.device('meta'), prepare "
        "materialises only the shards; after = VmRSS after the steps; trimmed = "
        "VmRSS after glibc's malloc_trim returned freed memory, the process's torch baseline "
        "included). "
        f"Step time: {cfg['rounds']} alternating (ABBA) rounds of {cfg['round_steps']} steps, "
        "ratio = median of per-round Sharded/raw ratios.", "",
        "| processes | Mirrored MiB/rank | Sharded MiB/rank | ratio | ratio × N (target ≤ 1.1) "
        "| peak RSS MiB M / S / S-meta | peak RSS ratio S / S-meta | RSS after MiB M / S "
        "| trimmed RSS MiB M / S | Sharded s/step | raw FSDP2 s/step | Sharded/raw (median) "
        "| per-round range |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, s = r["mirrored"], r["sharded"]
        timing = (f"{r['sharded_s_per_step']:.2f} | {r['raw_fsdp2_s_per_step']:.2f} | "
                  f"{r['time_ratio_median']:.3f} | {r['time_ratio_range'][0]:.3f}.."
                  f"{r['time_ratio_range'][1]:.3f}") if "time_ratio_median" in r else "- | - | - | -"
        lines.append(
            f"| {r['procs']} | {m['bytes_max'] / mib:.0f} | {s['bytes_max'] / mib:.0f} | "
            f"{r['bytes_ratio']:.3f} | {r['bytes_ratio_x_n']:.3f} | {m['peak_rss_max'] / mib:.0f} / "
            f"{s['peak_rss_max'] / mib:.0f} / {r['sharded-meta']['peak_rss_max'] / mib:.0f} | "
            f"{r['peak_rss_ratio']:.2f} / {r['peak_rss_ratio_meta']:.2f} | "
            f"{m['rss_max'] / mib:.0f} / {s['rss_max'] / mib:.0f} | "
            f"{m['rss_trimmed_max'] / mib:.0f} / {s['rss_trimmed_max'] / mib:.0f} | {timing} |")
    write_result("sharded_memory", {"meta": meta, "rows": rows}, lines, out_dir=out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
