"""The :class:`Part` protocol: the hooks a synchronisation part may implement.

The owning strategy calls them from its own hooks, in the order of its parts (see
``stratagem.strategy``): ``wrap_model`` at ``prepare`` (outermost last), ``setup`` once the
replicas start equal, ``set_grad_sync`` around gradient accumulation, ``after_update`` after
every real optimizer step, ``finalize`` at the end of training, ``consensus`` when the model
to keep is asked for (checkpoint, ``eval_model``), ``loaded`` after a checkpoint was loaded,
``extra_state`` / ``load_extra_state`` for the part's own checkpointed tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import Comm

if TYPE_CHECKING:
    from ..strategy import Prepared, Strategy

__all__ = ["Part"]


class Part:
    """One synchronisation mechanism over one :class:`~stratagem.comm.Comm`.

    ``replicated``: True when, after every optimizer step, each process's module already is
    the consensus model (so ``eval_model`` may return the module itself); parts that let
    replicas drift between synchronisations set it to False.
    """

    #: Short name, used as the key of this part's state in a prepared model.
    name = "part"
    replicated = True

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.strategy: Strategy | None = None

    def attach(self, strategy: Strategy) -> None:
        """Called once by the owning strategy (for its precision and device)."""
        self.strategy = strategy

    # ------------------------------------------------------------------ training
    def wrap_model(self, model: nn.Module, module: nn.Module) -> nn.Module:
        """Wrap the model the user will call (``module`` is the bare user module)."""
        return model

    def setup(self, prepared: Prepared) -> None:
        """Once per prepared model, after the replicas were made equal."""

    def set_grad_sync(self, prepared: Prepared, enabled: bool) -> None:
        """Whether the next backward should communicate gradients (accumulation)."""

    def after_update(self, prepared: Prepared) -> None:
        """After every real (non-skipped) optimizer step; ``prepared.local_steps`` counts it."""

    def finalize(self, prepared: Prepared) -> None:
        """One last synchronisation (see ``Strategy.finalize``)."""

    # ------------------------------------------------------------------ the model to keep
    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        """``state`` (the module's ``state_dict(keep_vars=True)`` so far) with the values this
        part keeps as the consensus (an average, the outer parameters), matched by tensor
        identity so tied weights follow. May be a collective."""
        return state

    def load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> bool:
        """Load a whole (unsharded) model state into the module if this part must do it its
        own way (a sharded module takes its rows); True when it did."""
        return False

    def eval_module(self, prepared: Prepared) -> nn.Module | None:
        """A fresh module of the user's class to hold the consensus for ``eval_model``, when a
        copy of the prepared module will not do (a sharded module); None otherwise."""
        return None

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor | None:
        """The total norm of gradients this part spreads over its Comm (sharded gradients);
        None when the local gradients are whole."""
        return None

    def loaded(self, prepared: Prepared) -> None:
        """The module was just loaded from a checkpoint: reset what derives from it."""

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint besides the model (outer momentum, per-rank local models)."""
        return {}

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        """Restore what ``extra_state`` returned (keys may be missing: another strategy or
        another layout wrote the checkpoint)."""

    # ------------------------------------------------------------------ fault tolerance
    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        """Whether ``after_update`` of local step ``step`` (or the backward before it) runs a
        collective: a fault-tolerant Comm forms its quorum before such a step."""
        return False

    def heal_state(self, prepared: Prepared) -> dict[str, Any]:
        """This replica's state of the part, for a replica joining a fault-tolerant job (a
        tree of tensors and JSON values; not a collective). The module's own tensors travel
        separately."""
        return {}

    def load_heal_state(self, prepared: Prepared, state: dict[str, Any]) -> None:
        """Load what a live peer's :meth:`heal_state` returned."""

    def metrics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Release what the part holds (the Comm is closed by its owner)."""
