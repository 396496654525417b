"""The final / consensus model: ``eval_model`` is always the user's module holding
the consensus under every precision, ``finalize`` folds the last local steps in, the
reusable ``strategy.autocast()``, and ``torch.compile``d models seen through."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_states_close, make_data, make_model
from safetensors.torch import load_file, load_model
from torch import nn

import stratagem as sg
from stratagem.comm import Comm
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    """A user class with a method of its own (what a DDP wrapper would hide)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(dim=1)


def _steps(strategy, model, opt, n: int, rank: int, offset: int = 0) -> None:
    X, Y = make_data()
    for step in range(offset, offset + n):
        x = X[rank::2][step * 8:(step + 1) * 8]
        y = Y[rank::2][step * 8:(step + 1) * 8]
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------- eval_model
@pytest.mark.parametrize("name", ["diloco", "easgd"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_eval_model_under_low_precision_equals_the_saved_model(name, precision, tmp_path):
    X, _ = make_data()

    def job(comm):
        s = sg.from_name(name, comm=comm, period=4, precision=precision)
        model = Net()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _steps(s, model, opt, 6, comm.rank)  # a sync at 4, then 2 local steps that drift
        s.save(tmp_path / "ckpt", model=model)
        ev = s.eval_model(model)
        with torch.no_grad():
            out_eval = ev(X[:32])
            out_local = model(X[:32])
        return type(ev), out_eval, out_local, _state(ev)

    results = run_ranks(job, 2)
    plain = Net()
    load_model(plain, str(tmp_path / "ckpt" / "model.safetensors"))
    ref_strategy = sg.OneDevice(precision=precision)
    with torch.no_grad(), ref_strategy.autocast():
        expected = plain(X[:32])
    for cls, out_eval, out_local, state in results:
        assert cls is Net
        assert out_eval.dtype == expected.dtype == (
            torch.bfloat16 if precision == "bf16" else torch.float16)
        torch.testing.assert_close(out_eval, expected, atol=0, rtol=0)
        assert not torch.equal(out_local, expected)  # the local model is another one
        assert_states_close(state, plain.state_dict(), atol=0, rtol=0)


def test_mirrored_eval_model_is_the_users_module_not_ddp():
    def job(comm):
        s = sg.Mirrored(comm=comm, precision="bf16")
        model = Net()
        wrapped, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _steps(s, wrapped, opt, 2, comm.rank)
        ev = s.eval_model(wrapped)
        x = make_data(8)[0]
        with torch.no_grad():
            assert ev(x).dtype == torch.bfloat16  # same precision as the prepared model
        return type(wrapped).__name__, ev is model, type(ev), ev.predict(x).shape

    for wrapped_name, same, cls, shape in run_ranks(job, 2):
        assert wrapped_name == "DistributedDataParallel"
        assert same and cls is Net and shape == (8,)


def test_local_sgd_eval_model_is_the_average_not_rank_0s_model():
    def job(comm):
        s = sg.LocalSGD(comm=comm, period=4)
        model = Net()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _steps(s, model, opt, 6, comm.rank)
        local = _state(model)
        ev = s.eval_model(model)
        assert all(torch.equal(v, local[k]) for k, v in _state(model).items())  # untouched
        return local, _state(ev), type(ev)

    (l0, e0, c0), (l1, e1, c1) = run_ranks(job, 2)
    assert c0 is c1 is Net
    mean = {k: (l0[k] + l1[k]) / 2 for k in l0}
    assert_states_close(e0, mean, atol=1e-7, rtol=1e-7)
    assert_states_close(e1, e0, atol=0, rtol=0)
    assert any(not torch.equal(l0[k], e0[k]) for k in l0)


def test_parameter_server_eval_model_is_the_users_module(shards):
    s = sg.ParameterServer(ps_addresses=shards, comm=Comm.single(), timeout=10)
    model = Net()
    compiled = torch.compile(model, backend="eager")
    prepared, opt = s.prepare(compiled, torch.optim.SGD(model.parameters(), lr=0.1))
    _steps(s, prepared, opt, 2, 0)
    ev = s.eval_model(prepared)
    assert ev is model and type(ev) is Net
    s.close()


# ---------------------------------------------------------------------- autocast
def test_autocast_is_reusable_nested_and_a_decorator():
    s = sg.OneDevice(precision="bf16")
    ctx = s.autocast()
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    for _ in range(3):  # the issue: the second `with ctx:` raised AttributeError
        with ctx:
            assert (a @ b).dtype == torch.bfloat16
        assert (a @ b).dtype == torch.float32
    with ctx:
        with ctx:
            assert (a @ b).dtype == torch.bfloat16
        assert (a @ b).dtype == torch.bfloat16  # the outer one is still active
    assert (a @ b).dtype == torch.float32

    @ctx
    def matmul() -> torch.Tensor:
        return a @ b

    assert matmul().dtype == torch.bfloat16
    assert ctx.enabled and ctx.fast_dtype is torch.bfloat16 and ctx.device_type == "cpu"
    fp32 = sg.OneDevice().autocast()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with fp32:  # fp32: a no-op, it does not switch an outer autocast off
            assert (a @ b).dtype == torch.bfloat16
    assert not fp32.enabled


# ---------------------------------------------------------------------- finalize
def test_diloco_finalize_makes_every_model_the_workers_mean(tmp_path):
    def job(comm):
        s = sg.DiLoCo(comm=comm, period=4, outer_lr=0.7, outer_momentum=0.9)
        model = Net()
        model, opt = s.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        _steps(s, model, opt, 7, comm.rank)  # an outer step at 4, then 3 inner steps
        before = _state(model)
        s.finalize(model)
        after = _state(model)
        ev = _state(s.eval_model(model))
        s.save(tmp_path / "ckpt", model=model)
        s.finalize(model)  # twice: nothing changes
        again = _state(model)
        _steps(s, model, opt, 3, comm.rank, offset=7)  # training continues: 10 % 4 != 0
        s.finalize(model)
        return before, after, ev, again, _state(model), _state(s.eval_model(model))

    (b0, a0, e0, g0, t0, te0), (b1, a1, e1, g1, t1, te1) = run_ranks(job, 2)
    mean = {k: (b0[k] + b1[k]) / 2 for k in b0}
    assert any(not torch.equal(b0[k], b1[k]) for k in b0)  # the workers had drifted apart
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for state in (a0, a1, e0, e1, g0, g1, saved):
        assert_states_close(state, mean, atol=1e-6, rtol=1e-6)
    assert_states_close(t0, t1, atol=0, rtol=0)
    assert_states_close(te0, t0, atol=0, rtol=0)


def test_local_sgd_finalize_averages_the_replicas():
    def job(comm):
        s = sg.LocalSGD(comm=comm, period=4)
        model = Net()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _steps(s, model, opt, 5, comm.rank)
        before = _state(model)
        s.finalize(model)
        return before, _state(model), s.metrics()["averages"]

    (b0, a0, n0), (b1, a1, n1) = run_ranks(job, 2)
    mean = {k: (b0[k] + b1[k]) / 2 for k in b0}
    assert_states_close(a0, mean, atol=1e-7, rtol=1e-7)
    assert_states_close(a1, a0, atol=0, rtol=0)
    assert n0 == n1 == 2  # the one at step 4 and the final one


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_easgd_finalize_is_a_last_exchange_then_a_no_op(rho):
    def job(comm):
        s = sg.ElasticAveraging(comm=comm, period=4, moving_rate=0.25, rho=rho)
        model = Net()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _steps(s, model, opt, 6, comm.rank)
        st = s._prepared[0].state["easgd"]
        center = [c.clone() for c in st.center]
        local = [t.detach().clone() for t in st.tensors]
        s.finalize(model)
        after = [c.clone() for c in st.center]
        s.finalize(model)  # no local step since: nothing happens
        again = [c.clone() for c in st.center]
        return center, local, after, again, s.metrics()["exchanges"]

    (c0, l0, a0, g0, e0), (c1, l1, a1, g1, e1) = run_ranks(job, 2)
    for i in range(len(c0)):
        torch.testing.assert_close(c0[i], c1[i], atol=0, rtol=0)
        # center += moving_rate * sum_i (x_i - center)
        expected = c0[i] + 0.25 * ((l0[i] - c0[i]) + (l1[i] - c0[i]))
        torch.testing.assert_close(a0[i], expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g0[i], a0[i], atol=0, rtol=0)
    assert e0 == e1 == 2


def test_parameter_server_finalize_flushes_the_accumulated_push(shards):
    s = sg.ParameterServer(ps_addresses=shards, comm=Comm.single(), timeout=10, push_every=3)
    model = Net()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _steps(s, model, opt, 4, 0)  # one push at step 3, step 4's gradient accumulated
    assert s.metrics()["pushes"] == 1
    s.finalize(model)
    assert s.metrics()["pushes"] == 2
    other = sg.ParameterServer(ps_addresses=shards, comm=Comm.single(), timeout=10)
    fresh = Net()
    fresh = other.prepare(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))[0]
    assert_states_close(_state(other.eval_model(fresh)), _state(model), atol=0, rtol=0)
    s.finalize(model)  # nothing pending: only pulls again
    assert s.metrics()["pushes"] == 2
    s.close()
    other.close()


def test_finalize_is_a_no_op_for_per_step_strategies_and_needs_a_prepared_model():
    s = sg.OneDevice()
    model = Net()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _steps(s, model, opt, 2, 0)
    before = _state(model)
    s.finalize(model)
    assert_states_close(_state(model), before, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"finalize needs a model prepared by this strategy"):
        s.finalize(Net())


def test_fit_finalizes_so_the_final_model_includes_every_local_step():
    data = make_data()

    def job(comm):
        s = sg.DiLoCo(comm=comm, period=100)  # no outer step at all during training
        model = Net()
        initial = _state(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        history = s.fit(model, opt, lambda out, y: F.cross_entropy(out, y), data, epochs=1,
                        global_batch_size=32, eval_dataset=make_data(64, seed=7),
                        progress=False)
        prepared = s._prepared[0].model
        return initial, _state(s.eval_model(prepared)), _state(prepared), history

    (i0, e0, m0, h0), (_, e1, m1, h1) = run_ranks(job, 2)
    assert_states_close(e0, m0, atol=0, rtol=0)
    assert_states_close(e0, e1, atol=0, rtol=0)
    assert_states_close(m0, m1, atol=0, rtol=0)
    assert any(not torch.allclose(e0[k], i0[k]) for k in e0)  # trained, not the initial model
    # The last val_loss is that of the final model.
    model = Net()
    model.load_state_dict(e0)
    X, Y = make_data(64, seed=7)
    with torch.no_grad():
        assert float(F.cross_entropy(model(X), Y)) == pytest.approx(h0["val_loss"][-1], rel=1e-5)


# ---------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("name", ["one_device", "mirrored", "local_sgd", "diloco", "easgd"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_model_is_seen_through(name, precision, tmp_path):
    data = make_data()
    world = 1 if name == "one_device" else 2
    replicated = name in ("one_device", "mirrored")

    def job(comm, compile_it: bool, path):
        kw = {} if replicated else {"period": 2}
        s = sg.OneDevice(precision=precision) if world == 1 else \
            sg.from_name(name, comm=comm, precision=precision, **kw)
        model = Net()
        given = torch.compile(model, backend="eager") if compile_it else model
        prepared, opt = s.prepare(given, torch.optim.SGD(model.parameters(), lr=0.1))
        _steps(s, prepared, opt, 3, comm.rank)
        out = prepared(data[0][:8])
        assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        s.save(path, model=prepared)
        consensus = _state(s.eval_model(prepared))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        s.restore(path, model=prepared)  # through the compiled wrapper, the module's names
        assert_states_close(_state(s.eval_model(given)), consensus, atol=0, rtol=0)
        assert s.unwrap(prepared) is model and s.unwrap(given) is model
        ev = s.eval_model(prepared)
        assert type(ev) is Net and s.eval_model(given) is ev
        assert (ev is model) == replicated  # the periodic strategies return a consensus copy
        assert all("_orig_mod" not in k for k in ev.state_dict())
        assert s.unwrap(torch.compile(Net(), backend="eager")).__class__ is Net
        return _state(s.unwrap(prepared)), out.detach(), _state(ev)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's own warnings on CPU
        compiled = run_ranks(job, world, args=(True, tmp_path / "c"))
    plain = run_ranks(job, world, args=(False, tmp_path / "p"))
    for (sc, oc, _), (sp, op, _) in zip(compiled, plain, strict=True):
        assert all("_orig_mod" not in k for k in sc)
        assert_states_close(sc, sp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(oc, op, atol=1e-2, rtol=1e-2)
    saved = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert sorted(saved) == sorted(compiled[0][0])  # the module's own names
    fresh = Net()
    load_model(fresh, str(tmp_path / "c" / "model.safetensors"))
    assert_states_close(_state(fresh), compiled[0][2], atol=0, rtol=0)  # the consensus
