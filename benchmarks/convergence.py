"""Time to accuracy on slow links: steps and wall-clock to 93% test accuracy on MNIST-5k.

    python benchmarks/convergence.py [--seeds 3] [--links lo,100mbit,20mbit] [--quick]

The job of ``stratagem.demo`` (4,000 train / 1,000 test real MNIST digits, MLP
784-256-256-10 = 269,322 fp32 parameters = 1.08 MB, Adam lr 2e-3, global batch 128 split over
4 workers) under each strategy: Mirrored (DDP all-reduce every step), PS async (Downpour),
EASGD sync and async (period 4; async keeps the center on one parameter-server shard), EAMSGD
(period 4, momentum 0.9), LocalSGD (period 8) and DiLoCo (period 16, outer Nesterov lr 0.7,
momentum 0.9). Same model, data, seeds, optimizer, batch and target for every strategy.

Worker 0 evaluates the consensus model (``strategy.eval_model``) on the whole test set every
``--eval-every`` steps and the run stops once it reaches ``--target`` (or after
``--max-epochs``). Synchronous strategies: the other workers wait for worker 0's stop/go
decision meanwhile, so evaluation pauses everybody and is excluded from the wall clock.
Asynchronous strategies (whose workers never wait for each other): no worker evaluates; an
evaluator process on the bridge reads the center / global parameters through a strategy
instance that never steps, each time the workers' mean step count crosses a multiple of
``--eval-every``, and the wall clock is the real one.

Links: ``lo`` (loopback, workers in the root namespace) and shaped links (``100mbit``,
``20mbit``...): each worker in its own network namespace with a veth to a bridge
(10.77.0.0/24), capped both ways with ``tc tbf`` (see ``stratagem.testing.netns``). The
TCPStore and the PS shard run in the root namespace on the bridge. Needs root; without it
only ``lo`` runs.

Writes ``benchmarks/results/convergence.{json,md,png}``. Done-when targets (``TARGETS``), each
noted only for the strategies of its family in the run: on the shaped links at least one
averaging strategy reaches 93% in <= 0.5x Mirrored's wall time, parameter-server
training in <= 1.0x.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402 - the shared job runner and results plumbing
    _TAG,
    _store,
    choose,
    dispatch,
    draw_seeds,
    figure,
    finish_worker,
    matrix_parser,
    parse_matrix_args,
    run_evaluator,
    run_job,
    run_matrix,
    save_figure,
    seeds_per_link,
    shaped_links_usable,
    split_list,
    start_together,
    traffic,
    write_outputs,
)

#: name -> (registry name, strategy arguments, needs a PS shard, synchronous)
STRATEGIES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "mirrored": ("mirrored", {}, False, True),
    "ps-async": ("ps-async", {}, True, False),
    "easgd": ("easgd", {"period": 4}, False, True),
    "easgd-async": ("easgd-async", {"period": 4}, True, False),
    "eamsgd": ("eamsgd", {"period": 4}, False, True),
    "local_sgd": ("local_sgd", {"period": 8}, False, True),
    "diloco": ("diloco", {"period": 16, "outer_lr": 0.7, "outer_momentum": 0.9}, False, True),
}
QUICK_STRATEGIES = ["mirrored", "easgd", "local_sgd"]
#: Done-when targets on the shaped links, per family of strategies (registry names): the
#: family's fastest strategy to 93%, as a ratio of Mirrored's wall time, must be <= limit.
TARGETS: tuple[tuple[str, str, frozenset[str], float], ...] = (
    ("averaging strategy", "averaging target",
     frozenset({"easgd", "easgd-async", "eamsgd", "local_sgd", "diloco"}), 0.5),
    ("parameter-server strategy", "parameter-server target", frozenset({"ps-async", "ps-sync"}), 1.0),
)
PS_MODULE = "stratagem.strategies.parameter_server"


# =========================================================================== worker side

def _accuracy(model: Any, X: Any, y: Any) -> float:
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = float((model(X).argmax(dim=1) == y).float().mean())
    model.train(was_training)
    return acc


def _build(cfg: dict[str, Any], **strategy_kwargs: Any) -> tuple[Any, Any, Any]:
    """The strategy, then the prepared model and optimizer: the same for every strategy."""
    import torch

    import stratagem as sg
    from stratagem.demo import MLP

    strategy = sg.from_name(cfg["strategy"], timeout=float(cfg["timeout"]),
                            **cfg["strategy_args"], **strategy_kwargs)
    with strategy.scope():
        torch.manual_seed(int(cfg["seed"]))
        model = MLP(int(cfg["hidden"]))
        optimizer = torch.optim.Adam(model.parameters(), lr=float(cfg["lr"]))
        model, optimizer = strategy.prepare(model, optimizer)
    return strategy, model, optimizer


def worker_main(cfg_path: str) -> int:
    """One worker process (started by the parent in its namespace). Writes a JSON result.

    Synchronous strategies: worker 0 evaluates every ``eval_every`` steps while the others
    wait for its stop/go decision (the clock is paused for everybody). Asynchronous ones: an
    evaluator process watches (``evaluator_main``) and nobody pauses."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch
    import torch.nn.functional as F

    from stratagem.demo import load_mnist5k

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(cfg["timeout"])
    ctrl = _store(timeout)
    strategy, model, optimizer = _build(cfg)
    (X_train, y_train), (X_test, y_test) = load_mnist5k()
    seed = int(cfg["seed"])
    loader = strategy.distribute_dataset((X_train, y_train), int(cfg["global_batch_size"]),
                                         shuffle=True, seed=seed)
    sync, every, target = bool(cfg["sync"]), int(cfg["eval_every"]), float(cfg["target"])
    early_stop = bool(cfg["early_stop"])
    progress = start_together(ctrl, rank, world, sync, timeout)
    start = time.perf_counter()
    paused = 0.0  # seconds worker 0 spent evaluating (sync): not training time
    curve: list[tuple[float, float, float]] = []
    reached: tuple[float, float, float] | None = None

    def evaluate(step: int) -> bool:
        nonlocal paused, reached
        t0 = time.perf_counter()
        wall = t0 - start - paused
        acc = _accuracy(strategy.unwrap(strategy.eval_model(model)), X_test, y_test)
        curve.append((wall, step, acc))
        if reached is None and acc >= target:
            reached = (wall, step, acc)
        paused += time.perf_counter() - t0
        return early_stop and reached is not None

    if sync and rank == 0:
        evaluate(0)
    elif sync:
        strategy.eval_model(model)  # a collective for some strategies: join worker 0's
    step, stop = 0, False
    compute_s = step_s = 0.0  # forward+backward / optimizer.step (the synchronisation)
    for epoch in range(int(cfg["max_epochs"])):
        loader.set_epoch(epoch)
        for x, y in loader:
            t_a = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            t_b = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            t_c = time.perf_counter()
            compute_s += t_b - t_a
            step_s += t_c - t_b
            step += 1
            if progress is not None:
                progress.step = step
                stop = progress.stop.is_set()
            elif step % every == 0:
                if rank == 0:
                    stop = evaluate(step)
                    ctrl.set(f"{_TAG}go/{step}", "stop" if stop else "go")
                else:
                    # eval_model is a collective for some strategies (LocalSGD averages):
                    # every worker joins it while worker 0 evaluates.
                    strategy.eval_model(model)
                    stop = ctrl.get(f"{_TAG}go/{step}") == b"stop"
            if cfg.get("max_steps") and step >= int(cfg["max_steps"]):
                stop = True  # --smoke: every worker stops at the same step
            if stop:
                break
        if stop:
            break
    end_wall = time.perf_counter() - start - paused
    if sync and curve and curve[-1][1] != step:
        evaluate(step)  # worker 0 only (curve is empty elsewhere)
    elif sync and rank != 0 and step % every != 0:
        strategy.eval_model(model)  # join worker 0's last evaluation (a collective for some)
    metrics = strategy.metrics()
    result: dict[str, Any] = {
        "rank": rank, **traffic(metrics, end_wall),
        "compute_ms_per_step": 1000 * compute_s / max(1, step),
        "sync_ms_per_step": 1000 * step_s / max(1, step),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "num_parameters": sum(p.numel() for p in strategy.unwrap(model).parameters()),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
    }
    if sync and rank == 0:
        result.update(curve=curve, final_accuracy=curve[-1][2],
                      reached=None if reached is None else
                      {"wall": reached[0], "step": reached[1], "accuracy": reached[2]})
    finish_worker(cfg, ctrl, strategy, result, rank=rank, world=world, step=step,
                  progress=progress, timeout=timeout)


def evaluator_main(cfg_path: str) -> int:
    """Asynchronous strategies: evaluate the consensus model (``eval_model`` of a strategy
    instance that never steps, on the bridge next to the PS shard) each time the workers'
    mean step count crosses a multiple of ``eval_every``; set the stop key at the target.
    Its wall clock is the real one: no worker ever pauses for it."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    import stratagem as sg
    from stratagem.demo import load_mnist5k

    torch.set_num_threads(1)
    target = float(cfg["target"])
    _, (X_test, y_test) = load_mnist5k()
    run_evaluator(
        cfg, lambda: _build(cfg, comm=sg.Comm.single()),
        lambda strategy, model: _accuracy(strategy.unwrap(strategy.eval_model(model)),
                                          X_test, y_test),
        lambda acc: acc >= target,
        lambda reached, wall: bool(cfg["early_stop"]) and reached is not None,
        metric="accuracy")


# =========================================================================== parent side


def run_once(key: str, link: str, seed: int, topo: Any, args: argparse.Namespace,
             tmp: Path, *, spec: tuple[str, dict[str, Any], bool, bool] | None = None,
             nnodes: int | None = None) -> dict[str, Any]:
    """One job: ``args.workers`` worker processes (in namespaces on a shaped link).

    ``spec`` replaces ``STRATEGIES[key]`` (other benchmarks' tables). ``nnodes=K`` (
    ``benchmarks/hierarchical.py``): K nodes of W/K workers, the workers of a node sharing
    its namespace, with torchrun's per-node environment; by default every worker has a
    namespace of its own and the job is one node."""
    name, strategy_args, needs_ps, sync = STRATEGIES[key] if spec is None else spec
    # A variant's "_env" sets environment variables of its processes (shard, workers), its
    # "_ps_shards" the number of parameter-server shard processes (1 unless given).
    strategy_args = dict(strategy_args)
    job_env = {str(k): str(v) for k, v in strategy_args.pop("_env", {}).items()}
    ps_shards = int(strategy_args.pop("_ps_shards", 1))
    run_dir = tmp / f"{key}-{link}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"strategy": name, "strategy_args": strategy_args, "seed": seed, "sync": sync,
           "hidden": 256, "lr": 2e-3, "global_batch_size": 128, "eval_every": args.eval_every,
           "target": args.target, "max_epochs": args.max_epochs, "timeout": args.timeout,
           "early_stop": not args.no_early_stop, "result_dir": str(run_dir),
           "max_steps": getattr(args, "max_steps", None)}
    out, chief, ranks = run_job(
        str(Path(__file__).resolve()), run_dir, cfg,
        {"strategy": key, "link": link, "seed": seed, "strategy_args": strategy_args},
        workers=args.workers, sync=sync, needs_ps=needs_ps, topo=topo, timeout=args.timeout,
        run_timeout=args.run_timeout, nnodes=nnodes, job_env=job_env, ps_shards=ps_shards)
    if chief is None:
        return out
    out.update({k: chief[k] for k in ("curve", "final_accuracy", "reached", "steps",
                                       "wall_seconds", "bytes_per_step",
                                       "bytes_sent_per_step", "comm_seconds",
                                       "compute_ms_per_step", "sync_ms_per_step",
                                       "num_parameters", "metrics")})
    out["peak_rss_mb"] = [r["peak_rss_mb"] for r in ranks]
    out["worker_steps"] = [r["steps"] for r in ranks]
    return out


# =========================================================================== summary


def _median(values: list[float]) -> float:
    """Median where an unreached target counts as +inf (so a majority must reach it)."""
    return statistics.median(values) if values else math.nan


def summarize(runs: list[dict[str, Any]], strategies: list[str], links: list[str],
              seeds: list[int], missing: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for link in links:
        base_wall: float | None = None
        base_seeds: dict[int, float | None] = {}
        for key in sorted(strategies, key=lambda k: k != "mirrored"):  # the baseline first
            rs = [r for r in runs if r["strategy"] == key and r["link"] == link]
            row: dict[str, Any] = {"strategy": key, "link": link, "runs": len(rs)}
            if key in missing:
                row["missing"] = missing[key]
                rows.append(row)
                continue
            ok = [r for r in rs if r.get("error") is None]
            row["errors"] = [r["error"] for r in rs if r.get("error") is not None]
            row["reached"] = sum(1 for r in ok if r["reached"])
            steps = [r["reached"]["step"] if r["reached"] else math.inf for r in ok]
            walls = [r["reached"]["wall"] if r["reached"] else math.inf for r in ok]
            row["median_steps"] = _median(steps)
            row["median_wall"] = _median(walls)
            row["final_accuracy"] = _median([r["final_accuracy"] for r in ok])
            row["bytes_per_step"] = _median([r["bytes_per_step"] for r in ok])
            row["peak_rss_mb"] = _median([max(r["peak_rss_mb"]) for r in ok])
            # Worker 0's split of a step (older JSON has no such fields: NaN).
            for f in ("compute_ms_per_step", "sync_ms_per_step"):
                row[f] = _median([r.get(f, math.nan) for r in ok])
            row["staleness_mean"] = _median([r.get("metrics", {}).get("staleness_mean",
                                                                        math.nan) for r in ok])
            row["per_seed_wall"] = {r["seed"]: (r["reached"]["wall"] if r["reached"] else None)
                                    for r in ok}
            if key == "mirrored":
                base_wall = row["median_wall"]
                base_seeds = row["per_seed_wall"]
            row["per_seed_ratio"] = {
                seed: (w / base_seeds[seed] if w is not None and base_seeds.get(seed) else None)
                for seed, w in row["per_seed_wall"].items()}
            row["ratio"] = (row["median_wall"] / base_wall
                            if base_wall and math.isfinite(base_wall) else math.nan)
            rows.append(row)
    return rows


def _per_seed(row: dict[str, Any]) -> str:
    """Each seed's wall time over Mirrored's with the same seed, in seed order ("-": either
    did not reach the target)."""
    ratios = row.get("per_seed_ratio") or {}
    return ", ".join("-" if ratios[s] is None else f"{ratios[s]:.2f}"
                     for s in sorted(ratios, key=int)) or "n/a"


def _fmt(x: float, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "not reached"
    return format(x, spec)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Time to 93% test accuracy (MNIST-5k, 4 workers)",
        "",
        f"MLP 784-256-256-10 ({meta['num_parameters']:,} fp32 parameters), Adam lr 2e-3, "
        "global batch 128 (32 per worker), same seeds for every strategy. The consensus "
        "model (`eval_model`) is evaluated on the 1,000 test digits every "
        f"{meta['eval_every']} steps; target {meta['target']:.0%}; at most "
        f"{meta['max_epochs']} epochs. Wall = training wall-clock from a common start "
        "(start-up excluded; sync strategies pause for evaluation, which is excluded; async "
        "ones are watched by a separate evaluator, see the notes). Medians over seeds 0..N-1 "
        f"with N per link {meta.get('seeds_per_link', len(meta['seeds']))} (an unreached "
        "target counts as infinite). Ratio = median wall / Mirrored's median wall on the "
        "same link; per seed = each seed's wall / Mirrored's with the same seed. Final "
        "accuracy = at the end of the run (runs stop at the target, else "
        "after the last epoch). Bytes/step = worker 0's bytes sent + "
        "received per step as counted by the strategy. Compute / sync ms/step = worker 0's "
        "mean forward+backward time / `optimizer.step()` time (the synchronisation: for PS "
        "the push and the pull, pipelined in buckets, so not separable). Mean staleness = "
        "`metrics()['staleness_mean']` of worker 0 (PS only: versions applied on the shard "
        "between the pull a gradient was computed on and its push).",
        "",
        f"Links: `lo` = loopback; `Nmbit` = each worker in its own network namespace, veth to "
        "a bridge, `tc tbf rate N burst 64kb latency 100ms` both ways (no added delay: "
        "netem is unavailable). Machine: "
        f"{meta['cpus']} CPUs shared with other jobs (load average at start "
        f"{meta['loadavg_start']}).",
        "",
        f"Command: `{meta['command']}` ({meta['total_minutes']:.1f} min)",
        "",
        "| strategy | link | reached | median steps to 93% | median wall s to 93% | "
        "wall vs Mirrored | per seed | final accuracy | bytes/step | compute ms/step | "
        "sync ms/step | mean staleness |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['strategy']} | {r['link']} |" + " n/a |" * 10)
            continue
        failed = f" ({len(r['errors'])} failed)" if r["errors"] else ""
        lines.append(
            f"| {r['strategy']} | {r['link']} | {r['reached']}/{r['runs']}{failed} | "
            f"{_fmt(r['median_steps'], '.0f')} | {_fmt(r['median_wall'], '.1f')} | "
            f"{_fmt(r['ratio'], '.2f')} | {_per_seed(r)} | "
            f"{_fmt(r['final_accuracy'], '.3f')} | "
            f"{_fmt(r['bytes_per_step'], ',.0f')} | "
            f"{_fmt(r.get('compute_ms_per_step', math.nan), '.1f')} | "
            f"{_fmt(r.get('sync_ms_per_step', math.nan), '.1f')} | "
            f"{_fmt(r.get('staleness_mean', math.nan), '.2f')} |")
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], links: list[str], strategies: list[str], target: float,
         path: Path) -> None:
    fig, axes, colors = figure(len(links))
    for ax, link in zip(axes, links, strict=True):
        # Log time axis (the fast strategies finish 10x sooner): the t=0 points are left out.
        points = draw_seeds(ax, runs, link, strategies, colors, target)
        # times with accuracy inside the y range: the x range
        visible = [w for w, a in points if a >= 0.80]
        if visible:
            ax.set_xlim(min(visible) * 0.7, max(visible) * 1.3)
        ax.set_xlabel("training wall-clock (s, log scale)")
        ax.set_ylabel("test accuracy of the consensus model")
        ax.set_ylim(0.80, 0.96)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, f"MNIST-5k, 4 workers: test accuracy vs wall-clock, one line per seed "
                     f"(dashed: the {target:.0%} target)", path)


# =========================================================================== main


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of one training job (target, evaluation, limits), shared with
    ``benchmarks/hierarchical.py``."""
    p.add_argument("--target", type=float, default=0.93)
    p.add_argument("--eval-every", type=int, default=4, help="evaluate every N steps")
    p.add_argument("--max-epochs", type=int, default=16, help="stop here if never reached")
    p.add_argument("--no-early-stop", action="store_true",
                   help="train all --max-epochs even after reaching the target")
    p.add_argument("--timeout", type=float, default=120.0, help="collective/store timeout s")
    p.add_argument("--run-timeout", type=float, default=900.0, help="one job's time limit s")


def add_variants(table: dict[str, tuple[str, dict[str, Any], bool, bool]],
                 items: list[str]) -> bool:
    """Add ``--variant NAME=BASE:JSON`` rows to ``table``; False (after printing why) on a
    malformed one."""
    for item in items:
        try:
            vname, rest = item.split("=", 1)
            base, vjson = rest.split(":", 1)
            extra = json.loads(vjson)
            if base not in table or not isinstance(extra, dict):
                raise ValueError(f"base must be one of {list(table)}, arguments a dict")
        except ValueError as e:
            print(f"--variant must be NAME=BASE:JSON, got {item!r} ({e})", file=sys.stderr)
            return False
        reg, base_args, needs_ps, is_sync = table[base]
        table[vname.strip()] = (reg, {**base_args, **extra}, needs_ps, is_sync)
    return True


def add_run_arguments(p: argparse.ArgumentParser, *, example: str) -> None:
    """Extra rows (``--variant``) and the namespace names of one run, shared with
    ``benchmarks/lm.py``."""
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:JSON",
                   help=f"an extra row: strategy BASE with these arguments, e.g. '{example}' "
                        "(repeatable; list NAME in --strategies); a key \"_env\" holds "
                        "environment variables for that row's processes instead")
    p.add_argument("--netns-prefix", default="sgcv",
                   help="name prefix of the namespaces (<= 6 chars; distinct per parallel run)")
    p.add_argument("--subnet", default="10.77.0",
                   help="first three octets of the bridge's /24 (distinct per parallel run)")


def parse_matrix(args: argparse.Namespace, table: dict[str, tuple[str, dict[str, Any], bool, bool]]
                 ) -> tuple[list[str], list[str], dict[str, int]] | None:
    """``table`` with the ``--variant`` rows added, then the strategies, links and seeds per
    link that the options choose; None (after saying what is wrong) when they do not."""
    if not add_variants(table, args.variant):
        return None
    strategies = choose(args.strategies, table)
    if strategies is None:
        return None
    links = split_list(args.links)
    per_link = seeds_per_link(args.seeds, links)
    if per_link is None:
        return None
    return strategies, links, per_link


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = matrix_parser(__doc__, table=STRATEGIES, quick=QUICK_STRATEGIES,
                      quick_links="lo,100mbit")
    add_run_arguments(p, example='ps-bucket=ps-async:{"bucket_cap_mb": 0.5}')
    add_job_arguments(p)
    return parse_matrix_args(p, argv, out=RESULTS / "convergence", quick=QUICK_STRATEGIES,
                             quick_links="lo,100mbit")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    done = dispatch(args, worker=worker_main, evaluator=evaluator_main,
                    write_results=write_results)
    if done is not None:
        return done
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO / "src"))  # a source checkout without `pip install -e`
    from stratagem.testing.netns import Topology

    chosen = parse_matrix(args, STRATEGIES)
    if chosen is None:
        return 2
    strategies, links, per_link = chosen
    seeds = list(range(max(per_link.values(), default=0)))
    notes: list[str] = []
    missing: dict[str, str] = {}
    if "ps-async" in strategies and importlib.util.find_spec(PS_MODULE) is None:
        missing["ps-async"] = f"{PS_MODULE} is not importable (not written yet)"
        notes.append(f"ps-async: n/a, {missing['ps-async']}.")
        print(f"ps-async: {missing['ps-async']}; its rows are n/a", flush=True)
    if not shaped_links_usable(links, notes):
        links = [link for link in links if link == "lo"]
    runnable = [s for s in strategies if s not in missing]
    meta: dict[str, Any] = {
        "command": "python benchmarks/convergence.py " + " ".join(argv or sys.argv[1:]),
        "workers": args.workers, "target": args.target, "eval_every": args.eval_every,
        "max_epochs": args.max_epochs, "seeds": seeds, "seeds_per_link": per_link,
        "links": links,
        "strategies": {k: STRATEGIES[k][1] for k in strategies},
        "registry": {k: STRATEGIES[k][0] for k in strategies}, "cpus": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(), "num_parameters": 269_322,
    }
    topo = Topology(args.workers, prefix=args.netns_prefix, subnet=args.subnet) if any(link != "lo" for link in links) else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def one(key: str, link: str, seed: int, topo: Any, tmp: Path) -> dict[str, Any]:
        r = run_once(key, link, seed, topo, args, tmp)
        _print_run(r)
        return r

    runs = run_matrix(links, per_link.__getitem__, runnable, topo, notes, one,
                      meta=meta, tmp_prefix="sg-convergence-")
    params = [r["num_parameters"] for r in runs if r.get("num_parameters")]
    if params:
        meta["num_parameters"] = params[0]
    meta["missing"], meta["base_notes"] = missing, notes
    write_results(meta, runs, strategies, out)
    return 0 if all(r.get("error") is None for r in runs) else 1


def write_results(meta: dict[str, Any], runs: list[dict[str, Any]], strategies: list[str],
                  out: Path) -> None:
    """Summarise ``runs`` and write ``out`` .md, .json and .png."""
    links, missing = meta["links"], meta.get("missing", {})
    rows = summarize(runs, strategies, links, meta["seeds"], missing)
    meta["notes"] = list(meta.get("base_notes", [])) + _auto_notes(rows, runs,
                                                                   _registry_names(meta))
    ran = [k for k in strategies if k not in missing]
    write_outputs(out, markdown(rows, meta), meta, rows, runs, wrote=", .json, .png",
                  plot=(lambda: plot(runs, links, ran, meta["target"], out.with_suffix(".png")))
                  if runs else None)


def _print_run(r: dict[str, Any]) -> None:
    if r.get("error"):
        print(f"{r['strategy']:12s} {r['link']:8s} seed {r['seed']}: FAILED {r['error']}\n"
              f"{r.get('log_tail', '')}", flush=True)
        return
    hit = r["reached"]
    what = (f"93% at step {hit['step']} / {hit['wall']:.1f}s" if hit else
            f"target not reached in {r['steps']} steps ({r['wall_seconds']:.1f}s)")
    print(f"{r['strategy']:12s} {r['link']:8s} seed {r['seed']}: {what}; final acc "
          f"{r['final_accuracy']:.3f}, {r['bytes_per_step']:,.0f} B/step, "
          f"job {r['job_seconds']:.1f}s", flush=True)


def _registry_names(meta: dict[str, Any]) -> dict[str, str]:
    """Each row's registry name (what ``TARGETS`` are keyed by). Results written before
    ``meta["registry"]`` existed: the built-in table, plus the ``--variant NAME=BASE:`` rows
    of the run's command line (the command is stored unquoted, so it is matched, not parsed)."""
    if "registry" in meta:
        return dict(meta["registry"])
    names = {k: v[0] for k, v in STRATEGIES.items()}
    for name, base in re.findall(r"--variant\s+([^=\s]+)=([^:\s]+):", meta.get("command", "")):
        if base in names:
            names[name] = names[base]
    return names


def _auto_notes(rows: list[dict[str, Any]], runs: list[dict[str, Any]],
                registry: dict[str, str] | None = None) -> list[str]:
    notes = []
    for r in rows:
        if "missing" in r:
            continue
        if r["runs"] and r["reached"] < r["runs"]:
            notes.append(f"{r['strategy']} on {r['link']}: reached the target in "
                         f"{r['reached']} of {r['runs']} runs.")
        for e in r["errors"]:
            notes.append(f"{r['strategy']} on {r['link']}: a run failed: {e}")
    registry = {k: v[0] for k, v in STRATEGIES.items()} if registry is None else registry
    for link in sorted({r["link"] for r in rows}):
        if link == "lo":
            continue
        # Each target is about its own family: a PS-only run says nothing about the averaging target.
        for family, target, members, limit in TARGETS:
            best = [r for r in rows if r["link"] == link and "missing" not in r
                    and registry.get(r["strategy"]) in members
                    and math.isfinite(r.get("ratio", math.nan))]
            if best:
                b = min(best, key=lambda r: r["ratio"])
                verdict = "met" if b["ratio"] <= limit else "NOT met"
                notes.append(f"{link}: fastest {family} to target is {b['strategy']} at "
                             f"{b['ratio']:.2f}x Mirrored's wall time ({target} <= "
                             f"{limit:.1f}x: {verdict}).")
    if any(r["strategy"] in ("easgd-async", "ps-async") for r in runs):
        notes.append("Async strategies (easgd-async, ps-async): no worker evaluates; an "
                     "evaluator process on the bridge pulls the consensus model each time the "
                     "workers' mean step count crosses a multiple of the evaluation interval "
                     "(steps = that mean, wall = real time: nobody pauses). It shares the 2 "
                     "CPUs with the workers.")
    return notes


if __name__ == "__main__":
    sys.exit(main())
