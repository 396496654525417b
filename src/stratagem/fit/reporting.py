"""What ``fit`` reports on the chief: the progress display, ``metrics.csv`` and TensorBoard.

:class:`Reporter` bundles the three sinks so the loop calls one object per event (epoch start,
step, epoch end) and closes them all on the way out, errors included. Other replicas get a
reporter that does nothing.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rich.console import Console

#: Seconds between progress-bar refreshes of the values that need a device sync (loss).
_PROGRESS_INTERVAL = 0.25
MB = 1e6

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


def mean_staleness(value: Any) -> float | None:
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


def step_info(loss: float, samples_per_s: float, comm_mb_per_s: float,
               metrics: Mapping[str, Any], show_scale: bool) -> str:
    parts = [f"loss {loss:.4f}", f"{samples_per_s:,.0f} samples/s", f"comm {comm_mb_per_s:.2f} MB/s"]
    if show_scale and metrics.get("loss_scale") is not None:
        parts.append(f"scale {float(metrics['loss_scale']):g}")
    if "staleness" in metrics:
        stale = mean_staleness(metrics["staleness"])
        if stale is not None:
            parts.append(f"staleness {stale:.1f}")
    return "  ".join(parts)


def comm_bytes(metrics: Mapping[str, Any]) -> float:
    return float(metrics.get("bytes_sent", 0)) + float(metrics.get("bytes_received", 0))


class Reporter:
    """The chief's three sinks behind one object: the progress display (unless ``progress``
    is False), ``metrics_dir/metrics.csv`` and TensorBoard scalars (when ``metrics_dir`` is
    given; TensorBoard only when installed). On other replicas every method is a no-op.
    ``close()`` (or leaving the ``with`` block) closes them all, also on errors."""

    def __init__(self, *, chief: bool, epochs: int, steps_per_epoch: int,
                 metrics_dir: str | os.PathLike[str] | None, progress: bool | Console,
                 show_scale: bool) -> None:
        self.show_scale = show_scale
        self.bar: _Progress | None = None
        self.csv: _CsvLogger | None = None
        self.writer: Any = None
        self._last_refresh = 0.0
        if not chief:
            return
        if metrics_dir is not None:
            self.csv = _CsvLogger(metrics_dir)
            writer_cls = _summary_writer_class()
            if writer_cls is not None:
                self.writer = writer_cls(log_dir=os.fspath(metrics_dir))
        if progress is not False:
            console = None if progress is True else progress
            self.bar = _Progress(console, epochs, steps_per_epoch)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_epoch(self, epoch: int, completed: int) -> None:
        self._last_refresh = 0.0
        if self.bar is not None:
            self.bar.start_epoch(epoch, completed)

    def step(self, step: int, loss: torch.Tensor) -> None:
        """After optimizer step ``step`` (TensorBoard's ``train/loss``; the loss is read from
        the device only when it is written)."""
        if self.writer is not None:
            self.writer.add_scalar("train/loss", float(loss), step)

    def wants_refresh(self) -> bool:
        """Whether the bar is due for new numbers (they cost a device sync: throttled)."""
        if self.bar is None:
            return False
        now = time.perf_counter()
        if now - self._last_refresh < _PROGRESS_INTERVAL:
            return False
        self._last_refresh = now
        return True

    def refresh(self, completed: int, loss: float, samples_per_s: float, comm_mb_per_s: float,
                metrics: Mapping[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(completed, step_info(loss, samples_per_s, comm_mb_per_s, metrics,
                                                 self.show_scale))

    def end_epoch(self, epoch: int, logs: Mapping[str, float]) -> None:
        if self.bar is not None:
            self.bar.end_epoch(epoch, logs)
        if self.csv is not None:
            self.csv.write(logs)
        if self.writer is not None:
            for key, value in logs.items():
                if key not in ("epoch", "step"):
                    self.writer.add_scalar(f"epoch/{key}", value, epoch)
            self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
