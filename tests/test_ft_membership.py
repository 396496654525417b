"""Membership that proves itself: member proofs, the quorum service's admission, the quorum
check a replica makes before it touches an address, and the protocol codec's bounds."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

from stratagem.ft.membership import MemberKey, UnverifiedMemberError  # noqa: E402
from stratagem.ft.quorum import (  # noqa: E402
    VerifiedQuorumService,
    _fields,
    _Malformed,
    decode_member,
    encode_quorum_response,
)

SECRET = b"s" * 32
OTHER = b"o" * 32


def _claim(rid: str, *, step: int = 3, rank: int = 0, size: int = 1,
           address: str = "http://127.0.0.1:1", store: str = "127.0.0.1:2") -> dict[str, Any]:
    return {"replica_id": rid, "address": address, "store_address": store, "step": step,
            "world_size": size, "group_rank": rank}


def _handle(key: MemberKey, rid: str, **kw: Any) -> str:
    return key.sign({"id": f"h-{rid}-{kw.get('rank', 0)}", "store": "127.0.0.1:9",
                     "global_rank": None}, _claim(rid, **kw))


def test_a_signed_handle_opens_and_any_change_or_other_secret_is_refused() -> None:
    key = MemberKey(SECRET)
    rid = key.replica_id("slot0:a")
    handle = _handle(key, rid)
    assert key.open(handle)["member"]["replica_id"] == rid
    with pytest.raises(UnverifiedMemberError, match="does not match the job's secret"):
        MemberKey(OTHER).open(handle)
    body = json.loads(handle)
    body["store"] = "10.0.0.9:9"  # the address a peer would connect to
    with pytest.raises(UnverifiedMemberError, match="does not match"):
        key.open(json.dumps(body))
    body = json.loads(handle)
    del body["proof"]
    with pytest.raises(UnverifiedMemberError, match="without a member proof"):
        key.open(json.dumps(body))
    with pytest.raises(UnverifiedMemberError, match="at most 4096"):
        key.open("x" * 5000)
    with pytest.raises(UnverifiedMemberError, match="not JSON"):
        key.open('{"proof": NaN}')


def test_replica_ids_carry_a_tag_only_the_secret_makes() -> None:
    key = MemberKey(SECRET)
    rid = key.replica_id("slot1:uuid")
    assert key.id_ok(rid)
    assert not key.id_ok("slot1:uuid")
    assert not MemberKey(OTHER).id_ok(rid)
    assert not key.id_ok(rid[:-1] + ("0" if rid[-1] != "0" else "1"))
    assert not key.id_ok("x" * 300)
    with pytest.raises(ValueError, match="without '~'"):
        key.replica_id("a~b")


def test_admission_wants_every_group_rank_with_the_request_s_own_claim() -> None:
    key = MemberKey(SECRET)
    rid = key.replica_id("slot0:a")
    good = [_handle(key, rid, rank=r, size=2) for r in (0, 1)]
    args = {"replica_id": rid, "address": "http://127.0.0.1:1", "store_address": "127.0.0.1:2",
            "step": 3, "world_size": 2}
    assert len(key.admit(handles=good, **args)) == 2
    with pytest.raises(UnverifiedMemberError, match="1 handles for a group of 2"):
        key.admit(handles=good[:1], **args)
    with pytest.raises(UnverifiedMemberError, match="claims other step"):
        key.admit(handles=good, **{**args, "step": 4})
    with pytest.raises(UnverifiedMemberError, match="claims other address"):
        key.admit(handles=good, **{**args, "address": "http://10.0.0.9:1"})
    with pytest.raises(UnverifiedMemberError, match="group ranks"):
        key.admit(handles=[good[0], good[0]], **args)
    with pytest.raises(UnverifiedMemberError, match="no valid tag"):
        key.admit(handles=good, **{**args, "replica_id": "slot0:a"})


def test_a_replica_refuses_a_quorum_with_an_unverified_member_naming_it() -> None:
    key = MemberKey(SECRET)
    a, b = key.replica_id("slot0:a"), key.replica_id("slot1:b")
    handles = [_handle(key, a, store="h:1", address="http://h:5"),
               _handle(key, b, store="h:2", address="http://h:6")]
    key.check_quorum(replica_ids=[a, b], handles=handles, store_address="h:1",
                     recover_src="http://h:6")
    intruder = json.dumps({"id": "x", "store": "10.0.0.9:1", "global_rank": None})
    with pytest.raises(UnverifiedMemberError, match="unverified member") as info:
        key.check_quorum(replica_ids=[a, b, "intruder"], handles=handles + [intruder])
    assert "proof" in str(info.value)
    with pytest.raises(UnverifiedMemberError, match="'intruder'") as info:
        key.check_quorum(replica_ids=[a, b, "intruder"], handles=handles)
    assert info.value.member == "intruder"
    forged = _handle(MemberKey(OTHER), "intruder")
    with pytest.raises(UnverifiedMemberError, match="does not match the job's secret"):
        key.check_quorum(replica_ids=[a, "intruder"], handles=[handles[0], forged])
    with pytest.raises(UnverifiedMemberError, match="store '10.0.0.9:1'"):
        key.check_quorum(replica_ids=[a, b], handles=handles, store_address="10.0.0.9:1")
    with pytest.raises(UnverifiedMemberError, match="recovery source"):
        key.check_quorum(replica_ids=[a, b], handles=handles, recover_src="http://10.0.0.9:1")


def test_the_codec_round_trips_a_member_and_refuses_malformed_bytes() -> None:
    from stratagem.ft.quorum import _enc_bytes, _enc_varint

    member = (_enc_bytes(1, b"slot0~t") + _enc_bytes(2, b"http://h:1") + _enc_bytes(3, b"h:2")
              + _enc_varint(4 << 3) + _enc_varint(7) + _enc_varint(5 << 3) + _enc_varint(1)
              + _enc_bytes(9, b'{"id":1}'))
    got = decode_member(member)
    assert (got["replica_id"], got["step"], got["world_size"], got["handles"]) == (
        "slot0~t", 7, 1, ['{"id":1}'])
    response = encode_quorum_response(5, [member], 1.5)
    (number, _, quorum), = _fields(response)
    assert number == 1 and [f[0] for f in _fields(quorum)] == [1, 2, 3]
    for bad in (b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # varint over 10 bytes
                b"\x0a\x10abc",  # a field longer than its message
                b"\x0b"):  # wire type 3
        with pytest.raises(_Malformed):
            decode_member(bad)
    with pytest.raises(_Malformed, match="bound"):
        decode_member(_enc_bytes(1, b"x" * 1000))


def _server(key: MemberKey | None, service: VerifiedQuorumService, rid: str, *,
            store: str = "127.0.0.1:2") -> Any:
    from torchft._torchft import ManagerServer

    return ManagerServer(replica_id=rid, lighthouse_addr=f"http://127.0.0.1:{service.port}",
                         hostname="127.0.0.1", bind="127.0.0.1:0", store_addr=store,
                         world_size=1, heartbeat_interval=timedelta(milliseconds=50),
                         connect_timeout=timedelta(seconds=5), quorum_retries=0)


def _ask(server: Any, handle: str, step: int = 3, timeout: float = 3.0) -> Any:
    from torchft._torchft import ManagerClient

    client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=5))
    return client._quorum(group_rank=0, step=step, checkpoint_metadata="", shrink_only=False,
                          timeout=timedelta(seconds=timeout), commit_failures=0,
                          reconfigure_handle=handle, init_sync=True)


def test_the_service_admits_a_member_with_the_secret_and_refuses_one_without() -> None:
    """Real torchft manager servers talk to the service: one whose handle proves the secret
    gets its quorum; one without the secret (its own handle, or a tagged id it copied) is
    refused and never appears in a quorum; an untagged heartbeat is not counted."""
    key = MemberKey(SECRET)
    service = VerifiedQuorumService(bind="127.0.0.1:0", token=SECRET, min_replicas=1,
                                    join_timeout_ms=200, quorum_tick_ms=20,
                                    heartbeat_timeout_ms=1000)
    servers = []
    try:
        good = key.replica_id("slot0:a")
        servers.append(_server(key, service, good))
        address = servers[-1].address()
        quorum = _ask(servers[-1], key.sign({"id": "g", "store": "127.0.0.1:9",
                                             "global_rank": None},
                                            _claim(good, address=address)))
        assert list(quorum.replica_ids) == [good]

        intruder = "intruder"
        servers.append(_server(None, service, intruder))
        plain = json.dumps({"id": "i", "store": "127.0.0.1:9", "global_rank": None})
        with pytest.raises(Exception):  # noqa: B017 - refused; torchft reports a timeout
            _ask(servers[-1], plain, timeout=2.0)
        refused = service.refused
        assert refused >= 1
        # A copied (tagged) id with a handle signed under another secret: refused too.
        servers.append(_server(None, service, good))
        forged = MemberKey(OTHER).sign({"id": "f", "store": "10.0.0.9:1", "global_rank": None},
                                       _claim(good, address=servers[-1].address()))
        with pytest.raises(Exception):  # noqa: B017
            _ask(servers[-1], forged, timeout=2.0)
        assert service.refused > refused
        time.sleep(0.3)  # the intruder's manager server has been heartbeating meanwhile
        with service._cond:
            assert intruder not in service._heartbeats
            assert all(intruder not in q for q in [service._prev.ids])
        # The good member still gets quorums, alone.
        quorum = _ask(servers[0], key.sign({"id": "g", "store": "127.0.0.1:9",
                                            "global_rank": None},
                                           _claim(good, address=address, step=4)), step=4)
        assert list(quorum.replica_ids) == [good]
    finally:
        for server in servers:
            server.shutdown()
        service.shutdown()


# ---------------------------------------------------------------------- the rendezvous store
def _store_pair() -> tuple[Any, Any]:
    from stratagem.ft.store import MemberStore, MemberStoreServer

    server = MemberStoreServer("127.0.0.1", b"k" * 32)
    client = MemberStore("127.0.0.1", server.port, b"k" * 32, prefix="p",
                         timeout=timedelta(seconds=5))
    return server, client


def test_the_rendezvous_store_serves_members_and_gloo_meets_on_it() -> None:
    import threading

    import torch
    import torch.distributed as dist

    from stratagem.ft.store import MemberStore

    server, client = _store_pair()
    try:
        client.set("a", b"1")
        assert client.get("a") == b"1" and client.check(["a"]) and not client.check(["b"])
        assert client.add("n", 2) == 2 and client.add("n", 3) == 5
        assert client.compare_set("c", b"", b"x") == b"x"
        assert client.compare_set("c", b"y", b"z") == b"x"
        assert client.delete_key("a") and not client.check(["a"])
        with pytest.raises(TimeoutError, match="did not appear within 0.2 s"):
            client.wait(["never"], timedelta(seconds=0.2))
        sums: dict[int, torch.Tensor] = {}

        def rank(r: int) -> None:
            store = MemberStore("127.0.0.1", server.port, b"k" * 32, prefix="q",
                                timeout=timedelta(seconds=10))
            pg = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=10))
            t = torch.full((3,), float(r + 1))
            pg.allreduce([t]).wait()
            sums[r] = t

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert all((sums[r] == 3).all() for r in range(2))
    finally:
        client.close()
        server.close()


def test_the_rendezvous_store_refuses_a_process_without_the_secret() -> None:
    """Neither side sends anything but a nonce before the other proves the secret; the
    refused connection can read and write nothing, and members are still served."""
    from stratagem.ft.store import MemberStore

    server, client = _store_pair()
    try:
        client.set("rank_0", b"10.0.0.1:1")
        with pytest.raises(PermissionError, match="do not hold the same job secret"):
            MemberStore("127.0.0.1", server.port, b"x" * 32, prefix="p",
                        timeout=timedelta(seconds=5))
        assert server.refused == 1
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        greeting = raw.recv(100)
        assert len(greeting) == 8 + 32  # magic and a nonce, nothing of the store
        raw.sendall(b"SGSTORE1" + b"\0" * 64)  # a wrong proof
        assert raw.recv(100) == b""  # closed, unanswered
        raw.close()
        assert client.get("rank_0") == b"10.0.0.1:1"
    finally:
        client.close()
        server.close()


def test_the_rendezvous_store_bounds_requests_before_reading_them() -> None:
    import struct

    from stratagem.ft.store import MAX_VALUE_BYTES, MemberStore, _mac

    server, client = _store_pair()
    try:
        with pytest.raises(ValueError, match="over the store's bounds"):
            client.set("big", b"x" * (MAX_VALUE_BYTES + 1))
        # A member that declares 4 GiB: the server closes the connection without reading.
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        hello = raw.recv(40)
        nonce = b"n" * 32
        raw.sendall(b"SGSTORE1" + nonce + _mac(b"k" * 32, b"client", hello[8:], nonce))
        assert len(raw.recv(32)) == 32
        raw.sendall(struct.pack(">BHIq", 1, 1, 0xFFFFFFFF, 0) + b"k")
        try:
            answer = raw.recv(10)
        except ConnectionResetError:
            answer = b""
        assert answer == b""  # closed, nothing read past the header
        raw.close()
        assert client.check(["big"]) is False  # the member is still served
        assert isinstance(client, MemberStore)
    finally:
        client.close()
        server.close()


def test_idle_unauthenticated_connections_do_not_lock_members_out() -> None:
    """More idle connections that never prove the secret than the store holds: the oldest
    give their places up, and a member connecting after them is served at once."""
    from stratagem.ft import store as store_mod
    from stratagem.ft.store import MemberStore

    server, client = _store_pair()
    idle = []
    try:
        for _ in range(store_mod.MAX_PENDING + 8):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        t0 = time.monotonic()
        late = MemberStore("127.0.0.1", server.port, b"k" * 32, prefix="p",
                           timeout=timedelta(seconds=30))
        late.set("x", b"1")
        assert time.monotonic() - t0 < 2.0
        assert client.get("x") == b"1"  # an authenticated member kept its place
        late.close()
    finally:
        for s in idle:
            s.close()
        client.close()
        server.close()


def test_the_launcher_can_forget_the_ids_of_reaped_replicas() -> None:
    """A restarted replica group takes a fresh id; its launcher forgets the old one once its
    processes are reaped, so the survivors' quorum forms at once instead of waiting for the
    dead heartbeat to age out."""
    key = MemberKey(SECRET)
    service = VerifiedQuorumService(bind="127.0.0.1:0", token=SECRET, min_replicas=1,
                                    join_timeout_ms=5_000, quorum_tick_ms=20,
                                    heartbeat_timeout_ms=5_000)
    servers = []
    try:
        alive, dead = key.replica_id("slot0:a"), key.replica_id("slot1:b")
        for rid in (alive, dead):
            servers.append(_server(key, service, rid))
        time.sleep(0.3)  # both heartbeat: a quorum of one would wait for the other
        assert service.ids_of("slot1:") == {dead}
        servers[1].shutdown()  # the group died; its heartbeat would count for 5 s
        service.evict(service.ids_of("slot1:"))
        t0 = time.monotonic()
        quorum = _ask(servers[0], key.sign({"id": "g", "store": "127.0.0.1:9",
                                            "global_rank": None},
                                           _claim(alive, address=servers[0].address())))
        assert list(quorum.replica_ids) == [alive]
        assert time.monotonic() - t0 < 2.0  # not the 5 s join timeout
        assert service.ids_of("slot1:") == set()
    finally:
        for server in servers[:1]:
            server.shutdown()
        service.shutdown()
