"""What ``Strategy.prepare`` makes of a model: :class:`Prepared` (the wrapped model, the
user's module, the strategy's per-model state) and :class:`StrategyOptimizer` (the optimizer
whose ``step()`` runs the strategy's step)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .parts.base import Part
    from .precision import Precision
    from .step import StepControl

__all__ = ["Prepared", "PreparedModels", "StrategyOptimizer", "uncompiled", "autocast_forward",
           "eval_copy", "default_device"]


def default_device() -> torch.device:
    """This worker's CUDA device (``LOCAL_RANK`` modulo the devices), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def uncompiled(module: nn.Module) -> nn.Module:
    """The module behind ``torch.compile``'s ``OptimizedModule`` wrappers (``_orig_mod``)."""
    while type(module).__name__ == "OptimizedModule":
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        module = inner
    return module


class Prepared:
    """What ``prepare`` made of one model: the wrapped model, the bare module (names as the
    user defined them; the module behind ``torch.compile``), the wrapped optimizers, and a
    dict the strategy's parts keep state in. ``given`` is the object passed to ``prepare``
    (a ``torch.compile`` wrapper, or the module itself); ``index`` its position among the
    strategy's prepared models."""

    def __init__(self, model: nn.Module, module: nn.Module, given: nn.Module | None = None,
                 index: int = 0) -> None:
        self.model = model
        self.module = module
        self.given = given if given is not None else module
        self.index = index
        self.optimizers: list[StrategyOptimizer] = []
        self.state: dict[str, Any] = {}
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        self.local_steps = 0


class PreparedModels(list[Prepared]):
    """The models one strategy prepared, in order, found by any of their names."""

    def find(self, model: nn.Module, *, exact: bool = True) -> Prepared | None:
        """The record of ``model`` (as ``prepare`` returned it, the user's module, or the
        object given to ``prepare``), or None; unless ``exact``, ``torch.compile`` wrappers
        applied after ``prepare`` are seen through."""
        for _ in range(8):
            prepared = next((p for p in self if model is p.model or model is p.module
                             or model is p.given), None)
            inner = getattr(model, "_orig_mod", None)
            if prepared is not None or exact or not isinstance(inner, nn.Module):
                return prepared
            model = inner
        return None

    def require(self, model: nn.Module, what: str) -> Prepared:
        prepared = self.find(model)
        if prepared is None:
            raise ValueError(f"{what} needs a model prepared by this strategy, got a "
                             f"{type(model).__name__} it did not prepare. Fix: pass the model "
                             "that strategy.prepare(model, optimizer) returned")
        return prepared


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare`` returns: ``step()`` runs the strategy's step; ``zero_grad()``
    is skipped between the micro-batches of one accumulated step. Everything else (param
    groups, state, LR schedulers) is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, prepared: Prepared,
                 control: StepControl, on_step: Callable[[StrategyOptimizer], None],
                 strategy: Any = None) -> None:
        # Deliberately not calling Optimizer.__init__: the param groups and state are shared
        # with the wrapped optimizer, not copied.
        self.optimizer = optimizer
        self._prepared = prepared
        self._control = control
        self._on_step = on_step
        self._strategy = strategy
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def strategy(self) -> Any:
        """The strategy that prepared this optimizer."""
        return self._strategy

    @property
    def prepared(self) -> Prepared:
        """The ``Prepared`` record of the model this optimizer trains."""
        return self._prepared

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise TypeError("a closure is not supported by strategy optimizers: call "
                            "strategy.backward(loss) then optimizer.step()")
        return self._on_step(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._control.accumulating():
            return
        self._control.end_accumulation()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({type(self._strategy).__name__}, {self.optimizer!r})"


def autocast_forward(module: nn.Module, precision: Precision) -> Callable[..., Any]:
    """``module.forward`` run in autocast. Plain ``torch.autocast`` (not ``Autocast``) so
    that ``torch.compile`` traces it without a graph break."""
    forward = module.forward
    device_type, dtype = precision.device_type, precision.dtype

    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    forward_in_autocast._stratagem_autocast = True  # type: ignore[attr-defined]
    return forward_in_autocast


def eval_copy(prepared: Prepared, parts: Sequence[Part], precision: Precision) -> nn.Module:
    """A copy of the user's module for ``eval_model`` (made once, then reused): the user's
    class, gradients off, its forward its own (a deep copy would keep the autocast wrapper
    bound to the *original* module, i.e. evaluate the local model), run in autocast like the
    prepared model under bf16/fp16. The caller fills in the values."""
    clone: nn.Module | None = prepared.state.get("_eval_copy")
    if clone is not None:
        return clone
    clone = next((m for m in (part.eval_module(prepared) for part in parts)
                  if m is not None), None) or copy.deepcopy(prepared.module)
    if getattr(clone.__dict__.get("forward"), "_stratagem_autocast", False):
        del clone.__dict__["forward"]
    clone.requires_grad_(False)
    for p in clone.parameters():
        p.grad = None
    if precision.dtype is not None:
        clone.forward = autocast_forward(clone, precision)  # type: ignore[method-assign]
    prepared.state["_eval_copy"] = clone
    return clone
