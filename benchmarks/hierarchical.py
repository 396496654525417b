"""Two nodes, slow link between them: time to 93% on MNIST-5k, flat vs hierarchical strategies.

    python benchmarks/hierarchical.py [--seeds 3] [--links 20mbit,100mbit] [--quick]

The job of ``benchmarks/convergence.py`` (MNIST-5k, MLP 784-256-256-10, Adam
lr 2e-3, global batch 128 over 4 workers, the consensus model evaluated every ``--eval-every``
steps, stop at ``--target``), run on 2 nodes x 2 workers: each node is a network namespace
holding both of its workers (intra-node traffic stays on the namespace's own loopback path,
fast), and each node's veth to the bridge is capped both ways with ``tc tbf`` at the link rate
(inter-node traffic crosses two capped veths). The workers get torchrun's per-node environment
(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=2``, ``GROUP_RANK``), which is what node groups are built
from. The worker code and the formatting helpers are ``convergence.py``'s, the job runner
``_common.py``'s (imported, not copied); this file adds the 2-node layout, the strategy
table and the byte counting.

Strategies: flat Mirrored (DDP all-reduce every step over all 4 workers), flat DiLoCo (the
convergence benchmark's settings: period 16, outer Nesterov lr 0.7, momentum 0.9) and
``Hierarchical(inner=Mirrored, outer=DiLoCo)`` (all-reduce inside a node every step, DiLoCo
across nodes) — the last once ``sg.Hierarchical`` is in the registry; until then its rows say
so. Adding a strategy is one more entry in ``STRATEGIES``.

Inter-node bytes per step: the veths' byte counters (the bytes each node sent into the bridge,
summed over the nodes: every byte between the nodes counted once) over the whole job divided by
worker 0's steps. They include the job's start-up (rendezvous, the initial broadcast), the control store
in the root namespace (evaluation stop/go keys, heartbeats), so they are an upper bound on the
strategy's own traffic; the strategies' ``metrics()`` (worker 0's bytes sent + received per
step) are reported next to them.

Writes ``benchmarks/results/hierarchical.{json,md}``. Done-when target: at 20 Mbit/s
Hierarchical reaches 93% in <= 0.3x flat Mirrored's wall time and <= 1.0x flat DiLoCo's, with
fewer inter-node bytes per step than either. Needs root (namespaces); exits 2 with the reason
otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))  # a source checkout without `pip install -e`

import convergence as harness  # noqa: E402 - after the path set-up above
from _common import (  # noqa: E402
    _interrupt,
    add_ledger_args,
    choose,
    output_dir,
    split_list,
    write_outputs,
)

NNODES = 2
#: name -> (registry name, strategy arguments, needs a PS shard, synchronous): the same
#: shape as convergence.STRATEGIES, so convergence.run_once runs them.
STRATEGIES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "mirrored": ("mirrored", {}, False, True),
    "diloco": harness.STRATEGIES["diloco"],
    # outer_* keywords go to the outer DiLoCo (so DiLoCo's own outer_lr is outer_outer_lr):
    # the same period and outer optimizer as flat DiLoCo.
    "hierarchical": ("hierarchical", {"inner": "mirrored", "outer": "diloco",
                                      "outer_period": 16, "outer_outer_lr": 0.7,
                                      "outer_outer_momentum": 0.9},
                     False, True),
}
TARGET_VS = {"mirrored": 0.3, "diloco": 1.0}  # Hierarchical's wall-time targets at 20mbit


def _available(name: str) -> bool:
    import stratagem as sg

    return name in sg.strategy_names()


def run_one(key: str, link: str, seed: int, topo: Any, args: argparse.Namespace,
            tmp: Path) -> dict[str, Any]:
    """One job on the 2-node topology, with the veth counters read around it (``topo`` None,
    on loopback: the strategy's own count only)."""
    if topo is None:
        r = harness.run_once(key, link, seed, None, args, tmp, spec=STRATEGIES[key],
                             nnodes=NNODES)
        r["inter_node_bytes"] = None
        if r.get("error") is None:
            m, steps = r.get("metrics", {}), max(1, int(r["steps"]))
            r["inter_node_bytes_per_step"] = math.nan
            if "inter_node_bytes_sent" in m:
                r["metrics_inter_node_bytes_per_step"] = (
                    m["inter_node_bytes_sent"] + m["inter_node_bytes_received"]) / steps
        return r
    before = [topo.link_bytes(i) for i in range(NNODES)]
    r = harness.run_once(key, link, seed, topo, args, tmp, spec=STRATEGIES[key], nnodes=NNODES)
    after = [topo.link_bytes(i) for i in range(NNODES)]
    # What left each node: a byte from node 0 to node 1 leaves one veth and enters the other,
    # so counting the sending side alone counts it once.
    crossed = sum(after[n][0] - before[n][0] for n in range(NNODES))
    r["inter_node_bytes"] = crossed
    if r.get("error") is None:
        steps = max(1, int(r["steps"]))
        r["inter_node_bytes_per_step"] = crossed / steps
        m = r.get("metrics", {})
        if "inter_node_bytes_sent" in m:
            r["metrics_inter_node_bytes_per_step"] = (
                m["inter_node_bytes_sent"] + m["inter_node_bytes_received"]) / steps
    return r


def summarize(runs: list[dict[str, Any]], strategies: list[str], links: list[str],
              missing: dict[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for link in links:
        walls: dict[str, float] = {}
        for key in strategies:
            row: dict[str, Any] = {"strategy": key, "link": link}
            if key in missing:
                row["missing"] = missing[key]
                rows.append(row)
                continue
            rs = [r for r in runs if r["strategy"] == key and r["link"] == link]
            ok = [r for r in rs if r.get("error") is None]
            row.update(runs=len(rs), errors=[r["error"] for r in rs if r.get("error")],
                       reached=sum(1 for r in ok if r["reached"]))
            row["median_steps"] = harness._median(
                [r["reached"]["step"] if r["reached"] else math.inf for r in ok])
            row["median_wall"] = harness._median(
                [r["reached"]["wall"] if r["reached"] else math.inf for r in ok])
            row["final_accuracy"] = harness._median([r["final_accuracy"] for r in ok])
            row["inter_node_bytes_per_step"] = harness._median(
                [r["inter_node_bytes_per_step"] for r in ok])
            row["metrics_bytes_per_step"] = harness._median([r["bytes_per_step"] for r in ok])
            # Only strategies that know their node groups split their bytes (Hierarchical).
            inter = [r["metrics_inter_node_bytes_per_step"] for r in ok
                     if r.get("metrics_inter_node_bytes_per_step") is not None]
            row["metrics_inter_node_bytes_per_step"] = harness._median(inter)
            walls[key] = row["median_wall"]
            rows.append(row)
        for row in rows:
            if row["link"] != link or "missing" in row:
                continue
            for base in ("mirrored", "diloco"):
                w = walls.get(base)
                row[f"vs_{base}"] = (row["median_wall"] / w if w and math.isfinite(w)
                                     else math.nan)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    f = harness._fmt
    lines = [
        "# Two nodes x two workers: time to 93% (MNIST-5k), flat vs hierarchical",
        "",
        "The job of `benchmarks/convergence.py` (MLP 784-256-256-10, Adam lr 2e-3, global "
        "batch 128 = 32 per worker, consensus model evaluated every "
        f"{meta['eval_every']} steps, target {meta['target']:.0%}, at most "
        f"{meta['max_epochs']} epochs) on 2 nodes of 2 workers: each node a network namespace "
        "holding both its workers (intra-node traffic never leaves it), its veth to a bridge "
        "capped both ways with `tc tbf rate R burst 64kb latency 100ms`. Wall = training "
        "wall-clock to the target (start-up and evaluation pauses excluded); medians over "
        f"seeds 0..{len(meta['seeds']) - 1} (an unreached target counts as infinite). "
        "Inter-node B/step = the veths' byte counters (bytes each node sent, summed over "
        "the nodes) over the whole job / steps: includes start-up and the control store, an "
        "upper bound. "
        "Metrics B/step = worker 0's `metrics()` bytes sent + received per step (all its "
        "peers); metrics inter-node B/step = the part Hierarchical counts on its cross-node "
        "group (flat strategies do not know which of their peers share a node).",
        "",
        f"Machine: {meta['cpus']} CPUs shared with other jobs (load average at start "
        f"{meta['loadavg_start']}). Command: `{meta['command']}` "
        f"({meta['total_minutes']:.1f} min)",
        "",
        "| strategy | link | reached | median steps | median wall s | vs Mirrored | "
        "vs DiLoCo | final acc | inter-node B/step (veth) | metrics B/step | "
        "metrics inter-node B/step |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "missing" in r:
            lines.append(f"| {r['strategy']} | {r['link']} | n/a: {r['missing']} "
                         "| | | | | | | | |")
            continue
        failed = f" ({len(r['errors'])} failed)" if r["errors"] else ""
        lines.append(
            f"| {r['strategy']} | {r['link']} | {r['reached']}/{r['runs']}{failed} | "
            f"{f(r['median_steps'], '.0f')} | {f(r['median_wall'], '.1f')} | "
            f"{f(r['vs_mirrored'], '.2f')} | {f(r['vs_diloco'], '.2f')} | "
            f"{f(r['final_accuracy'], '.3f')} | {f(r['inter_node_bytes_per_step'], ',.0f')} | "
            f"{f(r['metrics_bytes_per_step'], ',.0f')} | "
            f"{f(r['metrics_inter_node_bytes_per_step'], ',.0f')} |")
    if meta.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    for row in rows:
        if row["strategy"] != "hierarchical" or "missing" in row or row["link"] != "20mbit":
            continue
        by = {r["strategy"]: r for r in rows if r["link"] == row["link"] and "missing" not in r}
        for base, limit in TARGET_VS.items():
            if base not in by:
                notes.append(f"20mbit: hierarchical vs {base}: n/a ({base} was not run).")
                continue
            ratio = row.get(f"vs_{base}", math.nan)
            ok = math.isfinite(ratio) and ratio <= limit
            notes.append(f"20mbit: hierarchical at {harness._fmt(ratio, '.2f')}x {base}'s wall "
                         f"time (target <= {limit}x: {'met' if ok else 'NOT met'}).")
        if not any(b in by for b in TARGET_VS):
            continue
        fewer = all(row["inter_node_bytes_per_step"] < by[b]["inter_node_bytes_per_step"]
                    for b in TARGET_VS if b in by)
        notes.append(f"20mbit: hierarchical inter-node bytes/step fewer than flat "
                     f"{' and '.join(b for b in TARGET_VS if b in by)}: "
                     f"{'met' if fewer else 'NOT met'}.")
    return notes


def write_results(meta: dict[str, Any], runs: list[dict[str, Any]], strategies: list[str],
                  out: Path) -> None:
    rows = summarize(runs, strategies, meta["links"], meta["missing"])
    meta["notes"] = list(meta.get("base_notes", [])) + _verdicts(rows)
    write_outputs(out, markdown(rows, meta), meta, rows, runs, wrote=" and .json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--links", default="20mbit,100mbit", help="comma list of tc rates")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma list from {', '.join(STRATEGIES)}")
    p.add_argument("--quick", action="store_true", help="1 seed, 20mbit only")
    harness.add_job_arguments(p)
    p.add_argument("--out", default=str(RESULTS / "hierarchical"),
                   help="output path without extension (.json and .md are written); a bare "
                        "name goes under --out-dir")
    add_ledger_args(p, smoke=f"hierarchical, {NNODES} nodes of 1 worker on loopback (no "
                             "namespaces: inter-node bytes from the strategy's own count), "
                             "2 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.links = 1, "20mbit"
    args.workers = 2 * NNODES  # convergence.run_once reads it
    if args.smoke:
        args.seeds, args.links, args.workers = 1, "lo", NNODES
        if args.strategies == p.get_default("strategies"):
            args.strategies = "hierarchical"
        args.max_steps, args.eval_every, args.timeout, args.run_timeout = 2, 1, 60.0, 120.0
        args.out = str(output_dir(args) / Path(args.out).name)
    elif args.out_dir is not None:
        args.out = str(Path(args.out_dir) / Path(args.out).name)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from stratagem.testing.netns import Topology, netns_unavailable_reason

    strategies = choose(args.strategies, STRATEGIES)
    if strategies is None:
        return 2
    reason = None if args.smoke else netns_unavailable_reason()
    if reason is not None:
        print(f"this benchmark needs 2 network namespaces with shaped links: {reason}",
              file=sys.stderr)
        return 2
    links = split_list(args.links)
    missing = {k: f"`{STRATEGIES[k][0]}` is not in the registry yet (sg.strategy_names())"
               for k in strategies if not _available(STRATEGIES[k][0])}
    notes = [f"{k}: not run, {why}." for k, why in missing.items()]
    meta: dict[str, Any] = {
        "command": "python benchmarks/hierarchical.py " + " ".join(argv or sys.argv[1:]),
        "nodes": NNODES, "workers": args.workers, "target": args.target,
        "eval_every": args.eval_every, "max_epochs": args.max_epochs,
        "seeds": list(range(args.seeds)), "links": links,
        "strategies": {k: STRATEGIES[k][:2] for k in strategies}, "cpus": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(), "missing": missing, "base_notes": notes,
    }
    runnable = [s for s in strategies if s not in missing]
    runs: list[dict[str, Any]] = []
    # The bridge holds the control store (root namespace): a subnet of its own so that a
    # concurrent convergence/lm benchmark (10.77.0.0/24) does not share the route.
    topo = None if args.smoke else Topology(NNODES, subnet="10.76.0", bridge_ip=True)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # -> KeyboardInterrupt: clean up below
    try:
        with tempfile.TemporaryDirectory(prefix="sg-hierarchical-") as tmpdir:
            if topo is not None:
                topo.up()
            for link in links:
                if topo is not None:
                    topo.shape(link)
                for seed in range(args.seeds):
                    order = runnable[seed % max(1, len(runnable)):] + \
                        runnable[:seed % max(1, len(runnable))]
                    for key in order:
                        r = run_one(key, link, seed, topo, args, Path(tmpdir))
                        runs.append(r)
                        harness._print_run(r)
                        if r.get("error") is None and topo is not None:
                            print(f"{'':12s} inter-node {r['inter_node_bytes_per_step']:,.0f} "
                                  "B/step (veth counters)", flush=True)
    except KeyboardInterrupt:
        print("interrupted: cleaning up and writing partial results", file=sys.stderr)
        notes.append("interrupted: partial results")
    finally:
        if topo is not None:
            topo.down()
    meta["total_minutes"] = (time.perf_counter() - t_start) / 60
    write_results(meta, runs, strategies, out)
    return 0 if all(r.get("error") is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
