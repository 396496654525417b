"""Tensor plumbing the parts share: which tensors a model synchronises, flat buffers grouped
by dtype, averages, and per-rank gathers for checkpoints."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from ..comm import Comm, flatten, views

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["synced_tensors", "dtype_groups", "average_", "mean_copy", "gather_ranks",
           "load_rank", "local", "like", "dtensor_class", "is_dtensor"]

#: Where torch defines ``DTensor`` (``_tensor``: torch 2.4; later a re-export of ``tensor``).
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")
_dtensor: type[DTensor] | None = None


def dtensor_class() -> type[DTensor] | None:
    """torch's ``DTensor`` class if its module has been imported in this process, else None
    (and then no tensor can be a DTensor), without importing it.

    Why not import it: ``torch.distributed.tensor`` costs ~0.9 s of start-up (sympy and
    DTensor's op tables), and only ``sg.Sharded`` (FSDP2, which imports it) ever makes a
    DTensor. Processes that build no torch optimizer (CLI calls, the ``stratagem run``
    supervisor) now skip it; one that does still pays it there, from torch itself (torch
    2.13's ``Optimizer.add_param_group`` imports ``torch._dynamo``, which imports FSDP)."""
    global _dtensor
    if _dtensor is None:
        for name in _DTENSOR_MODULES:
            cls = getattr(sys.modules.get(name), "DTensor", None)
            if isinstance(cls, type):
                _dtensor = cls
                break
    return _dtensor


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (a sharded tensor of FSDP2), without importing DTensor."""
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a DTensor (a sharded parameter of
    FSDP2; writing into it writes the parameter), else ``t`` itself. Parts synchronise local
    shards with the peers holding the same shard."""
    return t.to_local() if is_dtensor(t) else t


def like(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local shard) as a tensor of ``reference``'s kind: a DTensor on the same
    mesh and placements when ``reference`` is one, else ``value``."""
    if not is_dtensor(reference):
        return value
    return type(reference).from_local(value, reference.device_mesh, reference.placements,
                                      run_check=False, shape=reference.shape,
                                      stride=reference.stride())


def synced_tensors(module: nn.Module, buffers: bool) -> tuple[list[str], list[torch.Tensor],
                                                               list[bool]]:
    """The module's unique parameters, then (if ``buffers``) its floating-point buffers, with
    their names and an is-parameter flag. Integer buffers (``num_batches_tracked``) are
    counters, not state to average: they stay local."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    is_param: list[bool] = []
    for n, p in module.named_parameters():
        names.append(n)
        tensors.append(p)
        is_param.append(True)
    if buffers:
        for n, b in module.named_buffers():
            if b.is_floating_point():
                names.append(n)
                tensors.append(b)
                is_param.append(False)
    return names, tensors, is_param


def dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device): one flat buffer / collective each."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def average_(comm: Comm, tensors: Sequence[torch.Tensor]) -> None:
    """Replace every tensor by its mean over the replicas: one all-reduce per dtype."""
    if comm.world_size == 1 or not tensors:
        return
    with torch.no_grad():
        comm.all_reduce_coalesced(tensors)
        torch._foreach_div_(list(tensors), comm.world_size)


def average_committed_(comm: Comm, tensors: Sequence[torch.Tensor]) -> bool:
    """:func:`average_` as one transaction of ``comm``: the means are computed in flat
    buffers and copied into ``tensors`` only when the transaction commits (a fault-tolerant
    Comm whose collective failed leaves the tensors as they were and returns False). On a
    plain Comm the result is :func:`average_`'s, bitwise."""
    comm.begin()
    if not tensors or (comm.world_size == 1 and not comm.in_transaction):
        return comm.commit()
    with torch.no_grad():
        flats = []
        for idx in dtype_groups(tensors):
            group = [tensors[i] for i in idx]
            flats.append((group, comm.all_reduce(flatten(group))))
        if not comm.commit():
            return False
        for group, flat in flats:
            flat.div_(comm.world_size)
            for t, v in zip(group, views(flat, group), strict=True):
                t.copy_(v)
    return True


def mean_copy(comm: Comm, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The replicas' mean of ``tensors`` as new tensors (the replicas are left untouched)."""
    out: list[torch.Tensor] = [t.detach().clone() for t in tensors]
    average_(comm, out)
    return out


def gather_ranks(comm: Comm, names: Sequence[str], tensors: Sequence[torch.Tensor],
                 prefix: str) -> dict[str, torch.Tensor]:
    """Every replica's ``tensors`` as ``{f"{prefix}.rank{r}/{name}": tensor}`` on every rank
    (collective: one all-gather per dtype). Used to checkpoint state only a worker holds."""
    out: dict[str, torch.Tensor] = {}
    for idx in dtype_groups(tensors):
        group = [tensors[i] for i in idx]
        flat = flatten(group)
        parts = comm.all_gather(flat) if comm.world_size > 1 else [flat]
        for r, part in enumerate(parts):
            for i, v in zip(idx, views(part, group), strict=True):
                out[f"{prefix}.rank{r}/{names[i]}"] = v
    return out


def load_rank(state: dict[str, torch.Tensor], prefix: str, rank: int, world_size: int,
              names: Sequence[str], tensors: Sequence[torch.Tensor]) -> bool:
    """Copy this rank's entries written by :func:`gather_ranks` into ``tensors``; only when
    the checkpoint was written by as many ranks as there are now (else returns False and the
    caller keeps the loaded model)."""
    ranks = {k.split("/", 1)[0] for k in state if k.startswith(f"{prefix}.rank")}
    if len(ranks) != world_size:
        return False
    keys = [f"{prefix}.rank{rank}/{n}" for n in names]
    if any(k not in state or state[k].shape != t.shape
           for k, t in zip(keys, tensors, strict=True)):
        return False
    with torch.no_grad():
        for k, t in zip(keys, tensors, strict=True):
            t.copy_(state[k])
    return True


def broadcast_buffers(comm: Comm, module: nn.Module) -> None:
    """Set every replica's (non-DTensor) buffers to rank 0's: one coalesced broadcast."""
    buffers = [b for b in module.buffers() if type(b) is torch.Tensor]
    if comm.world_size > 1 and buffers:
        with torch.no_grad():
            comm.broadcast_coalesced([b.data for b in buffers], src=0)
