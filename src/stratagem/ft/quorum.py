"""The quorum service: torchft's Lighthouse protocol, admitting only members with the secret.

torchft's Lighthouse forms a quorum of whoever asks: any local process that finds its port
can join, name a store the replicas then connect to, and join their process group. This
service speaks the same gRPC protocol (``torchft.LighthouseService``: ``Quorum`` and
``Heartbeat``; torchft's manager servers talk to it unchanged) and forms quorums the same way
(:meth:`VerifiedQuorumService._compute`, after torchft's ``quorum_compute``: heartbeats,
``min_replicas``, at least half of the live replicas, a join timeout for stragglers, a fast
quorum when every member of the last one is back), with two differences:

- a quorum request is admitted only when every process of the member proves the job's
  secret over the member's id, addresses and step (:meth:`MemberKey.admit
  <stratagem.ft.membership.MemberKey.admit>`); a refused request is answered with one
  generic ``PERMISSION_DENIED`` (the reason goes to this process's log only) and never
  enters a quorum;
- a heartbeat counts only for a replica id tagged with the secret
  (:meth:`MemberKey.id_ok <stratagem.ft.membership.MemberKey.id_ok>`): a process without it
  cannot make the replicas wait for members that do not exist.

It has no HTTP status page and no "kill a replica" endpoint (torchft's Lighthouse serves
both, to anyone). Bounds: requests of at most :data:`MAX_REQUEST_BYTES`, at most
:data:`MAX_WAITERS` quorum requests waiting at once, a quorum request waits at most its
caller's deadline (and :data:`MAX_WAIT`), ids not heard from for a minute are forgotten.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from .membership import MAX_ID_CHARS, MemberKey, UnverifiedMemberError

__all__ = ["VerifiedQuorumService", "decode_member", "encode_quorum_response",
           "MAX_REQUEST_BYTES", "MAX_WAITERS", "MAX_WAIT"]

_log = logging.getLogger("stratagem.ft.quorum")

#: The largest quorum or heartbeat request (bytes) the service reads.
MAX_REQUEST_BYTES = 256 << 10
#: Quorum requests that may wait for a quorum at once (each holds a server thread).
MAX_WAITERS = 256
#: The longest a quorum request waits for its quorum (seconds), whatever its deadline says.
MAX_WAIT = 600.0
#: Replica ids not heard from for this long are forgotten (seconds).
FORGET_AFTER = 60.0
_SERVICE = "torchft.LighthouseService"


# ---------------------------------------------------------------------- protobuf, by hand
class _Malformed(ValueError):
    pass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if i >= len(buf):
            raise _Malformed("truncated varint")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
    raise _Malformed("varint over 10 bytes")


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message; bytes for length-delimited."""
    out = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            if n > len(buf) - i:
                raise _Malformed("a field longer than its message")
            value, i = buf[i:i + n], i + n
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise _Malformed(f"wire type {wire}")
        if i > len(buf):
            raise _Malformed("truncated field")
        out.append((number, wire, value))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, bytes) or len(value) > limit:
        raise _Malformed("a string field over its bound")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed("a string field that is not UTF-8") from None


def decode_member(raw: bytes) -> dict[str, Any]:
    """torchft's ``QuorumMember`` (replica_id=1, address=2, store_address=3, step=4,
    world_size=5, shrink_only=6, data=7, commit_failures=8, reconfigure_handles=9)."""
    member: dict[str, Any] = {"replica_id": "", "address": "", "store_address": "", "step": 0,
                              "world_size": 0, "shrink_only": False, "commit_failures": 0,
                              "handles": []}
    for number, wire, value in _fields(raw):
        if number in (1, 2, 3) and wire == 2:
            name = ("replica_id", "address", "store_address")[number - 1]
            member[name] = _text(value, MAX_ID_CHARS if number == 1 else 1024)
        elif number == 4 and wire == 0:
            member["step"] = _signed(value)
        elif number == 5 and wire == 0:
            member["world_size"] = value
        elif number == 6 and wire == 0:
            member["shrink_only"] = bool(value)
        elif number == 8 and wire == 0:
            member["commit_failures"] = _signed(value)
        elif number == 9 and wire == 2:
            if len(member["handles"]) >= 4096:
                raise _Malformed("too many handles")
            member["handles"].append(_text(value, 4096))
    return member


def _quorum_request(raw: bytes) -> tuple[dict[str, Any], bytes]:
    for number, wire, value in _fields(raw):
        if number == 1 and wire == 2:
            return decode_member(value), value
    raise _Malformed("a quorum request without a requester")


def _heartbeat_request(raw: bytes) -> str:
    for number, wire, value in _fields(raw):
        if number == 1 and wire == 2:
            return _text(value, MAX_ID_CHARS)
    return ""


def _enc_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _enc_bytes(number: int, payload: bytes) -> bytes:
    return _enc_varint(number << 3 | 2) + _enc_varint(len(payload)) + payload


def encode_quorum_response(quorum_id: int, members: list[bytes], created: float) -> bytes:
    """``LighthouseQuorumResponse{quorum: Quorum{quorum_id, participants, created}}`` with
    each participant as the member's own bytes."""
    seconds = int(created)
    stamp = (_enc_varint(1 << 3) + _enc_varint(seconds)
             + _enc_varint(2 << 3) + _enc_varint(int((created - seconds) * 1e9)))
    quorum = _enc_varint(1 << 3) + _enc_varint(quorum_id)
    quorum += b"".join(_enc_bytes(2, m) for m in members) + _enc_bytes(3, stamp)
    return _enc_bytes(1, quorum)


# ---------------------------------------------------------------------- the service
@dataclass
class _Joined:
    joined: float
    member: dict[str, Any]
    raw: bytes


@dataclass
class _Quorum:
    quorum_id: int
    members: list[_Joined]
    created: float
    ids: set[str] = field(default_factory=set)


class VerifiedQuorumService:
    """The quorum service on ``bind`` (``host:port``; port 0 picks one) for members that hold
    ``token``. ``min_replicas``, ``join_timeout_ms``, ``quorum_tick_ms`` and
    ``heartbeat_timeout_ms`` mean what they mean to torchft's ``LighthouseServer``."""

    def __init__(self, *, bind: str, token: bytes, min_replicas: int,
                 join_timeout_ms: int = 60_000, quorum_tick_ms: int = 100,
                 heartbeat_timeout_ms: int = 5_000) -> None:
        import grpc

        self._key = MemberKey(token)
        self.min_replicas = min_replicas
        self._join_timeout = join_timeout_ms / 1e3
        self._tick = quorum_tick_ms / 1e3
        self._heartbeat_timeout = heartbeat_timeout_ms / 1e3
        self._cond = threading.Condition()
        self._participants: dict[str, _Joined] = {}
        self._heartbeats: dict[str, float] = {}
        #: replica id -> when it last asked for a quorum (forgotten with its heartbeat)
        self._asked: dict[str, float] = {}
        self._prev: _Quorum | None = None
        self._quorum_id = 0
        self._seq = 0
        self._waiters = 0
        self._closed = False
        #: Requests refused for want of the secret (quorum requests and heartbeats).
        self.refused = 0
        self.quorums = 0
        ident = _identity
        handler = grpc.method_handlers_generic_handler(_SERVICE, {
            "Quorum": grpc.unary_unary_rpc_method_handler(
                self._quorum_rpc, request_deserializer=ident, response_serializer=ident),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self._heartbeat_rpc, request_deserializer=ident, response_serializer=ident),
        })
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=MAX_WAITERS + 16,
                                       thread_name_prefix="sg-quorum"),
            handlers=(handler,), maximum_concurrent_rpcs=MAX_WAITERS + 8,
            options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                     ("grpc.max_send_message_length", 64 << 20),
                     ("grpc.so_reuseport", 0)])
        port = self._server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"the quorum service could not listen on {bind!r}")
        self.port = port
        self._server.start()
        self._ticker = threading.Thread(target=self._run_ticks, name="sg-quorum-tick",
                                        daemon=True)
        self._ticker.start()

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.stop(grace=0.5).wait(5.0)
        self._ticker.join(timeout=5.0)

    # ------------------------------------------------------------------ the launcher's word
    def ids_of(self, base: str) -> set[str]:
        """The replica ids heard from whose base starts with ``base`` (e.g. ``"slot3:"``)."""
        with self._cond:
            return {rid for rid in self._heartbeats if rid.startswith(base)}

    def asked_since(self, base: str, since: float) -> bool:
        """Whether a replica id whose base starts with ``base`` has asked for a quorum at or
        after ``since`` (``time.monotonic()``)."""
        with self._cond:
            return any(rid.startswith(base) and t >= since for rid, t in self._asked.items())

    def evict(self, ids: set[str]) -> None:
        """Forget ``ids`` now (their processes are known dead: the launcher reaped them), so
        the next quorum does not wait for their heartbeats to age out."""
        with self._cond:
            for rid in ids:
                self._heartbeats.pop(rid, None)
                self._asked.pop(rid, None)
                self._participants.pop(rid, None)
            self._tick_locked(time.monotonic())

    # ------------------------------------------------------------------ rpcs
    def _heartbeat_rpc(self, request: bytes, context: Any) -> bytes:
        try:
            replica_id = _heartbeat_request(request)
        except _Malformed:
            replica_id = ""
        now = time.monotonic()
        with self._cond:
            # Ids get here only once verified (here or by an admitted quorum request): a
            # known one is not proved again at every heartbeat (ten a second per replica).
            if replica_id in self._heartbeats:
                self._heartbeats[replica_id] = now
                return b""
        ok = self._key.id_ok(replica_id)
        with self._cond:
            if ok:
                self._heartbeats[replica_id] = now
            else:
                self.refused += 1
        return b""

    def _quorum_rpc(self, request: bytes, context: Any) -> bytes:
        import grpc

        try:
            member, raw = _quorum_request(request)
            self._key.admit(replica_id=member["replica_id"], address=member["address"],
                            store_address=member["store_address"], step=member["step"],
                            world_size=member["world_size"], handles=member["handles"])
        except (_Malformed, UnverifiedMemberError) as exc:
            with self._cond:
                self.refused += 1
            _log.warning("quorum service: refused a quorum request from %s: %s",
                         context.peer(), exc)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a member of this job")
        rid = member["replica_id"]
        remaining = context.time_remaining()
        wait = MAX_WAIT if remaining is None else min(max(remaining - 0.05, 0.0), MAX_WAIT)
        with self._cond:
            if self._waiters >= MAX_WAITERS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many quorum requests")
            self._waiters += 1
            try:
                now = time.monotonic()
                deadline = now + wait
                self._heartbeats[rid] = now  # an implicit heartbeat
                self._asked[rid] = now
                self._participants[rid] = _Joined(now, member, raw)
                seq = self._seq
                self._tick_locked(now)
                while True:
                    while self._seq == seq:
                        left = deadline - time.monotonic()
                        if self._closed or left <= 0:
                            self._participants.pop(rid, None)
                            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                          "no quorum formed in time")
                        self._cond.wait(min(left, 1.0))
                    seq = self._seq
                    quorum = self._prev
                    assert quorum is not None
                    if rid in quorum.ids:
                        return encode_quorum_response(
                            quorum.quorum_id, [j.raw for j in quorum.members], quorum.created)
                    # Not in this quorum: ask again for the next one (as torchft does).
                    self._participants[rid] = _Joined(time.monotonic(), member, raw)
            finally:
                self._waiters -= 1

    # ------------------------------------------------------------------ quorums
    def _run_ticks(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                self._tick_locked(time.monotonic())
                self._cond.wait(self._tick)

    def _tick_locked(self, now: float) -> None:
        for rid, seen in list(self._heartbeats.items()):
            if now - seen > FORGET_AFTER:
                del self._heartbeats[rid]
                self._asked.pop(rid, None)
                self._participants.pop(rid, None)
        members = self._compute(now)
        if members is None:
            return
        ids = [j.member["replica_id"] for j in members]
        prev_ids = None if self._prev is None else [j.member["replica_id"]
                                                     for j in self._prev.members]
        if ids != prev_ids or any(j.member["commit_failures"] > 0 for j in members):
            self._quorum_id += 1
        self._prev = _Quorum(self._quorum_id, members, time.time(), set(ids))
        self._participants.clear()
        self._seq += 1
        self.quorums += 1
        self._cond.notify_all()

    def _compute(self, now: float) -> list[_Joined] | None:
        """The members of a new quorum, or None (torchft's ``quorum_compute``)."""
        healthy = {rid for rid, seen in self._heartbeats.items()
                   if now - seen < self._heartbeat_timeout}
        joined = {rid: j for rid, j in self._participants.items() if rid in healthy}
        candidates = sorted(joined.values(), key=lambda j: j.member["replica_id"])
        if self._prev is not None:
            prev_ids = self._prev.ids
            if any(j.member["shrink_only"] for j in joined.values()):
                candidates = [j for j in candidates if j.member["replica_id"] in prev_ids]
            if prev_ids and all(rid in joined for rid in prev_ids):
                return candidates  # a fast quorum: everyone of the last one is back
        if len(joined) < self.min_replicas:
            return None
        if len(joined) <= len(healthy) // 2:
            return None  # no split brain: at least half of the live replicas
        if len(joined) < len(healthy):
            first = min(j.joined for j in joined.values())
            if now - first < self._join_timeout:
                return None  # wait for heartbeating stragglers
        return candidates


def _identity(x: bytes) -> bytes:
    return x
