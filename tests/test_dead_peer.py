"""A peer that dies or freezes mid-training surfaces as a named error within timeout + 10 s
(real processes: the process dying is the point)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg

pytestmark = pytest.mark.timeout(90)

TIMEOUT = 4.0


def _train_until_peer_fails(how: str) -> str:
    strategy = sg.Mirrored(timeout=TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for step in range(1000):
        if step == 3 and strategy.replica_id == 1:
            if how == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: heartbeat stops too
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        except sg.PeerTimeoutError as exc:
            raise sg.PeerTimeoutError(f"{exc} [surfaced after {time.monotonic() - t0:.1f}s]",
                                      ranks=exc.ranks) from None
    return "finished"


@pytest.mark.parametrize("how", ["freeze", "kill"])
def test_dead_or_frozen_peer_is_named_within_timeout(how):
    t0 = time.monotonic()
    with pytest.raises(sg.WorkerError) as info:
        sg.launch(_train_until_peer_fails, nprocs=2, args=(how,), timeout=60)
    elapsed = time.monotonic() - t0
    err = info.value
    if how == "freeze":
        # the survivor raises PeerTimeoutError naming rank 1 (died or froze)
        assert err.rank == 0, str(err)
        assert "PeerTimeoutError" in str(err) and "rank(s) 1" in str(err)
        import re

        surfaced = float(re.search(r"surfaced after ([0-9.]+)s", str(err)).group(1))
        assert surfaced < TIMEOUT + 10, surfaced
    else:
        # the launcher names the dead rank (SIGKILL) — or the survivor names it first
        assert err.rank == 1 or "rank(s) 1" in str(err), str(err)
    assert elapsed < 80  # process start-up dominates on a loaded 2-core machine
