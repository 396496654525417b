"""``Sharded``: fully sharded data parallelism on PyTorch FSDP2 (``fully_shard``).

ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) as PyTorch implements it in FSDP (Zhao et al., "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023) and its DTensor rewrite FSDP2:
every parameter, its gradient and its optimizer state are split along dim 0 into ``W`` row
blocks, one per replica. Before a unit's forward (and again before its backward when
``reshard_after_forward``) its parameters are all-gathered; after the backward its gradients
are reduce-scattered to their mean, so each replica holds the mean gradient of its own rows
and the optimizer (element-wise: SGD, Adam, AdamW...) updates its own rows only. The result
equals data parallelism (``Mirrored``) step for step, with per-replica memory for parameters +
gradients + optimizer state divided by ``W`` (plus one unit's gathered parameters at a time).

The mechanics live in :class:`FSDPSharding`, which takes a :class:`~stratagem.comm.Comm`
(the device mesh is built from ``comm.group``), so the same object can be one part of a
composed strategy (sharding inside a node, something else across nodes: HSDP).

What is CUDA-only: ``cpu_offload=True`` (FSDP2's ``CPUOffloadPolicy``: sharded parameters,
gradients and optimizer state live in pinned host memory and are copied to the GPU per unit)
needs a CUDA device; on a CPU job everything already is in host memory and the flag is
refused. Overlap of communication with compute through separate CUDA streams is a GPU
property too: on CPU + gloo the all-gathers and reduce-scatters run in line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parts import Plan
from ..parts.fsdp import (
    FSDPSharding,
    ShardModules,
    default_units,
    materialize_shards,
    release_host_memory,
    row_range,
)
from ..strategy import Strategy

__all__ = ["Sharded", "FSDPSharding", "ShardModules", "row_range", "release_host_memory",
           "materialize_shards", "default_units"]


class Sharded(Strategy):
    """Fully sharded data parallelism (ZeRO-3) on FSDP2: same steps as :class:`Mirrored`,
    per-replica parameter + gradient + optimizer memory divided by the number of replicas.

    Arguments: ``reshard_after_forward`` (free a unit's gathered parameters after its
    forward and gather them again for the backward: less memory, one more all-gather per
    step; the root is never resharded, as in ``fully_shard``'s default), ``shard_modules``
    (which submodules become FSDP units: classes such as your transformer block, or a
    predicate ``module -> bool``; default: each child holding a sizeable share of the
    parameters, see :func:`default_units`, then the root), ``cpu_offload`` (CUDA only: keep
    shards in pinned host memory), ``reduce_precision`` (the dtype of the gradient
    reduce-scatter under bf16/fp16: by default the same 16-bit type; ``"fp32"`` reduces in
    float32), ``release_host_memory`` (CPU jobs: have glibc return the per-step gathered
    buffers to the OS, see :func:`release_host_memory`, so resident memory stays at the
    shards' size; process-wide; ``False`` leaves the allocator alone), plus the common
    strategy arguments.
    ``precision="bf16"``/``"fp16"`` becomes FSDP2's ``MixedPrecisionPolicy``: units compute
    with 16-bit copies of the parameters, the sharded master parameters, gradients and
    optimizer state stay float32.

    On failure: a dead or stalled peer makes an all-gather or reduce-scatter fail within
    the process group's timeout (``timeout``); in ``strategy.backward`` that becomes
    ``PeerTimeoutError`` naming the peer, while a failure of a forward's all-gather surfaces
    as torch's own error from ``model(x)`` (FSDP2 gathers in a pre-forward hook, outside
    anything stratagem wraps). A non-finite gradient in any replica's rows is agreed on
    by all (one all-reduce of a flag): all skip the step (fp16 loss scaling,
    ``on_nonfinite="skip"``) or all raise ``FloatingPointError``.

    Memory per replica: ``1/W`` of the parameters, gradients and optimizer state, plus the
    gathered parameters of the unit(s) in flight. ``eval_model`` gathers a full copy (one
    all-gather per parameter, the whole model held by every replica while it is kept).
    """

    name = "sharded"

    def __init__(self, *, reshard_after_forward: bool = True, shard_modules: ShardModules = None,
                 cpu_offload: bool = False, reduce_precision: str | None = None,
                 release_host_memory: bool = True, **kwargs: Any) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got "
                            f"{reshard_after_forward!r}")
        if shard_modules is not None and not callable(shard_modules) and not (
                isinstance(shard_modules, (list, tuple))
                and all(isinstance(c, type) and issubclass(c, nn.Module) for c in shard_modules)):
            raise TypeError(f"shard_modules must be None, a list of nn.Module classes or a "
                            f"predicate module -> bool, got {shard_modules!r}. Fix: pass e.g. "
                            "shard_modules=[Block]")
        if not isinstance(release_host_memory, bool):
            raise TypeError(f"release_host_memory must be True or False, got "
                            f"{release_host_memory!r}")
        if reduce_precision not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"reduce_precision must be None, 'fp32', 'bf16' or 'fp16', got "
                             f"{reduce_precision!r}")
        self.reshard_after_forward = reshard_after_forward
        self.shard_modules = shard_modules
        self.cpu_offload = cpu_offload
        self.reduce_precision = reduce_precision
        self.release_host_memory = release_host_memory
        super().__init__(**kwargs)
        if cpu_offload and self.device.type != "cuda":
            raise ValueError(
                f"cpu_offload=True keeps the shards in pinned host memory and copies them to "
                f"the GPU unit by unit; it needs a CUDA device, got device={self.device}. Fix: "
                "drop cpu_offload on a CPU job (its tensors already live in host memory)")

    def plan(self) -> Plan:
        """One :class:`FSDPSharding` part that is the whole strategy (it checkpoints its
        shards and gathers them for ``eval_model``)."""
        return self.layer_plan(standalone=True)

    def layer_plan(self, standalone: bool = False) -> Plan:
        """The FSDP2 part; as ``Hierarchical``'s inner layer the outer layer keeps the model."""
        dtype = self.precision.dtype
        reduce_dtype = ({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
                        [self.reduce_precision] if self.reduce_precision is not None else dtype)
        return Plan(FSDPSharding.spec(
            device=self.device, reshard_after_forward=self.reshard_after_forward,
            shard_modules=self.shard_modules, cpu_offload=self.cpu_offload, param_dtype=dtype,
            reduce_dtype=reduce_dtype, release_host_memory=self.release_host_memory,
            standalone=standalone))

    @property
    def sharding(self) -> FSDPSharding:
        """The FSDP2 part this strategy is made of."""
        part = self.parts[0]
        assert isinstance(part, FSDPSharding)
        return part
