"""Time to a fixed validation loss for a character-level GPT on slow links, 4 workers.

    python benchmarks/lm.py [--seeds 3] [--links lo,100mbit,20mbit] [--quick]

The model and text of ``examples/gpt.py`` (``stratagem.demo_lm``: a GPT with the token
embedding tied to the output head, trained on ~2 MB of English documentation shipped with
Python), small enough for this 2-CPU machine: 2 layers, 4 heads, width 64, context 64
characters. AdamW with decay/no-decay groups (betas 0.9/0.95, weight decay 0.1), learning
rate 3e-3 after a 20-step linear warm-up, global batch 32 sequences (8 per worker), no
dropout. Strategies: Mirrored (gradients all-reduced every step), LocalSGD (period 8),
DiLoCo (period 16, outer Nesterov lr 0.7, momentum 0.9), EASGD (sync, period 4), parameter
server sync and async (one shard). Same model, data order, seeds and target for all.

The consensus model (``strategy.eval_model``) is scored on 64 fixed held-out windows
(4,096 characters) every ``--eval-every`` steps; a run stops once the validation loss is at
most ``--target`` (or after ``--max-steps``). Synchronous strategies (everything but
``ps-async``): every worker calls ``eval_model`` (a collective for some strategies), worker 0
scores it while the others wait for its stop/go decision, and that pause is excluded from the
wall clock. ``ps-async``: an evaluator process next to the shard reads the global model each
time the workers' mean step count crosses a multiple of ``--eval-every``; nobody pauses and
the wall clock is the real one (as in ``benchmarks/convergence.py``).

Links: ``lo`` (loopback) and shaped links (``100mbit``, ``20mbit``): every worker in its own
network namespace behind a veth capped both ways with ``tc tbf`` (``stratagem.testing.netns``);
the store and the shard sit on the bridge. Needs root; without it only ``lo`` runs.

Writes ``benchmarks/results/lm.{json,md,png}``. Done-when target: DiLoCo reaches
the target loss in <= 0.3x Mirrored's wall time at 20 Mbit/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import _common as common  # noqa: E402 - the shared job runner and results plumbing
from convergence import (  # noqa: E402 - formatting, --variant and option parsing
    _fmt,
    _median,
    add_run_arguments,
    parse_matrix,
)

#: name -> (registry name, strategy arguments, needs a PS shard, synchronous)
STRATEGIES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "mirrored": ("mirrored", {}, False, True),
    "local_sgd": ("local_sgd", {"period": 8}, False, True),
    "diloco": ("diloco", {"period": 32, "outer_lr": 1.0, "outer_momentum": 0.3}, False, True),
    "easgd": ("easgd", {"period": 4}, False, True),
    "ps-sync": ("ps-sync", {}, True, True),
    "ps-async": ("ps-async", {}, True, False),
}
QUICK_STRATEGIES = ["mirrored", "diloco"]
MODEL = {"block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 128, "dropout": 0.0}
LR, WARMUP, GLOBAL_BATCH, EVAL_CHARS = 3e-3, 20, 64, 4096


# =========================================================================== worker side


def _data(cfg: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """Training windows, and the fixed held-out windows (EVAL_CHARS characters) scored."""
    from stratagem.demo_lm import encode, load_corpus, split_corpus, windows

    train, val = split_corpus(encode(load_corpus()))
    block = int(cfg["model"]["block_size"])
    X, Y = windows(train, block)
    Xv, Yv = windows(val, block)
    return X, Y, Xv[:EVAL_CHARS // block], Yv[:EVAL_CHARS // block]


def _build(cfg: dict[str, Any], **strategy_kwargs: Any) -> tuple[Any, Any, Any]:
    import torch

    import stratagem as sg
    from stratagem.demo_lm import GPT, GPTConfig, adamw_param_groups

    strategy = sg.from_name(cfg["strategy"], timeout=float(cfg["timeout"]),
                            **cfg["strategy_args"], **strategy_kwargs)
    with strategy.scope():
        torch.manual_seed(int(cfg["seed"]))
        model = GPT(GPTConfig(**cfg["model"]))
        optimizer = torch.optim.AdamW(adamw_param_groups(model, 0.1), lr=float(cfg["lr"]),
                                      betas=(0.9, 0.95))
        model, optimizer = strategy.prepare(model, optimizer)
    return strategy, model, optimizer


def _val_loss(model: Any, Xv: Any, Yv: Any) -> float:
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        _, loss = model(Xv, Yv)
    model.train(was_training)
    return float(loss)


def worker_main(cfg_path: str) -> int:
    """One worker process (in its namespace on shaped links); writes a JSON result."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    from stratagem.demo_lm import lr_at

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(cfg["timeout"])
    ctrl = common._store(timeout)
    strategy, model, optimizer = _build(cfg)
    built = strategy.metrics()  # prepare's traffic (rank 0 broadcasts the model)
    setup_bytes = built["bytes_sent"] + built["bytes_received"]
    seed = int(cfg["seed"])
    X, Y, Xv, Yv = _data(cfg)
    loader = strategy.distribute_dataset((X, Y), int(cfg["global_batch"]), shuffle=True,
                                         seed=seed)
    sync, every, target = bool(cfg["sync"]), int(cfg["eval_every"]), float(cfg["target"])
    max_wall = float(cfg["max_wall"])
    # False: train on to max_steps after the target (diloco_compression.py compares final
    # losses at a fixed step count); the first time the target was reached is still kept.
    stop_at_target = bool(cfg.get("stop_at_target", True))
    progress = common.start_together(ctrl, rank, world, sync, timeout)
    start = time.perf_counter()
    paused = 0.0
    curve: list[tuple[float, float, float]] = []
    reached: tuple[float, float, float] | None = None

    eval_traffic = {"bytes_sent": 0.0, "bytes_received": 0.0, "comm_seconds": 0.0}

    def evaluate(step: int) -> bool:
        """Every worker calls eval_model (a collective for LocalSGD: its bytes are evaluation
        traffic, not training traffic, and are left out of bytes/step); worker 0 scores it."""
        nonlocal paused, reached
        t0 = time.perf_counter()
        before = strategy.metrics()
        consensus = strategy.eval_model(model)
        after = strategy.metrics()
        for k in eval_traffic:
            eval_traffic[k] += after[k] - before[k]
        if rank == 0:
            loss = _val_loss(consensus, Xv, Yv)
            wall = t0 - start - paused
            curve.append((wall, step, loss))
            if reached is None and loss <= target:
                reached = (wall, step, loss)
            stop = (reached is not None and stop_at_target) or wall > max_wall
            ctrl.set(f"{common._TAG}go/{step}", "stop" if stop else "go")
        else:
            stop = ctrl.get(f"{common._TAG}go/{step}") == b"stop"
        paused += time.perf_counter() - t0
        return stop

    step, stop, epoch = 0, False, 0
    if sync:
        stop = evaluate(0)
    max_steps, lr = int(cfg["max_steps"]), float(cfg["lr"])
    while not stop and step < max_steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr=lr, min_lr=lr, warmup=WARMUP, total=max_steps)
            _, loss = model(x, y)
            strategy.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if progress is not None:
                progress.step = step
                stop = progress.stop.is_set()
            elif step % every == 0 or step == max_steps:
                stop = evaluate(step)
            if stop or step >= max_steps:
                break
        epoch += 1
    end_wall = time.perf_counter() - start - paused
    metrics = strategy.metrics()
    for k in eval_traffic:
        metrics[k] -= eval_traffic[k]
    result: dict[str, Any] = {
        "rank": rank, **common.traffic(metrics, end_wall),
        # DiLoCo's outer step (benchmarks/diloco_compression.py): the seconds the training
        # thread waited on outer all-reduces, and how many fragment syncs were applied.
        "outer_wait_seconds": metrics.get("outer_wait_seconds"),
        "outer_steps": metrics.get("outer_steps"),
        "setup_bytes": setup_bytes,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "num_parameters": strategy.unwrap(model).num_parameters(),
    }
    if sync and rank == 0:
        result.update(curve=curve, final_val_loss=curve[-1][2],
                      reached=None if reached is None else
                      {"wall": reached[0], "step": reached[1], "val_loss": reached[2]})
    common.finish_worker(cfg, ctrl, strategy, result, rank=rank, world=world, step=step,
                         progress=progress, timeout=timeout)


def evaluator_main(cfg_path: str) -> int:
    """``ps-async``: score the global model each time the workers' mean step count crosses a
    multiple of ``eval_every``; set the stop key at the target. Nobody waits for it."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    import stratagem as sg

    torch.set_num_threads(1)
    target = float(cfg["target"])
    _, _, Xv, Yv = _data(cfg)
    common.run_evaluator(
        cfg, lambda: _build(cfg, comm=sg.Comm.single()),
        lambda strategy, model: _val_loss(strategy.eval_model(model), Xv, Yv),
        lambda loss: loss <= target,
        lambda reached, wall: reached is not None or wall > float(cfg["max_wall"]),
        metric="val_loss")


# =========================================================================== parent side


def run_once(key: str, link: str, seed: int, topo: Any, args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    """One job: ``args.workers`` worker processes (in namespaces on a shaped link), plus a
    PS shard and an evaluator when the strategy needs them."""
    name, strategy_args, needs_ps, sync = STRATEGIES[key]
    run_dir = tmp / f"{key}-{link}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"strategy": name, "strategy_args": strategy_args, "seed": seed, "sync": sync,
           "eval_every": args.eval_every, "target": args.target, "max_steps": args.max_steps,
           "max_wall": args.max_wall,
           "stop_at_target": getattr(args, "stop_at_target", True),
           "timeout": args.timeout, "result_dir": str(run_dir), "model": MODEL, "lr": LR,
           "global_batch": GLOBAL_BATCH}
    out, chief, ranks = common.run_job(
        str(Path(__file__).resolve()), run_dir, cfg,
        {"strategy": key, "link": link, "seed": seed, "strategy_args": strategy_args},
        workers=args.workers, sync=sync, needs_ps=needs_ps, topo=topo, timeout=args.timeout,
        run_timeout=args.run_timeout)
    if chief is None:
        return out
    out.update({k: chief[k] for k in ("curve", "final_val_loss", "reached", "steps",
                                       "wall_seconds", "bytes_per_step",
                                       "bytes_sent_per_step", "comm_seconds",
                                       "num_parameters")})
    out["outer_wait_seconds"] = chief.get("outer_wait_seconds")
    out["outer_steps"] = chief.get("outer_steps")
    out["setup_bytes"] = chief.get("setup_bytes")
    out["peak_rss_mb"] = [r["peak_rss_mb"] for r in ranks]
    out["worker_steps"] = [r["steps"] for r in ranks]
    return out


# =========================================================================== summary


def summarize(runs: list[dict[str, Any]], strategies: list[str], links: list[str]
              ) -> list[dict[str, Any]]:
    rows = []
    for link in links:
        base_wall: float | None = None
        for key in sorted(strategies, key=lambda k: k != "mirrored"):  # the baseline first
            rs = [r for r in runs if r["strategy"] == key and r["link"] == link]
            ok = [r for r in rs if r.get("error") is None]
            row: dict[str, Any] = {"strategy": key, "link": link, "runs": len(rs),
                                   "errors": [r["error"] for r in rs if r.get("error")],
                                   "reached": sum(1 for r in ok if r["reached"])}
            row["median_steps"] = _median([r["reached"]["step"] if r["reached"] else math.inf
                                           for r in ok])
            row["median_wall"] = _median([r["reached"]["wall"] if r["reached"] else math.inf
                                          for r in ok])
            row["final_val_loss"] = _median([r["final_val_loss"] for r in ok])
            row["bytes_per_step"] = _median([r["bytes_per_step"] for r in ok])
            row["peak_rss_mb"] = _median([max(r["peak_rss_mb"]) for r in ok])
            row["per_seed_wall"] = {r["seed"]: (r["reached"]["wall"] if r["reached"] else None)
                                    for r in ok}
            if key == "mirrored":
                base_wall = row["median_wall"]
            row["ratio"] = (row["median_wall"] / base_wall
                            if base_wall and math.isfinite(base_wall) else math.nan)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    target = meta["target"]
    lines = [
        f"# Time to validation loss {target} (character-level GPT, {meta['workers']} workers)",
        "",
        f"GPT {meta['model']} ({meta['num_parameters']:,} parameters, the token embedding "
        f"tied to the head), AdamW (decay/no-decay groups) lr {LR} after {WARMUP} warm-up "
        f"steps, global batch {GLOBAL_BATCH} sequences of {MODEL['block_size']} characters, "
        "same seeds and data order for every strategy, text of `stratagem.demo_lm` (the "
        "Python documentation shipped with the interpreter). The consensus model "
        f"(`eval_model`) is scored on {EVAL_CHARS:,} held-out characters every "
        f"{meta['eval_every']} steps; a run stops at the target, after {meta['max_steps']} "
        f"steps or after {meta['max_wall']:g} s of training. Wall = training "
        "wall-clock from a common start (start-up and evaluation pauses excluded; ps-async is "
        "watched by a separate evaluator and its wall is real time). Medians over seeds "
        f"0..N-1, N per link {meta['seeds_per_link']} (an unreached target counts as "
        "infinite). Ratio = median wall / Mirrored's median wall on the same link. "
        "Bytes/step = worker 0's bytes sent + received per training step as counted by the "
        "strategy (evaluation traffic, e.g. LocalSGD's averaging inside `eval_model`, left "
        "out).",
        "",
        "Links: `lo` = loopback; `Nmbit` = each worker in its own network namespace, veth to "
        "a bridge, `tc tbf rate N burst 64kb latency 100ms` both ways (no added delay). "
        f"Machine: {meta['cpus']} CPUs shared with other jobs (load average at start "
        f"{meta['loadavg_start']}).",
        "",
        f"Command: `{meta['command']}` ({meta['total_minutes']:.1f} min)",
        "",
        f"| strategy | link | reached | median steps to {target} | median wall s to {target} "
        "| wall vs Mirrored | final val loss | bytes/step |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        failed = f" ({len(r['errors'])} failed)" if r["errors"] else ""
        lines.append(
            f"| {r['strategy']} | {r['link']} | {r['reached']}/{r['runs']}{failed} | "
            f"{_fmt(r['median_steps'], '.0f')} | {_fmt(r['median_wall'], '.1f')} | "
            f"{_fmt(r['ratio'], '.2f')} | {_fmt(r['final_val_loss'], '.3f')} | "
            f"{_fmt(r['bytes_per_step'], ',.0f')} |")
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _auto_notes(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    for r in rows:
        if r["runs"] and r["reached"] < r["runs"]:
            notes.append(f"{r['strategy']} on {r['link']}: reached the target in "
                         f"{r['reached']} of {r['runs']} runs.")
        notes += [f"{r['strategy']} on {r['link']}: a run failed: {e}" for e in r["errors"]]
    for r in rows:
        if r["strategy"] == "diloco" and r["link"] == "20mbit":
            ok = math.isfinite(r.get("ratio", math.nan)) and r["ratio"] <= 0.3
            ratio = (f"{r['ratio']:.2f}x" if math.isfinite(r.get("ratio", math.nan))
                     else "n/a (a median not reached)")
            notes.append(f"20mbit: DiLoCo reaches the target in {ratio} Mirrored's wall time "
                         f"(target <= 0.3x: {'met' if ok else 'NOT met'}).")
    return notes


def plot(runs: list[dict[str, Any]], links: list[str], strategies: list[str], target: float,
         path: Path) -> None:
    fig, axes, colors = common.figure(len(links))
    for ax, link in zip(axes, links, strict=True):
        points = common.draw_seeds(ax, runs, link, strategies, colors, target)
        longest = max([1.0] + [w for w, _ in points])
        # From 1 s: the first evaluations come a few milliseconds in and say nothing.
        ax.set_xlim(1.0, longest * 1.3)
        ax.set_xlabel("training wall-clock (s, log scale)")
        ax.set_ylabel("validation loss of the consensus model (nats/char)")
        ax.set_ylim(max(0.0, target - 0.2), target + 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    common.save_figure(fig, f"char-level GPT, 4 workers: validation loss vs wall-clock, one "
                            f"line per seed (dashed: the {target} target)", path)


def write_results(meta: dict[str, Any], runs: list[dict[str, Any]], strategies: list[str],
                  out: Path) -> None:
    rows = summarize(runs, strategies, meta["links"])
    meta["notes"] = list(meta.get("base_notes", [])) + _auto_notes(rows)
    common.write_outputs(out, markdown(rows, meta), meta, rows, runs, wrote=", .json, .png",
                         plot=(lambda: plot(runs, meta["links"], strategies, meta["target"],
                                            out.with_suffix(".png"))) if runs else None)


# =========================================================================== main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.matrix_parser(__doc__, table=STRATEGIES, quick=QUICK_STRATEGIES,
                             quick_links="lo,20mbit")
    add_run_arguments(p, example='ps-prefetch=ps-async:{"prefetch": true}')
    p.add_argument("--target", type=float, default=2.8, help="validation loss to reach")
    p.add_argument("--eval-every", type=int, default=8,
                   help="evaluate every N steps (8 divides every period used)")
    p.add_argument("--max-steps", type=int, default=400, help="stop here if never reached")
    p.add_argument("--max-wall", type=float, default=90.0,
                   help="stop a run after this many seconds of training if the target is "
                        "not reached (counted as not reached)")
    p.add_argument("--timeout", type=float, default=120.0, help="collective/store timeout s")
    p.add_argument("--run-timeout", type=float, default=400.0, help="one job's time limit s")
    return common.parse_matrix_args(p, argv, out=RESULTS / "lm", quick=QUICK_STRATEGIES,
                                    quick_links="lo,20mbit")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    done = common.dispatch(args, worker=worker_main, evaluator=evaluator_main,
                           write_results=write_results)
    if done is not None:
        return done
    sys.path.insert(0, str(REPO / "src"))  # a source checkout without `pip install -e`
    from stratagem.demo_lm import GPT, GPTConfig, load_corpus
    from stratagem.testing.netns import Topology

    chosen = parse_matrix(args, STRATEGIES)
    if chosen is None:
        return 2
    strategies, links, per_link = chosen
    load_corpus()  # fail here with the explanation, not in every worker
    notes: list[str] = []
    shaped = [link for link in links if link != "lo"]
    if not common.shaped_links_usable(links, notes):
        links = [link for link in links if link == "lo"]
        per_link = {k: v for k, v in per_link.items() if k == "lo"}
    meta: dict[str, Any] = {
        "command": "python benchmarks/lm.py " + " ".join(argv or sys.argv[1:]),
        "workers": args.workers, "target": args.target, "eval_every": args.eval_every,
        "max_steps": args.max_steps, "max_wall": args.max_wall, "seeds_per_link": per_link,
        "links": links,
        "strategies": {k: STRATEGIES[k][1] for k in strategies}, "cpus": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(), "model": MODEL,
        "num_parameters": GPT(GPTConfig(**MODEL)).num_parameters(), "base_notes": notes,
    }
    topo = Topology(args.workers, prefix=args.netns_prefix, subnet=args.subnet) if shaped and any(link != "lo" for link in links) else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def one(key: str, link: str, seed: int, topo: Any, tmp: Path) -> dict[str, Any]:
        r = run_once(key, link, seed, topo, args, tmp)
        _print_run(r, args.target)
        return r

    runs = common.run_matrix(links, per_link.__getitem__, strategies, topo, notes, one,
                             meta=meta, tmp_prefix="sg-lm-")
    write_results(meta, runs, strategies, out)
    return 0 if all(r.get("error") is None for r in runs) else 1


def _print_run(r: dict[str, Any], target: float) -> None:
    if r.get("error"):
        print(f"{r['strategy']:10s} {r['link']:8s} seed {r['seed']}: FAILED {r['error']}\n"
              f"{r.get('log_tail', '')}", flush=True)
        return
    hit = r["reached"]
    what = (f"{target} at step {hit['step']:.0f} / {hit['wall']:.1f}s" if hit else
            f"target not reached in {r['steps']} steps ({r['wall_seconds']:.1f}s)")
    print(f"{r['strategy']:10s} {r['link']:8s} seed {r['seed']}: {what}; final val loss "
          f"{r['final_val_loss']:.3f}, {r['bytes_per_step']:,.0f} B/step, "
          f"job {r['job_seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
