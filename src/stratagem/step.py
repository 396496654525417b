"""Step control: what happens between ``strategy.backward(loss)`` and the parts' update, the
same for every strategy — gradient accumulation (micro-batches per optimizer step), fp16
loss scaling, ``clip_grad_norm_`` at the accumulation boundary, and the non-finite verdict
(agreed across replicas when the strategy's parts take synchronous steps).

The strategy owns one :class:`StepControl`; the parts never see micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .validation import check_int, check_number

if TYPE_CHECKING:
    from .precision import Precision
    from .prepared import Prepared, StrategyOptimizer

__all__ = ["StepControl", "is_comm_error"]


def is_comm_error(exc: BaseException) -> bool:
    """True when ``exc`` comes from a collective (gloo/NCCL), not from the user's code."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return any(k in text for k in ("Gloo", "gloo", "Connection closed", "Connection reset",
                                   "Timed out", "NCCL", "Broken pipe"))


@dataclass
class _ClipRequest:
    """A ``clip_grad_norm_`` call waiting for the accumulation boundary. ``norm`` is the
    tensor returned to the caller, filled in place when the norm is computed."""

    max_norm: float
    norm_type: float
    norm: torch.Tensor


class StepControl:
    """Accumulation, loss scaling, clipping and the non-finite verdict of one strategy.

    ``shares`` gives the shares of each global batch this replica trains on (1, or more
    while ``keep_global_batch`` hands it missing replicas' shares) and ``loss_fraction`` the
    all-reduce divisor's correction (live / launched replicas); ``set_grad_sync(enabled)``
    tells the parts whether the next backward communicates; ``grad_norm(prepared, grads,
    norm_type)`` is the parts' total norm; ``agree(flag)`` the verdict of every replica;
    ``diagnose(exc, what)`` turns a failed collective into ``PeerTimeoutError``.
    """

    def __init__(self, precision: Precision, *, device: torch.device,
                 shares: Callable[[], int], loss_fraction: Callable[[], float],
                 set_grad_sync: Callable[[bool], None],
                 grad_norm: Callable[[Prepared, list[torch.Tensor], float], torch.Tensor],
                 agree: Callable[[bool], bool],
                 diagnose: Callable[[BaseException, str], BaseException],
                 replica_id: Callable[[], int]) -> None:
        self.precision = precision
        self.device = device
        self._shares, self._loss_fraction = shares, loss_fraction
        self._set_grad_sync, self._grad_norm = set_grad_sync, grad_norm
        self._agree, self._diagnose, self._replica_id = agree, diagnose, replica_id
        self.micro = 0
        self.boundary_done = False
        self._accumulation_steps = 1
        #: Optimizer steps applied (skipped steps not counted) and skipped on this replica.
        self.steps = 0
        self.skipped = 0
        # clip_grad_norm_ bookkeeping for the current accumulation boundary: parameters
        # whose gradients are already unscaled/checked, pending clip requests and the
        # non-finite verdicts of clips done before optimizer.step().
        self._unscaled: set[int] = set()
        self._clip_requests: dict[int, _ClipRequest] = {}
        self._clip_nonfinite: dict[int, bool] = {}

    # ------------------------------------------------------------------ accumulation
    @staticmethod
    def check_accumulation(accumulation_steps: int | None,
                           global_accumulation_steps: int | None) -> None:
        """The strategy constructor's two ways to say it: at most one, each an int >= 1."""
        if accumulation_steps is not None and global_accumulation_steps is not None:
            raise ValueError(
                f"pass accumulation_steps (per worker) or global_accumulation_steps (over all "
                f"workers), not both; got accumulation_steps={accumulation_steps!r} and "
                f"global_accumulation_steps={global_accumulation_steps!r}. Fix: drop one")
        if accumulation_steps is not None:
            check_int("accumulation_steps", accumulation_steps, minimum=1,
                      fix="pass the number of micro-batches per optimizer step, e.g. 4")
        if global_accumulation_steps is not None:
            check_int("global_accumulation_steps", global_accumulation_steps, minimum=1,
                      fix="pass the number of micro-batches per optimizer step summed over all "
                      "workers, e.g. 8")

    def set_global_accumulation(self, value: int, workers: int) -> None:
        """``accumulation_steps = value / workers``; a count not divisible raises
        ``ValueError`` naming both numbers."""
        check_int("global_accumulation_steps", value, minimum=1,
                  fix="pass the number of micro-batches per optimizer step summed over all "
                  "workers, e.g. 8")
        if value % workers:
            raise ValueError(
                f"global_accumulation_steps={value} is not divisible by the {workers} workers "
                f"(num_replicas_in_sync), so workers cannot share it equally. Fix: pass a "
                f"multiple of {workers} (e.g. {max(workers, value - value % workers)}), or "
                "accumulation_steps= per worker")
        self.accumulation_steps = value // workers

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        check_int("accumulation_steps", value, minimum=1,
                  fix="pass the number of micro-batches per optimizer step, e.g. 4")
        if self.accumulating():
            raise RuntimeError(
                f"cannot change accumulation_steps from {self._accumulation_steps} to {value} "
                f"in the middle of an accumulated step ({self.micro} of "
                f"{self._accumulation_steps} micro-batches done). Fix: set it after "
                "optimizer.step() and optimizer.zero_grad() of the last micro-batch")
        self._accumulation_steps = value
        self.set_next_sync()

    @property
    def micro_per_step(self) -> int:
        """Micro-batches this replica runs per optimizer step (its own and adopted shares)."""
        return self._accumulation_steps * self._shares()

    def accumulating(self) -> bool:
        return 0 < self.micro < self.micro_per_step and not self.boundary_done

    def end_accumulation(self) -> None:
        if self.boundary_done:
            self.micro = 0
            self.boundary_done = False
            self._unscaled.clear()
            self._clip_nonfinite.clear()
            self.set_next_sync()

    def set_next_sync(self) -> None:
        self._set_grad_sync((self.micro + 1) >= self.micro_per_step)

    @property
    def sync_gradients(self) -> bool:
        return self.micro == 0 or self.micro >= self.micro_per_step or self.boundary_done

    @property
    def skips_agree(self) -> bool:
        """True when a step may be skipped (fp16 loss scaling, ``on_nonfinite="skip"``)."""
        return self.precision.uses_scaler or self.precision.on_nonfinite == "skip"

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.boundary_done:
            self.end_accumulation()
        fraction = self._loss_fraction()
        if fraction != 1.0:  # keep_global_batch with replicas missing
            loss = loss / (self._accumulation_steps / fraction)
        elif self._accumulation_steps > 1:
            loss = loss / self._accumulation_steps
        loss = self.precision.scale_loss(loss)
        try:
            loss.backward(**kwargs)
        except RuntimeError as exc:
            if is_comm_error(exc):
                raise self._diagnose(exc, "gradient all-reduce in backward") from exc
            raise
        self.micro += 1
        self.set_next_sync()

    # ------------------------------------------------------------------ clipping
    def clip(self, prepared: Prepared, max_norm: float, norm_type: float) -> torch.Tensor:
        check_number("max_norm", max_norm, low=0, low_open=True, finite=True,
                     fix="pass e.g. max_norm=1.0")
        check_number("norm_type", norm_type, low=0, low_open=True,
                     fix="pass 2.0 (Euclidean) or float('inf')")
        request = self._clip_requests.get(id(prepared))
        if request is None:
            request = _ClipRequest(float(max_norm), float(norm_type),
                                   torch.full((), math.nan, device=self.device))
            self._clip_requests[id(prepared)] = request
        else:  # the last call of the accumulated step wins
            request.max_norm, request.norm_type = float(max_norm), float(norm_type)
        if self.micro == 0 and not self.boundary_done and self.precision.uses_scaler:
            raise RuntimeError(
                "clip_grad_norm_ without strategy.backward(loss): precision='fp16' scales the "
                "loss there. Replace loss.backward() with strategy.backward(loss).")
        at_boundary = not self.boundary_done and (
            self.micro == 0 or self.micro >= self.micro_per_step)
        if at_boundary:
            del self._clip_requests[id(prepared)]
            self._clip_now(prepared, request)
        return request.norm

    def _unscale(self, params: Iterable[torch.Tensor]) -> bool:
        """Unscale (fp16) and check the gradients of ``params`` not yet handled at this
        boundary; True when one is inf/nan."""
        todo: list[torch.Tensor] = []
        for p in params:
            if p.grad is not None and id(p) not in self._unscaled:
                self._unscaled.add(id(p))
                todo.append(p.grad)
        return self.precision.unscale_and_check(todo)

    def _clip_now(self, prepared: Prepared, request: _ClipRequest) -> None:
        params = [p for p in prepared.module.parameters() if p.grad is not None]
        nonfinite = self._unscale(params)
        grads = [p.grad for p in params if p.grad is not None]
        norm = self._grad_norm(prepared, grads, request.norm_type)
        nonfinite = nonfinite or not bool(torch.isfinite(norm))
        with torch.no_grad():
            request.norm.copy_(norm)
            if not nonfinite and grads:
                coef = (request.max_norm / (norm + 1e-6)).clamp(max=1.0)
                dense = [g for g in grads if not g.is_sparse]
                if dense:
                    torch._foreach_mul_(dense, coef.to(dense[0].device))
                for g in grads:
                    if g.is_sparse:
                        g.mul_(coef.to(g.device))
        key = id(prepared)
        self._clip_nonfinite[key] = self._clip_nonfinite.get(key, False) or nonfinite

    # ------------------------------------------------------------------ the boundary
    def boundary(self, opt: StrategyOptimizer, *, synchronous: bool) -> bool | None:
        """None on a micro-batch before the boundary (nothing is applied); at the boundary,
        whether the step's gradients are non-finite — agreed by every replica when the step
        is ``synchronous`` and a skip is possible."""
        if self.micro == 0 and not self.boundary_done:
            if self.precision.uses_scaler:
                raise RuntimeError(
                    "optimizer.step() without strategy.backward(loss): precision='fp16' "
                    "scales the loss there. Replace loss.backward() with "
                    "strategy.backward(loss).")
            self.micro = self.micro_per_step  # the user called loss.backward() directly
        if self.micro < self.micro_per_step:
            return None  # a micro-batch: gradients keep accumulating, nothing communicated
        self.boundary_done = True
        prepared = opt.prepared
        params = [p for g in opt.param_groups for p in g["params"]]
        if not self._unscaled and not self._clip_requests:
            # No clipping at this boundary: no per-parameter bookkeeping on the hot path.
            nonfinite = self.precision.unscale_and_check(
                [p.grad for p in params if p.grad is not None])
        else:
            nonfinite = self._unscale(params)
            request = self._clip_requests.pop(id(prepared), None)
            if request is not None:  # recorded on an earlier micro-batch: the boundary is now
                self._clip_now(prepared, request)
            nonfinite = self._clip_nonfinite.pop(id(prepared), False) or nonfinite
            # Another optimizer stepping at this boundary unscales its own parameters.
            self._unscaled.difference_update(id(p) for p in params)
        if synchronous and self.skips_agree:
            nonfinite = self._agree(nonfinite)
        return nonfinite

    def skip(self, opt: StrategyOptimizer) -> None:
        """A non-finite step every replica agreed on: skipped (scale halved), or raised."""
        if not self.precision.uses_scaler and self.precision.on_nonfinite == "raise":
            raise FloatingPointError(self._describe_nonfinite(opt))
        self.precision.update(True)
        self.skipped += 1

    def applied(self) -> None:
        """An update was applied: the loss scale may grow, the step counts."""
        self.precision.update(False)
        self.steps += 1

    def _describe_nonfinite(self, opt: StrategyOptimizer) -> str:
        names = opt.prepared.param_names
        bad = [names.get(id(p), "?") for g in opt.param_groups for p in g["params"]
               if p.grad is not None and not bool(
                   torch.isfinite(p.grad._values() if p.grad.is_sparse else p.grad).all())]
        return (f"non-finite gradient at step {self.steps + 1} on replica {self._replica_id()} "
                f"in parameter(s) {', '.join(bad[:5]) or '?'} (or a gradient norm beyond "
                "float32). Fix: lower the learning rate, or clip the gradients with "
                "strategy.clip_grad_norm_(model, max_norm) between strategy.backward(loss) and "
                "optimizer.step() (fit(..., clip_grad_norm=1.0)); or pass on_nonfinite='skip' "
                "to skip such steps, or precision='fp16' for dynamic loss scaling.")
