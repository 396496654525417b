"""``FaultyComm``: a :class:`~stratagem.comm.Comm` whose collectives fail or stall on cue.

Why: the peer-diagnosis path (a collective errors or times out, :meth:`Comm.diagnose` reads
the heartbeats in the store, a :class:`~stratagem.PeerTimeoutError` names the peer) used to
be tested only by killing or freezing real processes and sleeping past the timeout: seconds
of process start-up per test, and the fault lands wherever the signal happens to. Declaring
the fault instead, as torchft's ``EventInjector().fail_at(rank=0, step=2)`` does for its
fault-tolerance tests, makes it deterministic (this call of that collective) and lets the
ranks run as threads (:func:`stratagem.testing.run_ranks`)::

    def job(comm):
        comm = FaultyComm(comm).fail_at(op="all_reduce", call=3, peer=1)
        strategy = sg.Mirrored(comm=comm)
        ...

How it reaches every collective: ``FaultyComm.group`` is a ``ProcessGroup`` subclass written
in Python that forwards to the real group. torch calls Python overrides of ``allreduce``,
``broadcast`` and ``allgather`` through its ``PyProcessGroup`` trampoline, so the faults fire
for the Comm's own methods (``all_reduce``, ``all_reduce_async``, ``broadcast``,
``all_gather`` and what is built on them) *and* for DDP's C++ reducer, whether ``Mirrored``
takes its built-in fast path or registers a comm hook: no strategy has to know it is under
test, and no path has to be forced. The real group's backend is registered on the wrapper
too, so operations it does not override run on the real group untouched.

Semantics (counts are per rank, 1-based, per operation; one DDP bucket is one
``all_reduce``; DDP's construction issues an ``all_gather`` and a ``broadcast``):

- :meth:`FaultyComm.fail_at` ``(op, call, peer)``: from that call on, rank ``peer`` is dead.
  On ``peer`` itself the call raises :class:`InjectedFault` (the process "died" there). On
  every other rank it fails the way gloo fails when a peer's connection drops (a
  ``DistBackendError``, "Connection closed by peer"), so the ordinary diagnosis runs and,
  reading ``peer``'s heartbeat as frozen, raises ``PeerTimeoutError`` naming it. Give every
  rank the same declaration, so no rank is left waiting for the dead one.
- :meth:`FaultyComm.stall_at` ``(op, call, seconds, rank)``: rank ``rank`` (default: every
  rank holding this FaultyComm) joins that call ``seconds`` late, alive (its heartbeat keeps
  beating) but reporting itself one collective behind while it waits, like a rank busy
  elsewhere. Its peers' collectives time out after ``comm.timeout`` and name it as stalled;
  nothing waits longer than its own timeout.

Use ``run_ranks(..., heartbeat=True)`` for the diagnosis to tell dead peers from stalled
ones (without heartbeats every silent rank reads as dead).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

import torch
import torch.distributed as dist

from ..comm import Comm

__all__ = ["FaultyComm", "InjectedFault", "OPS"]

#: The operations a fault can target: the collectives ``Comm`` and DDP issue on the group.
OPS = ("all_reduce", "broadcast", "all_gather", "all_to_all")

V = TypeVar("V")


class InjectedFault(Exception):
    """Raised on the rank that :meth:`FaultyComm.fail_at` declared dead, at the call where it
    dies (and at every collective after it): that rank's thread ends there, as its process
    would have."""


@dataclass(frozen=True)
class _Fault:
    kind: str
    op: str
    call: int
    peer: int | None = None
    seconds: float = 0.0
    rank: int | None = None


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class _FailedWork(dist.Work):
    """A collective that failed at once, for Comm's blocking collectives: ``wait`` raises
    inside ``Comm._wait``, which diagnoses it. (Never handed to DDP's C++ reducer: a Python
    work object there crashed the process on torch 2.13; that path gets the error raised.)"""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self._error = error

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        raise self._error

    def get_future(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_exception(self._error)
        return fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False


class _FrozenBeats(dist.Store):
    """The Comm's store as the diagnosis reads it: the heartbeat keys of dead peers hold a
    value that never changes (their heartbeat "stopped"); everything else is the real store."""

    def __init__(self, inner: dist.Store, dead: set[int]) -> None:
        super().__init__()
        self._inner = inner
        self._dead = dead

    def _frozen(self, key: str) -> bool:
        head, _, tail = key.rpartition("/")
        return "hb" in head.split("/") and tail.isdigit() and int(tail) in self._dead

    def get(self, key: str) -> bytes:
        return b"0:0" if self._frozen(key) else self._inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(self._frozen(k) or self._inner.check([k]) for k in keys)

    def set(self, key: str, value: str) -> None:
        self._inner.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)


class _FaultyGroup(dist.ProcessGroup):
    """The real group behind a Python subclass, so that every ``allreduce``/``broadcast``/
    ``allgather`` (from Python or from DDP's C++ reducer) passes :meth:`FaultyComm._issue`."""

    def __init__(self, inner: dist.ProcessGroup, owner: FaultyComm) -> None:
        # The (rank, size) constructor: the store one would make a second group on it.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self._inner = inner
        self._owner = owner
        # Everything not overridden below runs on the real backend (e.g. DDP's bookkeeping).
        cpu = torch.device("cpu")
        backend = inner._get_backend(cpu)
        backend_type = dist.ProcessGroup.BackendType.GLOO
        self._set_default_backend(backend_type)
        self._register_backend(cpu, backend_type, backend)

    def getBackendName(self) -> str:  # noqa: N802 - the name torch's trampoline calls
        return str(self._inner.name())

    def name(self) -> str:
        return str(self._inner.name())

    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._owner._issue("all_reduce", self._inner.allreduce, args, kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._owner._issue("broadcast", self._inner.broadcast, args, kwargs)

    def allgather(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._owner._issue("all_gather", self._inner.allgather, args, kwargs)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> dist.Work:
        return self._owner._issue("all_to_all", self._inner.alltoall_base, args, kwargs)


class _Shared(Generic[V]):
    """An attribute of the wrapped Comm (``obj._inner``), read and written through."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Shared[V]: ...

    @overload
    def __get__(self, obj: FaultyComm, objtype: type | None = None) -> V: ...

    def __get__(self, obj: FaultyComm | None, objtype: type | None = None) -> V | _Shared[V]:
        if obj is None:
            return self
        return getattr(obj._inner, self._name)  # type: ignore[no-any-return]

    def __set__(self, obj: FaultyComm, value: V) -> None:
        setattr(obj._inner, self._name, value)


class FaultyComm(Comm):
    """A :class:`Comm` over ``comm``'s process group whose collectives fail or stall on cue;
    accepted wherever a ``Comm`` is, e.g.
    ``sg.Mirrored(comm=FaultyComm(comm).fail_at(op="all_reduce", call=3, peer=1))``.

    - ``fail_at(op=, call=, peer=)``: from this rank's ``call``-th ``op`` on, rank ``peer`` is
      dead. ``peer`` raises :class:`InjectedFault`; the other ranks' collective fails as on a
      dropped connection and the ordinary diagnosis raises ``PeerTimeoutError`` naming
      ``peer`` (whose heartbeat reads as frozen). Declare it on every rank.
    - ``stall_at(op=, call=, seconds=, rank=)``: rank ``rank`` (default: this one) joins
      that call ``seconds`` late, alive but one collective behind; the others time out after
      ``comm.timeout`` and name it as stalled.

    ``op`` is ``"all_reduce"`` (also ``all_reduce_async``, barriers, coalesced variants and
    each DDP bucket), ``"broadcast"`` or ``"all_gather"``; ``call`` counts from 1 per rank
    and op. The faults fire on every path, DDP's C++ reducer included: ``group`` is a Python
    ``ProcessGroup`` forwarding to the real one, which torch calls through its trampoline (so
    ``Mirrored``'s built-in fast path is tested as it runs, not forced onto its hook path);
    the real group's timeout is set to ``comm.timeout`` so DDP's own waits are bounded by it.

    It shares ``comm``'s state (counters, heartbeat, store, timeout, close): closing either
    closes both. The declarations return ``self`` so they chain. Run threads with
    ``run_ranks(..., heartbeat=True)`` so the diagnosis can tell dead from stalled.
    """

    def __init__(self, comm: Comm) -> None:
        # Comm.__init__ is not called on purpose: the state is ``comm``'s (its heartbeat
        # reports ``comm.num_collectives``, which the collectives below advance).
        if isinstance(comm, FaultyComm):
            raise TypeError("comm is already a FaultyComm; declare more faults on it "
                            "instead of wrapping it twice")
        if not isinstance(comm, Comm):
            raise TypeError(f"comm must be a stratagem Comm, got {type(comm).__name__}")
        self._inner = comm
        self._faults: list[_Fault] = []
        self._calls: Counter[str] = Counter()
        self._dead: set[int] = set()
        self._waiting = threading.local()
        self._lock = threading.Lock()
        self._wrapped: tuple[dist.ProcessGroup, _FaultyGroup] | None = None
        #: What fired so far: ``(kind, op, call)``, for tests to assert the fault happened.
        self.fired: list[tuple[str, str, int]] = []

    # ------------------------------------------------------------------ declarations
    def fail_at(self, *, op: str, call: int, peer: int) -> FaultyComm:
        """From this rank's ``call``-th ``op`` on, rank ``peer`` is dead: it raises
        :class:`InjectedFault` there; every other rank's collective fails as on a dropped
        connection and raises ``PeerTimeoutError`` naming ``peer``."""
        if _check_int("peer", peer, 0) >= self._inner.world_size:
            raise ValueError(f"peer must be a rank below world_size={self._inner.world_size}, "
                             f"got {peer}")
        self._declare(_Fault("fail", op, call, peer=peer))
        return self

    def stall_at(self, *, op: str, call: int, seconds: float,
                 rank: int | None = None) -> FaultyComm:
        """Rank ``rank`` (default: this one) joins its ``call``-th ``op`` ``seconds`` late."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"seconds must be a positive number, got {seconds!r}")
        if rank is not None:
            _check_int("rank", rank, 0)
        self._declare(_Fault("stall", op, call, seconds=float(seconds), rank=rank))
        return self

    def _declare(self, fault: _Fault) -> None:
        if fault.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {fault.op!r} (all_reduce_async, "
                             "barrier and the coalesced variants are all_reduce/broadcast; "
                             "all_gather_bytes is all_gather)")
        _check_int("call", fault.call, 1)
        with self._lock:
            self._faults.append(fault)

    # ------------------------------------------------------------------ the injection
    def _issue(self, op: str, run: Callable[..., dist.Work], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dist.Work:
        with self._lock:
            self._calls[op] += 1
            n = self._calls[op]
            due = [f for f in self._faults if f.op == op and f.call == n]
            for f in due:
                if f.kind == "fail" and f.peer is not None:
                    self._dead.add(f.peer)
                if f.kind == "stall" and f.rank not in (None, self.rank):
                    continue
                self.fired.append((f.kind, op, n))
            dead = set(self._dead)
        if self.rank in dead:
            raise InjectedFault(f"rank {self.rank} died at {op} call {n} (declared by "
                                "FaultyComm.fail_at)")
        if dead:
            peers = ", ".join(str(r) for r in sorted(dead))
            error = dist.DistBackendError(
                f"[FaultyComm] Connection closed by peer rank {peers} during {op} call {n} "
                "(injected)")
            if getattr(self._waiting, "active", False):
                return _FailedWork(error)  # Comm._wait raises it and diagnoses
            raise error
        stall = sum(f.seconds for f in due
                    if f.kind == "stall" and f.rank in (None, self.rank))
        if stall > 0:
            # Report this rank one collective behind while it is away, as a rank that has not
            # reached the collective yet would (the Comm counted it before issuing).
            self.num_collectives -= 1
            try:
                time.sleep(stall)
            finally:
                self.num_collectives += 1
        return run(*args, **kwargs)

    # Comm's blocking collectives wait on the returned work inside ``Comm._wait`` (which
    # diagnoses what ``wait`` raises): they get a failed work object. Every other caller (DDP's
    # reducer on the fast path, ``all_reduce_async`` in a comm hook) gets the error raised by
    # the call itself: torch propagates an exception from a Python ``ProcessGroup`` override
    # through the reducer into ``backward``, whereas a Python work object handed to the C++
    # reducer crashed the process (torch 2.13).
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """:meth:`Comm.all_reduce`, subject to the declared faults."""
        with self._blocking():
            return super().all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """:meth:`Comm.broadcast`, subject to the declared faults."""
        with self._blocking():
            return super().broadcast(tensor, src)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`Comm.all_gather`, subject to the declared faults."""
        with self._blocking():
            return super().all_gather(tensor)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`Comm.all_to_all`, subject to the declared faults."""
        with self._blocking():
            return super().all_to_all(tensor)

    @contextlib.contextmanager
    def _blocking(self) -> Iterator[None]:
        self._waiting.active = True
        try:
            yield
        finally:
            self._waiting.active = False

    def calls(self, op: str) -> int:
        """How many ``op`` collectives this rank issued through the FaultyComm so far."""
        with self._lock:
            return self._calls[op]

    # ------------------------------------------------------------------ the shared state
    @property  # type: ignore[override]
    def group(self) -> dist.ProcessGroup | None:
        inner = self._inner.group
        if inner is None:
            return None
        if self._wrapped is None or self._wrapped[0] is not inner:
            # DDP's built-in path waits in the backend, not in Comm._wait: bound it by this
            # Comm's timeout as a launched job's default group is (run_ranks gives its groups
            # a longer one for connection set-up, which is over by now).
            inner.set_timeout(timedelta(seconds=self._inner.timeout))
            self._wrapped = (inner, _FaultyGroup(inner, self))
        return self._wrapped[1]

    @group.setter
    def group(self, value: dist.ProcessGroup | None) -> None:
        self._inner.group = value

    @property  # type: ignore[override]
    def store(self) -> dist.Store | None:
        store = self._inner.store
        if store is None or not self._dead:
            return store
        return _FrozenBeats(store, set(self._dead))

    @store.setter
    def store(self, value: dist.Store | None) -> None:
        self._inner.store = value

    # The wrapped Comm's state, read and written through (its heartbeat reports its own
    # num_collectives, which Comm's collectives advance on this object).
    rank: _Shared[int] = _Shared()
    world_size: _Shared[int] = _Shared()
    timeout: _Shared[float] = _Shared()
    bytes_sent: _Shared[int] = _Shared()
    bytes_received: _Shared[int] = _Shared()
    seconds: _Shared[float] = _Shared()
    num_collectives: _Shared[int] = _Shared()

    def on_close(self, callback: Callable[[], None]) -> None:
        self._inner.on_close(callback)

    def close(self) -> None:
        self._inner.close()
        self._wrapped = None

    def __getattr__(self, name: str) -> Any:
        # Anything else a Comm has (or gains later) is the wrapped Comm's.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return (f"FaultyComm(rank={self.rank}, world_size={self.world_size}, "
                f"faults={self._faults!r})")
