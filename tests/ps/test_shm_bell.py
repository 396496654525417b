"""The shared-memory path's doorbell (stratagem.ps.shm.Bell): each step's small message
through a pair of pipes instead of gRPC. Same results as gRPC; hostile pipes refused at
attach (the region stays, its steps on gRPC); hostile messages refused or the channel
closed, with a good client still served; no wait without a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
from helpers import shard_grads as _grads
from helpers import shard_params as _params
from torch.testing import assert_close

from stratagem.errors import ParameterServerUnavailable
from stratagem.ps import shm, wire
from stratagem.ps.server import ShardServer
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = pytest.mark.timeout(60)

TOKEN = "bell-test-token"
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.01}


@pytest.fixture
def shard() -> Iterator[ShardServer]:
    s = ShardServer("127.0.0.1", 0, token=TOKEN, body_timeout=1.0)
    s.start()
    yield s
    s.stop(0)


def _wait(cond: object, what: str, timeout: float = 5.0) -> None:
    due = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < due, what
        time.sleep(0.02)


def _good_table(client: PSClient) -> tuple[ShardedParameters, dict[str, torch.Tensor]]:
    params = _params()
    table = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
    table.register()
    table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
    assert table.shared_memory_shards == [0] and table._shm_regions[0].bell is not None
    return table, params


@pytest.mark.parametrize("bell", ["1", "0"])
def test_doorbell_gives_bitwise_the_grpc_parameters(bell: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Six Downpour steps with the doorbell (or the region's steps on gRPC), against the
    whole push on gRPC, each on a fresh shard: bitwise the same values and versions."""
    monkeypatch.setenv(shm.BELL_ENV, bell)
    results = []
    for shared in (True, False):
        with ShardServer("127.0.0.1", 0, token=TOKEN) as s:
            params = _params()
            with PSClient([s.address], token=TOKEN, timeout=10) as client:
                table = ShardedParameters(client, params, optimizer_spec=ADAM,
                                          shared_memory=shared)
                values, versions = table.register(), table.versions
                for step in range(6):
                    got = table.push_fetch_async(_grads(params, step), versions,
                                                 fetch=list(params)).result()
                    values, versions = got.values, got.versions
                health = client.health()[0]
                region = table._shm_regions.get(0)
                results.append((values, versions, health["shm_pushes"], health["shm_bells"],
                                region is not None and region.bell is not None))
    (v_shm, ver_shm, pushes, bells, has_bell), (v_grpc, ver_grpc, _, _, _) = results
    assert pushes == 6 and ver_shm == ver_grpc == {"w": 6, "b": 6, "e": 6}
    assert (bells, has_bell) == ((1, True) if bell == "1" else (0, False))
    for k in v_grpc:
        assert_close(v_shm[k], v_grpc[k], atol=0, rtol=0)


def _attach(client: PSClient, region: shm.WorkerRegion, bell: object) -> dict[str, object]:
    lay = region.layout
    fields = {"pid": os.getpid(), "fd": region.fd, "size": lay.size,
              "nonce": region.nonce.hex(), "entries": [[k, "float32"] for k in lay.names],
              "bell": bell}
    return client.call(0, "shm_attach", fields).fields


def _layout() -> shm.Layout:
    return shm.layout([(k, torch.float32, torch.float32, v.shape)
                       for k, v in _params().items()])


def test_hostile_doorbell_pipes_are_refused_and_the_region_stays(shard: ShardServer) -> None:
    with PSClient([shard.address], token=TOKEN, timeout=10) as good:
        table, params = _good_table(good)
        hostile = PSClient([shard.address], token=TOKEN, timeout=10)
        regular = os.open("/proc/self/exe", os.O_RDONLY)
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        r3, w3 = os.pipe()
        os.write(w3, b"x" * shm.NONCE_BYTES)  # a pipe holding the wrong proof
        try:
            os.write(w1, table._shm_regions[0].nonce)  # a proof there: the one-pipe check
            cases = [("not two descriptors", "3,4"), ("not two descriptors", [1, 2, 3]),
                     ("not two descriptors", [True, 1]), ("a file", [regular, w2]),
                     ("same pipe", [r1, w1]), ("empty pipe", [r1, w2]),
                     ("wrong proof", [r3, w2]), ("closed fd", [999_999, w2])]
            for i, (why, fds) in enumerate(cases):
                region = shm.WorkerRegion(_layout())
                try:
                    reply = _attach(hostile, region, fds)
                finally:
                    region.close_fd()
                assert isinstance(reply.get("region"), str), why
                assert reply.get("bell") is False, why  # the region, but no doorbell
                got = table.push_fetch_async(_grads(params, i + 1), fetch=list(params)).result()
                assert got.versions["w"] == i + 2, why  # the good client still served
                region.release()
            assert good.health()[0]["shm_bells"] == 1
        finally:
            hostile.close()
            for fd in (regular, r1, w1, r2, w2, r3, w3):
                os.close(fd)


class _RawBell:
    """A doorbell attached by hand, to send what a real worker never would."""

    def __init__(self, client: PSClient) -> None:
        self.region = shm.WorkerRegion(_layout())
        self.bell = shm.Bell(self.region.nonce)
        try:
            reply = _attach(client, self.region, self.bell.declare())
        finally:
            self.region.close_fd()
        assert reply["bell"] is True
        self.bell.opened()
        self.rid = reply["region"]
        self.req, self.rep = self.bell._req_w, self.bell._rep_r

    def ask(self, data: bytes) -> wire.Message:
        return wire.decode(self.bell.call(data, time.monotonic() + 10), wire.Limits())

    def close(self) -> None:
        self.bell.close()
        self.region.release()


def test_hostile_doorbell_messages_are_refused_or_close_only_that_channel(
        shard: ShardServer) -> None:
    with PSClient([shard.address], token=TOKEN, timeout=10) as good:
        table, params = _good_table(good)
        step = 1

        def still_served() -> None:
            nonlocal step
            got = table.push_fetch_async(_grads(params, step), fetch=list(params)).result()
            step += 1
            assert got.versions["w"] == step

        # A request of its own region that fails its checks: answered with a refusal.
        raw = _RawBell(good)
        try:
            refusals = [
                (wire.encode("shm_push", {"region": raw.rid, "push": [["zz", 0]]}),
                 "not in this region's layout"),
                (wire.encode("shm_push", {"region": raw.rid, "push": "b"}), "list of"),
            ]
            for data, why in refusals:
                m = raw.ask(data)
                assert m.op == "refused", data[:40]
                import re
                assert re.search(why, m.fields["detail"]), m.fields
                still_served()
            # A length above the bound: the channel is closed before anything is read.
            os.write(raw.req, (shm.BELL_MAX_BYTES + 1).to_bytes(4, "little"))
            with pytest.raises(shm.BellClosed):
                shm.bell_receive(raw.rep, time.monotonic() + 5)
            _wait(lambda: raw.rid not in shard.shm.regions, "oversized: region dropped")
            still_served()
        finally:
            raw.close()
        # Anything but a request of its region (garbage, another op, another region's push,
        # a reply as a crossed pipe would carry it): closed unanswered, the region detached.
        not_requests = [b"\x00garbage", wire.encode("health", {}), wire.encode("shutdown", {}),
                        wire.encode("shm_push", {"region": "0" * 32, "push": [["b", 0]]}),
                        wire.encode("refused", {"status": "INVALID_ARGUMENT", "detail": "x"}),
                        wire.encode("pushed", {"results": [], "versions": {}})]
        for data in not_requests:
            raw = _RawBell(good)
            try:
                shm.bell_send(raw.req, data, time.monotonic() + 5)
                with pytest.raises(shm.BellClosed):  # EOF, not an answer
                    shm.bell_receive(raw.rep, time.monotonic() + 5)
                _wait(lambda r=raw: r.rid not in shard.shm.regions, f"{data[:20]!r}: dropped")
                still_served()
            finally:
                raw.close()
        assert not shard.service.stopped.is_set()  # "shutdown" never reached the shard's op
        # A body that stops half-way: cut after body_timeout (1 s here), that channel only.
        raw = _RawBell(good)
        try:
            os.write(raw.req, (100).to_bytes(4, "little") + b"{")
            t0 = time.monotonic()
            _wait(lambda: good.health()[0]["shm_bells"] == 1, "stalled body: channel closed")
            assert time.monotonic() - t0 < 6.0
            still_served()
        finally:
            raw.close()
        # A reader that never reads its answers: the shard's write is bounded too.
        raw = _RawBell(good)
        try:
            push = wire.encode("shm_push", {"region": raw.rid, "push": [["zz", 0]]})
            for _ in range(2000):  # ~100 B answers: fills the 64 KiB reply pipe
                try:
                    os.write(raw.req, len(push).to_bytes(4, "little") + push)
                except BlockingIOError:
                    break
            _wait(lambda: good.health()[0]["shm_bells"] == 1, "unread answers: channel closed",
                  timeout=10)
            still_served()
        finally:
            raw.close()
        assert good.health()[0]["shm_bells"] == 1


def test_worker_gone_drops_its_region_and_doorbell(shard: ShardServer) -> None:
    with PSClient([shard.address], token=TOKEN, timeout=10) as good:
        _good_table(good)
        raw = _RawBell(good)
        assert good.health()[0]["shm_bells"] == 2
        raw.close()  # as a dead worker's ends close: EOF on the shard's side
        _wait(lambda: raw.rid not in shard.shm.regions, "region of a closed doorbell dropped")
        _wait(lambda: good.health()[0]["shm_bells"] == 1, "its thread ended")


def test_stuck_or_stopped_shard_raises_within_the_deadline_then_grpc(
        shard: ShardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params()
    with PSClient([shard.address], token=TOKEN, timeout=1.0) as client:
        table = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
        table.register()
        table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
        serve = shard.shm.push

        def slow(msg: wire.Message) -> bytes:
            time.sleep(2.5)
            return serve(msg)

        monkeypatch.setattr(shard.shm, "push", slow)
        t0 = time.monotonic()
        with pytest.raises(ParameterServerUnavailable, match="doorbell"):
            table.push_fetch_async(_grads(params, 1), fetch=list(params)).result()
        assert time.monotonic() - t0 < 3.0
        assert table.shared_memory_shards == []  # that region is never used again
        monkeypatch.setattr(shard.shm, "push", serve)
        _wait(lambda: shard.service.slots["w"].version == 2, "the slow push lands")
        got = table.push_fetch_async(_grads(params, 2), fetch=list(params)).result()
        assert got.versions["w"] == 3  # over gRPC: the slow push was applied, then this one
    # A shard that stops: the worker's next call ends at once, not at its deadline.
    params = _params()
    with ShardServer("127.0.0.1", 0, token=TOKEN) as s, \
            PSClient([s.address], token=TOKEN, timeout=30.0) as client:
        table = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
        table.register()
        table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
        s.stop(0)  # at once: whether its doorbell thread is still polling or gone
        t0 = time.monotonic()
        with pytest.raises((ParameterServerUnavailable, RemoteError)):
            table.push_fetch_async(_grads(params, 1), fetch=list(params)).result()
        assert time.monotonic() - t0 < 5.0
        assert s.service.slots["w"].version == 1  # a stopped shard applied nothing more


def test_a_message_above_the_doorbells_bound_goes_over_grpc(
        shard: ShardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose small message outgrows the doorbell (a model of very many tensors) is
    sent over gRPC as a shared-memory push; the region and its doorbell stay in use."""
    with PSClient([shard.address], token=TOKEN, timeout=10) as client:
        table, params = _good_table(client)
        sent: list[int] = []
        call = shm.Bell.call

        def counting(self: shm.Bell, data: bytes, due: float) -> bytes:
            sent.append(len(data))
            return call(self, data, due)

        monkeypatch.setattr(shm.Bell, "call", counting)
        monkeypatch.setattr(shm, "BELL_MAX_BYTES", 16)
        got = table.push_fetch_async(_grads(params, 1), fetch=list(params)).result()
        assert got.versions["w"] == 2 and sent == []
        monkeypatch.undo()
        monkeypatch.setattr(shm.Bell, "call", counting)
        got = table.push_fetch_async(_grads(params, 2), fetch=list(params)).result()
        assert got.versions["w"] == 3 and len(sent) == 1
        assert table.shared_memory_shards == [0]
        assert client.health()[0]["shm_pushes"] == 3


def test_detached_regions_leave_no_doorbell_thread_behind() -> None:
    """A region detached while its doorbell waits for the rest of a body: the thread ends
    within ~0.5 s, not at body_timeout (30 s here), so attach-stall-detach cannot pile up
    threads and descriptors on the shard."""
    with ShardServer("127.0.0.1", 0, token=TOKEN, body_timeout=30.0) as s, \
            PSClient([s.address], token=TOKEN, timeout=10) as client:
        _good_table(client)  # registers the tensors; its own doorbell stays
        base = client.health()[0]["shm_bells"]
        assert base == 1
        raws = []
        for _ in range(5):
            raw = _RawBell(client)
            os.write(raw.req, (100).to_bytes(4, "little") + b"{")  # a body that stops
            client.call(0, "shm_detach", {"region": raw.rid})
            raws.append(raw)
        t0 = time.monotonic()
        _wait(lambda: client.health()[0]["shm_bells"] == base, "threads of detached regions")
        assert time.monotonic() - t0 < 5.0
        for raw in raws:
            raw.close()


def test_a_forked_child_does_not_use_its_parents_region(shard: ShardServer) -> None:
    with PSClient([shard.address], token=TOKEN, timeout=10) as client:
        table, params = _good_table(client)
        region = table._shm_regions[0]
        region.pid = -1  # as a fork-started child sees it: not its own process
        got = table.push_fetch_async(_grads(params, 1), fetch=list(params)).result()
        assert got.versions["w"] == 2  # over gRPC
        assert client.health()[0]["shm_pushes"] == 1  # only the first push used the region


def test_closing_waits_for_a_doorbell_call_in_flight(shard: ShardServer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing the client during a doorbell call does not close the pipes under it (their
    descriptors could be reused): the call finishes, then the doorbell is closed."""
    import threading

    client = PSClient([shard.address], token=TOKEN, timeout=10)
    table, params = _good_table(client)
    serve = shard.shm.push

    def slow(msg: wire.Message) -> bytes:
        time.sleep(1.0)
        return serve(msg)

    monkeypatch.setattr(shard.shm, "push", slow)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(
        table.push_fetch_async(_grads(params, 1), fetch=list(params)).result()))
    t.start()
    time.sleep(0.3)
    region = table._shm_regions[0]
    client.close()
    t.join(10)
    assert out and out[0].versions["w"] == 2  # type: ignore[attr-defined]
    assert region.bell is None and region.dead
