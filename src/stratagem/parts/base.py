"""The :class:`Part` protocol: the hooks a synchronisation part may implement, and the
capabilities a part brings to the strategy made of it.

The base ``Strategy`` calls the hooks of its parts in one order, the same for every
strategy (docs/architecture.md, "Hook order"):

- ``prepare``: ``starts_alone`` parts skip the start-up check and broadcast; ``wrap_model``
  (outermost last), ``setup`` once the replicas start equal, ``set_grad_sync``.
- every optimizer step at an accumulation boundary that is applied: ``before_update``,
  ``apply_update`` (the first part whose update rule applies the step; else the inner
  optimizer's ``step()``), ``after_update``.
- ``finalize`` at the end of training; ``consensus`` / ``saved_model`` / ``eval_model`` when
  the model to keep is asked for; ``load_model`` + ``loaded`` on restore; ``extra_state`` /
  ``load_extra_state`` and ``optimizer_state`` / ``load_optimizer_state`` for checkpoints;
  ``syncs_at`` / ``heal_state`` / ``load_heal_state`` for the fault-tolerance layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..comm import Comm

if TYPE_CHECKING:
    from ..strategy import Prepared, Strategy, StrategyOptimizer

__all__ = ["Part", "PartSpec", "Capability"]


class Capability:
    """What a part brings to the strategy made of it (strings, so a part may compute them
    from its configuration in :meth:`Part.capabilities`)."""

    #: Replicas take the same step decisions: the non-finite verdict is agreed across them.
    SYNCHRONOUS_STEP = "synchronous_step"
    #: Each replica keeps optimizer state of its own (checkpoints save one per rank).
    LOCAL_OPTIMIZER_STATE = "local_optimizer_state"
    #: Its collectives are transactions of the Comm (begin / commit), so it runs under
    #: ``fault_tolerant=True``.
    TRANSACTIONS = "transactions"
    #: Its step is the mean of every replica's gradient: ``keep_global_batch`` is exact.
    KEEPS_GLOBAL_BATCH = "keeps_global_batch"
    #: Each process holds a shard of the model, not the whole.
    SHARDS_MODEL = "shards_model"
    #: ``prepare`` accepts a model on the meta device (the part materialises it).
    MATERIALIZES_META = "materializes_meta"
    #: No collective at start-up: a (re)started worker joins a running job alone.
    STARTS_ALONE = "starts_alone"
    #: May be ``Hierarchical``'s inner layer (synchronises a node's processes every step).
    INNER = "inner"
    #: May be ``Hierarchical``'s outer layer (synchronises across nodes).
    OUTER = "outer"

    ALL = frozenset({SYNCHRONOUS_STEP, LOCAL_OPTIMIZER_STATE, TRANSACTIONS, KEEPS_GLOBAL_BATCH,
                     SHARDS_MODEL, MATERIALIZES_META, STARTS_ALONE, INNER, OUTER})


@dataclass(frozen=True)
class PartSpec:
    """A part to build later over a Comm: its class and configuration. What a strategy
    declares (``Strategy.plan``); its capabilities are known before any Comm exists."""

    cls: type[Part]
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def capabilities(self) -> frozenset[str]:
        return self.cls.capabilities(self.config)

    def build(self, comm: Comm) -> Part:
        return self.cls(comm, **self.config)


class Part:
    """One synchronisation mechanism over one :class:`~stratagem.comm.Comm`.

    ``replicated``: True when, after every optimizer step, each process's module already is
    the consensus model (so ``eval_model`` may return the module itself); parts that let
    replicas drift between synchronisations set it to False. ``provides``: the part's
    :class:`Capability` values (a part may refine them from its configuration by overriding
    :meth:`capabilities`).
    """

    #: Short name, used as the key of this part's state in a prepared model.
    name = "part"
    replicated = True
    provides: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.strategy: Strategy | None = None

    @classmethod
    def spec(cls, **config: Any) -> PartSpec:
        """This part with ``config`` (its keyword arguments besides the Comm), to build later."""
        return PartSpec(cls, dict(config))

    @classmethod
    def capabilities(cls, config: Mapping[str, Any]) -> frozenset[str]:
        """The capabilities of this part built with ``config``: :attr:`provides` by default."""
        return cls.provides

    def attach(self, strategy: Strategy) -> None:
        """Called once by the owning strategy (for its precision, device, timeout)."""
        self.strategy = strategy

    @property
    def owner(self) -> Strategy:
        """The strategy this part was attached to."""
        if self.strategy is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a strategy. Fix: "
                               "build it through a strategy's plan(), or call part.attach(s)")
        return self.strategy

    # ------------------------------------------------------------------ prepare
    def wrap_model(self, model: nn.Module, module: nn.Module) -> nn.Module:
        """Wrap the model the user will call (``module`` is the bare user module)."""
        return model

    def setup(self, prepared: Prepared) -> None:
        """Once per prepared model, after the replicas were made equal."""

    def set_grad_sync(self, prepared: Prepared, enabled: bool) -> None:
        """Whether the next backward should communicate gradients (accumulation)."""

    # ------------------------------------------------------------------ the step
    def before_update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        """Before an applied optimizer step (gradients final: unscaled, checked, clipped)."""

    def apply_update(self, prepared: Prepared, opt: StrategyOptimizer) -> bool:
        """The part's own update rule: apply the step and return True (a push to parameter
        servers, EAMSGD's momentum around the optimizer); False lets the next part, and in
        the end the inner optimizer's ``step()``, apply it."""
        return False

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

    def saved_model(self, prepared: Prepared) -> dict[str, torch.Tensor] | None:
        """The model tensors a checkpoint writes when they are not the consensus (a sharded
        part: its shards); None otherwise."""
        return None

    def eval_model(self, prepared: Prepared) -> nn.Module | None:
        """The module ``eval_model`` returns when the part keeps one itself (a view of the
        center, a refreshed copy of the global model); None otherwise."""
        return None

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

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        """This replica's state of ``opt`` for a checkpoint when the part holds it (a
        parameter server reads it from the shards); None otherwise."""
        return None

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """Load a checkpointed optimizer state the part's own way; True when it did."""
        return False

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
        """Counters for ``Strategy.metrics()``; traffic the part counted outside its Comm is
        folded into the Comm first."""
        return {}

    def close(self) -> None:
        """Release what the part holds (the Comm is closed by its owner)."""
