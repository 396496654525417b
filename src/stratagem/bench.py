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
by the benchmarks' writer (``benchmarks/_common.py``: commit, versions, host) after every
benchmark, so an interrupted run keeps what it finished. ``--quick`` gives each benchmark
its settings from ``QUICK_PROFILE`` in that file and writes their results to a temporary
folder (or ``--out-dir``), never over the canonical ones.

The full run takes hours, so it can be done in parts::

    stratagem bench --stop-after 90        # start no benchmark after 90 minutes
    stratagem bench --resume               # later: the benchmarks not yet run
    stratagem bench --resume lm hierarchical   # or just these, into the same record

``--resume`` adds to the record in ``results/bench.json`` only while the code is the same:
every tracked file outside ``benchmarks/results/``, ``docs/`` and ``*.md`` as committed, with
no uncommitted change to one (a digest of them is in the record); the benchmark arguments
must match too. The record's duration is the sum of its benchmarks' seconds, and it lists
each part (date, wall seconds, benchmarks run). It is ``complete`` once every benchmark has
run.

A benchmark is a ``benchmarks/*.py`` file with a ``__main__`` guard (a helper module
without one is skipped). ``--dir`` (or ``STRATAGEM_BENCHMARKS_DIR``) points elsewhere.
A benchmark that cannot run on this machine (``gpu.py`` without CUDA) exits 77 and is
recorded as skipped, which is not a failure.

Exit code: 0 when every benchmark succeeded or was skipped, 1 when one failed, 2 for a usage
error (no ``benchmarks/`` found, unknown name), 130 on Ctrl-C and 143 on SIGTERM (forwarded
to the running benchmark, which gets to clean up first).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
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
#: A benchmark's exit code for "cannot run here" (``SKIPPED`` in ``benchmarks/_common.py``).
_SKIPPED = 77
#: Seconds a benchmark gets to clean up (e.g. delete network namespaces) after a signal.
_CLEANUP_GRACE = 30.0
#: Tracked paths whose changes leave what the benchmarks measure as it was: their results
#: and prose. Everything else is "the code" a resumed run must share with its record.
_NOT_CODE_DIRS = ("benchmarks/results/", "docs/")
#: The largest ``bench.json`` ``--resume`` reads (a record of 18 benchmarks is ~10 kB).
_MAX_RECORD_BYTES = 1 << 20


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
    p.add_argument("--resume", action="store_true",
                   help="add to the full run's record (results/bench.json) of this same code: "
                        "run the benchmarks it has not run yet (or the NAMEs given)")
    p.add_argument("--stop-after", type=float, default=None, metavar="MINUTES",
                   help="start no benchmark once this many minutes have passed (the one "
                        "running finishes); continue later with --resume")
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


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _is_code(path: str) -> bool:
    return not (path.startswith(_NOT_CODE_DIRS) or path.endswith(".md"))


def _code_state(root: Path) -> tuple[str, str] | None:
    """``(digest, commit)`` of the code the benchmarks of checkout ``root`` run: a digest of
    every tracked file outside ``benchmarks/results/``, ``docs/`` and ``*.md`` at HEAD, and
    the last commit that changed one of them. None when ``root`` is not a git checkout or
    one of those files has uncommitted changes (then no run can be resumed)."""
    listing = _git(root, "ls-tree", "-r", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    commit = _git(root, "log", "-1", "--format=%h", "--", ".",
                  *(f":(exclude){d.rstrip('/')}" for d in _NOT_CODE_DIRS),
                  ":(exclude,glob)**/*.md")
    if listing is None or status is None or not commit:
        return None
    for line in status.splitlines():  # "XY path" or "XY old -> new"
        if any(_is_code(p) for p in line[3:].split(" -> ")):
            return None
    entries = [e for e in listing.splitlines() if "\t" in e and _is_code(e.split("\t", 1)[1])]
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16], commit.strip()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class _Resume(Exception):
    """``--resume`` cannot add to the record; the message says why and what to do."""


def _load_record(path: Path, *, state: tuple[str, str] | None,
                 bench_args: list[str]) -> dict[str, Any]:
    """The payload of the full run's record at ``path`` that ``--resume`` may add to (a new,
    empty one when there is none yet)."""
    if state is None:
        raise _Resume("the code has uncommitted changes (or this is not a git checkout), so "
                      "no record can say which code its benchmarks ran. Fix: commit (or stash) "
                      "the changes outside benchmarks/results/, docs/ and *.md, then resume")
    fresh = {"complete": False, "succeeded": False, "code": state[0], "code_commit": state[1],
             "bench_args": bench_args, "total_s": 0.0, "parts": [], "benchmarks": []}
    if not path.is_file():
        return fresh
    size = path.stat().st_size
    if size > _MAX_RECORD_BYTES:
        raise _Resume(f"{path} is {size} bytes, more than a record's {_MAX_RECORD_BYTES}. "
                      "Fix: run without --resume to start a new record")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        record = data["results"]
        rows = record["benchmarks"]
        ok = (isinstance(record, dict) and isinstance(rows, list)
              and all(isinstance(r, dict) and isinstance(r.get("benchmark"), str)
                      and isinstance(r.get("exit_code"), int)
                      and isinstance(r.get("seconds"), (int, float)) for r in rows))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Resume(f"{path} is not a record of `stratagem bench` ({e}). Fix: run without "
                      "--resume to start a new one") from None
    if not ok or "code" not in record:
        raise _Resume(f"{path} was not written by a resumable `stratagem bench` (no code "
                      "digest or malformed rows). Fix: run without --resume to start a new one")
    if record["code"] != state[0]:
        raise _Resume(f"{path} records a run of the code at {record.get('code_commit')} "
                      f"(digest {record['code']}); this checkout's code is {state[1]} (digest "
                      f"{state[0]}). A record holds one code only. Fix: run without --resume "
                      "to start a new record")
    if record.get("bench_args", []) != bench_args:
        raise _Resume(f"{path} records benchmark arguments {record.get('bench_args')}, this "
                      f"run has {bench_args}. Fix: resume with the same arguments, or run "
                      "without --resume to start a new record")
    if record.get("complete"):
        print(f"stratagem bench: the record in {path} is complete already; naming benchmarks "
              "runs them again into it", flush=True)
    return {**fresh, **record}


def _ok(code: int) -> bool:
    return code in (0, _SKIPPED)


def _shown(code: int) -> str:
    return "ok" if code == 0 else "skipped" if code == _SKIPPED else f"exit {code}"


def _record(common: ModuleType, name: str, record: dict[str, Any], known: Sequence[str], *,
            out_dir: Path, command: str) -> None:
    """Write the run's own result: how long it took in all, each benchmark's exit code,
    seconds and commit, and the parts it was run in."""
    rows = record["benchmarks"]
    done = {r["benchmark"] for r in rows}
    left = [n for n in known if n not in done]
    record["complete"] = not left
    record["succeeded"] = not left and all(_ok(r["exit_code"]) for r in rows)
    record["skipped"] = [r["benchmark"] for r in rows if r["exit_code"] == _SKIPPED]
    record["total_s"] = round(sum(r["seconds"] for r in rows), 1)
    total = record["total_s"]
    skipped = record["skipped"]
    passed = (f"{len(rows) - len(skipped)} exited 0, {len(skipped)} skipped as unable to run "
              f"here ({', '.join(skipped)})" if skipped else "every benchmark exited 0")
    state = (f"complete, {passed if record['succeeded'] else 'with failures'}"
             if record["complete"] else f"partial: {len(done)} of {len(known)} benchmarks")
    parts = record["parts"]
    lines = [f"# `{command}`: {total / 60:.1f} min ({state})", "",
             f"The benchmarks one after the other, in {len(parts)} part(s), all of the code "
             f"at {record.get('code_commit')} (digest `{record.get('code')}`: every tracked "
             "file outside benchmarks/results/, docs/ and *.md); the time is the sum of the "
             f"benchmarks' seconds. Their results went to `{record.get('output')}`.", "",
             "| benchmark | outcome | s | commit | arguments |", "|---|---:|---:|---|---|"]
    lines += [f"| {r['benchmark']} | {_shown(r['exit_code'])} | {r['seconds']:.0f} | "
              f"{r.get('commit') or '-'} | `{' '.join(r.get('args', []))}` |" for r in rows]
    lines += ["", "| part | started | wall s | benchmarks |", "|---:|---|---:|---|"]
    lines += [f"| {i} | {p['started']} | {p['wall_s']:.0f} | {', '.join(p['benchmarks'])} |"
              for i, p in enumerate(parts, 1)]
    if left:
        lines += ["", f"Not run yet: {', '.join(left)} (`stratagem bench --resume`)."]
    common.write_result(name, record, lines, out_dir=out_dir, duration_s=total,
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
    if args.resume and args.quick:
        print("stratagem bench: error: --resume adds to the full run's record; --quick takes "
              "minutes, run it again instead", file=sys.stderr)
        return 2
    if args.stop_after is not None and not args.stop_after > 0:
        print(f"stratagem bench: error: --stop-after must be a positive number of minutes, "
              f"got {args.stop_after:g}", file=sys.stderr)
        return 2
    cwd = directory.parent
    common = _common_module(directory)
    profile: dict[str, list[str]] = getattr(common, "QUICK_PROFILE", {}) if args.quick else {}
    output = Path(args.out_dir) if args.out_dir else directory / "results"
    if args.quick and not args.out_dir:
        output = Path(tempfile.mkdtemp(prefix="stratagem-bench-quick-"))
    record_dir = Path(args.out_dir) if args.out_dir else directory / "results"
    record_name = "bench_quick" if args.quick else "bench"
    recording = common is not None and (not names or args.resume)
    if args.resume and common is None:
        print(f"stratagem bench: error: --resume needs the benchmarks' writer "
              f"({directory / '_common.py'}), which is missing", file=sys.stderr)
        return 2
    state = _code_state(cwd) if recording else None
    record: dict[str, Any] = {}
    if args.resume:
        try:
            record = _load_record(record_dir / f"{record_name}.json", state=state,
                                  bench_args=bench_args)
        except _Resume as e:
            print(f"stratagem bench: error: cannot resume: {e}", file=sys.stderr)
            return 2
        if not names:
            done = {r["benchmark"] for r in record["benchmarks"]}
            selected = [n for n in selected if n not in done]
            if not selected:
                print(f"stratagem bench: every benchmark has run into "
                      f"{record_dir / record_name}.json already; nothing to resume")
                return 0 if record.get("succeeded") else 1
    elif recording:
        record = {"complete": False, "succeeded": False,
                  "code": state[0] if state else None, "code_commit": state[1] if state else None,
                  "bench_args": bench_args, "total_s": 0.0, "parts": [], "benchmarks": []}
    if recording:
        record["output"] = str(output)
        part: dict[str, Any] = {"started": _now(), "wall_s": 0.0, "benchmarks": []}
        record["parts"] = [*record["parts"], part]
        command = " ".join(["stratagem bench", *(["--quick"] if args.quick else []),
                            *(["--out-dir", args.out_dir] if args.out_dir else []),
                            *bench_args])
    per_bench = {name: [*(profile.get(name, ["--smoke"]) if args.quick else []), *bench_args,
                        *(["--out-dir", str(output)] if args.quick or args.out_dir else [])]
                 for name in selected}
    outcomes: list[tuple[str, int, float]] = []
    started = time.perf_counter()
    stopped = False
    try:
        for name in selected:
            if (args.stop_after is not None and outcomes
                    and time.perf_counter() - started >= 60 * args.stop_after):
                stopped = True
                break
            shown = " ".join([f"benchmarks/{benchmarks[name].name}", *per_bench[name]])
            print(f"== stratagem bench: {name}: {sys.executable} {shown}", flush=True)
            t0 = time.perf_counter()
            head = _git(cwd, "rev-parse", "--short=12", "HEAD") if recording else None
            code = _run_one(benchmarks[name], per_bench[name], cwd)
            seconds = time.perf_counter() - t0
            outcomes.append((name, code, seconds))
            said = ("ok" if code == 0 else "skipped: it cannot run on this machine"
                    if code == _SKIPPED else f"FAILED (exit code {code})")
            print(f"== {name}: {said} in {seconds:.0f} s", flush=True)
            if recording:
                row = {"benchmark": name, "exit_code": code, "seconds": round(seconds, 1),
                       "args": per_bench[name], "commit": head.strip() if head else None,
                       "date": _now()}
                rows = [r for r in record["benchmarks"] if r["benchmark"] != name] + [row]
                order = list(benchmarks)
                record["benchmarks"] = sorted(
                    rows, key=lambda r: order.index(r["benchmark"])
                    if r["benchmark"] in order else len(order))
                part["benchmarks"].append(name)
                part["wall_s"] = round(time.perf_counter() - started, 1)
                _record(common, record_name, record, list(benchmarks), out_dir=record_dir,
                        command=command)
            if not _ok(code) and args.fail_fast:
                break
    except KeyboardInterrupt:
        print("stratagem bench: interrupted" + (f"; {record_dir / record_name}.json keeps the "
              "benchmarks that finished (continue: stratagem bench --resume)"
              if recording and outcomes else ""), file=sys.stderr)
        return 130
    except _Terminated:
        print("stratagem bench: terminated" + (f"; {record_dir / record_name}.json keeps the "
              "benchmarks that finished (continue: stratagem bench --resume)"
              if recording and outcomes else ""), file=sys.stderr)
        return 128 + signal.SIGTERM
    total = time.perf_counter() - started
    if len(selected) > 1:
        print("\n== summary")
        for name, code, seconds in outcomes:
            print(f"  {name:<20} {_shown(code):<8} {seconds:7.0f} s")
        for name in selected[len(outcomes):]:
            print(f"  {name:<20} not run")
        print(f"results: {output} ({total / 60:.1f} min in all)")
    if recording:
        left = [n for n in benchmarks if n not in {r["benchmark"] for r in record["benchmarks"]}]
        if stopped or left:
            print(f"stratagem bench: {len(left)} benchmark(s) not run yet "
                  f"({', '.join(left)}); continue with: stratagem bench --resume", flush=True)
        elif state is None and not args.quick:
            print("stratagem bench: the code had uncommitted changes, so this record cannot "
                  "be resumed", flush=True)
    return 0 if (stopped or len(outcomes) == len(selected)) and all(
        _ok(c) for _, c, _ in outcomes) else 1

if __name__ == "__main__":
    sys.exit(main())
