"""A parameter-server shard: the service on its tensors behind its transports.

Lineage: TensorFlow's ``ps`` job. A shard is made of parts, each in a module of its own:

- :mod:`stratagem.ps.service`: the operations on the tensors (slots, quota, reply bounds),
  with no transport in them; what an operation does to a tensor (Downpour SGD,
  ``SyncReplicasOptimizer`` aggregation, ``DropStaleGradientOptimizer``, the EASGD elastic
  exchange, optimizer slots and hyperparameters) is :mod:`stratagem.ps.rules`;
- this module: :class:`ShardServer`, the gRPC transport (``grpc.aio``: binding,
  authentication by token and TLS, chunked receive, tensor threads, ``wait_version``'s
  waiting, memory trimming) and what composes the parts;
- :mod:`stratagem.ps.admission`: bytes in flight, big requests one after another, deadlines;
- :mod:`stratagem.ps.serve_shm`: the same-host transport (shared-memory regions and their
  doorbells).

Operations (the ``op`` of a :mod:`stratagem.ps.wire` message): ``health``, ``register``,
``pull``, ``pull_rows``, ``push``, ``push_sparse``, ``wait_version``, ``elastic``,
``set_hyperparams``, ``get_state``, ``set_state``, ``shutdown``; and for workers on the same
machine ``shm_attach``, ``shm_push`` and ``shm_detach``.

Run one shard as a process with ``python -m stratagem.ps.server --host H --port P
[--port-file PATH]``; it exits 0 on SIGTERM/SIGINT or a ``shutdown`` call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import mmap
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

import torch

from stratagem._rendezvous import bracket_host
from stratagem.ps import auth as ps_auth
from stratagem.ps import rules, wire
from stratagem.ps.admission import Admission, declared_bytes, receive_buffer, within
from stratagem.ps.flags import DEFAULT_MAX_BYTES, add_shard_arguments
from stratagem.ps.rpc import grpc
from stratagem.ps.rules import is_int as _is_int
from stratagem.ps.serve_shm import REAP_SECONDS, SameHost
from stratagem.ps.service import INLINE_BYTES, Abort, ShardService
from stratagem.ps.wire import Message, WireError
from stratagem.validation import check_int, check_number

__all__ = ["ShardServer", "serve", "start_local_shards", "main",
           "serve_from_args", "DEFAULT_MAX_BYTES"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Refusals that suggest a misconfigured or hostile peer (logged as warnings, rate-limited).
_LOUD = frozenset({"UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "INTERNAL"})
#: A request whose JSON header is longer than this is decoded on a tensor thread.
_INLINE_HEADER_BYTES = 64 << 10
#: After a request of at least this size, freed memory is handed back to the kernel
#: (``malloc_trim``, once a burst of them is over, off the loop): gRPC receives a message in many
#: small blocks that glibc would otherwise keep resident after a burst of big bodies.
_TRIM_BYTES = 16 << 20


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


class ShardServer:
    """One parameter-server shard: a :class:`~stratagem.ps.service.ShardService` served over
    gRPC and, to workers on the same machine, over shared memory
    (:class:`~stratagem.ps.serve_shm.SameHost`). ``service``, ``admission`` and ``shm`` are
    those parts.

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
    ``max_bytes`` in total; request bytes held at once may not exceed ``max_inflight_bytes``
    (:class:`~stratagem.ps.admission.Admission`).

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
            check_int(name, value, minimum=low)
        for name, fvalue in (("max_wait_seconds", max_wait_seconds),
                             ("max_connection_age", max_connection_age),
                             ("body_timeout", body_timeout)):
            check_number(name, fvalue, low=0, low_open=True, finite=True,
                         fix="pass a number of seconds")
        self.host, self.port = host, port
        self._token = token.encode() if token else None
        self._tls: tuple[bytes, bytes] | None = None
        if tls_cert is not None and tls_key is not None:
            cert = ps_auth.read_pem(tls_cert, "certificate")
            key = ps_auth.read_pem(tls_key, "private key")
            ps_auth.check_tls_pair(cert, key)
            self._tls = (key, cert)
        limits = wire.Limits(max_message_bytes=max_message_bytes)
        self.admission = Admission(2 * limits.max_message_bytes
                                   if max_inflight_bytes is None else max_inflight_bytes)
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
        self.service = ShardService(limits=limits, max_bytes=max_bytes,
                                    address=self.address)
        self.service.on_change = self._notify
        # Stop from another thread: stopping inside a handler would wait on this very call.
        self.service.on_shutdown = lambda: threading.Thread(
            target=self.stop, args=(0.5,), daemon=True).start()
        self.service.health_fields.append(lambda: {"calls_in_flight": self._in_flight})
        self.shm = SameHost(self.service, max_workers=max_workers, body_timeout=self.body_timeout)
        self._trim_due = 0.0
        self._trim_pending = False
        self._server: grpc.aio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._loop: _LoopThread | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self._changed: asyncio.Event | None = None
        self._num_waiters = 0
        self._in_flight = 0  # authenticated calls being served (on the loop thread only)
        self._busy = 0  # calls handed to the tensor threads and not back (loop thread only)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{bracket_host(self.host)}:{self.port}"

    @property
    def limits(self) -> wire.Limits:
        """The message limits (size, tensors, header) the shard decodes and answers within."""
        return self.service.limits

    @limits.setter
    def limits(self, value: wire.Limits) -> None:
        self.service.limits = value

    @property
    def max_inflight_bytes(self) -> int:
        return self.admission.max_inflight_bytes

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
        self.service.address = self.address
        log.info("%s", self.describe())
        return port

    async def _start_async(self) -> tuple[grpc.aio.Server, int]:
        self._changed = asyncio.Event()
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
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return server, port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; in-flight calls get ``grace`` seconds to finish."""
        server, self._server = self._server, None
        self.service.stopped.set()
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
        return self.service.stopped.wait(timeout)

    def __enter__(self) -> ShardServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)

    async def _reap(self) -> None:
        """Every :data:`~stratagem.ps.serve_shm.REAP_SECONDS`, drop the shared-memory regions
        of dead workers (:meth:`stratagem.ps.serve_shm.SameHost.reap`)."""
        while not self.service.stopped.is_set():
            await asyncio.sleep(REAP_SECONDS)
            self.shm.reap()

    # -- the gRPC call --------------------------------------------------------------------

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
        self.service.throttle(f"{status}", level,
                              f"parameter-server shard {self.address} refused a call from "
                              f"{peer}: {status}: {detail[:300]}")

    async def _handle(self, request_iterator: Any, context: grpc.aio.ServicerContext
                      ) -> bytes | Abort:
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
        if isinstance(reply, Abort):
            self._refused(reply.status, peer, reply.detail)
            await context.abort(getattr(grpc.StatusCode, reply.status), reply.detail)
        return reply

    async def _serve_call(self, context: grpc.aio.ServicerContext) -> bytes | Abort:
        """The reply, or the refusal as a value: never a raised exception here, because an
        exception's traceback would keep this frame (and the request's megabytes) alive in
        a reference cycle until the next garbage collection."""
        adm = self.admission
        declared = declared_bytes(context.invocation_metadata())
        if isinstance(declared, Abort):
            return declared
        if declared is not None:  # chunked: admitted by its declared size before it is read
            if declared > self.limits.max_message_bytes:
                return Abort("RESOURCE_EXHAUSTED",
                             f"the request declares {declared} bytes, above this shard's "
                             f"max_message_bytes={self.limits.max_message_bytes}. Fix: use "
                             "more shards or a partitioner to split big tensors")
            try:
                if adm.must_wait(declared):
                    await within(adm.admit_big(declared), self.body_timeout)
                else:  # the usual case: admitted at once, no timer and no task
                    adm.take_big(declared)
            except asyncio.TimeoutError:
                return Abort("DEADLINE_EXCEEDED", f"request not admitted within body_timeout="
                             f"{self.body_timeout:g} s (bigger requests held the shard)")
            try:
                return await self._serve_chunked(context, declared)
            finally:
                adm.release_big(declared)
        try:  # one message, which gRPC caps at wire.REQUEST_CHUNK_BYTES
            request = await within(context.read(), self.body_timeout)
        except asyncio.TimeoutError:
            return Abort("DEADLINE_EXCEEDED", f"request body not received within "
                         f"body_timeout={self.body_timeout:g} s")
        if not isinstance(request, bytes):
            return Abort("INVALID_ARGUMENT", "the call carried no request message")
        size = len(request)
        refused = adm.over(size)
        if refused is not None:
            del request  # dropped at once: that is the point of the bound
            return refused
        adm.inflight_bytes += size
        try:
            return await self._serve_body(request, context)
        finally:
            adm.inflight_bytes -= size
            if size >= _TRIM_BYTES:
                self._trim_soon()

    async def _serve_chunked(self, context: grpc.aio.ServicerContext, declared: int
                             ) -> bytes | Abort:
        adm = self.admission
        refused = adm.over(declared)
        if refused is not None:
            return refused
        adm.inflight_bytes += declared
        try:
            try:
                body = await within(self._receive(context, declared), self.body_timeout)
            except asyncio.TimeoutError:
                return Abort("DEADLINE_EXCEEDED", f"request body not received within "
                             f"body_timeout={self.body_timeout:g} s")
            if isinstance(body, Abort):
                return body
            return await self._serve_body(body, context)
        finally:
            adm.inflight_bytes -= declared
            if declared >= _TRIM_BYTES:
                self._trim_soon()

    async def _receive(self, context: grpc.aio.ServicerContext, declared: int
                       ) -> bytearray | mmap.mmap | Abort:
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
                return Abort("INVALID_ARGUMENT", "the call carried no request message")
            if got + len(chunk) > declared:
                return Abort("INVALID_ARGUMENT",
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
            buf = receive_buffer(declared)
            buf[:got] = first
            del first
            head = bytearray()
        if got != declared or buf is None:
            return Abort("INVALID_ARGUMENT",
                          f"the request ended after {got} of the {declared} bytes its "
                          f"{wire.SIZE_METADATA_KEY!r} metadata declares")
        return buf


    async def _check_header(self, head: bytes | bytearray, head_end: int) -> Abort | None:
        """Refuse a chunked request by its header, before the rest of it is received: a
        malformed header or unknown op, or a ``register`` that cannot fit the quota
        (:meth:`~stratagem.ps.service.ShardService.register_cost_from_header`). A long
        header is parsed on a tensor thread, not the loop."""
        try:
            if head_end - 12 <= _INLINE_HEADER_BYTES:
                op, _, metas = wire.decode_header(head, self.limits)
            else:
                op, _, metas = await self._offload(wire.decode_header, head, self.limits)
            self.service.check_op(op)
        except WireError as exc:
            return Abort(exc.status, str(exc))
        if op != "register":
            return None
        return self.service.register_cost_from_header(metas)

    async def _serve_body(self, request: bytes | bytearray | mmap.mmap,
                          context: grpc.aio.ServicerContext) -> bytes | Abort:
        assert self._loop is not None and self._executor is not None
        svc = self.service
        try:
            # Never inline beside doorbell threads: they take tensor locks at any time.
            if (self._busy == 0 and self.shm.bells == 0 and len(request) <= INLINE_BYTES
                    and _header_bytes(request) <= _INLINE_HEADER_BYTES):
                # A small call: decode here; run it here too if it is small work (see
                # INLINE_BYTES). With no tensor thread busy no tensor lock is held, and none
                # can be taken until this returns (only the loop hands out work): no waiting.
                msg = svc.decode(request)
                del request
                if svc.inline_bytes(msg) <= INLINE_BYTES:
                    out = svc.dispatch(msg)
                else:
                    out = await self._offload(svc.dispatch, msg)
            else:
                # One hop to a tensor thread: decode and run the op there (the loop only moves
                # bytes); wait_version comes back decoded and waits on the loop.
                out = await self._offload(svc.run, request)
                del request
            if isinstance(out, Message):
                return await self._wait_version(out, context)
            return out
        except Exception as exc:  # noqa: BLE001 - a shard must survive any single request
            return svc.refusal(exc)

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tensor thread; counts the calls out (see ``INLINE_BYTES``)."""
        assert self._executor is not None
        self._busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._busy -= 1

    async def _wait_version(self, msg: Message, context: grpc.aio.ServicerContext) -> bytes:
        """Wait (a coroutine, not a thread: any number of waiters costs nothing) until the
        versions a ``wait_version`` names reach its goals, its timeout passes or the shard
        stops; then answer (:meth:`~stratagem.ps.service.ShardService.finish_wait`)."""
        wait = self.service.plan_wait(msg, self.max_wait_seconds, context.time_remaining())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait.timeout
        self._num_waiters += 1
        try:
            while not self.service.stopped.is_set() and not wait.reached():
                changed = self._changed
                if changed is None or wait.reached():  # re-check: a push may have just landed
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
        return await self._offload(self.service.finish_wait, wait)

    def _notify(self) -> None:
        # Called from tensor threads after a version changed; wakes the waiting coroutines.
        if self._num_waiters and self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        ev = self._changed
        if ev is not None:
            self._changed = asyncio.Event()
            ev.set()

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
        if self._executor is not None and not self.service.stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the executor is shut down: stopping
                self._executor.submit(wire.trim_malloc)


def _header_bytes(request: bytes | bytearray | mmap.mmap) -> int:
    """The JSON header length a request's frame prefix declares (0 if it has none)."""
    return int.from_bytes(request[8:12], "little") if len(request) >= 12 else 0


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
