"""Strategy overhead on a GPU: stratagem's step against the plain PyTorch step on the same
model, data and device, in alternating blocks of one run (so drift hits both).

    python benchmarks/gpu.py [--steps 50] [--rounds 10] [--width 4096] [--smoke] [--out-dir DIR]

Rows: ``OneDevice`` vs a plain loop under fp32, bf16 (``torch.autocast``) and fp16
(``torch.amp.GradScaler``); and, when the machine has two GPUs or more, ``Mirrored`` vs raw
``DistributedDataParallel`` over NCCL in 2 processes. Prints the median of the per-round
ratios with their range and writes ``gpu.json`` / ``gpu.md`` to ``benchmarks/results`` (or
``--out-dir``). ``--smoke``: 2 steps, 1 round, width 256, output to a temporary folder. Needs
CUDA: without it, says so and exits 2, or with ``--smoke`` prints ``skipped: no CUDA`` and
exits 0 (there is no CPU path to check: every row times CUDA work).
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


def _model(width: int) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _median_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    ratios = [x / y for x, y in zip(a, b)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _timed(cfg: dict[str, Any], ours: Any, theirs: Any, sync: Any) -> tuple[list[float],
                                                                          list[float]]:
    """Seconds per step of ``ours`` and ``theirs`` in alternating blocks after a warm-up."""
    def block(fn: Any) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            fn()
        sync()
        return (time.perf_counter() - t0) / cfg["steps"]

    block(ours), block(theirs)  # warm-up
    a: list[float] = []
    b: list[float] = []
    for r in range(cfg["rounds"]):
        for fn in ((ours, theirs) if r % 2 == 0 else (theirs, ours)):
            (a if fn is ours else b).append(block(fn))
    return a, b


def one_device_row(cfg: dict[str, Any], precision: str) -> dict[str, Any]:
    import stratagem as sg

    device = torch.device("cuda")
    x = torch.randn(cfg["batch"], 1024, device=device)
    y = torch.randint(0, 10, (cfg["batch"],), device=device)
    strategy = sg.OneDevice(device=device, precision=precision)
    model = _model(cfg["width"])
    model, opt = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    plain = _model(cfg["width"]).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def ours() -> None:
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    def theirs() -> None:
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(plain(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(plain_opt)
            scaler.update()
        else:
            loss.backward()
            plain_opt.step()
        plain_opt.zero_grad()

    a, b = _timed(cfg, ours, theirs, torch.cuda.synchronize)
    med, lo, hi = _median_ratio(a, b)
    row = {"case": f"OneDevice {precision} vs plain PyTorch", "ours_ms":
           1e3 * statistics.median(a), "plain_ms": 1e3 * statistics.median(b),
           "ratio": med, "ratio_min": lo, "ratio_max": hi,
           "skipped_steps": strategy.metrics()["skipped_steps"]}
    strategy.close()
    return row


def _mirrored_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stratagem as sg

    strategy = sg.Mirrored()  # NCCL: one GPU per process
    device = strategy.device
    model = _model(cfg["width"])
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    ddp = DDP(_model(cfg["width"]).to(device), device_ids=[device.index])
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(cfg["batch"], 1024, device=device)
    y = torch.randint(0, 10, (cfg["batch"],), device=device)

    def ours() -> None:
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    def theirs() -> None:
        F.cross_entropy(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    def sync() -> None:
        dist.barrier()
        torch.cuda.synchronize()

    a, b = _timed(cfg, ours, theirs, sync)
    strategy.close()
    return {"ours": a, "theirs": b}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", dest="out_dir", help=argparse.SUPPRESS)  # the old --out-dir
    add_ledger_args(p, smoke="2 steps, 1 round, width 256; without CUDA: skipped, exit 0")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        if args.smoke:
            print("skipped: no CUDA (benchmarks/gpu.py times CUDA work only)")
            return 0
        print("benchmarks/gpu.py needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    cfg = {"steps": 2 if args.smoke else args.steps, "rounds": 1 if args.smoke else args.rounds,
           "width": 256 if args.smoke else args.width, "batch": args.batch}
    out = output_dir(args)
    rows = [one_device_row(cfg, precision) for precision in ("fp32", "bf16", "fp16")]
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        from stratagem.launcher import launch

        res = launch(_mirrored_worker, nprocs=2, args=(cfg,), timeout=600)
        med, lo, hi = _median_ratio(res[0]["ours"], res[0]["theirs"])
        rows.append({"case": "Mirrored vs DDP, NCCL, 2 processes", "ours_ms":
                     1e3 * statistics.median(res[0]["ours"]), "plain_ms":
                     1e3 * statistics.median(res[0]["theirs"]), "ratio": med,
                     "ratio_min": lo, "ratio_max": hi})
    host = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda}
    md = [f"# Strategy overhead on a GPU\n\nHost: {host['gpu']} x{gpus}, torch {host['torch']} "
          f"(CUDA {host['cuda']}). MLP 1024-{cfg['width']}-{cfg['width']}-10, batch "
          f"{cfg['batch']}, {cfg['rounds']} alternating rounds of {cfg['steps']} steps after a "
          f"warm-up; the ratio is the median of the per-round ratios.\n",
          "| case | stratagem ms/step | plain ms/step | ratio (median) | per-round range |",
          "|---|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['case']} | {r['ours_ms']:.3f} | {r['plain_ms']:.3f} | "
                  f"{r['ratio']:.3f} | {r['ratio_min']:.3f}..{r['ratio_max']:.3f} |")
    if gpus < 2:
        md.append("\nMirrored vs DDP over NCCL needs two GPUs: not run (one GPU here).")
    write_result("gpu", {"host": host, "rows": rows}, md, out_dir=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
