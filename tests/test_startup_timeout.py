"""Start-up waits are not step waits: joining a job waits up to ``startup_timeout`` (default
the larger of ``timeout`` and 120 s) for every rank to start, so a short step ``timeout``
detects dead peers in training without failing a slow start; a rank that never starts is
named once ``startup_timeout`` has passed."""

from __future__ import annotations

import os
import time

import pytest
import torch

import stratagem as sg

pytestmark = pytest.mark.timeout(120)


def _join_late(delay: float, startup_timeout: float | None) -> float:
    if int(os.environ["RANK"]) == 1:
        time.sleep(delay)  # a slow start: imports, data, a busy node
    strategy = sg.Mirrored(timeout=2.0, startup_timeout=startup_timeout)
    return float(strategy.comm.all_reduce(torch.ones(1)))


def test_a_rank_that_starts_later_than_the_step_timeout_joins():
    # Rank 1 starts 6 s after rank 0, three times the 2 s step timeout (before startup_timeout
    # existed, rank 0's process-group creation gave up after `timeout`).
    assert sg.launch(_join_late, nprocs=2, args=(6.0, None), timeout=90) == [2.0, 2.0]


def test_a_rank_that_never_starts_is_named_after_startup_timeout():
    t0 = time.monotonic()
    with pytest.raises(sg.WorkerError, match=r"rank\(s\) \[1\] of 2 did not start within "
                                             r"startup_timeout=3s.*raise startup_timeout"):
        sg.launch(_join_late, nprocs=2, args=(60.0, 3.0), timeout=90)
    assert time.monotonic() - t0 < 45  # 3 s of waiting, plus process start-up


def test_startup_timeout_is_checked_when_the_strategy_is_built():
    for bad in (0, -1.0, float("nan"), "60"):
        with pytest.raises((ValueError, TypeError), match="startup_timeout"):
            sg.Mirrored(startup_timeout=bad)
    assert sg.Mirrored(timeout=5).startup_timeout == 120.0
    assert sg.Mirrored(timeout=300).startup_timeout == 300.0
    assert sg.Mirrored(startup_timeout=30).startup_timeout == 30.0
