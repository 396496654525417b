"""Start-up cost of stratagem: two source trees compared side by side in one run.

    python benchmarks/import_time.py [--before-src /work/main/src] [--after-src src] [--rounds 5]

Each round runs, for each tree (in the order A B, then B A in the next round, so drift hits
both), a fresh interpreter with ``PYTHONPATH=<tree>``:

- ``import``: the time of ``import stratagem`` after ``import torch`` (``perf_counter`` inside
  the process: torch's own start-up is the same for both and left out);
- ``cli``: the wall time of a whole ``stratagem --help`` process (what a CLI call, a launched
  worker or a test subprocess pays before doing anything);
- ``cli_cpu``: that process's CPU time (user + sys; less sensitive to other load than wall);
- whether ``torch.distributed.tensor`` was imported.

Prints the after/before ratio of the medians (and the per-round ratios) and writes
``benchmarks/results/import_time.{json,md}``. Same interpreter for both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_ledger_args, output_dir, write_result  # noqa: E402

HERE = Path(__file__).resolve().parents[1] / "src"

_IMPORT = (
    "import sys, time, json, torch\n"
    "t = time.perf_counter()\n"
    "import stratagem\n"
    "dt = time.perf_counter() - t\n"
    "print(json.dumps({'seconds': dt, 'file': stratagem.__file__,\n"
    "                  'dtensor': 'torch.distributed.tensor' in sys.modules}))\n")
_CLI = "import sys\nsys.argv = ['stratagem', '--help']\nfrom stratagem.cli import main\nmain()\n"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(src: Path, code: str) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, its stdout): one process at a time, so the
    children's rusage difference is this child's."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cpu, start = _cpu(), time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{src}: exit {done.returncode}: {done.stderr[-2000:]}")
    return wall, _cpu() - cpu, done.stdout


def measure(trees: dict[str, Path], rounds: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {k: {"import": [], "cli": [], "cli_cpu": []}
                                                for k in trees}
    dtensor: dict[str, bool] = {}
    names = list(trees)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            _, _, out = _run(trees[name], _IMPORT)
            info = json.loads(out.strip().splitlines()[-1])
            if Path(info["file"]).resolve().parent.parent != trees[name].resolve():
                raise RuntimeError(f"{name}: imported {info['file']}, not from {trees[name]}")
            samples[name]["import"].append(info["seconds"])
            dtensor[name] = info["dtensor"]
            wall, cpu, _ = _run(trees[name], _CLI)
            samples[name]["cli"].append(wall)
            samples[name]["cli_cpu"].append(cpu)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{n} import {samples[n]['import'][-1]:.3f}s cli {samples[n]['cli'][-1]:.3f}s"
            for n in names), flush=True)
    before, after = names
    out: dict[str, Any] = {"rounds": rounds, "trees": {k: str(v) for k, v in trees.items()},
                           "dtensor_imported": dtensor, "samples": samples, "ratios": {}}
    for what in ("import", "cli", "cli_cpu"):
        med = {n: statistics.median(samples[n][what]) for n in names}
        per_round = [a / b for a, b in zip(samples[after][what], samples[before][what],
                                           strict=True)]
        out["ratios"][what] = {"median_before": med[before], "median_after": med[after],
                               "ratio_of_medians": med[after] / med[before],
                               "per_round": per_round}
    return out


def write(result: dict[str, Any], load: tuple[float, float, float], out_dir: Path) -> None:
    result["load_average"] = load
    lines = [
        "# Start-up cost: `import stratagem` (after torch) and a `stratagem --help` process",
        "",
        f"`python benchmarks/import_time.py --before-src {result['trees']['before']} "
        f"--rounds {result['rounds']}`; trees: "
        + ", ".join(f"{k} = `{v}`" for k, v in result["trees"].items())
        + f"; alternating per round; load average at the end {load[0]:.1f} / {load[1]:.1f} "
        f"/ {load[2]:.1f} (1/5/15 min, 2 cores).",
        "",
        "| measure | before (median s) | after (median s) | after / before | per-round ratios |",
        "|---|---|---|---|---|",
    ]
    for what, label in (("import", "`import stratagem` after torch"),
                        ("cli", "`stratagem --help` process, wall"),
                        ("cli_cpu", "`stratagem --help` process, CPU (user + sys)")):
        r = result["ratios"][what]
        lines.append(f"| {label} | {r['median_before']:.3f} | {r['median_after']:.3f} | "
                     f"{r['ratio_of_medians']:.2f} | "
                     + ", ".join(f"{x:.2f}" for x in r["per_round"]) + " |")
    lines += ["", "`torch.distributed.tensor` imported by `import stratagem`: "
              + ", ".join(f"{k} {v}" for k, v in result["dtensor_imported"].items()), ""]
    write_result("import_time", result, lines, out_dir=out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-src", type=Path, default=None,
                        help="the src/ directory of the tree to compare against (e.g. main's; "
                             "default: --after-src itself, which measures the noise floor)")
    parser.add_argument("--after-src", type=Path, default=HERE)
    parser.add_argument("--rounds", type=int, default=5)
    add_ledger_args(parser, smoke="1 round, this tree against itself")
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    out_dir = output_dir(args)
    before = args.after_src if args.before_src is None else args.before_src
    result = measure({"before": before, "after": args.after_src}, args.rounds)
    write(result, os.getloadavg(), out_dir)


if __name__ == "__main__":
    main()
