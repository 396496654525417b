"""Synchronous gradient all-reduce on torch ``DistributedDataParallel``, over a given Comm.

Gradients are all-reduced in buckets during the backward pass (overlapping compute), so after
the backward every replica of the Comm holds the same mean gradient. Three communication
paths, chosen once per model in ``wrap_model``:

- **Plain dense model, no compression**: DDP's built-in C++ all-reduce, no Python on the
  gradient path. Bytes are counted analytically (ring all-reduce of every parameter DDP
  reduces, once per synchronising backward) from one forward pre-hook. Measured on this
  2-core machine (2 gloo processes, MLP 784-256-256-10, 40 alternating ABBA rounds of 20
  steps): a Python comm hook costs +4..7 % step time against raw DDP, the counting hook
  +0.6..3 % (noise of a few % per round).
- **Compression** (``"fp16"`` / ``"bf16"``): a Python comm hook divides each bucket by the
  world size *before* casting it to 16 bits (the sum of the casts cannot overflow where the
  fp32 mean would not) and all-reduces the cast: half the bytes (Micikevicius et al. 2018;
  DDP's ``fp16_compress_hook``). With error feedback the part of each bucket the cast lost is
  kept and added before the next cast (Seide et al. 2014; Karimireddy et al. 2019). An fp16
  overflow becomes ``inf`` on every replica (the all-reduce spreads it), so the strategy's
  non-finite check skips the step everywhere or raises.
- **Sparse gradients** (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``): DDP
  puts each such parameter in a bucket of its own and hands the hook the sparse gradient;
  gloo's sparse all-reduce exchanges indices and values (never densified), so the bytes
  scale with the rows touched. Sparse buckets are never cast. NCCL has no sparse all-reduce.
"""

# No "from __future__ import annotations": DDP checks the comm hook's annotations at run time.

import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..comm import Comm
from ..compression import ErrorFeedback, compress
from .base import Capability, Part
from .tensors import broadcast_buffers, gather_ranks, load_rank

if TYPE_CHECKING:
    from ..strategy import Prepared

__all__ = ["GradientSync", "check_sync_batchnorm"]

#: Checkpoint key prefix of the error-feedback residuals (per rank: ``ef_residual.rank{r}/``).
_EF_KEY = "ef_residual"

#: DDP's ``init_sync`` (torch >= 2.5; the package supports torch >= 2.4): whether its
#: constructor checks the parameter shapes across ranks and broadcasts rank 0's parameters and
#: buffers. Without it, those collectives always run.
_DDP_TAKES_INIT_SYNC = "init_sync" in inspect.signature(DDP.__init__).parameters


class _HookState:
    """What the comm hook needs: the communicator, the compression, the error-feedback
    residuals, the current loss scale (residuals are kept unscaled) and the per-parameter
    residuals restored from a checkpoint (``id(param) -> flat tensor``), which seed a
    bucket's residual the first time that bucket is compressed."""

    def __init__(self, comm: Comm, kind: "str | None", feedback: "ErrorFeedback | None",
                 scale_fn: Callable[[], float]) -> None:
        self.comm = comm
        self.kind = kind
        self.feedback = feedback
        self.scale_fn = scale_fn
        self.restored: dict[int, torch.Tensor] = {}
        self.sizes: dict[int, int] = {}  # id(param) -> numel, of the buckets seen


def _allreduce_hook(state: _HookState,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one bucket to its mean (compressed when asked), counting bytes and time."""
    comm = state.comm
    buf = bucket.buffer()
    if buf.is_sparse:
        return _sparse_allreduce(comm, buf)
    # Divide first, in the gradient's own precision: the cast then sees the per-replica share.
    buf.div_(comm.world_size)
    if state.kind is None:
        send = buf
    elif state.feedback is not None:
        if bucket.index() == 0:
            # DDP reduces buckets in index order: a new backward. Residuals still pending are
            # from a step the strategy skipped; they must not be committed.
            state.feedback.discard()
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        if state.feedback.residual(key) is None:
            _seed_residual(state, key, [p.numel() for p in params], buf)
        send, _ = state.feedback.compress(key, buf, scale=state.scale_fn())
    else:
        send, _ = compress(buf, state.kind)
    if send is buf:
        return comm.all_reduce_async(buf)

    def decompress(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        buf.copy_(f.value())
        return buf

    return comm.all_reduce_async(send).then(decompress)


def _seed_residual(state: _HookState, key: tuple[int, ...], sizes: list[int],
                   buf: torch.Tensor) -> None:
    """A bucket compressed for the first time takes its parameters' residuals from a restored
    checkpoint, or from the buckets that held them before (DDP regroups its buckets once,
    after the first backward): nothing the casts dropped is lost to a regrouping or a
    restore."""
    assert state.feedback is not None
    state.sizes.update(zip(key, sizes))
    pieces: dict[int, torch.Tensor] = dict(state.restored)
    for other in state.feedback.keys():
        flat = state.feedback.residual(other)
        if flat is None or not isinstance(other, tuple):
            continue
        offset = 0
        for i in other:
            n = state.sizes.get(i)
            if n is None:
                break
            pieces.setdefault(i, flat[offset:offset + n])
            offset += n
    for i in key:
        state.restored.pop(i, None)
    parts = [pieces.get(i) for i in key]
    if any(t is None for t in parts):
        return
    seeded = torch.cat([t.reshape(-1) for t in parts if t is not None])
    if seeded.numel() == buf.numel():
        state.feedback.seed(key, seeded.to(buf.dtype))


def _sparse_allreduce(comm: Comm, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Mean of a sparse COO gradient across replicas through gloo's sparse all-reduce.

    Gloo all-gathers each rank's coalesced indices and values (sizes first) and sums them:
    a rank sends its rows to the ``W - 1`` others. Counted as ``(W - 1) * payload`` sent and
    received per rank (exact summed over ranks; per rank it assumes equal row counts).
    """
    world = comm.world_size
    local = grad.coalesce()
    local = local / world
    indices, values = local._indices(), local._values()
    payload = indices.numel() * indices.element_size() + values.numel() * values.element_size()
    return comm.all_reduce_async(local, nbytes=(world - 1) * payload)


def _has_sparse_gradients(module: nn.Module) -> bool:
    # The same rule DDP uses to give a parameter a sparse bucket of its own.
    return any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
               for m in module.modules())


class _Released:
    """Stands in for a closed DDP wrapper's reducer: using the wrapper after
    ``strategy.close()`` says so instead of failing somewhere inside DDP."""

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(
            "this DistributedDataParallel model belongs to a closed Mirrored strategy (its "
            "process group was released by strategy.close() or at exit). Fix: evaluate "
            "strategy.eval_model(model) / strategy.unwrap(model), or build a new strategy "
            "and prepare the model again")


def _release_wrappers(wrappers: "weakref.WeakSet[DDP]") -> None:
    """Let DDP wrappers go of the process group (their C++ reducer holds it), so closing the
    Comm can destroy the group and join its threads."""
    for ddp in list(wrappers):
        ddp.__dict__["reducer"] = _Released()
        ddp.__dict__["logger"] = _Released()
        ddp.__dict__["process_group"] = None
    wrappers.clear()


#: Whether this torch's DDP reducer can fix its bucket layout before the first backward.
_CAN_PIN_LAYOUT = all(hasattr(torch._C._distributed_c10d.Reducer, name)
                      for name in ("_push_all_rebuilt_params", "_rebuild_buckets"))


def _pin_bucket_layout(ddp: DDP, *, required: bool = True) -> bool:
    """Build ``ddp``'s final buckets now, from its parameters in registration order, instead
    of after the first backward from the order their gradients became ready: the layout then
    depends on the model alone, so a replica that joins late lines up with its peers. DDP
    launches a bucket's all-reduce once every earlier bucket's is launched, so this layout
    overlaps less communication with the backward than DDP's rebuilt one (for a model of one
    bucket there is nothing to overlap). False (``required=False``) where DDP refused."""
    ddp.reducer._push_all_rebuilt_params()
    if ddp.reducer._rebuild_buckets():
        return True
    if not required:
        return False
    raise RuntimeError(
        "DDP did not accept a fixed bucket layout (a static_graph model?), which a "
        "fault-tolerant replica needs. Fix: pass find_unused_parameters=True to the "
        "strategy")


def _one_bucket(module: nn.Module, bucket_cap_mb: float) -> bool:
    """Whether DDP puts every gradient of ``module`` in one bucket (its first bucket's cap
    is the smaller, ``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
    size = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return size <= min(first, bucket_cap_mb * (1 << 20))


class GradientSync(Part):
    """All-reduce the gradients over ``comm`` during the backward, with DDP.

    ``compression`` (None, "fp16", "bf16") and ``error_feedback`` as described in the module
    docstring; ``bucket_cap_mb`` and ``find_unused_parameters`` are DDP's. ``init_sync=False``
    skips DDP's own check of the parameter shapes and broadcast of rank 0's state at wrap time,
    for a caller that has already made the replicas equal over a group holding this ``comm``
    (``Strategy.prepare`` does: its replica check and broadcast run before ``wrap_model``);
    with a torch whose DDP lacks the flag, DDP's broadcast still runs. The owning
    strategy's loss scale is read at each compressed bucket (residuals are kept unscaled).
    On failure a dead or stalled peer makes the all-reduce fail within the Comm's timeout and
    the backward raises ``PeerTimeoutError`` naming it. Memory: DDP's buckets (at most one
    extra copy of the gradients), plus one fp32 copy for error-feedback residuals.
    """

    name = "gradient_sync"
    provides = frozenset({Capability.SYNCHRONOUS_STEP, Capability.TRANSACTIONS,
                          Capability.KEEPS_GLOBAL_BATCH, Capability.INNER})

    def __init__(self, comm: Comm, *, bucket_cap_mb: float = 25,
                 compression: "str | None" = None, error_feedback: bool = False,
                 find_unused_parameters: bool = False, init_sync: bool = True) -> None:
        super().__init__(comm)
        self.init_sync = init_sync
        self.bucket_cap_mb = bucket_cap_mb
        self.compression = compression
        self.error_feedback = error_feedback
        self.find_unused_parameters = find_unused_parameters
        self._feedback: list[ErrorFeedback] = []
        self._hook_states: list[_HookState] = []
        self._wrappers: weakref.WeakSet[DDP] = weakref.WeakSet()
        wrappers = self._wrappers  # the callback must not keep the part alive
        comm.on_close(lambda: _release_wrappers(wrappers))

    def _scale(self) -> float:
        return self.strategy.precision.scale if self.strategy is not None else 1.0

    def wrap_model(self, model: nn.Module, module: nn.Module) -> nn.Module:
        # A fault-tolerant Comm may be a world of one now and grow later: always wrap.
        if self.comm.world_size == 1 and not self.comm.elastic:
            return model
        device = module_device(module)
        check_sync_batchnorm(self.comm, module, device)
        extra: dict[str, Any] = {}
        if not self.init_sync and _DDP_TAKES_INIT_SYNC:
            extra["init_sync"] = False
        # A fault-tolerant Comm admits replicas whose DDP is new: DDP re-orders its buckets
        # after its first backward (by the order the gradients became ready), so a new
        # replica's first buckets would not line up with its peers' and the all-reduce would
        # add up different parameters' gradients. Every replica's layout is therefore fixed
        # at wrap time, from the parameters' order alone (_pin_bucket_layout); with a torch
        # that cannot, find_unused_parameters keeps DDP's first layout (at the price of a
        # graph traversal per forward).
        pin = self.comm.elastic and not self.find_unused_parameters
        # A model of one bucket gets its final layout at once too (DDP's first layout and
        # its rebuilt one differ in the order of the parameters inside the bucket, so on
        # three replicas or more, where a ring all-reduce adds each element's terms in an
        # order that depends on its place, a run resumed from a checkpoint summed its first
        # step in another order than the run it continues; pinned, every step of every run
        # has the same layout and a resumed run is bitwise the uninterrupted one). With one
        # bucket there is no communication to overlap, so this costs nothing.
        settle = (not pin and not self.find_unused_parameters and _CAN_PIN_LAYOUT
                  and _one_bucket(module, self.bucket_cap_mb))
        # The built-in path needs every reduced parameter to get a gradient in every
        # backward (true unless find_unused_parameters) for the byte counter, and dense
        # gradients (a sparse payload depends on the rows touched).
        # Under a fault-tolerant Comm DDP's own group is a world of one: the gradients travel
        # through the hook, on the quorum's group.
        builtin = (self.compression is None and not self.find_unused_parameters
                   and not _has_sparse_gradients(module) and not self.comm.elastic)
        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.comm.ddp_group(),
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters or (pin and not _CAN_PIN_LAYOUT),
            # On the built-in path the gradients are views of DDP's buckets: no copy of the
            # reduced bucket back into them, and the step's non-finite check reads the
            # bucket the all-reduce has just written.
            gradient_as_bucket_view=builtin,
            **extra,
        )
        if pin and _CAN_PIN_LAYOUT:
            _pin_bucket_layout(ddp)
        elif settle:
            _pin_bucket_layout(ddp, required=False)
        self._wrappers.add(ddp)
        if builtin:
            _count_builtin_allreduce(self.comm, ddp)
            return ddp
        feedback = None
        if self.error_feedback:
            assert self.compression is not None
            feedback = ErrorFeedback(self.compression, deferred=True)
            self._feedback.append(feedback)
        state = _HookState(self.comm, self.compression, feedback, self._scale)
        if feedback is not None:
            self._hook_states.append(state)
        ddp.register_comm_hook(state, _allreduce_hook)
        return ddp

    def set_grad_sync(self, prepared: "Prepared", enabled: bool) -> None:
        model = prepared.model
        while not isinstance(model, DDP):
            inner = getattr(model, "module", None)
            if not isinstance(inner, nn.Module) or inner is model:
                return
            model = inner
        model.require_backward_grad_sync = enabled

    def syncs_at(self, prepared: "Prepared", step: int) -> bool:
        return True

    def after_update(self, prepared: "Prepared") -> None:
        # The residuals computed in this step's backward belong to the update just applied.
        for feedback in self._feedback:
            feedback.commit(prune=True)

    def finalize(self, prepared: "Prepared") -> None:
        """Broadcast rank 0's buffers (BatchNorm running statistics), as DDP does before
        each training forward: after the last forward every replica's statistics include its
        own last batch, so without this ``eval_model`` on rank r > 0 would evaluate slightly
        different statistics than the checkpoint (rank 0's) holds."""
        broadcast_buffers(self.comm, prepared.module)

    def loaded(self, prepared: "Prepared") -> None:
        for feedback in self._feedback:
            feedback.reset()  # residuals of the pre-restore trajectory do not apply
        for state in self._hook_states:
            state.restored = {}

    def _residuals(self, prepared: "Prepared") -> "tuple[list[str], list[torch.Tensor]]":
        """This replica's committed error-feedback residual per parameter (zeros where there
        is none yet), cut out of the bucket residuals (a bucket's buffer is its parameters'
        gradients one after the other, in ``bucket.parameters()`` order)."""
        by_id: dict[int, torch.Tensor] = {}
        for feedback in self._feedback:
            for key in feedback.keys():
                flat = feedback.residual(key)
                if flat is None or not isinstance(key, tuple):
                    continue
                offset = 0
                params = {id(p): p for p in prepared.module.parameters()}
                for i in key:
                    p = params.get(i)
                    if p is None:
                        break
                    by_id[i] = flat[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
        names, tensors = [], []
        for name, p in prepared.module.named_parameters():
            if p.requires_grad:
                names.append(name)
                tensors.append(by_id.get(id(p), torch.zeros_like(p)))
        return names, tensors

    def extra_state(self, prepared: "Prepared") -> "dict[str, torch.Tensor]":
        if not self._feedback:
            return {}
        # Per replica: each one's residual is what its own compressed gradients lost.
        names, tensors = self._residuals(prepared)
        return gather_ranks(self.comm, names, tensors, _EF_KEY)

    def load_extra_state(self, prepared: "Prepared", state: "dict[str, torch.Tensor]") -> None:
        if not self._hook_states:
            return
        names, tensors = self._residuals(prepared)
        fresh = [torch.zeros_like(t) for t in tensors]
        if not load_rank(state, _EF_KEY, self.comm.rank, self.comm.world_size, names, fresh):
            return  # another strategy or world size wrote it: residuals start at zero
        params = dict(prepared.module.named_parameters())
        restored = {id(params[n]): t for n, t in zip(names, fresh)}
        for hook_state in self._hook_states:
            hook_state.restored = dict(restored)

    def metrics(self) -> dict[str, Any]:
        if not self._feedback:
            return {}
        return {"error_feedback_norm": sum(f.residual_norm() for f in self._feedback)}


def check_sync_batchnorm(comm: Comm, module: nn.Module, device: torch.device) -> None:
    """Point every ``nn.SyncBatchNorm`` of ``module`` at ``comm``'s process group (torch's
    default is the global group, which is not the strategy's under ``Hierarchical`` or with
    ``comm=``), or refuse where torch's SyncBatchNorm cannot synchronise: it runs on CUDA
    (and XPU/HPU) tensors only, and synchronises only when torch.distributed's default group
    is initialised (a launched worker; not ranks run as threads)."""
    syncs = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    if not syncs or comm.world_size == 1:
        return
    if device.type == "cpu":
        raise ValueError(
            f"the model has {len(syncs)} nn.SyncBatchNorm layer(s), which torch runs on GPU "
            f"tensors only, and this strategy's device is {device}. Fix: keep nn.BatchNorm on "
            "the CPU (Mirrored keeps rank 0's running statistics, broadcast by DDP before "
            "each training forward; see docs/guide.md, BatchNorm and buffers), or convert "
            "with nn.SyncBatchNorm.convert_sync_batchnorm only when training on CUDA")
    if not dist.is_initialized():
        raise ValueError(
            f"the model has {len(syncs)} nn.SyncBatchNorm layer(s), and torch's SyncBatchNorm "
            "synchronises only once torch.distributed's default process group is initialised "
            "(it would silently compute per-replica statistics here). Fix: launch the job "
            "(stratagem run / sg.launch / torchrun: the first strategy initialises the group), "
            "or keep nn.BatchNorm")
    if comm.group is None:
        return
    for m in syncs:
        m.process_group = comm.group


def module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _count_builtin_allreduce(comm: Comm, ddp: DDP) -> None:
    """Count the bytes of DDP's C++ all-reduce: every reduced parameter once per synchronising
    backward, as a ring all-reduce (DDP's buckets partition them).

    Counted at the forward that arms the reduction, on DDP's own condition (grad mode and
    ``require_backward_grad_sync``): a forward pre-hook costs one Python call per step and
    stays off the autograd path. Over-counts only a grad-mode forward never followed by a
    backward.
    """
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    params = [p for n, p in ddp.module.named_parameters()
              if p.requires_grad and n not in ignored]
    if not params:
        return
    nbytes = comm.allreduce_bytes(sum(p.numel() * p.element_size() for p in params))

    def count(module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            comm.account(nbytes, nbytes)
            comm.num_collectives += 1  # progress for the peer diagnosis

    ddp.register_forward_pre_hook(count)
