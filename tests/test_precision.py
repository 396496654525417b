"""Loss scaling, non-finite handling and gradient accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_states_close, make_data, make_model, train

import stratagem as sg
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("factory", ["one_device", "mirrored"])
def test_accumulation_equals_larger_batch(factory):
    data = make_data()
    world = 1 if factory == "one_device" else 2

    def job(comm, accumulation, gbs):
        strategy = sg.OneDevice(accumulation_steps=accumulation) if world == 1 else \
            sg.Mirrored(comm=comm, accumulation_steps=accumulation)
        return _accumulated(strategy, data, accumulation, gbs)

    big = run_ranks(job, world, args=(1, 16 * world))
    small = run_ranks(job, world, args=(4, 4 * world))
    for a, b in zip(big, small):
        assert_states_close(a[0], b[0], atol=1e-6, rtol=1e-6)
        assert a[1]["steps"] == b[1]["steps"] == 10


def _accumulated(strategy, data, accumulation, gbs):
    """10 optimizer steps; with accumulation R each step sees R micro-batches of gbs/R that
    together cover the same samples as one batch of R*gbs (no shuffle)."""
    X, Y = data
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = strategy.prepare(model, opt)
    n, r = strategy.num_replicas_in_sync, strategy.replica_id
    per = gbs // n
    for step in range(10):
        for micro in range(accumulation):
            start = (step * accumulation + micro) * gbs
            idx = torch.arange(start, start + gbs)
            # replica r takes a strided share so both settings cover the same samples per replica
            mine = idx.view(-1, n)[:, r] if accumulation == 1 else idx[r * per:(r + 1) * per]
            x, y = X[mine % len(X)], Y[mine % len(X)]
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in strategy.unwrap(model).state_dict().items()}, strategy.metrics()


def test_nonfinite_gradient_raises_naming_parameter_and_step():
    s = sg.OneDevice()
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    s.backward(F.cross_entropy(model(x), y))
    model[2].bias.grad[0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"step 1.*2\.bias"):
        opt.step()


def test_skip_mode_leaves_parameters_unchanged():
    s = sg.OneDevice(on_nonfinite="skip")
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = make_data(8)
    s.backward(F.cross_entropy(model(x), y) * float("inf"))
    opt.step()
    opt.zero_grad()
    assert_states_close(model.state_dict(), before, atol=0, rtol=0)
    assert s.metrics()["skipped_steps"] == 1 and s.metrics()["steps"] == 0


def test_fp16_inf_on_one_replica_skips_everywhere_and_halves_scale():
    X, Y = make_data()

    def job(comm):
        s = sg.Mirrored(comm=comm, precision="fp16", growth_interval=3, init_scale=1024.0)
        model = make_model()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        scales, snapshots = [], []
        for step in range(1, 8):
            x, y = X[step * 8:(step + 1) * 8], Y[step * 8:(step + 1) * 8]
            loss = F.cross_entropy(model(x), y)
            before = {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}
            s.backward(loss)
            if step == 3 and comm.rank == 1:
                s.unwrap(model)[0].weight.grad[0, 0] = float("inf")  # only this replica
            opt.step()
            opt.zero_grad()
            scales.append(s.metrics()["loss_scale"])
            snapshots.append(before if step == 3 else None)
            if step == 3:
                assert_states_close(s.unwrap(model).state_dict(), before, atol=0, rtol=0)
        return scales, s.metrics()["skipped_steps"], s.unwrap(model).state_dict()

    (scales0, skipped0, state0), (scales1, skipped1, state1) = run_ranks(job, 2)
    s0 = 1024.0
    # steps 1,2 clean; 3 skipped (halve); 4,5,6 clean -> double after 3 clean; 7 clean
    assert scales0 == scales1 == [s0, s0, s0 / 2, s0 / 2, s0 / 2, s0, s0]
    assert skipped0 == skipped1 == 1
    assert_states_close(state0, state1, atol=0, rtol=0)


def test_fp16_requires_strategy_backward():
    s = sg.OneDevice(precision="fp16")
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="strategy.backward"):
        opt.step()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_training_converges(precision):
    data = make_data()
    state, metrics = train(sg.OneDevice(precision=precision), data, steps=60, lr=0.5, optimizer="sgd")
    ref, _ = train(sg.OneDevice(), data, steps=60, lr=0.5, optimizer="sgd")
    X, Y = data
    model = make_model()
    model.load_state_dict(state)
    loss_low = F.cross_entropy(model(X), Y).item()
    model.load_state_dict(ref)
    loss_ref = F.cross_entropy(model(X), Y).item()
    assert loss_low < 1.1 * loss_ref + 0.05
    assert metrics["skipped_steps"] <= 2


def test_autocast_applies_to_wrapped_model():
    s = sg.OneDevice(precision="bf16")
    model = s.prepare(make_model())
    out = model(torch.randn(4, 10))
    assert out.dtype == torch.bfloat16
    with s.autocast():
        assert torch.randn(2, 2).matmul(torch.randn(2, 2)).dtype == torch.bfloat16
