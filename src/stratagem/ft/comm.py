"""``FaultTolerantComm``: a :class:`~stratagem.comm.Comm` whose world survives lost replicas.

The engine is torchft (``pip install stratagem[ft]``): a Lighthouse quorum server, one
``torchft.Manager`` per replica and a reconfigurable process group: gloo for CPU tensors and,
where the device is CUDA, NCCL for CUDA tensors (rebuilt with every quorum, aborted when one
fails or the quorum changes). What this module adds
is the shape stratagem's strategies already have: every collective a part runs goes through
the Comm it was given, so a strategy made of parts becomes fault tolerant by being given this
Comm instead of the plain one, with no branch in its own file.

A *transaction* spans the collectives of one synchronising step:

- :meth:`begin` (at a step boundary, before a step that will communicate) runs a quorum
  with the Lighthouse. The quorum drops replicas that died, admits new or restarted ones, and
  reconfigures the process group when membership changed. A replica whose committed step is
  behind the others' is *healed* there: it receives the full training state of one live peer
  (model, optimizers, strategy state, step counters, loss scale, data position) through
  :class:`~stratagem.ft.transport.SafeHealTransport` (safetensors + strict JSON,
  authenticated, bounded: never pickle) and loads it before the step starts, so it then
  equals its peers bitwise.
- Collectives run on the quorum's process group. A collective that fails (a peer's process
  died: gloo reports the reset connection at once; a stalled peer: the group's ``timeout``)
  does **not** raise: the error is recorded and the tensor's contents are undefined.
- :meth:`commit` asks every replica of the quorum whether the step succeeded everywhere; the
  strategy applies the step's result only on ``True``. A failed step is applied nowhere that
  saw the failure; a replica that did commit while another did not is ahead by one step, and
  the next quorum heals the other from it, so replicas never stay apart.

*Quorum elision* (the default: ``quorum_every=32``; ``STRATAGEM_FT_QUORUM_EVERY=1`` or
``quorum_every=1`` turns it off). While every
launched replica is in the quorum and the last step committed, a transaction skips
torchft's two per-step calls (the quorum with the Lighthouse and the commit vote with the
manager server, ~5-10 ms on loopback) and runs on the quorum it has; every
``quorum_every``-th committed step still asks. Nothing can join then (every slot is
live), and a loss cannot go unnoticed: a collective over the quorum's group needs every
member, so when one dies or fails its step (a failing replica closes its connections of the
group, :meth:`_drop_group`), every other replica's next collective fails, its step does not
commit, and it asks for a quorum, which heals whoever is behind. While a replica is missing,
every transaction asks (a replacement joins at the next step). One process per replica only:
a replica group's processes keep torchft's per-step vote. A replica that fails a step
while staying alive makes its peers' next collective fail at once by dropping every
reference to the group (gloo closes a group's sockets only with its last reference; its
``abort`` does not), so nobody waits out ``timeout``; a replica whose process dies closes
its sockets anyway. Measured in ``docs/reliability.md`` ("Quorum elision").

Two timeouts: ``timeout`` bounds a step's collectives and its commit vote (how long a stalled
peer can hold the others up); ``quorum_timeout`` (default ``max(timeout, 30 s)``) bounds a
quorum, the process group's reconfiguration and a heal, which are setup work that a loaded
machine slows far more than a step, and the wait for ``min_replicas`` (a restarted worker
needs seconds to start). With both equal to a short ``timeout``, a woken or restarted
replica's heal failed on a loaded 2-core machine and the launcher restarted it again.

*A replacement takes its predecessor's place.* The Lighthouse drops a dead replica only when
its heartbeat ages out (1 s here) or the join timeout passes: torchft's survivors wait that
long after every loss. But the launcher restarts a dead worker at once (a warm spare, the
launcher's notice of the death), so the replacement is usually ready to ask for a quorum
before then. Its manager server heartbeats and asks under its predecessor's exact replica
id (kept in the job's store; torchft would append a fresh uuid), so to the Lighthouse the
slot is live again and has joined: the survivors' quorum forms as soon as it asks, with the
replacement healing in it. The exception: a predecessor that died while a quorum request of
its was outstanding (marked in the job's store around every request) may have left that
request in the Lighthouse, which a quorum could pick up under a live id and then wait for a
dead member; its replacement takes a fresh id, and the survivors wait for the old heartbeat as
torchft does. Only for replicas of one process with the launcher's store (``comm_from_env``).

``rank`` and ``world_size`` are the replica's place in the current quorum (they change when
replicas leave or join). ``slot`` / ``num_slots`` are the replica's fixed place in the job as
launched (``stratagem run --nproc N --fault-tolerant``: slots ``0..N-1``; a restarted worker
takes its old slot), which is what data sharding uses: a missing replica's share of a global
batch is not trained on while it is away (lost, never repeated).

Listening sockets: the Lighthouse, each replica's manager server, heal transport and store
bind ``host`` only (loopback on one node). torchft's manager server binds every interface
(``[::]``) with no option to change it; :func:`loopback_manager_server` rebinds it.

This module uses torchft's public API only; what stratagem needs beyond it (the manager
server's rebinding, the elided commit's bookkeeping, the quorum id, the gloo group's
rendezvous store) is done in :mod:`stratagem.ft.upstream`, which checks it against the
installed torchft (``docs/design/torchft-boundary.md``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._rendezvous import bound_tcp_store
from ..comm import Comm, nccl_device
from ..errors import PeerTimeoutError, StratagemError
from ..validation import check_timeout
from . import upstream

__all__ = ["FaultTolerantComm", "QuorumError", "loopback_gloo_group", "loopback_manager_server",
           "require_torchft", "QUORUM_EVERY", "QUORUM_TIMEOUT_FLOOR"]

#: The default of ``quorum_every``: 32 (quorum elision): with every launched replica
#: present, a quorum is asked for at every 32nd committed step and after any failed step
#: only. ``STRATAGEM_FT_QUORUM_EVERY=1`` (or ``quorum_every=1``) asks at every synchronising
#: step, torchft's own schedule (5-10 ms more per step on loopback).
QUORUM_EVERY = 32
#: The least default ``quorum_timeout`` (seconds): see "Two timeouts" in the module docstring.
QUORUM_TIMEOUT_FLOOR = 30.0


class QuorumError(StratagemError):
    """No quorum of at least ``min_replicas`` replicas formed within ``timeout``."""

    def __init__(self, message: str, *, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


def require_torchft() -> Any:
    """Import torchft, or raise ``ImportError`` naming the extra that installs it."""
    # torchft's Rust servers log every quorum and commit at INFO level (several lines per
    # training step); its logger reads RUST_LOG once, when torchft is first imported.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as exc:  # pragma: no cover - torchft is installed by make test
        raise ImportError(
            "fault_tolerant=True needs torchft, an optional dependency. Fix: pip install "
            "'stratagem[ft]' (it installs torchft-nightly)") from exc
    _quiet_flight_recorder()
    return torchft


def _quiet_flight_recorder() -> None:
    """torchft's manager warns at every reconfiguration of a gloo group that it cannot reset
    NCCL's flight recorder (one line per process per membership change); nothing is wrong."""
    import logging

    log = logging.getLogger("torchft.manager")
    if not any(getattr(f, "_stratagem", False) for f in log.filters):
        class _Drop(logging.Filter):
            _stratagem = True

            def filter(self, record: logging.LogRecord) -> bool:
                return "flight recorder" not in record.getMessage()

        log.addFilter(_Drop())


@contextlib.contextmanager
def loopback_manager_server(host: str, replica_id: str | None = None) -> Iterator[None]:
    """Build torchft's manager server on ``host`` instead of every interface (``[::]``);
    with ``replica_id``, under that exact id (torchft appends a fresh uuid to the one it is
    given: see "A replacement takes its predecessor's place" in the module docstring).
    One manager is built at a time while it is open (:func:`stratagem.ft.upstream.
    manager_server_on`, which raises when the installed torchft cannot be rebound)."""
    with upstream.manager_server_on(host, replica_id):
        yield


def loopback_gloo_group(timeout: timedelta, host: str = "127.0.0.1") -> Any:
    """torchft's reconfigurable gloo group with its rendezvous store on ``host`` only.

    torchft's ``get_reconfigure_handle`` hosts that store as ``TCPStore(host_name=
    socket.gethostname(), is_master=True)``: torch's master store listens on every interface
    whatever the host name (an unauthenticated key-value store any machine on the network
    could write new group handles into), and its peers are told the host name, which need
    not resolve to loopback. This group hosts it with
    :func:`~stratagem._rendezvous.bound_tcp_store` on ``host`` and advertises ``host``
    (:func:`stratagem.ft.upstream.bound_gloo_group`)."""
    return upstream.bound_gloo_group(timeout, host)


class FaultTolerantComm(Comm):
    """A Comm over the live replicas of a fault-tolerant job (see the module docstring).

    Built by :meth:`from_env` in a worker of ``stratagem run --fault-tolerant`` /
    ``sg.launch(..., fault_tolerant=True)``, or directly (tests): ``lighthouse`` is the quorum
    server's address, ``slot`` / ``num_slots`` this replica's place in the job as launched,
    ``token`` the job's secret for the heal transport.

    On failure: a collective that fails makes the step's :meth:`commit` return False on the
    replicas that saw it (the step is applied nowhere there) and the next :meth:`begin` forms
    a new quorum without the lost replica. A quorum below ``min_replicas`` waits at most
    ``timeout`` seconds, then raises :class:`QuorumError` naming the slots that are missing.
    A healing replica whose model differs (names, shapes, dtypes) from its peer's raises
    :class:`~stratagem.ReplicaMismatchError` naming the first difference.
    """

    fault_tolerant = True
    elastic = True
    #: Set by :func:`~stratagem.ft.launch.comm_from_env` when it froze the worker's objects
    #: out of the cyclic garbage collector; :meth:`close` gives them back.
    unfreeze_gc_on_close = False

    def __init__(self, *, lighthouse: str, slot: int, num_slots: int, token: bytes,
                 min_replicas: int = 1, timeout: float = 60.0, host: str = "127.0.0.1",
                 job_store: dist.Store | None = None, device: torch.device | None = None,
                 transport: Any = None, max_heal_bytes: int = 64 << 30,
                 allow_remote: bool = False, joining: bool = False, group_rank: int = 0,
                 group_size: int = 1, group_store: dist.Store | None = None,
                 group_comm: Comm | None = None, quorum_every: int | None = None,
                 quorum_timeout: float | None = None) -> None:
        require_torchft()
        from .membership import MemberKey

        if group_size > 1 and group_store is None:
            raise ValueError(f"a replica group of {group_size} processes needs group_store, "
                             "a store its processes share. Fix: launch with sg.launch(..., "
                             "nnodes=K, fault_tolerant=True)")
        #: The replica (group) this process belongs to, and the number launched.
        self.replica = slot
        self.num_replica_groups = num_slots
        self.replica_group_rank = group_rank
        self.replica_group_size = group_size
        self._slot = slot * group_size + group_rank
        self._num_slots = num_slots * group_size
        #: A replacement for a lost replica: it must find a live peer to heal from.
        self._joining = joining
        self.min_replicas = min_replicas
        self._rank = 0
        self._world = 1
        self._state_fn: Callable[[], dict[str, Any]] | None = None
        self._load_fn: Callable[[dict[str, Any]], None] | None = None
        self._open = False
        self._inject = False
        self._collectives_at_begin = 0
        self._error: BaseException | None = None
        self.failed_steps = 0
        self.heals = 0
        self._healed = False
        self.heal_seconds = 0.0
        self.quorums = 0
        #: Transactions that ran on the quorum they had (see "Quorum elision" above).
        self.elided_quorums = 0
        if quorum_every is None:
            quorum_every = int(os.environ.get("STRATAGEM_FT_QUORUM_EVERY", QUORUM_EVERY))
        if quorum_every < 1:
            raise ValueError(f"quorum_every must be >= 1, got {quorum_every}. Fix: 1 asks "
                             "for a quorum at every step; 32 (the default) elides them while "
                             "every replica is present")
        self.quorum_every = quorum_every
        #: Seconds a quorum, its process-group reconfiguration and a heal may take (the
        #: step's collectives and commit vote keep ``timeout``).
        self.quorum_timeout = (max(timeout, QUORUM_TIMEOUT_FLOOR) if quorum_timeout is None else
                               check_timeout("quorum_timeout", quorum_timeout,
                                             fix=f"omit it (max(timeout, "
                                                 f"{QUORUM_TIMEOUT_FLOOR:g} s)) or pass e.g. 60.0"))
        self._elided = False
        self._must_ask = True
        self.last_heal_bytes = 0
        self.last_quorum_size = 0
        self._job_store = job_store
        # The replica group's own store, hosted by its first process: torchft's manager
        # publishes its server's address there for the group's other processes.
        store_timeout = timedelta(seconds=max(timeout, 30.0))
        if group_rank == 0:
            self._store: dist.Store | None = bound_tcp_store(host, 0, timeout=store_timeout)
            store_port = self._store.port
            if group_store is not None:
                group_store.set("ft/store_port", str(store_port))
        else:
            self._store = None
            assert group_store is not None
            group_store.set_timeout(store_timeout)
            store_port = int(group_store.get("ft/store_port"))
        #: Proves this replica's membership to the quorum service and checks every quorum
        #: it is given (stratagem.ft.membership).
        self._key = MemberKey(token)
        # On CUDA, CUDA tensors go over NCCL, rebuilt with every quorum (CPU ones over gloo).
        on_nccl = nccl_device(device) if device is not None and device.type == "cuda" else None
        if on_nccl is not None:  # before the replica group's own NCCL group, if any
            upstream.nccl_env_defaults(error_handling=False)
        self._pg = upstream.bound_gloo_group(timedelta(seconds=timeout), host, key=self._key,
                                             device=on_nccl)
        if transport is None:
            from .transport import SafeHealTransport, heal_bound

            # A heal brings at most a bound that follows this replica's own state (sized when
            # the heal starts; ``max_heal_bytes`` caps it, and applies before prepare).
            transport = SafeHealTransport(
                token=token, host=host, timeout=self.quorum_timeout, max_bytes=max_heal_bytes,
                allow_remote=allow_remote, bound=lambda: (
                    max_heal_bytes if self._state_fn is None else heal_bound(self._state())))
        self.transport = transport
        # Only a group's first process builds a manager server (the others wait for its
        # address in the group's store: they must not hold the lock meanwhile).
        server = group_rank == 0
        self._id_key = f"ft/id/{slot}"
        self._asking_key = f"ft/asking/{slot}"
        self._keeps_id = server and group_size == 1 and job_store is not None
        # Every replica id is exact (no uuid appended by torchft) and tagged with the secret.
        replica_id = (self._replica_id(slot, joining) if self._keeps_id else
                      self._key.replica_id(f"slot{slot}:{uuid.uuid4()}") if server else None)
        self.manager = upstream.build_manager(
            server_host=host if server else None, server_replica_id=replica_id,
            pg=self._pg, load_state_dict=self._load, state_dict=self._state,
            min_replica_size=min_replicas, use_async_quorum=False,
            # torchft's own timeout bounds the reconfiguration and the heal: setup work,
            # slower on a loaded machine than a step's collective; the commit vote is
            # given ``timeout`` at each call.
            timeout=timedelta(seconds=self.quorum_timeout),
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timedelta(seconds=max(self.quorum_timeout, 10.0)),
            rank=group_rank,
            world_size=group_size, store_addr=host, store_port=store_port,
            lighthouse_addr=lighthouse, replica_id=f"slot{slot}", hostname=host,
            heartbeat_interval=timedelta(milliseconds=100),
            checkpoint_transport=transport, init_sync=True)
        self._prove_membership(host, store_port, store_timeout, replica_id, group_store)
        super().__init__(self._pg, 0, 1, store=None, timeout=timeout, heartbeat=False,
                         device=device)
        #: The processes of this replica group (a node of ``Hierarchical``): a plain Comm
        #: with fixed membership (``group_comm``, or one built over ``group_store``). A
        #: process of the group that dies fails the others' collectives on it, and the
        #: launcher restarts the whole group.
        self.group_comm: Comm = Comm.single()
        if group_comm is not None:  # built by the caller (a launched process: the default
            self.group_comm = group_comm  # group, which FSDP2 can find)
            self._children.append(group_comm)
        elif group_size > 1:
            from ..comm import new_group

            assert group_store is not None
            inner = dist.PrefixStore("group", group_store)
            self.group_comm = Comm(
                new_group(dist.PrefixStore("pg", inner), group_rank, group_size, timeout, device),
                group_rank, group_size, store=inner, timeout=timeout, device=device)
            self._children.append(self.group_comm)
        if on_nccl is not None:
            # After the replica group's own NCCL group (it keeps torch's error handling),
            # before the first quorum builds this Comm's NCCL backend, on this thread.
            upstream.nccl_env_defaults()
        self._beat = None
        if job_store is not None:
            from ..comm import Heartbeat

            # Liveness of every slot in the job's store: what names the missing replicas when
            # a quorum cannot form.
            self._beat = Heartbeat(job_store, slot, lambda: self.quorums)

    # ------------------------------------------------------------------ membership
    @property
    def slot(self) -> int:
        return self._slot

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property  # type: ignore[override]
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    @property  # type: ignore[override]
    def world_size(self) -> int:
        return self._world

    @world_size.setter
    def world_size(self, value: int) -> None:
        self._world = value

    def set_state_fns(self, state: Callable[[], dict[str, Any]],
                      load: Callable[[dict[str, Any]], None]) -> None:
        """What a heal sends (``state()``: a tree of tensors and JSON values) and how a healed
        replica loads it. The strategy registers these at ``prepare``."""
        self._state_fn, self._load_fn = state, load

    def _state(self) -> dict[str, Any]:
        return {} if self._state_fn is None else self._state_fn()

    def _load(self, state: dict[str, Any]) -> None:
        if self._load_fn is not None:
            self._load_fn(state)
        self.heals += 1
        self._healed = True

    def _prove_membership(self, host: str, store_port: int, store_timeout: timedelta,
                          replica_id: str | None, group_store: dist.Store | None) -> None:
        """Sign this process's quorum requests with its claim (the exact replica id its
        group's manager server uses, that server's address, the group store's address, the
        step, its place in the group) and check every quorum it is given before any address
        in it is used (stratagem.ft.membership)."""
        store = self._store if self._store is not None else dist.TCPStore(
            host, store_port, is_master=False, timeout=store_timeout, wait_for_workers=False)
        _, address = upstream.manager_identity(store)
        if replica_id is not None:  # the group's first process chose it
            if group_store is not None:
                group_store.set("ft/replica_id", replica_id)
        else:
            assert group_store is not None
            replica_id = group_store.get("ft/replica_id").decode()
        manager = self.manager
        claim = {"replica_id": replica_id, "address": address,
                 "store_address": f"{host}:{store_port}",
                 "world_size": self.replica_group_size, "group_rank": self.replica_group_rank}
        self._pg.claim = lambda: {**claim, "step": int(manager.current_step())}
        upstream.verify_quorums(manager, self._key, self._group_vote)

    def _group_vote(self, ok: bool, timeout: timedelta) -> bool:
        """The commit vote across this replica group's processes: True when every one of
        them completed the step (over the group's own process group; one process: its own
        verdict)."""
        if self.replica_group_size == 1:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=self.group_comm.device)
        self.group_comm.all_reduce(flag, op="min")
        return bool(flag.item() > 0.5)

    def _replica_id(self, slot: int, joining: bool) -> str:
        """The id this replica's manager server heartbeats and asks for quorums under (see
        "A replacement takes its predecessor's place" in the module docstring): the id of
        the process it replaces, unless that one died while asking for a quorum (its request
        may still sit in the Lighthouse: a new id keeps it out of any quorum)."""
        store = self._job_store
        assert store is not None
        fresh = self._key.replica_id(f"slot{slot}:{uuid.uuid4()}")
        with contextlib.suppress(Exception):
            if joining and store.check([self._id_key]):
                asking = store.check([self._asking_key]) and store.get(self._asking_key) == b"1"
                kept = store.get(self._id_key).decode()
                # The job's store is not authenticated: an id there without the secret's tag
                # is not the predecessor's (the quorum service would refuse it anyway).
                if not asking and self._key.id_ok(kept):
                    return kept
            store.set(self._id_key, fresh)
            store.set(self._asking_key, "0")
        return fresh

    def _asking(self, value: str) -> None:
        """Mark in the job's store whether this replica has a quorum request outstanding."""
        store = self._job_store
        if self._keeps_id and store is not None:
            with contextlib.suppress(Exception):
                store.set(self._asking_key, value)

    # ------------------------------------------------------------------ transactions
    def begin(self) -> None:
        """Form the quorum for the next synchronising step (heal this replica if it is
        behind); idempotent while a transaction is open."""
        if self._open:
            return
        if self._may_elide():
            self._open = True
            self._elided = True
            self._error = None
            self._collectives_at_begin = self.num_collectives
            self.elided_quorums += 1
            return
        self._elided = False
        if self.quorums == 0 and not self._joining:
            self._await_launched_replicas()
        t0 = time.perf_counter()
        received = getattr(self.transport, "bytes_received", 0)
        self._healed = False
        self._asking("1")
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.quorum_timeout))
        except StratagemError:
            raise  # the heal refused the peer's state (another model): said there
        except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError/TimeoutError
            raise self._quorum_error(exc) from exc
        self._asking("0")  # answered: the Lighthouse holds no request of ours any more
        if self.manager.errored() is not None:
            err = self.manager.errored()
            original = getattr(err, "original_exception", err)
            if isinstance(original, StratagemError):  # e.g. the heal found another model
                raise original
        self._open = True
        self._error = None
        self._collectives_at_begin = self.num_collectives
        self.quorums += 1
        self._must_ask = False
        self._world = max(1, self.manager.num_participants())
        rank = self.manager.participating_rank()
        self._rank = 0 if rank is None else int(rank)
        self.last_quorum_size = self._world
        if self._healed:
            self.heal_seconds += time.perf_counter() - t0
            # What this heal moved (the transport's own count; 0 for one that keeps none).
            self.last_heal_bytes = getattr(self.transport, "bytes_received", 0) - received
        if self._joining:
            self._joining = False
            if self._world == 1 and not self._healed:
                # Alone and nobody to heal from: the others finished (or all are lost).
                # Training on alone from step 0 would produce a model nobody asked for.
                who = (f"replica {self.slot}" if self.replica_group_size == 1 else
                       f"replica group {self.replica} (process slot {self.slot})")
                raise QuorumError(
                    f"{who} was restarted but found no live replica to heal from "
                    "(the job has finished, or every replica is lost). Fix: if training was "
                    "not finished, restart the job from its last checkpoint")
        if self._world < self.min_replicas:
            raise QuorumError(
                f"the quorum has {self._world} replica(s), fewer than min_replicas="
                f"{self.min_replicas}. Fix: restart the missing workers or lower min_replicas",
                missing=tuple(self._missing_slots()))

    def start_group(self) -> None:
        """At the job's start (nothing committed yet), give every process of this replica
        group the state of the group's first process; a no-op otherwise. The first quorum
        heals each group rank from a primary replica that torchft picks per group rank
        (``rank % replicas``); before anything is committed the replicas still hold their own
        initial states, so the processes of one group could come from different replicas.
        After this every process of the job holds the state of the quorum's first replica's
        first process (which every group's first process healed from). Collective on the
        group; the strategy calls it after its first :meth:`begin`."""
        if self.replica_group_size == 1 or self.committed_steps > 0:
            return
        import json

        from ..checkpoint.tree import decode, encode
        from ..errors import ReplicaMismatchError

        group = self.group_comm
        tensors, skeleton = encode(self._state(), what="the heal state")
        names = sorted(tensors)
        layout = json.dumps([[n, list(tensors[n].shape), str(tensors[n].dtype)]
                             for n in names]).encode()
        if not group.all_equal(layout):
            raise ReplicaMismatchError(
                f"the processes of replica group {self.replica} hold differently shaped "
                "training states (model, optimizer or strategy state). Fix: run the same "
                "script and configuration on every process")
        with torch.no_grad():
            group.broadcast_coalesced([tensors[n] for n in names], src=0)
        text = json.dumps(skeleton, separators=(",", ":")).encode() if group.rank == 0 else b""
        first = group.all_gather_bytes(text)[0]
        if self._load_fn is not None:
            self._load_fn(decode(tensors, json.loads(first), what="the heal state"))

    def _await_launched_replicas(self) -> None:
        """Before the job's first quorum, wait (at most ``quorum_timeout``) until every replica the
        job was launched with has its manager up. Without it the first replica to finish
        importing torch forms a quorum alone and torchft's Lighthouse may keep it apart from
        the others (seen: one replica training alone beside a quorum of two)."""
        store = self._job_store
        if store is None or self.num_slots <= 1:
            return
        with contextlib.suppress(Exception):
            store.add("ft/started", 1)
            deadline = time.monotonic() + self.quorum_timeout
            while time.monotonic() < deadline:
                if int(store.add("ft/started", 0)) >= self.num_slots:
                    # Let every manager's heartbeat reach the Lighthouse before asking.
                    time.sleep(0.3)
                    return
                time.sleep(0.05)

    def _may_elide(self) -> bool:
        """Whether the next transaction may run on the quorum it has (module docstring)."""
        return (self.quorum_every > 1 and not self._must_ask and self.quorums > 0
                and self.replica_group_size == 1 and self._world == self.num_replica_groups
                and self.committed_steps % self.quorum_every != 0
                and upstream.should_commit_is_elidable()
                and self.manager.errored() is None)

    def commit(self) -> bool:
        """True when every replica of the quorum completed this transaction's collectives;
        closes the transaction. Apply the step's result only on True."""
        if not self._open:
            return True
        self._open = False
        if self._error is not None:
            self._drop_group()
        if self._elided:
            ok = self._commit_elided()
        else:
            try:
                ok = bool(self.manager.should_commit(timeout=timedelta(seconds=self.timeout)))
            except Exception as exc:  # noqa: BLE001 - a peer died during the commit vote
                self.manager.report_error(exc)
                ok = False
        if not ok:
            self.failed_steps += 1
            self._must_ask = True
        return ok

    def _commit_elided(self) -> bool:
        """The commit of a transaction that skipped the quorum: what torchft's
        ``should_commit`` does for a replica group of one process, without its call to the
        manager server (whose vote, with one voter, is this process's own)."""
        failed = self._device_failure()
        if failed is not None:
            self._record(failed)
            self._drop_group()
        ok = self._error is None and self.manager.errored() is None
        upstream.commit_bookkeeping(self.manager, committed=ok, participants=self._world)
        return ok

    def _device_failure(self) -> Exception | None:
        """On NCCL, what torchft's ``should_commit`` checks and an elided commit must check
        too: the step's collectives finish on the GPU (an NCCL collective's future completes
        when it is queued; a lost peer fails it later, and NCCL's watchdog bounds that wait
        at twice ``timeout``), then the group says whether one failed."""
        if getattr(self._pg, "nccl", None) is None:
            return None
        if torch.cuda.is_available():  # (tests: gloo plays NCCL on a machine without CUDA)
            torch.cuda.current_stream().synchronize()
        return self._pg.errored()  # type: ignore[no-any-return]

    def _drop_group(self) -> None:
        """Close this replica's connections of a quorum whose step failed, before the commit
        vote, so a peer still waiting in a collective with us fails at once instead of after
        ``timeout``: gloo notices a peer that left a collective only when its sockets close,
        and a survivor that was not talking to the dead replica would otherwise wait out the
        whole timeout while the others ask for the next quorum without it. Nothing is lost:
        a replica that reported an error makes the Lighthouse bump the quorum id, and the
        next quorum rebuilds every member's group. Done here, on the training thread, after
        every collective of the step has completed (no worker thread of the group is busy).

        gloo closes a group's sockets only when its last reference goes (its ``abort`` and
        ``shutdown`` leave them open), and the step's error holds one: its traceback's frames
        keep the failed ``Work`` alive, and the ``Work`` keeps the group's gloo context. So the
        error's frames are cleared (its message stays) before the group is dropped, and a
        collection frees what cycles still hold it."""
        self._release_group()
        gc.collect()

    def _release_group(self) -> None:
        """Drop this replica's references to the quorum's gloo group: the error's frames
        (its message stays), then torchft's own (see :meth:`_drop_group`)."""
        errored = self.manager.errored()
        for exc in (self._error, errored, getattr(errored, "original_exception", None)):
            tb = getattr(exc, "__traceback__", None)
            if tb is not None:
                traceback.clear_frames(tb)
        with contextlib.suppress(Exception):
            self._pg.abort(errored=False)

    @property
    def in_transaction(self) -> bool:
        return self._open

    @property
    def collectives_pending(self) -> bool:
        return self._open and self.num_collectives > self._collectives_at_begin

    @property
    def committed_steps(self) -> int:
        """Steps committed by the quorum (torchft's step count)."""
        return int(self.manager.current_step())

    def live_slots(self) -> list[int]:
        """The slots of the current quorum, sorted: one all-gather of the slot numbers when
        the quorum changed (torchft's quorum id), cached until it changes again. A gather
        that failed (the step will not commit) is not cached."""
        self.begin()
        quorum_id = upstream.quorum_id(self.manager)
        cached = getattr(self, "_live", None)
        if cached is not None and quorum_id is not None and cached[0] == quorum_id:
            return list(cached[1])
        mine = torch.tensor([self.replica], dtype=torch.int64)
        replicas = sorted({int(t.item()) for t in self.all_gather(mine)})
        size = self.replica_group_size
        slots = [r * size + j for r in replicas for j in range(size)]
        if self._error is None and len(replicas) == self._world:
            self._live = (quorum_id, slots)
        return slots

    def _missing_slots(self) -> list[int]:
        store = self._job_store
        if store is None:
            return []
        alive = []
        for slot in range(self.num_slots):
            with contextlib.suppress(Exception):
                if store.check([f"hb/{slot}"]):
                    alive.append((slot, store.get(f"hb/{slot}")))
        time.sleep(1.5)
        moving = set()
        for slot, first in alive:
            with contextlib.suppress(Exception):
                if store.get(f"hb/{slot}") != first:
                    moving.add(slot)
        return [s for s in range(self.num_slots) if s not in moving]

    def _quorum_error(self, exc: BaseException) -> QuorumError:
        missing = self._missing_slots()
        named = f"; slots not running: {missing}" if missing else ""
        return QuorumError(
            f"no quorum of at least min_replicas={self.min_replicas} replica(s) formed within "
            f"quorum_timeout={self.quorum_timeout:g}s (this is slot {self.slot} of "
            f"{self.num_slots}{named}). Fix: restart the missing workers, lower min_replicas, "
            f"or raise quorum_timeout "
            f"[{type(exc).__name__}: {exc}]", missing=tuple(missing))

    # ------------------------------------------------------------------ collectives
    def _live_group(self) -> dist.ProcessGroup:
        self.begin()
        return super()._live_group()

    def _wait(self, work: Any, what: str) -> None:
        """Record a failure instead of raising: the step will not commit."""
        try:
            ok = work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError
            self._record(exc)
            return
        if ok is False:
            self._record(TimeoutError(f"{what}: no completion after {self.timeout}s"))
        self._injected()

    def inject_failure(self) -> None:
        """Testing: this replica's next collective completes but is recorded as failed (a
        failure only this replica saw), so its step does not commit while its peers' does."""
        self._inject = True

    def _injected(self) -> None:
        if self._inject:
            self._inject = False
            self._record(RuntimeError("injected collective failure (stratagem.testing.ft)"))

    def _record(self, exc: BaseException) -> None:
        self._error = self._error or exc
        self.manager.report_error(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))

    def _skipped(self) -> bool:
        """True when a collective need not run (a world of one, or the step already failed);
        it still counts as run, so the step's transaction is committed."""
        if self._error is not None or self._world == 1:
            self.num_collectives += 1
            return True
        return False

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._live_group()  # the quorum first: world_size is the quorum's
        if self._skipped():
            return tensor  # a world of one, or the step failed: the result is not used
        return super().all_reduce(tensor, op)

    def all_reduce_async(self, tensor: torch.Tensor, *, nbytes: float | None = None
                         ) -> torch.futures.Future[torch.Tensor]:
        self._live_group()
        if self._skipped():
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(tensor)
            return fut
        inner = super().all_reduce_async(tensor, nbytes=nbytes)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                value = f.value()
            except Exception as exc:  # noqa: BLE001 - a peer died mid-collective
                self._record(exc)
                value = tensor
            self._injected()
            return value

        # Chained, not copied into a new Future: NCCL's future carries the CUDA events that
        # make DDP's stream wait for the all-reduce before it reads the bucket (a plain
        # Future would let it read local or half-reduced gradients). An NCCL failure found
        # later on the GPU is seen at commit (the group's errored()).
        return inner.then(done)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._live_group()
        if self._skipped():
            return [tensor.clone() for _ in range(self._world)]
        return super().all_gather(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._live_group()
        if self._skipped():
            return tensor
        return super().broadcast(tensor, src)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        self._live_group()
        if self._skipped():
            return tensor.clone()
        return super().all_to_all(tensor)

    def all_reduce_quantized(self, tensor: torch.Tensor, kind: str, **kwargs: Any
                             ) -> torch.Tensor:
        self.begin()  # the quorum first: the chunks are cut for its world size
        return super().all_reduce_quantized(tensor, kind, **kwargs)

    def all_reduce_topk(self, tensor: torch.Tensor, kind: Any, **kwargs: Any) -> torch.Tensor:
        self.begin()  # the quorum first: the payloads are decoded for its world size
        try:
            return super().all_reduce_topk(tensor, kind, **kwargs)
        except ValueError:
            if self._error is None:
                raise  # a peer's payload is malformed: said by the check
            # The gather failed (a peer was lost): its contents are undefined and the step
            # will not commit, so nothing computed here is applied.
            lost = kwargs.get("lost")
            if lost is not None:
                lost.zero_()
            return tensor.clone()

    def diagnose(self, exc: BaseException, what: str) -> PeerTimeoutError:
        return PeerTimeoutError(f"{what} failed in a fault-tolerant job: {exc}")

    def split(self, groups: Any, *, name: str = "split") -> Comm:
        raise NotImplementedError(
            "a fault-tolerant Comm cannot be split into sub-groups (its membership changes). "
            "Fix: use fault_tolerant=True on Mirrored, LocalSGD, DiLoCo, "
            "ElasticAveraging(mode='sync'), or Hierarchical (a node is a replica group)")

    def node_groups(self, local_world_size: int | None = None) -> Any:
        """A node of ``Hierarchical`` is one replica group: ``intra`` is the group's own
        Comm (:attr:`group_comm`, fixed membership), ``inter`` this Comm (the same group rank
        of every live replica group, through the quorum)."""
        from ..comm import NodeGroups

        size = self.replica_group_size
        if local_world_size is not None and local_world_size != size:
            raise ValueError(
                f"under fault tolerance a node is a replica group of {size} process(es) (as "
                f"launched), but local_world_size={local_world_size} was asked for. Fix: omit "
                f"local_world_size, or launch sg.launch(..., nnodes=K, fault_tolerant=True) "
                f"with {local_world_size} processes per node")
        if self._node_groups is None:
            self._node_groups = NodeGroups(intra=self.group_comm, inter=self,
                                           local_world_size=size)
        return self._node_groups

    def ddp_group(self) -> dist.ProcessGroup:
        """The group DDP is built on: a world of one (DDP's own start-up collectives and
        size must not see the changing quorum); gradients travel through the comm hook."""
        group = getattr(self, "_ddp_group", None)
        if group is None:
            from ..comm import new_group

            group = new_group(dist.HashStore(), 0, 1, self.timeout)
            self._ddp_group = group
        return group

    def kill(self) -> None:
        """Testing: vanish as a killed process would. The manager server stops (no more
        heartbeats: the next quorum forms without this replica), the heal server and the
        process group's sockets close (a peer in a collective with it fails at once)."""
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self.transport.shutdown(wait=False)
        self._release_group()
        self.close()
        gc.collect()  # the group's last references: its sockets close (see _drop_group)

    def close(self) -> None:
        if self._closed:
            return
        if self.unfreeze_gc_on_close:  # comm_from_env froze the worker's older objects
            self.unfreeze_gc_on_close = False
            gc.unfreeze()
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        super().close()
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self.transport.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self._pg.shutdown()
        with contextlib.suppress(Exception):
            self._pg.close_member_store()
