"""Worker side of the parameter-server runtime, the transport: gRPC channels to the shards.

:class:`PSClient` sends :mod:`stratagem.ps.wire` messages to the shards (a deadline on every
call, concurrent calls to different shards, byte and time accounting) and maps gRPC failures
to stratagem errors; :class:`PSFuture` is a set of calls in flight. What the messages *mean*
(which tensor lives where, pushes, pulls, versions) is :mod:`stratagem.ps.table`.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from stratagem.errors import ParameterServerUnavailable, StratagemError
from stratagem.ps import auth as ps_auth
from stratagem.ps import wire
from stratagem.ps.addresses import check_address
from stratagem.ps.rpc import grpc
from stratagem.ps.wire import Entry, Message
from stratagem.validation import check_timeout

__all__ = ["AfterCall", "PSClient", "PSFuture", "RemoteError", "Request", "refused_request"]

T = TypeVar("T")
U = TypeVar("U")
#: One call: (shard index, op, fields, entries).
Request = tuple[int, str, "Mapping[str, Any] | None", Sequence[Entry]]

_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED)
#: The fix every "shard unavailable" error ends with.
_REACH_HINT = ("check that the shard process is running and reachable (STRATAGEM_PS_ADDRS), "
               "or raise timeout=")


#: What :meth:`PSClient.submit` calls when a call is over: ``(reply, None)`` or ``(None, error)``.
AfterCall = Callable[["bytes | Message | None", "BaseException | None"], None]
#: A request's own channel instead of gRPC (:meth:`PSClient.submit`'s ``direct``): called
#: with the encoded request and its deadline (``time.monotonic()``), returns the decoded
#: reply, or None when it does not take that request (it is then sent over gRPC), or raises
#: :class:`RemoteError` / ``ParameterServerUnavailable`` as a gRPC call would.
DirectCall = Callable[[bytes, float], "Message | None"]

#: Refusals a shard answers after reading the request and before acting on any of it.
_REFUSED_REQUEST = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)


def refused_request(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a shard's refusal of a request as malformed or over a limit: the
    shard answered, so the call is over and nothing of it is still running there (unlike a
    deadline or a lost connection, after which the shard may still be working on it)."""
    if isinstance(exc, RemoteError):  # answered through a direct channel (a doorbell)
        return exc.code in {c.name for c in _REFUSED_REQUEST}
    return isinstance(exc, grpc.RpcError) and exc.code() in _REFUSED_REQUEST


def _refused_stream(exc: grpc.RpcError) -> bool:
    """Whether the shard refused the call's stream before reading it (HTTP/2 error code 7,
    REFUSED_STREAM), as gRPC reports it."""
    details = exc.details() or ""
    return (exc.code() == grpc.StatusCode.UNAVAILABLE and "RST_STREAM" in details
            and "error code 7" in details)


class RemoteError(StratagemError):
    """A shard answered but refused the request; ``code`` is the gRPC status name."""

    def __init__(self, message: str, *, code: str, address: str) -> None:
        super().__init__(message)
        self.code, self.address = code, address


class _Task:
    """One call handed to :class:`_CallThreads`: run once, by a call thread or by the thread
    that waits for it, whichever claims it first."""

    __slots__ = ("future", "_fn", "_args", "_claimed", "_lock")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 lock: threading.Lock) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._fn: Callable[..., Any] | None = fn
        self._args: tuple[Any, ...] = args
        self._claimed = False
        self._lock = lock

    def claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def run(self) -> None:
        """Run the claimed call, its outcome into :attr:`future`."""
        fn, args = self._fn, self._args
        self._fn, self._args = None, ()  # no request bytes kept alive once it ran
        assert fn is not None
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                self.future.set_exception(exc)

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Any:
        """The call's reply. A call no thread has started yet runs here, in the waiting
        thread: one blocking call then costs no hand-off to a call thread and back (two
        thread wake-ups, each a scheduling delay on a busy machine)."""
        if self.claim():
            self.run()
        return self.future.result(timeout)


class _CallThreads:
    """Long-lived daemon threads that run blocking gRPC calls for one client.

    ``stub.future()`` starts a new thread (gRPC's "channel spin" thread) whenever a call is
    issued while none is in flight, i.e. once per step of a training loop: measured here at
    515 us of client CPU per 64 KiB call, against 263 us for a blocking call and 332 us for a
    blocking call run on a thread that already exists. Threads are started on demand (one per
    concurrent call, at most ``max_threads``) and then reused; ``close`` lets them finish.
    A call that no thread has started when its result is asked for runs in the asking thread
    (:meth:`_Task.result`), so calls still go out concurrently and a lone one costs no
    hand-off. Not a ``ThreadPoolExecutor``: its workers are joined at interpreter exit, so a
    call still in flight there would hold the exit up to its deadline (gRPC's own threads
    never did).
    """

    def __init__(self, max_threads: int = 32) -> None:
        self._max = max_threads
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Task:
        if self._pid != os.getpid():  # a forked child: the parent's threads (and a lock one
            self._lock = threading.Lock()  # of them may have held) are not here
            self._reset()
        with self._lock:
            if self._closed:
                raise RuntimeError("this parameter-server client is closed")
            task = _Task(fn, args, self._lock)
            self._queue.put(task)
            if self._idle < self._queue.qsize() and self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name="stratagem-ps-call",
                                 daemon=True).start()
        return task

    def _work(self) -> None:
        q = self._queue
        while True:
            with self._lock:
                self._idle += 1
            task = q.get()
            with self._lock:
                self._idle -= 1
            if task is None:
                return
            if task.claim():
                task.run()
            del task  # no request bytes kept alive while idle

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for _ in range(self._threads):
                self._queue.put(None)


class PSFuture(Generic[T]):
    """Calls in flight to one or more shards; :meth:`result` waits (bounded by the deadline)."""

    def __init__(self, client: PSClient, calls: list[tuple[int, str, Any, float]],
                 finish: Callable[[list[Message]], T], t_issue: float) -> None:
        self._client, self._calls, self._finish = client, calls, finish
        self._seconds = t_issue
        self._lock = threading.Lock()
        self._value: tuple[T] | None = None

    def done(self) -> bool:
        return all(c[2].done() for c in self._calls)

    def map(self, fn: Callable[[T], U]) -> PSFuture[U]:
        """The same calls, with ``fn`` applied to what :meth:`result` returns (e.g. one field
        of a combined reply)."""
        finish = self._finish
        return PSFuture(self._client, self._calls, lambda msgs: fn(finish(msgs)),
                        self._seconds)

    def result(self) -> T:
        with self._lock:
            if self._value is None:
                t0 = time.perf_counter()
                try:
                    msgs = [self._client._receive(*c) for c in self._calls]
                finally:
                    self._client._account(0, 0, self._seconds + time.perf_counter() - t0)
                self._value = (self._finish(msgs),)
            return self._value[0]


class PSClient:
    """gRPC connections to the parameter-server shards.

    Failure behaviour: a shard that does not answer within ``timeout`` seconds, or whose
    connection is down, raises :class:`stratagem.errors.ParameterServerUnavailable` naming its
    ``host:port`` (no call waits longer than its deadline); a shard that refuses a request
    raises :class:`RemoteError` with the gRPC status and the shard's explanation.
    """

    def __init__(self, addresses: Sequence[str], *, token: str | None = None,
                 tls_root_cert: bytes | str | os.PathLike[str] | None = None,
                 tls_server_name: str | None = None, timeout: float = 60.0,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
                 allow_plaintext: bool | None = None) -> None:
        if isinstance(addresses, str) or not addresses:
            raise ValueError(f"addresses must be a non-empty list of 'host:port', got "
                             f"{addresses!r}; e.g. STRATAGEM_PS_ADDRS.split(',')")
        for a in addresses:
            check_address(a)
        check_timeout("timeout", timeout)
        if allow_plaintext is not None and not isinstance(allow_plaintext, bool):
            raise ValueError(f"allow_plaintext must be None, True or False, got "
                             f"{allow_plaintext!r}")
        self.addresses = list(addresses)
        self.timeout = float(timeout)
        self.limits = wire.Limits(max_message_bytes=max_message_bytes)
        # The shard's token: token=, else STRATAGEM_PS_TOKEN, else STRATAGEM_PS_TOKEN_FILE
        # (what launcher-started shards hand their workers); blank is an error.
        token = ps_auth.resolve_token(token)
        self._metadata = ((wire.TOKEN_METADATA_KEY, token),) if token else None
        # A connection of its own: gRPC shares one connection between channels to the same
        # address, so several clients in a process (worker threads, a benchmark) would pile
        # their calls onto one connection, past the shard's streams-per-connection cap.
        options = [*wire.channel_options(max_message_bytes),
                   ("grpc.use_local_subchannel_pool", 1)]
        # Strategies build their client from the environment, like the token: a job whose
        # shards serve TLS exports the root certificate (and server name) to every worker.
        if tls_root_cert is None:
            tls_root_cert = os.environ.get("STRATAGEM_PS_TLS_ROOT_CERT") or None
        if tls_server_name is None:
            tls_server_name = os.environ.get("STRATAGEM_PS_TLS_SERVER_NAME") or None
        ps_auth.check_token_transport(self.addresses, token=token is not None,
                                      tls=tls_root_cert is not None,
                                      allow_plaintext=allow_plaintext)
        if tls_root_cert is not None:
            root = ps_auth.read_pem(tls_root_cert, "root certificate (tls_root_cert / "
                                              "STRATAGEM_PS_TLS_ROOT_CERT)")
            creds = grpc.ssl_channel_credentials(root_certificates=root)
            if tls_server_name:
                options = [*options, ("grpc.ssl_target_name_override", tls_server_name)]
            self._channels = [grpc.secure_channel(a, creds, options=options)
                              for a in self.addresses]
        else:
            self._channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        # request_serializer/response_deserializer None: raw bytes both ways.
        self._stubs = [ch.unary_unary(wire.METHOD) for ch in self._channels]
        # The same method, for a request longer than wire.REQUEST_CHUNK_BYTES: sent in chunks
        # with its length declared, so the shard admits it before receiving it (wire docs).
        self._chunked = [ch.stream_unary(wire.METHOD) for ch in self._channels]
        self._threads = _CallThreads()
        self._closers: list[Callable[[], None]] = []
        self._stats_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_seconds = 0.0
        self.num_calls = 0
        self._stats_seen: tuple[int, int, float] = (0, 0, 0.0)

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    # -- plumbing -------------------------------------------------------------------------

    def _account(self, sent: int, received: int, seconds: float, calls: int = 0) -> None:
        with self._stats_lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.comm_seconds += seconds
            self.num_calls += calls

    def _call(self, shard: int, data: bytes, due: float) -> bytes:
        """One blocking call, on a call thread; its deadline counts from ``submit``.

        A stream the shard refused (more calls in flight on this connection than its
        ``max_concurrent_streams``; gRPC's client does not wait for a free stream) is sent
        again after a short pause, until the deadline: HTTP/2's REFUSED_STREAM means the shard
        did nothing with it, so a push is never applied twice."""
        pause = 0.002
        while True:
            timeout = max(0.001, due - time.monotonic())
            try:
                reply: bytes
                if len(data) > wire.REQUEST_CHUNK_BYTES:
                    md = (*(self._metadata or ()), (wire.SIZE_METADATA_KEY, str(len(data))))
                    reply = self._chunked[shard](wire.request_chunks(data), timeout=timeout,
                                                 metadata=md)
                else:
                    reply = self._stubs[shard](data, timeout=timeout, metadata=self._metadata)
                return reply
            except grpc.RpcError as exc:
                if not _refused_stream(exc) or time.monotonic() + pause >= due:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _call_then(self, shard: int, data: bytes, due: float, after: AfterCall) -> bytes:
        """:meth:`_call`, then ``after(reply, None)`` in the same thread, or ``after(None,
        error)`` when the call failed: what must happen as soon as the call is over, whoever
        waits for it."""
        try:
            reply = self._call(shard, data, due)
        except BaseException as exc:
            after(None, exc)
            raise
        after(reply, None)
        return reply

    def _direct_then(self, channel: DirectCall, shard: int, data: bytes, due: float,
                     after: AfterCall | None) -> Message | bytes:
        """:meth:`_call_then` through the request's own channel (or gRPC, where the channel
        does not take it)."""
        try:
            reply: Message | bytes | None = channel(data, due)
            if reply is None:
                reply = self._call(shard, data, due)
        except BaseException as exc:
            if after is not None:
                after(None, exc)
            raise
        if after is not None:
            after(reply, None)
        return reply

    def account(self, sent: int, received: int) -> None:
        """Count bytes moved outside gRPC (a shared-memory region) as sent and received, so
        ``bytes_sent`` covers every byte a step moves between the worker and its shards."""
        self._account(sent, received, 0.0)

    def _receive(self, shard: int, op: str, fut: Any, timeout: float) -> Message:
        addr = self.addresses[shard]
        try:
            # The call itself ends at its deadline; the margin only guards against a call
            # thread that never ran it (it cannot, short of the process being torn down).
            data = fut.result(timeout=timeout + 30.0)
            if isinstance(data, Message):  # a direct channel's reply, decoded there
                self._account(0, data.nbytes, 0.0)
                return data
        except concurrent.futures.TimeoutError:
            raise ParameterServerUnavailable(
                f"parameter-server shard {addr} did not answer {op!r} within {timeout:g} s "
                "(the call never completed); raise timeout= or check the worker process",
                address=addr) from None
        except grpc.RpcError as exc:
            code = exc.code()
            if code in _UNAVAILABLE:
                what = (f"did not answer {op!r} within {timeout:g} s"
                        if code == grpc.StatusCode.DEADLINE_EXCEEDED else
                        f"could not be reached for {op!r}")
                raise ParameterServerUnavailable(
                    f"parameter-server shard {addr} {what} ({code.name}: {exc.details()}); "
                    f"{_REACH_HINT}", address=addr) from None
            raise RemoteError(f"parameter-server shard {addr} refused {op!r}: {code.name}: "
                              f"{exc.details()}", code=code.name, address=addr) from None
        self._account(0, len(data), 0.0)
        try:
            return wire.decode(data, self.limits)
        except wire.WireError as exc:
            raise RemoteError(f"parameter-server shard {addr} sent a malformed reply to {op!r}: "
                              f"{exc}", code="DATA_LOSS", address=addr) from None

    def submit(self, requests: Sequence[Request], finish: Callable[[list[Message]], T],
               *, timeout: float | None = None,
               after: Sequence[AfterCall | None] | None = None,
               direct: Sequence[DirectCall | None] | None = None
               ) -> PSFuture[T]:
        """Send all ``requests`` at once (concurrently); ``finish`` maps the replies.

        ``after`` (one per request, or None): called with the raw reply or the error, in the
        thread that made the call, as soon as it is over (see :meth:`_call_then`).
        ``direct`` (one per request, or None): a channel of the request's own that carries
        it instead of gRPC (a same-host shard's doorbell, :class:`stratagem.ps.shm.Bell`)."""
        t0 = time.perf_counter()
        deadline = self.timeout if timeout is None else timeout
        calls = []
        sent = 0
        hooks = list(after) if after is not None else [None] * len(requests)
        channels = list(direct) if direct is not None else [None] * len(requests)
        for (shard, op, fields, entries), hook, channel in zip(requests, hooks, channels,
                                                               strict=True):
            if len(entries) > self.limits.max_tensors:
                raise ValueError(f"{op!r} to shard {self.addresses[shard]} holds {len(entries)} "
                                 f"tensors, above max_tensors={self.limits.max_tensors} per "
                                 "message; use more shards, or fewer tensors per call")
            data = wire.encode(op, fields, entries)
            if len(data) > self.limits.max_message_bytes:
                raise ValueError(f"{op!r} to shard {self.addresses[shard]} is {len(data)} bytes, "
                                 f"above max_message_bytes={self.limits.max_message_bytes}; "
                                 "use more shards or a partitioner to split big tensors")
            sent += len(data)
            due = time.monotonic() + deadline
            if channel is not None:
                fut = self._threads.submit(self._direct_then, channel, shard, data, due, hook)
            elif hook is None:
                fut = self._threads.submit(self._call, shard, data, due)
            else:
                fut = self._threads.submit(self._call_then, shard, data, due, hook)
            del data
            calls.append((shard, op, fut, deadline))
        self._account(sent, 0, 0.0, len(calls))
        return PSFuture(self, calls, finish, time.perf_counter() - t0)

    def call(self, shard: int, op: str, fields: Mapping[str, Any] | None = None,
             entries: Sequence[Entry] = (), *, timeout: float | None = None) -> Message:
        """One call to one shard."""
        return self.submit([(shard, op, fields, entries)], lambda m: m[0],
                           timeout=timeout).result()

    # -- whole-cluster operations ---------------------------------------------------------

    def health(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Each shard's health fields (tensor count, bytes, versions, dropped gradients)."""
        fut = self.submit([(i, "health", None, ()) for i in range(self.num_shards)],
                          lambda ms: [m.fields for m in ms], timeout=timeout)
        return fut.result()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every shard answers ``health`` (shards may start after the workers)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.health(timeout=max(0.1, min(2.0, remaining)))
                return
            except ParameterServerUnavailable as exc:
                if remaining <= 0:
                    # Name the whole wait, not the last short attempt's deadline.
                    raise ParameterServerUnavailable(
                        f"parameter-server shard {exc.address} did not answer within "
                        f"{timeout:g} s of waiting for the shards to start (last attempt: "
                        f"{exc}); {_REACH_HINT}", address=exc.address) from None
                time.sleep(min(0.1, max(0.0, remaining)))

    def shutdown(self, shards: Sequence[int] | None = None) -> None:
        """Ask shards to stop (needs the token when the shards use one)."""
        idx = range(self.num_shards) if shards is None else shards
        self.submit([(i, "shutdown", None, ()) for i in idx], lambda ms: None).result()

    def stats(self) -> dict[str, float]:
        with self._stats_lock:
            return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                    "comm_seconds": self.comm_seconds, "calls": self.num_calls}

    def stats_delta(self) -> tuple[int, int, float]:
        """``(bytes_sent, bytes_received, comm_seconds)`` since the previous call: what a
        strategy folds into its own counters (meant for the client's one owner)."""
        with self._stats_lock:
            now = (self.bytes_sent, self.bytes_received, self.comm_seconds)
            seen, self._stats_seen = self._stats_seen, now
        return now[0] - seen[0], now[1] - seen[1], now[2] - seen[2]

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` first thing in :meth:`close`, while the channels are still open (a
        table detaching its shared-memory regions); its errors are ignored."""
        self._closers.append(fn)

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for fn in closers:
            try:
                fn()
            except Exception:  # noqa: BLE001 - closing must not fail on a dead shard
                pass
        self._threads.close()
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
