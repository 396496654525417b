"""``Mirrored``: synchronous data parallelism on torch ``DistributedDataParallel``.

One part: :class:`~stratagem.parts.GradientSync` over the job's Comm. Gradients are
all-reduced in buckets during the backward pass (overlapping compute), so after
``strategy.backward`` every replica holds the same mean gradient and the same optimizer step
keeps replicas identical. The communication paths (DDP's C++ all-reduce, compressed buckets,
sparse gradients) and their measured costs are described in :mod:`stratagem.parts.grad_sync`.
"""

from __future__ import annotations

from typing import Any

from ..compression import check_compression
from ..parts import GradientSync, Plan
from ..strategy import Strategy
from ..validation import check_number

__all__ = ["Mirrored"]

class Mirrored(Strategy):
    """Synchronous all-reduce data parallelism (one replica per process).

    Arguments: ``bucket_cap_mb`` (DDP's bucket size), ``compression`` (None, "fp16", "bf16":
    gradients cross the wire in 16 bits, half the bytes), ``error_feedback`` (keep what the
    16-bit cast lost and send it later; needs ``compression``), ``find_unused_parameters``
    (DDP's flag), plus the common strategy arguments.

    On failure: a dead or stalled peer makes the gradient all-reduce fail within ``timeout``
    and ``strategy.backward`` raises ``PeerTimeoutError`` naming it. A compressed gradient
    beyond fp16's range becomes ``inf`` on every replica: all skip the step (fp16 loss
    scaling or ``on_nonfinite="skip"``) or all raise ``FloatingPointError``. Memory: DDP's
    buckets (at most one extra copy of the gradients), plus one fp32 copy of the gradients
    for the error-feedback residuals.
    """

    name = "mirrored"

    def __init__(self, *, bucket_cap_mb: float = 25, compression: str | None = None,
                 error_feedback: bool = False, find_unused_parameters: bool = False,
                 **kwargs: Any) -> None:
        check_compression(compression)
        if error_feedback and compression is None:
            raise ValueError("error_feedback=True needs a lossy compression, got "
                             "compression=None; pass compression='fp16' or 'bf16', or drop "
                             "error_feedback")
        check_number("bucket_cap_mb", bucket_cap_mb, low=0.0, low_open=True,
                     fix="pass DDP's bucket size in MiB, e.g. 25")
        self.bucket_cap_mb = bucket_cap_mb
        self.compression = compression
        self.error_feedback = bool(error_feedback)
        self.find_unused_parameters = find_unused_parameters
        super().__init__(**kwargs)

    def plan(self) -> Plan:
        # init_sync=False: prepare has checked the replicas and broadcast rank 0's parameters
        # and buffers over the whole job before wrapping, so DDP's constructor would only
        # broadcast the same model a second time.
        return Plan(GradientSync.spec(bucket_cap_mb=self.bucket_cap_mb,
                                      compression=self.compression,
                                      error_feedback=self.error_feedback,
                                      find_unused_parameters=self.find_unused_parameters,
                                      init_sync=False))
