"""``strategy.clip_grad_norm_``: unscaled gradients, only at the accumulation
boundary whatever the loop shape, the skip logic for non-finite norms, ``fit(clip_grad_norm=)``,
and the ``accumulation_steps`` / ``global_accumulation_steps`` ergonomics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_states_close, make_data, make_model

import stratagem as sg
from stratagem.comm import Comm
from stratagem.fit import fit
from stratagem.ps.server import start_local_shards
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(90)

MAX_NORM = 0.5
LR = 0.05


def _build(name: str, comm: Comm, shards: list[str] | None, **kwargs):
    if name == "one_device":
        return sg.OneDevice(**kwargs)
    if name.startswith("ps"):
        return sg.from_name(name, comm=comm, ps_addresses=shards, timeout=10, **kwargs)
    return sg.from_name(name, comm=comm, **kwargs)


def _clipped_run(strategy, data, *, accumulation: int, gbs: int, steps: int = 10,
                 every_micro: bool = False):
    """``steps`` optimizer steps; step ``t`` covers samples ``[t*gbs*R, (t+1)*gbs*R)`` in
    ``accumulation`` (R) micro-batches, each replica taking its contiguous share of each
    micro-batch. Clips every micro-batch or only at the boundary. Returns the user-named
    state and the norms ``clip_grad_norm_`` returned (read after the step)."""
    X, Y = data
    with strategy.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = strategy.prepare(model, opt)
    n, r = strategy.num_replicas_in_sync, strategy.replica_id
    per = gbs // n
    norms = []
    for step in range(steps):
        returned = []
        for micro in range(accumulation):
            start = (step * accumulation + micro) * gbs + r * per
            x, y = X[start:start + per], Y[start:start + per]
            strategy.backward(F.cross_entropy(model(x), y))
            if every_micro or micro == accumulation - 1:
                returned.append(strategy.clip_grad_norm_(model, MAX_NORM))
            opt.step()
            opt.zero_grad()
        # Every tensor returned during one accumulated step holds the step's norm afterwards.
        assert all(t is returned[0] for t in returned)
        norms.append(float(returned[-1]))
    state = {k: v.detach().clone() for k, v in strategy.unwrap(model).state_dict().items()}
    return state, norms, strategy.metrics()


def _reference(data, *, gbs: int, steps: int = 10):
    """Plain PyTorch, fp32, one batch of ``gbs`` per step, torch's clip_grad_norm_."""
    X, Y = data
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for step in range(steps):
        x, y = X[step * gbs:(step + 1) * gbs], Y[step * gbs:(step + 1) * gbs]
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


@pytest.mark.parametrize("name", ["one_device", "mirrored"])
@pytest.mark.parametrize("every_micro", [False, True])
def test_fp16_accumulation_4_equals_fp32_big_batch(name, every_micro):
    data = make_data()
    world = 1 if name == "one_device" else 2
    ref_state, ref_norms = _reference(data, gbs=32)
    results = run_ranks(lambda comm: _clipped_run(
        _build(name, comm, None, precision="fp16", accumulation_steps=4, init_scale=1024.0),
        data,
        accumulation=4, gbs=8, every_micro=every_micro), world)
    for state, norms, metrics in results:
        assert metrics["steps"] == 10 and metrics["skipped_steps"] == 0
        assert_states_close(state, ref_state, atol=1e-4, rtol=1e-4)
        # The returned norm is the true pre-clip norm of the whole (unscaled) step.
        assert norms == pytest.approx(ref_norms, rel=2e-3)
        assert max(norms) > MAX_NORM  # clipping was active


@pytest.mark.parametrize("name", ["one_device", "mirrored", "local_sgd", "diloco", "easgd",
                                  "ps-sync", "ps-async"])
def test_both_loop_shapes_give_the_same_result(name, shards):
    data = make_data()
    # Async parameter-server workers interleave nondeterministically: one worker there.
    world = 1 if name in ("one_device", "ps-async") else 2

    def run(every_micro: bool, addrs: list[str]):
        kw = {"accumulation_steps": 2}
        if name in ("local_sgd", "diloco", "easgd"):
            kw["period"] = 3
        return run_ranks(lambda comm: _clipped_run(
            _build(name, comm, addrs, **kw), data, accumulation=2, gbs=16, steps=6,
            every_micro=every_micro), world)

    servers, other = start_local_shards(2)  # a fresh model on the shards for the 2nd run
    try:
        boundary = run(False, shards)
        every = run(True, other)
    finally:
        for s in servers:
            s.stop(0)
    for (s1, n1, _), (s2, n2, _) in zip(boundary, every, strict=True):
        assert_states_close(s1, s2, atol=1e-6, rtol=1e-6)
        assert n1 == pytest.approx(n2, rel=1e-6)
        assert all(math.isfinite(v) for v in n1) and max(n1) > MAX_NORM


def test_one_device_clipping_equals_torch_on_the_full_step():
    data = make_data()
    ref_state, ref_norms = _reference(data, gbs=32, steps=5)
    state, norms, _ = _clipped_run(sg.OneDevice(accumulation_steps=2), data, accumulation=2,
                                   gbs=16, steps=5, every_micro=True)
    assert_states_close(state, ref_state, atol=1e-6, rtol=1e-6)
    assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_norm_is_nan_before_the_step_and_filled_by_it():
    s = sg.OneDevice(accumulation_steps=2)
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(16)
    s.backward(F.cross_entropy(model(x[:8]), y[:8]))
    early = s.clip_grad_norm_(model, 1e-3)
    grads_before = [p.grad.clone() for p in model.parameters()]
    assert math.isnan(float(early))
    opt.step()  # a micro-batch: nothing clipped, partial sums left alone
    for p, g in zip(model.parameters(), grads_before):
        assert torch.equal(p.grad, g)
    s.backward(F.cross_entropy(model(x[8:]), y[8:]))
    late = s.clip_grad_norm_(model, 1e-3)
    assert late is early and math.isfinite(float(late)) and float(late) > 1e-3
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(total) == pytest.approx(1e-3, rel=1e-3)  # clipped at the boundary


def test_nonfinite_norm_skips_on_every_replica_under_fp16():
    X, Y = make_data()

    def job(comm):
        s = sg.Mirrored(comm=comm, precision="fp16", init_scale=1024.0)
        model = make_model()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        norms = []
        for step in range(3):
            x, y = X[step * 8:(step + 1) * 8], Y[step * 8:(step + 1) * 8]
            s.backward(F.cross_entropy(model(x), y))
            if step == 1:
                before = {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}
                if comm.rank == 1:
                    s.unwrap(model)[0].weight.grad[0, 0] = float("inf")  # only this replica
            norms.append(float(s.clip_grad_norm_(model, 1.0)))
            opt.step()
            opt.zero_grad()
            if step == 1:
                assert_states_close(s.unwrap(model).state_dict(), before, atol=0, rtol=0)
        return norms, s.metrics()

    (n0, m0), (n1, m1) = run_ranks(job, 2)
    assert m0["skipped_steps"] == m1["skipped_steps"] == 1
    assert m0["loss_scale"] == m1["loss_scale"] == 512.0
    assert math.isfinite(n0[1]) and not math.isfinite(n1[1])  # replica 0 saw finite grads
    assert all(math.isfinite(v) for v in n0[::2] + n1[::2])


def test_nonfinite_norm_raises_with_a_message_naming_clip_grad_norm():
    s = sg.OneDevice()
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(8)
    s.backward(F.cross_entropy(model(x), y))
    model[0].weight.grad[0, 0] = float("nan")
    assert math.isnan(float(s.clip_grad_norm_(model, 1.0)))
    with pytest.raises(FloatingPointError, match=r"strategy\.clip_grad_norm_"):
        opt.step()


def test_clip_grad_norm_rejects_bad_arguments():
    s = sg.OneDevice()
    model = make_model()
    prepared, _ = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"max_norm must be a finite number > 0, got 0"):
        s.clip_grad_norm_(prepared, 0)
    with pytest.raises(ValueError, match=r"norm_type must be .*got -1"):
        s.clip_grad_norm_(prepared, 1.0, norm_type=-1)
    with pytest.raises(ValueError, match=r"prepared by this strategy.*Sequential.*Fix"):
        s.clip_grad_norm_(make_model(), 1.0)
    fp16 = sg.OneDevice(precision="fp16")
    m = make_model()
    m, _ = fp16.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = make_data(8)
    F.cross_entropy(m(x), y).backward()
    with pytest.raises(RuntimeError, match="strategy.backward"):
        fp16.clip_grad_norm_(m, 1.0)


def test_fit_clip_grad_norm_equals_a_clipping_custom_loop():
    data = make_data()
    X, Y = data
    # fit shuffles with seed 0; the custom loop uses the same loader.
    s1 = sg.OneDevice(accumulation_steps=2)
    with s1.scope():
        model = make_model()
        model, opt = s1.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = s1.distribute_dataset(data, 16, shuffle=True, seed=0)
    loader.set_epoch(0)
    for x, y in loader:
        s1.backward(F.cross_entropy(model(x), y))
        s1.clip_grad_norm_(model, 0.2)
        opt.step()
        opt.zero_grad()
    s2 = sg.OneDevice(accumulation_steps=2)
    m2 = make_model()
    fit(s2, m2, torch.optim.SGD(m2.parameters(), lr=LR), F.cross_entropy, data, epochs=1,
        global_batch_size=16, progress=False, clip_grad_norm=0.2)
    assert_states_close(s2.unwrap(s2._prepared[0].model).state_dict(), model.state_dict(),
                        atol=1e-7, rtol=1e-7)
    unclipped = sg.OneDevice(accumulation_steps=2)
    m3 = make_model()
    fit(unclipped, m3, torch.optim.SGD(m3.parameters(), lr=LR), F.cross_entropy, data,
        epochs=1, global_batch_size=16, progress=False)
    assert not torch.allclose(m3[0].weight, model[0].weight, atol=1e-4)
    with pytest.raises(ValueError, match="clip_grad_norm must be None or a finite number > 0"):
        fit(sg.OneDevice(), make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1),
            F.cross_entropy, data, epochs=1, global_batch_size=16, clip_grad_norm=-1.0)


# ---------------------------------------------------------------------- accumulation ergonomics
def test_global_accumulation_steps_is_divided_by_the_workers():
    def job(comm):
        s = sg.Mirrored(comm=comm, global_accumulation_steps=6)
        return s.accumulation_steps, s.global_accumulation_steps

    assert run_ranks(job, 2) == [(3, 6), (3, 6)]

    def bad(comm):
        sg.LocalSGD(comm=comm, global_accumulation_steps=3)

    with pytest.raises(ValueError, match=r"global_accumulation_steps=3 is not divisible by the "
                                         r"2 workers.*Fix"):
        run_ranks(bad, 2)
    with pytest.raises(ValueError, match="not both"):
        sg.OneDevice(accumulation_steps=2, global_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"global_accumulation_steps must be an int >= 1, got 0"):
        sg.OneDevice(global_accumulation_steps=0)
    assert sg.OneDevice(global_accumulation_steps=5).accumulation_steps == 5


def test_accumulation_steps_settable_after_construction():
    data = make_data()
    reference, _, _ = _clipped_run(sg.OneDevice(accumulation_steps=4), data, accumulation=4,
                                   gbs=8, steps=3)
    s = sg.OneDevice()
    s.accumulation_steps = 4
    later, _, _ = _clipped_run(s, data, accumulation=4, gbs=8, steps=3)
    assert_states_close(later, reference, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"accumulation_steps must be an int >= 1, got 0"):
        s.accumulation_steps = 0
    # Not in the middle of an accumulated step.
    x, y = data
    model = s._prepared[0].model
    s.backward(F.cross_entropy(model(x[:8]), y[:8]))
    with pytest.raises(RuntimeError, match=r"from 4 to 2 in the middle.*1 of 4"):
        s.accumulation_steps = 2


def test_accumulation_steps_set_later_controls_ddp_gradient_sync():
    X, Y = make_data()

    def job(comm):
        s = sg.Mirrored(comm=comm)
        model = make_model()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        s.accumulation_steps = 2
        x, y = X[comm.rank * 8:(comm.rank + 1) * 8], Y[comm.rank * 8:(comm.rank + 1) * 8]
        s.backward(F.cross_entropy(model(x), y))  # micro-batch 1 of 2: no all-reduce
        return s.unwrap(model)[0].weight.grad.clone()

    g0, g1 = run_ranks(job, 2)
    assert not torch.allclose(g0, g1)  # local gradients: DDP did not synchronise


def test_one_device_warns_under_a_multi_process_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.warns(RuntimeWarning, match=r"WORLD_SIZE=2 .*RANK=1.*Fix: use a multi-process"):
        sg.OneDevice()
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE=2"):
        sg.from_name("one_device")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sg.OneDevice(comm=Comm.single())  # an explicit world of one is deliberate
        sg.get_strategy()  # the implicit default strategy does not warn either
        monkeypatch.setenv("WORLD_SIZE", "1")
        sg.OneDevice()


def test_clip_then_two_optimizers_at_one_boundary_unscale_once():
    # One model split over two optimizers (a GAN-like or per-module setup): the clip unscales
    # every gradient of the model once; neither step may unscale its share again.
    X, Y = make_data()

    def run(precision: str):
        s = sg.OneDevice(precision=precision, init_scale=1024.0, accumulation_steps=2)
        model = make_model()
        first = torch.optim.SGD(model[0].parameters(), lr=LR)
        second = torch.optim.SGD(model[2].parameters(), lr=LR)
        model, first, second = s.prepare(model, first, second)
        for step in range(4):
            for micro in range(2):
                start = (step * 2 + micro) * 16
                s.backward(F.cross_entropy(model(X[start:start + 16]), Y[start:start + 16]))
                s.clip_grad_norm_(model, MAX_NORM)
                first.step()
                second.step()
                first.zero_grad()
                second.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    assert_states_close(run("fp16"), run("fp32"), atol=1e-4, rtol=1e-4)
