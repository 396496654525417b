"""The outer step of DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023), driven by a real ``torch.optim`` optimizer, as torchft does.

Every ``period`` local steps the pseudo-gradient ``delta = theta_prev - mean_i(theta_i)`` is
all-reduced over the Comm and handed to the outer optimizer as the gradient of the outer
parameters ``theta_prev`` (``theta_prev.grad = delta; outer_optimizer.step()``); the result
becomes every worker's parameters. The default outer optimizer is SGD with Nesterov momentum
(lr 0.7, momentum 0.9, the paper's values): ``m = mu m + delta``, ``theta_prev -= lr (delta +
mu m)``. ``fragments > 1`` is streaming DiLoCo (Douillard et al., "Streaming DiLoCo", 2025):
contiguous groups of parameters synchronised on staggered steps; parameters outside the
fragment being synchronised have no gradient, so the outer optimizer leaves them (and their
state) untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Comm, flatten, views
from ..compression import wire_dtype
from .base import Part
from .tensors import (
    average_committed_,
    dtype_groups,
    gather_ranks,
    like,
    load_rank,
    local,
    synced_tensors,
)

if TYPE_CHECKING:
    from ..strategy import Prepared

__all__ = ["OuterStep", "OuterOptimizerFactory", "split_fragments"]

#: ``params -> optimizer``: builds the outer optimizer over the outer parameters.
OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

#: The checkpoint key of SGD's momentum buffer (the name DiLoCo checkpoints have always used).
_MOMENTUM_KEY = "outer_momentum"


def split_fragments(params: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
    """Contiguous runs of parameter indices, each non-empty, with about equal numbers of
    elements (a tensor goes to the fragment its midpoint falls in)."""
    total = sum(p.numel() for p in params)
    out: list[list[int]] = [[] for _ in range(fragments)]
    k, seen = 0, 0
    for i, p in enumerate(params):
        if out[k] and k < fragments - 1 and (
                fragments - 1 - k >= len(params) - i  # the rest need every remaining tensor
                or (seen + p.numel() / 2) * fragments >= (k + 1) * total):
            k += 1
        out[k].append(i)
        seen += p.numel()
    return out


class _OuterState:
    """Per prepared model: the fragments, the outer parameters and the outer optimizer."""

    def __init__(self, names: list[str], params: list[torch.Tensor],
                 fragments: list[list[int]], factory: OuterOptimizerFactory) -> None:
        self.names = names
        self.originals = params  # the module's parameters (DTensors when sharded)
        self.params = [local(p) for p in params]  # what this process synchronises
        self.fragments = fragments
        with torch.no_grad():
            self.prev = [p.detach().clone() for p in self.params]
        optimizer = factory(self.prev)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must build a torch.optim.Optimizer from the outer "
                            f"parameters, got {type(optimizer).__name__}. Fix: pass e.g. "
                            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, "
                            "momentum=0.9, nesterov=True)")
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if owned != {id(p) for p in self.prev}:
            raise ValueError("outer_optimizer must optimize exactly the parameters it is given "
                             "(the outer copies), got an optimizer over other tensors. Fix: "
                             "build it from the list passed to the factory")
        self.optimizer = optimizer


class OuterStep(Part):
    """DiLoCo's outer step over ``comm`` (see the module docstring).

    ``outer_optimizer`` is a factory ``params -> torch.optim.Optimizer`` (default: SGD,
    ``lr=outer_lr``, Nesterov momentum ``outer_momentum``; plain SGD when it is 0).
    ``compression`` ("bf16", "fp16" or None) is the pseudo-gradient's dtype on the wire.
    Floating-point buffers are averaged when fragment 0 syncs. The consensus (checkpoint,
    ``eval_model``) is ``theta_prev`` — not a collective. Memory: two extra copies of the
    parameters with the default optimizer (``theta_prev`` and the momentum), plus a transient
    flat buffer the size of the fragment being synced.
    """

    name = "outer_step"
    replicated = False

    def __init__(self, comm: Comm, *, period: int, outer_optimizer: OuterOptimizerFactory,
                 fragments: int = 1, compression: str | None = None) -> None:
        super().__init__(comm)
        self.period = period
        self.fragments = fragments
        self.factory = outer_optimizer
        self.wire = wire_dtype(compression)
        self.offsets = [k * period // fragments for k in range(fragments)]
        self.outer_steps = 0

    def setup(self, prepared: Prepared) -> None:
        names, params, _ = synced_tensors(prepared.module, buffers=False)
        if self.fragments > len(params):
            raise ValueError(f"fragments must be <= the number of parameter tensors "
                             f"({len(params)}), got fragments={self.fragments}. Fix: lower "
                             "fragments")
        prepared.state[self.name] = _OuterState(names, params,
                                                split_fragments(params, self.fragments),
                                                self.factory)

    def _state(self, prepared: Prepared) -> _OuterState:
        st: _OuterState = prepared.state[self.name]
        return st

    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        return step % self.period in self.offsets

    def after_update(self, prepared: Prepared) -> None:
        phase = prepared.local_steps % self.period
        for k, offset in enumerate(self.offsets):
            if offset == phase:
                buffers = ([b for b in prepared.module.buffers() if b.is_floating_point()]
                           if k == 0 else [])
                self.step(self._state(prepared), k, buffers)

    def step(self, st: _OuterState, k: int, buffers: Sequence[torch.Tensor] = ()) -> None:
        """One outer step on fragment ``k``: all-reduce its pseudo-gradient, step the outer
        optimizer, set the workers' parameters to the result; ``buffers`` are averaged in the
        same transaction. Under a fault-tolerant Comm a failed all-reduce applies nothing:
        the workers keep their local parameters and the next outer step of the fragment
        carries the whole drift since ``theta_prev``."""
        idx = st.fragments[k]
        self.comm.begin()
        reduced = []
        with torch.no_grad():
            for group in dtype_groups([st.params[i] for i in idx]):
                members = [idx[j] for j in group]
                params = [st.params[i] for i in members]
                delta = flatten([st.prev[i] for i in members]).sub_(flatten(params))
                if self.wire is not None and delta.dtype != self.wire:
                    delta.copy_(self.comm.all_reduce(delta.to(self.wire)))
                else:
                    self.comm.all_reduce(delta)
                reduced.append((members, params, delta))
        if not average_committed_(self.comm, list(buffers)):
            return
        world = self.comm.world_size
        with torch.no_grad():
            for members, params, delta in reduced:
                delta.div_(world)
                for i, d in zip(members, views(delta, params), strict=True):
                    st.prev[i].grad = d
        st.optimizer.step()
        with torch.no_grad():
            for i in idx:
                st.prev[i].grad = None
                st.params[i].copy_(st.prev[i])
        self.outer_steps += 1

    def finalize(self, prepared: Prepared) -> None:
        """Replace the outer parameters by the plain average of the workers' current
        parameters and set every worker to it (floating-point buffers are averaged too).

        An outer step with lr 1 and no momentum on the pending pseudo-gradient of every
        fragment: the consensus then includes every inner step, which an outer optimizer step
        would not (it extrapolates a pseudo-gradient of a period that may be incomplete). The
        outer optimizer's state is left as it is, so training may continue. Calling it twice
        changes nothing (the workers are equal)."""
        st = self._state(prepared)
        average_committed_(self.comm, st.params)
        average_committed_(self.comm, [b for b in prepared.module.buffers()
                                       if b.is_floating_point()])
        with torch.no_grad():
            for p, q in zip(st.params, st.prev, strict=True):
                q.copy_(p)

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        outer = {id(p): like(p, q) for p, q in zip(st.originals, st.prev, strict=True)}
        return {k: outer.get(id(v), v) for k, v in state.items()}

    def loaded(self, prepared: Prepared) -> None:
        st = self._state(prepared)
        with torch.no_grad():
            for p, q in zip(st.params, st.prev, strict=True):
                q.copy_(p)

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        out = gather_ranks(self.comm, st.names, st.params, "local")
        for n, q in zip(st.names, st.prev, strict=True):
            for key, value in st.optimizer.state.get(q, {}).items():
                if isinstance(value, torch.Tensor):
                    name = _MOMENTUM_KEY if key == "momentum_buffer" else f"outer_{key}"
                    out[f"{name}/{n}"] = value
        return out

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st = self._state(prepared)
        outer = dict(zip(st.names, st.prev, strict=True))
        momentum = _uses_momentum(st.optimizer)
        with torch.no_grad():
            for key, saved in state.items():
                head, _, name = key.partition("/")
                q = outer.get(name)
                if q is None or not head.startswith("outer_") or (
                        saved.dim() > 0 and saved.shape != q.shape):
                    continue
                if head == _MOMENTUM_KEY:
                    if momentum:
                        st.optimizer.state[q]["momentum_buffer"] = saved.clone()
                else:
                    st.optimizer.state[q][head[len("outer_"):]] = saved.clone()
        load_rank(state, "local", self.comm.rank, self.comm.world_size, st.names, st.params)

    def heal_state(self, prepared: Prepared) -> dict[str, Any]:
        st = self._state(prepared)
        return {"prev": {n: q.detach() for n, q in zip(st.names, st.prev, strict=True)},
                "optimizer": st.optimizer.state_dict(), "outer_steps": self.outer_steps}

    def load_heal_state(self, prepared: Prepared, state: dict[str, Any]) -> None:
        st = self._state(prepared)
        with torch.no_grad():
            for n, q in zip(st.names, st.prev, strict=True):
                q.copy_(state["prev"][n])
        st.optimizer.load_state_dict(state["optimizer"])
        self.outer_steps = int(state["outer_steps"])

    def metrics(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps}


def _uses_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return any(float(g.get("momentum", 0.0) or 0.0) > 0 for g in optimizer.param_groups)
