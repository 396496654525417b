"""The heal transport of fault-tolerant training: a live replica's state to a joining one,
with nothing unpickled.

torchft (github.com/pytorch/torchft: a per-step quorum from its Lighthouse, reconfigurable
process groups, live recovery) heals a replica that joins or fell behind by fetching the
``{"user": ..., "torchft": {"step", "batches_committed"}}`` state dict of a live peer through
a ``CheckpointTransport``. Its own transports unpickle what they receive
(``HTTPTransport`` loads with ``torch.load(weights_only=False)``; ``PGTransport`` pickles its
metadata): whoever reaches the port runs code in the trainer. :class:`SafeHealTransport` is a
drop-in replacement, ``torchft.Manager(..., checkpoint_transport=SafeHealTransport(...))``:

* **Format**: the state is encoded once per ``send_checkpoint`` by
  :func:`stratagem.checkpoint.tree.encode` (the checkpoint codec): tensors as one safetensors
  blob, the rest as strict JSON (int keys and tuples recorded, non-finite floats tagged).
  The receiver checks the safetensors header against the blob's size
  (:func:`stratagem.checkpoint.format.check_header`: dtypes, shapes, byte ranges, entry
  count, as ``restore`` does before ``safetensors.torch.load``), then builds the tensors as
  views of the received buffer (no copy: a heal is what a joining replica waits on), parses
  the JSON with no ``NaN`` tokens and bounded depth, and decodes only what ``encode`` writes.
* **Authentication** (HMAC, RFC 2104, as a challenge-response), mutual, with the job's secret
  ``token`` (never sent): the server sends a
  random nonce; the client answers with its own nonce, the step and
  ``HMAC-SHA256(token, "client" | server nonce | client nonce | step)``; the server checks it
  in constant time before it sends anything else (a wrong token gets the connection closed),
  and its header carries ``HMAC-SHA256(token, "server" | client nonce | server nonce |
  header)``, the header holding the SHA-256 of both body parts, so a peer without the token
  (or a replay of another session) is refused before the body is read, and a changed body
  after it is read.
* **Bounds**: a fixed-size header declares both sizes; more than the receive bound in all
  is refused before anything is allocated. The bound follows the joiner's own state
  (``bound``: :func:`heal_bound`, 4x its own tensors + 16 MiB, since a live peer's optimizer
  state may exist where the joiner's is not built yet), never above ``max_bytes``. The
  receive buffer is an anonymous mapping whose pages are committed as the bytes arrive: a
  peer that declares the bound and sends nothing costs no memory. A wrong step is refused.
* **Admission**: a connection must authenticate within :data:`AUTH_TIMEOUT` (its own short
  deadline, not the heal's); up to :data:`MAX_PENDING` connections may be authenticating at
  once, all on the accept thread (no thread each), and one more evicts the oldest, so idle
  unauthenticated connections cannot lock a joiner out. At most :data:`MAX_CONNECTIONS`
  authenticated connections are served at once.
* **Time**: every socket operation has a timeout, and a whole exchange a deadline (a peer
  trickling one byte per timeout still fails at the deadline).
* **Exposure**: the server binds ``host`` only, loopback by default; another address needs
  ``allow_remote=True`` (multi-node: this node's address that the peers reach); the
  unspecified address (every interface) is always refused.

On failure: ``recv_checkpoint`` raises :class:`~stratagem.CheckpointError` (refused: token,
size, step, format; the message names the peer and the fix) or ``TimeoutError`` ("timed out",
as torchft's tests expect); torchft's Manager reports either and the heal is retried at the
next quorum. The server logs and drops a connection that fails authentication or times out,
and keeps serving the others.

Wire format (big-endian)::

    server -> client   MAGIC(8) server_nonce(32)
    client -> server   MAGIC(8) client_nonce(32) step(i64) mac(32)
    server -> client   MAGIC(8) status(u8) step(i64) tensor_bytes(u64) json_bytes(u64)
                       sha256(tensor part)(32) sha256(json part)(32) mac(32)
                       tensor part (safetensors), json part (UTF-8 JSON skeleton)
    status 0: the checkpoint; status 1: refused, the json part is a UTF-8 reason (<= 4 KiB).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import mmap
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from safetensors.torch import save as st_save
from torchft.checkpointing.transport import CheckpointTransport

from ..checkpoint.format import check_header, loads_checked
from ..checkpoint.tree import decode, encode
from ..errors import CheckpointError
from ..ps.auth import is_loopback, is_unspecified
from .membership import labelled_mac as _mac

__all__ = ["SafeHealTransport", "MAGIC", "MAX_CONNECTIONS", "MAX_PENDING", "AUTH_TIMEOUT",
           "MIN_TOKEN_BYTES", "heal_bound", "state_nbytes"]

logger = logging.getLogger(__name__)

MAGIC = b"SGHEAL1\n"
#: Shortest job secret accepted (128 bits).
MIN_TOKEN_BYTES = 16
#: Authenticated connections served at once; more are closed at once (a heal has one client
#: per joining replica and rank).
MAX_CONNECTIONS = 16
#: Connections authenticating at once (on the accept thread); one more evicts the oldest.
MAX_PENDING = 128
#: Longest a connection may take to authenticate (capped by the transport's ``timeout``).
AUTH_TIMEOUT = 5.0
#: What a heal may carry beyond ``HEAL_BOUND_FACTOR`` times the joiner's own tensors (the
#: JSON skeleton, counters, a loader's position).
HEAL_BOUND_SLACK = 16 << 20
#: A live peer's state may hold optimizer state the joiner has not built yet (Adam: two
#: tensors per parameter; with amsgrad three): 4x the joiner's own tensors covers it.
HEAL_BOUND_FACTOR = 4
#: Longest refusal reason a server may send.
MAX_REASON_BYTES = 4096
_NONCE = 32
_HELLO = struct.Struct(">8s32s")
_AUTH = struct.Struct(">8s32sq32s")
_HEAD = struct.Struct(">8sBqQQ32s32s32s")
_OK, _REFUSED = 0, 1
_FIX_TOKEN = ("Fix: give every replica of the job the same token (the launcher's job secret), "
              "and check that the metadata points at a replica of this job")


def _seconds(timeout: timedelta | float, name: str) -> float:
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0 (or a timedelta), got "
                         f"{timeout!r}. Fix: pass e.g. {name}=60.0")
    return float(value)


class _Deadline:
    """One exchange's deadline: every socket operation gets what is left of it."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.what = what

    def left(self, sock: socket.socket) -> None:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self.what} timed out after {self.seconds:g} s")
        sock.settimeout(remaining)


def _recv_exact(sock: socket.socket, buf: bytearray | memoryview | mmap.mmap, deadline: _Deadline,
                what: str) -> None:
    view = memoryview(buf)
    got = 0
    while got < len(view):
        deadline.left(sock)
        try:
            n = sock.recv_into(view[got:], min(len(view) - got, 1 << 20))
        except TimeoutError:
            raise TimeoutError(f"{deadline.what} timed out after {deadline.seconds:g} s "
                               f"waiting for {what}") from None
        if n == 0:
            raise ConnectionError(f"{deadline.what}: the peer closed the connection after "
                                  f"{got} of {len(view)} bytes of {what}")
        got += n


def _recv_struct(sock: socket.socket, st: struct.Struct, deadline: _Deadline,
                 what: str) -> tuple[Any, ...]:
    buf = bytearray(st.size)
    _recv_exact(sock, buf, deadline, what)
    return st.unpack(buf)


def _send(sock: socket.socket, data: bytes | memoryview, deadline: _Deadline) -> None:
    deadline.left(sock)
    try:
        sock.sendall(data)  # the socket timeout bounds the whole sendall (Python >= 3.5)
    except TimeoutError:
        raise TimeoutError(f"{deadline.what} timed out after {deadline.seconds:g} s while "
                           "sending") from None


def state_nbytes(tree: Any) -> int:
    """Bytes of the tensors in a state tree (dicts, lists, tuples; other leaves count 0)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_nbytes(v) for v in tree)
    return 0


def heal_bound(own_state: Any) -> int:
    """The most a heal may bring to a replica whose own state is ``own_state``: the live
    peer's model is the same, its optimizer state may be built where the joiner's is not."""
    return HEAL_BOUND_FACTOR * state_nbytes(own_state) + HEAL_BOUND_SLACK


def _receive_buffer(n: int) -> mmap.mmap | bytearray:
    """A writable buffer of ``n`` bytes whose memory is committed as it is written (an
    anonymous mapping: untouched pages cost nothing; ``bytearray(n)`` would zero-fill all of
    it before the first byte arrives)."""
    return mmap.mmap(-1, n) if n > 0 else bytearray(0)


class _Pending:
    """A connection still authenticating: its nonce, what it sent so far, its deadline."""

    __slots__ = ("nonce", "got", "deadline", "peer")

    def __init__(self, nonce: bytes, deadline: float, peer: Any) -> None:
        self.nonce = nonce
        self.got = bytearray()
        self.deadline = deadline
        self.peer = peer


def _split_address(metadata: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; the port checked."""
    if not isinstance(metadata, str) or ":" not in metadata:
        raise CheckpointError(f"heal metadata must be 'host:port', got {metadata!r:.100}. Fix: "
                              "pass what the peer's SafeHealTransport.metadata() returned")
    host, _, port_text = metadata.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port_text.isdigit() or not 0 < int(port_text) < 65536 or not host:
        raise CheckpointError(f"heal metadata {metadata!r:.100} has no valid host and port "
                              "(1-65535). Fix: pass what the peer's metadata() returned")
    return host, int(port_text)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not -(1 << 63) <= step < 1 << 63:
        raise TypeError(f"step must be an int in the int64 range, got {step!r:.40}")


#: torch dtypes of the safetensors dtype names ``check_header`` allows.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _tensors_from(buf: bytearray | mmap.mmap, what: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors blob in ``buf``, as views of ``buf`` (no copy: a heal
    is the transfer torchft waits on). Every entry's dtype, shape and byte range were checked
    against the blob by ``check_header`` first (the same check ``restore`` applies before
    ``safetensors.torch.load``), so a view never reaches outside ``buf``; an entry not
    aligned to its element size is copied into an aligned tensor."""
    header = check_header(buf, what)
    start = 8 + int.from_bytes(buf[:8], "little")
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = entry["data_offsets"]
        if begin == end:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=start + begin)
        if (start + begin) % dtype.itemsize:
            flat = flat.clone()
        out[name] = flat.view(dtype).view(shape)
    return out


class _Payload:
    """One step's encoded state: encoded once, served to every joining replica as is."""

    def __init__(self, step: int, tensors: bytes, skeleton: bytes) -> None:
        self.step = step
        self.tensors = tensors
        self.skeleton = skeleton
        self.tensors_sha = hashlib.sha256(tensors).digest()
        self.skeleton_sha = hashlib.sha256(skeleton).digest()


class SafeHealTransport(CheckpointTransport[dict[str, Any]]):
    """torchft ``CheckpointTransport`` over a token-authenticated socket, safetensors + strict
    JSON; see the module docstring for the protocol and the bounds.

    ``SafeHealTransport(token=secret, timeout=60.0, max_bytes=4 << 30)`` starts its server at
    once on ``host`` (port 0: an ephemeral port; ``metadata()`` says which). One per trainer
    process; ``shutdown()`` stops the server and joins its threads (torchft's
    ``Manager.shutdown`` calls it).

    Failure: ``recv_checkpoint`` raises ``CheckpointError`` (a peer without the token, a size
    over ``max_bytes``, a wrong step, bytes that are not safetensors + strict JSON: nothing
    received is unpickled) or ``TimeoutError``; the server drops a connection that fails
    authentication or times out and keeps serving the others.
    """

    def __init__(self, *, token: bytes, timeout: float, max_bytes: int,
                 host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
                 bound: Callable[[], int] | None = None) -> None:
        if not isinstance(token, bytes):
            raise TypeError(f"token must be bytes, got {type(token).__name__}. Fix: pass the "
                            "job secret as bytes, e.g. secrets.token_bytes(32) or "
                            "text.encode()")
        if len(token) < MIN_TOKEN_BYTES:
            raise ValueError(f"token must be at least {MIN_TOKEN_BYTES} bytes, got "
                             f"{len(token)}. Fix: use secrets.token_bytes(32)")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an int >= 1 (the largest heal accepted, tensors "
                             f"and JSON together), got {max_bytes!r}. Fix: pass a bound above "
                             "the state's size, e.g. 2 * model and optimizer bytes")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in [0, 65535] (0: an ephemeral port), got "
                             f"{port!r}")
        if not isinstance(host, str) or is_unspecified(host):
            raise ValueError(f"host={host!r} would listen on every network interface. Fix: "
                             "bind 127.0.0.1 on one node, or this node's address that the "
                             "other replicas reach (with allow_remote=True)")
        if not is_loopback(host) and not allow_remote:
            raise ValueError(f"host={host!r} is not a loopback address: the heal server would "
                             "serve the model to the network. Fix: keep 127.0.0.1 on one node; "
                             "across nodes pass this node's address with allow_remote=True")
        self._token = token
        self._timeout = _seconds(timeout, "timeout")
        self._max_bytes = max_bytes
        #: At heal time, the most this replica accepts (see the module docstring); at most
        #: ``max_bytes``.
        self._bound = bound
        self._auth_timeout = min(AUTH_TIMEOUT, self._timeout)
        self._allow_remote = bool(allow_remote)
        #: Bytes of heal state (tensors + JSON, headers excluded) this transport received as
        #: a joiner / sent to joiners as a server, since it was built.
        self.bytes_received = 0
        self.bytes_served = 0
        self._cond = threading.Condition()
        self._payload: _Payload | None = None
        self._closed = False
        self._handlers: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind(address)
            self._sock.listen(MAX_PENDING)
            self._sock.setblocking(False)  # the accept thread's selector waits on it
        except OSError:
            self._sock.close()
            raise
        name = self._sock.getsockname()
        self._address = (f"[{name[0]}]:{name[1]}" if family == socket.AF_INET6
                         else f"{name[0]}:{name[1]}")
        self._thread = threading.Thread(target=self._serve, name=f"heal-server {self._address}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ CheckpointTransport
    def metadata(self) -> str:
        """``host:port`` of this transport's server (``[v6]:port`` for IPv6)."""
        return self._address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        """Encode ``state_dict`` once (a snapshot: it may change after this returns) and serve
        it for ``step`` until :meth:`disallow_checkpoint`. Refuses (``CheckpointError``) a
        state the codec cannot store, naming its key path, or one over ``max_bytes``."""
        del dst_ranks, timeout  # any authenticated replica may fetch; waits are per connection
        _check_step(step)
        tensors, skeleton = encode(state_dict, what="the heal state")
        try:
            blob = st_save(tensors)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot encode the heal state of step {step} as "
                                  f"safetensors: {exc}") from exc
        text = json.dumps(skeleton, allow_nan=False, separators=(",", ":")).encode()
        if len(blob) + len(text) > self._max_bytes:
            raise CheckpointError(
                f"the heal state of step {step} is {len(blob) + len(text)} bytes "
                f"({len(blob)} of tensors, {len(text)} of JSON), over max_bytes="
                f"{self._max_bytes}, which the joining replica would refuse. Fix: raise "
                "max_bytes on every replica")
        payload = _Payload(step, blob, text)
        with self._cond:
            self._payload = payload
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving (connections already sending finish from their own snapshot)."""
        with self._cond:
            self._payload = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict[str, Any]:
        """Fetch step ``step``'s state from the peer at ``metadata`` (``host:port``) within
        ``timeout``; see the class docstring for what is refused."""
        _check_step(step)
        host, port = _split_address(metadata)
        if not is_loopback(host) and not self._allow_remote:
            raise CheckpointError(f"heal peer {metadata!r} (rank {src_rank}) is not on loopback "
                                  "and this transport was built without allow_remote=True. "
                                  "Fix: pass allow_remote=True on multi-node jobs")
        seconds = _seconds(timeout, "timeout")
        where = f"heal of step {step} from {metadata} (rank {src_rank})"
        deadline = _Deadline(seconds, where)
        try:
            sock = socket.create_connection((host, port), timeout=seconds)
        except TimeoutError:
            raise TimeoutError(f"{where} timed out connecting after {seconds:g} s") from None
        except OSError as exc:
            raise ConnectionError(f"{where}: cannot connect ({exc}). Fix: check that the "
                                  "peer is alive and its metadata current") from exc
        with sock:
            return self._fetch(sock, step, deadline, where)

    def shutdown(self, wait: bool = True) -> None:
        """Close the server; with ``wait``, join its threads (each within ``timeout``)."""
        with self._cond:
            self._closed = True
            self._payload = None
            self._cond.notify_all()
            conns = list(self._conns)
            handlers = list(self._handlers)
        self._sock.close()
        for conn in conns:  # wakes handlers blocked in recv/send
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if wait:
            self._thread.join(self._timeout)
            for t in handlers:
                t.join(self._timeout)

    # ------------------------------------------------------------------ client side
    def _fetch(self, sock: socket.socket, step: int, deadline: _Deadline,
               where: str) -> dict[str, Any]:
        magic, server_nonce = _recv_struct(sock, _HELLO, deadline, "the greeting")
        if magic != MAGIC:
            raise CheckpointError(f"{where}: the peer is not a stratagem heal server (greeting "
                                  f"{bytes(magic)!r:.40}). {_FIX_TOKEN}")
        client_nonce = secrets.token_bytes(_NONCE)
        step_bytes = struct.pack(">q", step)
        mac = _mac(self._token, b"client", server_nonce, client_nonce, step_bytes)
        _send(sock, _AUTH.pack(MAGIC, client_nonce, step, mac), deadline)
        try:
            head = bytearray(_HEAD.size)
            _recv_exact(sock, head, deadline, "the header")
        except ConnectionError as exc:
            raise CheckpointError(f"{where}: the peer closed the connection instead of "
                                  f"answering: it refused our token. {_FIX_TOKEN}") from exc
        magic, status, got_step, n_tensors, n_json, sha_t, sha_j, their_mac = _HEAD.unpack(head)
        want = _mac(self._token, b"server", client_nonce, server_nonce, bytes(head[:-32]))
        if magic != MAGIC or not hmac.compare_digest(want, their_mac):
            raise CheckpointError(f"{where}: the peer's header is not signed with our token "
                                  f"(nothing more was read). {_FIX_TOKEN}")
        if status == _REFUSED:
            if n_tensors or n_json > MAX_REASON_BYTES:
                raise CheckpointError(f"{where}: the peer refused with a malformed reason")
            reason = bytearray(n_json)
            _recv_exact(sock, reason, deadline, "the refusal")
            if hashlib.sha256(reason).digest() != sha_j:
                raise CheckpointError(f"{where}: the refusal does not match its digest")
            raise CheckpointError(f"{where} refused by the peer: "
                                  f"{reason.decode('utf-8', 'replace')}")
        if status != _OK:
            raise CheckpointError(f"{where}: unknown status {status} from the peer")
        if got_step != step:
            raise CheckpointError(f"{where}: the peer sent step {got_step}, not {step}. Fix: "
                                  "the peer moved on; the heal is retried at the next quorum")
        limit, why = self._receive_limit()
        if n_tensors + n_json > limit:
            raise CheckpointError(
                f"{where}: the peer declares {n_tensors + n_json} bytes ({n_tensors} of "
                f"tensors, {n_json} of JSON), over {why}; nothing was allocated. Fix: if the "
                "state is really that large, raise max_heal_bytes (FaultTolerantComm) or "
                "max_bytes (SafeHealTransport)")
        tensor_buf = _receive_buffer(n_tensors)
        _recv_exact(sock, tensor_buf, deadline, "the tensors")
        json_buf = _receive_buffer(n_json)
        _recv_exact(sock, json_buf, deadline, "the JSON skeleton")
        if not (hmac.compare_digest(hashlib.sha256(tensor_buf).digest(), sha_t)
                and hmac.compare_digest(hashlib.sha256(json_buf).digest(), sha_j)):
            raise CheckpointError(f"{where}: the body does not match the signed digests "
                                  "(changed in transit). Fix: retry the heal")
        tensors = _tensors_from(tensor_buf, f"{where}: tensors")
        skeleton = loads_checked(bytes(json_buf), f"{where}: JSON skeleton", strict=True)
        state = decode(tensors, skeleton, what=where)
        self.bytes_received += n_tensors + n_json
        if not isinstance(state, dict):
            raise CheckpointError(f"{where}: the state is a {type(state).__name__}, not a dict")
        return state

    def _receive_limit(self) -> tuple[int, str]:
        """The most a heal may bring now, and how to name it in a refusal."""
        if self._bound is not None:
            try:
                bound = int(self._bound())
            except Exception as exc:  # noqa: BLE001 - the configured bound still holds
                logger.warning("heal transport: could not size this replica's own state "
                               "(%s); bounding the heal by max_bytes", exc)
            else:
                if bound < self._max_bytes:
                    return bound, (f"this replica's bound of {bound} bytes ({HEAL_BOUND_FACTOR}x "
                                   f"its own state + {HEAL_BOUND_SLACK >> 20} MiB)")
        return self._max_bytes, f"max_bytes={self._max_bytes}"

    # ------------------------------------------------------------------ server side
    def _serve(self) -> None:
        """Accept, and authenticate every connection here (non-blocking, each within
        ``AUTH_TIMEOUT``); an authenticated one gets a thread of its own (at most
        ``MAX_CONNECTIONS``)."""
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, _Pending] = {}  # oldest first
        try:
            try:
                sel.register(self._sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                return  # shut down before this thread started
            while True:
                with self._cond:
                    if self._closed:
                        return
                try:
                    ready = sel.select(timeout=0.1)
                except (OSError, ValueError):
                    return  # the listening socket was closed by shutdown()
                for key, _ in ready:
                    if key.fileobj is self._sock:
                        if not self._accept(sel, pending):
                            return
                    else:
                        self._authenticate(sel, pending, key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, p in pending.items() if now >= p.deadline]:
                    self._drop(sel, pending, conn, f"did not authenticate within "
                                                   f"{self._auth_timeout:g} s")
        finally:
            for conn in pending:
                conn.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]
                ) -> bool:
        """Accept what is waiting; False once the listening socket is closed."""
        while True:
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if len(pending) >= MAX_PENDING:  # the oldest has had the longest to answer
                oldest = next(iter(pending))
                self._drop(sel, pending, oldest, f"evicted: {MAX_PENDING} connections were "
                                                 "authenticating")
            nonce = secrets.token_bytes(_NONCE)
            try:
                conn.setblocking(False)
                hello = _HELLO.pack(MAGIC, nonce)
                if conn.send(hello) != len(hello):  # 40 bytes to a new socket's empty buffer
                    raise OSError("the greeting did not fit the socket's buffer")
                sel.register(conn, selectors.EVENT_READ)
            except OSError as exc:
                conn.close()
                logger.warning("heal server %s: dropped %s: %s", self._address, peer, exc)
                continue
            pending[conn] = _Pending(nonce, time.monotonic() + self._auth_timeout, peer)

    def _drop(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending],
              conn: socket.socket, why: str) -> None:
        entry = pending.pop(conn)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()
        logger.warning("heal server %s: dropped %s: %s", self._address, entry.peer, why)

    def _authenticate(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending],
                      conn: socket.socket) -> None:
        entry = pending[conn]
        try:
            data = conn.recv(_AUTH.size - len(entry.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(sel, pending, conn, str(exc))
            return
        if not data:
            self._drop(sel, pending, conn, "closed before authenticating")
            return
        entry.got += data
        if len(entry.got) < _AUTH.size:
            return
        magic, client_nonce, step, mac = _AUTH.unpack(entry.got)
        want = _mac(self._token, b"client", entry.nonce, client_nonce, struct.pack(">q", step))
        if magic != MAGIC or not hmac.compare_digest(want, mac):
            self._drop(sel, pending, conn, "the client's token is wrong; closed without "
                                           "sending anything")
            return
        del pending[conn]
        sel.unregister(conn)
        with self._cond:
            self._handlers = {t for t in self._handlers if t.is_alive()}
            busy = len(self._handlers) >= MAX_CONNECTIONS or self._closed
        if busy:
            conn.close()
            logger.warning("heal server %s: refused %s (%d authenticated connections already "
                           "served)", self._address, entry.peer, MAX_CONNECTIONS)
            return
        conn.setblocking(True)
        t = threading.Thread(target=self._handle, daemon=True, name=f"heal-conn {entry.peer}",
                             args=(conn, entry.peer, entry.nonce, client_nonce, step))
        with self._cond:
            self._handlers.add(t)
        t.start()

    def _handle(self, conn: socket.socket, peer: Any, server_nonce: bytes,
                client_nonce: bytes, step: int) -> None:
        with self._cond:
            self._conns.add(conn)
        try:
            with conn:
                self._answer(conn, server_nonce, client_nonce, step)
        except Exception as exc:  # noqa: BLE001 - one bad connection never stops the server
            logger.warning("heal server %s: dropped %s: %s", self._address, peer, exc)
        finally:
            with self._cond:
                self._conns.discard(conn)

    def _answer(self, conn: socket.socket, server_nonce: bytes, client_nonce: bytes,
                step: int) -> None:
        # Authenticated: wait (bounded) until a checkpoint is served; a joiner may ask before
        # the live replica's send_checkpoint ran in its own quorum thread.
        with self._cond:
            self._cond.wait_for(lambda: self._payload is not None or self._closed,
                                timeout=self._timeout)
            payload = self._payload
        if payload is None:
            reason = (f"not serving a checkpoint within {self._timeout:g} s (asked for step "
                      f"{step}); timed out").encode()
            self._send_head(conn, server_nonce, client_nonce, _REFUSED, step, b"", reason)
            return
        if payload.step != step:
            reason = (f"serving step {payload.step}, asked for step {step}. Fix: the replicas "
                      "disagree on the step; the heal is retried at the next quorum").encode()
            self._send_head(conn, server_nonce, client_nonce, _REFUSED, step, b"", reason)
            return
        self._send_head(conn, server_nonce, client_nonce, _OK, step, payload.tensors,
                        payload.skeleton, payload)

    def _send_head(self, conn: socket.socket, server_nonce: bytes, client_nonce: bytes,
                   status: int, step: int, tensors: bytes, text: bytes,
                   payload: _Payload | None = None) -> None:
        sha_t = payload.tensors_sha if payload else hashlib.sha256(tensors).digest()
        sha_j = payload.skeleton_sha if payload else hashlib.sha256(text).digest()
        head = _HEAD.pack(MAGIC, status, step, len(tensors), len(text), sha_t, sha_j, b"\0" * 32)
        mac = _mac(self._token, b"server", client_nonce, server_nonce, head[:-32])
        deadline = _Deadline(max(self._timeout, 1.0), "heal server: sending the checkpoint")
        _send(conn, head[:-32] + mac, deadline)
        if tensors:
            _send(conn, memoryview(tensors), deadline)
        if text:
            _send(conn, memoryview(text), deadline)
        if status == _OK:
            with self._cond:
                self.bytes_served += len(tensors) + len(text)
