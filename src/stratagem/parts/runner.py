""":class:`Parts`: a strategy's parts, and the one order in which their hooks run.

Every strategy runs its parts through this list, so the order below is true for all of them
(docs/architecture.md, "Hook order"; ``tests/test_hook_order.py`` records it):

1. ``prepare``: ``wrap_model`` (in order: the outermost wrapper last), ``setup``,
   ``set_grad_sync``.
2. an applied step: ``before_update``, ``apply_update`` (the first part whose update rule
   applies the step; else the inner optimizer's ``step()``), ``after_update``.
3. ``finalize`` at the end of training.
4. the model to keep: ``eval_model`` (a part's own module), else ``consensus`` (outermost
   part first); a checkpoint writes a part's ``saved_model`` or the consensus;
   ``load_model`` then ``loaded`` on restore; ``extra_state`` / ``load_extra_state``;
   ``optimizer_state`` / ``load_optimizer_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import Part

if TYPE_CHECKING:
    from ..prepared import Prepared, StrategyOptimizer

__all__ = ["Parts"]


class Parts(list[Part]):
    """The parts of one strategy, in order, with the hooks run over all of them."""

    def wrap_model(self, model: nn.Module, module: nn.Module) -> nn.Module:
        for part in self:
            model = part.wrap_model(model, module)
        return model

    def setup(self, prepared: Prepared) -> None:
        for part in self:
            part.setup(prepared)

    def set_grad_sync(self, prepared: Prepared, enabled: bool) -> None:
        for part in self:
            part.set_grad_sync(prepared, enabled)

    def update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        """An applied optimizer step: ``before_update``, the update rule, and (after the
        caller's counters) nothing else — :meth:`after_update` runs separately, once the step
        is counted."""
        for part in self:
            part.before_update(prepared, opt)
        if not any(part.apply_update(prepared, opt) for part in self):
            opt.optimizer.step()

    def after_update(self, prepared: Prepared) -> None:
        for part in self:
            part.after_update(prepared)

    def finalize(self, prepared: Prepared) -> None:
        for part in self:
            part.finalize(prepared)

    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        return any(part.syncs_at(prepared, step) for part in self)

    # ------------------------------------------------------------------ the model to keep
    def consensus(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        state = prepared.module.state_dict(keep_vars=True)
        # Outermost part first: it picks the values to keep (the outer parameters, an
        # average); an inner part then turns them into whole tensors (a sharded inner part
        # gathers its shards).
        for part in reversed(self):
            state = part.consensus(prepared, state)
        return {k: v.detach() for k, v in state.items()}

    def saved_model(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """What a checkpoint writes: a part's own ``saved_model`` (shards), else the consensus."""
        for part in self:
            saved = part.saved_model(prepared)
            if saved is not None:
                return saved
        return self.consensus(prepared)

    def eval_model(self, prepared: Prepared, copy: Any) -> nn.Module:
        """A part's own module, else the module itself when every part keeps replicas equal,
        else ``copy(prepared)`` loaded with the consensus."""
        for part in self:
            kept = part.eval_model(prepared)
            if kept is not None:
                return kept
        if all(part.replicated for part in self):
            return prepared.module
        module: nn.Module = copy(prepared)
        with torch.no_grad():
            module.load_state_dict(self.consensus(prepared))
        return module

    def load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        if not any(part.load_model(prepared, state) for part in self):
            prepared.module.load_state_dict(state)
        for part in self:
            part.loaded(prepared)

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self:
            out.update(part.extra_state(prepared))
        return out

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        for part in self:
            part.load_extra_state(prepared, state)

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        for part in self:
            held = part.optimizer_state(opt)
            if held is not None:
                return held
        return opt.state_dict()

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if not any(part.load_optimizer_state(opt, state) for part in self):
            opt.load_state_dict(state)

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float,
                  device: torch.device) -> torch.Tensor:
        """The total norm as the step will see the gradients: a sharded part's global norm,
        else this replica's own gradients'."""
        for part in self:
            norm = part.grad_norm(grads, norm_type)
            if norm is not None:
                return norm
        dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        if not dense:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(dense, norm_type=norm_type).float()

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self:
            out.update(part.metrics())
        return out

    def close(self) -> None:
        for part in self:
            part.close()
