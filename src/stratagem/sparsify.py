"""Top-k sparsified, low-bit pseudo-gradients for outer synchronisation (SparseLoCo).

Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo" (2025): DiLoCo's
pseudo-gradient plus an error-feedback residual is cut into chunks of :data:`TOPK_CHUNK`
values; per chunk only the ``k = round(density * chunk)`` entries of largest magnitude are
sent, their values quantized to ``bits`` bits and their positions as 16-bit indices within the
chunk; everything not sent (the entries left out and the quantization error) stays in the
residual and is added to the next outer step (error feedback: Seide et al. 2014; Karimireddy
et al., ICML 2019; top-k with memory: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory",
NeurIPS 2018).

The compression kind is one string, so that every path that already carries
``compression=`` (``DiLoCo``, ``LocalSGD``, ``Hierarchical``'s ``outer_compression``,
``stratagem run --strategy-arg``) carries its parameters too: ``"topk"`` (density 0.02,
2-bit values), ``"topk:DENSITY"``, ``"topk:DENSITY+intBITS"`` (``bits`` in 2, 4, 8).

Value grid: a mid-rise uniform grid of ``L = 2**bits`` levels over ``[-s, s]``, ``s`` the
chunk's largest magnitude (one fp32 scale per chunk): level ``c`` decodes to ``(c + 1/2 -
L/2) * 2s/L``, so every sent value is within ``s/L`` of what it decodes to (``s/4`` at 2
bits). An entry that is exactly zero is not sent: its slot holds the empty index ``0xFFFF``.

Payload of ``n`` values, ``C = ceil(n / chunk)`` chunks: ``C*k`` little-endian uint16 indices
(strictly ascending within a chunk, empty slots last), then the ``C*k`` value codes packed
``8/bits`` per byte (low bits first), then ``C`` fp32 scales: ``2k + ceil(k*bits/8) + 4``
bytes per chunk. Density 0.02, 2 bits, chunk 4096: k = 82, 188.5 bytes per 4096 values =
0.0115x of fp32.

Every byte of a payload received from the network is checked before it is used: its length,
every index against its chunk's length (the last chunk may be short), canonical order (no
duplicate index), and non-negative scales; a violation raises ``ValueError``. A chunk with a
non-finite value has a non-finite scale and decodes to ``nan`` (never hidden).

The all-reduce built on this (all-gather of each rank's payload, every rank decoding all of
them and summing in rank order in fp32) is :meth:`stratagem.comm.Comm.all_reduce_topk`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

__all__ = ["TopK", "TOPK_CHUNK", "DEFAULT_DENSITY", "DEFAULT_BITS", "VALUE_BITS",
           "MAX_DENSITY", "EMPTY", "is_topk", "parse_topk", "encode", "decode", "entries"]

#: Values per chunk (one fp32 scale and ``k`` uint16 indices each), SparseLoCo's chunk.
TOPK_CHUNK = 4096
#: ``"topk"`` alone: SparseLoCo's 1-3 % range, 2-bit values.
DEFAULT_DENSITY = 0.02
DEFAULT_BITS = 2
#: Bits per sent value.
VALUE_BITS = (2, 4, 8)
#: Above this density the dense ``"int4"`` (0.133x of fp32) moves fewer bytes than top-k
#: with its 2-byte indices (density 0.25 at 2 bits: 0.141x).
MAX_DENSITY = 0.25
#: The index of an empty slot (a chunk with fewer than ``k`` non-zero entries).
EMPTY = 0xFFFF

_FORM = re.compile(r"topk(?::([^+]+))?(?:\+int(\d+))?")
_FIX = "Fix: pass e.g. compression='topk' (= 'topk:0.02+int2'), or 'topk:0.01+int4'"


def is_topk(value: object) -> bool:
    """Whether ``value`` names the top-k kind (``"topk"`` or a ``"topk:..."`` form; validity
    is :func:`parse_topk`'s business)."""
    return isinstance(value, str) and (value == "topk" or value.startswith(("topk:", "topk+")))


@dataclass(frozen=True)
class TopK:
    """A top-k kind: the fraction of entries sent per chunk, the bits per sent value and the
    chunk length (<= 65535, so that a uint16 index and the empty index both fit)."""

    density: float = DEFAULT_DENSITY
    bits: int = DEFAULT_BITS
    chunk: int = TOPK_CHUNK

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) \
                or not 1 <= self.chunk < EMPTY:
            raise ValueError(f"chunk must be an int in [1, {EMPTY - 1}] (a uint16 index), got "
                             f"{self.chunk!r}. Fix: pass e.g. chunk={TOPK_CHUNK}")
        low = 1.0 / self.chunk
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) \
                or not math.isfinite(self.density) \
                or not low * (1 - 1e-9) <= self.density <= MAX_DENSITY:
            raise ValueError(
                f"top-k density must be in [1/{self.chunk}, {MAX_DENSITY}] (at least one value "
                f"per {self.chunk}-value chunk; above {MAX_DENSITY} the dense 'int4' moves fewer "
                f"bytes), got {self.density!r}. {_FIX}")
        if self.bits not in VALUE_BITS or isinstance(self.bits, bool):
            raise ValueError(f"top-k value bits must be one of {list(VALUE_BITS)} ('+int2', "
                             f"'+int4', '+int8'), got {self.bits!r}. {_FIX}")

    @property
    def k(self) -> int:
        """Entries sent per chunk."""
        return min(self.chunk, max(1, round(self.density * self.chunk)))

    def chunks(self, n: int) -> int:
        return max(1, -(-n // self.chunk))

    def payload_bytes(self, n: int) -> int:
        """Bytes of the payload of ``n`` values (indices, packed codes, scales)."""
        c, k = self.chunks(n), self.k
        return 2 * c * k + -(-c * k * self.bits // 8) + 4 * c

    def name(self) -> str:
        return f"topk:{self.density:g}+int{self.bits}"


def parse_topk(value: object, *, name: str = "compression") -> TopK:
    """The :class:`TopK` that ``value`` names; ``ValueError`` naming the form, the valid
    ranges and the fix otherwise."""
    m = _FORM.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{name}={value!r} is not a top-k kind: the forms are 'topk', "
                         f"'topk:DENSITY' and 'topk:DENSITY+intBITS' (DENSITY in "
                         f"[1/{TOPK_CHUNK}, {MAX_DENSITY}], BITS in {list(VALUE_BITS)}). {_FIX}")
    density = DEFAULT_DENSITY
    if m[1] is not None:
        try:
            density = float(m[1])
        except ValueError:
            raise ValueError(f"{name}={value!r}: the density {m[1]!r} is not a number; it must "
                             f"be in [1/{TOPK_CHUNK}, {MAX_DENSITY}]. {_FIX}") from None
    bits = DEFAULT_BITS if m[2] is None else int(m[2])
    try:
        return TopK(density=density, bits=bits)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r}: {exc}") from None


# ---------------------------------------------------------------------- encode / decode
def encode(x: torch.Tensor, spec: TopK) -> torch.Tensor:
    """The payload (one uint8 buffer) of the 1-D fp32 ``x`` under ``spec``. Deterministic."""
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"top-k encode needs a 1-D fp32 tensor, got shape {tuple(x.shape)} "
                         f"dtype {x.dtype}. Fix: flatten it and cast it to float32")
    n, size, k = x.numel(), spec.chunk, spec.k
    c = spec.chunks(n)
    padded = torch.zeros(c * size, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.detach())
    blocks = padded.view(c, size)
    # Non-finite entries first (their chunk's scale becomes non-finite: decoded as nan).
    magnitude = torch.nan_to_num(blocks.abs(), nan=math.inf)
    idx = magnitude.topk(k, dim=1).indices
    values = blocks.gather(1, idx)
    key = torch.where(values == 0, torch.full_like(idx, EMPTY), idx)
    key, order = key.sort(dim=1)  # canonical: ascending indices, empty slots last
    values = values.gather(1, order)
    scale = values.abs().amax(dim=1)
    levels = 1 << spec.bits
    step = 2 * scale / levels
    safe = torch.where((step > 0) & torch.isfinite(step), step, torch.ones_like(step))
    codes = torch.floor(values / safe[:, None] + levels / 2).nan_to_num_(0.0) \
        .clamp_(0, levels - 1).to(torch.uint8).reshape(-1)
    key = key.reshape(-1)
    indices = torch.stack([key & 0xFF, key >> 8], dim=1).to(torch.uint8).reshape(-1)
    return torch.cat([indices, _pack(codes, spec.bits), scale.view(torch.uint8)])


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return codes
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lanes = codes.view(-1, per)
    out = lanes[:, 0].clone()
    for j in range(1, per):
        out |= lanes[:, j] << (bits * j)
    return out


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed[:count]
    mask = (1 << bits) - 1
    lanes = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(lanes, dim=1).reshape(-1)[:count]


def entries(payload: torch.Tensor, n: int, spec: TopK) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (int64, in ``[0, n)``, unique) and fp32 values a payload of ``n`` values
    carries; ``ValueError`` if the payload is malformed (see the module docstring)."""
    expected = spec.payload_bytes(n)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
        raise ValueError(f"a top-k payload of {n} values ({spec.name()}, chunk {spec.chunk}) "
                         f"has {expected} uint8 bytes, got {payload.numel()} of "
                         f"{payload.dtype}. Fix: pass the buffer encode() returned, with the "
                         "same kind and length on every rank")
    c, k, size = spec.chunks(n), spec.k, spec.chunk
    nidx = 2 * c * k
    ncodes = -(-c * k * spec.bits // 8)
    raw = payload[:nidx].view(-1, 2).to(torch.int64)
    idx = (raw[:, 0] | (raw[:, 1] << 8)).view(c, k)
    empty = idx == EMPTY
    limit = torch.full((c, 1), size, dtype=torch.int64, device=payload.device)
    limit[-1, 0] = n - (c - 1) * size
    bad = ~empty & (idx >= limit)
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"corrupt top-k payload: index {int(idx[row, col])} in chunk {row} is "
                         f"out of range (the chunk holds {int(limit[row, 0])} values). Fix: "
                         "check that every rank runs the same model and compression kind")
    if k > 1:
        # Canonical order (what encode writes): strictly ascending, then empty slots only.
        # (EMPTY is above every valid index, so an empty slot before a used one fails.)
        ok = (idx[:, 1:] > idx[:, :-1]) | (empty[:, 1:] & empty[:, :-1])
        if not bool(ok.all()):
            raise ValueError("corrupt top-k payload: indices within a chunk must be strictly "
                             "ascending with empty slots last (a duplicate or reordered "
                             "index). Fix: pass the buffer encode() returned")
    scale = payload[nidx + ncodes:].clone().view(torch.float32)
    if bool((scale < 0).any()):
        raise ValueError("corrupt top-k payload: a negative scale. Fix: pass the buffer "
                         "encode() returned")
    codes = _unpack(payload[nidx:nidx + ncodes], spec.bits, c * k).view(c, k)
    levels = 1 << spec.bits
    step = 2 * scale / levels
    values = (codes.to(torch.float32) + (0.5 - levels / 2)) * step[:, None]
    values[~torch.isfinite(scale)] = float("nan")
    rows = torch.arange(c, dtype=torch.int64, device=payload.device)[:, None] * size
    keep = ~empty
    return (rows + idx)[keep], values[keep]


def decode(payload: torch.Tensor, n: int, spec: TopK) -> torch.Tensor:
    """The dense fp32 tensor of ``n`` values a payload carries (zero where nothing was sent)."""
    pos, values = entries(payload, n, spec)
    out = torch.zeros(n, dtype=torch.float32, device=payload.device)
    out[pos] = values
    return out
