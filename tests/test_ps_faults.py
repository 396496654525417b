"""ParameterServer under failures: a worker that vanishes leaves the shards and the other
workers running and a restarted worker starts from the current parameters (threads on
in-process shards); a SIGKILLed shard process surfaces as ParameterServerUnavailable naming
its address within the deadline (the one real-process test here)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_model

from stratagem.comm import Comm
from stratagem.errors import ParameterServerUnavailable
from stratagem.launcher import start_ps_shards
from stratagem.ps.transport import PSClient
from stratagem.strategies.parameter_server import ParameterServer


class _Died(Exception):
    """Ends a worker thread mid-run, as SIGKILL ends a process: no close, nothing flushed."""


def _worker(index: int, steps: int, addrs: list[str], die_at: int | None = None
            ) -> dict[str, Any]:
    """One async worker with a Comm of its own (async training needs no collective)."""
    s = ParameterServer(mode="async", ps_addresses=addrs, comm=Comm.single(), timeout=20)
    with s.scope():
        model = make_model(seed=100 + index)  # the shards' values win over this init
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start_version = s.global_version
    x, y = make_data(seed=index + 1)
    losses = []
    for step in range(steps):
        if step == die_at:
            raise _Died(f"worker {index} died at step {step}")
        i = (step * 32) % 640
        loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        s.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    m = s.metrics()
    s.close()
    return {"start": start, "start_version": start_version, "losses": losses,
            "staleness": dict(m["staleness"]), "pushes": m["pushes"]}


def _shard_state(addrs: list[str]) -> tuple[dict[str, torch.Tensor], int]:
    from stratagem.ps.table import ShardedParameters

    with PSClient(addrs, timeout=10) as client:
        table = ShardedParameters(client, dict(make_model().named_parameters()), mode="elastic")
        values = table.pull()
        return values, min(table.versions.values())


@pytest.mark.timeout(120)
def test_dead_worker_leaves_shards_and_others_running_and_a_restart_pulls_first(shards):
    # Three async workers as threads on in-process shards; worker 1 vanishes after 3 steps
    # (the real-process version of this path is test_chaos.py's SIGKILLed EASGD worker).
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            results[i] = _worker(i, 60, shards, die_at=3 if i == 1 else None)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads)
    assert isinstance(results[1], _Died), results[1]
    survivors = [results[0], results[2]]
    assert all(isinstance(r, dict) for r in survivors), survivors
    assert all(len(r["losses"]) == 60 and r["pushes"] == 60 for r in survivors)
    assert all(sum(r["losses"][-10:]) < sum(r["losses"][:10]) for r in survivors)
    with PSClient(shards, timeout=10) as client:
        assert all(h["ok"] for h in client.health())

    # Restart worker 1 with the shards quiescent: it must hold the shards' current values
    # (and version) before its first push, which is therefore not stale.
    values, version = _shard_state(shards)
    assert version >= 120
    again = _worker(1, 3, shards)
    assert again["start_version"] == version
    for k, v in values.items():
        torch.testing.assert_close(again["start"][k], v, atol=0, rtol=0)
    # Its first push was computed on those values (later ones are one fetch behind:
    # prefetch), so nothing it pushed was stale beyond that.
    assert again["staleness"].get(0, 0) >= 1 and set(again["staleness"]) <= {0, 1}


@pytest.mark.timeout(60)
def test_dead_shard_raises_naming_its_address_within_the_deadline(monkeypatch):
    with start_ps_shards(1) as shards:
        addr = shards.addresses[0]
        for k, v in shards.env().items():  # addresses and the job's token file
            monkeypatch.setenv(k, v)
        # The dead shard's connection is refused at once (tens of ms), not at the deadline: a
        # 10 s deadline keeps the two far apart on a loaded machine; the bound is the midpoint.
        s = ParameterServer(mode="async", ps_addresses=shards.addresses, comm=Comm.single(),
                            timeout=10.0)
        with s.scope():
            model = make_model()
            model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_data()

        def step(i: int) -> None:
            s.backward(F.cross_entropy(model(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8]))
            opt.step()
            opt.zero_grad()

        for i in range(3):
            step(i)
        os.kill(shards.procs[0].pid, signal.SIGKILL)
        shards.procs[0].wait(10)
        t0 = time.monotonic()
        with pytest.raises(ParameterServerUnavailable, match=re.escape(addr)) as info:
            for i in range(3, 10):  # with prefetch the error surfaces at the next install
                step(i)
        assert time.monotonic() - t0 < 10.0 / 2
        assert info.value.address == addr
        s.close()
