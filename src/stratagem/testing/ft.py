"""Fault-tolerant replicas as threads, with declared faults.

``run_replicas(fn, n)`` starts a quorum service (torchft's Lighthouse protocol, for members with the job's secret, on loopback) and calls
``fn(comm, slot)`` on ``n`` threads, each with a :class:`~stratagem.ft.comm.FaultTolerantComm`
of its own (its own manager, store, heal transport and process group), and returns their
results in slot order. Faults are declared, as torchft's tests do
(``EventInjector().fail_at(rank, step)``), instead of sleeping past timeouts:

- ``ReplicaFaults.fail_at(slot, step)``: replica ``slot`` dies at the end of its step
  ``step``; its Comm is torn down as a killed process's would be (its manager stops
  heartbeating, its sockets close), so its peers' next collective fails and the next quorum
  forms without it. With ``restart=True`` a new replica takes the slot (``fn`` is called again
  for it with a fresh Comm) and heals from a live peer.
- ``ReplicaFaults.fail_collective(slot, step)``: replica ``slot``'s collectives fail during
  step ``step`` (a failed collective, the replica stays alive): that step commits nowhere that
  saw the failure, and the replicas continue.

``fn`` reads its cue with ``faults.check(slot, step)`` at the end of every step (after
``optimizer.step()``); it raises :class:`ReplicaDied` on a replica due to die.

A replacement must find someone to heal from, however slowly it starts: after a death with
``restart``, the other replicas' ``check`` holds them (at most ``REPLACEMENT_WAIT`` seconds)
until the replacement's first quorum request has reached the quorum service. A real job gets the same from its launcher
(a warm spare restarted at once) and from training longer than a restart takes; threads on a
loaded 2-core machine got neither: the survivors of a 16-step run finished before the
replacement had built its model, and it found nobody to heal from.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from .._rendezvous import loopback_tcp_store
from ..ft.comm import FaultTolerantComm
from ..ft.launch import QuorumService, read_token_file

__all__ = ["run_replicas", "ReplicaFaults", "ReplicaDied", "ReplicasStopped",
           "REPLACEMENT_WAIT"]

#: The longest a surviving replica's ``check`` waits for a replacement to ask for a quorum.
REPLACEMENT_WAIT = 60.0


class ReplicaDied(Exception):
    """Raised in a replica's thread at the step where :meth:`ReplicaFaults.fail_at` kills it."""


class ReplicasStopped(Exception):
    """Raised in every replica's thread at its next step once another replica raised: the
    run is over, and no replica may keep training (or sit in a collective) in the background
    after :func:`run_replicas` returned (a gloo thread alive at interpreter exit aborts it)."""


class ReplicaFaults:
    """Declared faults for :func:`run_replicas`."""

    def __init__(self) -> None:
        #: replica -> step -> the group ranks that have not died there yet
        self._die: dict[int, dict[int, set[int] | None]] = {}
        self._fail: dict[int, set[int]] = {}
        self.restart = True
        self.deaths: list[tuple[int, int]] = []
        self.stopped = False
        self._lock = threading.Lock()
        #: processes declared dead with ``restart`` whose replacement has not asked for a
        #: quorum yet (the survivors' ``check`` waits for them: module docstring)
        self._replacing = 0
        self._replaced = threading.Condition(self._lock)

    def fail_at(self, slot: int, step: int, *, restart: bool = True) -> ReplicaFaults:
        """Replica ``slot`` dies at the end of its step ``step`` (and comes back when
        ``restart``). With replica groups (``run_replicas(..., group_size=G)``) ``slot`` is
        the group: every process of it dies there, as a node would."""
        self._die.setdefault(slot, {})[step] = None
        self.restart = restart
        return self

    def fail_collective(self, slot: int, step: int) -> ReplicaFaults:
        """Replica ``slot``'s collectives of step ``step`` fail (it stays alive)."""
        self._fail.setdefault(slot, set()).add(step)
        return self

    def check(self, comm: FaultTolerantComm, step: int) -> None:
        """Call at the end of each step: dies here if declared (see the class docstring)."""
        if self.stopped:
            raise ReplicasStopped(f"replica {comm.replica}: another replica failed")
        slot = comm.slot
        replica, rank = comm.replica, comm.replica_group_rank
        with self._lock:
            due = self._die.get(replica, {})
            if step in due:
                left = due[step]
                if left is None:  # the group's first process to get here
                    left = due[step] = set(range(comm.replica_group_size))
                    self.deaths.append((replica, step))
                left.discard(rank)
                if not left:
                    del due[step]
                if self.restart:
                    self._replacing += 1
                raise ReplicaDied(f"replica {replica} died at step {step}")
            end = time.monotonic() + REPLACEMENT_WAIT
            while self._replacing and not self.stopped and time.monotonic() < end:
                self._replaced.wait(timeout=0.05)
        if self.stopped:
            raise ReplicasStopped(f"replica {comm.replica}: another replica failed")
        if step + 1 in self._fail.get(slot, set()):
            self._fail[slot].discard(step + 1)
            comm.inject_failure()

    def announce(self, comm: FaultTolerantComm,
                 asked: Callable[[float], bool] | None = None) -> None:
        """Make a replacement's first quorum request release the survivors waiting in
        :meth:`check` (called by :func:`run_replicas` on every replacement's Comm).

        ``asked(since)`` tells whether the replacement's request has reached the quorum
        service at or after ``since``: the survivors are released only then. Released
        before it (when the replacement merely started asking), a survivor whose last quorum
        was itself alone formed its next ones alone at once (a quorum whose members of the
        last one are all back forms without waiting, as torchft's does), finished before the
        request arrived, and left the replacement nobody to heal from (CI, a loaded 2-core
        machine)."""
        begin = comm.begin

        def release() -> None:
            with self._lock:
                self._replacing = max(0, self._replacing - 1)
                self._replaced.notify_all()

        def release_once_asked(since: float) -> None:
            end = time.monotonic() + REPLACEMENT_WAIT
            while (not self.stopped and time.monotonic() < end
                   and not asked(since)):  # type: ignore[misc]
                time.sleep(0.01)
            release()

        def first_begin() -> None:
            comm.begin = begin  # type: ignore[method-assign]
            if asked is None:
                release()
            else:
                threading.Thread(target=release_once_asked, args=(time.monotonic(),),
                                 daemon=True, name=f"announce{comm.replica}").start()
            begin()

        comm.begin = first_begin  # type: ignore[method-assign]


def run_replicas(fn: Callable[..., Any], n: int, *, args: tuple[Any, ...] = (),
                 faults: ReplicaFaults | None = None, min_replicas: int = 1,
                 timeout: float = 10.0, deadline: float = 120.0,
                 absent: Sequence[int] = (), group_size: int = 1,
                 quorum_every: int | None = None,
                 quorum_timeout: float | None = None,
                 on_service: Callable[[QuorumService], None] | None = None,
                 device: Any = None) -> list[Any]:
    """Run ``fn(comm, *args)`` for ``n`` fault-tolerant replicas as threads (see the module
    docstring); a replica killed by ``faults`` is replaced by a new one in its slot (its
    result is the replacement's). The slots in ``absent`` are never started (as if they
    died before their first quorum; their result is None). Raises the first unexpected
    exception, or ``TimeoutError`` after ``deadline`` seconds.

    ``group_size=G``: each replica is a group of G processes (threads) sharing a store, as
    the nodes of ``Hierarchical`` under ``sg.launch(..., nnodes=K, fault_tolerant=True)``;
    results are per process, ``n * G`` of them, in slot order (group by group).
    ``quorum_every``: :class:`~stratagem.ft.comm.FaultTolerantComm`'s (1: a quorum at every
    step; None: its default); ``quorum_timeout`` likewise (None: ``max(timeout, 30)``).
    ``on_service(service)`` is called once the quorum service listens, before any replica
    starts. ``device``: each replica's :class:`~stratagem.ft.comm.FaultTolerantComm`'s."""
    service = QuorumService(num_slots=n, min_replicas=min_replicas)
    if on_service is not None:
        try:
            on_service(service)
        except BaseException:
            service.stop()
            raise
    job_store = loopback_tcp_store("127.0.0.1", 0, timeout=timedelta(seconds=30))
    if absent:  # counted as started: the live ones' first quorum does not wait for them
        job_store.add("ft/started", len(absent) * group_size)
    token = read_token_file(service.token_file)  # the job's secret, as a launcher gives it
    results: list[Any] = [None] * (n * group_size)
    errors: list[tuple[int, BaseException, str]] = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()

    def replica(slot: int, rank: int, life: int) -> None:
        comm: FaultTolerantComm | None = None
        try:
            from torch.distributed import PrefixStore, TCPStore

            store = TCPStore("127.0.0.1", job_store.port, is_master=False,
                             timeout=timedelta(seconds=30), wait_for_workers=False)
            comm = FaultTolerantComm(
                lighthouse=service.address(), slot=slot, num_slots=n, token=token,
                min_replicas=min_replicas, timeout=timeout, job_store=store,
                joining=life > 0, group_rank=rank, group_size=group_size,
                group_store=PrefixStore(f"ftgroup/{slot}/{life}", store)
                if group_size > 1 else None, quorum_every=quorum_every,
                quorum_timeout=quorum_timeout, device=device)
            if life > 0 and faults is not None:
                faults.announce(comm, functools.partial(service.asked_since, slot))
            results[slot * group_size + rank] = fn(comm, *args)
        except ReplicasStopped:
            pass
        except ReplicaDied:
            if comm is not None:
                comm.kill()
                comm = None
            if faults is not None and faults.restart:
                start(slot, rank, life + 1)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append((slot * group_size + rank, exc, traceback.format_exc()))
            if faults is not None:  # the survivors stop at their next step, not after
                faults.stopped = True  # waiting out REPLACEMENT_WAIT for this replica
        finally:
            if comm is not None:
                comm.close()

    def start(slot: int, rank: int, life: int = 0) -> None:
        t = threading.Thread(target=replica, args=(slot, rank, life), daemon=True,
                             name=f"replica{slot}" + (f".{rank}" if group_size > 1 else ""))
        with lock:
            threads.append(t)
        t.start()

    try:
        for slot in range(n):
            if slot not in absent:
                for rank in range(group_size):
                    start(slot, rank)
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            with lock:
                alive = [t for t in threads if t.is_alive()]
            if not alive or errors:
                break
            time.sleep(0.02)
        if errors:
            if faults is not None:  # the others stop at their next step (bounded wait)
                faults.stopped = True
                stop_by = time.monotonic() + 20.0
                for t in list(threads):
                    t.join(timeout=max(0.0, stop_by - time.monotonic()))
            slot, exc, tb = sorted(errors, key=lambda e: e[0])[0]
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on replica {slot})\n{tb}")
            raise exc
        with lock:
            running = [t.name for t in threads if t.is_alive()]
        if running:
            raise TimeoutError(f"replicas {running} still running after {deadline}s")
        return results
    finally:
        service.stop()
