"""Deterministic placement of tensors on parameter-server shards, and partitioners.

Greedy least-loaded placement follows the tf_cnn_benchmarks variable manager and TensorFlow's
``GreedyLoadBalancingStrategy``: units are placed largest first, each on the shard holding the
fewest bytes so far (ties to the lowest shard index). Tensors smaller than
``small_tensor_bytes`` (biases, norms) are grouped into one unit so they travel to one shard.
Tensors of at least ``small_tensor_bytes`` for which the partitioner returns more than one
part are split along dim 0 into parts (TensorFlow's
``FixedShardsPartitioner``, ``MinSizePartitioner``, ``MaxSizePartitioner``), and the parts are
placed like any other tensor. ``round_robin`` is the ``replica_device_setter`` baseline.

Placement is a pure function of (names, shapes, dtypes, number of shards, configuration), so
every worker computes the same answer without talking to anyone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "TensorSpec",
    "Part",
    "Placement",
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "greedy",
    "round_robin",
    "place",
    "specs_of",
]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Part:
    """Rows ``[row_start, row_end)`` of tensor ``name`` (all of it if ``num_parts == 1``)."""

    key: str  # the name on the shard
    name: str
    index: int
    num_parts: int
    shard: int
    row_start: int
    row_end: int
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Placement:
    parts: tuple[Part, ...]
    num_shards: int

    def parts_of(self, name: str) -> list[Part]:
        return [p for p in self.parts if p.name == name]

    def on_shard(self, shard: int) -> list[Part]:
        return [p for p in self.parts if p.shard == shard]

    @property
    def shard_bytes(self) -> list[int]:
        loads = [0] * self.num_shards
        for p in self.parts:
            loads[p.shard] += p.nbytes
        return loads

    @property
    def imbalance(self) -> float:
        """max / mean shard bytes (1.0 is perfect balance)."""
        loads = self.shard_bytes
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0


class Partitioner(Protocol):
    """Returns how many parts to split a tensor into along dim 0 (1 = do not split)."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int: ...


def _check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _rows(shape: Sequence[int]) -> int:
    return shape[0] if len(shape) else 1


class FixedShardsPartitioner:
    """Split every tensor into ``num_shards`` parts (fewer if dim 0 is smaller)."""

    def __init__(self, num_shards: int) -> None:
        _check_positive("num_shards", num_shards)
        self.num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return max(1, min(self.num_shards, _rows(shape)))


class MinSizePartitioner:
    """Split so each part holds at least ``min_shard_bytes`` (at most ``max_shards`` parts)."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int | None = None) -> None:
        _check_positive("min_shard_bytes", min_shard_bytes)
        _check_positive("max_shards", max_shards, allow_none=True)
        self.min_shard_bytes, self.max_shards = min_shard_bytes, max_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows = _rows(shape)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize if len(shape) else dtype.itemsize
        if rows == 0 or row_bytes == 0:
            return 1
        rows_per_part = max(1, math.ceil(self.min_shard_bytes / row_bytes))
        # Floor, as TF does: a part never goes below the minimum by rounding up the count.
        n = max(1, rows // rows_per_part)
        return min(n, self.max_shards or n, rows)


class MaxSizePartitioner:
    """Split so each part holds at most ``max_shard_bytes`` (at most ``max_shards`` parts)."""

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None) -> None:
        _check_positive("max_shard_bytes", max_shard_bytes)
        _check_positive("max_shards", max_shards, allow_none=True)
        self.max_shard_bytes, self.max_shards = max_shard_bytes, max_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows = _rows(shape)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize if len(shape) else dtype.itemsize
        if rows == 0 or row_bytes == 0:
            return 1
        rows_per_part = max(1, self.max_shard_bytes // row_bytes)
        n = math.ceil(rows / rows_per_part)
        return max(1, min(n, self.max_shards or n, rows))


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]


def _split(specs: Sequence[TensorSpec], partitioner: Partitioner | None,
           small_tensor_bytes: int) -> list[Part]:
    """Unplaced parts (shard=-1), in the given tensor order; rows split like tensor_split.

    Tensors under ``small_tensor_bytes`` are never split: they are cheaper grouped than cut.
    """
    parts: list[Part] = []
    names: set[str] = set()
    for s in specs:
        n = 1
        if partitioner is not None and len(s.shape) >= 1 and s.nbytes >= small_tensor_bytes:
            n = int(partitioner(s.shape, s.dtype))
            if not 1 <= n <= max(1, s.shape[0]):
                raise ValueError(f"partitioner returned {n} parts for {s.name!r} of shape "
                                 f"{s.shape}; it must be between 1 and dim 0")
        rows = _rows(s.shape)
        row_bytes = s.nbytes // rows if rows else 0
        base, extra = divmod(rows, n)
        start = 0
        for i in range(n):
            r = base + (1 if i < extra else 0)
            key = s.name if n == 1 else f"{s.name}/part{i}of{n}"
            shape = s.shape if n == 1 else (r, *s.shape[1:])
            parts.append(Part(key, s.name, i, n, -1, start, start + r, shape,
                              s.nbytes if n == 1 else r * row_bytes))
            start += r
        if s.name in names:
            raise ValueError(f"tensor name {s.name!r} appears twice; names must be unique")
        names.add(s.name)
    keys = [p.key for p in parts]
    if len(set(keys)) != len(keys):
        raise ValueError("a tensor name collides with the '<name>/partIofN' name of a "
                         "partitioned tensor; rename it")
    return parts


def _with_shard(p: Part, shard: int) -> Part:
    return Part(p.key, p.name, p.index, p.num_parts, shard, p.row_start, p.row_end, p.shape,
                p.nbytes)


def greedy(specs: Sequence[TensorSpec], num_shards: int, *, small_tensor_bytes: int = 65536,
           partitioner: Partitioner | None = None) -> Placement:
    """Largest unit first onto the least-loaded shard; small tensors travel as one group."""
    _check_positive("num_shards", num_shards)
    parts = _split(specs, partitioner, small_tensor_bytes)
    small = [p for p in parts if p.nbytes < small_tensor_bytes]
    units: list[list[Part]] = [[p] for p in parts if p.nbytes >= small_tensor_bytes]
    if small:
        units.append(small)
    # Sort by (bytes desc, first key) so the order, hence the answer, is a function of the specs.
    units.sort(key=lambda u: (-sum(p.nbytes for p in u), u[0].key))
    loads = [0] * num_shards
    shard_of: dict[str, int] = {}
    for unit in units:
        shard = min(range(num_shards), key=lambda i: (loads[i], i))
        for p in unit:
            shard_of[p.key] = shard
        loads[shard] += sum(p.nbytes for p in unit)
    return Placement(tuple(_with_shard(p, shard_of[p.key]) for p in parts), num_shards)


def round_robin(specs: Sequence[TensorSpec], num_shards: int, *,
                small_tensor_bytes: int = 65536,
                partitioner: Partitioner | None = None) -> Placement:
    """Part ``i`` (in model order) on shard ``i % num_shards``: the byte-blind baseline."""
    _check_positive("num_shards", num_shards)
    parts = _split(specs, partitioner, small_tensor_bytes)
    return Placement(tuple(_with_shard(p, i % num_shards) for i, p in enumerate(parts)),
                     num_shards)


def place(specs: Sequence[TensorSpec], num_shards: int, *, strategy: str = "greedy",
          small_tensor_bytes: int = 65536, partitioner: Partitioner | None = None) -> Placement:
    if strategy == "greedy":
        return greedy(specs, num_shards, small_tensor_bytes=small_tensor_bytes,
                      partitioner=partitioner)
    if strategy == "round_robin":
        return round_robin(specs, num_shards, small_tensor_bytes=small_tensor_bytes,
                           partitioner=partitioner)
    raise ValueError(f"placement strategy must be 'greedy' or 'round_robin', got {strategy!r}")
