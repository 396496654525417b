"""Synchronisation parts alone and in strategies: each part over a Comm of
threads, and DiLoCo's outer step as a real torch optimizer against the hand-written update."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import mse_steps
from torch import nn
from torch.testing import assert_close

import stratagem as sg
from stratagem.comm import Comm
from stratagem.parts import GradientSync, OuterStep, ParameterAveraging
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

WORLD = 3
LR = 0.05


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)

def _local_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _reference_diloco(steps: int, period: int, fragments: list[list[int]] | None,
                      outer_lr: float, mu: float) -> list[torch.Tensor]:
    """The outer update as DiLoCo wrote it by hand before it used torch optimizers:
    ``m = mu m + delta; theta_prev -= lr (delta + mu m)``; workers simulated in one thread."""
    models = [_model() for _ in range(WORLD)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    prev = [p.detach().clone() for p in models[0].parameters()]
    mom = [torch.zeros_like(p) for p in prev]
    n = len(prev)
    frags = fragments or [list(range(n))]
    offsets = [k * period // len(frags) for k in range(len(frags))]
    for step in range(steps):
        for r in range(WORLD):
            _local_step(models[r], opts[r], r, step)
        phase = (step + 1) % period
        for k, off in enumerate(offsets):
            if off != phase:
                continue
            with torch.no_grad():
                for i in frags[k]:
                    mean = sum(list(m.parameters())[i].detach() for m in models) / WORLD
                    d = prev[i] - mean
                    mom[i].mul_(mu).add_(d)
                    prev[i].sub_(d + mu * mom[i], alpha=outer_lr)
                    for m in models:
                        list(m.parameters())[i].copy_(prev[i])
    return prev


@pytest.mark.parametrize("fragments", [1, 2])
def test_diloco_user_nesterov_sgd_equals_hand_written_outer_step(fragments: int) -> None:
    steps, period = 13, 4

    def job(comm: Comm) -> list[torch.Tensor]:
        strategy = sg.DiLoCo(
            period=period, fragments=fragments, comm=comm,
            outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
        model = _model()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        mse_steps(strategy, model, opt, steps, _batch)
        return [t.clone() for t in strategy.eval_model(model).parameters()]

    got = run_ranks(job, WORLD)
    frags = None
    if fragments > 1:
        from stratagem.parts.outer import split_fragments
        frags = split_fragments(list(_model().parameters()), fragments)
    want = _reference_diloco(steps, period, frags, 0.7, 0.9)
    for rank_params in got:
        for g, w in zip(rank_params, want, strict=True):
            assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_diloco_default_outer_optimizer_is_nesterov_sgd() -> None:
    def job(comm: Comm, user: bool) -> list[torch.Tensor]:
        kw = {"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.8,
                                                            nesterov=True)} if user else {}
        strategy = sg.DiLoCo(period=2, outer_lr=0.5, outer_momentum=0.8, comm=comm, **kw)
        model = _model()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        mse_steps(strategy, model, opt, 6, _batch)
        return [t.clone() for t in strategy.eval_model(model).parameters()]

    a = run_ranks(job, 2, args=(True,))
    b = run_ranks(job, 2, args=(False,))
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)


def test_diloco_outer_adam_state_survives_a_checkpoint(tmp_path) -> None:
    """Any torch optimizer drives the outer step, and its state is checkpointed per parameter
    under the model's own names."""

    def job(comm: Comm, path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        def outer(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
            return torch.optim.Adam(ps, lr=0.01)

        strategy = sg.DiLoCo(period=2, comm=comm, outer_optimizer=outer)
        model = _model()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        mse_steps(strategy, model, opt, 4, _batch)
        strategy.save(path, model=model, optimizer=opt)
        st = strategy._find_prepared(model).state["outer_step"]
        before = [st.optimizer.state[q]["exp_avg"].clone() for q in st.prev]
        # A fresh strategy restores the outer Adam's moments.
        again = sg.DiLoCo(period=2, comm=comm, outer_optimizer=outer)
        model2 = _model()
        model2, opt2 = again.prepare(model2, torch.optim.SGD(model2.parameters(), lr=LR))
        again.restore(path, model=model2, optimizer=opt2)
        st2 = again._find_prepared(model2).state["outer_step"]
        after = [st2.optimizer.state[q]["exp_avg"].clone() for q in st2.prev]
        return before, after

    for before, after in run_ranks(job, 2, args=(str(tmp_path / "ckpt"),)):
        assert any(b.abs().sum() > 0 for b in before)
        for b, a in zip(before, after, strict=True):
            assert_close(a, b)


def test_outer_optimizer_must_own_the_outer_parameters() -> None:
    other = [torch.zeros(3, requires_grad=True)]

    def job(comm: Comm) -> None:
        strategy = sg.DiLoCo(period=2, comm=comm,
                             outer_optimizer=lambda ps: torch.optim.SGD(other, lr=0.1))
        model = _model()
        strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))

    with pytest.raises(ValueError, match="exactly the parameters it is given"):
        run_ranks(job, 2)


def test_diloco_compression_keyword_and_deprecated_alias() -> None:
    st = sg.DiLoCo(period=2, compression="bf16", comm=Comm.single())
    assert st.compression == "bf16"
    with pytest.warns(DeprecationWarning, match="compression="):
        old = sg.DiLoCo(period=2, pseudo_grad_dtype="bf16", comm=Comm.single())
    assert old.compression == "bf16"
    with pytest.raises(ValueError, match="compression must be"):
        sg.DiLoCo(period=2, compression="int2", comm=Comm.single())  # int8/int4 exist; int2 does not


# ---------------------------------------------------------------------- parts alone
def test_parameter_averaging_part_alone() -> None:
    def job(comm: Comm) -> list[float]:
        part = ParameterAveraging(comm, period=2)
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(float(comm.rank))
        prepared = sg.strategy.Prepared(model, model)
        seen = []
        for step in (1, 2):
            prepared.local_steps = step
            part.after_update(prepared)
            seen.append(model.weight.item())
        return seen

    assert run_ranks(job, 3) == [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]


def test_outer_step_part_alone_with_lr_1_is_an_average() -> None:
    def job(comm: Comm) -> float:
        part = OuterStep(comm, period=1,
                         outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(10.0)
        prepared = sg.strategy.Prepared(model, model)
        part.setup(prepared)
        with torch.no_grad():
            model.weight.fill_(float(comm.rank))
        prepared.local_steps = 1
        part.after_update(prepared)
        return model.weight.item()

    assert run_ranks(job, 3) == [1.0, 1.0, 1.0]


def test_gradient_sync_part_alone_averages_gradients() -> None:
    def job(comm: Comm) -> float:
        part = GradientSync(comm)
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        wrapped = part.wrap_model(model, model)
        x = torch.full((1, 1), float(comm.rank + 1))
        wrapped(x).sum().backward()
        return float(model.weight.grad.item())

    assert run_ranks(job, 2) == [1.5, 1.5]


def test_strategies_are_their_parts() -> None:
    one = Comm.single()
    assert [type(p) for p in sg.Mirrored(comm=one).parts] == [GradientSync]
    assert [type(p) for p in sg.LocalSGD(comm=one).parts] == [ParameterAveraging]
    assert [type(p) for p in sg.DiLoCo(comm=one).parts] == [OuterStep]
    assert sg.OneDevice().parts == []


def test_a_strategy_built_as_configuration_does_not_join_the_job(monkeypatch) -> None:
    """Inner/outer strategies of Hierarchical are configuration: building one must not join
    the process group the environment describes (the comm is joined on first use)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "1")  # would fail to connect if anything joined
    st = sg.Mirrored()
    assert st._comm is None
    copy.copy(st)


class _RefusingComm(Comm):
    """A world of one whose transaction never commits (a collective failed somewhere)."""

    def __init__(self) -> None:
        pass

    rank, world_size, fault_tolerant = 0, 1, True

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor.mul_(3.0)  # what a failed collective leaves is undefined

    def commit(self) -> bool:
        return False


def test_an_elastic_exchange_that_does_not_commit_changes_nothing() -> None:
    from stratagem.parts.elastic import elastic_exchange_, make_center

    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g).double()]
    groups = [[0], [1]]
    flats, _ = make_center(tensors, groups)
    for f in flats:
        f.add_(1.0)  # the center differs from the worker: an exchange would move both
    before = [t.clone() for t in tensors], [f.clone() for f in flats]
    assert not elastic_exchange_(_RefusingComm(), tensors, groups, flats, [True, True], 0.5)
    for now, then in zip([*tensors, *flats], [*before[0], *before[1]], strict=True):
        assert torch.equal(now, then)
    # The same exchange on a Comm that commits moves worker and center towards each other.
    assert elastic_exchange_(Comm.single(), tensors, groups, flats, [True, True], 0.5)
    assert not torch.equal(tensors[0], before[0][0])
    assert not torch.equal(flats[0], before[1][0])
