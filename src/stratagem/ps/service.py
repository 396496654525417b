"""A parameter-server shard's operations on its tensors, with no transport in them.

Lineage: TensorFlow's ``ps`` job. :class:`ShardService` holds the slots (one tensor, its
optimizer, version and lock each: :mod:`stratagem.ps.rules`), the quota, and one method per
operation of a :mod:`stratagem.ps.wire` message: ``health``, ``register``, ``pull``,
``pull_rows``, ``push``, ``push_sparse``, ``elastic``, ``contribute``, ``close_round``,
``set_hyperparams``, ``get_state``, ``set_state``, ``shutdown``, and ``wait_version`` as a plan (:meth:`ShardService.plan_wait`)
whose waiting belongs to the transport. A request comes in as bytes or a decoded
:class:`~stratagem.ps.wire.Message`; the answer leaves as encoded bytes, or as a refusal
raised (:class:`~stratagem.ps.wire.WireError` with its gRPC status name), which
:meth:`ShardService.refusal` turns into an :class:`Abort` value for any transport.

Every bound that is a property of the request (reply size, ``max_tensors``, the quota,
repeated names, finiteness) is checked here, before anything is allocated or locked, so each
transport gets the same refusals: the conformance suite (``tests/ps/test_conformance.py``)
runs one set of cases against this class alone and against every transport. What bounds the
transport itself (bytes in flight, deadlines, connections, doorbells) lives beside it:
:mod:`stratagem.ps.admission`, :mod:`stratagem.ps.server` (gRPC),
:mod:`stratagem.ps.serve_shm` (shared memory and doorbells).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.compression import ASYNC_OUTER_KINDS
from stratagem.ps import optim as ps_optim
from stratagem.ps import rules, updates, wire
from stratagem.ps.rules import Slot
from stratagem.ps.rules import is_int as _is_int
from stratagem.ps.rules import refused as _err
from stratagem.ps.wire import Entry, Message, WireError
from stratagem.quantize import DEFAULT_BLOCK, QUANT_KINDS
from stratagem.validation import check_int, check_number

__all__ = ["Abort", "ShardService", "Throttle", "Wait", "field_float", "field_int",
           "field_names", "first_repeat", "locked", "INLINE_BYTES"]

log = logging.getLogger("stratagem.ps.server")

#: A ``push``, ``pull`` or ``health`` that touches at most this many tensor bytes (pushed plus
#: fetched) may run on a transport's event loop itself when no tensor thread is busy: handing
#: it to a thread and back cost more than the work (~0.35 ms of CPU per call, measured with
#: 64 KiB buckets), and a bucketed Downpour step makes up to 16 such calls per worker. The
#: bound keeps the loop's pause per call to about a millisecond.
INLINE_BYTES = 1 << 20
_INLINE_OPS = frozenset({"push", "pull", "health"})
#: What a tensor entry (in a request, or a slot a reply lists) counts as in that bound: its
#: header JSON, checks and objects cost ~10 us each, so a request of a few thousand empty
#: tensors is decoded and served on a tensor thread, not on the loop.
_ENTRY_BYTES = 4096
#: A registered message may be kept as the slots' storage when at most this much (plus an
#: eighth of the registered bytes) of it is something else.
_ADOPT_SLACK = 64 << 10


def field_int(fields: dict[str, Any], key: str, default: int | None = None, *,
              minimum: int | None = 0) -> int | None:
    """Request field ``key`` as an int (not a bool) >= ``minimum``; None when absent and no
    default. Refused (INVALID_ARGUMENT) with :func:`stratagem.validation.check_int`'s words."""
    v = fields.get(key, default)
    if v is None:
        return None
    try:
        return check_int(f"field {key!r}", v, minimum=minimum)
    except ValueError as exc:
        raise _err(str(exc)) from None


def field_float(fields: dict[str, Any], key: str, default: float | None = None) -> float:
    """Request field ``key`` as a finite number (:func:`stratagem.validation.check_number`)."""
    try:
        return check_number(f"field {key!r}", fields.get(key, default), finite=True)
    except ValueError as exc:
        raise _err(str(exc)[:200]) from None


def first_repeat(items: Sequence[str]) -> str:
    """The first item of ``items`` seen twice ("" if none)."""
    seen: set[str] = set()
    for n in items:
        if n in seen:
            return n
        seen.add(n)
    return ""


def field_names(fields: dict[str, Any], key: str = "names") -> list[str] | None:
    """Request field ``key`` as a list of distinct strings (None when absent)."""
    v = fields.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise _err(f"field {key!r} must be a list of strings")
    if len(set(v)) != len(v):  # a name repeated N times would cost N copies in the reply
        raise _err(f"field {key!r} names {first_repeat(v)!r} more than once; name each tensor "
                   "once")
    return v


class Throttle:
    """At most one log line per key every ``every`` seconds, counting what it held back: a
    shard under attack (or a slot failing on every push) must not flood its log."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, level: int, message: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last, held = self._seen.get(key, (-math.inf, 0))
            if now - last < self.every:
                self._seen[key] = (last, held + 1)
                return False
            if len(self._seen) > 256:  # keys include peers: keep the table bounded
                self._seen.clear()
            self._seen[key] = (now, 0)
        log.log(level, "%s%s", message,
                f" ({held} similar in the last {self.every:g} s not logged)" if held else "")
        return True


class Abort:
    """A refusal as a value: the gRPC status name and the explanation sent to the caller
    (a transport answers it in its own way: a gRPC status, a doorbell's ``refused``)."""

    def __init__(self, status: str, detail: str) -> None:
        self.status, self.detail = status, detail


@dataclass
class Wait:
    """A checked ``wait_version`` request: the slots whose versions it waits for, their
    goals, the slots whose values it answers with, and how long it may wait."""

    slots: list[Slot]
    goals: list[tuple[Slot, int]]
    wanted: list[Slot]
    timeout: float

    def reached(self) -> bool:
        return all(s.version >= goal for s, goal in self.goals)


def _state_sizes(slot: Slot) -> list[tuple[str, int]]:
    """``(name, bytes)`` of what ``get_state`` sends for ``slot``: its value and its optimizer
    state tensors, read without the slot's lock (a step may be adding state: then every
    tensor its optimizer could hold is counted at the value's size)."""
    out = [(slot.name, slot.value.nbytes)]
    if slot.optimizer is not None:
        try:
            for state in list(slot.optimizer.state.values()):
                out += [(f"{slot.name}.{k}", v.nbytes) for k, v in list(state.items())
                        if isinstance(v, torch.Tensor)]
        except RuntimeError:  # changed while read
            out += [(f"{slot.name}.state{i}", slot.value.nbytes) for i in range(4)]
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


#: A checked gradient of a push: its slot, its entry, and its cast (built lazily).
Checked = tuple[Slot, Entry, Callable[[], torch.Tensor]]


class ShardService:
    """The tensors of one shard and the operations on them; no sockets, threads or loops.

    Each tensor has its own lock, optimizer and version counter, so operations on different
    tensors may run concurrently on any threads a transport chooses. Transports add their own
    operations with :meth:`add_op` (the shared-memory ones) and learn of version changes
    through ``on_change`` (to wake ``wait_version`` callers) and of a ``shutdown`` call
    through ``on_shutdown``; ``health_fields`` adds what a transport reports to ``health``.
    """

    def __init__(self, *, limits: wire.Limits, max_bytes: int, address: str = "?") -> None:
        self.limits = limits
        self.max_bytes = check_int("max_bytes", max_bytes, minimum=0,
                                   fix="pass the shard's quota of registered bytes")
        #: How the shard is named in refusals (its transport's address, set once bound).
        self.address = address
        self.slots: dict[str, Slot] = {}
        self.registry_lock = threading.Lock()
        self.charged = 0  # bytes of registered tensors + optimizer state (the quota)
        self.stopped = threading.Event()
        self.throttle = Throttle()
        self.started = time.monotonic()
        self.on_change: Callable[[], None] = lambda: None
        self.on_shutdown: Callable[[], None] = lambda: None
        self.health_fields: list[Callable[[], dict[str, Any]]] = []
        self.ops: dict[str, Callable[[Message], bytes]] = {
            "health": self.health, "register": self.register, "pull": self.pull,
            "pull_rows": self.pull_rows, "push": self.push, "push_sparse": self.push_sparse,
            "elastic": self.elastic, "contribute": self.contribute,
            "close_round": self.close_round, "set_hyperparams": self.set_hyperparams,
            "get_state": self.get_state, "set_state": self.set_state,
            "shutdown": self.shutdown,
        }
        self._inline_cost: dict[str, Callable[[Message], int]] = {}

    def add_op(self, op: str, fn: Callable[[Message], bytes],
               inline_cost: Callable[[Message], int] | None = None) -> None:
        """Serve ``op`` with ``fn``; ``inline_cost`` is its bytes for :meth:`inline_bytes`
        (absent: it never runs on a transport's loop)."""
        self.ops[op] = fn
        if inline_cost is not None:
            self._inline_cost[op] = inline_cost

    # -- requests ---------------------------------------------------------------------------

    def valid_ops(self) -> list[str]:
        return sorted([*self.ops, "wait_version"])

    def check_op(self, op: str) -> None:
        if op not in self.ops and op != "wait_version":
            raise _err(f"unknown op {op!r}; valid: {self.valid_ops()}")

    def decode(self, request: bytes | bytearray | mmap.mmap) -> Message:
        """``request`` decoded within the limits, its op known and no tensor named twice."""
        msg = wire.decode(request, self.limits)
        self.check_op(msg.op)
        names = [e.name for e in msg.entries]
        if len(set(names)) != len(names):
            raise _err(f"{msg.op}: tensor {first_repeat(names)!r} appears more than once in "
                       "one request; send each tensor once")
        return msg

    def dispatch(self, msg: Message) -> bytes | Message:
        """The answer to ``msg``; a ``wait_version`` comes back as itself (the transport waits:
        :meth:`plan_wait`, :meth:`finish_wait`)."""
        if msg.op == "wait_version":
            return msg
        return self.ops[msg.op](msg)

    def run(self, request: bytes | bytearray | mmap.mmap) -> bytes | Message:
        return self.dispatch(self.decode(request))

    def refusal(self, exc: Exception) -> Abort:
        """What a request that raised ``exc`` is answered (any transport): a refusal's own
        status, INVALID_ARGUMENT for a bad value, UNAVAILABLE while stopping, else INTERNAL
        (logged)."""
        if isinstance(exc, WireError):
            return Abort(exc.status, str(exc))
        if isinstance(exc, (ValueError, TypeError)):
            return Abort("INVALID_ARGUMENT", str(exc))
        if isinstance(exc, RuntimeError) and self.stopped.is_set():
            return Abort("UNAVAILABLE", "the shard is stopping")
        return self.internal(exc)

    def internal(self, exc: BaseException) -> Abort:
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        at = (f" at {os.path.basename(where.tb_frame.f_code.co_filename)}:{where.tb_lineno}"
              if where is not None else "")
        self.throttle(f"INTERNAL:{type(exc).__name__}", logging.ERROR,
                      f"parameter-server shard {self.address}: unexpected "
                      f"{type(exc).__name__}{at}: {str(exc)[:300]}")
        return Abort("INTERNAL", f"{type(exc).__name__}: {exc}")

    def inline_bytes(self, msg: Message) -> int:
        """The tensor bytes ``msg`` touches, or more than :data:`INLINE_BYTES` when it may
        not run on a transport's loop (a malformed field is left for the op to refuse)."""
        cost = self._inline_cost.get(msg.op)
        if cost is not None:
            return cost(msg)
        if msg.op not in _INLINE_OPS:
            return INLINE_BYTES + 1
        total = sum(e.tensor.nbytes + _ENTRY_BYTES for e in msg.entries)
        names = msg.fields.get("fetch" if msg.op == "push" else "names")
        if msg.op == "health" or (msg.op == "pull" and names is None):  # every tensor
            if len(self.slots) * _ENTRY_BYTES > INLINE_BYTES:
                return INLINE_BYTES + 1
            if msg.op == "health":
                return total
            return total + sum(s.value.nbytes + _ENTRY_BYTES for s in self.slots.values())
        if isinstance(names, list):
            for n in names:
                slot = self.slots.get(n) if isinstance(n, str) else None
                total += _ENTRY_BYTES + (0 if slot is None else slot.value.nbytes)
                if total > INLINE_BYTES:
                    break
        return total

    # -- helpers ----------------------------------------------------------------------------

    def slot(self, name: str) -> Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise _err(f"tensor {name!r} is not registered on shard {self.address}; "
                       "register it first", "NOT_FOUND")
        return slot

    def select(self, names: list[str] | None, op: str = "this call") -> list[Slot]:
        """The slots named (None: every slot), counted against ``max_tensors`` before any is
        looked up, sorted or locked."""
        self.check_count(op, len(self.slots) if names is None else len(names), names is None)
        if names is None:
            return [self.slots[k] for k in sorted(self.slots)]
        return [self.slot(n) for n in names]

    def check_count(self, op: str, count: int, whole: bool, *, names: bool = True) -> None:
        """Refuse a call that would walk (and reply with) more than ``max_tensors`` tensors,
        from the count alone: before any slot is visited or locked, so a shard of many
        tensors answers such a call at once instead of holding every lock first."""
        bound = self.limits.max_tensors
        if count <= bound:
            return
        what = (f"every tensor of shard {self.address} ({count})" if whole
                else f"{count} tensors")
        fix = (f"name the tensors you need (names=[...]), at most {bound} per call"
               if names else "spread the tensors over more shards")
        raise _err(f"{op}: the reply would cover {what}, above this shard's max_tensors="
                   f"{bound} per message; refused before any tensor was read. Fix: {fix}",
                   "RESOURCE_EXHAUSTED")

    def check_reply(self, op: str, tensors: Sequence[tuple[str, int]], extra: int = 0) -> None:
        """Refuse, before allocating anything, a reply that would exceed max_message_bytes."""
        if len(tensors) > self.limits.max_tensors:
            raise _err(f"{op}: the reply would hold {len(tensors)} tensors, above this shard's "
                       f"max_tensors={self.limits.max_tensors} per message. Fix: ask for fewer "
                       "tensors per call (name them)", "RESOURCE_EXHAUSTED")
        # Per tensor: its bytes, alignment, and its JSON entry (name, dtype, shape, offsets).
        total = 1024 + extra + sum(nbytes + 8 + 200 + 2 * len(name) for name, nbytes in tensors)
        if total > self.limits.max_message_bytes:
            raise _err(f"{op}: the reply would be about {total} bytes, above this shard's "
                       f"max_message_bytes={self.limits.max_message_bytes}. Fix: ask for fewer "
                       "tensors per call (more shards or a partitioner split big tensors), or "
                       "raise max_message_bytes on the shard and the client",
                       "RESOURCE_EXHAUSTED")

    def snapshot(self, slots: Sequence[Slot], op: str = "values",
                 fields: dict[str, Any] | None = None) -> bytes:
        """Encode the values of ``slots`` as one consistent snapshot."""
        self.check_reply(op, [(s.name, s.value.nbytes) for s in slots],
                         extra=len(json.dumps(fields or {})))
        # The given slots' own locks (a slot replaced by set_state meanwhile keeps its lock), in
        # a fixed order: no deadlock.
        with locked(slots):
            return wire.encode(op, fields, [Entry(s.name, s.value, s.version) for s in slots])

    def check_quota(self, op: str, adding: int, freeing: int = 0) -> None:
        """Caller holds ``registry_lock``."""
        after = self.charged - freeing + adding
        if adding > freeing and after > self.max_bytes:
            raise _err(f"{op}: registering {adding} more bytes (tensors plus optimizer state) "
                       f"would bring shard {self.address} to {after} bytes, above its quota "
                       f"max_bytes={self.max_bytes}. Fix: use more shards, or start the shard "
                       "with a larger --max-bytes", "RESOURCE_EXHAUSTED")

    def register_cost_from_header(self, metas: Sequence[Any]) -> Abort | None:
        """Refuse a ``register`` by its header alone, before its tensors are received: its new
        tensors' declared bytes plus the per-slot overhead (a lower bound of what registering
        them charges) would pass ``max_bytes``. Checked again, exactly, when it is served."""
        new: dict[str, int] = {}
        for m in metas:  # claims, checked when the request is decoded: count only sane ones
            if not isinstance(m, dict):
                continue
            name, nbytes = m.get("name"), m.get("nbytes")
            if (isinstance(name, str) and isinstance(nbytes, int) and nbytes >= 0
                    and name not in self.slots):
                new[name] = max(new.get(name, 0), int(nbytes) + rules.SLOT_OVERHEAD_BYTES)
        adding, charged = sum(new.values()), self.charged
        if charged + adding <= self.max_bytes:
            return None
        return Abort("RESOURCE_EXHAUSTED",
                     f"register: the request's {len(new)} new tensors need at least {adding} "
                     f"bytes, and shard {self.address} holds {charged} of its quota "
                     f"max_bytes={self.max_bytes} (refused from the request's header, before "
                     "its tensors were received). Fix: use more shards, or start the shard "
                     "with a larger --max-bytes")

    def offer(self, slot: Slot, base: int | None, max_staleness: int | None,
              grad: Callable[[], torch.Tensor]) -> list[Any]:
        """:func:`stratagem.ps.rules.offer`, then wake the version waiters if it applied."""
        return self._after_offer(slot, rules.offer(slot, base, max_staleness, grad))

    def _after_offer(self, slot: Slot, result: list[Any]) -> list[Any]:
        """Wake the version waiters if the offer applied; log a refused step."""
        if result[1] == "applied" or (result[1] == "refused" and slot.mode == "sync"):
            self.on_change()
        if result[1] == "refused":
            self.throttle(f"refused:{slot.name}", logging.WARNING,
                          f"parameter-server shard {self.address}: refused a step of "
                          f"{slot.name!r} that would make it non-finite; it keeps its last "
                          f"finite value ({slot.refused} refused so far)")
        return result

    def check_push(self, entries: Sequence[Entry]) -> list[Checked]:
        """The pushed gradients, each with its slot and its cast (built lazily), after every
        check a push gets (shape, dtype, base version, finiteness, overflow of the cast):
        everything is checked before anything is applied, so one bad tensor refuses the
        request. Shared by every transport's push."""
        checked: list[Checked] = []
        slots: list[Slot] = []
        for e in entries:
            slot = self.slot(e.name)
            if slot.mode in ("elastic", "outer"):
                what, op = (("elastic averaging", "elastic") if slot.mode == "elastic"
                            else ("outer rounds", "contribute"))
                raise _err(f"tensor {slot.name!r} is registered for {what}; it takes {op!r} "
                           "calls, not gradient pushes", "FAILED_PRECONDITION")
            if e.version is None:
                raise _err(f"gradient for {slot.name!r} carries no base version")
            slots.append(slot)
        rules.check_grads([(slot, e.tensor) for slot, e in zip(slots, entries, strict=True)])
        for slot, e in zip(slots, entries, strict=True):
            if rules.narrows(e.tensor.dtype, slot.value.dtype):
                # Checked after the cast, before anything is applied (what will be stored).
                cast = rules.to_slot_dtype(slot, e.tensor)
                checked.append((slot, e, functools.partial(_same, cast)))
            else:  # built lazily: a dropped gradient costs nothing
                checked.append((slot, e, functools.partial(rules.to_slot_dtype, slot, e.tensor)))
        return checked

    def apply_push(self, checked: Sequence[Checked], max_staleness: int | None
                   ) -> list[list[Any]]:
        """Offer the checked gradients: one fused optimizer step for the tensors of this push
        that share an optimizer configuration (rules.offer_many), the same results as one
        offer per tensor."""
        results = rules.offer_many([(slot, e.version, grad) for slot, e, grad in checked],
                                   max_staleness)
        for (slot, _, _), result in zip(checked, results, strict=True):
            self._after_offer(slot, result)
        return results

    # -- operations -------------------------------------------------------------------------

    def health(self, msg: Message) -> bytes:
        # Its versions list every tensor: counted before anything is walked.
        self.check_count("health", len(self.slots), True, names=False)
        with self.registry_lock:
            slots = list(self.slots.values())
            charged = self.charged
        fields: dict[str, Any] = {
            "ok": True, "pid": os.getpid(), "num_tensors": len(slots),
            "bytes": sum(s.value.nbytes for s in slots), "dropped": sum(s.dropped for s in slots),
            "refused": sum(s.refused for s in slots),
            "charged_bytes": charged, "max_bytes": self.max_bytes,
            "uptime_seconds": time.monotonic() - self.started,
            "versions": {s.name: s.version for s in slots},
            # Asynchronous DiLoCo: the samples (inner steps) merged into the global model, as
            # the most-merged tensor counts them (every pseudo-gradient covers every tensor).
            "outer_merged_samples": max((s.merged_samples for s in slots
                                         if s.mode == "outer"), default=0.0),
            # As a request handler sees it: the width of each optimizer step (see serve()).
            "intra_op_threads": torch.get_num_threads(),
        }
        for more in self.health_fields:
            fields.update(more())
        self.check_reply("health", [], extra=64 * len(slots) + sum(len(s.name) for s in slots))
        return wire.encode("health", fields)

    def register(self, msg: Message) -> bytes:
        specs = msg.fields.get("specs", [])
        meta = msg.fields.get("entries")
        if not isinstance(specs, list) or not isinstance(meta, list) or len(meta) != len(
                msg.entries):
            raise _err("register needs fields 'specs' (list) and 'entries' (one per tensor)")
        # The reply holds every named tensor: refuse a too-big one before creating anything.
        self.check_reply("register", [(e.name, e.tensor.nbytes) for e in msg.entries])
        with self.registry_lock:  # all or nothing; the first registration of a name wins
            todo: list[tuple[Entry, str, Any, Any]] = []
            cost = 0
            for e, m in zip(msg.entries, meta, strict=True):
                if not isinstance(m, dict):
                    raise _err("register: each entry must be an object")
                old = self.slots.get(e.name)
                if old is not None:
                    if old.value.shape != e.tensor.shape or old.value.dtype != e.tensor.dtype:
                        raise _err(
                            f"tensor {e.name!r} is registered with shape "
                            f"{tuple(old.value.shape)} {old.value.dtype}, this worker has "
                            f"{tuple(e.tensor.shape)} {e.tensor.dtype}; every worker must "
                            "build the same model", "FAILED_PRECONDITION")
                    continue
                idx = m.get("spec")
                spec = None
                if idx is not None:
                    if not _is_int(idx) or not 0 <= idx < len(specs):
                        raise _err(f"register: bad spec index {idx!r}")
                    spec = specs[idx]
                mode = m.get("mode", "async")
                cost += rules.cost(e.tensor, mode, spec)
                todo.append((e, mode, spec, m.get("replicas_to_aggregate", 1)))
            self.check_quota("register", cost)
            # Keep the received tensors as the slots' values (no copy) when the message is
            # (nearly) all new tensors: a copy would double what registering costs, beyond
            # the quota. A message carrying much else is copied so it is not kept alive.
            adopted = sum(e.tensor.nbytes for e, _, _, _ in todo)
            keep = msg.nbytes - adopted <= adopted // 8 + _ADOPT_SLACK
            new = [rules.make_slot(e.name, e.tensor, mode, spec, replicas, copy=not keep)
                   for e, mode, spec, replicas in todo]  # any refusal: nothing was inserted
            for slot in new:
                self.slots[slot.name] = slot
            self.charged += cost
            created = {s.name for s in new}
            # The reply carries only the tensors registered before: the caller has the
            # values it just created (echoing them would cost their size once more).
            slots = [self.slots[e.name] for e in msg.entries if e.name not in created]
        return self.snapshot(slots, "register", {"created": [s.name for s in new]})

    def pull(self, msg: Message) -> bytes:
        return self.snapshot(self.select(field_names(msg.fields), "pull"))

    def pull_rows(self, msg: Message) -> bytes:
        name = msg.fields.get("name")
        slot = self.slot(name if isinstance(name, str) else "")
        idx = msg.tensors().get("indices")
        if idx is None or idx.dtype != torch.int64 or idx.dim() != 1 or slot.value.dim() < 1:
            raise _err("pull_rows needs a 1-D int64 tensor 'indices' and a tensor with dim >= 1")
        rows = slot.value.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            raise _err(f"pull_rows: indices must be in [0, {rows}) for {name!r}")
        if idx.numel() > 1 and int(torch.unique(idx).numel()) != idx.numel():
            raise _err(f"pull_rows: indices for {name!r} repeat a row; ask for each row once "
                       "(the client expands repeats locally)")
        row_bytes = slot.value.nbytes // max(1, rows)
        self.check_reply("pull_rows", [(slot.name, idx.numel() * row_bytes)])
        with slot.lock:
            out = slot.value.index_select(0, idx)
            version = slot.version
        return wire.encode("rows", None, [Entry(slot.name, out, version)])

    def push(self, msg: Message) -> bytes:
        max_staleness = field_int(msg.fields, "max_staleness")
        fetch = field_names(msg.fields, "fetch")
        wanted = [self.slot(n) for n in fetch] if fetch is not None else []
        checked = self.check_push(msg.entries)
        if fetch is not None:
            self.check_reply("push", [(s.name, s.value.nbytes) for s in wanted],
                             extra=64 * len(checked))
        results = self.apply_push(checked, max_staleness)
        if fetch is None:
            return wire.encode("pushed", {"results": results})
        # Push and fetch in one round trip (a Downpour step): the values after this push.
        return self.snapshot(wanted, "pushed", {"results": results})

    def push_sparse(self, msg: Message) -> bytes:
        name = msg.fields.get("name")
        slot = self.slot(name if isinstance(name, str) else "")
        t = msg.tensors()
        idx, values = t.get("indices"), t.get("values")
        shape = tuple(slot.value.shape)
        if (idx is None or values is None or idx.dtype != torch.int64 or idx.dim() != 1
                or len(shape) < 1 or tuple(values.shape) != (idx.numel(), *shape[1:])
                or not values.is_floating_point()):
            raise _err(f"push_sparse for {name!r} needs 1-D int64 'indices' (n,) and float "
                       f"'values' of shape (n, *{shape[1:]})")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= shape[0]):
            raise _err(f"push_sparse: indices must be in [0, {shape[0]}) for {name!r}")
        rules.require_finite(values, f"gradient rows for {slot.name!r}")
        cast = rules.to_slot_dtype(slot, values, "gradient rows")  # checked as it will be used
        base = next(e.version for e in msg.entries if e.name == "values")
        sparse = slot.mode == "async" and slot.spec is not None and ps_optim.supports_sparse(
            slot.spec)

        def grad() -> torch.Tensor:
            v = cast
            if sparse:
                return torch.sparse_coo_tensor(idx.unsqueeze(0), v, shape,
                                               check_invariants=True).coalesce()
            # Exactly the gradient a dense backward through the embedding would produce.
            return torch.zeros(shape, dtype=slot.value.dtype).index_add_(0, idx, v)

        result = self.offer(slot, base, field_int(msg.fields, "max_staleness"), grad)
        return wire.encode("pushed", {"results": [result]})

    def plan_wait(self, msg: Message, max_wait: float, time_left: float | None = None) -> Wait:
        """A ``wait_version`` request checked and sized before any waiting: its timeout (at
        most ``max_wait``, and answered 0.5 s before the caller's own deadline
        ``time_left``), the slots and goals, and its reply bounded by max_message_bytes."""
        target = field_int(msg.fields, "min_version", 0) or 0
        per_name = msg.fields.get("min_versions")
        if per_name is not None and (not isinstance(per_name, dict) or not all(
                _is_int(v) for v in per_name.values())):
            raise _err("field 'min_versions' must be an object of name -> integer")
        timeout = min(field_float(msg.fields, "timeout", 60.0), max_wait)
        if time_left is not None:  # answer (with reached=False) before the caller's deadline
            timeout = min(timeout, time_left - 0.5)
        slots = self.select(field_names(msg.fields), "wait_version")
        fetch = field_names(msg.fields, "fetch")
        wanted = slots if fetch is None else [self.slot(n) for n in fetch]
        self.check_reply("wait_version", [(s.name, s.value.nbytes) for s in wanted],
                         extra=sum(32 + len(s.name) for s in slots))
        goals = [(s, max(target, int((per_name or {}).get(s.name, 0)))) for s in slots]
        return Wait(slots, goals, wanted, max(0.0, timeout))

    def finish_wait(self, wait: Wait) -> bytes:
        """The answer to a ``wait_version`` once it is over: whether its goals were reached,
        every waited slot's version, and the values it fetches (all by default: a caller that
        reads sparse rows on demand needs the versions of an embedding, not its megabytes)."""
        fields = {"reached": wait.reached(), "versions": {s.name: s.version for s in wait.slots}}
        return self.snapshot(wait.wanted, "values", fields)

    def elastic(self, msg: Message) -> bytes:
        a = field_float(msg.fields, "moving_rate")
        if not 0.0 < a <= 1.0:
            raise _err(f"moving_rate must be in (0, 1], got {a}")
        checked: list[tuple[Slot, str, torch.Tensor]] = []
        for e in msg.entries:
            slot = self.slot(e.name)
            if slot.mode != "elastic":
                raise _err(f"tensor {e.name!r} is registered in mode {slot.mode!r}, not "
                           "'elastic'", "FAILED_PRECONDITION")
            rules.check_grad(slot, e.tensor, "elastic exchange")
            checked.append((slot, e.name, rules.to_slot_dtype(slot, e.tensor,
                                                              "elastic exchange")))
        self.check_reply("elastic", [(s.name, s.value.nbytes) for s, _, _ in checked])
        out = []
        for slot, name, x in checked:
            try:
                d, version = rules.elastic_exchange(slot, x, a)
            except WireError:
                self.throttle(f"refused:{slot.name}", logging.WARNING,
                              f"parameter-server shard {self.address}: refused an elastic "
                              f"exchange for {slot.name!r} that would make it non-finite "
                              f"({slot.refused} refused so far)")
                raise
            out.append(Entry(name, d, version))
        self.on_change()
        return wire.encode("elastic", None, out)

    def _outer_slot(self, name: str, op: str) -> Slot:
        slot = self.slot(name)
        if slot.mode != "outer":
            raise _err(f"{op}: tensor {name!r} is registered in mode {slot.mode!r}, not "
                       "'outer' (asynchronous DiLoCo)", "FAILED_PRECONDITION")
        return slot

    def contribute(self, msg: Message) -> bytes:
        """Asynchronous DiLoCo: one replica's pseudo-gradients (each entry's version is the
        model version it was computed on), covering ``samples``, in their own dtype, a
        16-bit cast, or blockwise ``int8``/``int4`` (one uint8 payload per tensor, its size
        checked against the tensor's before it is decoded). Everything is checked before
        anything is added; ``fetch``: the reply carries the values after it."""
        samples = field_float(msg.fields, "samples")
        if not 0.0 < samples <= 1e12:
            raise _err(f"contribute: samples must be a number in (0, 1e12], got {samples}")
        kind = msg.fields.get("compression")
        if kind not in ASYNC_OUTER_KINDS:
            raise _err(f"contribute: compression must be one of {list(ASYNC_OUTER_KINDS)}, "
                       f"got {kind!r}")
        fetch = msg.fields.get("fetch", False)
        if not isinstance(fetch, bool):
            raise _err(f"contribute: fetch must be true or false, got {fetch!r}")
        checked: list[tuple[Slot, int, torch.Tensor]] = []
        for e in msg.entries:
            slot = self._outer_slot(e.name, "contribute")
            if e.version is None:
                raise _err(f"pseudo-gradient for {slot.name!r} carries no base version")
            if kind in QUANT_KINDS:
                delta = _dequantized(slot, e.tensor, kind)
            else:
                rules.check_grad(slot, e.tensor, "pseudo-gradient")
                delta = rules.to_slot_dtype(slot, e.tensor, "pseudo-gradient")
            checked.append((slot, e.version, delta))
        slots = [s for s, _, _ in checked]
        if fetch:
            self.check_reply("contribute", [(s.name, s.value.nbytes) for s in slots],
                             extra=64 * len(slots))
        now = time.monotonic()
        results = [rules.contribute(slot, base, samples, functools.partial(_same, d), now)
                   for slot, base, d in checked]
        self._after_round(slots, [r[1] for r in results])
        fields = {"results": results}
        return (self.snapshot(slots, "contributed", fields) if fetch
                else wire.encode("contributed", fields))

    def close_round(self, msg: Message) -> bytes:
        """Close the named tensors' open rounds of the given versions once their grace window
        has passed (``force``: at once); ``fetch``: the reply carries the values after;
        ``leaving``: the caller will send no more (later rounds need one fewer)."""
        versions = msg.fields.get("versions")
        if not isinstance(versions, dict) or not all(
                isinstance(k, str) and _is_int(v) for k, v in versions.items()):
            raise _err("close_round needs 'versions', an object of name -> integer")
        force, fetch = msg.fields.get("force", False), msg.fields.get("fetch", False)
        leaving = msg.fields.get("leaving", False)
        if not all(isinstance(v, bool) for v in (force, fetch, leaving)):
            raise _err("close_round: force, fetch and leaving must be true or false")
        self.check_count("close_round", len(versions), False)
        have = msg.fields.get("have", {})
        if not isinstance(have, dict) or not all(
                k in versions and isinstance(v, list) and len(v) == 2
                and all(_is_int(x) for x in v) for k, v in have.items()):
            raise _err("close_round: 'have' must be an object of name (one of 'versions') -> "
                       "[version, lineage] integers")
        slots = [self._outer_slot(n, "close_round") for n in versions]
        if fetch:  # an encoded chain is sent only when smaller than the value: this bounds it
            self.check_reply("close_round", [(s.name, s.value.nbytes) for s in slots],
                             extra=96 * len(slots))
        now = time.monotonic()
        results = [rules.close_round(s, versions[s.name], now, force=force, leaving=leaving)
                   for s in slots]
        self._after_round(slots, [r[0] for r in results])
        fields: dict[str, Any] = {"results": results}
        if not fetch:
            return wire.encode("closed", fields)
        return self._values_since(slots, have, "closed", fields)

    def _values_since(self, slots: Sequence[Slot], have: Mapping[str, list[int]], op: str,
                      fields: dict[str, Any]) -> bytes:
        """The values of ``slots`` as one consistent snapshot, each either the value or, for a
        caller that holds an earlier version of the same lineage (``have``), the encoded
        updates since (``fields["updates"]``: name -> how many entries, oldest first), with
        every slot's lineage (``fields["lineage"]``)."""
        with locked(slots):
            entries: list[Entry] = []
            counts: dict[str, int] = {}
            for slot in slots:
                held = have.get(slot.name)
                chain = None if held is None else rules.updates_since(slot, held[0], held[1])
                if chain is None:
                    entries.append(Entry(slot.name, slot.value, slot.version))
                else:
                    counts[slot.name] = len(chain)
                    entries.extend(Entry(slot.name, p, v) for v, p in chain)
            out = {**fields, "updates": counts,
                   "lineage": {slot.name: slot.lineage for slot in slots}}
            return wire.encode(op, out, entries)

    def _after_round(self, slots: Sequence[Slot], statuses: Sequence[str]) -> None:
        """Wake the version waiters if a round closed; log a refused outer step."""
        if any(st in ("applied", "refused") for st in statuses):
            self.on_change()
        for slot, st in zip(slots, statuses, strict=True):
            if st == "refused":
                self.throttle(f"refused:{slot.name}", logging.WARNING,
                              f"parameter-server shard {self.address}: refused an outer step "
                              f"of {slot.name!r} that would make it non-finite; it keeps its "
                              f"last finite value ({slot.refused} refused so far)")

    def set_hyperparams(self, msg: Message) -> bytes:
        hyper = msg.fields.get("hyperparams")
        if not isinstance(hyper, dict) or "name" in hyper:
            raise _err("set_hyperparams needs a 'hyperparams' object (without 'name')")
        # Validate every new configuration the way torch would before changing any slot.
        planned = rules.plan_hyperparameters(self.select(field_names(msg.fields),
                                                         "set_hyperparams"), hyper)
        rules.apply_hyperparameters(planned)
        return wire.encode("ok", {"changed": len(planned)})

    def get_state(self, msg: Message) -> bytes:
        slots = self.select(field_names(msg.fields), "get_state")
        # Counted and sized before any lock is taken (optimizer state read without its lock:
        # an estimate, checked again exactly under the locks below).
        self.check_reply("get_state", [(n, b) for s in slots for n, b in _state_sizes(s)])
        with locked(slots):
            entries: list[Entry] = []
            metas: list[dict[str, Any]] = []
            for slot in slots:
                meta: dict[str, Any] = {
                    "name": slot.name, "version": slot.version, "mode": slot.mode,
                    "spec": slot.spec, "replicas_to_aggregate": slot.replicas_to_aggregate,
                    "param": len(entries), "opt": {}, "scalars": {}}
                entries.append(Entry(slot.name, slot.value, slot.version))
                if slot.optimizer is not None:
                    state = slot.optimizer.state_dict()["state"].get(0, {})
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            meta["opt"][k] = len(entries)
                            entries.append(Entry(f"{slot.name}.{k}", v))
                        elif isinstance(v, (int, float, bool)):
                            meta["scalars"][k] = v
                metas.append(meta)
            fields = {"slots": metas}
            self.check_reply("get_state", [(e.name, e.tensor.nbytes) for e in entries],
                             extra=len(json.dumps(fields)))
            # Encoded under the locks: one consistent copy, no clone per tensor first.
            return wire.encode("state", fields, entries)

    def set_state(self, msg: Message) -> bytes:
        metas = msg.fields.get("slots")
        if not isinstance(metas, list):
            raise _err("set_state needs a 'slots' list")
        # if_newer: a slot the shard already holds at this version or a newer one is kept (a
        # replica re-seeding a restarted shard with the newest model it holds: the newest of
        # the replicas' copies wins, whatever the order they arrive in).
        if_newer = msg.fields.get("if_newer", False)
        if not isinstance(if_newer, bool):
            raise _err(f"set_state: if_newer must be true or false, got {if_newer!r}")
        n = len(msg.entries)
        used: set[int] = set()

        def take(i: Any, what: str) -> torch.Tensor:
            if not _is_int(i) or not 0 <= i < n:
                raise _err(f"set_state: bad {what} index {i!r} (the request has {n} tensors)")
            if i in used:
                raise _err(f"set_state: tensor {i} is used twice ({what}); each tensor of the "
                           "request may fill one slot entry")
            used.add(i)
            return msg.entries[i].tensor

        with self.registry_lock:  # all or nothing, and the quota checked against the truth
            plans: list[tuple[dict[str, Any], torch.Tensor, dict[str, torch.Tensor],
                              dict[str, Any]]] = []
            names: set[str] = set()
            adding = freeing = 0
            for m in metas:
                if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                    raise _err("set_state: each slot must be an object with a 'name'")
                name = m["name"]
                if name in names:
                    raise _err(f"set_state: slot {name!r} appears twice")
                names.add(name)
                value = take(m.get("param"), f"param of {name!r}")
                old = self.slots.get(name)
                if if_newer and old is not None and old.version >= (
                        field_int(m, "version", 0) or 0):
                    continue
                if old is not None and (old.value.shape != value.shape
                                        or old.value.dtype != value.dtype):
                    raise _err(f"set_state: tensor {name!r} is registered with shape "
                               f"{tuple(old.value.shape)} {old.value.dtype}, the state has "
                               f"{tuple(value.shape)} {value.dtype}; restore a checkpoint of "
                               "the same model", "FAILED_PRECONDITION")
                opt, scalars = m.get("opt", {}), m.get("scalars", {})
                if not isinstance(opt, dict) or not isinstance(scalars, dict):
                    raise _err("set_state: 'opt' and 'scalars' must be objects")
                mode, spec = m.get("mode", "async"), m.get("spec")
                tensors = {k: take(i, f"optimizer state {k!r} of {name!r}")
                           for k, i in opt.items()}
                if opt or scalars:
                    if mode == "elastic" or not isinstance(spec, dict):
                        raise _err(f"set_state: {name!r} has optimizer state but no optimizer")
                    rules.check_opt_state(name, value, spec, tensors, scalars)
                adding += rules.cost(value, mode, spec)
                if old is not None:
                    freeing += rules.cost(old.value, old.mode, old.spec)
                plans.append((m, value, tensors, scalars))
            self.check_quota("set_state", adding, freeing)
            new: list[Slot] = []
            for m, value, tensors, scalars in plans:
                slot = rules.make_slot(m["name"], value, m.get("mode", "async"), m.get("spec"),
                                       m.get("replicas_to_aggregate", 1))
                slot.version = field_int(m, "version", 0) or 0
                rules.load_optimizer_state(slot, tensors, scalars)
                new.append(slot)
            for slot in new:
                self.slots[slot.name] = slot
            self.charged += adding - freeing
        self.on_change()
        return wire.encode("ok", {"restored": [s.name for s in new]})

    def shutdown(self, msg: Message) -> bytes:
        self.on_shutdown()
        return wire.encode("ok", {"stopping": True})




def _dequantized(slot: Slot, payload: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 pseudo-gradient of ``slot`` carried by a quantized ``payload`` (the tensor's
    values padded to whole blocks): its size checked first, NaN or Inf refused after."""
    n = slot.value.numel()
    want, _ = updates.encoded_size(n, kind)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != want:
        raise _err(f"{kind} pseudo-gradient for {slot.name!r} must be a 1-D uint8 payload of "
                   f"{want} bytes ({n} values in blocks of {DEFAULT_BLOCK}), got "
                   f"{tuple(payload.shape)} {payload.dtype}", "FAILED_PRECONDITION")
    if not slot.value.is_floating_point():
        raise _err(f"tensor {slot.name!r} is not floating point; it cannot take a quantized "
                   "pseudo-gradient")
    delta = updates.decode(payload, kind, slot.value)
    rules.require_finite(delta, f"pseudo-gradient for {slot.name!r}")
    return rules.to_slot_dtype(slot, delta, "pseudo-gradient")


class locked:
    """Hold the locks of ``slots`` (each once, in name order: no deadlock)."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        self._locks = [s.lock for s in sorted({id(s): s for s in slots}.values(),
                                               key=lambda s: s.name)]

    def __enter__(self) -> None:
        for lk in self._locks:
            lk.acquire()

    def __exit__(self, *exc: object) -> None:
        for lk in reversed(self._locks):
            lk.release()
