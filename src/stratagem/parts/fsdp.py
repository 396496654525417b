"""``FSDPSharding``: the part of fully sharded data parallelism on PyTorch FSDP2
(``fully_shard``), which ``Sharded`` is made of.

The algorithm (ZeRO stage 3 on FSDP2), its papers and what is CUDA-only are described in
:mod:`stratagem.strategies.sharded`; this module is its mechanism.

The mechanics live in :class:`FSDPSharding`, which takes a :class:`~stratagem.comm.Comm`
(the device mesh is built from ``comm.group``), so the same object can be one part of a
composed strategy (sharding inside a node, something else across nodes: HSDP).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# torch.distributed.fsdp and torch.distributed.tensor are imported in the functions that use
# them: importing them costs ~0.9 s (see parts.tensors.dtensor_class), and this module is
# also imported for its helpers (row_range, release_host_memory) without any sharding.
from ..comm import Comm
from .base import Capability, Part
from .grad_sync import check_sync_batchnorm
from .tensors import broadcast_buffers, is_dtensor

if TYPE_CHECKING:
    from ..strategy import Prepared

__all__ = ["FSDPSharding", "ShardModules", "row_range", "release_host_memory",
           "materialize_shards", "default_units"]

#: Which submodules become FSDP units: classes (every instance below the root), or a
#: predicate ``module -> bool``. ``None``: the default rule of :func:`default_units`.
ShardModules = Sequence[type] | Callable[[nn.Module], bool] | None

#: A module holding at least this share of the parameters becomes a unit of its own under
#: the default rule (a container holding more than ``_DESCEND_SHARE`` is split further).
_UNIT_SHARE = 0.02
_DESCEND_SHARE = 0.5


#: glibc's ``M_MMAP_THRESHOLD`` (``malloc.h``) and the value ``release_host_memory`` sets:
#: host tensors of 1 MiB or more get pages of their own, returned to the OS when freed.
_M_MMAP_THRESHOLD = -3
_HOST_MMAP_THRESHOLD = 1 << 20


def release_host_memory() -> bool:
    """Make glibc give freed blocks of 1 MiB or more back to the operating system (a fixed
    mmap threshold) for the rest of the process; False where it does not apply (not glibc).

    FSDP2 on CPU allocates and frees every unit's gathered parameters and gradients on each
    step. With glibc's default, the mmap threshold rises to the size of the largest block
    freed (up to 32 MiB), so those blocks then come from the heap, which fragments: measured
    on the 105 M-parameter GPT of ``benchmarks/sharded_memory.py`` on 2 processes, resident
    memory grew step after step to Mirrored's level (2.37 GiB after 6 steps) instead of
    staying at the shards' 1.16 GiB. The cost is a page fault per 4 KiB page of each such
    block, the same for a hand-written ``fully_shard`` loop in the process."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _HOST_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dim-0 sharded tensor held by ``rank``: ``torch.chunk``
    blocks of ``ceil(rows / world_size)``, the last ranks possibly short or empty (DTensor's
    ``Shard(0)`` and FSDP2 split this way)."""
    block = -(-rows // world_size) if rows else 0
    start = min(rank * block, rows)
    return start, min(start + block, rows)


def _numel(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def default_units(root: nn.Module) -> list[nn.Module]:
    """The submodules the default rule makes FSDP units, outermost first.

    A module becomes a unit when it holds at least 2 % of the model's parameters; a module
    holding more than half of them that has children (a container: the ``ModuleList`` of
    transformer blocks, a ``transformer`` trunk) is split into its children instead. A module
    sharing a parameter with the rest of the model (tied weights: GPT's embedding and output
    head) is never a unit of its own: FSDP2 manages each parameter in exactly one unit, so a
    tied parameter stays with the root, which holds both users."""
    params = {id(p): p for p in root.parameters()}
    total = _numel(params.values())
    if total == 0:
        return []
    owners = _owners(root)

    def shares_outside(module: nn.Module) -> bool:
        return _shared_outside(module, owners) is not None

    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            held = _numel({id(p): p for p in child.parameters()}.values())
            if held == 0:
                continue
            has_children = any(True for _ in child.children())
            if held > _DESCEND_SHARE * total and has_children:
                visit(child)
            elif held >= _UNIT_SHARE * total and not shares_outside(child):
                units.append(child)
            elif has_children:
                visit(child)

    visit(root)
    return units


def _owners(root: nn.Module) -> dict[int, int]:
    """How many (module, attribute) slots hold each parameter (2 for a tied one)."""
    owners: dict[int, int] = {}
    for module in root.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return owners


def _shared_outside(module: nn.Module, owners: dict[int, int]) -> str | None:
    """The name (in ``module``) of a parameter also used outside ``module``, if any."""
    inside: dict[int, int] = {}
    names: dict[int, str] = {}
    for name, sub in module.named_modules():
        for pname, p in sub.named_parameters(recurse=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
            names.setdefault(id(p), f"{name}.{pname}" if name else pname)
    return next((names[i] for i, n in inside.items() if owners[i] != n), None)


def _chosen_units(root: nn.Module, shard_modules: ShardModules) -> list[nn.Module]:
    if shard_modules is None:
        return default_units(root)
    if callable(shard_modules) and not isinstance(shard_modules, (list, tuple)):
        predicate = shard_modules
    else:
        classes = tuple(shard_modules)
        def predicate(m: nn.Module) -> bool:
            return isinstance(m, classes)
    units = [m for m in root.modules() if m is not root and predicate(m)]
    owners = _owners(root)
    for unit in units:
        shared = _shared_outside(unit, owners)
        if shared is not None:
            raise ValueError(
                f"shard_modules selects a {type(unit).__name__} whose parameter {shared!r} is "
                "also used outside it (tied weights); FSDP2 manages each parameter in exactly "
                "one unit. Fix: leave that module out of shard_modules (the root then holds "
                "the tied parameter), e.g. shard only the transformer blocks")
    return units


def _registered(comm: Comm) -> dist.ProcessGroup:
    """``comm.group``, which must be a group torch.distributed knows: ``DeviceMesh.from_group``
    looks it up in torch.distributed's registry. The job's group and the sub-groups
    ``Comm.split`` makes of it (the node groups of ``Hierarchical``) are registered; the
    groups of thread ranks (``stratagem.testing.run_ranks``) are not."""
    group = comm.group
    assert group is not None
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        raise ValueError(
            "FSDP2 needs a process group registered with torch.distributed (DeviceMesh "
            "looks it up there); this Comm's group is not (thread ranks of "
            "stratagem.testing.run_ranks, or a group built by hand). Fix: run Sharded in "
            "launched processes (sg.launch, stratagem run, torchrun)") from None
    return group


class FSDPSharding(Part):
    """FSDP2 over one :class:`Comm`: which modules become units, the mixed-precision and
    offload policies, gradient-sync control, the global gradient norm, and conversions
    between the sharded parameters (DTensors) and full tensors.

    A part (:class:`~stratagem.parts.Part`): ``wrap_model`` shards the module in place,
    ``setup`` re-points the optimizers at the shards, ``set_grad_sync`` drives accumulation,
    ``consensus`` leaves the shards as they are (a sharded checkpoint writes them, an
    ``eval_model`` gathers them). It knows nothing of the strategy around it beyond its device
    and precision, so a composed strategy can shard within a node (a ``Comm`` over the node's
    processes) and synchronise otherwise across nodes."""

    name = "fsdp"
    provides = frozenset({Capability.SYNCHRONOUS_STEP, Capability.SHARDS_MODEL,
                          Capability.MATERIALIZES_META, Capability.INNER})
    #: Each process holds its rows, not the whole consensus module.
    replicated = False

    def __init__(self, comm: Comm, *, device: torch.device, reshard_after_forward: bool = True,
                 shard_modules: ShardModules = None, cpu_offload: bool = False,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 release_host_memory: bool = True, standalone: bool = False) -> None:
        super().__init__(comm)
        #: True when this part is the whole strategy (``Sharded``): checkpoints then hold the
        #: shards, ``eval_model`` gathers them into a plain copy and a full optimizer state
        #: is sharded like its parameters. Inside ``Hierarchical`` the outer layer's
        #: consensus is kept instead.
        self.standalone = standalone
        self.device = device
        self.release_host_memory = release_host_memory
        self.reshard_after_forward = reshard_after_forward
        self.shard_modules = shard_modules
        self.cpu_offload = cpu_offload
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self._mesh: DeviceMesh | None = None
        self._pending: tuple[nn.Module, dict[int, nn.Parameter]] | None = None
        # Per prepared module: whether its next backward reduce-scatters (byte counting).
        self._sync_states: dict[int, dict[str, bool]] = {}

    # ------------------------------------------------------------------ Part hooks
    def wrap_model(self, model: nn.Module, module: nn.Module) -> nn.Module:
        """Shard ``module`` (the bare user module) in place; ``model`` (what the user calls,
        e.g. a ``torch.compile`` wrapper around it) is returned as it is."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            raise ValueError(f"the {type(module).__name__} given to prepare is already sharded "
                             "by fully_shard. Fix: pass the plain module; Sharded applies "
                             "fully_shard itself")
        check_sync_batchnorm(self.comm, module, self.device)
        deferred = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
        template = _meta_template(module)
        before = dict(module.named_parameters(remove_duplicate=False))
        units = self.shard(module)
        if deferred:
            materialize_shards(module, template, self.device, self.comm.world_size,
                               self.comm.rank)
        after = dict(module.named_parameters(remove_duplicate=False))
        # fully_shard replaces every parameter by a new DTensor parameter; the optimizers
        # the user built before prepare are re-pointed at them in setup.
        self._pending = (template, {id(p): after[n] for n, p in before.items()})
        self._count_bytes(module, units[:-1])
        return model

    def setup(self, prepared: Prepared) -> None:
        assert self._pending is not None, "setup without wrap_model"
        template, replaced = self._pending
        self._pending = None
        prepared.state["fsdp_template"] = template
        for opt in prepared.optimizers:
            inner = opt.optimizer
            if inner.state:
                raise ValueError(
                    f"the {type(inner).__name__} given to prepare already holds state for "
                    f"{len(inner.state)} parameter(s); Sharded replaces the parameters by their "
                    "shards, so that state cannot follow. Fix: prepare before the first step, "
                    "then strategy.restore(...) the optimizer state")
            for group in inner.param_groups:
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        """Whole tensors: each shard all-gathered (a collective), tied names sharing one
        tensor. What a composed strategy keeps and evaluates; ``Sharded`` itself checkpoints
        the shards instead (:meth:`saved_model`, standalone)."""
        seen: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if is_dtensor(value):
                key = id(value)
                if key not in seen:
                    seen[key] = value.full_tensor()
                out[name] = seen[key]
            else:
                out[name] = value
        return out

    def saved_model(self, prepared: Prepared) -> dict[str, torch.Tensor] | None:
        """Standalone: the module's state as FSDP2 holds it, DTensor shards (not the
        gathered consensus): a sharded checkpoint writes each replica's rows, ``save(...,
        consolidate=True)`` gathers them."""
        if not self.standalone:
            return None
        return {k: v.detach() for k, v in prepared.module.state_dict().items()}

    def eval_model(self, prepared: Prepared) -> nn.Module | None:
        """Standalone: a plain module of the user's class holding the full parameters,
        gathered from the shards (a collective). Made once, refreshed on every call; one
        full copy of the parameters on every replica."""
        if not self.standalone:
            return None
        clone = self.owner.eval_copy(prepared)  # made once (eval_module below), then refreshed
        targets = clone.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in prepared.module.state_dict().items():
                targets[name].copy_(self.full(value.detach()))
        return clone

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """Standalone: a full (gathered / Mirrored) optimizer state: tensors shaped like their
        parameter are sharded like it; the rest (step counters) load as they are."""
        if not self.standalone:
            return False
        params = [p for g in opt.param_groups for p in g["params"]]
        sharded: dict[Any, Any] = {}
        for key, entry in state.get("state", {}).items():
            param = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
            if param is None or not isinstance(entry, dict):
                sharded[key] = entry
                continue
            sharded[key] = {k: (self.like(param, v) if isinstance(v, torch.Tensor)
                                and not is_dtensor(v) and v.dim() > 0 else v)
                            for k, v in entry.items()}
        opt.load_state_dict({**state, "state": sharded})
        return True

    def finalize(self, prepared: Prepared) -> None:
        """Broadcast rank 0's buffers (BatchNorm running statistics): FSDP2 leaves buffers
        replicated but never synchronises them, so each replica's drift with its own batches;
        afterwards every replica, ``eval_model`` and the checkpoint hold rank 0's (DDP's
        convention)."""
        broadcast_buffers(self.comm, prepared.module)

    def load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> bool:
        """Full tensors (any checkpoint, any writer's world size): this replica keeps its
        rows of each."""
        for name, target in prepared.module.state_dict().items():
            self.load_full(target, state[name])
        return True

    def eval_module(self, prepared: Prepared) -> nn.Module:
        """A plain module of the user's class (from the meta-device template taken before
        sharding, ties kept), uninitialised: the caller fills in the gathered values."""
        module: nn.Module = prepared.state["fsdp_template"]
        return _materialize(copy.deepcopy(module), self.device)

    def set_grad_sync(self, prepared: Prepared, enabled: bool) -> None:
        """Whether the next backward reduce-scatters (accumulation: not before the last
        micro-batch; the unsharded gradients accumulate locally meanwhile)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(prepared.module, FSDPModule):
            prepared.module.set_requires_gradient_sync(enabled)
        state = self._sync_states.get(id(prepared.module))
        if state is not None:
            state["sync"] = enabled

    def _count_bytes(self, module: nn.Module, units: list[nn.Module]) -> None:
        """Count FSDP2's traffic analytically at the root's forward (it bypasses ``Comm``):
        per replica a ring all-gather of the parameters in the compute dtype for the forward,
        another of the units' (not the root's) for the backward when
        ``reshard_after_forward``, and a reduce-scatter of the gradients in the reduction
        dtype when this backward synchronises (each moves ``(W-1)/W`` of the full size)."""
        world = self.comm.world_size
        if world == 1:
            return
        numel = sum(p.numel() for p in module.parameters())
        in_units = sum(p.numel() for p in {id(p): p for u in units
                                           for p in u.parameters()}.values())
        share = (world - 1) / world
        gather = numel * (self.param_dtype or torch.float32).itemsize * share
        regather = in_units * (self.param_dtype or torch.float32).itemsize * share
        scatter = numel * (self.reduce_dtype or torch.float32).itemsize * share
        comm, state, reshard = self.comm, {"sync": True}, self.reshard_after_forward
        self._sync_states[id(module)] = state

        def count(_module: nn.Module, _args: Any) -> None:
            nbytes = gather
            if torch.is_grad_enabled():
                if reshard:
                    nbytes += regather
                if state["sync"]:
                    nbytes += scatter
            comm.account(nbytes, nbytes)
            comm.num_collectives += 1

        module.register_forward_pre_hook(count)

    @property
    def mesh(self) -> DeviceMesh:
        """The 1-D device mesh over ``comm.group`` (built on first use: it needs the group to
        be one torch.distributed knows, i.e. not a bare thread-test group)."""
        if self._mesh is None:
            if self.comm.group is None:
                raise ValueError("FSDP2 needs a process group; this Comm has none (a single "
                                 "process). Fix: launch several workers, or use OneDevice")
            self._mesh = DeviceMesh.from_group(_registered(self.comm), self.device.type)
        return self._mesh

    def units(self, module: nn.Module) -> list[nn.Module]:
        """The submodules of ``module`` that become FSDP units (``shard_modules``, else
        :func:`default_units`); ``ValueError`` when one shares a parameter with the rest of
        the model (tied weights), which FSDP2 cannot split across units."""
        return _chosen_units(module, self.shard_modules)

    def shard(self, module: nn.Module) -> list[nn.Module]:
        """Apply ``fully_shard`` to the chosen units (innermost first), then to ``module``
        itself; the module is modified in place. Returns the units (root last). A single
        process shards nothing (there is nobody to share the state with)."""
        if self.comm.world_size == 1:
            return []
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if self.release_host_memory and self.device.type == "cpu" and not self.cpu_offload:
            release_host_memory()
        offload: OffloadPolicy = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        units = self.units(module)
        depth = {id(m): 0 for m in units}
        for name, m in module.named_modules():
            if id(m) in depth:
                depth[id(m)] = name.count(".") + 1
        units.sort(key=lambda m: -depth[id(m)])  # nested units before the units holding them
        for unit in [*units, module]:
            # The root's parameters (embedding, output head) are needed again as soon as the
            # backward starts: like fully_shard's own default, it is never resharded between
            # its forward and backward.
            reshard = self.reshard_after_forward and unit is not module
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard,
                        mp_policy=policy, offload_policy=offload)
        return [*units, module]

    def grad_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The total ``norm_type``-norm of gradients sharded across the comm's replicas: the
        norm of each replica's rows, combined with one all-reduce (sum of ``|g|^p``, or max
        for the inf-norm). Replicated (non-DTensor) gradients count once (rank 0's)."""
        local: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        for g in grads:
            if is_dtensor(g):
                local.append(g.to_local())
            else:
                replicated.append(g)
        if self.comm.rank == 0:
            local.extend(replicated)
        local = [t for t in local if t.numel()]
        if math.isinf(norm_type):
            part = (torch.stack([t.detach().abs().max().float() for t in local]).max()
                    if local else torch.zeros(()))
            total = self.comm.all_reduce(part.reshape(1).cpu(), "max")
            return total.reshape(()).to(self.device)
        if local:
            norm = torch.nn.utils.get_total_norm([t.detach() for t in local], norm_type=norm_type)
            part = norm.float().pow(norm_type)
        else:
            part = torch.zeros(())
        total = self.comm.all_reduce(part.reshape(1).cpu().double(), "sum")
        return total.pow(1.0 / norm_type).float().reshape(()).to(self.device)

    def full(self, value: torch.Tensor) -> torch.Tensor:
        """The full tensor behind a shard (an all-gather: a collective), else ``value``."""
        return value.full_tensor() if is_dtensor(value) else value

    def load_full(self, target: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this replica's rows of ``full`` into ``target`` (a shard or a plain tensor)."""
        with torch.no_grad():
            _copy_rows(target, full, self.comm.world_size, self.comm.rank)

    def like(self, reference: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``full`` sharded like ``reference`` (a DTensor): this replica's rows as a DTensor
        on the same mesh; ``full`` itself when ``reference`` is not sharded."""
        if not is_dtensor(reference) or tuple(full.shape) != tuple(reference.shape):
            return full
        from torch.distributed.tensor import DTensor, Shard

        start, stop = row_range(full.shape[0], self.comm.world_size, self.comm.rank)
        rows = full[start:stop].to(reference.to_local().device).clone()
        return DTensor.from_local(rows, reference.device_mesh, [Shard(0)], run_check=False,
                                  shape=reference.shape, stride=reference.stride())


def materialize_shards(module: nn.Module, template: nn.Module, device: torch.device,
                       world_size: int, rank: int) -> None:
    """Give ``module``, built on the meta device and sharded, real values: storage for this
    replica's shards only (``to_empty``), then values from the modules' own
    ``reset_parameters()`` (``_reset_parameters()`` for ``nn.MultiheadAttention``).

    Each module that defines ``reset_parameters`` and holds tensors is rebuilt full size on the
    CPU from ``template`` (its subtree only: one layer at a time, never the whole model unless
    the root itself defines it), reset, and this replica keeps its rows. Modules are reset
    children first, in registration order (the order a constructor builds them), so a parent
    that re-initialises a child's tensor (``nn.MultiheadAttention``) has the last word. Every
    replica computes the same full values from the same RNG state, so the rows fit together
    whatever the number of workers. Custom initialisation done in a constructor is not
    replayed (it ran on meta tensors): tensors no ``reset_parameters`` sets are refused by
    name. Raises ``ValueError``."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        module.to_empty(device=device)  # FSDP2 re-creates its shards; ties stay one parameter
    else:  # one process, nothing sharded: Module.to_empty would give each tie its own tensor
        _materialize(module, device, keep_requires_grad=True)
    targets = {**dict(module.named_parameters(remove_duplicate=False)),
               **dict(module.named_buffers(remove_duplicate=False))}
    done: dict[int, str] = {}  # tensor -> the name it was set under
    twins = dict(template.named_modules())
    for name, sub in _post_order(module):
        twin_template = twins[name]
        reset = _reset_method(sub)
        own = [*twin_template.named_parameters(), *twin_template.named_buffers()]
        if reset is None or not own:
            continue
        twin = _materialize(copy.deepcopy(twin_template), torch.device("cpu"))
        values = {**dict(twin.named_parameters(remove_duplicate=False)),
                  **dict(twin.named_buffers(remove_duplicate=False))}
        with torch.no_grad():
            for t in values.values():
                if t.is_floating_point():
                    t.fill_(math.nan)  # what reset_parameters leaves as it is stays NaN
            getattr(twin, reset)()
            for key, full in values.items():
                if full.is_floating_point() and bool(torch.isnan(full).any()):
                    continue  # not set by this module: a parent's reset may set it
                path = f"{name}.{key}" if name else key
                target = targets[path]
                if done.setdefault(id(target), path) != path:
                    # A tied tensor keeps the value of its first user, as when a
                    # constructor ties an output head to an already built embedding.
                    continue
                _copy_rows(target, full, world_size, rank)
    missing = [n for n, t in targets.items() if id(t) not in done]
    if missing:
        raise ValueError(
            f"prepare built this model on the meta device, but no reset_parameters() sets "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: their values were "
            "computed in a constructor, on meta tensors, and are lost. Fix: give those "
            "modules a reset_parameters() that sets them, or build the model on the CPU")


def _reset_method(module: nn.Module) -> str | None:
    """The name of ``module``'s re-initialisation method: ``reset_parameters``, or the
    private ``_reset_parameters`` of ``nn.MultiheadAttention`` and ``nn.Transformer``."""
    return next((n for n in ("reset_parameters", "_reset_parameters")
                 if callable(getattr(type(module), n, None))), None)


def _post_order(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(name, module)`` children before their parent, siblings in registration order."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in root.named_children():
        out.extend(_post_order(child, f"{prefix}.{name}" if prefix else name))
    out.append((prefix, root))
    return out


def _copy_rows(target: torch.Tensor, full: torch.Tensor, world_size: int, rank: int) -> None:
    """This replica's rows of ``full`` into ``target`` (a dim-0 shard), or all of it."""
    if is_dtensor(target):
        local = target.to_local()
        start, stop = row_range(full.shape[0], world_size, rank)
        assert local.shape[0] == stop - start, (local.shape, start, stop)
        local.copy_(full[start:stop])
    else:
        target.copy_(full)


def _materialize(template: nn.Module, device: torch.device, *,
                 keep_requires_grad: bool = False) -> nn.Module:
    """``template`` with uninitialised tensors on ``device`` in place of its meta tensors, one
    per original tensor (``Module.to_empty`` would give each user of a tied parameter a
    tensor of its own); parameters frozen unless ``keep_requires_grad``."""
    made: dict[int, torch.Tensor] = {}
    for module in template.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                           requires_grad=keep_requires_grad and p.requires_grad)
            setattr(module, name, made[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            if id(b) not in made:
                made[id(b)] = torch.empty_like(b, device=device)
            setattr(module, name, made[id(b)])
    return template


def _meta_template(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` on the meta device (no memory): parameters and buffers
    replaced by meta tensors of the same shapes, ties kept (one meta tensor per original)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    for b in module.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
    forward = module.__dict__.pop("forward", None)
    try:
        template = copy.deepcopy(module, memo)
    finally:
        if forward is not None:
            module.forward = forward  # type: ignore[method-assign]
    return template
