"""Every run exits cleanly. The abort at exit came from gloo threads outliving the
interpreter (see ``stratagem.comm.release_all``); these tests check the mechanism that
prevents it — no gloo thread is left when finalization starts, whether the script calls
``strategy.close()`` or simply returns — rather than counting rare aborts (that is
``scripts/exit_soak.py``'s job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers import train_briefly

import stratagem as sg
from stratagem.comm import Comm, live_backend_threads

SRC = str(Path(sg.__file__).resolve().parent.parent)
TESTS = str(Path(__file__).resolve().parent)

# An atexit handler registered *before* stratagem is imported runs *after* stratagem's own
# (atexit is last-in, first-out): what it sees is the state finalization starts from.
EXIT_PROBE = """
import atexit, json, os, sys
def probe():
    from stratagem.comm import live_backend_threads
    import threading
    line = {"rank": int(os.environ["RANK"]), "ending": ENDING,
            "gloo_threads": live_backend_threads(),
            "python_threads": sorted(t.name for t in threading.enumerate()
                                     if t is not threading.main_thread())}
    os.write(1, (json.dumps(line) + "\\n").encode())
atexit.register(probe)
# Rank 0 closes its strategy, rank 1 simply returns (close is local: no collective).
ENDING = "close" if os.environ["RANK"] == "0" else "exit"

import torch
import stratagem as sg
sys.path.insert(0, TESTS_DIR)
from helpers import train_briefly
strategy = sg.from_env()
train_briefly(strategy)
strategy.reduce("mean", torch.ones(()))  # a collective right before the end
if ENDING == "close":
    strategy.close()
"""


def _strategies_in_turn() -> list[dict[str, Any]]:
    """What ``stratagem demo`` does: several strategies, one after the other, each trained,
    then closed before the next is built; what each close left behind is recorded. Rank 1
    builds each later one a second late, so rank 0 looks for rank 1's gloo address first:
    with one store prefix for every group it read the address of rank 1's closed group
    ("Connection refused"). One launch for all of it: each costs ~8-10 s here."""
    import time

    out = []
    for i, name in enumerate(["mirrored", "local_sgd", "diloco"]):
        if i and os.environ["RANK"] == "1":
            time.sleep(1.0)
        strategy = sg.from_name(name, timeout=30)
        total = strategy.reduce("sum", 1)
        model, _ = train_briefly(strategy)
        before = live_backend_threads()
        strategy.close()
        after = live_backend_threads()
        error = ""
        try:
            model(torch.randn(2, 6))
        except RuntimeError as e:
            error = str(e)
        out.append({"name": name, "sum": total, "before": before, "after": after,
                    "initialized": dist.is_initialized(), "error": error})
    return out


def test_close_joins_the_process_group_threads_and_a_later_strategy_gets_a_fresh_group(
        ) -> None:
    results = sg.launch(_strategies_in_turn, nprocs=2, timeout=120)
    for rank_results in results:
        assert [r["name"] for r in rank_results] == ["mirrored", "local_sgd", "diloco"]
        for r in rank_results:
            assert r["sum"] == 2, r  # each later strategy got a working process group
            assert r["before"], f"{r['name']}: the job should have had gloo threads"
            assert r["after"] == [], f"gloo threads left after {r['name']}.close(): {r['after']}"
            assert r["initialized"] is False, r
        # Using the DDP wrapper of a closed strategy says what to do instead.
        assert "closed Mirrored strategy" in rank_results[0]["error"], rank_results[0]


def test_no_backend_thread_left_when_finalization_starts(tmp_path: Path) -> None:
    # Both endings in one job (one `stratagem run` costs ~10-20 s here): rank 0 calls
    # strategy.close(), rank 1 returns without it; each process is probed on its own.
    script = tmp_path / "probe.py"
    script.write_text(EXIT_PROBE.replace("TESTS_DIR", repr(TESTS)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "stratagem.cli", "run", "--nproc", "2", "--strategy", "mirrored",
         str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((line["rank"], line["ending"]) for line in lines) == [
        (0, "close"), (1, "exit")], proc.stdout + proc.stderr
    for line in lines:
        assert line["gloo_threads"] == [], line
        assert not any(n.startswith("sg-heartbeat") for n in line["python_threads"]), line


def test_a_closed_comm_refuses_collectives_with_a_clear_error() -> None:
    def body(comm: Comm) -> str:
        comm.all_reduce(torch.ones(2))
        comm.close()
        comm.close()  # idempotent
        try:
            comm.all_reduce(torch.ones(2))
        except RuntimeError as e:
            return str(e)
        return ""

    from stratagem.testing import run_ranks
    for message in run_ranks(body, 2):
        assert "is closed" in message and "build a new strategy" in message
