"""Replica operations on values, not models: ``reduce`` and ``gather`` of tensors, numbers
and nested containers across replicas, and the agreement check (``agree``) that raises
``ReplicaMismatchError`` naming the first difference and the ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from torch import nn

from .comm import Comm
from .errors import ReplicaMismatchError

__all__ = ["ReduceOp", "ReplicaOps", "normalize_op"]


class ReduceOp(str, Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


def normalize_op(op: Any) -> str:
    value = op.value if isinstance(op, ReduceOp) else str(op).lower()
    if value not in ("sum", "mean", "max", "min"):
        raise ValueError(f"reduce op must be one of sum, mean, max, min (or sg.ReduceOp), got {op!r}")
    return value


class ReplicaOps:
    """``reduce`` / ``gather`` / ``agree`` over the Comm ``comm()`` returns, among
    ``replicas()`` replicas (a fault-tolerant job's quorum changes between calls)."""

    def __init__(self, comm: Callable[[], Comm], replicas: Callable[[], int],
                 device: torch.device) -> None:
        self._comm, self._replicas, self.device = comm, replicas, device

    def check_model(self, model: nn.Module, comm: Comm | None = None) -> None:
        """Every replica (of ``comm``) built the same parameter and buffer names, shapes and
        dtypes; else ``ReplicaMismatchError`` naming the first difference."""
        entries = [[f"param:{n}", list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
        entries += [[f"buffer:{n}", list(b.shape), str(b.dtype)] for n, b in model.named_buffers()]
        self.agree(entries, "the model", comm)

    def agree(self, signature: Any, what: str, comm: Comm | None = None) -> None:
        """Raise ``ReplicaMismatchError`` on every rank (of ``comm``; by default the
        strategy's) unless all pass an equal ``signature`` (JSON-able). One 32-byte
        all-gather when they agree."""
        if (self._replicas() if comm is None else comm.world_size) == 1:
            return
        comm = self._comm() if comm is None else comm
        text = json.dumps(signature, separators=(",", ":"))
        if comm.all_equal(text.encode()):
            return
        sigs = [json.loads(b.decode()) for b in comm.all_gather_bytes(text.encode())]
        raise ReplicaMismatchError(_describe_mismatch(sigs, what))

    def reduce(self, op: Any, value: Any) -> Any:
        op = normalize_op(op)
        leaves, rebuild = _flatten(value)
        tensors: list[torch.Tensor] = []
        kinds: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                kinds.append(("tensor", t.device, t.dtype))
                if op == "mean" and not t.is_floating_point():
                    t = t.to(torch.get_default_dtype())
                tensors.append(t.to("cpu" if self.device.type == "cpu" else self.device).reshape(-1).clone())
            elif isinstance(leaf, (bool, int, float)):
                kinds.append(("number", type(leaf)))
                is_int = isinstance(leaf, int) and op != "mean"
                tensors.append(torch.tensor([leaf], dtype=torch.int64 if is_int else torch.float64))
            else:
                raise TypeError(f"reduce handles tensors, numbers and nested dict/list/tuple; "
                                f"got {type(leaf).__name__}")
        replicas = self._replicas()
        if replicas > 1:
            self.agree([[str(t.dtype), t.numel()] for t in tensors] + [_shape_sig(leaves)],
                       f"reduce({op!r}) values")
            self._comm().all_reduce_coalesced(tensors, "sum" if op == "mean" else op)
            if op == "mean":
                for t in tensors:
                    t.div_(replicas)
        out: list[Any] = []
        for leaf, kind, t in zip(leaves, kinds, tensors):
            if kind[0] == "tensor":
                out.append(t.reshape(leaf.shape).to(kind[1]))
            else:
                v = t.item()
                out.append(kind[1](v) if (kind[1] is int and op != "mean") else float(v))
        return rebuild(out)

    def gather(self, value: Any, axis: int = 0) -> Any:
        leaves, rebuild = _flatten(value)
        out = []
        for leaf in leaves:
            t = leaf.detach() if isinstance(leaf, torch.Tensor) else torch.tensor([leaf])
            if t.dim() == 0:
                t = t.reshape(1)
            out.append(self._gather_tensor(t, axis))
        return rebuild(out)

    def _gather_tensor(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        if self._replicas() == 1:
            return t.clone()
        axis = axis % t.dim()
        moved = t.movedim(axis, 0).contiguous()
        rest = list(moved.shape[1:])
        self.agree([str(t.dtype), rest, t.dim()], f"gather(axis={axis}) values")
        device = moved.device
        comm = self._comm()
        sizes = [int(s.item()) for s in comm.all_gather(torch.tensor([moved.shape[0]]))]
        padded = torch.zeros([max(sizes)] + rest, dtype=moved.dtype)
        padded[: moved.shape[0]] = moved.cpu()
        parts = comm.all_gather(padded)
        result = torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)
        return result.movedim(0, axis).to(device)


def _flatten(value: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Leaves of a nested dict/list/tuple and a function rebuilding it from new leaves."""
    if isinstance(value, dict):
        keys = list(value.keys())
        parts = [_flatten(value[k]) for k in keys]
        leaves = [leaf for p in parts for leaf in p[0]]

        def rebuild_dict(new: list[Any]) -> Any:
            out, i = {}, 0
            for k, (sub, rb) in zip(keys, parts):
                out[k] = rb(new[i:i + len(sub)])
                i += len(sub)
            return type(value)(out) if type(value) is not dict else out
        return leaves, rebuild_dict
    if isinstance(value, (list, tuple)):
        parts = [_flatten(v) for v in value]
        leaves = [leaf for p in parts for leaf in p[0]]

        def rebuild_seq(new: list[Any]) -> Any:
            items, i = [], 0
            for sub, rb in parts:
                items.append(rb(new[i:i + len(sub)]))
                i += len(sub)
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*items)
            return type(value)(items)
        return leaves, rebuild_seq
    return [value], lambda new: new[0]


def _shape_sig(leaves: list[Any]) -> list[Any]:
    return [list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves]


def _describe_mismatch(sigs: list[Any], what: str) -> str:
    ref = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        if isinstance(ref, list) and isinstance(sig, list):
            for i, (a, b) in enumerate(zip(ref, sig)):
                if a != b:
                    return (f"replicas disagree on {what}: entry {i} is {a} on rank 0 but {b} on "
                            f"rank {rank}. Fix: build the same model / pass the same structure "
                            "on every replica (same code, same config).")
            return (f"replicas disagree on {what}: rank 0 has {len(ref)} entries, rank {rank} has "
                    f"{len(sig)} (first extra: {(ref if len(ref) > len(sig) else sig)[min(len(ref), len(sig))]}). "
                    "Fix: build the same model / pass the same structure on every replica.")
        return f"replicas disagree on {what}: rank 0 has {ref}, rank {rank} has {sig}"
    return f"replicas disagree on {what}"


