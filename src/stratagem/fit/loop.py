"""``fit`` itself: argument checks, preparing, resuming, and the training loop.

The loop is made of the steps a custom loop takes (see the package docstring); each step of it
is a function here: :func:`_run_epoch` (the batches), :func:`_epoch_logs` (one reduction for
the epoch's history row), :func:`_evaluate_epoch`, :func:`_end_epoch` (history, callbacks,
reporting) and the agreed early stop.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint import exists as checkpoint_exists
from ..errors import CheckpointError
from ..strategy import Strategy, StrategyOptimizer, register_feature
from ..validation import check_int, check_optional_number
from .callbacks import Callback, FitContext, ModelCheckpoint
from .evaluation import evaluate, num_samples, split_batch
from .reporting import MB, Reporter, comm_bytes

if TYPE_CHECKING:
    from rich.console import Console

# ---------------------------------------------------------------------- fit
def _checkpoint_exists(strategy: Strategy, path: str) -> bool:
    """Whether to resume, decided by the chief (which writes the checkpoints) for all."""
    found = 0
    if strategy.is_chief:
        found = int(checkpoint_exists(path))
    return bool(strategy.reduce("max", found))


def fit(
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    dataset: Any,
    *,
    epochs: int,
    global_batch_size: int,
    eval_dataset: Any = None,
    callbacks: Sequence[Callback] = (),
    checkpoint_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    metrics_dir: str | os.PathLike[str] | None = None,
    progress: bool | Console = True,
    eval_fn: Callable[[Strategy, nn.Module], Mapping[str, float]] | None = None,
    clip_grad_norm: float | None = None,
) -> dict[str, list[float]]:
    """Train ``model`` for ``epochs`` epochs on ``dataset`` under ``strategy``; call it on
    every replica. Returns the history: per epoch ``loss`` (mean training loss, reduced across
    replicas), ``samples_per_second`` (global), ``comm_mb_per_second`` (mean per replica,
    sent + received), and with ``eval_dataset`` ``val_loss`` / ``val_accuracy`` (accuracy when
    the model outputs class logits and targets are integers), plus ``lr`` and ``eval_fn`` keys
    when those are used.

    ``model``/``optimizer`` may be plain (prepared here inside ``strategy.scope()``) or
    already returned by ``strategy.prepare``. Batches are ``(inputs..., target)``; the loss is
    ``loss_fn(model(*inputs), target)``, which must return the batch mean. ``seed`` seeds the
    shuffle (``distribute_dataset(..., seed=seed)``), so a custom loop with the same seed takes
    the same steps. ``eval_fn(strategy, eval_model)`` adds metrics of your own (it runs on every
    replica and must return values identical on all, e.g. via ``strategy.reduce``).

    ``checkpoint_dir``: if it holds a checkpoint, training resumes from it (model, optimizer,
    loader position, history, callback state); a :class:`ModelCheckpoint` saving there every
    epoch is added unless ``callbacks`` has one. ``metrics_dir``: the chief appends one row per
    epoch to ``metrics_dir/metrics.csv`` and, when ``tensorboard`` is installed, writes
    TensorBoard scalars there. ``progress``: a rich progress bar on the chief (True), none
    (False), or a ``rich.console.Console`` to draw on; when the output is not a terminal, one
    line per epoch is printed instead. ``clip_grad_norm``: clip the gradients of every
    optimizer step to this total 2-norm with ``strategy.clip_grad_norm_`` (unscaled, whole
    accumulated step).

    At the end of training (the last epoch, before its evaluation, and again after an early
    stop) ``strategy.finalize(model)`` folds the last local steps into the consensus model
    (LocalSGD, DiLoCo, EASGD, parameter servers), so the last ``val_*`` numbers, the last
    checkpoint and ``strategy.eval_model(model)`` after ``fit`` describe the final model.

    On failure: errors of the strategy propagate unchanged (e.g. ``PeerTimeoutError`` naming
    the peer); the progress bar and metric files are closed first.
    """
    check_int("epochs", epochs, minimum=1, fix="pass e.g. epochs=1")
    check_int("global_batch_size", global_batch_size, minimum=1,
              fix="pass the batch size summed over all replicas, e.g. 64")
    check_optional_number("clip_grad_norm", clip_grad_norm, low=0, low_open=True, finite=True,
                          fix="pass e.g. clip_grad_norm=1.0")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, target) -> loss, got "
                        f"{type(loss_fn).__name__}")
    callbacks = list(callbacks)
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks must be stratagem.fit.Callback instances, got "
                            f"{type(cb).__name__}; subclass Callback and override its hooks")
    ckpt = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt is not None and not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        callbacks.append(ModelCheckpoint(ckpt))
    # Checkpoints last, so the state they save includes this step's / epoch's updates of the
    # other callbacks (early-stopping counters, schedulers).
    callbacks.sort(key=lambda cb: isinstance(cb, ModelCheckpoint))

    with strategy.scope():
        model, optimizer = _prepared_pair(strategy, model, optimizer)
        loader = strategy.distribute_dataset(dataset, global_batch_size, shuffle=True, seed=seed)
        ctx = FitContext(strategy, model, optimizer, loader, ckpt, callbacks=callbacks)
        start_epoch, first_step = _maybe_resume(ctx)
        return _train(ctx, loss_fn, start_epoch=start_epoch, first_step=first_step,
                      epochs=epochs, eval_dataset=eval_dataset, eval_fn=eval_fn,
                      eval_batch_size=max(1, global_batch_size // strategy.num_replicas_in_sync),
                      metrics_dir=metrics_dir, progress=progress, clip_grad_norm=clip_grad_norm)


def _prepared_pair(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(model, optimizer)`` as ``strategy.prepare`` returns them, preparing if needed."""
    prepared = strategy.find_prepared(model, exact=True)
    if isinstance(optimizer, StrategyOptimizer):
        if optimizer.strategy is not strategy or prepared is None:
            raise ValueError("the optimizer was prepared by another strategy, or the model was "
                             "not prepared with it: pass the model and optimizer that "
                             "strategy.prepare(model, optimizer) returned, or prepare neither")
        # The wrapper, even if the user passed the bare module: under Mirrored only the DDP
        # wrapper all-reduces gradients.
        return prepared.model, optimizer
    if prepared is not None:
        raise ValueError("the model is prepared but the optimizer is not: pass the optimizer "
                         "strategy.prepare returned, or prepare neither")
    return strategy.prepare(model, optimizer)  # type: ignore[no-any-return]


def _maybe_resume(ctx: FitContext) -> tuple[int, int]:
    """Restore from ``ctx.checkpoint_dir`` when it holds a checkpoint; returns the epoch and
    the step within it to start at."""
    if ctx.checkpoint_dir is None or not _checkpoint_exists(ctx.strategy, ctx.checkpoint_dir):
        return 0, 0
    try:
        extras = ctx.strategy.restore(ctx.checkpoint_dir, model=ctx.model,
                                      optimizer=ctx.optimizer, loader=ctx.loader)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot resume fit from {ctx.checkpoint_dir}: {exc}. Fix: "
                              "point checkpoint_dir at a checkpoint written by fit "
                              "(ModelCheckpoint), or at a new directory to start fresh") from exc
    state = extras.get("fit")
    if not isinstance(state, Mapping):
        raise CheckpointError(f"the checkpoint at {ctx.checkpoint_dir} was not written by fit "
                              "(no 'fit' state); point checkpoint_dir at a new directory")
    ctx.step = int(state.get("step", 0))
    ctx.history = {k: [float(v) for v in vs] for k, vs in dict(state.get("history", {})).items()}
    saved_cbs = list(state.get("callbacks", []))
    if len(saved_cbs) == len(ctx.callbacks):
        for cb, cb_state in zip(ctx.callbacks, saved_cbs, strict=True):
            cb.set_context(ctx)
            if cb_state:
                cb.load_state_dict(cb_state)
    else:
        warnings.warn(f"the checkpoint holds the state of {len(saved_cbs)} callbacks, this fit "
                      f"has {len(ctx.callbacks)}: callback state starts fresh", RuntimeWarning,
                      stacklevel=3)
    epoch = int(state.get("epoch", 0))
    if state.get("epoch_done", False):
        # The loader stopped at the end of that epoch; continue with the next one, from its start.
        epoch += 1
        ctx.loader.load_state_dict({"epoch": epoch, "step_in_epoch": 0})
        return epoch, 0
    return epoch, int(state.get("step_in_epoch", 0))


@dataclass
class _Loop:
    """What every step of the loop needs, fixed for the whole ``fit`` call."""

    ctx: FitContext
    loss_fn: Callable[..., torch.Tensor]
    clip_grad_norm: float | None
    reporter: Reporter
    #: Captured once, as the loop always did: the micro-batches per optimizer step.
    accumulation: int
    #: Callbacks that override ``on_step_end`` (the others cost nothing per step).
    step_hooks: list[Callback]
    #: Micro-batches into the current optimizer step; carries over epoch boundaries.
    micro: int = 0


@dataclass
class _EpochMeter:
    """One epoch's training numbers on this replica."""

    first: int  # batches of this epoch already done before a resume
    t0: float
    bytes0: float
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    batches: int = 0
    samples: int = 0

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.t0, 1e-9)

    def mean_loss(self) -> float:
        return float(self.loss_sum) / self.batches


def _train(ctx: FitContext, loss_fn: Callable[..., torch.Tensor], *, start_epoch: int,
           first_step: int, epochs: int, eval_dataset: Any, eval_fn: Any, eval_batch_size: int,
           metrics_dir: str | os.PathLike[str] | None, progress: bool | Console,
           clip_grad_norm: float | None = None) -> dict[str, list[float]]:
    strategy = ctx.strategy
    reporter = Reporter(chief=strategy.is_chief, epochs=epochs, steps_per_epoch=len(ctx.loader),
                        metrics_dir=metrics_dir, progress=progress,
                        show_scale=strategy.precision.uses_scaler)
    with reporter:
        loop = _Loop(ctx, loss_fn, clip_grad_norm, reporter, strategy.accumulation_steps,
                     [cb for cb in ctx.callbacks
                      if type(cb).on_step_end is not Callback.on_step_end])
        for cb in ctx.callbacks:
            cb.set_context(ctx)
        for cb in ctx.callbacks:
            cb.on_train_begin(_last_row(ctx.history))
        for epoch in range(start_epoch, epochs):
            lr = _begin_epoch(ctx, epoch)
            meter = _run_epoch(loop, first_step if epoch == start_epoch else 0)
            logs = _epoch_logs(loop, epoch, meter, lr)
            if epoch == epochs - 1:
                # The last epoch: its evaluation and checkpoint see the final model.
                strategy.finalize(ctx.model)
            logs.update(_evaluate_epoch(strategy, ctx.model, loss_fn, eval_dataset, eval_fn,
                                        eval_batch_size))
            _end_epoch(loop, epoch, logs)
            # Agreed across replicas: a stop asked for anywhere stops everyone after this epoch.
            if strategy.reduce("max", int(any(cb.stop_training for cb in ctx.callbacks))):
                break
        # After an early stop, or a resume past the last epoch; else a no-op-like repeat.
        strategy.finalize(ctx.model)
        for cb in ctx.callbacks:
            cb.on_train_end(_last_row(ctx.history))
    return ctx.history


def _begin_epoch(ctx: FitContext, epoch: int) -> float:
    """Position the loader, run ``on_epoch_begin``; returns the lr this epoch trains with (an
    epoch schedule set it just now)."""
    ctx.epoch, ctx.epoch_done = epoch, False
    ctx.loader.set_epoch(epoch)
    for cb in ctx.callbacks:
        cb.on_epoch_begin(epoch, {})
    return float(ctx.optimizer.param_groups[0]["lr"])


def _run_epoch(loop: _Loop, first: int) -> _EpochMeter:
    """The epoch's batches, each the custom loop's step: forward, ``strategy.backward``,
    optional clipping, ``optimizer.step()``, ``zero_grad()``; step callbacks at every
    optimizer step; the progress display refreshed at most every few hundred ms."""
    ctx, reporter = loop.ctx, loop.reporter
    strategy, model, optimizer = ctx.strategy, ctx.model, ctx.optimizer
    n = strategy.num_replicas_in_sync
    reporter.start_epoch(ctx.epoch, first)
    meter = _EpochMeter(first, time.perf_counter(), comm_bytes(strategy.metrics()))
    for batch in ctx.loader:
        inputs, target = split_batch(batch)
        loss = loop.loss_fn(model(*inputs), target)
        strategy.backward(loss)
        if loop.clip_grad_norm is not None:
            strategy.clip_grad_norm_(model, loop.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        detached = loss.detach()
        meter.loss_sum += detached.to("cpu", torch.float64)
        meter.batches += 1
        meter.samples += num_samples(target)
        loop.micro += 1
        if loop.micro == loop.accumulation:
            loop.micro = 0
            ctx.step += 1
            if loop.step_hooks:
                step_logs = {"loss": float(detached)}
                for cb in loop.step_hooks:
                    cb.on_step_end(ctx.step, step_logs)
            reporter.step(ctx.step, detached)
        if reporter.wants_refresh():
            metrics = strategy.metrics()
            elapsed = meter.elapsed()
            reporter.refresh(first + meter.batches, meter.mean_loss(), meter.samples * n / elapsed,
                             (comm_bytes(metrics) - meter.bytes0) / MB / elapsed, metrics)
    return meter


def _epoch_logs(loop: _Loop, epoch: int, meter: _EpochMeter, lr: float) -> dict[str, float]:
    """The epoch's history row, from one reduction across replicas."""
    strategy = loop.ctx.strategy
    n = strategy.num_replicas_in_sync
    elapsed = meter.elapsed()
    metrics = strategy.metrics()
    comm_mb = (comm_bytes(metrics) - meter.bytes0) / MB
    if meter.batches:  # the throttled display may lag the last steps
        loop.reporter.refresh(meter.first + meter.batches, meter.mean_loss(),
                              meter.samples * n / elapsed, comm_mb / elapsed, metrics)
    totals = strategy.reduce("sum", {
        "loss": float(meter.loss_sum) / max(meter.batches, 1), "samples": meter.samples,
        "comm_mb": comm_mb, "seconds": elapsed})
    return {
        "epoch": epoch, "step": loop.ctx.step,
        "loss": float(totals["loss"]) / n if meter.batches else math.nan,
        # Synchronous replicas move at the pace of the slowest: use the mean wall time.
        "samples_per_second": float(totals["samples"]) / (float(totals["seconds"]) / n),
        "comm_mb_per_second": float(totals["comm_mb"]) / float(totals["seconds"]),
        "lr": lr,
    }


def _evaluate_epoch(strategy: Strategy, model: nn.Module, loss_fn: Callable[..., Any],
                    eval_dataset: Any, eval_fn: Any, eval_batch_size: int) -> dict[str, float]:
    """``val_loss`` / ``val_accuracy`` on ``eval_dataset`` and the ``eval_fn`` metrics."""
    logs: dict[str, float] = {}
    if eval_dataset is not None:
        logs.update(evaluate(strategy, model, loss_fn, eval_dataset, eval_batch_size))
    if eval_fn is not None:
        logs.update({k: float(v) for k, v in eval_fn(strategy, strategy.eval_model(model)).items()})
    return logs


def _end_epoch(loop: _Loop, epoch: int, logs: dict[str, float]) -> None:
    """History first (a checkpoint taken in ``on_epoch_end`` must include this epoch's row),
    then the callbacks, then the reports."""
    ctx = loop.ctx
    for key, value in logs.items():
        if key not in ("epoch", "step"):
            ctx.history.setdefault(key, []).append(float(value))
    ctx.epoch_done = True
    for cb in ctx.callbacks:
        cb.on_epoch_end(epoch, dict(logs))
    loop.reporter.end_epoch(epoch, logs)


def _last_row(history: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: v[-1] for k, v in history.items() if v}


register_feature("fit", fit)
