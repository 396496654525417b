"""Periodic parameter averaging (local SGD): Lin, Stich, Patel, Jaggi, "Don't use large
mini-batches, use local SGD" (ICLR 2020), including its warm-up ("post-local SGD")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..comm import Comm
from .base import Capability, Part
from .tensors import (
    average_committed_,
    gather_ranks,
    like,
    load_rank,
    local,
    mean_copy,
    synced_tensors,
)

if TYPE_CHECKING:
    from ..strategy import Prepared

__all__ = ["ParameterAveraging"]


class ParameterAveraging(Part):
    """Replace the parameters and floating-point buffers by their mean over ``comm`` after
    every ``period``-th local step, and after every step while ``local_step <=
    warmup_steps``: one all-reduce per dtype. The consensus (checkpoint, ``eval_model``) is
    the mean the next average would produce — a collective. Each rank's local model goes in
    the extra state (exact resume with the same layout)."""

    name = "averaging"
    replicated = False
    provides = frozenset({Capability.SYNCHRONOUS_STEP, Capability.TRANSACTIONS,
                          Capability.LOCAL_OPTIMIZER_STATE, Capability.OUTER})

    def __init__(self, comm: Comm, *, period: int, warmup_steps: int = 0) -> None:
        super().__init__(comm)
        self.period = period
        self.warmup_steps = warmup_steps
        self.averages = 0

    def _tensors(self, prepared: Prepared) -> tuple[list[str], list[torch.Tensor]]:
        """Names and local views (the local shard of a sharded parameter)."""
        names, tensors, _ = synced_tensors(prepared.module, buffers=True)
        return names, [local(t) for t in tensors]

    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        return step <= self.warmup_steps or step % self.period == 0

    def after_update(self, prepared: Prepared) -> None:
        if self.syncs_at(prepared, prepared.local_steps):
            # Under a fault-tolerant Comm an average that failed is not applied: each replica
            # keeps its local model and the next average includes it.
            if average_committed_(self.comm, self._tensors(prepared)[1]):
                self.averages += 1

    def finalize(self, prepared: Prepared) -> None:
        """Average now (the average the next period would make); the schedule is unchanged."""
        if average_committed_(self.comm, self._tensors(prepared)[1]):
            self.averages += 1

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        _, originals, _ = synced_tensors(prepared.module, buffers=True)
        means = mean_copy(self.comm, [local(t) for t in originals])
        mean = {id(t): like(t, m) for t, m in zip(originals, means, strict=True)}
        return {k: mean.get(id(v), v) for k, v in state.items()}

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        names, tensors = self._tensors(prepared)
        return gather_ranks(self.comm, names, tensors, "local")

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        names, tensors = self._tensors(prepared)
        load_rank(state, "local", self.comm.rank, self.comm.world_size, names, tensors)

    def metrics(self) -> dict[str, Any]:
        return {"averages": self.averages}
