"""Islands of different speeds: asynchronous (decoupled) DiLoCo against synchronous DiLoCo
and Mirrored, 4 replicas of the character-level GPT of ``benchmarks/lm.py`` on shaped links.

    python benchmarks/decoupled.py [--seeds 3] [--links 20mbit] [--cases equal,slow]

Rows (``--strategies``): ``mirrored``; ``diloco`` (synchronous, period 32, outer Nesterov lr
1.0 momentum 0.3: lm.py's tuned values); ``diloco-async`` (the same with ``mode="async"``,
``min_contributions`` 3 of 4, ``grace_window`` 10 s, fp32 pseudo-gradients);
``diloco-async-int4`` (int4 with error feedback both ways: the model comes down as the
rounds' int4 updates); ``diloco-async-int4-up`` (int4 up only, the model down in fp32: the
ablation of the compressed download); ``diloco-async-nostale`` (the staleness correction
off: the ablation); ``diloco-async-sd0`` and ``diloco-async-int4-sd0`` (``sync_delay=0``:
a replica waits for its round, which needs 3 of the 4, each time it sends, rather than
training on from the model it sent from and grafting those steps onto the new one).

Cases (``--cases``): ``equal`` (every replica as fast as the machine lets it); ``slow``
(after each step replica 3 sleeps twice its compute per step: forward and backward as
measured over its first 24 steps, while every replica computes on the shared CPUs, then
frozen; one torch thread per replica; the synchronous rows are slowed the same way in the
same run); ``kills`` (every ``--kill-every`` 15 s a random replica is SIGKILLed and started
again at once; its replacement starts from the newest global model) and ``slow+kills``,
asynchronous rows only (a synchronous row survives a SIGKILL only with
``fault_tolerant=True``, measured by ``benchmarks/ft_kills.py``), over a budget of
``--kill-steps`` steps, long enough for at least 5 kills. Asynchronous replicas share no
process group (``comm=sg.Comm.single()``, as a replica restarted alone must): each draws
batches of global batch / 4 sequences from its own shuffle.

Goodput (asynchronous rows): the inner steps whose pseudo-gradient was merged into the global
model (the shard counts them) over the inner steps the replicas trained, every attempt's
counted (a killed replica's steps since its last merged pseudo-gradient are lost; so is what
was in flight when the budget ended).

Measured per run: the wall time until the global model (``eval_model``) reaches validation
loss ``--target`` (2.8), the validation loss after a fixed budget of samples (``--max-steps``
x global batch: synchronous rows train exactly that many steps; asynchronous rows stop when
the replicas' mean step count reaches ``--max-steps``, so the total samples are equal, then
send what they trained since their last pseudo-gradient and the evaluator scores the model
once they all finished), the
bytes per outer step (per step for Mirrored) as worker 0's strategy counts them, and for the
asynchronous rows the rounds' staleness and how often a replica waited for its round.
Synchronous rows are scored by worker 0 every ``--eval-every`` steps (the pause excluded from
the wall); asynchronous rows by an evaluator process beside the shard, nobody pausing (the
wall is real time).

Writes ``benchmarks/results/decoupled.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import _common as common  # noqa: E402
import lm  # noqa: E402 - the model, data, build and scoring of the GPT benchmark
from convergence import _fmt, _median, add_run_arguments, parse_matrix  # noqa: E402

_DILOCO = {"period": 32, "outer_lr": 1.0, "outer_momentum": 0.3}
_ASYNC = {**_DILOCO, "mode": "async", "min_contributions": 3, "grace_window": 10.0}
#: name -> (registry name, strategy arguments, needs a PS shard, synchronous)
STRATEGIES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "mirrored": ("mirrored", {}, False, True),
    "diloco": ("diloco", dict(_DILOCO), False, True),
    "diloco-async": ("diloco", dict(_ASYNC), True, False),
    "diloco-async-int4": ("diloco", {**_ASYNC, "compression": "int4"}, True, False),
    "diloco-async-nostale": ("diloco", {**_ASYNC, "staleness": "none"}, True, False),
    "diloco-async-int4-up": ("diloco", {**_ASYNC, "compression": "int4",
                                        "compress_download": False}, True, False),
    # sync_delay=0: a replica waits for its round (min_contributions of 4) when it sends,
    # instead of training on the model it sent from and grafting those steps on.
    "diloco-async-sd0": ("diloco", {**_ASYNC, "sync_delay": 0}, True, False),
    "diloco-async-int4-sd0": ("diloco", {**_ASYNC, "compression": "int4", "sync_delay": 0},
                              True, False),
}
QUICK_STRATEGIES = ["diloco-async", "diloco"]
#: "kills" and "slow+kills" run the asynchronous rows only: a synchronous row survives a
#: SIGKILL only with fault_tolerant=True (torchft's quorum; benchmarks/ft_kills.py).
CASES = ("equal", "slow", "kills", "slow+kills")
SLOW_FACTOR = 3.0  # the slow replica's step time over its compute time
MIN_KILLS = 5  # the kills cases' runs must be long enough for this many SIGKILLs
CALIBRATION_STEPS = 24  # the slow replica's compute is measured over these first steps


# =========================================================================== worker side


def worker_main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    from stratagem.demo_lm import lr_at

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(cfg["timeout"])
    ctrl = common._store(timeout)
    sync = bool(cfg["sync"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Asynchronous replicas share no process group (each restarts alone): each draws its own
    # batches of global_batch / world sequences from its own shuffle.
    import stratagem as sg

    strategy, model, optimizer = lm._build(cfg) if sync else lm._build(
        cfg, comm=sg.Comm.single())
    built = strategy.metrics()  # start-up traffic (registration, the first pull): left out
    setup_bytes = built["bytes_sent"] + built["bytes_received"]
    X, Y, Xv, Yv = lm._data(cfg)
    slow = cfg["case"].startswith("slow") and rank == world - 1
    compute: float | None = None  # the slow replica's compute per step, measured live
    batch = int(cfg["global_batch"]) if sync else int(cfg["global_batch"]) // world
    loader = strategy.distribute_dataset((X, Y), batch, shuffle=True,
                                         seed=int(cfg["seed"]) * 1000 + (0 if sync else rank))
    every, target = int(cfg["eval_every"]), float(cfg["target"])
    max_steps, lr, max_wall = int(cfg["max_steps"]), float(cfg["lr"]), float(cfg["max_wall"])
    # A restarted replica counts on from its previous attempts' steps (they were trained,
    # and what they sent after their last merged pseudo-gradient is lost: goodput).
    key = f"{common._TAG}step/{rank}"
    before = int(ctrl.get(key)) if attempt and ctrl.check([key]) else 0
    progress = common.start_together(ctrl, rank, world, sync, timeout)
    if progress is not None:
        progress.step = before
    start = time.perf_counter()
    paused = 0.0
    curve: list[tuple[float, float, float]] = []
    reached: dict[str, float] | None = None
    eval_bytes = 0.0

    def evaluate(step: int) -> bool:
        nonlocal paused, reached, eval_bytes
        t0 = time.perf_counter()
        before = strategy.metrics()
        consensus = strategy.eval_model(model)
        after = strategy.metrics()
        eval_bytes += (after["bytes_sent"] + after["bytes_received"]
                       - before["bytes_sent"] - before["bytes_received"])
        if rank == 0:
            loss = lm._val_loss(consensus, Xv, Yv)
            wall = t0 - start - paused
            curve.append((wall, step, loss))
            if reached is None and loss <= target:
                reached = {"wall": wall, "step": step, "val_loss": loss}
            stop = wall > max_wall
            ctrl.set(f"{common._TAG}go/{step}", "stop" if stop else "go")
        else:
            stop = ctrl.get(f"{common._TAG}go/{step}") == b"stop"
        paused += time.perf_counter() - t0
        return stop

    # Asynchronous replicas stop when the evaluator says the budget is spent (their mean
    # step count); the cap only bounds a run whose evaluator died.
    cap = max_steps if sync else 4 * max_steps
    step, stop, epoch = before, False, attempt * 1000
    while not stop and step < cap:
        loader.set_epoch(epoch)
        for x, y in loader:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr=lr, min_lr=lr, warmup=lm.WARMUP, total=max_steps)
            t_compute = time.perf_counter()
            _, loss = model(x, y)
            strategy.backward(loss)
            if slow and step < CALIBRATION_STEPS:
                # Measured where it runs, over the first steps, while every replica computes
                # (the CPUs shared as in the equal case): forward and backward, no
                # communication (none happens there for DiLoCo); then frozen. Measured on,
                # it would shrink whenever the others wait (sync) and free the CPUs, and the
                # slow replica would not be slow.
                took = time.perf_counter() - t_compute
                compute = took if compute is None else 0.8 * compute + 0.2 * took
            optimizer.step()
            optimizer.zero_grad()
            if slow and compute is not None:
                time.sleep((SLOW_FACTOR - 1.0) * compute)
            step += 1
            if progress is not None:
                progress.step = step
                stop = progress.stop.is_set()
            elif step % every == 0 or step == max_steps:
                stop = evaluate(step)
            if stop or step >= cap:
                break
        epoch += 1
    if not sync:
        # The budget is spent: send the steps since the last pseudo-gradient and close the
        # round, so the evaluator's last score (after every replica finished) holds every
        # step, as synchronous DiLoCo's outer step at the last step does.
        strategy.finalize(model)
    end_wall = time.perf_counter() - start - paused
    metrics = strategy.metrics()
    moved = metrics["bytes_sent"] + metrics["bytes_received"] - eval_bytes - setup_bytes
    outer = metrics.get("outer_sent") or metrics.get("outer_steps") or 0
    result: dict[str, Any] = {
        "rank": rank, **common.traffic(metrics, end_wall), "trained_steps": step,
        "attempts": attempt + 1,
        "bytes_per_outer_step": moved / outer if outer else None,
        "outer_steps": outer,
        "slow_pause": (SLOW_FACTOR - 1.0) * compute if compute is not None else 0.0,
        "outer_waits": metrics.get("outer_waits"),
        "outer_wait_seconds": metrics.get("outer_wait_seconds"),
        "outer_mean_staleness": metrics.get("outer_mean_staleness"),
        "outer_max_staleness": metrics.get("outer_max_staleness"),
        "num_parameters": strategy.unwrap(model).num_parameters(),
    }
    if sync and rank == 0:
        result.update(curve=curve, final_val_loss=curve[-1][2], reached=reached)
    common.finish_worker(cfg, ctrl, strategy, result, rank=rank, world=world, step=step,
                         progress=progress, timeout=timeout)
    return 0


def evaluator_main(cfg_path: str) -> int:
    """Asynchronous rows: score the global model each time the replicas' mean step count
    crosses a multiple of ``eval_every``; stop everyone at the sample budget."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    import stratagem as sg

    torch.set_num_threads(1)
    target = float(cfg["target"])
    _, _, Xv, Yv = lm._data(cfg)
    common.run_evaluator(
        cfg, lambda: lm._build(cfg, comm=sg.Comm.single()),
        lambda strategy, model: lm._val_loss(strategy.eval_model(model), Xv, Yv),
        lambda loss: loss <= target,
        lambda reached, wall: wall > float(cfg["max_wall"]),
        metric="val_loss", stop_mean=float(cfg["max_steps"]), final_after_finish=True)
    return 0


# =========================================================================== parent side


def run_once(key: str, link: str, seed: int, topo: Any, args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    row, case = key.split("@")
    name, strategy_args, needs_ps, sync = STRATEGIES[row]
    run_dir = tmp / f"{row}-{case}-{link}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"strategy": name, "strategy_args": strategy_args, "seed": seed, "sync": sync,
           "case": case, "eval_every": args.eval_every, "target": args.target,
           "max_steps": args.max_steps, "max_wall": args.max_wall, "timeout": args.timeout,
           "result_dir": str(run_dir), "model": lm.MODEL, "lr": lm.LR,
           "global_batch": lm.GLOBAL_BATCH}
    kills = "kills" in case
    if kills:
        cfg["max_steps"] = args.kill_steps
    out, chief, ranks = common.run_job(
        str(Path(__file__).resolve()), run_dir, cfg,
        {"strategy": key, "row": row, "case": case, "link": link, "seed": seed,
         "strategy_args": strategy_args},
        workers=args.workers, sync=sync, needs_ps=needs_ps, topo=topo, timeout=args.timeout,
        run_timeout=args.run_timeout, kill_every=args.kill_every if kills else None,
        kill_seed=seed)
    if chief is None:
        return out
    out.update({k: chief.get(k) for k in ("curve", "final_val_loss", "reached", "steps",
                                           "wall_seconds", "bytes_per_step",
                                           "bytes_per_outer_step", "num_parameters")})
    out["worker_steps"] = [r["trained_steps"] for r in ranks]
    out["attempts"] = [r["attempts"] for r in ranks]
    trained = sum(out["worker_steps"])
    # Goodput: inner steps whose pseudo-gradient was merged into the global model (the
    # shard's count) over the inner steps the replicas trained (every attempt's).
    merged = out.get("merged_samples")
    out["goodput"] = merged / trained if merged is not None and trained else None
    out["slow_pause"] = max(r["slow_pause"] for r in ranks)
    for k in ("outer_waits", "outer_wait_seconds", "outer_mean_staleness",
              "outer_max_staleness"):
        out[k] = [r.get(k) for r in ranks]
    return out


def summarize(runs: list[dict[str, Any]], keys: list[str], links: list[str]
              ) -> list[dict[str, Any]]:
    rows = []
    for link in links:
        base: dict[str, float] = {}
        for key in keys:
            rs = [r for r in runs if r["strategy"] == key and r["link"] == link]
            ok = [r for r in rs if r.get("error") is None]
            row_name, case = key.split("@")
            row: dict[str, Any] = {
                "strategy": row_name, "case": case, "link": link, "runs": len(rs),
                "errors": [r["error"] for r in rs if r.get("error")],
                "reached": sum(1 for r in ok if r["reached"]),
                "median_wall": _median([r["reached"]["wall"] if r["reached"] else math.inf
                                        for r in ok]),
                "final_val_loss": _median([r["final_val_loss"] for r in ok]),
                "bytes_per_outer_step": _median([r["bytes_per_outer_step"] or math.nan
                                                 for r in ok]),
                "per_seed_wall": {r["seed"]: (r["reached"]["wall"] if r["reached"] else None)
                                  for r in ok},
                "per_seed_loss": {r["seed"]: r["final_val_loss"] for r in ok},
                "waits": [sum(w or 0 for w in r["outer_waits"]) for r in ok],
                "kills": [r.get("kills", 0) for r in ok],
                "goodput": _median([r["goodput"] if r.get("goodput") is not None
                                    else math.nan for r in ok]),
                "max_staleness": [max((s or 0) for s in r["outer_max_staleness"])
                                  for r in ok],
            }
            if row_name == "diloco":
                base[case] = row["median_wall"]
            ref = base.get(case)
            row["vs_sync"] = (row["median_wall"] / ref if ref and math.isfinite(ref)
                              else math.nan)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    target = meta["target"]
    lines = [
        f"# Islands of different speeds: asynchronous DiLoCo, {meta['workers']} replicas",
        "",
        f"GPT {meta['model']} ({meta['num_parameters']:,} parameters), AdamW lr {lm.LR}, "
        f"global batch {lm.GLOBAL_BATCH} sequences; the settings of `benchmarks/lm.py`. "
        f"Sample budget: {meta['max_steps']} steps x {lm.GLOBAL_BATCH} sequences per run "
        "(asynchronous rows: until the replicas' mean step count reaches it). Case `slow`: "
        f"replica {meta['workers'] - 1} sleeps {SLOW_FACTOR - 1:g}x its compute per step "
        "(forward + backward over its first 24 steps in the run, then frozen). Wall = seconds to validation loss "
        f"{target} of the global model (synchronous rows: evaluation pauses excluded; "
        "asynchronous rows: real time, scored by an evaluator). vs sync = median wall / "
        "synchronous DiLoCo's median wall in the same case. Medians over seeds; an "
        "unreached target counts as infinite. Bytes/outer step: worker 0's bytes sent + "
        "received per outer step (per step for Mirrored), evaluation traffic excluded. "
        "Waits: pseudo-gradients sent while the previous one's round was still open (all "
        "replicas); staleness: the largest seen by any replica.",
        "",
        f"Links: `Nmbit` = each replica in its own network namespace behind a veth capped "
        f"both ways with `tc tbf`. Machine: {meta['cpus']} CPUs (load average at start "
        f"{meta['loadavg_start']}).",
        "",
        f"Command: `{meta['command']}` ({meta['total_minutes']:.1f} min)",
        "",
        f"| strategy | case | link | reached | median wall s to {target} | vs sync DiLoCo "
        f"| val loss at budget | bytes/outer step | goodput | kills | waits | max staleness |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        failed = f" ({len(r['errors'])} failed)" if r["errors"] else ""
        lines.append(
            f"| {r['strategy']} | {r['case']} | {r['link']} | {r['reached']}/{r['runs']}"
            f"{failed} | {_fmt(r['median_wall'], '.1f')} | {_fmt(r['vs_sync'], '.2f')} | "
            f"{_fmt(r['final_val_loss'], '.3f')} | {_fmt(r['bytes_per_outer_step'], ',.0f')} "
            f"| {_fmt(r['goodput'], '.3f')} | {r['kills']} | {r['waits']} | "
            f"{r['max_staleness']} |")
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _auto_notes(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    by = {(r["strategy"], r["case"], r["link"]): r for r in rows}
    for r in rows:
        notes += [f"{r['strategy']} {r['case']} on {r['link']}: a run failed: {e}"
                  for e in r["errors"]]
        few = [k for k in r["kills"] if k < MIN_KILLS] if "kills" in r["case"] else []
        if few:
            notes.append(f"{r['strategy']} {r['case']} {r['link']}: runs with fewer than "
                         f"{MIN_KILLS} kills ({r['kills']}): raise --kill-steps")
        sync_equal = by.get(("diloco", "equal", r["link"]))
        if r["strategy"].startswith("diloco-async") and sync_equal:
            loss, ref = r["final_val_loss"], sync_equal["final_val_loss"]
            if math.isfinite(loss) and math.isfinite(ref):
                notes.append(f"{r['strategy']} {r['case']} {r['link']}: wall {r['vs_sync']:.2f}x "
                             f"sync DiLoCo's ({r['case']}); val loss at the budget "
                             f"{loss:.3f} vs sync DiLoCo equal {ref:.3f} "
                             f"({100 * (loss / ref - 1):+.1f}%)")
    return notes


def write_results(meta: dict[str, Any], runs: list[dict[str, Any]], strategies: list[str],
                  out: Path) -> None:
    rows = summarize(runs, meta["keys"], meta["links"])
    meta["notes"] = list(meta.get("base_notes", [])) + _auto_notes(rows)
    common.write_outputs(out, markdown(rows, meta), meta, rows, runs, wrote=", .json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = common.matrix_parser(__doc__, table=STRATEGIES, quick=QUICK_STRATEGIES,
                             quick_links="20mbit")
    add_run_arguments(p, example='diloco-async-k2=diloco:{"mode": "async", '
                                 '"min_contributions": 2}')
    p.set_defaults(links="20mbit", seeds="1")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list from {CASES}")
    p.add_argument("--target", type=float, default=2.8, help="validation loss to reach")
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=320,
                   help="the sample budget, in steps of the global batch")
    p.add_argument("--max-wall", type=float, default=240.0,
                   help="stop a run after this many seconds of training")
    p.add_argument("--kill-every", type=float, default=15.0,
                   help="cases with kills: SIGKILL a random replica every this many seconds")
    # 1920 steps (85-110 s of training here) gave 4 kills in 2 runs of 12: 2400 leaves room.
    p.add_argument("--kill-steps", type=int, default=2400,
                   help="cases with kills: the sample budget in steps (long enough for >= "
                        f"{MIN_KILLS} kills; a run with fewer is named in the notes)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--run-timeout", type=float, default=600.0)
    args = common.parse_matrix_args(p, argv, out=RESULTS / "decoupled",
                                    quick=QUICK_STRATEGIES, quick_links="20mbit")
    if args.smoke and args.cases == p.get_default("cases"):
        args.cases = "slow"  # one job: the asynchronous row with its slow replica
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    done = common.dispatch(args, worker=worker_main, evaluator=evaluator_main,
                           write_results=write_results)
    if done is not None:
        return done
    sys.path.insert(0, str(REPO / "src"))
    from stratagem.demo_lm import GPT, GPTConfig, load_corpus
    from stratagem.testing.netns import Topology

    chosen = parse_matrix(args, STRATEGIES)
    if chosen is None:
        return 2
    strategies, links, per_link = chosen
    cases = common.split_list(args.cases)
    if any(c not in CASES for c in cases):
        print(f"--cases: choose from {CASES}, got {cases}", file=sys.stderr)
        return 2
    keys = [f"{s}@{c}" for c in cases for s in strategies
            if "kills" not in c or not STRATEGIES[s][3]]
    load_corpus()
    notes: list[str] = []
    if not common.shaped_links_usable(links, notes):
        links = [link for link in links if link == "lo"]
        per_link = {k: v for k, v in per_link.items() if k == "lo"}
    meta: dict[str, Any] = {
        "command": "python benchmarks/decoupled.py " + " ".join(argv or sys.argv[1:]),
        "workers": args.workers, "target": args.target, "eval_every": args.eval_every,
        "max_steps": args.max_steps, "max_wall": args.max_wall, "seeds_per_link": per_link,
        "links": links, "keys": keys, "cases": cases,
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
        r = run_once(key, link, seed, topo, args, tmp)
        _print_run(r, args.target)
        return r

    runs = common.run_matrix(links, per_link.__getitem__, keys, topo, notes, one, meta=meta,
                             tmp_prefix="sg-decoupled-")
    write_results(meta, runs, strategies, out)
    return 0 if all(r.get("error") is None for r in runs) else 1


def _print_run(r: dict[str, Any], target: float) -> None:
    if r.get("error"):
        print(f"{r['strategy']:28s} {r['link']:8s} seed {r['seed']}: FAILED {r['error']}\n"
              f"{r.get('log_tail', '')}", flush=True)
        return
    hit = r["reached"]
    what = (f"{target} at {hit['wall']:.1f}s" if hit else "target not reached")
    print(f"{r['strategy']:28s} {r['link']:8s} seed {r['seed']}: {what}; val loss at the "
          f"budget {r['final_val_loss']:.3f}; steps {r['worker_steps']}; waits "
          f"{r['outer_waits']}; staleness {r['outer_max_staleness']}; job "
          f"{r['job_seconds']:.1f}s", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
