"""Worker failures reported once: ``stratagem run`` runs each worker's script through this file
and prints the exceptions of a failed job once, grouped by exception, with the ranks and the
first traceback, instead of one traceback per rank inside torchrun's failure table.

Three pieces, all here so that one module owns the record format:

- ``python /path/to/stratagem/_worker.py [-m] SCRIPT ARGS...`` (what torchrun starts, see
  :func:`wrap_torchrun_argv`) runs ``SCRIPT`` exactly as ``python SCRIPT ARGS`` would
  (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]`` the script's directory; with
  ``-m`` as ``python -m``). An exception escaping the script is written as one strict-JSON
  record ``attempt<A>.rank<R>.json`` into ``$STRATAGEM_ERROR_DIR`` and the worker exits 1,
  as Python would; without that variable, or if the record cannot be written, the traceback
  is printed as usual. ``SystemExit`` and ``KeyboardInterrupt`` pass through untouched.
- :func:`summarize` turns the records (and torchrun's list of failed ranks with their exit
  codes) into the text printed once.
- :func:`wrap_torchrun_argv` rewrites a torchrun command line to start the script through
  this file.

Run by path, not with ``-m``: ``python -m stratagem._worker`` would import the ``stratagem``
package, hence torch, before the user's script (which may set ``OMP_NUM_THREADS``,
``CUDA_VISIBLE_DEVICES`` and the like before importing torch). So this file imports the
standard library only, and nothing of the package.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.realpath(sys.path[0] or ".") == \
        os.path.dirname(os.path.realpath(__file__)):
    # Started as a file: Python put this package's directory first on sys.path, where its
    # modules (data.py, errors.py...) would shadow the user's. The script's own directory
    # replaces it below, before anything else is imported.
    del sys.path[0]

import contextlib  # noqa: E402 - after the sys.path fix above
import json  # noqa: E402
import runpy  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

__all__ = ["ERROR_DIR_ENV", "WORKER_FILE", "record_exception", "read_records", "summarize",
           "wrap_torchrun_argv"]

#: The directory where workers write their failure records (set by the torchrun runner).
ERROR_DIR_ENV = "STRATAGEM_ERROR_DIR"
#: This file: what torchrun starts instead of the script.
WORKER_FILE = os.path.realpath(__file__)
#: A record bigger than this is not ours (or is a traceback nobody reads): skipped.
_MAX_RECORD_BYTES = 1 << 20
#: Traceback text kept per record, from the end (the frames nearest the raise).
_MAX_TRACEBACK_CHARS = 64 << 10


def _env_int(env: Mapping[str, str], name: str, default: int = 0) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without this file's and runpy's frames (the user sees their
    script's frames first, as with ``python script.py``)."""
    tb = exc.__traceback__
    ours = {WORKER_FILE, os.path.realpath(runpy.__file__)}
    while tb is not None and (tb.tb_frame.f_code.co_filename.startswith("<frozen runpy") or
                              os.path.realpath(tb.tb_frame.f_code.co_filename) in ours):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return text[-_MAX_TRACEBACK_CHARS:]


def record_exception(exc: BaseException, directory: str,
                     env: Mapping[str, str] | None = None) -> str:
    """Write ``exc`` as this worker's failure record in ``directory``; returns its path.
    Raises ``OSError`` if it cannot be written (the caller then prints the traceback)."""
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK")
    attempt = _env_int(env, "TORCHELASTIC_RESTART_COUNT")
    record = {"rank": rank, "local_rank": _env_int(env, "LOCAL_RANK"), "attempt": attempt,
              "pid": os.getpid(), "time": time.time(), "type": type(exc).__qualname__,
              "message": str(exc)[:_MAX_TRACEBACK_CHARS], "traceback": _user_traceback(exc)}
    final = os.path.join(directory, f"attempt{attempt}.rank{rank}.json")
    tmp = f"{final}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, allow_nan=False)
        os.replace(tmp, final)  # readers never see half a record
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return final


def read_records(directory: str) -> list[dict[str, Any]]:
    """The failure records in ``directory`` (ours by name and shape; anything else is
    skipped), sorted by attempt then rank."""
    out: list[dict[str, Any]] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        if not (entry.name.startswith("attempt") and entry.name.endswith(".json")):
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or \
                    entry.stat(follow_symlinks=False).st_size > _MAX_RECORD_BYTES:
                continue
            with open(entry.path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and all(
                isinstance(record.get(k), t) for k, t in (
                    ("rank", int), ("attempt", int), ("type", str), ("message", str),
                    ("traceback", str))):
            out.append(record)
    out.sort(key=lambda r: (r["attempt"], r["rank"]))
    return out


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _exit_text(code: int, count: int) -> str:
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{'was' if count == 1 else 'were'} killed by {name}"
    return f"exited with code {code}"


def summarize(records: Sequence[Mapping[str, Any]], *, world_size: int | None = None,
              exit_codes: Mapping[int, int] | None = None, prog: str = "stratagem run") -> str:
    """The text printed once for a failed job: the last attempt's exceptions grouped by type
    and message, each with its ranks and the traceback of its lowest rank; the failed ranks
    that raised nothing (``exit_codes``: rank -> exit code, negative for a signal, as torchrun
    reports them); and one line per earlier attempt (restarts). Empty if there is nothing."""
    lines: list[str] = []
    last = max((int(r["attempt"]) for r in records), default=0)
    earlier = [r for r in records if r["attempt"] != last]
    for attempt in sorted({int(r["attempt"]) for r in earlier}):
        groups = _group([r for r in earlier if r["attempt"] == attempt])
        what = "; ".join(f"{_ranks(ranks)}: {head}" for head, ranks, _ in groups)
        lines.append(f"{prog}: attempt {attempt} failed ({what}); the job was restarted")
    current = [r for r in records if r["attempt"] == last]
    for head, ranks, tb in _group(current):
        every = world_size is not None and len(ranks) == world_size and world_size > 1
        who = f"all {world_size} workers ({_ranks(ranks)})" if every else _ranks(ranks)
        lines.append(f"{prog}: {who} failed with {head}")
        lines.append(f"traceback of rank {min(ranks)}:")
        lines.append(tb.rstrip("\n"))
    raised = {int(r["rank"]) for r in current}
    silent = {rank: code for rank, code in (exit_codes or {}).items() if rank not in raised}
    by_code: dict[int, list[int]] = {}
    for rank, code in silent.items():
        by_code.setdefault(code, []).append(rank)
    for code, ranks in sorted(by_code.items()):
        cause = (" (stopped by torchrun after the failure above)" if current else
                 " without raising an exception (killed, out of memory, or os._exit)")
        lines.append(f"{prog}: {_ranks(ranks)} {_exit_text(code, len(ranks))}{cause}")
    return "\n".join(lines)


def _group(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[int], str]]:
    """(``Type: message``, ranks, first traceback) per distinct exception, lowest rank first."""
    groups: dict[str, tuple[list[int], str]] = {}
    for r in sorted(records, key=lambda r: int(r["rank"])):
        head = f"{r['type']}: {r['message']}" if r["message"] else str(r["type"])
        if head not in groups:
            groups[head] = ([], str(r["traceback"]))
        groups[head][0].append(int(r["rank"]))
    return [(head, ranks, tb) for head, (ranks, tb) in groups.items()]


def wrap_torchrun_argv(argv: Sequence[str], script_index: int, module: bool) -> list[str]:
    """``argv`` (torchrun's arguments, the script at ``script_index``) starting the script
    through this file: ``... WORKER_FILE [-m] SCRIPT ARGS``; torchrun's own ``-m/--module``
    flag is moved to the worker (torchrun then starts this file with ``python``)."""
    head = list(argv[:script_index])
    if module:
        head = [a for a in head if a not in ("-m", "--module")]
    return [*head, WORKER_FILE, *(["-m"] if module else []), *argv[script_index:]]


def _main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python _worker.py [-m] SCRIPT [ARGS...]\n")
        raise SystemExit(2)
    target = argv[0]
    sys.argv = list(argv)
    if module:
        sys.path.insert(0, os.getcwd())  # what python -m puts first
    else:
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        # The script is done: exit without the interpreter's final collections, which walk
        # torch's every object (stratagem.launcher.skip_final_collection says why and what
        # it changes; this file imports nothing of the package).
        import gc

        gc.freeze()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - every other failure is reported once
        directory = os.environ.get(ERROR_DIR_ENV)
        written = False
        if directory:
            try:
                record_exception(exc, directory)
                written = True
            except Exception:  # noqa: BLE001 - e.g. an exception whose str() raises
                pass
        if not written:
            raise  # printed by Python as usual
        raise SystemExit(1) from None


if __name__ == "__main__":
    _main(sys.argv[1:])
