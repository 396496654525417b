"""Exit soak: many short 2-process jobs under every strategy, counting the jobs
that end abnormally — above all a worker that finishes its work and then dies at exit
(SIGABRT, "terminate called without an active exception").

    .venv/bin/python scripts/exit_soak.py --runs 200            # mixed strategies
    .venv/bin/python scripts/exit_soak.py --runs 20 --only easgd,diloco --parallel 2

Each job is ``stratagem run --nproc 2 [--num-ps 1] --strategy S`` on a small training
script (a few optimizer steps on random data, then a checkpoint) that ends in one of two
ways, alternating: ``strategy.close()`` then a normal return, or a plain return with nothing
closed (the interpreter-exit path). A job is *abnormal* when torchrun exits non-zero, when a
worker's output shows an abort, or when it does not finish within ``--job-timeout`` seconds.
Prints a per-strategy table and writes it (with the failing outputs) to
``benchmarks/results/exit_soak.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: name -> (extra ``stratagem run`` arguments, strategy arguments)
STRATEGIES: dict[str, tuple[list[str], list[str]]] = {
    "mirrored": ([], []),
    "mirrored-fp16-wire": ([], ["compression=fp16"]),
    "local_sgd": ([], ["period=2"]),
    "diloco": ([], ["period=2"]),
    "easgd": ([], ["period=2"]),
    "easgd-async": (["--num-ps", "1"], ["period=2"]),
    "ps-async": (["--num-ps", "1"], []),
    "ps-sync": (["--num-ps", "1"], []),
}

JOB = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    import stratagem as sg

    strategy = sg.from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = strategy.prepare(model, opt)
    gen = torch.Generator().manual_seed(strategy.replica_id)
    for _ in range(6):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randint(0, 4, (8,), generator=gen)
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    strategy.save(sys.argv[1], model=model, optimizer=opt, step=6)
    loss = strategy.reduce("mean", F.cross_entropy(model(x), y).detach())
    if strategy.is_chief:
        print(f"job done: loss {float(loss):.4f}", flush=True)
    if sys.argv[2] == "close":
        strategy.close()
''')


def _run_job(name: str, index: int, job_file: str, timeout: float) -> dict[str, object]:
    run_args, strategy_args = STRATEGIES[name]
    ending = "close" if index % 2 == 0 else "exit"
    with tempfile.TemporaryDirectory(prefix="stratagem-soak-") as tmp:
        cmd = [str(ROOT / ".venv" / "bin" / "stratagem"), "run", "--nproc", "2", *run_args,
               "--strategy", name.replace("-fp16-wire", "")]
        for arg in strategy_args:
            cmd += ["--strategy-arg", arg]
        cmd += [job_file, os.path.join(tmp, "ckpt"), ending]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                                  cwd=tmp)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code = None
            out = f"TIMEOUT after {timeout:g} s\n{e.stdout or ''}{e.stderr or ''}"
        seconds = time.monotonic() - t0
    aborted = "terminate called" in out or "SIGABRT" in out or "Signal 6" in out
    done = "job done" in out
    ok = code == 0 and done and not aborted
    return {"strategy": name, "ending": ending, "exit_code": code, "aborted": aborted,
            "finished_work": done, "ok": ok, "seconds": round(seconds, 2),
            "output_tail": "" if ok else out[-3000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="jobs in all (round-robin)")
    parser.add_argument("--only", default=None, help="comma-separated subset of strategies")
    parser.add_argument("--parallel", type=int, default=1, help="jobs at a time")
    parser.add_argument("--job-timeout", type=float, default=180.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "exit_soak"))
    args = parser.parse_args()
    names = list(STRATEGIES) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if args.runs < 1 or args.parallel < 1:
        parser.error("--runs and --parallel must be >= 1")

    with tempfile.NamedTemporaryFile("w", suffix="_soak_job.py", delete=False) as f:
        f.write(JOB)
        job_file = f.name
    plan = [(names[i % len(names)], i // len(names)) for i in range(args.runs)]
    t0 = time.monotonic()
    results: list[dict[str, object]] = []
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            for i, res in enumerate(pool.map(
                    lambda p: _run_job(p[0], p[1], job_file, args.job_timeout), plan), 1):
                results.append(res)
                if not res["ok"]:
                    print(f"[{i}/{args.runs}] ABNORMAL {res['strategy']} ({res['ending']}): "
                          f"exit {res['exit_code']}, aborted={res['aborted']}\n"
                          f"{res['output_tail']}", flush=True)
                elif i % 10 == 0:
                    print(f"[{i}/{args.runs}] ok so far: "
                          f"{sum(1 for r in results if r['ok'])}/{i}", flush=True)
    finally:
        os.unlink(job_file)
    wall = time.monotonic() - t0

    runs, bad, aborts = Counter(), Counter(), Counter()
    for r in results:
        runs[r["strategy"]] += 1
        bad[r["strategy"]] += 0 if r["ok"] else 1
        aborts[r["strategy"]] += 1 if r["aborted"] else 0
    lines = [f"Exit soak: {len(results)} jobs of 2 processes, `python scripts/exit_soak.py "
             f"--runs {args.runs} --parallel {args.parallel}`, {wall / 60:.1f} min",
             "", "| strategy | jobs | abnormal exits | of which aborts (SIGABRT) |",
             "|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {runs[n]} | {bad[n]} | {aborts[n]} |")
    lines.append(f"| **all** | {sum(runs.values())} | {sum(bad.values())} | "
                 f"{sum(aborts.values())} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"runs": args.runs, "parallel": args.parallel, "wall_seconds": round(wall, 1),
         "results": results}, indent=1) + "\n")
    return 0 if sum(bad.values()) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
