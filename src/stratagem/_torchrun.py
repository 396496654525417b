"""``python -m stratagem._torchrun ARGS``: torchrun whose static-rendezvous store listens on
``--master-addr`` only — loopback for single-node jobs, node 0's address on the
private network for multi-node jobs; how and why in :mod:`stratagem._rendezvous`.
``stratagem run`` starts every static-rendezvous job with it.

It also reports worker failures once: each worker's script runs through
:mod:`stratagem._worker`, which writes an exception escaping the script as a record in a
private temporary directory instead of printing it; when the job fails, the records are
printed here once, grouped by exception with their ranks and the first traceback, in place of
torchrun's per-rank failure table and its own traceback (the exit code stays 1).

A module of its own, never imported by the package, so ``python -m`` runs it fresh.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

from stratagem._rendezvous import torchrun_main


def _local_world_size(nproc_per_node: str, nnodes: str) -> int | None:
    """This node's worker count when the job is one node with a fixed count, else None."""
    return int(nproc_per_node) if nproc_per_node.isdigit() and nnodes in ("1", "1:1") else None


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args

    from stratagem._worker import ERROR_DIR_ENV, read_records, summarize, wrap_torchrun_argv

    parsed = parse_args(argv)
    index = len(argv) - len(parsed.training_script_args) - 1
    if parsed.no_python or getattr(parsed, "run_path", False) or index < 0 \
            or argv[index] != parsed.training_script:
        torchrun_main(argv)  # not a Python script (or an argv we cannot place): as is
        return 0
    directory = tempfile.mkdtemp(prefix="stratagem-errors-")  # 0700: ours alone
    os.environ[ERROR_DIR_ENV] = directory  # the agent passes its environment to the workers
    # Its per-rank "failed (exitcode...)" and "Sending process ... SIGTERM" lines: the summary
    # below says the same once.
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401 - the logger's module

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    world = _local_world_size(str(parsed.nproc_per_node), str(parsed.nnodes))
    try:
        try:
            torchrun_main(wrap_torchrun_argv(argv, index, bool(parsed.module)))
        except ChildFailedError as e:
            codes = {int(rank): int(f.exitcode) for rank, f in e.failures.items()}
            text = summarize(read_records(directory), world_size=world, exit_codes=codes)
            print(text or str(e), file=sys.stderr, flush=True)
            return 1
        text = summarize(read_records(directory), world_size=world)  # restarts that healed
        if text:
            print(text, file=sys.stderr, flush=True)
        return 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    sys.exit(main(sys.argv[1:]))
