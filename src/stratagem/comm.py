"""``Comm``: an explicit process group with timeouts, byte/time accounting and peer diagnosis.

Library code always receives a ``Comm``; nothing inside stratagem reaches for the default
process group or the environment (``Comm.from_env`` is the single place that does). That is
what lets the tests run ranks as threads, each with a group of its own.

Byte accounting counts the payload a bandwidth-optimal (ring) algorithm moves per rank:
an all-reduce of ``S`` bytes sends and receives ``2 (W-1)/W * S``; an all-gather of ``S``
bytes per rank sends and receives ``(W-1) * S``; a broadcast receives ``S`` on every
non-root rank and sends ``S`` from the root; an all-to-all of ``S`` bytes per rank (``W``
chunks of ``S/W``) sends and receives ``(W-1)/W * S``.

:meth:`Comm.all_reduce_quantized` (int8/int4 blockwise, :mod:`stratagem.quantize`) is built on
the primitives :meth:`Comm.all_to_all` and :meth:`Comm.all_gather` only, so that a subclass
(:class:`RelayComm`, ``stratagem.testing.FaultyComm``) changes how it travels, or injects
faults into it, by overriding those primitives.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import gc
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

# Imported before any process group exists, on purpose: this torch module evaluates
# ``group.WORLD`` in the default arguments of its functions at import time, so importing it
# (DDP does, lazily) after ``init_process_group`` pins the default group in ten default
# arguments forever. A pinned group can never be destroyed before interpreter exit, and a
# gloo group that outlives the interpreter aborts the process (see ``release_all``).
import torch.distributed.nn.functional  # noqa: F401  isort: skip

from ._rendezvous import bound_tcp_store
from .errors import PeerTimeoutError
from .quantize import DEFAULT_BLOCK, check_block, dequantize, q_max, quantize
from .sparsify import TopK, encode, entries, parse_topk
from .validation import check_timeout

__all__ = ["Comm", "NodeGroups", "Heartbeat", "new_group", "release_all", "live_backend_threads",
           "bucketed"]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

_HEARTBEAT_SECONDS = 1.0
T = TypeVar("T")
#: ``broadcast_coalesced`` packs tensors into buckets of this many bytes (DDP's is 25 MiB).
BROADCAST_BUCKET_BYTES = 32 << 20


_LIVE_HEARTBEATS: weakref.WeakSet[Heartbeat] = weakref.WeakSet()
#: Every Comm not yet closed (``release_all`` closes them at interpreter exit).
_LIVE_COMMS: weakref.WeakSet[Comm] = weakref.WeakSet()
#: True while the default process group is one that ``Comm.from_env`` created.
_OWNS_DEFAULT_GROUP = False
#: How many default groups ``from_env`` has created in this process. Every worker builds and
#: closes its strategies in the same order, so the count agrees across workers and names a
#: fresh store prefix for each group: a group re-created after ``close()`` must not read the
#: previous group's gloo addresses (their sockets are closed: "Connection refused").
_DEFAULT_GROUPS_CREATED = 0
#: Names Linux gives the threads of a gloo process group (see ``live_backend_threads``).
_GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")


def live_backend_threads() -> list[str]:
    """Names of this process's live gloo threads (from ``/proc/self/task``; empty where
    that is unavailable). Empty after :func:`release_all`: what tests assert."""
    names: list[str] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
                if name in _GLOO_THREAD_NAMES:
                    names.append(name)
    return names


@atexit.register
def release_all() -> None:
    """Close every live :class:`Comm` and destroy the default process group stratagem created,
    so no backend thread outlives the interpreter. Runs at interpreter exit (``atexit``, i.e.
    before finalization) and in ``sg.launch`` workers after ``fn`` returns; idempotent.

    Why: a gloo worker thread releases a collective's tensors *after* marking it complete,
    and since torch 2.10 dropping a C++ reference to a tensor that has a Python object takes
    the GIL. If the main thread has meanwhile entered interpreter finalization, CPython ends
    that thread with ``pthread_exit``; the forced unwind meets a ``noexcept`` destructor and
    the process aborts ("terminate called without an active exception", SIGABRT) after its
    work is done. Destroying the group here joins those threads while the interpreter is
    still whole (torch releases the GIL in the group's destructor, so a thread waiting for it
    finishes first).
    """
    for comm in list(_LIVE_COMMS):
        comm.close()
    for beat in list(_LIVE_HEARTBEATS):
        beat.stop()
    _destroy_default_group()


class Heartbeat:
    """A daemon thread bumping a counter in the store so a failed collective can tell a dead
    peer (counter frozen) from a slow one (counter moving, collective progress behind)."""

    def __init__(self, store: dist.Store, rank: int, progress: Any) -> None:
        self._store = store
        self._rank = rank
        self._progress = progress
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._run, name=f"sg-heartbeat-{rank}", daemon=True)
        self._thread.start()
        _LIVE_HEARTBEATS.add(self)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._beats += 1
            try:
                self._store.set(f"hb/{self._rank}", f"{self._beats}:{self._progress()}")
            except Exception:  # noqa: BLE001 - the store host died; diagnosis reports it
                return
            self._stop.wait(_HEARTBEAT_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        # Join: a daemon thread still inside store.set (a C++ call that released the GIL) when
        # the interpreter finalizes is force-unwound and aborts the whole process ("terminate
        # called without an active exception"). set() is bounded by the store's timeout.
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def nccl_device(device: torch.device | None) -> torch.device | None:
    """``device`` where NCCL can serve it, else None (collectives over gloo alone).

    NCCL gives every process of a group its own GPU and refuses two ranks on one ("Duplicate
    GPU detected"), which is what a node running more processes than it has GPUs gets from
    the default device (``LOCAL_RANK % device_count``): 4 workers on a 1-GPU machine, say.
    There the group stays on gloo, whose collectives take CUDA tensors through host memory
    (slower than NCCL, correct), and a warning says so and how to get NCCL back."""
    if device is None or device.type != "cuda":
        return device
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    local = int(raw) if raw.isdigit() else 1
    gpus = torch.cuda.device_count()
    if local > gpus:
        warnings.warn(
            f"{local} processes on this node share {gpus} GPU(s) (LOCAL_WORLD_SIZE={local}): "
            "NCCL refuses two ranks on one GPU, so stratagem's collectives run over gloo "
            "(CUDA tensors staged through host memory). Fix, for NCCL: launch at most "
            f"{gpus} process(es) per node (--nproc {gpus}).", RuntimeWarning, stacklevel=3)
        return None
    return device


#: The least time joining a job waits for its ranks to start (``startup_timeout``'s default
#: is the larger of this and the step ``timeout``).
STARTUP_TIMEOUT = 120.0


def startup_seconds(timeout: float, startup_timeout: float | None) -> float:
    """The bound of a start-up wait: ``startup_timeout`` when given (checked), else
    ``max(timeout, STARTUP_TIMEOUT)``."""
    if startup_timeout is None:
        return max(float(timeout), STARTUP_TIMEOUT)
    return check_timeout("startup_timeout", startup_timeout,
                         fix="pass the seconds every rank has to start, e.g. "
                             "startup_timeout=120")


def _await_ranks(store: dist.Store, rank: int, world_size: int, seconds: float) -> None:
    """Wait until every rank of ``world_size`` has announced itself on ``store`` (at most
    ``seconds``); ``PeerTimeoutError`` naming the ranks that did not."""
    store.set(str(rank), "1")
    store.add("count", 1)
    end = time.monotonic() + seconds
    delay = 0.005
    while int(store.add("count", 0)) < world_size:
        if time.monotonic() >= end:
            # check() does not block: a rank not started yet is just "not there".
            missing = [r for r in range(world_size) if not store.check([str(r)])]
            raise PeerTimeoutError(
                f"rank {rank}: rank(s) {missing} of {world_size} did not start within "
                f"startup_timeout={seconds:g}s. Fix: check that they were launched and are "
                "not stuck importing or loading data; on a slow or busy machine raise "
                "startup_timeout (the step timeout is not used for start-up)",
                ranks=tuple(missing))
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def new_group(store: dist.Store, rank: int, world_size: int, timeout: float,
              device: torch.device | None = None) -> dist.ProcessGroup:
    """A process group of its own over ``store`` (not torch.distributed's default group, and
    without the default group's help: ``dist.new_group`` needs every rank of the default group
    to call it, which neither threads in tests nor node groups can promise). Gloo for CPU
    tensors, plus NCCL for CUDA tensors when ``device`` is a CUDA device. DDP and FSDP need
    the ``ProcessGroup`` wrapper, not the bare backend, so that is what this returns."""
    pg = dist.ProcessGroup(store, rank, world_size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size,
                                 timedelta(seconds=timeout))
    gloo_type = dist.ProcessGroup.BackendType.GLOO
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), gloo_type, gloo)
    default = gloo_type
    device = nccl_device(device)
    if device is not None and device.type == "cuda":  # pragma: no cover - no CUDA here
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, opts)
        nccl._set_sequence_number_for_group()
        nccl_type = dist.ProcessGroup.BackendType.NCCL
        pg._register_backend(torch.device("cuda"), nccl_type, nccl)
        default = nccl_type
    pg._set_default_backend(default)
    return pg


class Comm:
    """A process group plus the things a training library needs around it.

    On failure: a collective that errors or exceeds ``timeout`` raises
    :class:`~stratagem.PeerTimeoutError` naming the peer(s) whose heartbeat stopped (dead)
    or, when all are alive, the ones furthest behind (stalled).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        *,
        store: dist.Store | None = None,
        timeout: float = 60.0,
        heartbeat: bool = True,
        local_world_size: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        if world_size > 1 and group is None:
            raise ValueError(f"a Comm of world_size={world_size} needs a process group")
        lws = world_size if local_world_size is None else local_world_size
        if isinstance(lws, bool) or not isinstance(lws, int) or lws < 1 or world_size % lws:
            raise ValueError(
                f"local_world_size (processes per node) must be an int >= 1 dividing "
                f"world_size={world_size}, got {local_world_size!r}. Fix: launch the same "
                "number of processes on every node (torchrun --nproc-per-node, "
                "sg.launch(nprocs=N, nnodes=K) with N divisible by K)")
        #: Processes per node (torchrun's ``LOCAL_WORLD_SIZE``); ranks are laid out node by
        #: node, as torchrun assigns them: node ``rank // local_world_size``.
        self.local_world_size = lws
        self.device = device
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.timeout = float(timeout)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0
        self.num_collectives = 0
        self._heartbeat = (
            Heartbeat(store, rank, lambda: self.num_collectives)
            if heartbeat and store is not None and world_size > 1
            else None
        )
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        self._splits = 0
        self._children: list[Comm] = []
        self._node_groups: NodeGroups | None = None
        if group is not None:
            _LIVE_COMMS.add(self)

    # ------------------------------------------------------------------ transactions
    #: True for a Comm whose membership survives lost replicas (``stratagem.ft``): its
    #: collectives record failures instead of raising, and :meth:`commit` says whether the
    #: step's results may be applied.
    fault_tolerant = False
    #: True when ``world_size`` may change between steps (replicas leave and join).
    elastic = False

    def begin(self) -> None:
        """Open a transaction before the collectives of a synchronising step (a quorum, for a
        fault-tolerant Comm). A no-op here: this Comm's membership never changes."""

    def commit(self) -> bool:
        """Close the transaction: True when the step's collectives succeeded everywhere, so
        their results may be applied. Always True here (a failure raises instead)."""
        return True

    @property
    def in_transaction(self) -> bool:
        """True between :meth:`begin` and :meth:`commit` of a fault-tolerant Comm."""
        return False

    @property
    def collectives_pending(self) -> bool:
        """True when collectives ran in the open transaction (their results await
        :meth:`commit`)."""
        return False

    @property
    def slot(self) -> int:
        """This replica's fixed place in the job as launched (data sharding uses it): the rank,
        unless replicas may leave and join (``stratagem.ft``)."""
        return self.rank

    @property
    def num_slots(self) -> int:
        """The number of replicas the job was launched with (see :attr:`slot`)."""
        return self.world_size

    def live_slots(self) -> list[int]:
        """The slots of the replicas synchronising now, sorted (every slot here; the current
        quorum's under fault tolerance)."""
        return list(range(self.num_slots))

    #: Processes per fault-tolerant replica group (``stratagem.ft``: a node of
    #: ``Hierarchical`` is one replica; its processes train synchronously inside it). 1 here.
    replica_group_size = 1
    #: This process's place in its replica group (0 here).
    replica_group_rank = 0

    def ddp_group(self) -> dist.ProcessGroup | None:
        """The process group ``DistributedDataParallel`` is built on: this Comm's own."""
        return self.group

    # ------------------------------------------------------------------ nodes
    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node_rank(self) -> int:
        """This rank's node (torchrun's ``GROUP_RANK``)."""
        return self.rank // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    def split(self, groups: Sequence[Sequence[int]], *, name: str = "split") -> Comm:
        """Sub-communicators: ``groups`` partitions the ranks of this Comm (every rank in
        exactly one group); returns a Comm over the group holding this rank, with ranks
        numbered in the order given. Every rank must call ``split`` with the same ``groups``,
        in the same order relative to its other splits (each split gets its own store prefix,
        so heartbeats and gloo addresses of different groups never collide).

        The sub-Comm has its own byte accounting, heartbeat and timeout (this Comm's), and is
        closed with this Comm."""
        members = [list(g) for g in groups]
        flat = sorted(r for g in members for r in g)
        if flat != list(range(self.world_size)):
            raise ValueError(
                f"split groups must partition ranks 0..{self.world_size - 1} (each rank in "
                f"exactly one group), got {members!r}. Fix: list every rank once")
        index = next(i for i, g in enumerate(members) if self.rank in g)
        mine = members[index]
        self._splits += 1
        size = len(mine)
        if size == 1:
            child = Comm(None, 0, 1, timeout=self.timeout)
        else:
            if self.store is None:
                raise RuntimeError(
                    "this Comm has no store, so it cannot build sub-groups. Fix: build it with "
                    "Comm.from_env() or stratagem.testing.run_ranks, or pass store=")
            store = dist.PrefixStore(f"{name}/{self._splits}/{index}", self.store)
            if self._is_default_group():
                # torch.distributed must know the sub-groups of its default group: FSDP2's
                # DeviceMesh.from_group looks them up. dist.new_group is collective over the
                # default group, so every rank creates every group, in the same order.
                group = None
                for g in members:
                    if len(g) == 1:
                        continue
                    created = dist.new_group(ranks=g, timeout=timedelta(
                        seconds=max(self.timeout, 30.0)))
                    if g is mine:
                        group = created
                assert group is not None
            else:
                group = new_group(dist.PrefixStore("pg", store), mine.index(self.rank), size,
                                  max(self.timeout, 30.0), self.device)
            child = Comm(group, mine.index(self.rank), size, store=store,
                         timeout=self.timeout, heartbeat=self._heartbeat is not None,
                         device=self.device)
        self._children.append(child)
        return child

    def _is_default_group(self) -> bool:
        return (self.group is not None and dist.is_initialized()
                and self.group is dist.distributed_c10d._get_default_group())

    def node_groups(self, local_world_size: int | None = None) -> NodeGroups:
        """This rank's node group (the processes of its node) and cross-node group (the
        processes with the same local rank on every node), built once and cached. Nodes are
        ``local_world_size`` consecutive ranks (torchrun's layout); by default this Comm's
        ``local_world_size`` (from ``LOCAL_WORLD_SIZE``)."""
        lws = self.local_world_size if local_world_size is None else local_world_size
        if self._node_groups is not None and self._node_groups.local_world_size == lws:
            return self._node_groups
        if isinstance(lws, bool) or not isinstance(lws, int) or lws < 1 or self.world_size % lws:
            raise ValueError(
                f"local_world_size must be an int >= 1 dividing world_size="
                f"{self.world_size}, got {lws!r}. Fix: pass the number of processes per node")
        nodes = self.world_size // lws
        intra = self.split([list(range(n * lws, (n + 1) * lws)) for n in range(nodes)],
                           name="node")
        inter = self.split([list(range(j, self.world_size, lws)) for j in range(lws)],
                           name="cross")
        self._node_groups = NodeGroups(intra=intra, inter=inter, local_world_size=lws)
        return self._node_groups

    # ------------------------------------------------------------------ construction
    @classmethod
    def single(cls) -> Comm:
        """A world of one: every collective is the identity."""
        return cls(None, 0, 1)

    @classmethod
    def from_env(cls, *, timeout: float = 60.0, device: torch.device | None = None,
                 startup_timeout: float | None = None) -> Comm:
        """Join the job described by torchrun-style environment variables.

        The first strategy built in a launched worker initialises torch.distributed's default
        process group here, so user code may also call ``torch.distributed`` directly.
        Joining waits up to ``startup_timeout`` (default :func:`startup_seconds`) for every
        rank to start, however short the step ``timeout``: a slow start is not a dead peer.
        """
        startup = startup_seconds(timeout, startup_timeout)
        from stratagem.clusters import adopt_tasks

        # Processes a cluster started one per worker (srun python train.py) get torchrun's
        # variables from their cluster's; a torchrun-style launcher's are kept as they are.
        adopt_tasks()
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1 and not dist.is_initialized():
            return cls.single()
        if dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
            try:
                store: dist.Store | None = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - private API; heartbeats are a diagnosis aid only
                store = None
            return cls(group, dist.get_rank(), dist.get_world_size(), store=store, timeout=timeout,
                       local_world_size=_env_local_world_size(dist.get_world_size(),
                                                              dist.get_rank()),
                       device=device)
        rank = int(os.environ["RANK"])
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        base: dist.Store
        if rank == 0 and not agent_store:
            # Rank 0 hosts the store itself on MASTER_ADDR only; torch's
            # TCPStore would listen on every interface (on one machine every peer is on
            # loopback; on several, they reach node 0's address on their shared network).
            try:
                base = bound_tcp_store(host, port, world_size=world_size,
                                       timeout=timedelta(seconds=startup))
            except OSError as exc:
                from stratagem.clusters import SOURCE_ENV

                source = os.environ.get(SOURCE_ENV)  # set only for a derived port
                if source is None or exc.errno != errno.EADDRINUSE:
                    raise
                raise OSError(errno.EADDRINUSE,
                              f"the rendezvous port {port} ({source} job: derived from the "
                              f"job id, unless MASTER_PORT is set) is taken on {host}. Fix: "
                              "export MASTER_PORT=<a free port> in the job script") from exc
        else:
            # Connecting waits for rank 0's store: start-up, bounded by ``startup``.
            base = dist.TCPStore(
                host, port, world_size, is_master=(rank == 0 and not agent_store),
                timeout=timedelta(seconds=startup), wait_for_workers=False,
            )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"stratagem/attempt_{attempt}", base)
        comm = cls.default_group(store, rank, world_size, timeout=timeout, device=device,
                                 local_world_size=_env_local_world_size(world_size, rank),
                                 startup_timeout=startup)
        base.set_timeout(timedelta(seconds=timeout))  # started: store waits are step waits
        return comm

    @classmethod
    def default_group(cls, store: dist.Store, rank: int, world_size: int, *, timeout: float,
                      device: torch.device | None = None,
                      local_world_size: int | None = None,
                      startup_timeout: float | None = None) -> Comm:
        """A Comm over torch.distributed's default process group, initialised here over
        ``store`` (``from_env``; a fault-tolerant replica group of several processes, whose
        FSDP2 needs a registered group). Destroyed by the last Comm's close.

        Every rank first waits (up to ``startup_timeout``, default :func:`startup_seconds`)
        until all have reached this point, then the group is created with the step
        ``timeout``: its rendezvous finds everyone started, and its collectives keep the
        short bound. A rank that never comes raises ``PeerTimeoutError`` naming it."""
        device = nccl_device(device)
        backend = "cpu:gloo,cuda:nccl" if (device is not None and device.type == "cuda") else "gloo"
        global _OWNS_DEFAULT_GROUP, _DEFAULT_GROUPS_CREATED
        generation = _DEFAULT_GROUPS_CREATED
        prefix = "default_pg" if generation == 0 else f"default_pg/{generation}"
        _await_ranks(dist.PrefixStore(f"{prefix}/started", store), rank, world_size,
                     startup_seconds(timeout, startup_timeout))
        dist.init_process_group(
            backend, store=dist.PrefixStore(prefix, store), rank=rank,
            world_size=world_size, timeout=timedelta(seconds=timeout),
        )
        _DEFAULT_GROUPS_CREATED += 1
        _OWNS_DEFAULT_GROUP = True  # destroyed by the last Comm's close, or by release_all
        group = dist.distributed_c10d._get_default_group()
        return cls(group, rank, world_size, store=store, timeout=timeout,
                   local_world_size=local_world_size, device=device)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` first thing in :meth:`close`: for objects holding this Comm's
        process group (a DDP wrapper, a pending work handle), which must let go of it before
        the group can be destroyed."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Stop the heartbeat and let go of the process group; the last Comm on a default
        group that ``from_env`` created destroys it, joining its threads. Idempotent. The
        Comm cannot run collectives afterwards."""
        if self._closed:
            return
        self._closed = True
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        children, self._children = self._children, []
        for child in children:
            child.close()
        self._node_groups = None
        group, self.group = self.group, None
        _LIVE_COMMS.discard(self)
        if group is not None and _OWNS_DEFAULT_GROUP and dist.is_initialized() \
                and group is dist.distributed_c10d._get_default_group() \
                and not any(c.group is group for c in _LIVE_COMMS):
            del group
            _destroy_default_group()

    # ------------------------------------------------------------------ accounting
    def account(self, sent: float, received: float, seconds: float = 0.0) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.seconds += seconds

    def allreduce_bytes(self, nbytes: int) -> float:
        return 2.0 * (self.world_size - 1) / self.world_size * nbytes

    def _live_group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(
                f"this Comm (rank {self.rank} of {self.world_size}) is closed: its process "
                "group was released by close() (strategy.close() or interpreter exit). Fix: "
                "build a new strategy instead of reusing a closed one")
        return self.group

    # ------------------------------------------------------------------ failures
    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError
            raise self.diagnose(exc, what) from exc
        if ok is False:
            raise self.diagnose(TimeoutError(f"no completion after {self.timeout}s"), what)

    def diagnose(self, exc: BaseException, what: str) -> PeerTimeoutError:
        """Turn a failed collective into a ``PeerTimeoutError`` naming the culprit peer(s)."""
        culprits, how = self._find_culprits()
        names = ", ".join(str(r) for r in culprits) if culprits else "unknown"
        return PeerTimeoutError(
            f"{what} failed on rank {self.rank} of {self.world_size}: peer rank(s) {names} "
            f"{how} (timeout={self.timeout}s). Original error: {str(exc).splitlines()[0][:300]}. "
            "Fix: check that peer's log; restart the job (stratagem run --max-restarts) and "
            "resume from the last checkpoint.",
            ranks=tuple(culprits),
        )

    def silent_peers(self) -> tuple[list[int], str]:
        """Which peers look dead (heartbeat frozen for ~2.5 s) or stalled, and how; for errors
        raised outside a collective (e.g. a parameter-server version that never arrives).
        Takes ~2.5 s; ``([], ...)`` when nothing can be told."""
        if self.world_size == 1:
            return [], "no peers"
        return self._find_culprits()

    def _read_beats(self) -> dict[int, tuple[int, int]] | None:
        if self.store is None:
            return None
        beats: dict[int, tuple[int, int]] = {}
        try:
            for r in range(self.world_size):
                key = f"hb/{r}"
                if self.store.check([key]):
                    count, progress = self.store.get(key).decode().split(":")
                    beats[r] = (int(count), int(progress))
        except Exception:  # noqa: BLE001 - the store itself is gone
            return None
        return beats

    def _find_culprits(self) -> tuple[list[int], str]:
        others = [r for r in range(self.world_size) if r != self.rank]
        first = self._read_beats()
        if first is None:
            return [0], "is unreachable (it hosts the rendezvous store, or the store is down)"
        time.sleep(2.5 * _HEARTBEAT_SECONDS)
        second = self._read_beats()
        if second is None:
            return [0], "is unreachable (it hosts the rendezvous store, or the store is down)"
        dead = [r for r in others if r not in second or first.get(r, (-1, 0))[0] == second[r][0]]
        if dead:
            return dead, "stopped responding (its heartbeat stopped: the process died or froze)"
        lowest = min(second[r][1] for r in others) if others else 0
        behind = [r for r in others if second[r][1] == lowest and lowest < self.num_collectives]
        if behind:
            return behind, "is alive but did not join the collective (stalled or diverged)"
        return [], "did not complete the collective"

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a contiguous tensor; ``op`` in sum/max/min/product."""
        if self.world_size == 1:
            return tensor
        group = self._live_group()
        assert tensor.is_contiguous()
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]  # type: ignore[assignment]
        t0 = time.perf_counter()
        self.num_collectives += 1
        self._wait(group.allreduce([tensor], opts), f"all_reduce({op})")
        nbytes = self.allreduce_bytes(tensor.numel() * tensor.element_size())
        self.account(nbytes, nbytes, time.perf_counter() - t0)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, *, nbytes: float | None = None
                         ) -> torch.futures.Future[torch.Tensor]:
        """Start a sum all-reduce (dense or sparse) and return a future of the result, counting
        it like every other collective (progress for the peer diagnosis, bytes and time on
        completion). For DDP communication hooks, which must return a future. ``nbytes``
        overrides the dense ring estimate (e.g. for a sparse tensor)."""
        group = self._live_group()
        if nbytes is None:
            nbytes = self.allreduce_bytes(tensor.numel() * tensor.element_size())
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        t0 = time.perf_counter()
        self.num_collectives += 1
        fut = group.allreduce([tensor], opts).get_future()

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            self.account(nbytes, nbytes, time.perf_counter() - t0)
            return f.value()[0]  # type: ignore[no-any-return]

        return fut.then(done)

    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor], op: str = "sum") -> None:
        """All-reduce many tensors in place with one collective per dtype/device."""
        if self.world_size == 1 or not tensors:
            return
        for group in _by_dtype(tensors):
            flat = self.all_reduce(flatten(group), op)
            for t, v in zip(group, views(flat, group)):
                t.copy_(v)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        group = self._live_group()
        assert tensor.is_contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        t0 = time.perf_counter()
        self.num_collectives += 1
        self._wait(group.broadcast([tensor], opts), "broadcast")
        nbytes = tensor.numel() * tensor.element_size()
        self.account(nbytes if self.rank == src else 0, 0 if self.rank == src else nbytes,
                     time.perf_counter() - t0)
        return tensor

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, *,
                            bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
        """Broadcast ``tensors`` from ``src`` in place: small tensors packed into buckets of
        at most ``bucket_bytes`` (one collective each), a contiguous tensor of a bucket's size
        or more sent as it is. The transient copy is one bucket, never the whole model (a
        100 M-parameter model flattened at once doubled ``prepare``'s peak memory)."""
        if self.world_size == 1 or not tensors:
            return
        for group in _by_dtype(tensors):
            for bucket in bucketed(group, bucket_bytes, _nbytes):
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    self.broadcast(bucket[0], src)
                    continue
                flat = self.broadcast(flatten(bucket), src)
                with torch.no_grad():
                    for t, v in zip(bucket, views(flat, bucket)):
                        t.copy_(v)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Same-shape all-gather: returns one tensor per rank."""
        if self.world_size == 1:
            return [tensor]
        group = self._live_group()
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        t0 = time.perf_counter()
        self.num_collectives += 1
        # Options passed explicitly: a Python process group (torchft's reconfigurable one, under
        # a fault-tolerant Comm) takes them positionally.
        self._wait(group.allgather([out], [tensor], AllgatherOptions()), "all_gather")
        nbytes = (self.world_size - 1) * tensor.numel() * tensor.element_size()
        self.account(nbytes, nbytes, time.perf_counter() - t0)
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Equal-split all-to-all of a 1-D tensor whose length is a multiple of the world
        size: chunk ``j`` of this rank's input goes to rank ``j``; chunk ``i`` of the returned
        tensor came from rank ``i`` (chunk ``rank`` is this rank's own)."""
        if self.world_size == 1:
            return tensor.clone()
        group = self._live_group()
        tensor = tensor.contiguous()
        if tensor.dim() != 1 or tensor.numel() % self.world_size:
            raise ValueError(f"all_to_all needs a 1-D tensor whose length is a multiple of "
                             f"world_size={self.world_size}, got shape {tuple(tensor.shape)}. "
                             "Fix: pad it to a multiple of the world size")
        out = torch.empty_like(tensor)
        t0 = time.perf_counter()
        self.num_collectives += 1
        self._wait(group.alltoall_base(out, tensor, [], [], dist.AllToAllOptions()),
                   "all_to_all")
        nbytes = (self.world_size - 1) * tensor.numel() // self.world_size \
            * tensor.element_size()
        self.account(nbytes, nbytes, time.perf_counter() - t0)
        return out

    def all_reduce_quantized(self, tensor: torch.Tensor, kind: str, *,
                             block: int = DEFAULT_BLOCK,
                             lost: torch.Tensor | None = None) -> torch.Tensor:
        """The **sum** over ranks of the 1-D fp32 ``tensor``, sent quantized (``kind`` "int8"
        or "int4", one fp32 scale per ``block`` values; :mod:`stratagem.quantize`). Returns a
        new tensor, bitwise identical on every rank; ``tensor`` is left as it is.

        A quantized reduce-scatter, then a quantized all-gather: the tensor is padded to
        ``W`` chunks of whole blocks; rank ``i`` quantizes chunk ``j`` and sends it to rank
        ``j`` (one :meth:`all_to_all`); rank ``j`` dequantizes the ``W`` copies of its chunk,
        sums them in fp32 (in rank order), re-quantizes the sum and every rank all-gathers the
        quantized sums (one :meth:`all_gather`) and dequantizes them, its own included. So no
        floating-point reduction happens on the wire, and everyone decodes the same bytes.
        Bytes on the wire per rank: ``2 (W-1) P`` with ``P`` a chunk's payload (integers plus
        scales), about ``(1 + 4/block)/4`` (int8) or ``(1/2 + 4/block)/4`` (int4) of a fp32
        ring all-reduce.

        ``lost`` (a tensor like ``tensor``, for error feedback) is filled with what this rank's
        part of the result dropped: ``tensor`` minus its dequantized quantization, plus, on the
        chunk this rank reduced, the fp32 sum minus its dequantized re-quantization. Summed
        over ranks, the ``lost`` tensors are exactly the fp32 sum of the inputs minus the
        returned sum (up to fp32 rounding), so adding them to the next call's inputs keeps
        the running sum of the results within one call's error of the fp32 running sum.
        Non-finite input gives a non-finite result on every rank (and ``lost`` zero there).
        """
        q_max(kind)
        check_block(block)
        _check_flat_fp32("all_reduce_quantized", tensor, lost)
        n, world = tensor.numel(), self.world_size
        chunk = -(-max(n, 1) // (world * block)) * block  # values per rank, whole blocks
        padded = torch.zeros(world * chunk, dtype=torch.float32, device=tensor.device)
        padded[:n].copy_(tensor.detach())
        pieces = padded.view(world, chunk)
        sent = [quantize(pieces[j], kind, block) for j in range(world)]
        size = sent[0].numel()
        mine = self.rank
        drop = torch.empty_like(padded) if lost is not None else None
        if drop is not None:
            for j in range(world):
                drop[j * chunk:(j + 1) * chunk] = pieces[j] - dequantize(sent[j], kind, chunk,
                                                                         block)
        received = self.all_to_all(torch.cat(sent)).view(world, size)
        total = dequantize(received[0], kind, chunk, block)
        for i in range(1, world):
            total += dequantize(received[i], kind, chunk, block)
        summed = quantize(total, kind, block)
        gathered = self.all_gather(summed)
        out = torch.cat([dequantize(g, kind, chunk, block) for g in gathered])
        if drop is not None and lost is not None:
            own = slice(mine * chunk, (mine + 1) * chunk)
            drop[own] += total - out[own]
            lost.copy_(torch.nan_to_num(drop[:n], nan=0.0, posinf=0.0, neginf=0.0))
        return out[:n].clone() if world * chunk != n else out

    def all_reduce_topk(self, tensor: torch.Tensor, kind: str | TopK, *,
                        lost: torch.Tensor | None = None) -> torch.Tensor:
        """The **sum** over ranks of what each rank's top-k payload of the 1-D fp32 ``tensor``
        carries (``kind``: a :class:`~stratagem.sparsify.TopK` or its string, e.g.
        ``"topk:0.02+int2"``; SparseLoCo, Sarfi et al. 2025). Returns a new tensor, bitwise
        identical on every rank; ``tensor`` is left as it is.

        Every rank encodes its tensor (per chunk of ``kind.chunk`` values: the ``k`` entries
        of largest magnitude, ``bits``-bit values, uint16 indices, one fp32 scale;
        :mod:`stratagem.sparsify`), one :meth:`all_gather` moves the payloads (all the same
        size), and every rank checks and decodes all of them, its own included, and adds them
        in rank order in fp32: the same bytes and the same additions everywhere. A malformed
        payload (an index outside its chunk, a wrong length) raises ``ValueError`` before
        anything is written. Bytes on the wire per rank: ``(W-1) P`` sent and received, ``P``
        one payload (``kind.payload_bytes(n)``): it grows with ``W``, unlike a ring
        all-reduce; at density 0.02 / 2 bits, 0.0115x of fp32's bytes per peer.

        ``lost`` (a tensor like ``tensor``, for error feedback) is filled with ``tensor`` minus
        what this rank's payload decodes to (the entries not sent and the quantization error
        of those sent), so that the ``lost`` tensors summed over ranks are exactly the sum of
        the inputs minus the result (up to fp32 rounding). Non-finite input gives ``nan`` on
        every rank in its chunk (and ``lost`` zero where it was sent).
        """
        spec = kind if isinstance(kind, TopK) else parse_topk(kind, name="kind")
        _check_flat_fp32("all_reduce_topk", tensor, lost)
        n = tensor.numel()
        payload = encode(tensor, spec)
        gathered = self.all_gather(payload)
        decoded = [entries(p, n, spec) for p in gathered]  # every payload checked first
        total = torch.zeros(n, dtype=torch.float32, device=tensor.device)
        for pos, values in decoded:
            total[pos] += values  # positions are unique within a payload: deterministic
        if lost is not None:
            pos, values = entries(payload, n, spec)
            lost.copy_(tensor.detach())
            lost[pos] -= values
            lost.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return total

    def all_equal(self, payload: bytes) -> bool:
        """Whether every rank passed the same ``payload``: one all-gather of its 32-byte
        SHA-256 digest (True in a world of one)."""
        if self.world_size == 1:
            return True
        import hashlib

        digest = torch.frombuffer(bytearray(hashlib.sha256(payload).digest()),
                                  dtype=torch.int64)
        return all(torch.equal(d, digest) for d in self.all_gather(digest.clone()))

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """All-gather variable-length byte strings (sizes first, then padded payloads)."""
        if self.world_size == 1:
            return [payload]
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [int(s.item()) for s in self.all_gather(size)]
        buf = torch.zeros(max(sizes) or 1, dtype=torch.uint8)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [bytes(t[:n].numpy().tobytes()) for t, n in zip(self.all_gather(buf), sizes)]

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        self.all_reduce(torch.zeros(1))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new contiguous 1-D buffer holding ``tensors`` one after the other (same dtype)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (the layout of :func:`flatten`)."""
    out, offset = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[offset:offset + n].view(t.shape))
        offset += n
    return out


def _env_local_world_size(world_size: int, rank: int) -> int:
    """Processes per node from torchrun's ``LOCAL_WORLD_SIZE``, checked against ``GROUP_RANK``
    (node ranks must be laid out node by node, as torchrun does)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        lws = int(raw) if raw else world_size
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an int, got {raw!r}. Fix: launch with "
                         "torchrun / stratagem run, which set it") from None
    if lws < 1 or world_size % lws:
        raise ValueError(f"LOCAL_WORLD_SIZE={lws} does not divide WORLD_SIZE={world_size}: "
                         "every node must run the same number of processes. Fix: use the same "
                         "--nproc-per-node on every node")
    group_rank = os.environ.get("GROUP_RANK", "")
    if group_rank.isdigit() and int(group_rank) != rank // lws:
        raise ValueError(f"rank {rank} with LOCAL_WORLD_SIZE={lws} should be on node "
                         f"{rank // lws}, but GROUP_RANK={group_rank}: ranks are not laid out "
                         "node by node. Fix: use torchrun's default rank assignment")
    return lws


class NodeGroups:
    """A rank's node group (``intra``: the processes of its node) and cross-node group
    (``inter``: the processes with the same local rank on every node), from
    :meth:`Comm.node_groups`. ``relay()`` is a Comm across nodes for state that is identical
    within a node (see :class:`RelayComm`)."""

    def __init__(self, *, intra: Comm, inter: Comm, local_world_size: int) -> None:
        self.intra = intra
        self.inter = inter
        self.local_world_size = local_world_size
        self._relay: RelayComm | None = None

    @property
    def num_nodes(self) -> int:
        return self.inter.world_size

    @property
    def node_rank(self) -> int:
        return self.inter.rank

    def relay(self) -> RelayComm:
        if self._relay is None:
            relay = self._relay = RelayComm(self.intra, self.inter)
            self.inter.on_close(relay.close)  # the relay holds the cross-node group too
        return self._relay


#: Below this many elements per local rank a relayed all-reduce is not split (the chunks
#: would be latency-bound): every local rank all-reduces the whole tensor across nodes.
_RELAY_MIN_CHUNK = 4096


class RelayComm(Comm):
    """A Comm across nodes (rank = node rank, world size = number of nodes) for tensors that
    are identical on every process of a node (after a Mirrored step, for instance).

    An all-reduce is split into ``local_world_size`` chunks; local rank ``j`` all-reduces
    chunk ``j`` with its peers on the other nodes, then the node all-gathers the chunks (the
    reduce-scatter / all-gather split of hierarchical all-reduce, as in HSDP and Horovod's
    hierarchical allreduce). Each node thus sends one copy of the tensor across nodes, spread
    over all its processes, instead of one copy per process; the intra-node all-gather runs
    on the fast local links. Other collectives go to the cross-node group directly (every
    local rank does the same, small, work).

    Bytes are counted on the two underlying Comms (``intra``: node-local, ``inter``: across
    nodes); this Comm's own counters stay at zero.
    """

    def __init__(self, intra: Comm, inter: Comm) -> None:
        self.intra = intra
        self.inter = inter
        super().__init__(inter.group, inter.rank, inter.world_size, timeout=inter.timeout,
                         heartbeat=False, device=inter.device)

    # Rank, size and transactions are the cross-node Comm's, read when asked: under fault
    # tolerance (``stratagem.ft``) the nodes are replica groups whose quorum changes.
    @property  # type: ignore[override]
    def rank(self) -> int:
        return self.inter.rank

    @rank.setter
    def rank(self, value: int) -> None:
        pass  # always the cross-node Comm's

    @property  # type: ignore[override]
    def world_size(self) -> int:
        return self.inter.world_size

    @world_size.setter
    def world_size(self, value: int) -> None:
        pass

    @property  # type: ignore[override]
    def fault_tolerant(self) -> bool:  # type: ignore[override]
        return self.inter.fault_tolerant

    def begin(self) -> None:
        self.inter.begin()

    def commit(self) -> bool:
        return self.inter.commit()

    @property
    def in_transaction(self) -> bool:
        return self.inter.in_transaction

    @property
    def collectives_pending(self) -> bool:
        return self.inter.collectives_pending

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        local = self.intra.world_size
        n = tensor.numel()
        if local == 1 or n < local * _RELAY_MIN_CHUNK or self.world_size == 1:
            # (a fault-tolerant Comm alone in its quorum still counts the collective)
            return self.inter.all_reduce(tensor, op)
        assert tensor.is_contiguous()
        flat = tensor.view(-1)
        size = -(-n // local)
        lo = min(self.intra.rank * size, n)
        hi = min(lo + size, n)
        chunk = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
        chunk[: hi - lo].copy_(flat[lo:hi])
        self.inter.all_reduce(chunk, op)
        for j, part in enumerate(self.intra.all_gather(chunk)):
            a = min(j * size, n)
            b = min(a + size, n)
            flat[a:b].copy_(part[: b - a])
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, *, nbytes: float | None = None
                         ) -> torch.futures.Future[torch.Tensor]:
        raise NotImplementedError("a RelayComm has no asynchronous all-reduce; use all_reduce")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.inter.broadcast(tensor, src)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.inter.all_gather(tensor)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.inter.all_to_all(tensor)

    def all_reduce_quantized(self, tensor: torch.Tensor, kind: str, **kwargs: Any
                             ) -> torch.Tensor:
        # On the cross-node group: every local rank sends the whole (quantized) tensor across
        # nodes, unlike the relayed all_reduce.
        return self.inter.all_reduce_quantized(tensor, kind, **kwargs)

    def split(self, groups: Sequence[Sequence[int]], *, name: str = "split") -> Comm:
        raise NotImplementedError("split the underlying Comms, not a RelayComm")


def _check_flat_fp32(what: str, tensor: torch.Tensor, lost: torch.Tensor | None) -> None:
    """The input checks of the compressed all-reduces: a 1-D fp32 ``tensor``, and ``lost``
    (when given) shaped like it."""
    if tensor.dim() != 1 or tensor.dtype != torch.float32:
        raise ValueError(f"{what} needs a 1-D fp32 tensor, got shape {tuple(tensor.shape)} "
                         f"dtype {tensor.dtype}. Fix: flatten it and cast it to float32")
    if lost is not None and (lost.shape != tensor.shape or lost.dtype != tensor.dtype):
        raise ValueError(f"lost must be a tensor like the input (shape {tuple(tensor.shape)}, "
                         f"float32), got shape {tuple(lost.shape)} dtype {lost.dtype}. Fix: "
                         "pass torch.empty_like(tensor)")


def _destroy_default_group() -> None:
    """Destroy the default group if ``from_env`` created it, then collect garbage so the last
    Python reference goes now (torch's wrapper releases the GIL while the group's destructor
    joins its threads)."""
    global _OWNS_DEFAULT_GROUP
    if not _OWNS_DEFAULT_GROUP:
        return
    _OWNS_DEFAULT_GROUP = False
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()


def bucketed(items: Sequence[T], limit: int, nbytes: Callable[[T], int]) -> list[list[T]]:
    """``items`` cut into buckets of at most ``limit`` bytes (``nbytes(item)``), small items
    kept in order; an item of ``limit`` bytes or more is a bucket of its own. Used for the
    broadcast of ``prepare`` and for a parameter server's push-fetch calls."""
    out: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if n >= limit:
            out.append([item])
            continue
        if current and size + n > limit:
            out.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        out.append(current)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
