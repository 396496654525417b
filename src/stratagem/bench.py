"""``stratagem bench``: run the benchmark scripts of a source checkout.

The benchmarks are scripts in the repository's ``benchmarks/`` directory (not part of the
installed package); each prints ratios measured in one run and writes JSON + markdown (+ PNG)
to ``benchmarks/results/``. This command finds that directory and runs the scripts one after
another as subprocesses with this very interpreter, ``src/`` put first on ``PYTHONPATH``::

    stratagem bench                        # every benchmark, default settings
    stratagem bench --quick                # the quick profile: small settings, <= 10 minutes
    stratagem bench --list                 # names and one-line descriptions
    stratagem bench convergence --seeds 1  # one benchmark; unknown options are passed on
    stratagem bench mirrored_vs_ddp ps_throughput -- --help

A run of every benchmark records its own duration and each benchmark's exit code and seconds
as a result of its own, ``results/bench`` (``results/bench_quick`` for ``--quick``), written
by the benchmarks' writer (``benchmarks/_common.py``: commit, versions, host). ``--quick``
gives each benchmark its settings from ``QUICK_PROFILE`` in that file and writes their
results to a temporary folder (or ``--out-dir``), never over the canonical ones.

A benchmark is a ``benchmarks/*.py`` file with a ``__main__`` guard (a helper module
without one is skipped). ``--dir`` (or ``STRATAGEM_BENCHMARKS_DIR``) points elsewhere.
Exit code: 0 when every benchmark succeeded, 1 when one failed, 2 for a usage error (no
``benchmarks/`` found, unknown name), 130 on Ctrl-C and 143 on SIGTERM (forwarded to the
running benchmark, which gets to clean up first).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

__all__ = ["main", "find_benchmarks_dir", "list_benchmarks"]

#: Run first, in this order, when present; any other benchmark follows alphabetically.
_ORDER = ("mirrored_vs_ddp", "ps_throughput", "compression", "convergence")
_ENV_DIR = "STRATAGEM_BENCHMARKS_DIR"
#: Seconds a benchmark gets to clean up (e.g. delete network namespaces) after a signal.
_CLEANUP_GRACE = 30.0


class _NotFound(Exception):
    pass


def _repo_root() -> Path:
    """``src/stratagem/bench.py`` -> the checkout root (two levels above the package)."""
    return Path(__file__).resolve().parent.parent.parent


def find_benchmarks_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The ``benchmarks/`` directory: ``explicit``, else ``$STRATAGEM_BENCHMARKS_DIR``, else
    the one of the source checkout this package was imported from, else ``./benchmarks``.
    Raises ``FileNotFoundError`` saying where it looked and what to do."""
    given = explicit if explicit is not None else os.environ.get(_ENV_DIR) or None
    if given is not None:
        path = Path(given).expanduser().resolve()
        if not path.is_dir():
            source = "--dir" if explicit is not None else _ENV_DIR
            raise FileNotFoundError(f"{source}={str(given)!r} is not a directory. Fix: point it "
                                    "at the benchmarks/ directory of a stratagem checkout")
        return path
    candidates = [_repo_root() / "benchmarks", Path.cwd() / "benchmarks"]
    for path in candidates:
        if path.is_dir() and list_benchmarks(path):
            return path.resolve()
    looked = ", ".join(str(p) for p in dict.fromkeys(candidates))
    raise FileNotFoundError(
        f"no benchmarks/ directory with benchmark scripts found (looked in {looked}). The "
        "benchmarks ship with the source repository, not with the installed package. Fix: "
        "run from a checkout (git clone ...; pip install -e .), or pass --dir PATH "
        f"(or set {_ENV_DIR})")


def _is_benchmark(path: Path) -> bool:
    if path.name.startswith(("_", ".")) or path.suffix != ".py":
        return False
    try:
        return "__main__" in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def list_benchmarks(directory: Path) -> dict[str, Path]:
    """``{name: script}`` of the benchmarks in ``directory``, in running order."""
    found = {p.stem: p for p in sorted(directory.glob("*.py")) if _is_benchmark(p)}
    first = [n for n in _ORDER if n in found]
    return {n: found[n] for n in first + sorted(set(found) - set(first))}


def _summary(path: Path) -> str:
    """First paragraph of the script's module docstring, on one line."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, ValueError):
        doc = None
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""


def _child_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    src = root / "src"
    parts = [str(src)] if (src / "stratagem").is_dir() else []
    parts += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


class _Terminated(Exception):
    pass


def _run_one(script: Path, args: Sequence[str], cwd: Path) -> int:
    """Run one benchmark; forward SIGTERM to it (then stop: ``_Terminated``) and give it
    time to clean up on Ctrl-C."""
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=_child_env(cwd))
    terminated = []

    def forward(signum: int, frame: FrameType | None) -> None:
        terminated.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        code = proc.wait()
        if terminated:
            raise _Terminated
        return code
    except KeyboardInterrupt:
        # The terminal sent SIGINT to the whole foreground group, the child included; let it
        # finish its own clean-up (network namespaces, shard processes) before we give up.
        try:
            proc.wait(timeout=_CLEANUP_GRACE)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=_CLEANUP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stratagem bench", usage="stratagem bench [NAME ...] [options] [-- ARGS ...]",
        description="Run the benchmarks of a stratagem source checkout "
        "(benchmarks/*.py) and write their results to benchmarks/results/.",
        epilog="NAME: benchmarks to run (default: all; see --list), given first. Options not "
        "listed here (e.g. --quick, --seeds 3) are passed to every selected benchmark; put "
        "them after `--` to pass options that clash with these (such as --help).")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--dir", default=None,
                   help=f"the benchmarks directory (default: ${_ENV_DIR}, else the checkout's)")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first benchmark that fails (default: run them all)")
    p.add_argument("--quick", action="store_true",
                   help="the quick profile (QUICK_PROFILE in benchmarks/_common.py): small "
                        "settings, results in a temporary folder, about 10 minutes in all")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="passed to every benchmark: write the results here instead of "
                        "benchmarks/results/ (--quick: instead of a temporary folder)")
    return p


def _common_module(directory: Path) -> ModuleType | None:
    """The benchmarks' ``_common.py`` (its writer and quick profile), or None without one."""
    path = directory / "_common.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_stratagem_bench_common", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(common: ModuleType, name: str, outcomes: list[tuple[str, int, float]],
            args: dict[str, list[str]], *, total: float, out_dir: Path, output: Path,
            command: str) -> None:
    """The run's own result: how long it took, and each benchmark's exit code and seconds."""
    rows: list[dict[str, Any]] = [
        {"benchmark": n, "exit_code": code, "seconds": round(seconds, 1), "args": args[n]}
        for n, code, seconds in outcomes]
    lines = [f"# `{command}`: {total / 60:.1f} min", "",
             f"Every benchmark, one after the other; their results went to `{output}`.", "",
             "| benchmark | exit code | s | arguments |", "|---|---:|---:|---|"]
    lines += [f"| {r['benchmark']} | {r['exit_code']} | {r['seconds']:.0f} | "
              f"`{' '.join(r['args'])}` |" for r in rows]
    common.write_result(name, {"total_s": round(total, 1), "output": str(output),
                               "benchmarks": rows}, lines, out_dir=out_dir, duration_s=total,
                        command=command, quiet=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``stratagem bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    names: list[str] = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0).removesuffix(".py"))
    args, extra = _parser().parse_known_args(argv)
    if not names:  # `stratagem bench --dir D NAME ...`
        while extra and not extra[0].startswith("-"):
            names.append(extra.pop(0).removesuffix(".py"))
    try:
        directory = find_benchmarks_dir(args.dir)
    except FileNotFoundError as e:
        print(f"stratagem bench: error: {e}", file=sys.stderr)
        return 2
    benchmarks = list_benchmarks(directory)
    if args.list:
        width = max((len(n) for n in benchmarks), default=0)
        for name, path in benchmarks.items():
            print(f"{name:<{width}}  {_summary(path)}")
        return 0
    unknown = [n for n in names if n not in benchmarks]
    if unknown:
        print(f"stratagem bench: error: unknown benchmark(s) {', '.join(unknown)}; available: "
              f"{', '.join(benchmarks) or 'none'} (in {directory})", file=sys.stderr)
        return 2
    selected = names or list(benchmarks)
    if not selected:
        print(f"stratagem bench: error: no benchmark scripts in {directory}", file=sys.stderr)
        return 2
    bench_args = extra + passthrough
    cwd = directory.parent
    common = _common_module(directory)
    profile: dict[str, list[str]] = getattr(common, "QUICK_PROFILE", {}) if args.quick else {}
    output = Path(args.out_dir) if args.out_dir else directory / "results"
    if args.quick and not args.out_dir:
        output = Path(tempfile.mkdtemp(prefix="stratagem-bench-quick-"))
    per_bench = {name: [*(profile.get(name, ["--smoke"]) if args.quick else []), *bench_args,
                        *(["--out-dir", str(output)] if args.quick or args.out_dir else [])]
                 for name in selected}
    outcomes: list[tuple[str, int, float]] = []
    started = time.perf_counter()
    try:
        for name in selected:
            shown = " ".join([f"benchmarks/{benchmarks[name].name}", *per_bench[name]])
            print(f"== stratagem bench: {name}: {sys.executable} {shown}", flush=True)
            t0 = time.perf_counter()
            code = _run_one(benchmarks[name], per_bench[name], cwd)
            outcomes.append((name, code, time.perf_counter() - t0))
            print(f"== {name}: {'ok' if code == 0 else f'FAILED (exit code {code})'} in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            if code != 0 and args.fail_fast:
                break
    except KeyboardInterrupt:
        print("stratagem bench: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("stratagem bench: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    total = time.perf_counter() - started
    if not names and common is not None and len(outcomes) == len(selected):
        command = " ".join(["stratagem bench", *(["--quick"] if args.quick else []),
                            *(["--out-dir", args.out_dir] if args.out_dir else []),
                            *bench_args])
        _record(common, "bench_quick" if args.quick else "bench", outcomes, per_bench,
                total=total, out_dir=Path(args.out_dir) if args.out_dir else
                directory / "results", output=output, command=command)
    if len(selected) > 1:
        print("\n== summary")
        for name, code, seconds in outcomes:
            print(f"  {name:<20} {'ok' if code == 0 else f'exit {code}':<8} {seconds:7.0f} s")
        for name in selected[len(outcomes):]:
            print(f"  {name:<20} not run")
        print(f"results: {output} ({total / 60:.1f} min in all)")
    return 0 if len(outcomes) == len(selected) and all(c == 0 for _, c, _ in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
