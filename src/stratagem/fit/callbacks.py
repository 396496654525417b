"""``fit``'s callbacks: the context they see and the three built-in ones.

:class:`Callback` hooks run on every replica in the same order (so a hook may call
collectives); :class:`ModelCheckpoint` saves a resumable checkpoint, :class:`EarlyStopping`
stops on a monitored value, :class:`LearningRateScheduler` drives an LR schedule per epoch or
per step.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..data import DistributedLoader
from ..strategy import Strategy
from ..validation import check_choice, check_int, check_number

if TYPE_CHECKING:
    pass

# ---------------------------------------------------------------------- context & callbacks
@dataclass
class FitContext:
    """What a callback can see and use during ``fit``; ``callback.context`` once training
    begins. ``model`` and ``optimizer`` are the prepared (wrapped) ones."""

    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DistributedLoader
    checkpoint_dir: str | None
    epoch: int = 0
    step: int = 0
    history: dict[str, list[float]] = field(default_factory=dict)
    #: Set by ``fit`` after the epoch's logs are final; checkpoints taken in ``on_epoch_end``
    #: then resume at the next epoch rather than repeating this one.
    epoch_done: bool = False
    #: The callbacks of this ``fit`` call (a checkpoint stores their state).
    callbacks: list[Callback] = field(default_factory=list)


class Callback:
    """Base class of ``fit`` callbacks; override the hooks you need (all are no-ops here).

    Hooks run on every replica in the same order, so a hook may call collectives (e.g.
    ``strategy.save``). ``logs`` values are Python floats; in ``on_epoch_end`` they are
    already reduced across replicas (identical everywhere). Setting ``self.stop_training =
    True`` ends training after the current epoch; ``fit`` agrees on it across replicas (one
    replica asking is enough). A callback whose state must survive a resume implements
    ``state_dict()`` (JSON-able) and ``load_state_dict(state)``.
    """

    stop_training: bool = False
    context: FitContext | None = None

    def set_context(self, context: FitContext) -> None:
        self.context = context

    def on_train_begin(self, logs: dict[str, float]) -> None:
        """Before the first step (after a resume, with the restored state)."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, float]) -> None:
        """Before the first step of ``epoch`` (0-based)."""

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        """After optimizer step ``step`` (1-based, counted across epochs); ``logs["loss"]`` is
        this replica's loss of the last micro-batch."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """After ``epoch`` and its evaluation; ``logs`` holds the epoch's history row."""

    def on_train_end(self, logs: dict[str, float]) -> None:
        """After the last epoch (or an early stop)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def _ctx(cb: Callback) -> FitContext:
    if cb.context is None:
        raise RuntimeError(f"{type(cb).__name__} is used outside fit(): pass it in "
                           "fit(..., callbacks=[...]) so it gets a context")
    return cb.context


class ModelCheckpoint(Callback):
    """Save a resumable checkpoint with ``strategy.save`` every ``every_n_epochs`` epochs
    and/or every ``every_n_steps`` optimizer steps.

    ``path`` defaults to ``fit``'s ``checkpoint_dir``. The checkpoint holds the model, the
    optimizer, the loader position, the step, and the history and callback state under the
    ``"fit"`` extra, so ``fit(..., checkpoint_dir=path)`` continues exactly where it stopped.
    On failure: ``strategy.save`` raises ``CheckpointError`` on every replica (the previous
    checkpoint at ``path`` stays intact).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 every_n_steps: int | None = None, every_n_epochs: int | None = 1) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None:
                check_int(name, value, minimum=1, fix=f"pass None (never) or e.g. {name}=1")
        if every_n_steps is None and every_n_epochs is None:
            raise ValueError("ModelCheckpoint with every_n_steps=None and every_n_epochs=None "
                             "would never save; set at least one of them")
        self.path = os.fspath(path) if path is not None else None
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.saves = 0

    def on_train_begin(self, logs: dict[str, float]) -> None:
        ctx = _ctx(self)
        if self.path is None:
            if ctx.checkpoint_dir is None:
                raise ValueError("ModelCheckpoint() has no path: pass ModelCheckpoint(path) or "
                                 "fit(..., checkpoint_dir=...)")
            self.path = ctx.checkpoint_dir

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            self.save()

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if self.every_n_epochs is not None and (epoch + 1) % self.every_n_epochs == 0:
            self.save()

    def save(self) -> None:
        """Write the checkpoint now (a collective: every replica calls it)."""
        ctx = _ctx(self)
        assert self.path is not None  # set in on_train_begin
        state = {
            "epoch": ctx.epoch, "epoch_done": ctx.epoch_done, "step": ctx.step,
            "step_in_epoch": int(ctx.loader.state_dict()["step_in_epoch"]),
            "history": ctx.history,
            "callbacks": [_jsonable_state(cb) for cb in ctx.callbacks],
        }
        ctx.strategy.save(self.path, model=ctx.model, optimizer=ctx.optimizer, loader=ctx.loader,
                          step=ctx.step, fit=state)
        self.saves += 1


class EarlyStopping(Callback):
    """Stop when ``monitor`` (a key of the epoch logs, e.g. ``"val_loss"``, ``"loss"``,
    ``"val_accuracy"``) has not improved by more than ``min_delta`` for ``patience`` epochs.

    The monitored value is reduced across replicas before this runs, so the decision is the
    same on every replica. ``mode`` "min"/"max"; "auto" picks "max" for names containing
    "acc". A missing key raises ``KeyError`` naming the keys available.
    """

    def __init__(self, monitor: str = "val_loss", *, patience: int = 0, min_delta: float = 0.0,
                 mode: str = "auto") -> None:
        check_int("patience", patience, minimum=0,
                  fix="pass the epochs without improvement to tolerate, e.g. patience=3")
        check_choice("mode", mode, ("auto", "min", "max"))
        check_number("min_delta", min_delta, low=0,
                     fix="pass a magnitude: the direction follows mode")
        self.monitor = monitor
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = ("max" if "acc" in monitor else "min") if mode == "auto" else mode
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return not math.isnan(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if self.monitor not in logs:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, not in the epoch logs "
                           f"{sorted(logs)}; pick one of those (val_* needs eval_dataset)")
        value = float(logs[self.monitor])
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stop_training = True
            self.stopped_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.wait = int(state.get("wait", 0))


class _TorchScheduler(Protocol):
    def step(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class LearningRateScheduler(Callback):
    """Apply a learning-rate schedule: a torch LR scheduler (``step()`` after every epoch, or
    after every optimizer step with ``per_step=True``) or a function ``epoch -> lr`` (set on
    every param group before each epoch). ``fit`` logs the lr each epoch trained with.

    Build a torch scheduler on the optimizer you pass to ``fit`` (prepared or not: they share
    param groups). Its state is checkpointed by :class:`ModelCheckpoint` when it is JSON-able.
    """

    def __init__(self, schedule: _TorchScheduler | Callable[[int], float], *,
                 per_step: bool = False) -> None:
        self._is_torch = hasattr(schedule, "step") and hasattr(schedule, "state_dict")
        if not self._is_torch and not callable(schedule):
            raise TypeError("schedule must be a torch LR scheduler or a function epoch -> lr, "
                            f"got {type(schedule).__name__}")
        if per_step and not self._is_torch:
            raise ValueError("per_step=True needs a torch LR scheduler; a function schedule "
                             "maps epochs to learning rates")
        self.schedule = schedule
        self.per_step = per_step

    def on_epoch_begin(self, epoch: int, logs: dict[str, float]) -> None:
        if self._is_torch:
            return
        lr = float(self.schedule(epoch))  # type: ignore[operator]
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"the schedule returned lr={lr!r} for epoch {epoch}; it must be a "
                             "finite number >= 0")
        for group in _ctx(self).optimizer.param_groups:
            group["lr"] = lr

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        if self._is_torch and self.per_step:
            with warnings.catch_warnings():
                # torch warns when it cannot see optimizer.step() through the strategy wrapper.
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                self.schedule.step()  # type: ignore[union-attr]

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        if self._is_torch and not self.per_step:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                self.schedule.step()  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        if not self._is_torch:
            return {}
        return {"scheduler": self.schedule.state_dict()}  # type: ignore[union-attr]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._is_torch and "scheduler" in state:
            # The optimizer's param groups (and so the lr) are restored with the optimizer.
            self.schedule.load_state_dict(dict(state["scheduler"]))  # type: ignore[union-attr]


def _jsonable_state(cb: Callback) -> dict[str, Any]:
    state = cb.state_dict()
    try:
        json.dumps(state)
    except (TypeError, ValueError):
        warnings.warn(f"{type(cb).__name__}.state_dict() is not JSON-able; it is not "
                      "checkpointed and starts fresh on resume", RuntimeWarning, stacklevel=3)
        return {}
    return state
