"""Asynchronous DiLoCo's tensors as they travel: pseudo-gradients up, the global model's
updates down, in one encoding (a 16-bit cast, or blockwise int8 / int4 of
:mod:`stratagem.quantize`), shared by the replicas and the shards so both sides decode the
same bytes into the same values.

**The model down.** With a compressed kind, a shard that closes a round does not only change
its model: it sends the change. After the outer optimizer's step it encodes the update ``u =
theta_new - theta_old + r`` (``r``: what earlier encodings dropped, kept on the shard) and
*sets* its model to ``theta_old + D(E(u))`` (:func:`apply`), keeping ``r = u - (theta -
theta_old)``: server-side error feedback, as the replicas keep theirs. The shard's model is
therefore exactly the one a replica rebuilds from the encoded updates, and a replica holding
version ``v`` fetches the updates since ``v`` (:data:`HISTORY` at most, each a fraction of
the model's bytes) instead of the model (``docs/design/async-diloco-rounds.md``).
"""

from __future__ import annotations

import torch

from ..compression import ASYNC_OUTER_KINDS, KINDS
from ..quantize import DEFAULT_BLOCK, QUANT_KINDS, dequantize, payload_bytes, quantize

__all__ = ["HISTORY", "DOWN_KINDS", "encode", "decode", "apply", "encoded_size"]

#: Encoded updates a shard keeps per tensor: a replica at most this many rounds behind
#: fetches them, an older one the model itself.
HISTORY = 4
#: The kinds the model may come down in (every lossy kind a pseudo-gradient may go up in).
DOWN_KINDS = tuple(k for k in ASYNC_OUTER_KINDS if k is not None)


def _padded(n: int) -> int:
    return -(-n // DEFAULT_BLOCK) * DEFAULT_BLOCK


def encoded_size(n: int, kind: str) -> tuple[int, torch.dtype]:
    """The element count and dtype of the encoding of ``n`` values in ``kind``."""
    if kind in QUANT_KINDS:
        return payload_bytes(_padded(n), kind), torch.uint8
    dtype = KINDS[kind]
    assert dtype is not None
    return n, dtype


def encode(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` (any shape, floating point) as one flat tensor of ``kind``: a 16-bit cast, or
    the blockwise int8 / int4 payload of the values padded with zeros to whole blocks."""
    flat = x.detach().reshape(-1).to(torch.float32)
    if kind in QUANT_KINDS:
        pad = -flat.numel() % DEFAULT_BLOCK
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return quantize(flat, kind)
    dtype = KINDS[kind]
    if dtype is None:
        raise ValueError(f"encode needs a lossy kind, one of {list(DOWN_KINDS)}, got {kind!r}")
    return flat.to(dtype)


def decode(payload: torch.Tensor, kind: str, like: torch.Tensor) -> torch.Tensor:
    """The fp32 values (``like``'s shape) an :func:`encode` of ``kind`` carries; ``ValueError``
    naming the expected size when ``payload`` is not one (checked before decoding)."""
    n = like.numel()
    want, dtype = encoded_size(n, kind)
    if payload.dtype != dtype or payload.dim() != 1 or payload.numel() != want:
        raise ValueError(f"a {kind} encoding of {n} values is a 1-D {dtype} tensor of {want} "
                         f"elements, got {tuple(payload.shape)} {payload.dtype}")
    if kind in QUANT_KINDS:
        return dequantize(payload, kind, _padded(n))[:n].reshape(like.shape)
    return payload.to(torch.float32).reshape(like.shape)


def apply(old: torch.Tensor, payload: torch.Tensor, kind: str) -> torch.Tensor:
    """``old`` moved by the encoded update: ``(old + D(payload))`` in fp32, then in ``old``'s
    dtype. The shards and the replicas both compute it this way (bitwise the same)."""
    return (old.to(torch.float32) + decode(payload, kind, old)).to(old.dtype)
