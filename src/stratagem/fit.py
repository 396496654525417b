"""``fit``: the high-level training loop, built on exactly the methods a custom loop uses.

The loop is the one in the README — ``scope``/``prepare`` (unless already prepared),
``distribute_dataset``, ``set_epoch``, ``backward``, ``optimizer.step()``, ``zero_grad()``,
``reduce`` — so ``fit`` and a hand-written loop with the same seed take the same steps and end
with the same parameters under every strategy. On top of that it adds what a custom loop
usually re-implements: per-epoch evaluation of ``strategy.eval_model(model)`` (loss and
accuracy reduced across replicas), Keras-style callbacks (:class:`ModelCheckpoint`,
:class:`EarlyStopping`, :class:`LearningRateScheduler`), resumption from a checkpoint
directory, a rich progress bar on the chief, and CSV / TensorBoard metrics.

Every decision that changes control flow (resume or not, stop early) is agreed across replicas
with a collective, so a callback that decides differently on one replica cannot leave another
waiting in a collective that never comes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from .checkpoint import exists as checkpoint_exists
from .data import DistributedLoader, move_to_device
from .errors import CheckpointError
from .strategy import Strategy, StrategyOptimizer, register_feature
from .validation import check_choice, check_int, check_number, check_optional_number

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "fit",
    "Callback",
    "FitContext",
    "ModelCheckpoint",
    "EarlyStopping",
    "LearningRateScheduler",
]

#: Seconds between progress-bar refreshes of the values that need a device sync (loss).
_PROGRESS_INTERVAL = 0.25
_MB = 1e6


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


# ---------------------------------------------------------------------- metrics sinks
class _CsvLogger:
    """``metrics_dir/metrics.csv``, one row per epoch, appended across resumes."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fields: list[str] | None = None
        if self.path.is_file() and self.path.stat().st_size > 0:
            with open(self.path, newline="") as f:
                self.fields = next(csv.reader(f), None)

    def write(self, row: Mapping[str, Any]) -> None:
        new = self.fields is None
        if self.fields is None:
            self.fields = list(row)
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore", restval="")
            if new:
                writer.writeheader()
            writer.writerow(dict(row))


def _summary_writer_class() -> Any:
    """TensorBoard's ``SummaryWriter`` when ``tensorboard`` is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def _mean_staleness(value: Any) -> float | None:
    """One number from the ``staleness`` metric: a number, a histogram ``{staleness: count}``
    or a list of counts indexed by staleness."""
    if isinstance(value, (int, float)):
        return float(value)
    pairs: Iterable[tuple[Any, Any]]
    if isinstance(value, Mapping):
        pairs = value.items()
    elif isinstance(value, Sequence) and not isinstance(value, str):
        pairs = enumerate(value)
    else:
        return None
    total = weighted = 0.0
    for k, v in pairs:
        try:
            total += float(v)
            weighted += float(k) * float(v)
        except (TypeError, ValueError):
            return None
    return weighted / total if total else None


class _Progress:
    """The chief's progress display: a live rich bar on a terminal, one line per epoch when
    the output is not a terminal (log files, CI), nothing on other replicas."""

    def __init__(self, console: Console | None, epochs: int, steps_per_epoch: int) -> None:
        from rich.console import Console

        self.console = console if console is not None else Console(stderr=True)
        self.live = self.console.is_terminal
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self._bar: Any = None
        self._task: Any = None
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("epoch {task.fields[epoch]}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn(), console=self.console,
                                 refresh_per_second=4)
            self._bar.start()

    def start_epoch(self, epoch: int, completed: int) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task("train", total=self.steps_per_epoch,
                                            completed=completed,
                                            epoch=f"{epoch + 1}/{self.epochs}", info="")

    def update(self, completed: int, info: str) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=completed, info=info)

    def end_epoch(self, epoch: int, logs: Mapping[str, float]) -> None:
        text = f"epoch {epoch + 1}/{self.epochs} " + "  ".join(
            f"{k} {_fmt(v)}" for k, v in logs.items() if k not in ("epoch",))
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e9):
        return str(int(v))
    return f"{v:.4g}"


def _step_info(loss: float, samples_per_s: float, comm_mb_per_s: float,
               metrics: Mapping[str, Any], show_scale: bool) -> str:
    parts = [f"loss {loss:.4f}", f"{samples_per_s:,.0f} samples/s", f"comm {comm_mb_per_s:.2f} MB/s"]
    if show_scale and metrics.get("loss_scale") is not None:
        parts.append(f"scale {float(metrics['loss_scale']):g}")
    if "staleness" in metrics:
        stale = _mean_staleness(metrics["staleness"])
        if stale is not None:
            parts.append(f"staleness {stale:.1f}")
    return "  ".join(parts)


def _comm_bytes(metrics: Mapping[str, Any]) -> float:
    return float(metrics.get("bytes_sent", 0)) + float(metrics.get("bytes_received", 0))


# ---------------------------------------------------------------------- batches & evaluation
def _split_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    raise TypeError(f"fit expects batches of (inputs..., target), got {type(batch).__name__}"
                    f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; "
                    "use a tuple of tensors (X, y) or a Dataset whose items are (input, target), "
                    "or write a custom loop")


def _num_samples(target: Any) -> int:
    if isinstance(target, torch.Tensor):
        return int(target.shape[0]) if target.dim() > 0 else 1
    return len(target)


def _eval_shard(dataset: Any, replica: int, replicas: int) -> tuple[Any, int]:
    """This replica's stride of the evaluation set (every sample scored exactly once)."""
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor)
                                                              for t in dataset):
        return tuple(t[replica::replicas] for t in dataset), len(dataset[0][replica::replicas])
    if isinstance(dataset, torch.utils.data.TensorDataset):
        tensors = tuple(t[replica::replicas] for t in dataset.tensors)
        return tensors, len(tensors[0])
    try:
        n = len(dataset)
    except TypeError as exc:
        raise TypeError(f"eval_dataset must be a tuple of tensors or a map-style Dataset (with "
                        f"__len__), got {type(dataset).__name__}; or pass eval_fn=") from exc
    subset = torch.utils.data.Subset(dataset, range(replica, n, replicas))
    return subset, len(subset)


def _eval_batches(shard: Any, batch_size: int, device: torch.device) -> Iterable[Any]:
    if isinstance(shard, tuple):
        n = len(shard[0])
        for start in range(0, n, batch_size):
            yield move_to_device(tuple(t[start:start + batch_size] for t in shard), device)
        return
    for batch in torch.utils.data.DataLoader(shard, batch_size=batch_size, shuffle=False):
        yield move_to_device(batch, device)


def _evaluate(strategy: Strategy, model: nn.Module, loss_fn: Callable[..., Any], dataset: Any,
              batch_size: int) -> dict[str, float]:
    """Loss (and accuracy, for class logits with integer targets) over ``dataset``, each
    replica scoring its own stride, reduced across replicas: identical on every replica."""
    module = strategy.unwrap(strategy.eval_model(model))
    shard, _ = _eval_shard(dataset, strategy.replica_id, strategy.num_replicas_in_sync)
    was_training = module.training
    module.eval()
    loss_sum, count, correct, acc_count = 0.0, 0, 0, 0
    try:
        # The bare module, not the DDP wrapper: DDP's forward may broadcast buffers, a
        # collective that replicas with different numbers of eval batches could not match.
        with torch.no_grad(), strategy.autocast():
            for batch in _eval_batches(shard, batch_size, strategy.device):
                inputs, target = _split_batch(batch)
                out = module(*inputs)
                n = _num_samples(target)
                loss_sum += float(loss_fn(out, target)) * n  # loss_fn returns the batch mean
                count += n
                if (isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor)
                        and out.is_floating_point() and not target.is_floating_point()
                        and out.dim() == target.dim() + 1 and out.shape[0] == target.shape[0]):
                    correct += int((out.argmax(dim=1) == target).sum())
                    acc_count += int(target.numel())
    finally:
        module.train(was_training)
    totals = strategy.reduce("sum", {"loss": loss_sum, "count": count, "correct": correct,
                                     "acc_count": acc_count})
    logs: dict[str, float] = {}
    if totals["count"] > 0:
        logs["val_loss"] = float(totals["loss"]) / float(totals["count"])
    if totals["acc_count"] > 0:
        logs["val_accuracy"] = float(totals["correct"]) / float(totals["acc_count"])
    return logs


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


def _train(ctx: FitContext, loss_fn: Callable[..., torch.Tensor], *, start_epoch: int,
           first_step: int, epochs: int, eval_dataset: Any, eval_fn: Any, eval_batch_size: int,
           metrics_dir: str | os.PathLike[str] | None, progress: bool | Console,
           clip_grad_norm: float | None = None) -> dict[str, list[float]]:
    strategy, model, optimizer, loader = ctx.strategy, ctx.model, ctx.optimizer, ctx.loader
    chief = strategy.is_chief
    callbacks = ctx.callbacks
    step_hooks = [cb for cb in callbacks if type(cb).on_step_end is not Callback.on_step_end]
    accumulation = strategy.accumulation_steps
    n = strategy.num_replicas_in_sync
    bar: _Progress | None = None
    csv_logger = _CsvLogger(metrics_dir) if (chief and metrics_dir is not None) else None
    writer_cls = _summary_writer_class() if (chief and metrics_dir is not None) else None
    writer = (writer_cls(log_dir=os.fspath(metrics_dir))
              if writer_cls is not None and metrics_dir is not None else None)
    show_scale = strategy.precision.uses_scaler
    try:
        for cb in callbacks:
            cb.set_context(ctx)
        for cb in callbacks:
            cb.on_train_begin(_last_row(ctx.history))
        if chief and progress is not False:
            console = None if progress is True else progress
            bar = _Progress(console, epochs, len(loader))  # type: ignore[arg-type]
        micro = 0  # micro-batches into the current optimizer step (accumulation)
        for epoch in range(start_epoch, epochs):
            ctx.epoch, ctx.epoch_done = epoch, False
            loader.set_epoch(epoch)
            for cb in callbacks:
                cb.on_epoch_begin(epoch, {})
            # The lr this epoch trains with (an epoch schedule set it just now).
            lr = float(optimizer.param_groups[0]["lr"])
            first = first_step if epoch == start_epoch else 0
            if bar is not None:
                bar.start_epoch(epoch, first)
            loss_sum = torch.zeros((), dtype=torch.float64)
            batches = samples = 0
            t0 = time.perf_counter()
            bytes0 = _comm_bytes(strategy.metrics())
            last_refresh = 0.0
            for batch in loader:
                inputs, target = _split_batch(batch)
                loss = loss_fn(model(*inputs), target)
                strategy.backward(loss)
                if clip_grad_norm is not None:
                    strategy.clip_grad_norm_(model, clip_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
                detached = loss.detach()
                loss_sum += detached.to("cpu", torch.float64)
                batches += 1
                samples += _num_samples(target)
                micro += 1
                if micro == accumulation:
                    micro = 0
                    ctx.step += 1
                    if step_hooks:
                        step_logs = {"loss": float(detached)}
                        for cb in step_hooks:
                            cb.on_step_end(ctx.step, step_logs)
                    if writer is not None:
                        writer.add_scalar("train/loss", float(detached), ctx.step)
                now = time.perf_counter()
                if bar is not None and now - last_refresh >= _PROGRESS_INTERVAL:
                    last_refresh = now
                    metrics = strategy.metrics()
                    elapsed = max(now - t0, 1e-9)
                    bar.update(first + batches, _step_info(
                        float(loss_sum) / batches, samples * n / elapsed,
                        (_comm_bytes(metrics) - bytes0) / _MB / elapsed, metrics, show_scale))
            elapsed = max(time.perf_counter() - t0, 1e-9)
            metrics = strategy.metrics()
            comm_mb = (_comm_bytes(metrics) - bytes0) / _MB
            if bar is not None and batches:  # the throttled bar may lag the last steps
                bar.update(first + batches, _step_info(
                    float(loss_sum) / batches, samples * n / elapsed, comm_mb / elapsed, metrics,
                    show_scale))
            # One reduction for every number of the epoch's history row.
            totals = strategy.reduce("sum", {
                "loss": float(loss_sum) / max(batches, 1), "samples": samples,
                "comm_mb": comm_mb, "seconds": elapsed})
            logs: dict[str, float] = {
                "epoch": epoch, "step": ctx.step,
                "loss": float(totals["loss"]) / n if batches else math.nan,
                # Synchronous replicas move at the pace of the slowest: use the mean wall time.
                "samples_per_second": float(totals["samples"]) / (float(totals["seconds"]) / n),
                "comm_mb_per_second": float(totals["comm_mb"]) / float(totals["seconds"]),
                "lr": lr,
            }
            if epoch == epochs - 1:
                # The last epoch: its evaluation and checkpoint see the final model.
                strategy.finalize(model)
            if eval_dataset is not None:
                logs.update(_evaluate(strategy, model, loss_fn, eval_dataset, eval_batch_size))
            if eval_fn is not None:
                logs.update({k: float(v) for k, v in
                             eval_fn(strategy, strategy.eval_model(model)).items()})
            # History first: a checkpoint taken in on_epoch_end must include this epoch's row.
            for key, value in logs.items():
                if key not in ("epoch", "step"):
                    ctx.history.setdefault(key, []).append(float(value))
            ctx.epoch_done = True
            for cb in callbacks:
                cb.on_epoch_end(epoch, dict(logs))
            if bar is not None:
                bar.end_epoch(epoch, logs)
            if csv_logger is not None:
                csv_logger.write(logs)
            if writer is not None:
                for key, value in logs.items():
                    if key not in ("epoch", "step"):
                        writer.add_scalar(f"epoch/{key}", value, epoch)
                writer.flush()
            # Agreed across replicas: a stop asked for anywhere stops everyone after this epoch.
            if strategy.reduce("max", int(any(cb.stop_training for cb in callbacks))):
                break
        # After an early stop, or a resume past the last epoch; else a no-op-like repeat.
        strategy.finalize(model)
        for cb in callbacks:
            cb.on_train_end(_last_row(ctx.history))
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
    return ctx.history


def _last_row(history: Mapping[str, list[float]]) -> dict[str, float]:
    return {k: v[-1] for k, v in history.items() if v}


register_feature("fit", fit)
