"""Mixed precision: autocast, dynamic loss scaling, non-finite gradient detection.

Loss scaling follows torch.amp.GradScaler semantics (Micikevicius et al., "Mixed Precision
Training", 2018; the tf_cnn_benchmarks automatic loss scaling): start at 2**16, halve and skip
the step on a non-finite gradient, double after ``growth_interval`` clean steps. It is
implemented here rather than by GradScaler because synchronous strategies must all-reduce the
skip decision before acting on it, so every replica skips the same step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

import torch

from .validation import check_choice, check_int

__all__ = ["Precision", "PRECISIONS", "Autocast"]

PRECISIONS = ("fp32", "bf16", "fp16")
_NONFINITE = ("raise", "skip")


class Autocast(contextlib.ContextDecorator):
    """A reusable autocast context manager (and decorator), like ``torch.autocast``.

    ``ctx = strategy.autocast()`` may be entered any number of times, one after the other or
    nested, from several threads: every ``with ctx:`` enters a fresh ``torch.autocast`` kept
    on a per-thread stack (``torch.autocast`` itself stores its saved state on the instance,
    so one instance cannot be nested). With ``fast_dtype=None`` (fp32) it is a no-op: it
    neither enables nor disables an autocast entered around it.
    """

    def __init__(self, device_type: str, dtype: torch.dtype | None) -> None:
        self.device_type = device_type
        self.fast_dtype = dtype
        self.enabled = dtype is not None
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        stack: list[Any] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> Autocast:
        ctx = None
        if self.fast_dtype is not None:
            ctx = torch.autocast(device_type=self.device_type, dtype=self.fast_dtype)
            ctx.__enter__()
        self._stack().append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx = self._stack().pop()
        if ctx is not None:
            ctx.__exit__(*exc)

    def __repr__(self) -> str:
        return (f"Autocast(device_type={self.device_type!r}, fast_dtype={self.fast_dtype}, "
                f"enabled={self.enabled})")


class Precision:
    """Autocast context, loss scale and non-finite checks for one replica."""

    def __init__(
        self,
        precision: str = "fp32",
        *,
        device_type: str = "cpu",
        on_nonfinite: str = "raise",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        check_choice("precision", precision, PRECISIONS)
        check_choice("on_nonfinite", on_nonfinite, _NONFINITE,
                     fix="'skip' drops a step whose gradients are not finite")
        check_int("growth_interval", growth_interval, minimum=1,
                  fix="pass the finite steps before the loss scale grows, e.g. 2000")
        self.precision = precision
        self.device_type = device_type
        self.on_nonfinite = on_nonfinite
        self.scale = float(init_scale) if precision == "fp16" else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    @property
    def uses_scaler(self) -> bool:
        return self.precision == "fp16"

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self) -> Autocast:
        """A reusable autocast context (a no-op under fp32), see :class:`Autocast`."""
        return Autocast(self.device_type, self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # Upcast first: an fp16 loss times 2**16 would overflow before backward even starts.
        return loss.float() * self.scale if self.uses_scaler else loss

    def unscale_and_check(self, grads: Iterable[torch.Tensor]) -> bool:
        """Unscale gradients in place (fp16) and return True when any is inf/nan.

        One fused pass per dtype/device (the kernel GradScaler uses): an element-wise
        ``isfinite`` per tensor measured ~60x slower on CPU for a 1.8M-parameter MLP.
        """
        # A sharded parameter's gradient (a DTensor) is checked on this replica's own rows:
        # through DTensor dispatch every sum and isfinite would be a reduction across
        # replicas. Synchronous strategies agree on the replicas' verdicts afterwards.
        grads = [g._values() if g.is_sparse else g.to_local() if hasattr(g, "to_local") else g
                 for g in grads]
        if not grads:
            return False
        if not self.uses_scaler:
            # Read-only check: inf/nan propagate through a sum. One reduction per tensor is
            # ~2x cheaper than the fused unscale kernel (which also writes every gradient); a
            # finite gradient whose sum overflows fp32 (|sum| > 3e38) would count as non-finite,
            # which only happens when training has diverged anyway.
            sums = torch.stack([g.sum(dtype=torch.float32) for g in grads])
            return not bool(torch.isfinite(sums).all())
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.dtype, g.device), []).append(g)
        found = False
        for (_, device), group in groups.items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            except RuntimeError:  # a dtype the fused kernel does not take
                torch._foreach_mul_(group, 1.0 / self.scale)
                flag.fill_(0.0 if all(bool(torch.isfinite(g).all()) for g in group) else 1.0)
            found = found or bool(flag.item() > 0)
        return found

    def update(self, found_nonfinite: bool) -> None:
        """Advance the dynamic loss scale after a step (no-op without fp16)."""
        if not self.uses_scaler:
            return
        if found_nonfinite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.uses_scaler and state.get("precision") == "fp16":
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
