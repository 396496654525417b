"""DiLoCo's outer synchronisation compressed and overlapped: bytes, time to a validation loss.

    python benchmarks/diloco_compression.py [--seeds 3] [--links 20mbit,100mbit] [--quick]

The character-level GPT and harness of ``benchmarks/lm.py`` (same model, data, AdamW inner
optimizer, learning rate, global batch 64 over 4 workers, evaluation of the consensus model
every 8 steps, stop at the target loss), on shaped links (each worker in its own network
namespace behind a veth capped both ways with ``tc tbf``; ``stratagem.testing.netns``).
Rows, side by side in one run (same seeds, same data order):

- ``mirrored``: gradients all-reduced every step (the baseline of ``lm.py``);
- ``diloco``: DiLoCo, period 32, outer Nesterov lr 1.0 / momentum 0.3 (``lm.py``'s tuning),
  fp32 pseudo-gradients;
- ``diloco-bf16``, ``diloco-int8``, ``diloco-int4``: the same with ``compression=`` (int8 /
  int4: blockwise, one fp32 scale per 128 values, quantized reduce-scatter + all-gather,
  error feedback; ``Comm.all_reduce_quantized``);
- ``diloco-topk``: SparseLoCo (Sarfi et al. 2025), ``compression="topk"``: per 4096-value
  chunk the 2 % largest entries of pseudo-gradient + residual, 2-bit values, uint16 indices,
  one all-gather of the payloads (``Comm.all_reduce_topk``), error feedback; not in the default
  grid (``--strategies diloco,diloco-int4,diloco-topk``);
- ``streaming-int4``: Streaming DiLoCo (Douillard et al. 2025): ``fragments=4`` (a quarter of
  the model every 8 steps), ``sync_delay=2`` (each fragment's all-reduce runs in the
  background for 2 inner steps), ``alpha=0.5``, int4.

Columns: bytes per outer step (one full-model synchronisation: worker 0's bytes sent +
received as the Comm counts them on the wire, payload + scales, less ``prepare``'s broadcast
of the model, divided by the number of full-model syncs), time to the target validation loss (training wall-clock, evaluation
pauses excluded), final validation loss (DiLoCo rows train on to ``--max-steps`` after the
target so that final losses compare at the same step; Mirrored stops at the target), and the
seconds worker 0's training thread waited on
the outer all-reduces (DiLoCo's ``outer_wait_seconds``; for Mirrored, DDP's all-reduce
overlaps the backward inside C++ and is not timed). Medians over seeds; ratios against
DiLoCo fp32 on the same link and seed are computed from runs made side by side in one
invocation (the machine is shared, so absolute seconds are noisy).

Writes ``benchmarks/results/diloco_compression.{json,md}``. Done-when targets:
int4 <= 0.14x and int8 <= 0.27x DiLoCo fp32's bytes per outer step; final validation loss
within 1 % of DiLoCo fp32; streaming + int4 reaches the target in <= 0.6x DiLoCo fp32's wall
time at 20 Mbit/s with the workers waiting on communication < 10 % of the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import lm  # noqa: E402 - the worker, the job runner and the model of benchmarks/lm.py
from _common import (  # noqa: E402
    add_ledger_args,
    choose,
    output_dir,
    rewrite_from_json,
    run_matrix,
    shaped_links_usable,
    split_list,
    write_outputs,
)
from convergence import _fmt, _median  # noqa: E402

_DILOCO = {"period": 32, "outer_lr": 1.0, "outer_momentum": 0.3}
#: name -> (registry name, strategy arguments, needs a PS shard, synchronous)
STRATEGIES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "mirrored": ("mirrored", {}, False, True),
    "diloco": ("diloco", dict(_DILOCO), False, True),
    "diloco-bf16": ("diloco", {**_DILOCO, "compression": "bf16"}, False, True),
    "diloco-int8": ("diloco", {**_DILOCO, "compression": "int8"}, False, True),
    "diloco-int4": ("diloco", {**_DILOCO, "compression": "int4"}, False, True),
    "streaming-int4": ("diloco", {**_DILOCO, "compression": "int4", "fragments": 4,
                                  "sync_delay": 2, "alpha": 0.5}, False, True),
}
#: Not in the default grid: Streaming DiLoCo without the local mix (alpha 0: a landed fragment
#: replaces the local one), to separate the effect of alpha from that of the overlap.
EXTRA: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "streaming-int4-a0": ("diloco", {**_DILOCO, "compression": "int4", "fragments": 4,
                                     "sync_delay": 2, "alpha": 0.0}, False, True),
    # SparseLoCo: top-k 2 % at 2 bits, error feedback.
    "diloco-topk": ("diloco", {**_DILOCO, "compression": "topk"}, False, True),
    # Fragments without overlap: separates fragmenting (and its lagging consensus) from tau.
    "streaming-int4-sync": ("diloco", {**_DILOCO, "compression": "int4", "fragments": 4},
                            False, True),
}
DEFAULT_ROWS = list(STRATEGIES)
STRATEGIES.update(EXTRA)
QUICK_STRATEGIES = ["diloco", "diloco-int4", "streaming-int4"]
BASELINE = "diloco"


def _full_syncs(run: dict[str, Any]) -> float | None:
    """Full-model synchronisations in a run (outer steps / fragments; Mirrored: steps)."""
    args = run["strategy_args"]
    if run.get("outer_steps") is None:
        return float(run["steps"]) if run["strategy"] == "mirrored" else None
    return run["outer_steps"] / int(args.get("fragments", 1))


def summarize(runs: list[dict[str, Any]], strategies: list[str], links: list[str]
              ) -> list[dict[str, Any]]:
    rows = []
    for link in links:
        base = {r["seed"]: r for r in runs if r["strategy"] == BASELINE and r["link"] == link
                and r.get("error") is None}
        base_bytes = None
        for key in strategies:
            rs = [r for r in runs if r["strategy"] == key and r["link"] == link]
            ok = [r for r in rs if r.get("error") is None]
            row: dict[str, Any] = {"strategy": key, "link": link, "runs": len(rs),
                                   "errors": [r["error"] for r in rs if r.get("error")],
                                   "reached": sum(1 for r in ok if r["reached"])}
            per_sync = []
            for r in ok:
                syncs = _full_syncs(r)
                if syncs:
                    total = r["bytes_per_step"] * r["steps"] - (r.get("setup_bytes") or 0)
                    per_sync.append(total / syncs)
            row["bytes_per_outer_step"] = _median(per_sync) if per_sync else math.nan
            row["bytes_per_step"] = _median([r["bytes_per_step"] for r in ok])
            row["median_wall"] = _median([r["reached"]["wall"] if r["reached"] else math.inf
                                          for r in ok])
            row["median_steps"] = _median([r["reached"]["step"] if r["reached"] else math.inf
                                           for r in ok])
            row["final_val_loss"] = _median([r["final_val_loss"] for r in ok])
            waits = [r["outer_wait_seconds"] for r in ok if r.get("outer_wait_seconds") is not None]
            row["wait_seconds"] = _median(waits) if waits else math.nan
            row["wait_fraction"] = _median(
                [r["outer_wait_seconds"] / r["wall_seconds"] for r in ok
                 if r.get("outer_wait_seconds") is not None and r["wall_seconds"] > 0]
            ) if waits else math.nan
            # Per seed, against DiLoCo fp32 of the same seed and link (run side by side).
            wall_ratios, loss_ratios = [], []
            for r in ok:
                b = base.get(r["seed"])
                if b is None:
                    continue
                if r["reached"] and b["reached"]:
                    wall_ratios.append(r["reached"]["wall"] / b["reached"]["wall"])
                loss_ratios.append(r["final_val_loss"] / b["final_val_loss"])
            row["wall_vs_diloco_per_seed"] = wall_ratios
            row["wall_vs_diloco"] = _median(wall_ratios) if wall_ratios else math.nan
            row["loss_vs_diloco"] = _median(loss_ratios) if loss_ratios else math.nan
            if key == BASELINE:
                base_bytes = row["bytes_per_outer_step"]
            rows.append(row)
        for row in rows:
            if row["link"] == link:
                row["bytes_vs_diloco"] = (row["bytes_per_outer_step"] / base_bytes
                                          if base_bytes else math.nan)
    return rows


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    for link in sorted({r["link"] for r in rows}):
        by = {r["strategy"]: r for r in rows if r["link"] == link}
        for key, limit in (("diloco-int4", 0.14), ("diloco-int8", 0.27), ("diloco-topk", 0.05)):
            r = by.get(key)
            if r is not None and math.isfinite(r.get("bytes_vs_diloco", math.nan)):
                ok = r["bytes_vs_diloco"] <= limit
                notes.append(f"{link}: {key} moves {r['bytes_vs_diloco']:.3f}x DiLoCo fp32's "
                             f"bytes per outer step (target <= {limit}: "
                             f"{'met' if ok else 'NOT met'}).")
        for key in ("diloco-bf16", "diloco-int8", "diloco-int4", "diloco-topk",
                    "streaming-int4"):
            r = by.get(key)
            if r is not None and math.isfinite(r.get("loss_vs_diloco", math.nan)):
                ok = abs(r["loss_vs_diloco"] - 1) <= 0.01
                notes.append(f"{link}: {key} final val loss {r['final_val_loss']:.3f} = "
                             f"{r['loss_vs_diloco']:.4f}x DiLoCo fp32's (median of per-seed "
                             f"ratios; target within 1 %: {'met' if ok else 'NOT met'}).")
    r = next((r for r in rows if r["strategy"] == "streaming-int4" and r["link"] == "20mbit"),
             None)
    if r is not None:
        ratio, frac = r["wall_vs_diloco"], r["wait_fraction"]
        ok = math.isfinite(ratio) and ratio <= 0.6
        notes.append(f"20mbit: streaming + int4 reaches the target in "
                     f"{_fmt(ratio, '.2f')}x DiLoCo fp32's wall time (per seed "
                     f"{', '.join(f'{x:.2f}' for x in r['wall_vs_diloco_per_seed'])}; target "
                     f"<= 0.6x: {'met' if ok else 'NOT met'}); its training thread waited on "
                     f"communication {_fmt(100 * frac, '.1f')} % of the wall time (target "
                     f"< 10 %: {'met' if math.isfinite(frac) and frac < 0.1 else 'NOT met'}).")
    return notes


def _streaming_delay(meta: dict[str, Any]) -> int:
    """The streaming rows' sync_delay in this run (lowered below period // fragments)."""
    for args in meta.get("strategies", {}).values():
        if "sync_delay" in args:
            return int(args["sync_delay"])
    return 2


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    target = meta["target"]
    lines = [
        f"# DiLoCo's outer synchronisation compressed and overlapped (char-level GPT, "
        f"{meta['workers']} workers)",
        "",
        f"Model, data and inner training of `benchmarks/lm.py` (GPT {meta['model']}, "
        f"{meta['num_parameters']:,} parameters, AdamW lr {lm.LR}, global batch "
        f"{lm.GLOBAL_BATCH}). DiLoCo: period {meta.get('period', _DILOCO['period'])}, outer Nesterov lr 1.0, "
        "momentum 0.3. "
        "int8/int4: blockwise absmax quantization, one fp32 scale per 128 values, quantized "
        "reduce-scatter (all-to-all) + fp32 sum + re-quantized all-gather, error feedback. "
        f"streaming-int4: fragments 4, sync_delay {_streaming_delay(meta)}, alpha 0.5, int4 "
        "(-a0: alpha 0; -sync: sync_delay 0). "
        "diloco-topk: top-k 2 % per 4096-value chunk, 2-bit values + uint16 indices + one fp32 "
        "scale per chunk, all-gather of the payloads, error feedback (SparseLoCo). "
        "Evaluation of the "
        f"consensus every {meta['eval_every']} steps; DiLoCo rows train {meta['max_steps']} "
        f"steps (final val loss at that step; wall to {target} = first evaluation at or below "
        f"it), Mirrored stops at {target} (or after {meta['max_wall']:g} s). Medians over "
        f"seeds {meta['seeds_per_link']} per link. Bytes/outer step = worker 0's bytes sent + "
        "received per full-model synchronisation, as counted by the Comm (payload + "
        "scales; prepare's broadcast of the model left out); Mirrored: per step. Wait = "
        "seconds worker 0's training thread was blocked "
        "on outer all-reduces. Ratios vs DiLoCo fp32 are per seed (same seed, same link, "
        "run back to back in this invocation), then the median.",
        "",
        "Links: `Nmbit` = each worker in its own network namespace, veth to a bridge, `tc tbf "
        f"rate N burst 64kb latency 100ms` both ways. Machine: {meta['cpus']} CPUs shared "
        f"with other jobs (load average at start {meta['loadavg_start']}).",
        "",
        f"Command: `{meta['command']}` ({meta['total_minutes']:.1f} min)",
        "",
        f"| row | link | reached | bytes/outer step | vs fp32 | wall s to {target} | "
        f"vs fp32 | steps to {target} | final val loss | vs fp32 | wait s | wait/wall |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        failed = f" ({len(r['errors'])} failed)" if r["errors"] else ""
        wait = "n/a (DDP)" if r["strategy"] == "mirrored" else _fmt(r["wait_seconds"], ".2f")
        frac = ("n/a" if r["strategy"] == "mirrored"
                else _fmt(100 * r["wait_fraction"], ".1f") + " %")
        lines.append(
            f"| {r['strategy']} | {r['link']} | {r['reached']}/{r['runs']}{failed} | "
            f"{_fmt(r['bytes_per_outer_step'], ',.0f')} | {_fmt(r['bytes_vs_diloco'], '.3f')} | "
            f"{_fmt(r['median_wall'], '.1f')} | {_fmt(r['wall_vs_diloco'], '.2f')} | "
            f"{_fmt(r['median_steps'], '.0f')} | {_fmt(r['final_val_loss'], '.3f')} | "
            f"{_fmt(r['loss_vs_diloco'], '.4f')} | {wait} | {frac} |")
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_results(meta: dict[str, Any], runs: list[dict[str, Any]], strategies: list[str],
                  out: Path) -> None:
    rows = summarize(runs, strategies, meta["links"])
    meta["notes"] = list(meta.get("base_notes", [])) + _targets(rows) + [
        f"{r['strategy']} on {r['link']}: a run failed: {e}" for r in rows for e in r["errors"]]
    write_outputs(out, markdown(rows, meta), meta, rows, runs, wrote=", .json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--links", default="20mbit,100mbit",
                   help="comma list of tc rates (and/or lo)")
    p.add_argument("--strategies", default=",".join(DEFAULT_ROWS),
                   help=f"comma list from {', '.join(STRATEGIES)}")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: 1 seed, 20mbit, {', '.join(QUICK_STRATEGIES)}, 96 steps")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--netns-prefix", default="sgq24", help="namespace name prefix (<= 6)")
    p.add_argument("--subnet", default="10.124.0", help="first three octets of the /24")
    p.add_argument("--target", type=float, default=2.8, help="validation loss to reach")
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=256,
                   help="DiLoCo rows train this many steps (8 outer steps of period 32)")
    p.add_argument("--max-wall", type=float, default=120.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--run-timeout", type=float, default=400.0)
    p.add_argument("--period", type=int, default=_DILOCO["period"],
                   help="inner steps between outer syncs of every DiLoCo row (default 32, "
                        "lm.py's tuning; smaller periods make the job communication-bound "
                        "on this machine's slow CPUs, as larger models are on GPUs)")
    p.add_argument("--out", default=str(RESULTS / "diloco_compression"),
                   help="output path without extension; a bare name goes under --out-dir")
    p.add_argument("--from-json", metavar="PATH")
    add_ledger_args(p, smoke="the diloco row, period 2, 2 workers on loopback, 2 steps")
    args = p.parse_args(argv)
    args.variant = []
    if args.smoke:
        args.seeds, args.links, args.workers, args.period = 1, "lo", 2, 2
        if args.strategies == p.get_default("strategies"):
            args.strategies = "diloco"
        args.max_steps, args.eval_every, args.timeout, args.run_timeout = 2, 1, 60.0, 120.0
        args.out = str(output_dir(args) / Path(args.out).name)
    elif args.out_dir is not None:
        args.out = str(Path(args.out_dir) / Path(args.out).name)
    if args.quick:
        args.seeds = 1
        if args.links == p.get_default("links"):
            args.links = "20mbit"
        if args.strategies == p.get_default("strategies"):
            args.strategies = ",".join(QUICK_STRATEGIES)
        args.max_steps = min(args.max_steps, 96)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return rewrite_from_json(args.from_json, Path(args.out), write_results)
    sys.path.insert(0, str(REPO / "src"))
    from stratagem.demo_lm import GPT, GPTConfig, load_corpus
    from stratagem.testing.netns import Topology

    for _, row_args, _, _ in STRATEGIES.values():
        if "period" in row_args:
            row_args["period"] = args.period
            gap = args.period // int(row_args.get("fragments", 1))
            if row_args.get("sync_delay", 0) >= gap:  # must stay < period // fragments
                row_args["sync_delay"] = max(0, gap - 1)
    lm.STRATEGIES.clear()
    lm.STRATEGIES.update(STRATEGIES)  # lm.run_once reads its table
    strategies = choose(args.strategies, STRATEGIES, "rows")
    if strategies is None:
        return 2
    links = split_list(args.links)
    load_corpus()
    notes: list[str] = []
    if not shaped_links_usable(links, notes):
        links = ["lo"]
    meta: dict[str, Any] = {
        "command": "python benchmarks/diloco_compression.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "workers": args.workers, "target": args.target, "eval_every": args.eval_every,
        "max_steps": args.max_steps, "max_wall": args.max_wall, "period": args.period,
        "seeds_per_link": args.seeds, "links": links,
        "strategies": {k: STRATEGIES[k][1] for k in strategies}, "cpus": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(), "model": lm.MODEL,
        "num_parameters": GPT(GPTConfig(**lm.MODEL)).num_parameters(), "base_notes": notes,
    }
    topo = (Topology(args.workers, prefix=args.netns_prefix, subnet=args.subnet)
            if any(link != "lo" for link in links) else None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def one(key: str, link: str, seed: int, topo: Any, tmp: Path) -> dict[str, Any]:
        # Mirrored (the time baseline) stops at the target; the DiLoCo rows train to
        # max_steps so their final losses compare at equal steps.
        args.stop_at_target = key == "mirrored"
        r = lm.run_once(key, link, seed, topo, args, tmp)
        _print_run(r, args.target)
        return r

    runs = run_matrix(links, lambda link: args.seeds, strategies, topo, notes, one,
                      meta=meta, tmp_prefix="sg-dc-")
    write_results(meta, runs, strategies, out)
    return 0 if all(r.get("error") is None for r in runs) else 1


def _print_run(r: dict[str, Any], target: float) -> None:
    if r.get("error"):
        print(f"{r['strategy']:15s} {r['link']:8s} seed {r['seed']}: FAILED {r['error']}\n"
              f"{r.get('log_tail', '')}", flush=True)
        return
    hit = r["reached"]
    what = (f"{target} at step {hit['step']:.0f} / {hit['wall']:.1f}s" if hit else
            f"not reached in {r['steps']} steps ({r['wall_seconds']:.1f}s)")
    print(f"{r['strategy']:15s} {r['link']:8s} seed {r['seed']}: {what}; final "
          f"{r['final_val_loss']:.3f}, {r['bytes_per_step']:,.0f} B/step, wait "
          f"{r.get('outer_wait_seconds')}, outer steps {r.get('outer_steps')}, "
          f"job {r['job_seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
