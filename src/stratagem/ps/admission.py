"""Admission for a parameter-server shard's transport: request bytes in flight, big requests
taken one after another, and deadlines.

A shard holds at most ``max_inflight_bytes`` of requests at once (received, not yet
answered): a request that would pass it is refused (``RESOURCE_EXHAUSTED``) and dropped at
once. A request longer than :data:`stratagem.ps.wire.REQUEST_CHUNK_BYTES` comes in chunks
with its size declared up front; it is charged that size before a byte of it is read, and
such requests are received and served at once only up to ``max_receiving_bytes`` (a quarter
of the bound; one request always may): the others wait, unread, within the body deadline.
No transport code here: the gRPC transport (:mod:`stratagem.ps.server`) asks, and holds the
bytes.
"""

from __future__ import annotations

import asyncio
import mmap
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from stratagem.ps import wire
from stratagem.ps.service import Abort
from stratagem.validation import check_int

__all__ = ["Admission", "declared_bytes", "receive_buffer", "within"]

T = TypeVar("T")

#: A chunked request at least this long is received into an anonymous mapping, not a
#: bytearray (see receive_buffer).
_MMAP_BYTES = 1 << 20


class Admission:
    """The bytes of requests a shard holds, and the order big ones are taken in. Used from
    the transport's event loop only (no locks)."""

    def __init__(self, max_inflight_bytes: int) -> None:
        #: Bound on the request bytes held at once (received, not yet answered).
        self.max_inflight_bytes = check_int("max_inflight_bytes", max_inflight_bytes,
                                            minimum=1024, fix="pass e.g. 2 * max_message_bytes")
        self.inflight_bytes = 0
        #: The bytes of chunked requests received and served at once (one request always
        #: may; the others wait, unread): see :meth:`admit_big`.
        self.max_receiving_bytes = max_inflight_bytes // 4
        self.receiving_bytes = 0
        self._received: asyncio.Event | None = None

    def over(self, size: int) -> Abort | None:
        """The refusal of a request of ``size`` bytes that would pass the in-flight bound."""
        if self.inflight_bytes + size <= self.max_inflight_bytes:
            return None
        return Abort("RESOURCE_EXHAUSTED",
                     f"the shard already holds {self.inflight_bytes} bytes of requests "
                     f"in progress; this one ({size} bytes) would pass its bound "
                     f"max_inflight_bytes={self.max_inflight_bytes}. Retry later, or "
                     "send smaller requests")

    def must_wait(self, declared: int) -> bool:
        """Whether a chunked request of ``declared`` bytes must wait to be admitted."""
        return bool(self.receiving_bytes
                    and self.receiving_bytes + declared > self.max_receiving_bytes)

    async def admit_big(self, declared: int) -> None:
        """Wait until a chunked request of ``declared`` bytes may be received and served.

        Peak shard memory: gRPC's receive path costs about three times the message it is
        assembling, so requests longer than wire.REQUEST_CHUNK_BYTES come in chunks, each
        written into a buffer of the declared size. Chunked requests are received and
        served at once only up to ``max_receiving_bytes`` (a quarter of
        ``max_inflight_bytes``; one request always may): the others wait here, unread, with
        one HTTP/2 window each (BDP probing is off on the gRPC transport). So eight
        concurrent 12 MiB registers against a 64 MiB quota and a 40 MiB in-flight bound are
        taken one after another: the peak is what registering keeps (the quota) plus about
        one request, where before gRPC held all eight bodies at once in three copies each."""
        while self.must_wait(declared):
            if self._received is None:
                self._received = asyncio.Event()
            await self._received.wait()
        self.receiving_bytes += declared

    def take_big(self, declared: int) -> None:
        """Admit a chunked request at once (the caller saw :meth:`must_wait` false)."""
        self.receiving_bytes += declared

    def release_big(self, declared: int) -> None:
        self.receiving_bytes -= declared
        done, self._received = self._received, None
        if done is not None:
            done.set()


def declared_bytes(metadata: Any) -> int | None | Abort:
    """The total size a chunked request declares in its metadata (None: not chunked)."""
    for key, value in metadata or ():
        if key == wire.SIZE_METADATA_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if not (text.isascii() and text.isdigit() and len(text) <= 12):
                return Abort("INVALID_ARGUMENT", f"metadata {wire.SIZE_METADATA_KEY!r} must "
                             f"be a byte count (decimal digits), got {text[:20]!r}")
            return int(text)
    return None


def receive_buffer(size: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``size`` bytes for a chunked request, allocated without touching
    its pages: an anonymous mapping, which the kernel zero-fills page by page as the chunks
    are written. ``bytearray(size)`` zero-fills all of it at once, on the event loop: ~1 s
    for 1000 MiB, during which no other client is served."""
    if size < _MMAP_BYTES:
        return bytearray(size)
    return mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     mmap.PROT_READ | mmap.PROT_WRITE)


if sys.version_info >= (3, 11):
    async def within(awaitable: Awaitable[T], timeout: float) -> T:
        """``await awaitable`` for at most ``timeout`` seconds (``asyncio.TimeoutError``
        after): :func:`asyncio.timeout`, which runs it in the calling task, where
        :func:`asyncio.wait_for` (Python < 3.12) wraps it in a task of its own, a few event-loop
        turns per call on the path of every request."""
        async with asyncio.timeout(timeout):
            return await awaitable
else:  # pragma: no cover - Python 3.10
    async def within(awaitable: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(awaitable, timeout)
