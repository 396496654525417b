"""Gradient compression by casting to 16 bits, with optional error feedback.

``compress(tensor, kind)`` casts a gradient to fp16 or bf16 for the wire (half the bytes of
fp32) and ``decompress`` casts it back. :class:`ErrorFeedback` keeps, per tensor (a key chosen
by the caller: a DDP bucket, a parameter name pushed to a parameter server), the residual the
cast lost and adds it to the next gradient before compressing it: the "1-bit SGD" error
feedback of Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs" (Interspeech 2014), analysed for any
compressor by Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes" (ICML 2019). With error feedback nothing the cast drops is lost for good:
it is sent later, once it has accumulated above the 16-bit resolution.

Overflow is never silent: a value beyond fp16's range (65504) becomes ``inf`` in the cast
(IEEE round-to-nearest, no saturation), so a strategy's non-finite check sees it and skips
or raises; the residual of a non-finite compression is dropped, never carried. bf16 has
fp32's range and cannot overflow in the cast.

Used by ``Mirrored`` (through its DDP communication hook) and meant for the parameter-server
push path: both hand a flat gradient and a key to :meth:`ErrorFeedback.compress`.

:data:`KINDS` is the one table of compression kinds in stratagem: every ``compression=``
keyword (Mirrored, the parameter-server push, DiLoCo's pseudo-gradients, the PS wire) is
checked with :func:`check_compression` and mapped to its wire dtype with :func:`wire_dtype`,
so that a new kind is added here once.

The quantized kinds ``"int8"`` and ``"int4"`` (blockwise absmax quantization with one fp32
scale per :data:`~stratagem.quantize.DEFAULT_BLOCK` values, :mod:`stratagem.quantize`) are in
the same table, but only outer synchronisation accepts them (``DiLoCo``, and ``Hierarchical``
with a DiLoCo outer): their all-reduce is
:meth:`~stratagem.comm.Comm.all_reduce_quantized`, never a cast. Every other caller keeps the
default ``kinds`` of :func:`check_compression` (:data:`CAST_KINDS`) and refuses them.

The top-k kind ``"topk"`` (SparseLoCo, Sarfi et al. 2025; :mod:`stratagem.sparsify`) is in
the table too, with its parameters in the string (``"topk:0.02+int2"``): outer
synchronisation only, all-reduced by :meth:`~stratagem.comm.Comm.all_reduce_topk`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .sparsify import is_topk, parse_topk
from .validation import describe_choices

__all__ = ["KINDS", "CAST_KINDS", "QUANTIZED_KINDS", "SPARSE_KINDS", "OUTER_KINDS",
           "ASYNC_OUTER_KINDS", "COMPRESSIONS", "CompressionContext", "ErrorFeedback", "check_compression",
           "compress", "compression_dtype", "decompress", "wire_dtype"]

#: Every value a ``compression=`` keyword accepts, and the dtype it puts on the wire
#: (``None``: no compression, tensors travel in their own dtype).
#: (``"int8"``/``"int4"``: the dtype of the packed integers; the fp32 scales travel beside.)
KINDS: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "int4": torch.uint8,
    "topk": torch.uint8,
}

#: The kinds sent by casting (what ``check_compression`` accepts unless told otherwise).
CAST_KINDS: tuple[str | None, ...] = (None, "fp16", "bf16")
#: The blockwise-quantized kinds (:mod:`stratagem.quantize`): outer synchronisation only.
QUANTIZED_KINDS: tuple[str, ...] = ("int8", "int4")
#: The top-k sparsified kind (:mod:`stratagem.sparsify`): outer synchronisation only. Its
#: parameters travel in the string: ``"topk"``, ``"topk:DENSITY"``, ``"topk:DENSITY+intBITS"``.
SPARSE_KINDS: tuple[str, ...] = ("topk",)
#: What an outer synchronisation (DiLoCo's pseudo-gradients) accepts.
OUTER_KINDS: tuple[str | None, ...] = CAST_KINDS + QUANTIZED_KINDS + SPARSE_KINDS
#: What asynchronous DiLoCo's pseudo-gradients travel as to a shard (no top-k: the shard
#: sums them one by one, not through an all-gather).
ASYNC_OUTER_KINDS: tuple[str | None, ...] = CAST_KINDS + QUANTIZED_KINDS

#: The lossy cast kinds only, for code that compresses by casting for sure.
COMPRESSIONS: dict[str, torch.dtype] = {k: v for k, v in KINDS.items()
                                        if k is not None and v is not None
                                        and v.is_floating_point}


def check_compression(value: object, *, name: str = "compression",
                      kinds: tuple[str | None, ...] | None = None) -> str | None:
    """``value`` if it is a compression kind the caller supports (``kinds``, a subset of
    :data:`KINDS`; by default :data:`CAST_KINDS`); else ``ValueError`` naming the valid kinds
    and the fix (and, for a quantized kind given where it is not supported, where it is).

    ``name`` is the keyword the user passed (kept in the message so it points at their
    argument)."""
    allowed = CAST_KINDS if kinds is None else kinds
    unknown = [k for k in allowed if k not in KINDS]
    if unknown:
        raise ValueError(f"kinds must be keys of compression.KINDS {list(KINDS)}, got {unknown}")
    if is_topk(value) and "topk" in allowed:
        parse_topk(value, name=name)  # ValueError naming the ranges and the fix
        return value  # type: ignore[return-value]
    try:
        ok = value in allowed
    except TypeError:  # unhashable
        ok = False
    if not ok:
        choices = describe_choices(allowed)
        where = ""
        if ok is False and (value in QUANTIZED_KINDS or is_topk(value)):
            what = "top-k sparsification" if is_topk(value) else "blockwise quantization"
            where = (f". {value!r} ({what}) is for outer synchronisation only: "
                     "DiLoCo(compression=...), LocalSGD(compression=...) or "
                     "Hierarchical(outer='diloco', outer_compression=...)")
        forms = (" ('topk' also as 'topk:DENSITY+intBITS', e.g. 'topk:0.02+int2')"
                 if "topk" in allowed else "")
        raise ValueError(f"{name} must be one of {choices}, got {value!r}. Fix: pass "
                         f"{choices}" + (" (None: full precision)" if None in allowed else "")
                         + forms + where)
    return value  # type: ignore[return-value]


def wire_dtype(kind: str | None) -> torch.dtype | None:
    """The dtype ``kind`` sends (``None`` for no compression; the packed integers' dtype for
    a quantized or top-k kind); ``ValueError`` for an unknown kind."""
    checked = check_compression(kind, kinds=tuple(KINDS))
    return KINDS["topk" if is_topk(checked) else checked]


@dataclass(frozen=True)
class CompressionContext:
    """What ``decompress`` needs to rebuild the original tensor."""

    dtype: torch.dtype
    shape: torch.Size


def compression_dtype(kind: str) -> torch.dtype:
    """The wire dtype of the lossy ``kind``; raises ``ValueError`` naming the valid kinds."""
    return COMPRESSIONS[check_compression(kind, kinds=tuple(COMPRESSIONS))]  # type: ignore[index]


def compress(tensor: torch.Tensor, kind: str) -> tuple[torch.Tensor, CompressionContext]:
    """Cast a dense floating-point tensor to the 16-bit ``kind`` ("fp16" or "bf16").

    Returns ``(payload, ctx)``; ``decompress(payload, ctx)`` gives a tensor of the original
    dtype and shape. fp16 overflow becomes ``inf`` (see the module docstring).
    """
    if tensor.is_sparse or not tensor.is_floating_point():
        raise TypeError(f"compress needs a dense floating-point tensor, got layout "
                        f"{tensor.layout} dtype {tensor.dtype}; send sparse or integer tensors "
                        "uncompressed")
    return tensor.to(compression_dtype(kind)), CompressionContext(tensor.dtype, tensor.shape)


def decompress(payload: torch.Tensor, ctx: CompressionContext) -> torch.Tensor:
    """The inverse of :func:`compress` (up to the precision the cast dropped)."""
    return payload.to(ctx.dtype).reshape(ctx.shape)


class ErrorFeedback:
    """Compression with a residual per key (Seide et al. 2014; Karimireddy et al. 2019).

    ``compress(key, g)`` sends ``c = C(g + e)`` and keeps ``e' = g + e - D(c)``. With
    ``deferred=True`` the new residuals wait in a pending set until :meth:`commit` (call it
    once the update they belong to was applied) and :meth:`discard` drops them: a step the
    strategy skips on a non-finite gradient must not consume the residual it was given.

    ``scale`` lets the caller compress loss-scaled gradients (fp16 dynamic loss scaling):
    residuals are stored unscaled and re-scaled by the current loss scale when added, so a
    change of scale between steps does not distort them. Memory: one fp32 copy of every
    compressed tensor.
    """

    def __init__(self, kind: str, *, deferred: bool = False) -> None:
        compression_dtype(kind)  # validate early
        self.kind = kind
        self.deferred = deferred
        self._residual: dict[Hashable, torch.Tensor] = {}
        self._pending: dict[Hashable, torch.Tensor | None] = {}

    def compress(self, key: Hashable, tensor: torch.Tensor, *,
                 scale: float = 1.0) -> tuple[torch.Tensor, CompressionContext]:
        """Compress ``tensor + residual[key]`` and remember what the cast lost."""
        residual = self._residual.get(key)
        corrected = tensor.detach()
        if residual is not None and residual.shape == corrected.shape:
            corrected = corrected + (residual * scale if scale != 1.0 else residual)
        payload, ctx = compress(corrected, self.kind)
        lost = corrected - decompress(payload, ctx)
        # An overflow (inf) makes the step non-finite; carrying inf/nan would poison every
        # later step, so the residual of such a compression is dropped.
        new: torch.Tensor | None = None
        if bool(torch.isfinite(lost).all()):
            new = lost / scale if scale != 1.0 else lost
        if self.deferred:
            self._pending[key] = new
        elif new is None:
            self._residual.pop(key, None)
        else:
            self._residual[key] = new
        return payload, ctx

    def commit(self, *, prune: bool = False) -> None:
        """Make the pending residuals current (deferred mode): the update was applied.

        ``prune=True`` also forgets keys not compressed since the last commit (a caller whose
        keys change, as DDP's buckets do once after the first iteration, frees the old ones).
        """
        if not self._pending:
            return
        if prune:
            self._residual = {k: v for k, v in self._residual.items() if k in self._pending}
        for key, value in self._pending.items():
            if value is None:
                self._residual.pop(key, None)
            else:
                self._residual[key] = value
        self._pending = {}

    def discard(self) -> None:
        """Drop the pending residuals (deferred mode): the update was skipped."""
        self._pending = {}

    def keys(self) -> list[Hashable]:
        """The keys holding a committed residual."""
        return list(self._residual)

    def seed(self, key: Hashable, residual: torch.Tensor) -> None:
        """Set the committed residual of ``key`` (a restored checkpoint's), unscaled."""
        self._residual[key] = residual.detach().clone()

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The committed residual of ``key`` (unscaled), or None."""
        return self._residual.get(key)

    def residual_norm(self) -> float:
        """L2 norm of all committed residuals (a diagnostic)."""
        if not self._residual:
            return 0.0
        return float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(r.float()) for r in self._residual.values()])))

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint)."""
        self._residual.clear()
        self._pending = {}
