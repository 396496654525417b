"""The replicas' rendezvous store, for members only.

A fault-tolerant replica's process group is rebuilt whenever the quorum changes: its members
meet on the store of the quorum's first member and exchange their gloo addresses there.
torch's ``TCPStore`` serves anyone who connects (and lists its keys to them), so a local
process without the job's secret could read the addresses and write its own in their place.
This store serves only processes that prove the secret:

- each connection starts with a mutual challenge (both sides show an HMAC of both nonces
  under a key derived from the secret) within :data:`AUTH_TIMEOUT` seconds; a connection that
  fails it is closed without a word. At most :data:`MAX_PENDING` connections wait to prove
  the secret (one more closes the oldest of them) and only members hold one of the
  :data:`MAX_CONNECTIONS` serving places, so idle connections cannot lock members out;
- keys live under a prefix derived from the secret and the quorum (a key name alone says
  nothing about the job); there is no operation that lists keys;
- every request is bounded before anything is allocated: keys of at most
  :data:`MAX_KEY_BYTES`, values of at most :data:`MAX_VALUE_BYTES`, at most
  :data:`MAX_KEYS` keys held and :data:`MAX_STORE_BYTES` in all.

:class:`MemberStore` is a ``torch.distributed.Store`` (what gloo's rendezvous calls: ``set``,
``get``, ``wait``; also ``add``, ``check``, ``compare_set``, ``delete_key``).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._rendezvous import bracket_host
from .membership import labelled_mac as _mac

__all__ = ["MemberStoreServer", "MemberStore", "AUTH_TIMEOUT", "MAX_CONNECTIONS", "MAX_PENDING",
           "MAX_KEY_BYTES", "MAX_VALUE_BYTES", "MAX_KEYS", "MAX_STORE_BYTES"]

#: Seconds a new connection has to prove the secret.
AUTH_TIMEOUT = 5.0
#: Members' connections served at once (each member of a quorum holds one while they meet).
MAX_CONNECTIONS = 64
#: Connections still to prove the secret; one more closes the oldest of them.
MAX_PENDING = 128
MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS = 4096
MAX_STORE_BYTES = 64 << 20
_MAGIC = b"SGSTORE1"
_NONCE = 32
_REQ = struct.Struct(">BHIq")  # op, key length, value length, argument (add / wait ms)
_REP = struct.Struct(">BIq")  # status, value length, integer result
_SET, _GET, _WAIT, _ADD, _CHECK, _CAS, _DELETE = range(1, 8)
_OK, _MISSING, _TIMEOUT, _REFUSED = range(4)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


class MemberStoreServer:
    """The store a member hosts on ``host`` (a free port) for holders of ``key`` (bytes
    derived from the job's secret). ``port`` is where it listens; ``close()`` stops it."""

    def __init__(self, host: str, key: bytes) -> None:
        self._key = key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._data: dict[bytes, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._pending: list[socket.socket] = []
        self._closed = False
        self._conns: set[socket.socket] = set()
        #: Connections closed for want of the secret.
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, name="sg-member-store",
                                        daemon=True)
        self._thread.start()

    def address(self) -> str:
        return f"{bracket_host(self.host)}:{self.port}"

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._closed:
                conn.close()
                return
            with self._cond:
                if len(self._pending) >= MAX_PENDING:
                    # The oldest connection still to prove the secret gives its place up.
                    oldest = self._pending.pop(0)
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)
                self._pending.append(conn)
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="sg-member-store-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        served = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ok = self._authenticate(conn)
            with self._cond:
                if conn in self._pending:
                    self._pending.remove(conn)
                if not ok:
                    self.refused += 1
            if not ok:
                return
            # Only members hold a serving place; one over the cap is closed at once.
            served = self._slots.acquire(blocking=False)
            if not served:
                return
            conn.settimeout(None)
            while not self._closed:
                op, klen, vlen, arg = _REQ.unpack(_recv(conn, _REQ.size))
                if klen > MAX_KEY_BYTES or vlen > MAX_VALUE_BYTES:
                    return  # over the bounds: closed before anything is read or allocated
                key = _recv(conn, klen)
                value = _recv(conn, vlen) if vlen else b""
                status, out, num = self._apply(op, key, value, arg)
                conn.sendall(_REP.pack(status, len(out), num) + out)
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            with self._cond:
                self._conns.discard(conn)
                if conn in self._pending:
                    self._pending.remove(conn)
            with contextlib.suppress(OSError):
                conn.close()
            if served:
                self._slots.release()

    def _authenticate(self, conn: socket.socket) -> bool:
        conn.settimeout(AUTH_TIMEOUT)
        deadline = time.monotonic() + AUTH_TIMEOUT
        server_nonce = os.urandom(_NONCE)
        try:
            conn.sendall(_MAGIC + server_nonce)
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            hello = _recv(conn, len(_MAGIC) + _NONCE + 32)
        except (OSError, ConnectionError):
            return False
        magic, client_nonce, proof = hello[:8], hello[8:8 + _NONCE], hello[8 + _NONCE:]
        if magic != _MAGIC or not hmac.compare_digest(
                proof, _mac(self._key, b"client", server_nonce, client_nonce)):
            return False
        try:
            conn.sendall(_mac(self._key, b"server", server_nonce, client_nonce))
        except OSError:
            return False
        return True

    # ------------------------------------------------------------------ operations
    def _apply(self, op: int, key: bytes, value: bytes, arg: int) -> tuple[int, bytes, int]:
        with self._cond:
            if op == _SET:
                return self._put(key, value), b"", 0
            if op in (_GET, _WAIT):
                end = time.monotonic() + max(0, arg) / 1e3
                while key not in self._data:
                    left = end - time.monotonic()
                    if left <= 0 or self._closed:
                        return _TIMEOUT, b"", 0
                    self._cond.wait(left)
                return _OK, (self._data[key] if op == _GET else b""), 0
            if op == _CHECK:
                return _OK, b"", int(key in self._data)
            if op == _ADD:
                current = int(self._data.get(key, b"0") or b"0")
                status = self._put(key, str(current + arg).encode())
                return status, b"", current + arg
            if op == _CAS:
                n = min(arg, len(value))
                expected, desired = value[:n], value[n:]
                held = self._data.get(key)
                if (held is None and expected == b"") or held == expected:
                    status = self._put(key, desired)
                    return status, desired, 0
                return _OK, (held if held is not None else expected), 0
            if op == _DELETE:
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(key) + len(old)
                return _OK, b"", int(old is not None)
        return _REFUSED, b"", 0

    def _put(self, key: bytes, value: bytes) -> int:
        old = self._data.get(key)
        grown = len(key) + len(value) - (0 if old is None else len(key) + len(old))
        if (old is None and len(self._data) >= MAX_KEYS) or self._bytes + grown > MAX_STORE_BYTES:
            return _REFUSED
        self._data[key] = value
        self._bytes += grown
        self._cond.notify_all()
        return _OK


class MemberStore(dist.Store):
    """A client of :class:`MemberStoreServer` at ``host:port`` holding ``key``, with every
    key under ``prefix``. Raises ``PermissionError`` when the server does not prove the
    secret, ``TimeoutError`` when a wait outlasts ``timeout``."""

    def __init__(self, host: str, port: int, key: bytes, *, prefix: str,
                 timeout: timedelta) -> None:
        super().__init__()
        self._key = key
        self._prefix = prefix.encode() + b"/"
        self._timeout = timeout
        self._lock = threading.Lock()
        seconds = max(1.0, timeout.total_seconds())
        self._sock = socket.create_connection((host.strip("[]"), port), timeout=seconds)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(min(seconds, AUTH_TIMEOUT))
        try:
            hello = _recv(self._sock, len(_MAGIC) + _NONCE)
            if hello[:8] != _MAGIC:
                raise PermissionError(f"the rendezvous store at {host}:{port} is not a "
                                      "member's store")
            server_nonce, client_nonce = hello[8:], os.urandom(_NONCE)
            self._sock.sendall(_MAGIC + client_nonce
                               + _mac(key, b"client", server_nonce, client_nonce))
            answer = _recv(self._sock, 32)
        except (ConnectionError, TimeoutError) as exc:
            self._sock.close()
            raise PermissionError(
                f"the rendezvous store at {host}:{port} closed the connection during its "
                f"challenge ({exc}): this process and the store's member do not hold the same "
                "job secret. Fix: give every replica the launcher's secret "
                "(--ft-token-file on several nodes)") from None
        except PermissionError:
            self._sock.close()
            raise
        if not hmac.compare_digest(answer, _mac(key, b"server", server_nonce, client_nonce)):
            self._sock.close()
            raise PermissionError(f"the rendezvous store at {host}:{port} does not hold the "
                                  "job's secret")

    def close(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def __del__(self) -> None:
        self.close()

    def _call(self, op: int, key: str, value: bytes = b"", arg: int = 0,
              wait: float | None = None) -> tuple[int, bytes, int]:
        name = self._prefix + key.encode()
        if len(name) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"a rendezvous store key of {len(name)} bytes or value of "
                             f"{len(value)} bytes is over the store's bounds "
                             f"({MAX_KEY_BYTES}, {MAX_VALUE_BYTES})")
        with self._lock:
            self._sock.settimeout(None if wait is None else wait + 10.0)
            self._sock.sendall(_REQ.pack(op, len(name), len(value), arg) + name + value)
            status, n, num = _REP.unpack(_recv(self._sock, _REP.size))
            if n > MAX_VALUE_BYTES:
                raise ConnectionError("the rendezvous store answered over its bounds")
            out = _recv(self._sock, n) if n else b""
        if status == _REFUSED:
            raise RuntimeError("the rendezvous store is full (keys or bytes over its bounds)")
        return status, out, num

    def _wait_ms(self, timeout: timedelta | None) -> int:
        return int(1e3 * (self._timeout if timeout is None else timeout).total_seconds())

    def set(self, key: str, value: Any) -> None:  # type: ignore[override]
        self._call(_SET, key, value if isinstance(value, bytes) else str(value).encode())

    def get(self, key: str) -> bytes:  # type: ignore[override]
        ms = self._wait_ms(None)
        status, out, _ = self._call(_GET, key, arg=ms, wait=ms / 1e3)
        if status != _OK:
            raise TimeoutError(f"rendezvous store: key {key!r} did not appear within "
                               f"{ms / 1e3:g} s")
        return out

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        ms = self._wait_ms(timeout)
        end = time.monotonic() + ms / 1e3
        for key in keys:
            left = max(0, int(1e3 * (end - time.monotonic())))
            status, _, _ = self._call(_WAIT, key, arg=left, wait=left / 1e3)
            if status != _OK:
                raise TimeoutError(f"rendezvous store: key {key!r} did not appear within "
                                   f"{ms / 1e3:g} s")

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._call(_ADD, key, arg=int(amount))[2]

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return all(self._call(_CHECK, key)[2] for key in keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # type: ignore[override]
        exp = expected if isinstance(expected, bytes) else str(expected).encode()
        des = desired if isinstance(desired, bytes) else str(desired).encode()
        return self._call(_CAS, key, exp + des, arg=len(exp))[1]

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._call(_DELETE, key)[2])

    def set_timeout(self, timeout: timedelta) -> None:  # type: ignore[override]
        self._timeout = timeout
