"""Fault-tolerant replica groups with real processes: ``stratagem run
--fault-tolerant --replica-group-size 2`` with ``Hierarchical``; a process SIGKILLed mid-run
takes its group down and the group is restarted whole. Its own file, so that pytest-xdist
can run it beside ``test_ft_processes.py`` (both launch several processes)."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("torchft")

from helpers import ft_pids  # noqa: E402
from test_ft_processes import (  # noqa: E402
    _assert_bitwise_equal,
    _final,
    _finish,
    _start,
    _wait_progress,
)

pytestmark = pytest.mark.timeout(300)


def test_a_sigkilled_process_takes_its_replica_group_down_and_the_group_heals(tmp_path):
    # Hierarchical on 2 replica groups of 2 processes (a node each: FSDP2 inside, DiLoCo
    # across; torchft's HSDP). SIGKILL one process of group 1: its group-mate fails in the
    # group's collectives, the launcher restarts group 1 whole, group 0 trains on and is
    # never restarted, and each new process heals its shards from the same group rank of
    # group 0. (Mirrored inside: test_ft.py, threads; FSDP2 needs launched processes.)
    # --min-replicas 2: group 0 waits for the replacement (as in the test above).
    proc = _start(tmp_path, "--strategy", "hierarchical_sharded", "--step-sleep", "0.01",
                  "--timeout", "120", min_replicas=2, nproc=4, group=2, steps=30)
    _wait_progress(tmp_path, [0, 1, 2, 3], 6, deadline=150)
    survivors = {s: ft_pids(tmp_path, s) for s in (0, 1)}
    os.kill(ft_pids(tmp_path, 3)[-1], signal.SIGKILL)
    text = _finish(proc)
    assert "restarting worker 3 with its replica group 1" in text, text[-3000:]
    assert "restarting worker 2 with its replica group 1" in text, text[-3000:]
    assert {s: ft_pids(tmp_path, s) for s in (0, 1)} == survivors
    assert len(ft_pids(tmp_path, 2)) == 2 and len(ft_pids(tmp_path, 3)) == 2
    states, accs = _final(tmp_path, 4)
    _assert_bitwise_equal(states)
    # The fault-free run of this data reaches 0.99 (synthetic clusters; the bar
    # against a fault-free run is measured by benchmarks/ft_kills.py, where it is costlier).
    assert accs[0] >= 0.98, accs
    for s in (2, 3):
        assert "heals=1" in (tmp_path / f"acc.{s}").read_text()
