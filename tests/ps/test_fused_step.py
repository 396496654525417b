"""One push, one optimizer step (``rules.offer_many``), and lone client calls run in place.

``offer_many`` must give exactly what one ``offer`` per tensor gives (bitwise: values,
optimizer state, results, refusal counts), including when one tensor's step would overflow
(only that one is refused) and with staleness-scaled learning rates.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch

from stratagem.ps import optim as ps_optim
from stratagem.ps import rules
from stratagem.ps.transport import _CallThreads

pytestmark = pytest.mark.timeout(30)

SHAPES = [(32, 48), (32,), (16, 32), (16,), (3, 16)]
SPECS = [
    {"name": "adam", "lr": 2e-3},
    {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.1, "amsgrad": True},
    {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
    {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"name": "sgd", "lr": 0.1},  # the plain-SGD fast path: never fused
    {"name": "rmsprop", "lr": 0.01, "momentum": 0.9, "centered": True},
    {"name": "adagrad", "lr": 0.1, "lr_decay": 0.01},
]


def _slots(spec: dict[str, Any]) -> list[rules.Slot]:
    g = torch.Generator().manual_seed(0)
    return [rules.make_slot(f"t{i}", torch.randn(s, generator=g), "async", spec, 1)
            for i, s in enumerate(SHAPES)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _state(slot: rules.Slot) -> dict[str, torch.Tensor]:
    assert slot.optimizer is not None
    param = slot.optimizer.param_groups[0]["params"][0]
    return {k: v for k, v in slot.optimizer.state.get(param, {}).items()
            if isinstance(v, torch.Tensor)}


def _assert_same(a: list[rules.Slot], b: list[rules.Slot]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.value, y.value), x.name
        sa, sb = _state(x), _state(y)
        assert sa.keys() == sb.keys(), x.name
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (x.name, k)
        assert (x.version, x.refused, x.dropped) == (y.version, y.refused, y.dropped), x.name


def _items(slots: list[rules.Slot], grads: list[torch.Tensor], bases: list[int]
           ) -> list[tuple[rules.Slot, int | None, Any]]:
    return [(s, b, functools.partial(lambda t: t, g)) for s, g, b in zip(slots, grads, bases,
                                                                        strict=True)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_one_fused_step_per_push_equals_one_step_per_tensor(spec: dict[str, Any],
                                                          monkeypatch) -> None:
    calls: list[int] = []
    real = rules._fused_step

    def counted(slots: Any, grads: Any, scale: float) -> bool:
        calls.append(len(slots))
        return real(slots, grads, scale)

    monkeypatch.setattr(rules, "_fused_step", counted)
    alone, fused = _slots(spec), _slots(spec)
    for step in range(4):
        grads = _grads(step)
        want = [rules.offer(s, s.version, None, functools.partial(lambda t: t, g))
                for s, g in zip(alone, grads, strict=True)]
        got = rules.offer_many(_items(fused, grads, [s.version for s in fused]), None)
        assert got == want
        _assert_same(alone, fused)
    # A push is one fused step once every tensor has its optimizer state (Adagrad builds it
    # with the optimizer, the others in their first step); plain SGD keeps its fast path.
    fused_pushes = 4 if _state(_slots(spec)[0]) else 3
    assert calls == ([] if rules.plain_sgd_lr(spec) is not None
                     else [len(SHAPES)] * fused_pushes)


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_a_fused_step_that_overflows_refuses_only_that_tensor(name: str) -> None:
    spec = {"name": name, "lr": 0.01}
    alone, fused = _slots(spec), _slots(spec)
    for slots in (alone, fused):  # optimizer state built: the next push is fused
        rules.offer_many(_items(slots, _grads(0), [0] * len(slots)), None)
    kept = [s.value.clone() for s in fused]
    kept_state = _state(fused[2])
    grads = _grads(1)
    grads[2][0, 0] = 3e38  # finite, but its square overflows the optimizer state
    want = [rules.offer(s, s.version, None, functools.partial(lambda t: t, g))
            for s, g in zip(alone, grads, strict=True)]
    got = rules.offer_many(_items(fused, grads, [s.version for s in fused]), None)
    assert [r[1] for r in got] == ["applied", "applied", "refused", "applied", "applied"]
    assert got == want
    _assert_same(alone, fused)
    assert torch.equal(fused[2].value, kept[2]) and fused[2].refused == 1
    for k, v in kept_state.items():
        assert torch.equal(_state(fused[2])[k], v), k
    assert not torch.equal(fused[0].value, kept[0])
    for s in fused:
        assert all(rules.finite(t) for t in [s.value, *_state(s).values()])


def test_staleness_scaled_and_dropped_gradients_match_one_offer_each() -> None:
    spec = {"name": "adam", "lr": 0.01, ps_optim.STALENESS_LR: True}
    alone, fused = _slots(spec), _slots(spec)
    for slots in (alone, fused):
        for step in range(3):
            rules.offer_many(_items(slots, _grads(step), [s.version for s in slots]), None)
    # Staleness 0, 1, 1, 2 (two learning rates: two fused groups) and 3 (dropped).
    bases = [3, 2, 2, 1, 0]
    grads = _grads(9)
    want = [rules.offer(s, b, 2, functools.partial(lambda t: t, g))
            for s, g, b in zip(alone, grads, bases, strict=True)]
    got = rules.offer_many(_items(fused, grads, bases), 2)
    assert [r[1] for r in got] == ["applied"] * 4 + ["dropped"]
    assert got == want
    _assert_same(alone, fused)


def test_a_lone_call_runs_in_the_thread_that_waits_for_it() -> None:
    threads = _CallThreads(max_threads=1)
    release = threading.Event()
    ran: dict[str, str] = {}

    def call(name: str) -> str:
        ran[name] = threading.current_thread().name
        if name == "first":
            release.wait(10)
        return name

    first = threads.submit(call, "first")  # occupies the only call thread
    while "first" not in ran:
        release.wait(0.001)
    second = threads.submit(call, "second")  # queued: no thread has started it
    assert second.result(10) == "second"
    assert ran["second"] == threading.current_thread().name  # run here, not handed over
    release.set()
    assert first.result(10) == "first" and ran["first"] == "stratagem-ps-call"
    third = threads.submit(call, "third")  # the call thread skips the call run here
    assert third.result(10) == "third"
    threads.close()
