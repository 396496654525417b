"""The synchronous elastic exchange of EASGD (Zhang, Choromanska, LeCun, "Deep learning with
Elastic Averaging SGD", NeurIPS 2015, Algorithm 1 with the center replicated on every worker).

Every ``period`` local steps each worker exchanges with the center ``x~``::

    d_i = x_i - x~;    x_i -= moving_rate * d_i;    x~ += moving_rate * sum_i d_i

all exchanges of a round applied together (one all-reduce of the ``d_i`` per dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Comm, flatten, views
from .base import Capability, Part
from .tensors import dtype_groups, gather_ranks, load_rank, synced_tensors

if TYPE_CHECKING:
    from ..strategy import Prepared

__all__ = ["ElasticExchange", "center_state", "default_moving_rate", "elastic_exchange_", "load_center",
           "make_center"]


def make_center(tensors: Sequence[torch.Tensor], groups: list[list[int]]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The center as one flat buffer per dtype group (a copy of ``tensors``) and one view per
    tensor into it."""
    flats: list[torch.Tensor] = []
    center: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for idx in groups:
        group = [tensors[i] for i in idx]
        flat = flatten(group)  # a new buffer: the center starts at the current model
        flats.append(flat)
        for i, v in zip(idx, views(flat, group), strict=True):
            center[i] = v
    return flats, center


def elastic_exchange_(comm: Comm, tensors: Sequence[torch.Tensor], groups: list[list[int]],
                      center_flats: Sequence[torch.Tensor], pull: Sequence[bool],
                      moving_rate: float) -> bool:
    """One synchronous round: ``x~ += a * sum_i d_i`` and ``x_i -= a * d_i`` for the tensors
    with ``pull[i]`` (the penalty form of EASGD pulls parameters through the gradient
    instead, so it passes False for them).

    One transaction of ``comm``: the sums are all-reduced first and nothing changes unless
    the transaction commits (a fault-tolerant Comm whose collective failed leaves workers and
    center as they were and returns False; the next exchange includes what this one would
    have moved). On a plain Comm it always commits, bitwise as an exchange that pulls
    before it reduces: ``x_i - c`` is the same number computed either way."""
    a = moving_rate
    comm.begin()
    with torch.no_grad():
        sums = []
        for idx, center in zip(groups, center_flats, strict=True):
            group = [tensors[i] for i in idx]
            sums.append(comm.all_reduce(flatten(group).sub_(center)))  # sum_i d_i per dtype
        if not comm.commit():
            return False
        for idx, center, total in zip(groups, center_flats, sums, strict=True):
            group = [tensors[i] for i in idx]
            for i, t, c in zip(idx, group, views(center, group), strict=True):
                if pull[i]:
                    t.sub_(t - c, alpha=a)  # before the center moves: d_i = x_i - x~
            center.add_(total, alpha=a)
    return True


def load_center(names: Sequence[str], center: Sequence[torch.Tensor],
                saved: dict[str, torch.Tensor]) -> None:
    """Copy a live peer's center (a heal) into ``center``, tensor by tensor."""
    with torch.no_grad():
        for n, c in zip(names, center, strict=True):
            c.copy_(saved[n])


def center_state(names: Sequence[str], center: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The center under the model's own names (what a heal sends; :func:`load_center`)."""
    return {n: c.detach() for n, c in zip(names, center, strict=True)}


class _ElasticPartState:
    def __init__(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.names = names
        self.tensors = tensors
        self.groups = dtype_groups(tensors)
        self.center_flats, self.center = make_center(tensors, self.groups)
        self.exchanged_at = 0


def default_moving_rate(beta: float, period: int, workers: int) -> float:
    """``beta / (period * workers)``, the paper's ``beta = p * alpha`` spread over a round;
    ``ValueError`` when above 1."""
    rate = beta / (period * workers)
    if rate > 1.0:
        raise ValueError(
            f"the default moving_rate = beta / (period * num_workers) = {beta:g} / "
            f"({period} * {workers}) = {rate:g} is above 1. Fix: lower beta, or "
            "pass moving_rate in (0, 1]")
    return rate


class ElasticExchange(Part):
    """EASGD's synchronous elastic exchange over ``comm`` every ``period`` local steps (see
    the module docstring), parameters and (``average_buffers``) floating-point buffers. The
    consensus (checkpoint, ``eval_model``) is the center — not a collective. Memory: one extra
    copy of the parameters (the center) plus a transient flat buffer per exchange."""

    name = "elastic_exchange"
    replicated = False
    provides = frozenset({Capability.SYNCHRONOUS_STEP, Capability.TRANSACTIONS,
                          Capability.LOCAL_OPTIMIZER_STATE, Capability.OUTER})

    def __init__(self, comm: Comm, *, period: int, moving_rate: float | None,
                 beta: float = 0.9, average_buffers: bool = True) -> None:
        super().__init__(comm)
        self.period = period
        if moving_rate is None:  # the paper's default over this Comm's workers
            moving_rate = default_moving_rate(beta, period, comm.world_size)
        self.moving_rate = moving_rate
        self.average_buffers = average_buffers
        self.exchanges = 0

    def setup(self, prepared: Prepared) -> None:
        names, tensors, _ = synced_tensors(prepared.module, self.average_buffers)
        prepared.state[self.name] = _ElasticPartState(names, tensors)

    def _state(self, prepared: Prepared) -> _ElasticPartState:
        st: _ElasticPartState = prepared.state[self.name]
        return st

    def _exchange(self, st: _ElasticPartState) -> None:
        if elastic_exchange_(self.comm, st.tensors, st.groups, st.center_flats,
                             [True] * len(st.tensors), self.moving_rate):
            self.exchanges += 1

    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        return step % self.period == 0

    def after_update(self, prepared: Prepared) -> None:
        if self.syncs_at(prepared, prepared.local_steps):
            st = self._state(prepared)
            self._exchange(st)
            st.exchanged_at = prepared.local_steps

    def finalize(self, prepared: Prepared) -> None:
        """A last exchange when local steps were taken since the previous one."""
        st = self._state(prepared)
        if prepared.local_steps != st.exchanged_at:
            self._exchange(st)
            st.exchanged_at = prepared.local_steps

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        center = {id(t): c for t, c in zip(st.tensors, st.center, strict=True)}
        return {k: center.get(id(v), v) for k, v in state.items()}

    def loaded(self, prepared: Prepared) -> None:
        st = self._state(prepared)
        with torch.no_grad():
            for t, c in zip(st.tensors, st.center, strict=True):
                c.copy_(t)

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        return gather_ranks(self.comm, st.names, st.tensors, "local")

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st = self._state(prepared)
        load_rank(state, "local", self.comm.rank, self.comm.world_size, st.names, st.tensors)

    def heal_state(self, prepared: Prepared) -> dict[str, Any]:
        st = self._state(prepared)
        return {"center": center_state(st.names, st.center),
                "exchanged_at": st.exchanged_at, "exchanges": self.exchanges}

    def load_heal_state(self, prepared: Prepared, state: dict[str, Any]) -> None:
        st = self._state(prepared)
        load_center(st.names, st.center, state["center"])
        st.exchanged_at = int(state["exchanged_at"])
        self.exchanges = int(state["exchanges"])

    def metrics(self) -> dict[str, Any]:
        return {"exchanges": self.exchanges, "moving_rate": self.moving_rate}
