"""The update rules of a parameter-server shard: what happens to a tensor, independent of gRPC.

One :class:`Slot` per tensor holds its value, version, optimizer and lock. The rules:

- **Downpour SGD** (Dean et al. 2012, ``mode="async"``): each gradient is applied on arrival,
  dropped when more than ``max_staleness`` versions old (TensorFlow's
  ``DropStaleGradientOptimizer``).
- **Synchronous replicas** (TensorFlow's ``SyncReplicasOptimizer``, ``mode="sync"``): the mean
  of ``replicas_to_aggregate`` gradients computed on the current version is applied; late
  ones are dropped.
- **Outer rounds** (asynchronous DiLoCo, ``mode="outer"``): replicas send pseudo-gradients
  ``theta_base - theta_i`` computed from any version; each is added to the round's sum with
  weight ``samples * s(staleness)`` (:func:`staleness_weight`), and once
  ``replicas_to_aggregate`` (``min_contributions``) have arrived, or a waiting replica closes
  the round after its grace window, the sum divided by the samples is the gradient of one
  outer optimizer step (:func:`contribute`, :func:`close_round`).
- **Elastic exchange** (asynchronous EASGD, Zhang, Choromanska, LeCun 2015,
  ``mode="elastic"``): for a worker's ``x`` and moving rate ``a``, ``d = x - center;
  center += a * d``; the worker gets ``d``.
- **Optimizer slots and hyperparameters**: each tensor's optimizer is rebuilt from its spec
  (:mod:`stratagem.ps.optim`) and validated the way torch validates it; optimizer state
  restored from a checkpoint is checked against the optimizer's layout; nothing non-finite
  gets in (a NaN would spread to every worker).

Finite in, finite kept: finite values can still overflow what is stored, so the
decision is taken on what will be stored, not only on what arrived. A gradient or exchanged
value is checked *after* its cast to the tensor's dtype (1e5 is finite in fp32, ``inf`` in
fp16); sync gradients are summed in float64; an optimizer step is checked before it is
committed (plain SGD: a bound on ``|value| + lr * |grad|``, else the step on a scratch copy;
other optimizers: the step, then its result, restoring the value and optimizer state on
overflow); an elastic exchange's difference and new center are checked before the center
changes. A step that would make the tensor non-finite is *refused*: counted in
``Slot.refused``, reported as status ``"refused"``, and the tensor keeps its last finite value.

One push, one step: the tensors of a push whose optimizers are equal (class and
hyperparameters) and already hold their state take one torch ``foreach`` step
(:func:`offer_many`), guarded as above but once for all of them; if that step would overflow
anywhere, every tensor is restored and steps alone, so exactly the overflowing ones are refused.
On CPU the ``foreach`` and single-tensor paths of every supported optimizer give bitwise equal
results (tested), and a push of the demo's MLP (6 tensors, Adam) costs ~25 torch calls
instead of ~150.

Every refusal is a :class:`~stratagem.ps.wire.WireError` carrying the gRPC status the service
(:mod:`stratagem.ps.server`) answers with.
"""

from __future__ import annotations

import collections
import functools
import math
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem.ps import optim as ps_optim
from stratagem.ps import updates as updates_mod
from stratagem.ps.wire import WireError

__all__ = ["MODES", "Slot", "refused", "is_int", "make_slot", "check_grad", "to_slot_dtype",
           "apply_gradient", "offer", "offer_many", "elastic_exchange", "plan_hyperparameters",
           "apply_hyperparameters", "check_opt_state", "load_optimizer_state", "state_copies",
           "cost", "finite", "all_finite", "check_grads", "require_finite", "plain_sgd_lr",
           "contribute", "close_round", "staleness_weight", "updates_since",
           "warm_up_optimizers", "narrows", "SLOT_OVERHEAD_BYTES", "FUSE_MIN_SLOTS"]

MODES = ("async", "sync", "elastic", "outer")


@dataclass
class Slot:
    """One tensor on a shard with everything that changes it."""

    name: str
    value: torch.Tensor
    mode: str
    spec: dict[str, Any] | None
    optimizer: torch.optim.Optimizer | None
    replicas_to_aggregate: int = 1
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    acc: torch.Tensor | None = None  # sync mode: sum of this version's gradients (float64)
    acc_count: int = 0
    #: outer mode: the samples of this round's contributions (the divisor of the sum), when
    #: its first contribution arrived (``time.monotonic()``), and contributions merged so far
    acc_weight: float = 0.0
    opened_at: float | None = None
    merged: int = 0
    merged_samples: float = 0.0
    #: outer mode with a download kind (the spec's ``outer_download``): the encoded updates
    #: of the last rounds, ``(version after, payload)`` oldest first, and what encoding them
    #: dropped (fp32, carried into the next; :mod:`stratagem.ps.updates`). ``lineage`` tells
    #: this slot's versions apart from another slot's of the same name (set_state replaces a
    #: slot): a replica's "I hold version v" counts only for the lineage it was read from.
    updates: collections.deque[tuple[int, torch.Tensor]] = field(
        default_factory=lambda: collections.deque(maxlen=updates_mod.HISTORY))
    down_residual: torch.Tensor | None = None
    lineage: int = field(default_factory=lambda: secrets.randbits(52))
    dropped: int = 0
    refused: int = 0  # steps refused because they would have made the tensor non-finite
    #: Plain SGD (no momentum, weight decay or maximize): its learning rate, for the fast
    #: path in :func:`apply_gradient` (the same single ``add_`` torch's SGD does, minus ~75 us of
    #: optimizer-framework overhead per call, a tenth of a push of 8 MB in 10 tensors).
    sgd_lr: float | None = None

    def bump(self) -> None:
        """A new version: the sync (or outer) accumulator starts again."""
        self.version += 1
        self.acc, self.acc_count = None, 0
        self.acc_weight, self.opened_at = 0.0, None


def refused(message: str, status: str = "INVALID_ARGUMENT") -> WireError:
    """A refusal sent back to the caller with gRPC status ``status``."""
    return WireError(message, status=status)


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON fields)."""
    return isinstance(v, int) and not isinstance(v, bool)


def make_slot(name: str, value: torch.Tensor, mode: str, spec: Any,
              replicas: Any, *, copy: bool = True) -> Slot:
    """A new slot holding a copy of ``value`` (``copy=False``: ``value`` itself, e.g. a view
    of a received message the slot may keep) and, unless elastic, its optimizer built from
    ``spec``; refused before anything is allocated when the combination is invalid."""
    if mode not in MODES:
        raise refused(f"tensor {name!r}: mode must be one of {MODES}, got {mode!r}")
    if not is_int(replicas) or replicas < 1:
        raise refused(f"replicas_to_aggregate must be a positive integer, got {replicas!r}")
    if mode != "elastic":
        if spec is None:
            raise refused(f"tensor {name!r}: mode {mode!r} needs an optimizer spec")
        if not value.is_floating_point():
            raise refused(f"tensor {name!r} has dtype {value.dtype}; only floating-point "
                          "tensors can be optimized on a shard")
        ps_optim.check_spec(spec)  # torch's own errors, before any allocation
    require_finite(value, f"initial value of {name!r}")
    data = value.detach().clone() if copy else value.detach()
    param = torch.nn.Parameter(data, requires_grad=value.is_floating_point())
    optimizer = ps_optim.build_optimizer(spec, param) if mode != "elastic" else None
    return Slot(name, param.data, mode, spec, optimizer, replicas,
                sgd_lr=plain_sgd_lr(spec) if optimizer is not None else None)


def check_grad(slot: Slot, g: torch.Tensor, what: str = "gradient") -> None:
    """Refuse a gradient (or an elastic exchange's value) of the wrong shape or dtype, or
    holding NaN/Inf."""
    if tuple(g.shape) != tuple(slot.value.shape):
        raise refused(f"{what} for {slot.name!r} has shape {tuple(g.shape)}, the tensor has "
                      f"{tuple(slot.value.shape)}", "FAILED_PRECONDITION")
    if not g.is_floating_point():
        raise refused(f"{what} for {slot.name!r} has non-float dtype {g.dtype}")
    require_finite(g, f"{what} for {slot.name!r}")


def check_grads(pairs: Sequence[tuple[Slot, torch.Tensor]], what: str = "gradient") -> None:
    """:func:`check_grad` for every ``(slot, gradient)`` of one request, the finiteness of
    all of them taken in one check (:func:`all_finite`); the first offending gradient is
    named as :func:`check_grad` names it."""
    for slot, g in pairs:
        if tuple(g.shape) != tuple(slot.value.shape):
            raise refused(f"{what} for {slot.name!r} has shape {tuple(g.shape)}, the tensor "
                          f"has {tuple(slot.value.shape)}", "FAILED_PRECONDITION")
        if not g.is_floating_point():
            raise refused(f"{what} for {slot.name!r} has non-float dtype {g.dtype}")
    if not all_finite([g for _, g in pairs]):
        for slot, g in pairs:
            require_finite(g, f"{what} for {slot.name!r}")


def narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a finite ``src`` value can overflow to ``inf`` when cast to ``dst``."""
    if src == dst or not (src.is_floating_point and dst.is_floating_point):
        return False
    return torch.finfo(dst).max < torch.finfo(src).max


def to_slot_dtype(slot: Slot, g: torch.Tensor, what: str = "gradient") -> torch.Tensor:
    """``g`` in the slot's dtype; refused when the cast overflows (an fp32 value of 1e5 is
    ``inf`` in fp16), since that is what would be stored."""
    out = g.to(slot.value.dtype)  # upcasts fp16/bf16-compressed gradients
    if narrows(g.dtype, out.dtype) and not finite(out):
        raise refused(f"{what} for {slot.name!r} is finite in {g.dtype} but overflows the "
                      f"tensor's dtype {slot.value.dtype} (largest finite value "
                      f"{torch.finfo(slot.value.dtype).max:g}); refused so the shared model "
                      "stays finite. Fix: scale the values down (loss scaling, gradient "
                      "clipping), or register the tensor in a wider dtype")
    return out


def _max_abs(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t)
    return max(abs(float(lo)), abs(float(hi)))


def _sgd_step(slot: Slot, grad: torch.Tensor, lr: float) -> bool:
    """``value -= lr * grad`` unless it would overflow: in place when a bound proves it
    cannot (every realistic step), else computed on a scratch copy and committed only if
    finite."""
    value = slot.value
    with torch.no_grad():
        # |value - lr*g| <= |value| + |lr|*|g|; half the dtype's range leaves room for the
        # rounding of the product and the sum. The bound is a Python (double) float: for a
        # float64 tensor it overflows to inf and takes the scratch path.
        g_max = _max_abs(grad.coalesce().values() if grad.is_sparse else grad)
        bound = _max_abs(value) + abs(lr) * g_max
        if bound <= torch.finfo(value.dtype).max / 2:
            value.add_(grad, alpha=-lr)  # exactly torch's SGD step
            return True
        new = value.clone().add_(grad, alpha=-lr)
        if not finite(new):
            return False
        value.copy_(new)
        return True


def _optimizer_step(slot: Slot, grad: torch.Tensor, lr_scale: float) -> bool:
    """The slot's torch optimizer step, committed only if the value and every state tensor
    stay finite; otherwise both are restored from the copies taken before it."""
    assert slot.optimizer is not None
    group = slot.optimizer.param_groups[0]
    param = group["params"][0]
    state = slot.optimizer.state.get(param, {})
    saved_value = param.detach().clone()
    saved_state = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                   for k, v in state.items()}
    param.grad = grad
    lr = group["lr"]
    if lr_scale != 1.0:
        group["lr"] = lr * lr_scale
    try:
        slot.optimizer.step()
    finally:
        param.grad = None
        group["lr"] = lr
    after = slot.optimizer.state.get(param, {})
    if finite(param.detach()) and all(finite(v) for v in after.values()
                                      if isinstance(v, torch.Tensor)):
        return True
    with torch.no_grad():
        param.copy_(saved_value)
    if saved_state:
        for k, v in saved_state.items():
            cur = after.get(k)
            if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                cur.copy_(v)
            else:
                after[k] = v
    else:  # the first step created the state: a refused first step leaves none
        slot.optimizer.state.pop(param, None)
    return False


def apply_gradient(slot: Slot, grad: torch.Tensor, lr_scale: float = 1.0) -> bool:
    """Run the slot's optimizer on ``grad`` with its learning rate times ``lr_scale`` (caller
    holds ``slot.lock``). Returns False, changing nothing and counting it in
    ``slot.refused``, when the step would make the tensor or its optimizer state
    non-finite."""
    assert slot.optimizer is not None
    if slot.sgd_lr is not None:
        ok = _sgd_step(slot, grad, slot.sgd_lr * lr_scale)
    else:
        ok = _optimizer_step(slot, grad, lr_scale)
    if not ok:
        slot.refused += 1
    return ok


#: Fewest slots of one push that take one fused optimizer step (:func:`offer_many`).
FUSE_MIN_SLOTS = 2


def _fusable(slot: Slot, grad: torch.Tensor) -> bool:
    """Whether ``slot``'s step may run fused with others: an optimizer other than the plain
    SGD fast path, whose state is already built (the first step creates it, and a refused
    first step must leave none) and made of tensors only, and a dense gradient."""
    if slot.optimizer is None or slot.sgd_lr is not None or grad.is_sparse:
        return False
    param = slot.optimizer.param_groups[0]["params"][0]
    state = slot.optimizer.state.get(param)
    return state is not None and bool(state) and all(isinstance(v, torch.Tensor)
                                                     for v in state.values())


def _fuse_key(slot: Slot, lr_scale: float) -> tuple[Any, ...]:
    """Slots with equal keys step as one torch optimizer: same class, same hyperparameters
    (the learning rate as it applies to this gradient), same dtype."""
    assert slot.optimizer is not None
    group = slot.optimizer.param_groups[0]
    hyper = tuple(sorted((k, repr(v)) for k, v in group.items() if k not in ("params", "lr")))
    return (type(slot.optimizer), float(group["lr"]) * lr_scale, hyper, slot.value.dtype)


def _fused_step(slots: Sequence[Slot], grads: Sequence[torch.Tensor], lr_scale: float) -> bool:
    """One torch ``foreach`` step of the slots' (equal) optimizers over all their tensors:
    the same arithmetic as one step per slot (torch's single-tensor and ``foreach`` paths give
    bitwise equal results on CPU; tested), in a few calls instead of ~25 per slot. Guarded as
    :func:`_optimizer_step` is, once for all: committed only if every value and state tensor
    stays finite; otherwise every slot is restored from the copies taken before it and False
    is returned (the caller then steps each slot alone, refusing only the ones that overflow).
    Caller holds every slot's lock."""
    first = slots[0].optimizer
    assert first is not None
    params: list[torch.Tensor] = []
    states: list[dict[str, Any]] = []
    for slot in slots:
        assert slot.optimizer is not None
        param = slot.optimizer.param_groups[0]["params"][0]
        params.append(param)
        states.append(slot.optimizer.state[param])
    saved = [(p.detach().clone(), {k: v.clone() for k, v in st.items()})
             for p, st in zip(params, states, strict=True)]
    group = {k: v for k, v in first.param_groups[0].items() if k != "params"}
    group["lr"] = float(group["lr"]) * lr_scale
    group["foreach"], group["fused"] = True, None
    fused = type(first)([{**group, "params": params}])  # type: ignore[call-arg]
    for p, st in zip(params, states, strict=True):
        fused.state[p] = st  # the slot's own state dict: the step updates it in place
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    try:
        fused.step()
    finally:
        for p in params:
            p.grad = None
    after = [p.detach() for p in params] + [v for st in states for v in st.values()]
    if all_finite(after):
        return True
    with torch.no_grad():
        for p, st, (value, state) in zip(params, states, saved, strict=True):
            p.copy_(value)
            for k, v in state.items():
                st[k].copy_(v)
    return False


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """:func:`finite` of every tensor, in one sum per tensor and one check: NaN or Inf
    anywhere makes the total non-finite; only then (or when finite values overflow the
    total) is each tensor checked exactly."""
    floats = [t for t in tensors if t.numel() and t.is_floating_point()]
    if not floats:
        return True
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in floats:
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        by_dtype.setdefault(wide, []).append(t.sum(dtype=wide))
    if all(bool(torch.isfinite(torch.stack(sums).sum(dtype=torch.float64)))
           for sums in by_dtype.values()):
        return True
    return all(finite(t) for t in floats)


def offer_many(items: Sequence[tuple[Slot, int | None, Callable[[], torch.Tensor]]],
               max_staleness: int | None) -> list[list[Any]]:
    """:func:`offer` for every ``(slot, base, grad)`` of one push (each slot once), with the
    same result per item. Async slots whose optimizers are equal and already have their
    state take one fused step (:func:`_fused_step`) under all their locks; the others, and
    any fused group whose step would overflow, go through :func:`offer` one by one."""
    results: list[list[Any] | None] = [None] * len(items)
    built: dict[int, torch.Tensor] = {}  # gradients already cast, not cast twice
    candidates = [i for i, (slot, base, _) in enumerate(items)
                  if slot.mode == "async" and base is not None and slot.optimizer is not None
                  and slot.sgd_lr is None]
    if len(candidates) >= FUSE_MIN_SLOTS:
        slots = [items[i][0] for i in candidates]
        # A fixed order (by name, as every multi-slot lock in the service): no deadlock.
        unique = sorted({id(s): s for s in slots}.values(), key=lambda s: s.name)
        for s in unique:
            s.lock.acquire()
        try:
            groups: dict[tuple[Any, ...], list[tuple[int, int, float]]] = {}
            for i in candidates:
                slot, base, grad = items[i]
                assert base is not None
                staleness = slot.version - base
                if staleness < 0 or (max_staleness is not None and staleness > max_staleness):
                    continue  # dropped: offer() counts it below
                g = built[i] = grad()
                if _fusable(slot, g):
                    scale = staleness_lr_scale(slot, staleness)
                    groups.setdefault(_fuse_key(slot, scale), []).append((i, staleness, scale))
            for members in groups.values():
                if len(members) < FUSE_MIN_SLOTS:
                    continue
                fused = [items[i][0] for i, _, _ in members]
                if _fused_step(fused, [built[i] for i, _, _ in members], members[0][2]):
                    for (i, staleness, _), slot in zip(members, fused, strict=True):
                        slot.version += 1
                        results[i] = [staleness, "applied", slot.version]
        finally:
            for s in reversed(unique):
                s.lock.release()
    out: list[list[Any]] = []
    for i, (slot, base, grad) in enumerate(items):
        done = results[i]
        if done is None:
            cast = built.get(i)
            done = offer(slot, base, max_staleness,
                         grad if cast is None else functools.partial(_same, cast))
        out.append(done)
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def staleness_lr_scale(slot: Slot, staleness: int) -> float:
    """``1 / max(1, staleness)`` when the slot's spec asks for staleness-aware learning rates
    (Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep Learning",
    IJCAI 2016: ``lr / staleness``), else 1."""
    if slot.spec is None or not slot.spec.get(ps_optim.STALENESS_LR):
        return 1.0
    return 1.0 / max(1, staleness)


def offer(slot: Slot, base: int | None, max_staleness: int | None,
          grad: Callable[[], torch.Tensor]) -> list[Any]:
    """Apply (async) or accumulate (sync) one gradient; returns [staleness, status, version].

    ``grad`` builds the gradient lazily so a dropped one costs nothing.
    """
    if slot.mode in ("elastic", "outer"):
        what = "elastic averaging" if slot.mode == "elastic" else "outer rounds"
        op = "elastic" if slot.mode == "elastic" else "contribute"
        raise refused(f"tensor {slot.name!r} is registered for {what}; it takes {op!r} "
                      "calls, not gradient pushes", "FAILED_PRECONDITION")
    if base is None:
        raise refused(f"gradient for {slot.name!r} carries no base version")
    with slot.lock:
        staleness = slot.version - base
        if slot.mode == "async":
            if staleness < 0 or (max_staleness is not None and staleness > max_staleness):
                slot.dropped += 1
                status = "dropped"
            elif apply_gradient(slot, grad(), staleness_lr_scale(slot, staleness)):
                slot.version += 1
                status = "applied"
            else:
                status = "refused"
        elif staleness != 0:  # sync: only gradients of the current version count
            slot.dropped += 1
            status = "dropped"
        else:
            g = grad()
            # float64: two fp32 gradients of 3e38 sum to inf in an fp32 accumulator.
            if slot.acc is None:
                slot.acc = g.to(torch.float64, copy=True)
            else:
                slot.acc.add_(g)
            slot.acc_count += 1
            status = "accumulated"
            if slot.acc_count >= slot.replicas_to_aggregate:
                # In place: the accumulator is discarded by bump() right after.
                mean = slot.acc.div_(slot.acc_count).to(slot.value.dtype)
                if finite(mean) and apply_gradient(slot, mean):
                    status = "applied"
                else:
                    if not finite(mean):
                        slot.refused += 1
                    status = "refused"
                # A refused aggregate still ends the round (the value unchanged), so the
                # replicas waiting for the next version go on instead of timing out.
                slot.bump()
        version = slot.version
    return [staleness, status, version]


def check_opt_state(name: str, value: torch.Tensor, spec: dict[str, Any],
                    tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    layout = ps_optim.state_layout(spec)
    given = set(tensors) | set(scalars)
    if given != set(layout):
        raise refused(f"set_state: optimizer state of {name!r} has entries {sorted(given)}, "
                      f"optimizer {spec.get('name')!r} keeps {sorted(layout)}; save and "
                      "restore with the same optimizer")
    for k, t in tensors.items():
        if layout[k]:
            ok = tuple(t.shape) == tuple(value.shape) and t.is_floating_point()
        else:
            ok = t.numel() == 1
        if not ok:
            raise refused(f"set_state: optimizer state {k!r} of {name!r} has shape "
                          f"{tuple(t.shape)} {t.dtype}; expected "
                          f"{tuple(value.shape) if layout[k] else 'one element'}")
        require_finite(t, f"optimizer state {k!r} of {name!r}")
    for k, v in scalars.items():
        if not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise refused(f"set_state: optimizer scalar {k!r} of {name!r} must be a finite "
                          f"number, got {v!r}")


#: Bytes charged against a shard's quota for every tensor on top of its values: what a slot
#: costs in Python objects (the slot, its Parameter, optimizer, lock, dict entries: ~2.8 KB
#: measured for an SGD slot), so 50 000 one-element tensors cannot hide ~140 MB behind a
#: 200 KB charge.
SLOT_OVERHEAD_BYTES = 4096


def state_copies(mode: str, spec: Any) -> int:
    """How many parameter-sized buffers the slot's optimizer (and sync accumulator) keeps
    (the float64 sync accumulator is charged in :func:`cost`)."""
    if mode == "elastic" or not isinstance(spec, dict):
        return 0
    name = str(spec.get("name", "")).lower()
    if name == "sgd":
        n = 1 if spec.get("momentum") else 0
    elif name in ("adam", "adamw"):
        n = 3 if spec.get("amsgrad") else 2
    elif name == "rmsprop":
        n = 1 + bool(spec.get("momentum")) + bool(spec.get("centered"))
    else:
        n = 1
    return n


def cost(value: torch.Tensor, mode: Any, spec: Any) -> int:
    """Bytes charged for a slot: its value, its optimizer state, the float64 sync
    accumulator, and :data:`SLOT_OVERHEAD_BYTES`; in outer mode with a download kind also
    the copy taken at each outer step, the fp32 residual and the kept encoded updates."""
    acc = (value.numel() * 8 if str(mode) in ("sync", "outer") and isinstance(spec, dict)
           else 0)
    down = spec.get(ps_optim.OUTER_DOWNLOAD) if isinstance(spec, dict) else None
    if str(mode) == "outer" and down in updates_mod.DOWN_KINDS:
        count, dtype = updates_mod.encoded_size(value.numel(), down)
        acc += (value.nbytes + value.numel() * 4
                + updates_mod.HISTORY * count * dtype.itemsize)
    return value.nbytes * (1 + state_copies(str(mode), spec)) + acc + SLOT_OVERHEAD_BYTES


def finite(t: torch.Tensor) -> bool:
    if t.numel() == 0 or not t.is_floating_point():
        return True
    # One reduction (no boolean copy of the tensor): NaN or Inf anywhere makes the sum
    # non-finite; only if it is do we look closer (a finite tensor whose sum overflows).
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(total)):
        return True
    # Exact and still allocation-free (isfinite(t).all() is ~50x slower): max and min
    # propagate NaN, and an infinity is one of them.
    return bool(torch.isfinite(t.amax())) and bool(torch.isfinite(t.amin()))


def require_finite(t: torch.Tensor, what: str) -> None:
    if not finite(t):
        raise refused(f"{what} holds NaN or Inf; refused so the shared model stays finite. Fix: "
                      "skip non-finite steps on the worker (on_nonfinite='skip', or fp16 loss "
                      "scaling), or lower the learning rate")


def plain_sgd_lr(spec: dict[str, Any] | None) -> float | None:
    if spec is None or str(spec.get("name", "")).lower() != "sgd":
        return None
    if spec.get("momentum") or spec.get("weight_decay") or spec.get("maximize"):
        return None
    lr = spec.get("lr", 1e-3)
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def warm_up_optimizers() -> None:
    """Take one optimizer step now: torch's first one imports lazily for ~1 s, which would
    otherwise land inside a worker's first (deadline-bound) registration."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.0).step()


def elastic_exchange(slot: Slot, x: torch.Tensor, moving_rate: float
                     ) -> tuple[torch.Tensor, int]:
    """EASGD with the worker's ``x`` (already checked and in the slot's dtype):
    ``d = x - center; center += moving_rate * d``; returns ``d`` and the new version."""
    with slot.lock:
        d = x - slot.value
        new = None
        if finite(d):
            new = torch.add(slot.value, d, alpha=moving_rate)
        if new is None or not finite(new):
            slot.refused += 1
            raise refused(f"elastic exchange for {slot.name!r} would make the center "
                          "non-finite (the difference to the center overflows its dtype "
                          f"{slot.value.dtype}); refused, the center keeps its value. Fix: "
                          "keep the worker's parameters finite and in range (lower the "
                          "learning rate)")
        slot.value.copy_(new)
        slot.version += 1
        return d, slot.version


def plan_hyperparameters(slots: Sequence[Slot], hyper: dict[str, Any]
                         ) -> list[tuple[Slot, dict[str, Any], dict[str, Any]]]:
    """Validate ``hyper`` for every slot with an optimizer the way torch would, before any slot
    changes: ``(slot, new spec, param-group values)`` per slot, for
    :func:`apply_hyperparameters`."""
    planned = []
    for slot in slots:
        if slot.optimizer is None or slot.spec is None:
            continue
        spec = {**slot.spec, **hyper}
        group = ps_optim.check_spec(spec)
        keys = set(ps_optim.validate_spec(spec)) & set(hyper)
        planned.append((slot, spec, {k: group[k] for k in keys if k in group}))
    return planned


def apply_hyperparameters(planned: Sequence[tuple[Slot, dict[str, Any], dict[str, Any]]]
                          ) -> None:
    """Install what :func:`plan_hyperparameters` validated."""
    for slot, spec, values in planned:
        with slot.lock:
            slot.spec = spec
            slot.sgd_lr = plain_sgd_lr(spec)
            slot.optimizer.param_groups[0].update(values)  # type: ignore[union-attr]


def load_optimizer_state(slot: Slot, tensors: dict[str, torch.Tensor],
                         scalars: dict[str, Any]) -> None:
    """Install optimizer state checked by :func:`check_opt_state` into a new slot."""
    if slot.optimizer is None or not (tensors or scalars):
        return
    state: dict[str, Any] = dict(scalars)
    state.update({k: t.clone() for k, t in tensors.items()})
    group = {**slot.optimizer.param_groups[0]}
    group["params"] = [0]
    slot.optimizer.load_state_dict({"state": {0: state}, "param_groups": [group]})


# ---------------------------------------------------------------------- outer rounds
def staleness_weight(slot: Slot, staleness: int) -> float:
    """How much a contribution computed ``staleness`` versions ago counts: ``1 / (1 +
    staleness)`` under the ``"inverse"`` rule (the default: the staleness-aware learning rate
    of Zhang, Gupta, Lian, Liu, IJCAI 2016, shifted so that a fresh contribution counts
    fully), 1 under ``"none"``."""
    rule = (slot.spec or {}).get(ps_optim.OUTER_STALENESS, "inverse")
    return 1.0 / (1 + staleness) if rule == "inverse" else 1.0


def _close(slot: Slot) -> str:
    """Apply the round's merged pseudo-gradient (its weighted sum divided by the larger of its
    samples and the spec's ``outer_round_samples``) as one outer optimizer step
    and start the next round (caller holds the lock; the round has a contribution)."""
    assert slot.acc is not None and slot.acc_weight > 0
    full = (slot.spec or {}).get(ps_optim.OUTER_ROUND)
    divisor = slot.acc_weight if full is None else max(slot.acc_weight, float(full))
    merged = slot.acc.div_(divisor).to(slot.value.dtype)
    kind = (slot.spec or {}).get(ps_optim.OUTER_DOWNLOAD)
    before = slot.value.clone() if kind is not None else None
    if finite(merged) and apply_gradient(slot, merged):
        status = "applied"
        if before is not None:
            _publish(slot, before, str(kind))
    else:
        if not finite(merged):
            slot.refused += 1
        status = "refused"
        slot.updates.clear()  # the version moves on unchanged: replicas fetch the model
    slot.merged += slot.acc_count
    slot.merged_samples += slot.acc_weight
    # A refused round still ends (the value unchanged): waiting replicas go on.
    slot.bump()
    return status


def _publish(slot: Slot, before: torch.Tensor, kind: str) -> None:
    """After an outer step: set the model to ``before`` moved by the encoded update (plus what
    earlier encodings dropped) and keep the encoding for the replicas that hold ``before``
    (caller holds the lock; the version is bumped after)."""
    u = slot.value.to(torch.float32) - before.to(torch.float32)
    if slot.down_residual is not None:
        u.add_(slot.down_residual)
    payload = updates_mod.encode(u, kind)
    new = updates_mod.apply(before, payload, kind)
    if not finite(new):  # the exact step is finite, its encoding overflowed the dtype: keep it
        slot.updates.clear()
        slot.down_residual = None
        return
    slot.down_residual = u.sub_(new.to(torch.float32) - before.to(torch.float32))
    slot.value.copy_(new)
    slot.updates.append((slot.version + 1, payload))


def updates_since(slot: Slot, have: int, lineage: int) -> list[tuple[int, torch.Tensor]] | None:
    """The encoded updates from version ``have`` (of ``lineage``) to the slot's own, oldest
    first, or None when a replica at ``have`` must fetch the model (another lineage, too old,
    no download kind, or not smaller than the model). Caller holds the lock."""
    if lineage != slot.lineage or not 0 <= have < slot.version or not slot.updates:
        return None
    chain = [(v, p) for v, p in slot.updates if v > have]
    if not chain or chain[0][0] != have + 1 or chain[-1][0] != slot.version:
        return None
    if sum(p.nbytes for _, p in chain) >= slot.value.nbytes:
        return None
    return chain


def contribute(slot: Slot, base: int, samples: float, delta: Callable[[], torch.Tensor],
               now: float) -> list[Any]:
    """Outer mode: add one replica's pseudo-gradient (computed on version ``base``, covering
    ``samples``) to the open round, weighted by ``samples * staleness_weight``; the round
    closes (one outer step) when it holds ``replicas_to_aggregate`` contributions. Returns
    ``[staleness, status, version]``: status "accumulated", "applied", "refused" (the step
    would have made the tensor non-finite) or "dropped" (a base from the future)."""
    with slot.lock:
        staleness = slot.version - base
        if staleness < 0:
            slot.dropped += 1
            return [staleness, "dropped", slot.version]
        d = delta()
        w = float(samples) * staleness_weight(slot, staleness)
        if slot.acc is None:
            slot.acc = d.to(torch.float64, copy=True).mul_(w)
        else:
            slot.acc.add_(d, alpha=w)
        slot.acc_weight += float(samples)
        slot.acc_count += 1
        if slot.opened_at is None:
            slot.opened_at = now
        status = "accumulated"
        if slot.acc_count >= slot.replicas_to_aggregate:
            status = _close(slot)
        return [staleness, status, slot.version]


def close_round(slot: Slot, version: int, now: float, *, force: bool = False,
                leaving: bool = False) -> list[Any]:
    """Close the open round of version ``version`` early: once its grace window (the spec's
    ``outer_grace`` seconds since its first contribution) has passed, or at once with
    ``force`` (a replica's last contribution, so that nothing it trained stays unmerged).
    Returns ``[status, version]``: "applied"/"refused" (closed now), "closed" (the version
    already moved on), "empty" (no contribution yet) or "open" (the window has not passed).

    ``leaving``: the caller has sent its last pseudo-gradient (it finished training), so later
    rounds need one contribution fewer (at least 1), and an open round that is now full
    closes: the replicas still training do not wait a grace window per round for one that
    will not come."""
    with slot.lock:
        if leaving:
            slot.replicas_to_aggregate = max(1, slot.replicas_to_aggregate - 1)
            if 0 < slot.acc_count >= slot.replicas_to_aggregate:
                return [_close(slot), slot.version]  # the open round is now full
        if slot.version != version:
            return ["closed", slot.version]
        if slot.acc_count == 0 or slot.opened_at is None:
            return ["empty", slot.version]
        grace = (slot.spec or {}).get(ps_optim.OUTER_GRACE)
        if not force and (grace is None or now - slot.opened_at < float(grace)):
            return ["open", slot.version]
        return [_close(slot), slot.version]
