"""The one hook order: every strategy's parts are run by ``stratagem.parts.Parts`` in the
order docs/architecture.md states ("Hook order"). Each strategy's parts are instrumented,
a short job runs every public entry point once, and the hooks recorded for each entry point
must appear in the documented order (a hook may be absent: a part that answered first, or
a strategy without that step, e.g. no consensus for a replicated model).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.parts.base import Part
from stratagem.testing import run_ranks

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
HOOKS = [name for name in vars(Part) if not name.startswith("_") and callable(vars(Part)[name])
         and name not in ("spec", "capabilities", "attach")]


def documented_order() -> dict[str, list[str]]:
    """``entry: hook hook ...`` lines of the ```hook-order block in docs/architecture.md."""
    block = re.search(r"```hook-order\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/architecture.md has no ```hook-order block"
    order = {}
    for line in block.group(1).strip().splitlines():
        entry, _, hooks = line.partition(":")
        order[entry.strip()] = hooks.split()
    return order


def instrument(strategy: sg.Strategy) -> tuple[list[tuple[str, str]], list[str]]:
    """Record ``(entry, hook)`` for every hook call of the strategy's parts; ``entry[0]`` is
    the public entry point running."""
    calls: list[tuple[str, str]] = []
    entry = ["-"]
    for part in strategy.parts:
        depth = [0]  # a hook a part calls on itself (after_update -> syncs_at) is not the order
        for hook in HOOKS:
            original = getattr(part, hook)

            def recorded(*args: Any, _hook: str = hook, _original: Any = original,
                         _depth: list[int] = depth, **kw: Any) -> Any:
                if _depth[0] == 0:
                    calls.append((entry[0], _hook))
                _depth[0] += 1
                try:
                    return _original(*args, **kw)
                finally:
                    _depth[0] -= 1
            setattr(part, hook, recorded)
    return calls, entry


def job(strategy: sg.Strategy) -> list[tuple[str, str]]:
    calls, entry = instrument(strategy)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))

    def at(name: str, fn: Any, *args: Any) -> Any:
        entry[0] = name
        calls.append((name, ""))  # one call of the entry point starts here
        return fn(*args)

    model, opt = at("prepare", strategy.prepare, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        at("backward", strategy.backward, model(torch.randn(4, 6, generator=g)).pow(2).mean())
        at("step", opt.step)
        at("zero_grad", opt.zero_grad)
    at("finalize", strategy.finalize, model)
    kept = at("eval_model", strategy.eval_model, model)
    full = {k: v.detach().clone() for k, v in kept.state_dict().items()}  # whole tensors
    at("model_state", strategy.model_state, model)  # Sharded: its shards
    at("load_model_state", strategy.load_model_state, model, full)
    extra = at("strategy_state", strategy.strategy_state, model)
    at("load_strategy_state", strategy.load_strategy_state, model, extra)
    opt_state = at("optimizer_state", strategy.optimizer_state, opt)
    at("load_optimizer_state", strategy.load_optimizer_state, opt, opt_state)
    at("metrics", strategy.metrics)
    at("close", strategy.close)
    return calls


def check(calls: list[tuple[str, str]], name: str) -> None:
    order = documented_order()
    runs: list[tuple[str, list[str]]] = []
    for entry, hook in calls:
        if not hook:  # an entry point was called
            runs.append((entry, []))
            continue
        assert runs, f"{name}: {hook} ran outside any entry point"
        seq = runs[-1][1]
        if not seq or seq[-1] != hook:  # several parts: one hook, then the next
            seq.append(hook)
    for entry, seq in runs:
        assert entry in order, f"{name}: hooks ran in {entry!r}, which the doc does not list"
        expected = iter(order[entry])
        # ``seq`` is a subsequence of the documented order (each hook in its place).
        assert all(hook in expected for hook in seq), (
            f"{name}, {entry}: ran {seq}, docs/architecture.md says {order[entry]}")


THREADED = {
    "mirrored": lambda comm, addrs: sg.Mirrored(comm=comm),
    "local_sgd": lambda comm, addrs: sg.LocalSGD(comm=comm, period=2),
    "diloco": lambda comm, addrs: sg.DiLoCo(comm=comm, period=2),
    "easgd": lambda comm, addrs: sg.ElasticAveraging(comm=comm, period=2, momentum=0.5,
                                                     rho=0.1),
    "easgd_async": lambda comm, addrs: sg.ElasticAveraging(comm=comm, period=2, mode="async",
                                                           ps_addresses=addrs,
                                                           moving_rate=0.2),
    "ps_async": lambda comm, addrs: sg.ParameterServer(comm=comm, ps_addresses=addrs),
    "ps_sync": lambda comm, addrs: sg.ParameterServer(comm=comm, mode="sync",
                                                      ps_addresses=addrs),
    "hierarchical": lambda comm, addrs: sg.Hierarchical(comm=comm, outer="diloco",
                                                        outer_period=2),
}


@pytest.mark.filterwarnings("ignore:EAMSGD")
@pytest.mark.parametrize("name", sorted(THREADED))
def test_each_strategy_runs_its_parts_in_the_documented_order(name, shards):
    nnodes = 2 if name == "hierarchical" else 1
    results = run_ranks(lambda comm: job(THREADED[name](comm, shards)), 2 * nnodes,
                        nnodes=nnodes)
    for calls in results:
        check(calls, name)
    assert any(hook == "after_update" for _, hook in results[0])


def _sharded_job() -> list[tuple[str, str]]:
    return job(sg.Sharded())


def test_sharded_runs_its_part_in_the_documented_order():
    for calls in sg.launch(_sharded_job, nprocs=2, timeout=200):
        check(calls, "sharded")


def test_the_documented_order_names_only_part_hooks():
    for entry, hooks in documented_order().items():
        assert set(hooks) <= set(HOOKS), (entry, set(hooks) - set(HOOKS))
