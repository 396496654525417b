"""Strategy's public state protocol, the step-end hook, the feature registration, the default
strategy supplied by the registry, and the one strategy table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem import context, registry
from stratagem.comm import Comm
from stratagem.strategy import StrategyOptimizer, register_feature


def _setup(**kwargs):
    torch.manual_seed(0)
    s = sg.OneDevice(comm=Comm.single(), **kwargs)
    module = nn.Linear(3, 2)
    model, opt = s.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    return s, module, model, opt


def _step(s, model, opt, value=1.0):
    loss = model(torch.full((4, 3), value)).pow(2).sum()
    s.backward(loss)
    opt.step()
    opt.zero_grad()


def test_model_state_round_trip_and_unprepared_modules():
    s, module, model, opt = _setup()
    state = s.model_state(model)
    assert set(state) == {"weight", "bias"}
    assert all(not t.requires_grad for t in state.values())
    with torch.no_grad():
        module.weight.zero_()
    s.load_model_state(model, state)
    assert torch.equal(module.weight, state["weight"])
    plain = nn.Linear(3, 2)
    assert s.find_prepared(plain) is None
    s.load_model_state(plain, state)  # an unprepared module: load_state_dict
    assert torch.equal(plain.weight, module.weight)
    assert torch.equal(s.model_state(plain)["bias"], plain.bias)
    assert s.strategy_state(plain) == {} and s.local_steps(plain) == 0


def test_find_prepared_sees_through_a_later_torch_compile():
    s, module, model, _ = _setup()
    compiled = torch.compile(model)  # wraps; compiles only when called
    assert s.find_prepared(compiled) is s.find_prepared(module)
    assert s.find_prepared(compiled, exact=True) is None
    assert s.find_prepared(model, exact=True) is s.find_prepared(module)


def test_steps_local_steps_and_optimizer_state():
    s, module, model, opt = _setup()
    assert isinstance(opt, StrategyOptimizer) and opt.strategy is s
    assert opt.prepared is s.find_prepared(model)
    for _ in range(3):
        _step(s, model, opt)
    assert s.steps == 3 and s.local_steps(model) == 3
    s.set_local_steps(model, 7)
    assert s.local_steps(module) == 7
    s.steps = 5
    assert s.metrics()["steps"] == 5
    with pytest.raises(ValueError, match=r"steps must be an int >= 0, got -1"):
        s.steps = -1
    state = s.optimizer_state(opt)
    assert set(state) == {"state", "param_groups"}
    s.load_optimizer_state(opt, state)
    assert s.optimizer_state_is_local is False
    assert sg.LocalSGD(comm=Comm.single()).optimizer_state_is_local is True


def test_step_end_hooks_run_at_every_boundary_and_can_be_removed():
    s, _, model, opt = _setup(accumulation_steps=2, on_nonfinite="skip")
    seen: list[tuple[str, int]] = []
    first = s.add_step_end_hook(lambda o: seen.append(("a", s.steps)))
    s.add_step_end_hook(lambda o: seen.append(("b", s.steps)) if o is opt else None)
    _step(s, model, opt)  # micro-batch 1 of 2: no boundary
    assert seen == []
    _step(s, model, opt)
    assert seen == [("a", 1), ("b", 1)]
    _step(s, model, opt, float("nan"))
    _step(s, model, opt, float("nan"))  # a skipped step is a boundary too
    assert seen[-2:] == [("a", 1), ("b", 1)] and s.metrics()["skipped_steps"] == 1
    first.remove()
    _step(s, model, opt)
    _step(s, model, opt)
    assert seen[-1] == ("b", 2) and len(seen) == 5


def test_on_preemption_attaches_through_the_step_end_hook_and_replaces(tmp_path):
    s, _, model, opt = _setup()
    first = s.on_preemption(tmp_path / "a", model=model, optimizer=opt, exit=False)
    second = s.on_preemption(tmp_path / "b", model=model, optimizer=opt, exit=False)
    first.trigger()  # detached: its request is never acted on
    _step(s, model, opt)
    assert not first.saved and not second.saved
    second.trigger()
    _step(s, model, opt)
    assert second.saved and (tmp_path / "b").exists() and not (tmp_path / "a").exists()
    second.detach()


def test_feature_registration():
    with pytest.raises(ValueError, match="unknown feature 'nope'"):
        register_feature("nope", print)
    s, _, model, opt = _setup()
    calls = []
    from stratagem.checkpoint import save as real_save

    register_feature("save", lambda strategy, path, **state: calls.append((strategy, path)))
    try:
        s.save("somewhere", model=model)
    finally:
        register_feature("save", real_save)
    assert calls == [(s, "somewhere")]


def test_default_strategy_comes_from_the_registry():
    out: list[object] = []

    def in_thread(factory):
        context.set_default_strategy_factory(factory)
        try:
            out.append(sg.get_strategy())
        except RuntimeError as exc:
            out.append(exc)
        finally:
            context.set_default_strategy_factory(registry._default_strategy)

    for factory in (None, registry._default_strategy):
        t = threading.Thread(target=in_thread, args=(factory,))
        t.start()
        t.join(30)
    assert isinstance(out[0], RuntimeError) and "import stratagem" in str(out[0])
    assert isinstance(out[1], sg.OneDevice) and out[1].num_replicas_in_sync == 1


# ---------------------------------------------------------------------- one strategy table
def test_one_table_feeds_the_registry_and_the_lazy_exports():
    publics = [e for e in registry.STRATEGIES if e.public is not None]
    assert len({e.public for e in publics}) == len(publics)
    for entry in registry.STRATEGIES:
        installed = importlib.util.find_spec(entry.module) is not None
        assert (entry.name in sg.strategy_names()) == installed
        if entry.public is not None:
            assert (entry.public in sg.__all__) == installed
    for entry in publics:
        if registry.is_available(entry) and entry.module.endswith(("one_device", "mirrored",
                                                                    "local_sgd")):
            assert getattr(sg, entry.public) is registry.strategy_class(entry.name)
    names = {e.name for e in registry.STRATEGIES}
    assert {"hierarchical", "sharded"} <= names


def test_a_strategy_whose_module_is_missing_is_absent_not_an_error(monkeypatch):
    ghost = registry.StrategyEntry("Ghost", "ghost", "stratagem.strategies.no_such_ghost", "Ghost")
    monkeypatch.setattr(registry, "STRATEGIES", (*registry.STRATEGIES, ghost))
    monkeypatch.setitem(registry._BY_NAME, "ghost", ghost)
    assert not registry.is_available(ghost)
    assert "ghost" not in registry.strategy_names()
    assert "Ghost" not in registry.lazy_exports()
    with pytest.raises(ValueError, match="'ghost' is registered but its module "
                                         "stratagem.strategies.no_such_ghost is not installed"):
        registry.from_name("ghost")
    with pytest.raises(ValueError, match="'ghost' is registered"):
        registry.canonical_name("Ghost")  # what `stratagem run --strategy` checks up front
    with pytest.raises(ValueError, match="unknown strategy 'phantom'; valid names: diloco"):
        registry.from_name("phantom")


@pytest.mark.timeout(120)
def test_importing_stratagem_with_the_new_strategies_missing():
    code = ("import importlib.util, stratagem as sg\n"
            "for mod, pub, name in [('hierarchical', 'Hierarchical', 'hierarchical'),\n"
            "                       ('sharded', 'Sharded', 'sharded')]:\n"
            "    there = importlib.util.find_spec('stratagem.strategies.' + mod) is not None\n"
            "    assert (name in sg.strategy_names()) == there\n"
            "    assert hasattr(sg, pub) == there, pub\n"
            "    if not there:\n"
            "        try:\n"
            "            getattr(sg, pub)\n"
            "        except AttributeError as exc:\n"
            "            assert 'registered but stratagem.strategies.' in str(exc), exc\n"
            "from stratagem import *  # every name in __all__ resolves\n"
            "print(len(sg.strategy_names()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) >= 9
