"""Mirrored vs raw DistributedDataParallel: step time with the same model, data and bucket
size, measured in the same processes in alternating blocks (so machine drift hits both).

    python benchmarks/mirrored_vs_ddp.py [--procs 2 4] [--steps 30] [--rounds 6]

Prints the Mirrored/DDP ratio of median step times per process count and writes
``benchmarks/results/mirrored_vs_ddp.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_ledger_args, output_dir, write_result  # noqa: E402


def _model(seed: int, width: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import stratagem as sg

    torch.set_num_threads(1)
    strategy = sg.Mirrored(bucket_cap_mb=cfg["bucket_cap_mb"])
    _ = strategy.comm  # joins the job (the default group) now: the Comm is joined on first use
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], 784, generator=gen)
    y = torch.randint(0, 10, (cfg["batch"],), generator=gen)

    mirrored_model = _model(0, cfg["width"])
    mirrored_opt = torch.optim.SGD(mirrored_model.parameters(), lr=0.01)
    mirrored_model, mirrored_opt = strategy.prepare(mirrored_model, mirrored_opt)

    raw = _model(0, cfg["width"])
    ddp = DDP(raw, bucket_cap_mb=cfg["bucket_cap_mb"])
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def mirrored_step() -> None:
        loss = F.cross_entropy(mirrored_model(x), y)
        strategy.backward(loss)
        mirrored_opt.step()
        mirrored_opt.zero_grad()

    def ddp_step() -> None:
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()

    raw_checked = _model(0, cfg["width"])
    ddp_checked = DDP(raw_checked, bucket_cap_mb=cfg["bucket_cap_mb"])
    checked_opt = torch.optim.SGD(ddp_checked.parameters(), lr=0.01)

    def ddp_checked_step() -> None:
        # Raw DDP plus the one thing Mirrored's step does that DDP's does not: the
        # non-finite gradient check (on_nonfinite="raise"), written as Mirrored writes it.
        loss = F.cross_entropy(ddp_checked(x), y)
        loss.backward()
        grads = [p.grad for p in ddp_checked.parameters() if p.grad is not None]
        if not bool(torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in grads])).all()):
            raise FloatingPointError("non-finite gradient")
        checked_opt.step()
        checked_opt.zero_grad()

    raw_view = _model(0, cfg["width"])
    ddp_view = DDP(raw_view, bucket_cap_mb=cfg["bucket_cap_mb"], gradient_as_bucket_view=True)
    view_opt = torch.optim.SGD(ddp_view.parameters(), lr=0.01)

    def ddp_view_step() -> None:
        # Raw DDP configured as Mirrored configures it (gradients as views of the buckets),
        # without the non-finite check: what the strategy's own machinery costs.
        loss = F.cross_entropy(ddp_view(x), y)
        loss.backward()
        view_opt.step()
        view_opt.zero_grad()

    def block(step_fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            step_fn()
        dist.barrier()
        return (time.perf_counter() - t0) / cfg["steps"]

    arms = {"mirrored": mirrored_step, "ddp": ddp_step}
    if cfg["attribute"]:
        arms["ddp_checked"] = ddp_checked_step
        arms["ddp_view"] = ddp_view_step
    for fn in arms.values():  # warm-up
        block(fn)
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(cfg["rounds"]):
        # Rotate the order each round: no arm always runs first (or right after another).
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(block(arms[name]))
    metrics = strategy.metrics()
    return {**times, "bytes_sent": metrics["bytes_sent"], "steps": metrics["steps"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--attribute", action="store_true",
                        help="add two arms: raw DDP plus Mirrored's non-finite gradient check, "
                             "and raw DDP with gradient_as_bucket_view=True as Mirrored builds "
                             "it, to show what the gap is made of")
    add_ledger_args(parser, smoke="2 processes, 1 round of 2 steps, width 64")
    args = parser.parse_args(argv)
    if args.smoke:
        args.procs, args.steps, args.rounds, args.width = [2], 2, 1, 64
    out_dir = output_dir(args)
    from stratagem.launcher import launch

    rows = []
    for procs in args.procs:
        cfg = {"steps": args.steps, "rounds": args.rounds, "width": args.width, "batch": args.batch,
               "bucket_cap_mb": args.bucket_cap_mb, "attribute": args.attribute}
        results = launch(worker, nprocs=procs, args=(cfg,))
        # A step ends when the slowest rank ends it: the chief's block times include barriers.
        m = statistics.median(results[0]["mirrored"])
        d = statistics.median(results[0]["ddp"])
        # Each round runs both blocks back to back, so a per-round ratio cancels machine drift;
        # its median is the figure we quote.
        ratios = [a / b for a, b in zip(results[0]["mirrored"], results[0]["ddp"])]
        ratio = statistics.median(ratios)
        rows.append({"procs": procs, "mirrored_ms": 1e3 * m, "ddp_ms": 1e3 * d, "ratio": ratio,
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "bytes_sent_per_step": results[0]["bytes_sent"] / max(1, results[0]["steps"])})
        if args.attribute:
            checked = [a / b for a, b in zip(results[0]["ddp_checked"], results[0]["ddp"])]
            vs_checked = [a / b for a, b in zip(results[0]["mirrored"], results[0]["ddp_checked"])]
            rows[-1].update({
                "ddp_checked_ms": 1e3 * statistics.median(results[0]["ddp_checked"]),
                "check_ratio": statistics.median(checked),
                "check_ratio_min": min(checked), "check_ratio_max": max(checked),
                "vs_checked_ratio": statistics.median(vs_checked),
                "vs_checked_min": min(vs_checked), "vs_checked_max": max(vs_checked)})
            vs_view = [a / b for a, b in zip(results[0]["mirrored"], results[0]["ddp_view"])]
            rows[-1].update({
                "ddp_view_ms": 1e3 * statistics.median(results[0]["ddp_view"]),
                "vs_view_ratio": statistics.median(vs_view),
                "vs_view_min": min(vs_view), "vs_view_max": max(vs_view)})
        print(f"{procs} procs: Mirrored {1e3 * m:.2f} ms/step, DDP {1e3 * d:.2f} ms/step, "
              f"ratio {ratio:.3f} (median of per-round ratios; range {min(ratios):.3f}.."
              f"{max(ratios):.3f})", flush=True)
        if args.attribute:
            r = rows[-1]
            print(f"  DDP + non-finite check {r['ddp_checked_ms']:.2f} ms/step: "
                  f"(DDP+check)/DDP {r['check_ratio']:.3f} ({r['check_ratio_min']:.3f}.."
                  f"{r['check_ratio_max']:.3f}); Mirrored/(DDP+check) {r['vs_checked_ratio']:.3f} "
                  f"({r['vs_checked_min']:.3f}..{r['vs_checked_max']:.3f})", flush=True)
            print(f"  DDP with gradient_as_bucket_view {r['ddp_view_ms']:.2f} ms/step: "
                  f"Mirrored/(DDP view) {r['vs_view_ratio']:.3f} ({r['vs_view_min']:.3f}.."
                  f"{r['vs_view_max']:.3f})", flush=True)
    params = sum(p.numel() for p in _model(0, args.width).parameters())
    md = ["# Mirrored vs raw DDP step time", "",
          f"Model: MLP 784-{args.width}-{args.width}-10 ({params:,} parameters), per-replica batch "
          f"{args.batch}, bucket_cap_mb={args.bucket_cap_mb}, gloo on CPU, {args.rounds} alternating "
          f"rounds of {args.steps} steps after a warm-up; ms/step are medians, the ratio is the median "
          "of the per-round Mirrored/DDP ratios.", "",
          "| processes | Mirrored ms/step | DDP ms/step | Mirrored/DDP (median per-round) | per-round range |",
          "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['procs']} | {r['mirrored_ms']:.2f} | {r['ddp_ms']:.2f} | {r['ratio']:.3f} | "
                  f"{r['ratio_min']:.3f}..{r['ratio_max']:.3f} |")
    if args.attribute:
        md += ["", "Attribution: two more arms. DDP+check: raw DDP plus the non-finite gradient "
               "check that Mirrored runs at every step (`on_nonfinite=\"raise\"`, one sum per "
               "gradient). DDP view: raw DDP with `gradient_as_bucket_view=True`, as Mirrored "
               "builds it, without the check.", "",
               "| processes | DDP+check ms/step | (DDP+check)/DDP | range | Mirrored/(DDP+check) | range | DDP view ms/step | Mirrored/(DDP view) | range |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            md.append(f"| {r['procs']} | {r['ddp_checked_ms']:.2f} | {r['check_ratio']:.3f} | "
                      f"{r['check_ratio_min']:.3f}..{r['check_ratio_max']:.3f} | "
                      f"{r['vs_checked_ratio']:.3f} | {r['vs_checked_min']:.3f}..{r['vs_checked_max']:.3f} | "
                      f"{r['ddp_view_ms']:.2f} | {r['vs_view_ratio']:.3f} | "
                      f"{r['vs_view_min']:.3f}..{r['vs_view_max']:.3f} |")
    write_result("mirrored_vs_ddp", rows, md, out_dir=out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
