"""A parameter-server shard, the service: tensors, their optimizers and versions over gRPC.

Lineage: TensorFlow's ``ps`` job. This module is the service around the tensors: binding,
authentication (token, TLS), limits (message size, quota, concurrency, body timeout), request
validation and dispatch, and waiting for versions. What an operation does to a tensor (Downpour
SGD, ``SyncReplicasOptimizer`` aggregation, ``DropStaleGradientOptimizer``, the EASGD elastic
exchange, optimizer slots and hyperparameters) is :mod:`stratagem.ps.rules`.

Each tensor has its own lock, optimizer and version counter, so pushes to different tensors run
concurrently. Operations (the ``op`` of a :mod:`stratagem.ps.wire` message): ``health``,
``register``, ``pull``, ``pull_rows``, ``push``, ``push_sparse``, ``wait_version``, ``elastic``,
``set_hyperparams``, ``get_state``, ``set_state``, ``shutdown``; and for workers on the same
machine ``shm_attach``, ``shm_push`` (a push+fetch whose tensors are in a shared-memory region,
checked and applied as a ``push``) and ``shm_detach`` (:mod:`stratagem.ps.shm`).

Run one shard as a process with ``python -m stratagem.ps.server --host H --port P
[--port-file PATH]``; it exits 0 on SIGTERM/SIGINT or a ``shutdown`` call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import mmap
import os
import secrets
import signal
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from stratagem._rendezvous import bracket_host
from stratagem.ps import auth as ps_auth
from stratagem.ps import optim as ps_optim
from stratagem.ps import rules, shm, wire
from stratagem.ps.flags import DEFAULT_MAX_BYTES, add_shard_arguments
from stratagem.ps.rpc import grpc
from stratagem.ps.rules import Slot
from stratagem.ps.rules import is_int as _is_int
from stratagem.ps.rules import refused as _err
from stratagem.ps.wire import Entry, Message, WireError

__all__ = ["ShardServer", "serve", "start_local_shards", "main",
           "serve_from_args", "DEFAULT_MAX_BYTES"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Refusals that suggest a misconfigured or hostile peer (logged as warnings, rate-limited).
_LOUD = frozenset({"UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "INTERNAL"})

#: A ``push``, ``pull`` or ``health`` that touches at most this many tensor bytes (pushed plus
#: fetched) runs on the event loop itself when no tensor thread is busy: handing it to a
#: thread and back cost more than the work (~0.35 ms of CPU per call, measured with 64 KiB
#: buckets), and a bucketed Downpour step makes up to 16 such calls per worker. The bound
#: keeps the loop's pause per call to about a millisecond.
_INLINE_BYTES = 1 << 20
_INLINE_OPS = frozenset({"push", "pull", "health", "shm_push"})
#: Shared-memory regions one shard maps at most (those of dead workers are dropped first):
#: each is bounded by the registered tensors it covers (two copies), so this bounds them all.
_MAX_REGIONS = 64
#: A chunked request at least this long is received into an anonymous mapping, not a
#: bytearray (see _receive_buffer).
_MMAP_BYTES = 1 << 20
#: How often the shard looks for regions of workers that are gone (see _reap_regions).
_REAP_SECONDS = 2.0
#: How long an idle doorbell thread waits before it looks whether its region is still
#: wanted: each look is a wake-up that takes the GIL, so many idle doorbells waking often
#: cost the calls being served (a request on the pipe, or its closing, wakes it at once).
_BELL_IDLE_SECONDS = 2.0
#: What a tensor entry (in a request, or a slot a reply lists) counts as in that bound: its
#: header JSON, checks and objects cost ~10 us each, so a request of a few thousand empty
#: tensors is decoded and served on a tensor thread, not on the loop.
_ENTRY_BYTES = 4096
#: A request whose JSON header is longer than this is decoded on a tensor thread.
_INLINE_HEADER_BYTES = 64 << 10
#: A registered message may be kept as the slots' storage when at most this much (plus an
#: eighth of the registered bytes) of it is something else.
_ADOPT_SLACK = 64 << 10
#: After a request of at least this size, freed memory is handed back to the kernel
#: (``malloc_trim``, once a burst of them is over, off the loop): gRPC receives a message in many
#: small blocks that glibc would otherwise keep resident after a burst of big bodies.
_TRIM_BYTES = 16 << 20


def _int(fields: dict[str, Any], key: str, default: int | None = None, *,
         minimum: int | None = 0) -> int | None:
    v = fields.get(key, default)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (minimum is not None and v < minimum):
        raise _err(f"field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _float(fields: dict[str, Any], key: str, default: float | None = None) -> float:
    v = fields.get(key, default)
    try:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an integer beyond float range
        ok = False
    if not ok or not isinstance(v, (int, float)):
        raise _err(f"field {key!r} must be a finite number, got {str(v)[:40]}")
    return float(v)


def _first_repeat(items: Sequence[str]) -> str:
    seen: set[str] = set()
    for n in items:
        if n in seen:
            return n
        seen.add(n)
    return ""


def _names(fields: dict[str, Any], key: str = "names") -> list[str] | None:
    v = fields.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise _err(f"field {key!r} must be a list of strings")
    if len(set(v)) != len(v):  # a name repeated N times would cost N copies in the reply
        dup = _first_repeat(v)
        raise _err(f"field {key!r} names {dup!r} more than once; name each tensor once")
    return v


class _Throttle:
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


class _LoopThread:
    """The one asyncio event loop (in a daemon thread) that hosts every shard of this process:
    grpc.aio servers live on a loop, and one loop for all keeps in-process shards simple."""

    _lock = threading.Lock()
    _instance: _LoopThread | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="stratagem-ps-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _LoopThread()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("cannot wait for the shard loop from inside it")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@dataclass
class _Region:
    """A worker's shared-memory region as the shard maps it (views keep the mapping alive).
    ``started`` is the worker's start time (``/proc/<pid>/stat``), so a pid reused by a new
    process does not keep a dead worker's region; ``fifos`` are its doorbell's pipes."""

    pid: int
    layout: shm.Layout
    grads: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    started: str | None = None
    fifos: tuple[shm.FifoId, ...] = ()


def _alive(region: _Region) -> bool:
    """Whether the worker that attached ``region`` still runs (same pid, same start time)."""
    started = _process_start(region.pid)
    return started is not None and (region.started is None or started == region.started)


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


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``; None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


class _NotARequest(Exception):
    """A doorbell carried something that is not a request of its region: the channel is
    closed unanswered (:meth:`ShardServer._bell_loop`)."""


class _Abort:
    """A refusal: the gRPC status name and the explanation sent to the caller."""

    def __init__(self, status: str, detail: str) -> None:
        self.status, self.detail = status, detail


class ShardServer:
    """One parameter-server shard.

    Availability: the shard is a ``grpc.aio`` server, so a call costs a coroutine, not a
    thread, while its body arrives (or never does): a client holding many stalled streams
    cannot starve others. The token is checked from the call's metadata before the body is
    read (the method is registered as client-streaming, so gRPC hands us the call before the
    message): an unauthenticated body is never buffered beyond HTTP/2 flow control. Each
    connection may hold ``max_concurrent_streams`` calls; a body must arrive within
    ``body_timeout`` seconds; connections are recycled after ``max_connection_age`` seconds
    (in-flight calls get a grace period); idle peers are probed with keepalive pings. Tensor
    work (optimizer steps, encoding replies) runs on ``max_workers`` threads with one lock per
    tensor; a small push or pull (at most 1 MiB of tensors) runs on the loop itself while no
    thread is busy, which saves a thread hand-off per call.

    Bounded work: every request's reply size is computed before anything is allocated and
    refused (``RESOURCE_EXHAUSTED``) above ``max_message_bytes``; a tensor or row may appear
    only once per request; registered tensors (plus their optimizer state) may not exceed
    ``max_bytes`` in total.

    No poisoning: non-finite gradients, elastic exchanges, registrations and states are
    refused (``INVALID_ARGUMENT``) before anything is applied; optimizer hyperparameters are
    validated by building the optimizer as torch would (:func:`stratagem.ps.optim.check_spec`).

    Failure behaviour: a malformed, oversize or non-stratagem message (random bytes, a pickle)
    is refused with ``INVALID_ARGUMENT`` or ``RESOURCE_EXHAUSTED``; a missing or wrong token
    with ``UNAUTHENTICATED``; an unknown tensor with ``NOT_FOUND``; a request that contradicts
    the registration (shape, mode) with ``FAILED_PRECONDITION``. None of these affect other
    clients; each kind is logged at most once per 10 s. An unexpected exception is answered
    with ``INTERNAL`` and logged as one rate-limited line (no traceback per request).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 tls_cert: bytes | str | os.PathLike[str] | None = None,
                 tls_key: bytes | str | os.PathLike[str] | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
                 max_bytes: int = DEFAULT_MAX_BYTES,
                 max_workers: int = 4, max_wait_seconds: float = 10.0,
                 max_concurrent_streams: int = 32, max_concurrent_rpcs: int = 1024,
                 max_connection_age: float = 3600.0, body_timeout: float = 120.0,
                 max_inflight_bytes: int | None = None) -> None:
        token = ps_auth.resolve_token(token)
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM); got only "
                             f"{'tls_cert' if tls_key is None else 'tls_key'}. Fix: pass both")
        for name, value, low in (("max_workers", max_workers, 1),
                                 ("max_concurrent_streams", max_concurrent_streams, 1),
                                 ("max_concurrent_rpcs", max_concurrent_rpcs, 1),
                                 ("max_bytes", max_bytes, 0)):
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name, fvalue in (("max_wait_seconds", max_wait_seconds),
                             ("max_connection_age", max_connection_age),
                             ("body_timeout", body_timeout)):
            if not isinstance(fvalue, (int, float)) or not 0 < fvalue < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {fvalue!r}")
        self.host, self.port = host, port
        self._token = token.encode() if token else None
        self._tls: tuple[bytes, bytes] | None = None
        if tls_cert is not None and tls_key is not None:
            cert = ps_auth.read_pem(tls_cert, "certificate")
            key = ps_auth.read_pem(tls_key, "private key")
            ps_auth.check_tls_pair(cert, key)
            self._tls = (key, cert)
        self.limits = wire.Limits(max_message_bytes=max_message_bytes)
        if max_inflight_bytes is None:
            max_inflight_bytes = 2 * self.limits.max_message_bytes
        if not _is_int(max_inflight_bytes) or max_inflight_bytes < 1024:
            raise ValueError(f"max_inflight_bytes must be an integer >= 1024, got "
                             f"{max_inflight_bytes!r}. Fix: pass e.g. 2 * max_message_bytes")
        #: Bound on the request bytes held at once (received, not yet answered): a request
        #: that would pass it is refused (RESOURCE_EXHAUSTED) and dropped at once; a chunked
        #: request (wire.REQUEST_CHUNK_BYTES) is charged its declared size before it is read.
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight_bytes = 0  # loop thread only
        #: The bytes of chunked requests received and served at once (one request always
        #: may; the others wait, unread): see :meth:`_admit_big`.
        self.max_receiving_bytes = max_inflight_bytes // 4
        self._receiving_bytes = 0  # loop thread only
        self._received: asyncio.Event | None = None
        self._trim_due = 0.0
        self._trim_pending = False
        self.max_bytes = max_bytes
        self._max_workers = max_workers
        self.max_wait_seconds = float(max_wait_seconds)
        self.max_concurrent_streams = max_concurrent_streams
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.max_connection_age = float(max_connection_age)
        self.body_timeout = float(body_timeout)
        msg = ps_auth.exposure_warning(host, token=self._token is not None,
                                       tls=self._tls is not None)
        if msg is not None:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
        self._slots: dict[str, Slot] = {}
        self._registry_lock = threading.Lock()
        self._charged = 0  # bytes of registered tensors + optimizer state (the quota)
        self._stopped = threading.Event()
        self._server: grpc.aio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._loop: _LoopThread | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._changed: asyncio.Event | None = None
        self._num_waiters = 0
        self._in_flight = 0  # authenticated calls being served (on the loop thread only)
        self._busy = 0  # calls handed to the tensor threads and not back (loop thread only)
        self._throttle = _Throttle()
        self._started = time.monotonic()
        self._ops: dict[str, Callable[[Message], bytes]] = {
            "health": self._health, "register": self._register, "pull": self._pull,
            "pull_rows": self._pull_rows, "push": self._push, "push_sparse": self._push_sparse,
            "elastic": self._elastic,
            "set_hyperparams": self._set_hyperparams, "get_state": self._get_state,
            "set_state": self._set_state, "shutdown": self._shutdown,
            "shm_attach": self._shm_attach, "shm_push": self._shm_push,
            "shm_detach": self._shm_detach,
        }
        #: Shared-memory regions of workers on this machine, by id (stratagem.ps.shm).
        self._regions: dict[str, _Region] = {}
        self._regions_lock = threading.Lock()
        self._shm_pushes = 0  # served through a region (health: the path is in use)
        self._bells = 0  # doorbell threads serving a region (shm.Bell), under _regions_lock
        #: The pipes those threads hold open (st_dev, st_ino), under _regions_lock: a pipe
        #: may serve one doorbell only (see shm.open_bell).
        self._bell_fifos: set[shm.FifoId] = set()
        #: Pushes served by doorbell threads at once: at most as many as tensor threads.
        self._bell_slots = threading.BoundedSemaphore(self._max_workers)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{bracket_host(self.host)}:{self.port}"

    def describe(self) -> str:
        """One line: address, authentication, TLS and limits (logged at start-up)."""
        return (f"parameter-server shard listening on {self.address} "
                f"(auth: {'token' if self._token else 'NONE'}, "
                f"TLS: {'on' if self._tls else 'off'}, "
                f"max message {self.limits.max_message_bytes} B, "
                f"max registered {self.max_bytes} B, "
                f"max in flight {self.max_inflight_bytes} B, "
                f"{self.max_concurrent_streams} streams per connection, "
                f"{self.max_concurrent_rpcs} calls in all, "
                f"body timeout {self.body_timeout:g} s, "
                f"connection age {self.max_connection_age:g} s, "
                f"{self._max_workers} tensor threads)")

    def _options(self) -> list[tuple[str, Any]]:
        age_ms = int(self.max_connection_age * 1000)
        return [("grpc.max_send_message_length", self.limits.max_message_bytes),
                # One gRPC message is at most a chunk (longer requests come chunked, their
                # size declared and admitted before they are read: see _receive). gRPC refuses
                # a longer message from its length prefix, before receiving it (a bare
                # grpc.aio server sent eight 12 MiB messages against a 1 MiB cap: +0 MiB).
                ("grpc.max_receive_message_length", wire.REQUEST_CHUNK_BYTES),
                # No BDP probing: with it gRPC grows every stream's receive window towards
                # the measured bandwidth-delay product (megabytes on loopback), so each call
                # waiting to be admitted had megabytes of its body received and held by gRPC
                # anyway (8 concurrent 12 MiB registers, 64 MiB quota, 1 MiB chunks: peak
                # 1.78-1.83x the quota with probing, 1.11-1.15x without). Without it a waiting
                # call holds one 64 KiB window. Loopback push+pull throughput without it was
                # the same as with it, within the benchmark's noise (docs/reliability.md).
                ("grpc.http2.bdp_probe", 0),
                # so_reuseport=0: a second shard on the same fixed port must fail, not share it.
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", self.max_concurrent_streams),
                ("grpc.max_connection_age_ms", age_ms),
                # In-flight calls (a long wait_version, a big push on a slow link) may finish.
                ("grpc.max_connection_age_grace_ms", int((self.body_timeout + 60) * 1000)),
                # Probe silent peers so half-open connections do not linger.
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 5)]

    def start(self) -> int:
        """Start serving; returns the bound port (useful with ``port=0``)."""
        if self._server is not None:
            raise RuntimeError(f"shard {self.address} is already started")
        rules.warm_up_optimizers()
        self._loop = _LoopThread.get()
        self._executor = futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                    thread_name_prefix="stratagem-ps")
        try:
            server, port = self._loop.run(self._start_async(), timeout=60.0)
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self._server, self.port = server, port
        log.info("%s", self.describe())
        return port

    async def _start_async(self) -> tuple[grpc.aio.Server, int]:
        self._changed = asyncio.Event()
        self._received = asyncio.Event()
        server = grpc.aio.server(options=self._options(),
                                 maximum_concurrent_rpcs=self.max_concurrent_rpcs)
        # Client-streaming on our side (the client calls it unary: the wire is the same), so
        # the handler runs on the headers and reads the body only once the token is checked.
        handler = grpc.stream_unary_rpc_method_handler(self._handle)
        service, method = wire.METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),))
        target = f"{bracket_host(self.host)}:{self.port}"
        try:
            if self._tls is not None:
                port = server.add_secure_port(target, grpc.ssl_server_credentials([self._tls]))
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise OSError(f"parameter-server shard could not bind {target}: {exc}; the address "
                          "is in use or not local: choose another port, or port 0") from None
        if not port:
            raise OSError(f"parameter-server shard could not bind {target}; choose another port "
                          "or port 0")
        await server.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_regions())
        return server, port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; in-flight calls get ``grace`` seconds to finish."""
        server, self._server = self._server, None
        self._stopped.set()
        if server is not None and self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._wake)
            if self._reaper is not None:
                self._loop.loop.call_soon_threadsafe(self._reaper.cancel)
            with contextlib.suppress(Exception):
                self._loop.run(server.stop(grace), timeout=(grace or 0) + 5.0)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the shard stops (``shutdown`` call or :meth:`stop`); False on timeout."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> ShardServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)

    # -- dispatch -------------------------------------------------------------------------

    def _authorized(self, metadata: Any) -> bool:
        if self._token is None:
            return True
        for key, value in metadata or ():
            if key == wire.TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._token)
        return False

    def _refused(self, status: str, peer: str, detail: str) -> None:
        level = logging.WARNING if status in _LOUD else logging.INFO
        self._throttle(f"{status}", level,
                       f"parameter-server shard {self.address} refused a call from {peer}: "
                       f"{status}: {detail[:300]}")

    async def _handle(self, request_iterator: Any, context: grpc.aio.ServicerContext
                      ) -> bytes | _Abort:
        peer = context.peer() or "?"
        if not self._authorized(context.invocation_metadata()):
            detail = ("missing or wrong parameter-server token; set STRATAGEM_PS_TOKEN "
                      "(or STRATAGEM_PS_TOKEN_FILE, or token=) on the worker to the shard's "
                      "token")
            self._refused("UNAUTHENTICATED", peer, "missing or wrong token")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)
        self._in_flight += 1
        try:
            reply = await self._serve_call(context)
        finally:
            self._in_flight -= 1
        if isinstance(reply, _Abort):
            self._refused(reply.status, peer, reply.detail)
            await context.abort(getattr(grpc.StatusCode, reply.status), reply.detail)
        return reply

    async def _serve_call(self, context: grpc.aio.ServicerContext) -> bytes | _Abort:
        """The reply, or the refusal as a value: never a raised exception here, because an
        exception's traceback would keep this frame (and the request's megabytes) alive in
        a reference cycle until the next garbage collection."""
        declared = _declared_bytes(context.invocation_metadata())
        if isinstance(declared, _Abort):
            return declared
        if declared is not None:  # chunked: admitted by its declared size before it is read
            if declared > self.limits.max_message_bytes:
                return _Abort("RESOURCE_EXHAUSTED",
                              f"the request declares {declared} bytes, above this shard's "
                              f"max_message_bytes={self.limits.max_message_bytes}. Fix: use "
                              "more shards or a partitioner to split big tensors")
            try:
                if self._must_wait(declared):
                    await _within(self._admit_big(declared), self.body_timeout)
                else:  # the usual case: admitted at once, no timer and no task
                    self._receiving_bytes += declared
            except asyncio.TimeoutError:
                return _Abort("DEADLINE_EXCEEDED", f"request not admitted within body_timeout="
                              f"{self.body_timeout:g} s (bigger requests held the shard)")
            try:
                return await self._serve_chunked(context, declared)
            finally:
                self._release_big(declared)
        try:  # one message, which gRPC caps at wire.REQUEST_CHUNK_BYTES
            request = await _within(context.read(), self.body_timeout)
        except asyncio.TimeoutError:
            return _Abort("DEADLINE_EXCEEDED", f"request body not received within "
                          f"body_timeout={self.body_timeout:g} s")
        if not isinstance(request, bytes):
            return _Abort("INVALID_ARGUMENT", "the call carried no request message")
        size = len(request)
        refused = self._over_inflight(size)
        if refused is not None:
            del request  # dropped at once: that is the point of the bound
            return refused
        self._inflight_bytes += size
        try:
            return await self._serve_body(request, context)
        finally:
            self._inflight_bytes -= size
            if size >= _TRIM_BYTES:
                self._trim_soon()

    def _over_inflight(self, size: int) -> _Abort | None:
        if self._inflight_bytes + size <= self.max_inflight_bytes:
            return None
        return _Abort("RESOURCE_EXHAUSTED",
                      f"the shard already holds {self._inflight_bytes} bytes of requests "
                      f"in progress; this one ({size} bytes) would pass its bound "
                      f"max_inflight_bytes={self.max_inflight_bytes}. Retry later, or "
                      "send smaller requests")

    async def _admit_big(self, declared: int) -> None:
        """Wait until a chunked request of ``declared`` bytes may be received and served.

        Peak shard memory: gRPC's receive path costs about three times the message it is
        assembling, so requests longer than wire.REQUEST_CHUNK_BYTES come in chunks, each
        written into a buffer of the declared size. Chunked requests are received and
        served at once only up to ``max_receiving_bytes`` (a quarter of
        ``max_inflight_bytes``; one request always may): the others wait here, unread, with
        one HTTP/2 window each (BDP probing is off, see _options). So eight concurrent 12 MiB
        registers against a 64 MiB quota and a 40 MiB in-flight bound are taken one after
        another: the peak is what registering keeps (the quota) plus about one request,
        where before the fix gRPC held all eight bodies at once in three copies each."""
        assert self._received is not None
        while self._must_wait(declared):
            await self._received.wait()
        self._receiving_bytes += declared

    def _must_wait(self, declared: int) -> bool:
        """Whether a chunked request of ``declared`` bytes must wait to be admitted."""
        return bool(self._receiving_bytes
                    and self._receiving_bytes + declared > self.max_receiving_bytes)

    def _release_big(self, declared: int) -> None:
        self._receiving_bytes -= declared
        if self._received is not None:
            done, self._received = self._received, asyncio.Event()
            done.set()

    async def _serve_chunked(self, context: grpc.aio.ServicerContext, declared: int
                             ) -> bytes | _Abort:
        refused = self._over_inflight(declared)
        if refused is not None:
            return refused
        self._inflight_bytes += declared
        try:
            try:
                body = await _within(self._receive(context, declared), self.body_timeout)
            except asyncio.TimeoutError:
                return _Abort("DEADLINE_EXCEEDED", f"request body not received within "
                              f"body_timeout={self.body_timeout:g} s")
            if isinstance(body, _Abort):
                return body
            return await self._serve_body(body, context)
        finally:
            self._inflight_bytes -= declared
            if declared >= _TRIM_BYTES:
                self._trim_soon()

    async def _receive(self, context: grpc.aio.ServicerContext, declared: int
                       ) -> bytearray | mmap.mmap | _Abort:
        """A chunked request's bytes, written into a buffer of its declared size.

        Its header is checked as soon as it has arrived (:meth:`_check_header`), and only then
        is the buffer allocated: a request that is malformed, or a registration that cannot
        fit the quota, is refused after its first chunk, having cost that chunk, not its
        declared size."""
        head = bytearray()  # what arrived before the header could be checked
        buf: bytearray | mmap.mmap | None = None
        got = 0
        while True:
            chunk = await context.read()
            if chunk is grpc.aio.EOF:
                break
            if not isinstance(chunk, bytes):
                return _Abort("INVALID_ARGUMENT", "the call carried no request message")
            if got + len(chunk) > declared:
                return _Abort("INVALID_ARGUMENT",
                              f"the request carries more than the {declared} bytes its "
                              f"{wire.SIZE_METADATA_KEY!r} metadata declares")
            if buf is not None:
                buf[got:got + len(chunk)] = chunk
                got += len(chunk)
                del chunk
                continue
            first: bytes | bytearray = chunk
            if head:
                head += chunk  # amortised: many tiny chunks cost no quadratic copying
                first = head
            got += len(chunk)
            head_end = wire.frame_length(first)
            if head_end is None or (got < min(head_end, declared)
                                    and head_end - 12 <= self.limits.max_header_bytes):
                if first is chunk:
                    head += chunk  # the header has not all arrived yet
                del chunk, first
                continue
            del chunk
            refused = await self._check_header(first, head_end)
            if refused is not None:
                return refused
            # The usual case, a header within the first chunk, copies that chunk once.
            buf = _receive_buffer(declared)
            buf[:got] = first
            del first
            head = bytearray()
        if got != declared or buf is None:
            return _Abort("INVALID_ARGUMENT",
                          f"the request ended after {got} of the {declared} bytes its "
                          f"{wire.SIZE_METADATA_KEY!r} metadata declares")
        return buf

    async def _check_header(self, head: bytes | bytearray, head_end: int) -> _Abort | None:
        """Refuse a chunked request by its header, before the rest of it is received: a
        malformed header or unknown op, or a ``register`` whose new tensors alone (their
        declared bytes plus the per-slot overhead, a lower bound of what registering them
        charges) would pass ``max_bytes``. The quota is checked again, exactly, when the
        request is served; this check only spares receiving (and holding) a request that
        cannot fit. A long header is parsed on a tensor thread, not the loop."""
        try:
            if head_end - 12 <= _INLINE_HEADER_BYTES:
                op, _, metas = wire.decode_header(head, self.limits)
            else:
                op, _, metas = await self._offload(wire.decode_header, head, self.limits)
        except WireError as exc:
            return _Abort(exc.status, str(exc))
        if op not in self._ops and op != "wait_version":
            return _Abort("INVALID_ARGUMENT", f"unknown op {op!r}; valid: "
                          f"{sorted([*self._ops, 'wait_version'])}")
        if op != "register":
            return None
        new: dict[str, int] = {}
        for m in metas:  # claims, checked when the request is decoded: count only sane ones
            if not isinstance(m, dict):
                continue
            name, nbytes = m.get("name"), m.get("nbytes")
            if (isinstance(name, str) and isinstance(nbytes, int) and nbytes >= 0
                    and name not in self._slots):
                new[name] = max(new.get(name, 0), int(nbytes) + rules.SLOT_OVERHEAD_BYTES)
        adding, charged = sum(new.values()), self._charged
        if charged + adding <= self.max_bytes:
            return None
        return _Abort("RESOURCE_EXHAUSTED",
                      f"register: the request's {len(new)} new tensors need at least {adding} "
                      f"bytes, and shard {self.address} holds {charged} of its quota "
                      f"max_bytes={self.max_bytes} (refused from the request's header, before "
                      "its tensors were received). Fix: use more shards, or start the shard "
                      "with a larger --max-bytes")

    async def _serve_body(self, request: bytes | bytearray | mmap.mmap,
                          context: grpc.aio.ServicerContext
                          ) -> bytes | _Abort:
        assert self._loop is not None and self._executor is not None
        try:
            # Never inline beside doorbell threads: they take tensor locks at any time.
            if (self._busy == 0 and self._bells == 0 and len(request) <= _INLINE_BYTES
                    and _header_bytes(request) <= _INLINE_HEADER_BYTES):
                # A small call: decode here; run it here too if it is small work (see
                # _INLINE_BYTES). With no tensor thread busy no tensor lock is held, and none
                # can be taken until this returns (only the loop hands out work): no waiting.
                msg = self._decode(request)
                del request
                if self._inline_bytes(msg) <= _INLINE_BYTES:
                    out = self._dispatch(msg)
                else:
                    out = await self._offload(self._dispatch, msg)
            else:
                # One hop to a tensor thread: decode and run the op there (the loop only moves
                # bytes); wait_version comes back decoded and waits on the loop.
                out = await self._offload(self._run, request)
                del request
            if isinstance(out, Message):
                return await self._wait_version(out, context)
            return out
        except Exception as exc:  # noqa: BLE001 - a shard must survive any single request
            return self._refusal(exc)

    def _refusal(self, exc: Exception) -> _Abort:
        """What a request that raised ``exc`` is answered (gRPC call or doorbell): a
        refusal's own status, INVALID_ARGUMENT for a bad value, UNAVAILABLE while stopping
        (the executor is shut down), else INTERNAL (logged)."""
        if isinstance(exc, WireError):
            return _Abort(exc.status, str(exc))
        if isinstance(exc, (ValueError, TypeError)):
            return _Abort("INVALID_ARGUMENT", str(exc))
        if isinstance(exc, RuntimeError) and self._stopped.is_set():
            return _Abort("UNAVAILABLE", "the shard is stopping")
        return self._internal(exc)

    def _trim_soon(self) -> None:
        """Trim the heap once the burst of big requests is over (loop thread only): 0.2 s
        after the last one, off the loop."""
        self._trim_due = time.monotonic() + 0.2
        if not self._trim_pending and self._loop is not None:
            self._trim_pending = True
            self._loop.loop.call_later(0.2, self._trim_check)

    def _trim_check(self) -> None:
        left = self._trim_due - time.monotonic()
        if left > 0 and self._loop is not None:
            self._loop.loop.call_later(left, self._trim_check)
            return
        self._trim_pending = False
        if self._executor is not None and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the executor is shut down: stopping
                self._executor.submit(wire.trim_malloc)

    def _internal(self, exc: BaseException) -> _Abort:
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        at = (f" at {os.path.basename(where.tb_frame.f_code.co_filename)}:{where.tb_lineno}"
              if where is not None else "")
        self._throttle(f"INTERNAL:{type(exc).__name__}", logging.ERROR,
                       f"parameter-server shard {self.address}: unexpected "
                       f"{type(exc).__name__}{at}: {str(exc)[:300]}")
        return _Abort("INTERNAL", f"{type(exc).__name__}: {exc}")

    def _decode(self, request: bytes | bytearray | mmap.mmap) -> Message:
        msg = wire.decode(request, self.limits)
        if msg.op not in self._ops and msg.op != "wait_version":
            raise _err(f"unknown op {msg.op!r}; valid: {sorted([*self._ops, 'wait_version'])}")
        names = [e.name for e in msg.entries]
        if len(set(names)) != len(names):
            dup = _first_repeat(names)
            raise _err(f"{msg.op}: tensor {dup!r} appears more than once in one request; send "
                       "each tensor once")
        return msg

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tensor thread; counts the calls out (see :data:`_INLINE_BYTES`)."""
        assert self._executor is not None
        self._busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._busy -= 1

    def _inline_bytes(self, msg: Message) -> int:
        """The tensor bytes ``msg`` touches, or more than :data:`_INLINE_BYTES` when it may
        not run on the loop (a malformed field is left for the op to refuse)."""
        if msg.op not in _INLINE_OPS:
            return _INLINE_BYTES + 1
        if msg.op == "shm_push":  # at most its region's bytes (copied out and in)
            rid = msg.fields.get("region")
            region = self._regions.get(rid) if isinstance(rid, str) else None
            return region.layout.size if region is not None else 0
        total = sum(e.tensor.nbytes + _ENTRY_BYTES for e in msg.entries)
        names = msg.fields.get("fetch" if msg.op == "push" else "names")
        if msg.op == "health" or (msg.op == "pull" and names is None):  # every tensor
            if len(self._slots) * _ENTRY_BYTES > _INLINE_BYTES:
                return _INLINE_BYTES + 1
            if msg.op == "health":
                return total
            return total + sum(s.value.nbytes + _ENTRY_BYTES for s in self._slots.values())
        if isinstance(names, list):
            for n in names:
                slot = self._slots.get(n) if isinstance(n, str) else None
                total += _ENTRY_BYTES + (0 if slot is None else slot.value.nbytes)
                if total > _INLINE_BYTES:
                    break
        return total

    def _dispatch(self, msg: Message) -> bytes | Message:
        if msg.op == "wait_version":
            return msg
        return self._ops[msg.op](msg)

    def _run(self, request: bytes | bytearray | mmap.mmap) -> bytes | Message:
        return self._dispatch(self._decode(request))

    # -- helpers --------------------------------------------------------------------------

    def _slot(self, name: str) -> Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise _err(f"tensor {name!r} is not registered on shard {self.address}; "
                       "register it first", "NOT_FOUND")
        return slot

    def _select(self, names: list[str] | None, op: str = "this call") -> list[Slot]:
        """The slots named (None: every slot), counted against ``max_tensors`` before any is
        looked up, sorted or locked."""
        self._check_count(op, len(self._slots) if names is None else len(names), names is None)
        if names is None:
            return [self._slots[k] for k in sorted(self._slots)]
        return [self._slot(n) for n in names]

    def _check_count(self, op: str, count: int, whole: bool, *, names: bool = True) -> None:
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

    def _check_reply(self, op: str, tensors: Sequence[tuple[str, int]], extra: int = 0) -> None:
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

    def _snapshot(self, slots: Sequence[Slot], op: str = "values",
                  fields: dict[str, Any] | None = None) -> bytes:
        """Encode the values of ``slots`` as one consistent snapshot."""
        self._check_reply(op, [(s.name, s.value.nbytes) for s in slots],
                          extra=len(json.dumps(fields or {})))
        # The given slots' own locks (a slot replaced by set_state meanwhile keeps its lock), in
        # a fixed order: no deadlock.
        unique = sorted({id(s): s for s in slots}.values(), key=lambda s: s.name)
        locks = [s.lock for s in unique]
        for lk in locks:
            lk.acquire()
        try:
            return wire.encode(op, fields, [Entry(s.name, s.value, s.version) for s in slots])
        finally:
            for lk in reversed(locks):
                lk.release()

    def _notify(self) -> None:
        # Called from tensor threads after a version changed; wakes the waiting coroutines.
        if self._num_waiters and self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        ev = self._changed
        if ev is not None:
            self._changed = asyncio.Event()
            ev.set()

    def _check_quota(self, op: str, adding: int, freeing: int = 0) -> None:
        """Caller holds ``_registry_lock``."""
        after = self._charged - freeing + adding
        if adding > freeing and after > self.max_bytes:
            raise _err(f"{op}: registering {adding} more bytes (tensors plus optimizer state) "
                       f"would bring shard {self.address} to {after} bytes, above its quota "
                       f"max_bytes={self.max_bytes}. Fix: use more shards, or start the shard "
                       "with a larger --max-bytes", "RESOURCE_EXHAUSTED")

    def _offer(self, slot: Slot, base: int | None, max_staleness: int | None,
               grad: Callable[[], torch.Tensor]) -> list[Any]:
        """:func:`stratagem.ps.rules.offer`, then wake the version waiters if it applied."""
        return self._after_offer(slot, rules.offer(slot, base, max_staleness, grad))

    def _after_offer(self, slot: Slot, result: list[Any]) -> list[Any]:
        """Wake the version waiters if the offer applied; log a refused step."""
        if result[1] == "applied" or (result[1] == "refused" and slot.mode == "sync"):
            self._notify()
        if result[1] == "refused":
            self._throttle(f"refused:{slot.name}", logging.WARNING,
                           f"parameter-server shard {self.address}: refused a step of "
                           f"{slot.name!r} that would make it non-finite; it keeps its last "
                           f"finite value ({slot.refused} refused so far)")
        return result

    # -- operations -----------------------------------------------------------------------

    def _health(self, msg: Message) -> bytes:
        # Its versions list every tensor: counted before anything is walked.
        self._check_count("health", len(self._slots), True, names=False)
        with self._registry_lock:
            slots = list(self._slots.values())
            charged = self._charged
        fields = {
            "ok": True, "pid": os.getpid(), "num_tensors": len(slots),
            "shm_regions": len(self._regions), "shm_pushes": self._shm_pushes,
            "shm_bells": self._bells,
            "bytes": sum(s.value.nbytes for s in slots), "dropped": sum(s.dropped for s in slots),
            "refused": sum(s.refused for s in slots),
            "charged_bytes": charged, "max_bytes": self.max_bytes,
            "calls_in_flight": self._in_flight,
            "uptime_seconds": time.monotonic() - self._started,
            "versions": {s.name: s.version for s in slots},
            # As a request handler sees it: the width of each optimizer step (see serve()).
            "intra_op_threads": torch.get_num_threads(),
        }
        self._check_reply("health", [], extra=64 * len(slots) + sum(len(s.name) for s in slots))
        return wire.encode("health", fields)

    def _register(self, msg: Message) -> bytes:
        specs = msg.fields.get("specs", [])
        meta = msg.fields.get("entries")
        if not isinstance(specs, list) or not isinstance(meta, list) or len(meta) != len(
                msg.entries):
            raise _err("register needs fields 'specs' (list) and 'entries' (one per tensor)")
        # The reply holds every named tensor: refuse a too-big one before creating anything.
        self._check_reply("register", [(e.name, e.tensor.nbytes) for e in msg.entries])
        with self._registry_lock:  # all or nothing; the first registration of a name wins
            todo: list[tuple[Entry, str, Any, Any]] = []
            cost = 0
            for e, m in zip(msg.entries, meta, strict=True):
                if not isinstance(m, dict):
                    raise _err("register: each entry must be an object")
                old = self._slots.get(e.name)
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
            self._check_quota("register", cost)
            # Keep the received tensors as the slots' values (no copy) when the message is
            # (nearly) all new tensors: a copy would double what registering costs, beyond
            # the quota. A message carrying much else is copied so it is not kept alive.
            adopted = sum(e.tensor.nbytes for e, _, _, _ in todo)
            keep = msg.nbytes - adopted <= adopted // 8 + _ADOPT_SLACK
            new = [rules.make_slot(e.name, e.tensor, mode, spec, replicas, copy=not keep)
                   for e, mode, spec, replicas in todo]  # any refusal: nothing was inserted
            for slot in new:
                self._slots[slot.name] = slot
            self._charged += cost
            created = {s.name for s in new}
            # The reply carries only the tensors registered before: the caller has the
            # values it just created (echoing them would cost their size once more).
            slots = [self._slots[e.name] for e in msg.entries if e.name not in created]
        return self._snapshot(slots, "register", {"created": [s.name for s in new]})

    def _pull(self, msg: Message) -> bytes:
        return self._snapshot(self._select(_names(msg.fields), "pull"))

    def _pull_rows(self, msg: Message) -> bytes:
        name = msg.fields.get("name")
        slot = self._slot(name if isinstance(name, str) else "")
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
        self._check_reply("pull_rows", [(slot.name, idx.numel() * row_bytes)])
        with slot.lock:
            out = slot.value.index_select(0, idx)
            version = slot.version
        return wire.encode("rows", None, [Entry(slot.name, out, version)])

    def _push(self, msg: Message) -> bytes:
        max_staleness = _int(msg.fields, "max_staleness")
        fetch = _names(msg.fields, "fetch")
        wanted = [self._slot(n) for n in fetch] if fetch is not None else []
        checked = self._check_push(msg.entries)
        if fetch is not None:
            self._check_reply("push", [(s.name, s.value.nbytes) for s in wanted],
                              extra=64 * len(checked))
        results = self._apply_push(checked, max_staleness)
        if fetch is None:
            return wire.encode("pushed", {"results": results})
        # Push and fetch in one round trip (a Downpour step): the values after this push.
        return self._snapshot(wanted, "pushed", {"results": results})

    def _check_push(self, entries: Sequence[Entry]
                    ) -> list[tuple[Slot, Entry, Callable[[], torch.Tensor]]]:
        """The pushed gradients, each with its slot and its cast (built lazily), after every
        check a push gets (shape, dtype, base version, finiteness, overflow of the cast):
        everything is checked before anything is applied, so one bad tensor refuses the
        request. Shared by the gRPC push and the shared-memory one."""
        checked: list[tuple[Slot, Entry, Callable[[], torch.Tensor]]] = []
        slots: list[Slot] = []
        for e in entries:
            slot = self._slot(e.name)
            if slot.mode == "elastic":
                raise _err(f"tensor {slot.name!r} is registered for elastic averaging; it "
                           "takes 'elastic' exchanges, not gradient pushes",
                           "FAILED_PRECONDITION")
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

    def _apply_push(self, checked: Sequence[tuple[Slot, Entry, Callable[[], torch.Tensor]]],
                    max_staleness: int | None) -> list[list[Any]]:
        """Offer the checked gradients: one fused optimizer step for the tensors of this push
        that share an optimizer configuration (rules.offer_many), the same results as one
        offer per tensor."""
        results = rules.offer_many([(slot, e.version, grad) for slot, e, grad in checked],
                                   max_staleness)
        for (slot, _, _), result in zip(checked, results, strict=True):
            self._after_offer(slot, result)
        return results

    # -- same-host shared memory (stratagem.ps.shm) ----------------------------------------

    def _shm_attach(self, msg: Message) -> bytes:
        """Map a worker's region (:func:`stratagem.ps.shm.open_region` checks it); answers its
        id. The layout is computed here from this shard's own tensors and the pushed dtypes
        the worker declares, so the region's size is bounded by what is registered."""
        f = msg.fields
        declared = f.get("entries")
        nonce_hex = f.get("nonce")
        if (not isinstance(declared, list) or not declared
                or len(declared) > self.limits.max_tensors
                or not all(isinstance(d, list) and len(d) == 2 and isinstance(d[0], str)
                           and isinstance(d[1], str) for d in declared)):
            raise _err(f"shm_attach needs 'entries': a list of 1 to {self.limits.max_tensors} "
                       "[name, pushed dtype] pairs")
        if not isinstance(nonce_hex, str) or len(nonce_hex) != 2 * shm.NONCE_BYTES:
            raise _err(f"shm_attach needs 'nonce': {2 * shm.NONCE_BYTES} hex digits")
        try:
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            raise _err("shm_attach: 'nonce' is not hex") from None
        names = [d[0] for d in declared]
        if len(set(names)) != len(names):
            raise _err(f"shm_attach: tensor {_first_repeat(names)!r} is declared twice")
        entries = []
        for name, dtype_name in declared:
            slot = self._slot(name)
            dtype = wire.DTYPES.get(dtype_name)
            if dtype is None or not dtype.is_floating_point:
                raise _err(f"shm_attach: pushed dtype {dtype_name!r} of {name!r} is not a "
                           "floating-point wire dtype")
            entries.append((name, dtype, slot.value.dtype, tuple(slot.value.shape)))
        lay = shm.layout(entries)
        size, pid, fd = f.get("size"), f.get("pid"), f.get("fd")
        if not (isinstance(pid, int) and isinstance(fd, int)):
            raise _err(f"shm_attach needs integers 'pid' and 'fd', got pid={str(pid)[:20]} "
                       f"fd={str(fd)[:20]}")
        if size != lay.size:
            raise _err(f"shm_attach: the region declares {size!r} bytes, the layout of its "
                       f"tensors on this shard needs {lay.size}; every worker must build the "
                       "same model (and use the same stratagem)")
        with self._regions_lock:
            self._purge_regions()
            if len(self._regions) >= _MAX_REGIONS:
                raise _err(f"shm_attach: shard {self.address} already maps {_MAX_REGIONS} "
                           "shared-memory regions of live workers; this worker uses gRPC",
                           "RESOURCE_EXHAUSTED")
        started = _process_start(pid)
        try:
            mm = shm.open_region(pid, fd, lay, nonce)
        except shm.RegionRefused as exc:
            # The caller is told one generic sentence; what was wrong with the file (which
            # may be another process's) only goes to this shard's log.
            self._throttle("shm_attach_refused", logging.WARNING, f"parameter-server shard "
                           f"{self.address}: refused a shared-memory region: {exc.detail}")
            raise _err(str(exc), "PERMISSION_DENIED") from None
        bell: tuple[int, int, tuple[shm.FifoId, shm.FifoId]] | None = None
        if f.get("bell") is not None and shm.bell_enabled() and self._bells < _MAX_REGIONS:
            try:
                bell = shm.open_bell(pid, f.get("bell"), nonce, self._held_fifos())
            except shm.RegionRefused as exc:  # the region stands; its steps go over gRPC
                self._throttle("shm_bell", logging.INFO, f"parameter-server shard "
                               f"{self.address}: no doorbell for a region: {exc}")
        grads, values = shm.views(mm, lay)
        region = _Region(pid, lay, grads, values, started)
        region_id = secrets.token_hex(16)
        with self._regions_lock:
            self._regions[region_id] = region
            # Doorbells are bounded too, and a pipe serves one of them (checked again here:
            # another attach may have taken it since open_bell looked).
            if bell is not None and (self._bells >= _MAX_REGIONS
                                     or set(bell[2]) & self._bell_fifos):
                os.close(bell[0])
                os.close(bell[1])
                bell = None
            if bell is not None:
                region.fifos = bell[2]
                self._bell_fifos.update(bell[2])
                self._bells += 1
        if bell is not None:
            try:
                threading.Thread(target=self._bell_loop,
                                 args=(region_id, region, bell[0], bell[1]),
                                 name=f"stratagem-ps-bell-{region_id[:8]}",
                                 daemon=True).start()
            except BaseException:
                os.close(bell[0])
                os.close(bell[1])
                with self._regions_lock:
                    self._bells -= 1
                    self._bell_fifos.difference_update(region.fifos)
                    region.fifos = ()
                bell = None
        return wire.encode("ok", {"region": region_id, "bell": bell is not None})

    def _held_fifos(self) -> set[shm.FifoId]:
        """The pipes of the doorbells this shard holds open (until their threads end)."""
        with self._regions_lock:
            return set(self._bell_fifos)

    def _bell_loop(self, rid: str, region: _Region, rfd: int, wfd: int) -> None:
        """Serve one region's doorbell (:class:`stratagem.ps.shm.Bell`) until its worker
        closes it, the region is detached or the shard stops: each request must be a
        ``shm_push`` of this region and is answered as the gRPC call would be (a refusal as
        a ``refused`` message with the gRPC status name). A request must arrive whole within
        ``body_timeout`` of its first byte and its answer be read as fast; a channel that
        breaks either rule, or the protocol, is closed (the worker then uses gRPC). A
        message that is not such a request closes the channel unanswered and detaches the
        region (:meth:`_bell_request`)."""
        def wanted() -> bool:
            return not self._stopped.is_set() and self._regions.get(rid) is region

        try:
            while wanted():
                if not shm.bell_wait(rfd, _BELL_IDLE_SECONDS):
                    # Nothing to serve for a while: is its worker still there? (A busy
                    # doorbell is checked by the shard's timer, _reap_regions.)
                    if not _alive(region):
                        raise shm.BellClosed("the worker is gone")
                    continue
                if not wanted():  # stopped, or detached, while waiting: serve nothing more
                    break
                body = shm.bell_receive(rfd, time.monotonic() + self.body_timeout, wanted)
                msg = self._bell_request(rid, body)  # anything else: closed, unanswered
                del body
                if not self._bell_slots.acquire(timeout=self.body_timeout):
                    reply = wire.encode("refused", {
                        "status": "UNAVAILABLE", "detail": f"shard {self.address} is busy: "
                        f"{self._max_workers} pushes in progress for {self.body_timeout:g} s"})
                else:
                    try:
                        reply = (self._bell_serve(msg) if wanted() else wire.encode(
                            "refused", {"status": "UNAVAILABLE",
                                        "detail": "the shard is stopping"}))
                    finally:
                        self._bell_slots.release()
                del msg
                shm.bell_send(wfd, reply, time.monotonic() + self.body_timeout, wanted)
        except shm.BellClosed:  # the worker closed its end (detached, or it died)
            with self._regions_lock:
                if self._regions.get(rid) is region:
                    del self._regions[rid]
        except _NotARequest as exc:  # not answered: a refusal could feed a crossed pipe
            with self._regions_lock:
                if self._regions.get(rid) is region:
                    del self._regions[rid]
            self._throttle("shm_bell_not_a_request", logging.WARNING, f"parameter-server "
                           f"shard {self.address}: closed a region's doorbell and detached "
                           f"the region, unanswered: {exc}")
        except shm.BellTimeout as exc:  # a body or a reply stuck: the channel is closed
            self._throttle("shm_bell_stuck", logging.WARNING, f"parameter-server shard "
                           f"{self.address}: closed a region's doorbell ({exc} within "
                           f"body_timeout={self.body_timeout:g} s); that worker uses gRPC")
        except OSError as exc:  # the pipes failed otherwise: that worker falls back to gRPC
            self._throttle("shm_bell_error", logging.WARNING, f"parameter-server shard "
                           f"{self.address}: closed a region's doorbell: {exc}")
        finally:
            os.close(rfd)
            os.close(wfd)
            with self._regions_lock:
                self._bells -= 1
                self._bell_fifos.difference_update(region.fifos)

    def _bell_request(self, rid: str, body: bytes) -> Message:
        """``body`` decoded, if it is a request a doorbell carries: a ``shm_push`` of region
        ``rid`` with no tensors. Anything else (a reply, another op, another region's push,
        bytes that do not decode) raises :class:`_NotARequest`: answering it with a refusal
        would write into a pipe that may be another doorbell's request pipe."""
        try:
            msg = self._decode(body)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is not a request
            raise _NotARequest(f"a message that does not decode ({str(exc)[:120]})") from None
        if msg.op != "shm_push" or msg.fields.get("region") != rid or msg.entries:
            raise _NotARequest(f"a doorbell carries only its own region's shm_push, got "
                               f"{msg.op[:40]!r}")
        return msg

    def _bell_serve(self, msg: Message) -> bytes:
        """One doorbell request (checked by :meth:`_bell_request`), served as
        :meth:`_serve_body` serves a gRPC call (refusals and failures as ``refused``)."""
        try:
            return self._shm_push(msg)
        except Exception as exc:  # noqa: BLE001 - a shard must survive any single request
            failure = self._refusal(exc)
        return wire.encode("refused", {"status": failure.status, "detail": failure.detail})

    def _purge_regions(self) -> None:
        """Forget the regions of workers that are gone (caller holds ``_regions_lock``): a
        worker that died never detached; its memory is freed once nothing maps it, and its
        doorbell thread (if any) ends when it next looks (within _BELL_IDLE_SECONDS)."""
        for rid, region in list(self._regions.items()):
            if not _alive(region):
                del self._regions[rid]

    async def _reap_regions(self) -> None:
        """Every :data:`_REAP_SECONDS`, drop the regions of dead workers, whether or not
        their doorbells are busy (a doorbell only checks its worker when idle, and a new
        attach only purges when it comes)."""
        while not self._stopped.is_set():
            await asyncio.sleep(_REAP_SECONDS)
            if self._regions:
                with self._regions_lock:
                    self._purge_regions()

    def _region(self, fields: dict[str, Any]) -> _Region:
        rid = fields.get("region")
        region = self._regions.get(rid) if isinstance(rid, str) else None
        if region is None:
            raise _err(f"unknown shared-memory region {str(rid)[:40]!r} on shard "
                       f"{self.address} (detached, or the shard restarted); the worker falls "
                       "back to gRPC", "FAILED_PRECONDITION")
        return region

    def _shm_push(self, msg: Message) -> bytes:
        """A push (and fetch) whose tensors are in the caller's region: the gradients are
        copied out of it first (the worker may write the region at any time; what is checked
        must be what is applied), then checked and applied exactly as a gRPC push, and the
        values after it written into the region under the tensors' locks."""
        region = self._region(msg.fields)
        max_staleness = _int(msg.fields, "max_staleness")
        pushed = msg.fields.get("push")
        if not isinstance(pushed, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _is_int(p[1])
                for p in pushed):
            raise _err("shm_push needs 'push': a list of [name, base version] pairs")
        names = [p[0] for p in pushed]
        if len(set(names)) != len(names):
            raise _err(f"shm_push: tensor {_first_repeat(names)!r} is pushed twice")
        fetch = _names(msg.fields, "fetch") or []
        for n in (*names, *fetch):
            if n not in region.grads:
                raise _err(f"shm_push: {n!r} is not in this region's layout",
                           "FAILED_PRECONDITION")
        entries = [Entry(n, region.grads[n].clone(), base) for n, base in pushed]
        checked = self._check_push(entries)
        wanted = [self._slot(n) for n in fetch]
        for s in wanted:
            if s.value.shape != region.values[s.name].shape or (
                    s.value.dtype != region.values[s.name].dtype):
                raise _err(f"shm_push: {s.name!r} changed shape or dtype since the region was "
                           "attached", "FAILED_PRECONDITION")
        results = self._apply_push(checked, max_staleness)
        versions: dict[str, int] = {}
        unique = sorted({id(s): s for s in wanted}.values(), key=lambda s: s.name)
        for s in unique:
            s.lock.acquire()
        try:
            for s in wanted:
                region.values[s.name].copy_(s.value)
                versions[s.name] = s.version
        finally:
            for s in reversed(unique):
                s.lock.release()
        self._shm_pushes += 1
        return wire.encode("pushed", {"results": results, "versions": versions})

    def _shm_detach(self, msg: Message) -> bytes:
        rid = msg.fields.get("region")
        with self._regions_lock:
            gone = self._regions.pop(rid, None) if isinstance(rid, str) else None
        return wire.encode("ok", {"detached": gone is not None})

    def _push_sparse(self, msg: Message) -> bytes:
        name = msg.fields.get("name")
        slot = self._slot(name if isinstance(name, str) else "")
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

        result = self._offer(slot, base, _int(msg.fields, "max_staleness"), grad)
        return wire.encode("pushed", {"results": [result]})

    async def _wait_version(self, msg: Message, context: grpc.aio.ServicerContext) -> bytes:
        target = _int(msg.fields, "min_version", 0) or 0
        per_name = msg.fields.get("min_versions")
        if per_name is not None and (not isinstance(per_name, dict) or not all(
                _is_int(v) for v in per_name.values())):
            raise _err("field 'min_versions' must be an object of name -> integer")
        timeout = min(_float(msg.fields, "timeout", 60.0), self.max_wait_seconds)
        left = context.time_remaining()
        if left is not None:  # answer (with reached=False) before the caller's deadline
            timeout = min(timeout, left - 0.5)
        slots = self._select(_names(msg.fields), "wait_version")
        fetch = _names(msg.fields, "fetch")
        wanted = slots if fetch is None else [self._slot(n) for n in fetch]
        self._check_reply("wait_version", [(s.name, s.value.nbytes) for s in wanted],
                          extra=sum(32 + len(s.name) for s in slots))
        goals = [(s, max(target, int((per_name or {}).get(s.name, 0)))) for s in slots]

        def reached() -> bool:
            return all(s.version >= goal for s, goal in goals)

        # A waiting call is a coroutine, not a thread: any number of waiters costs nothing.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        self._num_waiters += 1
        try:
            while not self._stopped.is_set() and not reached():
                changed = self._changed
                if changed is None or reached():  # re-check: a push may have just landed
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    break
        finally:
            self._num_waiters -= 1
        fields = {"reached": reached(), "versions": {s.name: s.version for s in slots}}
        # Values only for ``fetch`` (all by default): a caller that reads sparse rows on demand
        # needs the versions of an embedding, not its megabytes.
        return await self._offload(self._snapshot, wanted, "values", fields)

    def _elastic(self, msg: Message) -> bytes:
        a = _float(msg.fields, "moving_rate")
        if not 0.0 < a <= 1.0:
            raise _err(f"moving_rate must be in (0, 1], got {a}")
        checked: list[tuple[Slot, str, torch.Tensor]] = []
        for e in msg.entries:
            slot = self._slot(e.name)
            if slot.mode != "elastic":
                raise _err(f"tensor {e.name!r} is registered in mode {slot.mode!r}, not "
                           "'elastic'", "FAILED_PRECONDITION")
            rules.check_grad(slot, e.tensor, "elastic exchange")
            checked.append((slot, e.name, rules.to_slot_dtype(slot, e.tensor,
                                                              "elastic exchange")))
        self._check_reply("elastic", [(s.name, s.value.nbytes) for s, _, _ in checked])
        out = []
        for slot, name, x in checked:
            try:
                d, version = rules.elastic_exchange(slot, x, a)
            except WireError:
                self._throttle(f"refused:{slot.name}", logging.WARNING,
                               f"parameter-server shard {self.address}: refused an elastic "
                               f"exchange for {slot.name!r} that would make it non-finite "
                               f"({slot.refused} refused so far)")
                raise
            out.append(Entry(name, d, version))
        self._notify()
        return wire.encode("elastic", None, out)

    def _set_hyperparams(self, msg: Message) -> bytes:
        hyper = msg.fields.get("hyperparams")
        if not isinstance(hyper, dict) or "name" in hyper:
            raise _err("set_hyperparams needs a 'hyperparams' object (without 'name')")
        # Validate every new configuration the way torch would before changing any slot.
        planned = rules.plan_hyperparameters(self._select(_names(msg.fields),
                                                          "set_hyperparams"), hyper)
        rules.apply_hyperparameters(planned)
        return wire.encode("ok", {"changed": len(planned)})

    def _get_state(self, msg: Message) -> bytes:
        slots = self._select(_names(msg.fields), "get_state")
        # Counted and sized before any lock is taken (optimizer state read without its lock:
        # an estimate, checked again exactly under the locks below).
        self._check_reply("get_state", [(n, b) for s in slots for n, b in _state_sizes(s)])
        unique = sorted({id(s): s for s in slots}.values(), key=lambda s: s.name)
        for s in unique:
            s.lock.acquire()
        try:
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
            self._check_reply("get_state", [(e.name, e.tensor.nbytes) for e in entries],
                              extra=len(json.dumps(fields)))
            # Encoded under the locks: one consistent copy, no clone per tensor first.
            return wire.encode("state", fields, entries)
        finally:
            for s in reversed(unique):
                s.lock.release()

    def _set_state(self, msg: Message) -> bytes:
        metas = msg.fields.get("slots")
        if not isinstance(metas, list):
            raise _err("set_state needs a 'slots' list")
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

        with self._registry_lock:  # all or nothing, and the quota checked against the truth
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
                old = self._slots.get(name)
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
            self._check_quota("set_state", adding, freeing)
            new: list[Slot] = []
            for m, value, tensors, scalars in plans:
                slot = rules.make_slot(m["name"], value, m.get("mode", "async"), m.get("spec"),
                                       m.get("replicas_to_aggregate", 1))
                slot.version = _int(m, "version", 0) or 0
                rules.load_optimizer_state(slot, tensors, scalars)
                new.append(slot)
            for slot in new:
                self._slots[slot.name] = slot
            self._charged += adding - freeing
        self._notify()
        return wire.encode("ok", {"restored": [s.name for s in new]})

    def _shutdown(self, msg: Message) -> bytes:
        # Stop from another thread: stopping inside a handler would wait on this very call.
        threading.Thread(target=self.stop, args=(0.5,), daemon=True).start()
        return wire.encode("ok", {"stopping": True})


if sys.version_info >= (3, 11):
    async def _within(awaitable: Awaitable[T], timeout: float) -> T:
        """``await awaitable`` for at most ``timeout`` seconds (``asyncio.TimeoutError``
        after): :func:`asyncio.timeout`, which runs it in the calling task, where
        :func:`asyncio.wait_for` (Python < 3.12) wraps it in a task of its own, a few event-loop
        turns per call on the path of every request."""
        async with asyncio.timeout(timeout):
            return await awaitable
else:  # pragma: no cover - Python 3.10
    async def _within(awaitable: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(awaitable, timeout)


def _declared_bytes(metadata: Any) -> int | None | _Abort:
    """The total size a chunked request declares in its metadata (None: not chunked)."""
    for key, value in metadata or ():
        if key == wire.SIZE_METADATA_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if not (text.isascii() and text.isdigit() and len(text) <= 12):
                return _Abort("INVALID_ARGUMENT", f"metadata {wire.SIZE_METADATA_KEY!r} must "
                              f"be a byte count (decimal digits), got {text[:20]!r}")
            return int(text)
    return None


def _receive_buffer(size: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``size`` bytes for a chunked request, allocated without touching
    its pages: an anonymous mapping, which the kernel zero-fills page by page as the chunks
    are written. ``bytearray(size)`` zero-fills all of it at once, on the event loop: ~1 s
    for 1000 MiB, during which no other client is served."""
    if size < _MMAP_BYTES:
        return bytearray(size)
    return mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     mmap.PROT_READ | mmap.PROT_WRITE)


def _header_bytes(request: bytes | bytearray | mmap.mmap) -> int:
    """The JSON header length a request's frame prefix declares (0 if it has none)."""
    return int.from_bytes(request[8:12], "little") if len(request) >= 12 else 0


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def start_local_shards(num_shards: int, **kwargs: Any) -> tuple[list[ShardServer], list[str]]:
    """Start ``num_shards`` in-process shards on 127.0.0.1, free ports; returns (servers, addrs).

    Stop them with ``for s in servers: s.stop(0)``. In-process shards share the caller's
    torch intra-op threads; for throughput run each shard in a process of its own
    (:func:`serve`, ``python -m stratagem.ps.server``).
    """
    servers = [ShardServer("127.0.0.1", 0, **kwargs) for _ in range(num_shards)]
    for s in servers:
        s.start()
    return servers, [s.address for s in servers]


def serve(host: str = "127.0.0.1", port: int = 0, *, port_file: str | os.PathLike[str] | None
          = None, grace: float = 2.0, intra_op_threads: int | None = 1,
          parent_pid: int | None = None, **kwargs: Any) -> int:
    """Run one shard until SIGTERM/SIGINT or a ``shutdown`` call; returns the bound port.

    With ``port_file`` the bound port is written there (atomically) once the shard listens,
    so a launcher can pass ``port=0`` and learn the port. Tunes malloc for big messages
    (:func:`stratagem.ps.wire.tune_malloc`) and sets torch's intra-op threads to
    ``intra_op_threads`` (``None``: leave torch's default): call it in a process of its own.

    Why one intra-op thread: a shard's parallelism is across requests (the gRPC thread pool,
    per-tensor locks), and its tensor work is memory-bound elementwise optimizer steps on a
    few MB. With torch's default (an OpenMP team as wide as the machine) every push was split
    across all cores and the team's threads then spin-waited for the next step, burning the
    cores the gRPC threads, the other shards and the workers need: on 2 cores a 4 MB SGD step
    took 0.3-7 ms and 2 shards with 1 worker reached 0.26-0.45 of raw gRPC throughput (0.7-0.9
    with one thread, or with ``OMP_WAIT_POLICY=passive``). Raise it only for a shard alone on
    a big machine with few huge tensors and heavy optimizers.
    """
    if intra_op_threads is not None and (not _is_int(intra_op_threads) or intra_op_threads < 1):
        raise ValueError(f"intra_op_threads must be None or an integer >= 1, got "
                         f"{intra_op_threads!r}")
    wire.tune_malloc()
    if intra_op_threads is not None:
        torch.set_num_threads(intra_op_threads)
    server = ShardServer(host, port, **kwargs)
    bound = server.start()
    if port_file is not None:
        tmp = Path(f"{port_file}.tmp{os.getpid()}")
        tmp.write_text(f"{bound}\n")
        os.replace(tmp, port_file)
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        # Short waits so the main thread gets to run signal handlers promptly. With
        # parent_pid (set by the launcher) the shard also stops when its launcher is gone, e.g.
        # SIGKILLed: a shard must never outlive the job as an orphan.
        while not stop.is_set() and not server.wait(0.2):
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("launcher (pid %d) is gone; stopping the shard", parent_pid)
                break
    finally:
        server.stop(grace)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bound


def serve_from_args(args: argparse.Namespace, prog: str) -> int:
    """Run :func:`serve` from parsed :func:`stratagem.ps.flags.add_shard_arguments` flags; start-up errors
    (empty token, bad TLS material, port in use, bad limits) print one line and return 2."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if (args.tls_cert is None) != (args.tls_key is None):
        print(f"{prog}: error: TLS needs both --tls-cert and --tls-key, got only "
              f"{'--tls-cert' if args.tls_cert else '--tls-key'}", file=sys.stderr)
        return 2
    try:
        token = (ps_auth.read_token_file(args.token_file)
                 if args.token_file is not None else None)
        serve(args.host, args.port, port_file=args.port_file, token=token,
              tls_cert=args.tls_cert, tls_key=args.tls_key,
              max_message_bytes=args.max_message_bytes, max_bytes=args.max_bytes,
              max_inflight_bytes=getattr(args, "max_inflight_bytes", None),
              max_concurrent_streams=args.max_concurrent_streams,
              max_connection_age=args.max_connection_age, body_timeout=args.body_timeout,
              max_workers=args.threads, intra_op_threads=args.intra_op_threads or None,
              parent_pid=getattr(args, "parent_pid", None))
    except (ValueError, TypeError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stratagem.ps.server",
                                description="Run one stratagem parameter-server shard.")
    add_shard_arguments(p, port_required=False)
    p.add_argument("--parent-pid", type=int, default=None,
                   help="stop when this process (the launcher) is no longer our parent")
    args = p.parse_args(argv)
    return serve_from_args(args, p.prog)


if __name__ == "__main__":
    sys.exit(main())
