"""Hostile parameter-server clients: finite poisoning, bloat, careless clients.

Each shard-side test runs the hostile client next to a good one and checks that the good one
is served within ``GOOD_BOUND`` (1 s) throughout; poisoning tests also check that the shared
tensor stays finite and that the refusal is counted. Client-side tests check the refusal
itself (they run no shard: the point is that nothing is sent).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ProcShard

from stratagem.ps import addresses as ps_addresses
from stratagem.ps import wire
from stratagem.ps.auth import read_token_file
from stratagem.ps.rpc import grpc
from stratagem.ps.server import ShardServer
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = pytest.mark.timeout(240)

TOKEN = "hostile-25-token"
MiB = 1 << 20
MD = ((wire.TOKEN_METADATA_KEY, TOKEN),)
GOOD_BOUND = 1.0


class Good:
    """A well-behaved worker on its own connection: every push+pull must take < GOOD_BOUND."""

    def __init__(self, address: str, name: str = "good") -> None:
        self.client = PSClient([address], token=TOKEN, timeout=10)
        self.name = f"{name}.w"
        self.table = ShardedParameters(self.client, {self.name: torch.zeros(256)},
                                       optimizer_spec={"name": "sgd", "lr": 0.01})
        self.table.register()
        self.worst = 0.0
        self.steps = 0

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.table.push({self.name: torch.ones(256)})
        got = self.table.pull()[self.name]
        took = time.perf_counter() - t0
        assert out[self.name].applied and bool(torch.isfinite(got).all())
        self.worst = max(self.worst, took)
        self.steps += 1

    def steps_while(self, busy: threading.Event | None, seconds: float) -> None:
        """Step until ``seconds`` pass (or ``busy`` is cleared), at least once."""
        end = time.monotonic() + seconds
        while True:
            self.step()
            if time.monotonic() >= end or (busy is not None and not busy.is_set()):
                break
            time.sleep(0.01)
        print(f"[{self.name}] good client: {self.steps} push+pull, worst {self.worst:.3f} s")
        assert self.worst < GOOD_BOUND, f"good client waited {self.worst:.2f} s"

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def shard() -> Iterator[ShardServer]:
    server = ShardServer(token=TOKEN, max_message_bytes=64 * MiB, max_bytes=64 * MiB)
    server.start()
    yield server
    server.stop(0)


@pytest.fixture
def good(shard: ShardServer) -> Iterator[Good]:
    g = Good(shard.address)
    yield g
    g.close()


def _evil(shard: ShardServer) -> PSClient:
    return PSClient([shard.address], token=TOKEN, timeout=10)


def _raw(address: str, data: bytes, *, unary: bool = False
         ) -> tuple[bytes | None, grpc.RpcError | None]:
    """One call on a connection of its own, sent as ``PSClient`` sends it (chunks, the size
    declared, above ``wire.REQUEST_CHUNK_BYTES``), or as one message with ``unary=True``."""
    opts = [*wire.channel_options(128 * MiB), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=opts) as ch:
        try:
            if len(data) > wire.REQUEST_CHUNK_BYTES and not unary:
                md = (*MD, (wire.SIZE_METADATA_KEY, str(len(data))))
                return ch.stream_unary(wire.METHOD)(wire.request_chunks(data), timeout=20,
                                                    metadata=md), None
            return ch.unary_unary(wire.METHOD)(data, timeout=20, metadata=MD), None
        except grpc.RpcError as exc:
            return None, exc


def _health(shard: ShardServer) -> dict:
    with PSClient([shard.address], token=TOKEN, timeout=10) as c:
        return c.health()[0]


# -- 2. finite values that poison -------------------------------------------------------------

def test_two_elastic_exchanges_of_3e38_leave_the_center_finite(shard, good) -> None:
    evil = _evil(shard)
    center = ShardedParameters(evil, {"c": torch.zeros(4)}, mode="elastic")
    center.register()
    center.elastic_exchange({"c": torch.full((4,), 3e38)}, 0.9)  # center 2.7e38: finite
    kept = center.pull()["c"].clone()
    # x - center = -5.7e38 overflows fp32: the exchange is refused, the center kept.
    with pytest.raises(RemoteError, match="non-finite"):
        center.elastic_exchange({"c": torch.full((4,), -3e38)}, 0.9)
    assert torch.equal(center.pull()["c"], kept)
    assert _health(shard)["refused"] == 1
    good.steps_while(None, 0.2)
    evil.close()


def test_sync_mean_of_two_3e38_gradients_is_finite(shard, good) -> None:
    evil = _evil(shard)
    t = ShardedParameters(evil, {"s": torch.zeros(4)}, mode="sync", replicas_to_aggregate=2,
                          optimizer_spec={"name": "sgd", "lr": 1.0})
    t.register()
    assert t.push({"s": torch.full((4,), 3e38)})["s"].status == "accumulated"
    assert t.push({"s": torch.full((4,), 3e38)})["s"].applied  # summed in float64
    got = t.pull()["s"]
    assert bool(torch.isfinite(got).all()) and float(got[0]) == pytest.approx(-3e38, rel=1e-6)
    good.steps_while(None, 0.2)
    evil.close()


def test_async_steps_that_overflow_are_refused_and_counted(shard, good) -> None:
    evil = _evil(shard)
    t = ShardedParameters(evil, {"a": torch.zeros(4), "m": torch.zeros(4)},
                          optimizer_specs={"a": {"name": "sgd", "lr": 1.0},
                                           "m": {"name": "sgd", "lr": 1.0, "momentum": 0.9}})
    t.register()
    big = torch.full((4,), 3e38)
    first = t.push({"a": big, "m": big})
    assert first["a"].applied and first["m"].applied
    kept = t.pull()
    second = t.push({"a": big, "m": big}, base_versions=1)  # -6e38 and -8.7e38: overflow
    assert second["a"].status == second["m"].status == "refused"
    assert not second["a"].accepted
    after = t.pull()
    for k in kept:  # plain SGD and the optimizer (momentum) path both keep the last value
        assert torch.equal(after[k], kept[k]), k
    assert _health(shard)["refused"] == 2
    # The momentum buffer was restored too: a small gradient now moves "m" as it should
    # (momentum 0.9 * 3e38 + 1 from the first step's buffer would overflow again otherwise).
    assert t.push({"m": -big}, base_versions=1)["m"].applied
    assert bool(torch.isfinite(t.pull()["m"]).all())
    good.steps_while(None, 0.2)
    evil.close()


def test_fp32_gradient_of_1e5_to_an_fp16_tensor_is_refused_after_the_cast(shard, good) -> None:
    evil = _evil(shard)
    t = ShardedParameters(evil, {"h": torch.zeros(4, dtype=torch.float16)},
                          optimizer_spec={"name": "sgd", "lr": 0.1})
    t.register()
    before = t.versions["h"]
    # The client sends fp32 (what a mixed-precision worker may push); 1e5 is inf in fp16.
    data = wire.encode("push", {}, [wire.Entry("h", torch.full((4,), 1e5), before)])
    _, err = _raw(shard.address, data)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "overflows the tensor's dtype torch.float16" in (err.details() or "")
    got = t.pull()["h"]
    assert bool(torch.isfinite(got).all()) and t.versions["h"] == before
    good.steps_while(None, 0.2)
    evil.close()


def test_fp32_elastic_exchange_of_1e5_to_an_fp16_center_is_refused(shard, good) -> None:
    evil = _evil(shard)
    center = ShardedParameters(evil, {"c16": torch.zeros(4, dtype=torch.float16)},
                               mode="elastic")
    center.register()
    data = wire.encode("elastic", {"moving_rate": 0.5},
                       [wire.Entry("c16", torch.full((4,), 1e5))])
    _, err = _raw(shard.address, data)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "overflows" in (err.details() or "")
    assert torch.equal(center.pull()["c16"], torch.zeros(4, dtype=torch.float16))
    good.steps_while(None, 0.2)


@pytest.mark.parametrize("op", ["register", "set_hyperparams"])
def test_a_learning_rate_of_1e30_is_refused(shard, good, op) -> None:
    evil = _evil(shard)
    if op == "register":
        data = wire.encode("register", {"entries": [{"mode": "async", "spec": 0}],
                                        "specs": [{"name": "sgd", "lr": 1e30}]},
                           [wire.Entry("lr", torch.zeros(4))])
    else:
        ShardedParameters(evil, {"lr": torch.zeros(4)},
                          optimizer_spec={"name": "sgd", "lr": 0.1}).register()
        data = wire.encode("set_hyperparams", {"names": ["lr"], "hyperparams": {"lr": 1e30}})
    _, err = _raw(shard.address, data)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lr must be a finite number <= 1000" in (err.details() or "")
    # Our own client refuses it before sending.
    with pytest.raises(ValueError, match="lr must be a finite number <= 1000"):
        ShardedParameters(evil, {"x": torch.zeros(2)},
                          optimizer_spec={"name": "sgd", "lr": 1e30})
    good.steps_while(None, 0.2)
    evil.close()


# -- 5. stalling or bloating a shard ------------------------------------------------------

@pytest.fixture(scope="module")
def procs() -> Iterator[dict[str, ProcShard]]:
    tmp = Path(tempfile.mkdtemp(prefix="stratagem-hostile-bloat-"))
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    # a: the quota and in-flight bound of the bloat cases; b: a small quota for tiny slots.
    shards = {"a": ProcShard(tmp / "a", "--max-bytes", str(64 * MiB), "--max-message-bytes",
                             str(64 * MiB), "--max-inflight-bytes", str(40 * MiB), token=TOKEN),
              "b": ProcShard(tmp / "b", "--max-bytes", str(2 * MiB), token=TOKEN)}
    try:
        yield {k: v.wait() for k, v in shards.items()}
    finally:
        for v in shards.values():
            v.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _senders(n: int, address: str, data: bytes, busy: threading.Event,
             codes: list[grpc.StatusCode]) -> list[threading.Thread]:
    def send() -> None:
        while busy.is_set():
            _, err = _raw(address, data)
            codes.append(err.code() if err is not None else grpc.StatusCode.OK)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _under_attack(address: str, data: bytes, senders: int, seconds: float, name: str
                  ) -> tuple[Good, list[grpc.StatusCode]]:
    g = Good(address, name)
    busy, codes = threading.Event(), []
    busy.set()
    threads = _senders(senders, address, data, busy, codes)
    try:
        time.sleep(0.3)
        g.steps_while(None, seconds)
    finally:
        busy.clear()
        for t in threads:
            t.join(20)
        g.close()
    return g, codes


def test_requests_of_many_empty_tensors_do_not_stall_a_good_client(procs) -> None:
    # ~1 MiB of headers: 13 000 empty tensors per request (every one ~10 us to check).
    entries = [wire.Entry(f"e{i:05d}-" + "x" * 40, torch.zeros(0)) for i in range(13_000)]
    data = wire.encode("push", {}, entries)
    assert 0.5 * MiB < len(data) < 1.5 * MiB
    g, codes = _under_attack(procs["a"].address, data, 8, 2.0, "empties")
    assert codes and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
    assert g.steps >= 5


def test_tiny_slots_are_charged_their_overhead_and_a_pull_of_all_is_bounded(procs) -> None:
    shard = procs["b"]
    registered = 0
    for batch in range(200):  # up to 200 x 250 one-element tensors = 50 000 slots
        data = wire.encode(
            "register", {"entries": [{"mode": "elastic"}] * 250, "specs": []},
            [wire.Entry(f"t{batch}.{i}", torch.zeros(1)) for i in range(250)])
        _, err = _raw(shard.address, data)
        if err is not None:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "max_bytes" in (err.details() or "")
            break
        registered += 250
    # 4 KiB charged per slot: a 2 MiB quota holds at most 512 of them, not 50 000.
    assert 0 < registered <= 2 * MiB // 4096
    assert shard.health()["charged_bytes"] >= registered * 4096
    # Pulls of every slot, back to back, while a good client steps (the pull runs on a
    # tensor thread, not the loop; several senders at once still delay the good client
    # through the shared tensor threads and locks: see docs/reliability.md).
    _, codes = _under_attack(shard.address, wire.encode("pull"), 1, 1.5, "tiny")
    assert codes


def test_concurrent_registers_keep_to_the_quota_without_a_copy(procs) -> None:
    # Eight concurrent registers of 12 MiB against a 64 MiB quota (and a 40 MiB bound on
    # requests in flight): at most five fit; each registered tensor is kept from its message
    # (no copy), and no reply echoes it back. They come as our client sends them (chunks,
    # size declared): the shard admits them by their declared size and receives them one
    # after another, so its peak stays near what it keeps (see ShardServer._receive).
    shard = procs["a"]
    codes: list[grpc.StatusCode] = []
    details: list[str] = []
    replies: list[int] = []
    datas = [wire.encode("register", {"entries": [{"mode": "elastic"}], "specs": []},
                         [wire.Entry(f"big{i}", torch.full((3 * MiB,), float(i)))])
             for i in range(8)]

    def register(i: int) -> None:
        # Sent again while refused for the in-flight bound ("retry later"), as a persistent
        # client would: so the quota is filled, not only the in-flight bound.
        end = time.monotonic() + 20
        while True:
            reply, err = _raw(shard.address, datas[i])
            if (err is None or "max_inflight_bytes" not in (err.details() or "")
                    or time.monotonic() > end):
                break
            time.sleep(0.005)
        codes.append(err.code() if err is not None else grpc.StatusCode.OK)
        details.append((err.details() or "") if err is not None else "")
        if reply is not None:
            replies.append(len(reply))

    g = Good(shard.address, "regs")
    time.sleep(0.2)
    rss0, _ = shard.rss()
    shard.reset_peak()
    threads = [threading.Thread(target=register, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    g.steps_while(None, 0.5)
    for t in threads:
        t.join(30)
    g.close()
    peak = shard.rss()[1] - rss0
    ok = codes.count(grpc.StatusCode.OK)
    assert ok == 5 and set(codes) <= {grpc.StatusCode.OK,
                                      grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    for d in details:  # the quota refuses the other three, and says so
        assert not d or "max_bytes=" in d, d
    assert max(replies) < 64 * 1024  # the 12 MiB value is not sent back
    health = shard.health()
    assert health["charged_bytes"] <= 64 * MiB
    created = [n for n in health["versions"] if n.startswith("big")]
    with PSClient([shard.address], token=TOKEN, timeout=10) as c:
        got = c.call(0, "pull", {"names": created}).tensors()
    for n in created:  # the adopted storage holds the registered values
        assert torch.equal(got[n], torch.full((3 * MiB,), float(n[3:])))
    print(f"concurrent registers: {ok} x 12 MiB registered, peak +{peak / MiB:.0f} MiB "
          f"against a 64 MiB quota ({peak / (64 * MiB):.2f}x)")
    # The three that cannot fit are refused by their header, after one chunk, so they cost
    # (and hold) no 12 MiB buffer: admitted one at a time, each sees the quota already taken.
    refused = [d for d in details if d]
    assert len(refused) == 3 and all("before its tensors were received" in d
                                     for d in refused), refused
    # Measured 1.11-1.15x (+71-74 MiB: the 60 MiB kept, about 8 MiB of gRPC buffers while
    # 1 MiB chunks arrive, the good client); 1.9-2.9x before requests were chunked, admitted
    # by their declared size and refused by their header: see "Peak shard memory under
    # concurrent big requests" in docs/reliability.md.
    assert peak <= 1.25 * 64 * MiB, f"peak +{peak / MiB:.0f} MiB ({peak / (64 * MiB):.2f}x)"


def test_request_bytes_in_flight_are_bounded(procs) -> None:
    # Eight 16 MiB garbage bodies at once, chunked as our client sends them, and eight more
    # as single gRPC messages, against a 40 MiB bound on bytes held. The chunked ones are
    # admitted by their declared size, one at a time, and refused as not a message; the single
    # messages are refused by gRPC from their length prefix (a message is at most
    # wire.REQUEST_CHUNK_BYTES), before their bodies are received. The shard's peak stays
    # below the bound.
    shard = procs["a"]
    codes: list[grpc.StatusCode] = []
    details: list[str] = []

    def send(unary: bool) -> None:
        _, err = _raw(shard.address, bytes(16 * MiB), unary=unary)
        codes.append(err.code() if err is not None else grpc.StatusCode.OK)
        details.append((err.details() or "") if err is not None else "")

    g = Good(shard.address, "inflight")
    time.sleep(0.2)
    rss0, _ = shard.rss()
    shard.reset_peak()
    threads = [threading.Thread(target=send, args=(i % 2 == 0,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        g.steps_while(None, 1.0)
    finally:
        for t in threads:
            t.join(30)
        g.close()
    peak = shard.rss()[1] - rss0
    assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    for d in details:
        if "in progress" in d:
            assert f"max_inflight_bytes={40 * MiB}" in d
    assert sum("larger than max" in d for d in details) == 8, details
    assert shard.health()["ok"]
    print(f"16 x 16 MiB garbage bodies: peak +{peak / MiB:.0f} MiB")
    assert peak < 40 * MiB, f"peak +{peak / MiB:.0f} MiB"


# -- 6. clients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("address", ["10.1.2.3:5000", "ps-0.example:5000", "[2001:db8::1]:5000"])
def test_client_refuses_a_token_in_clear_text_off_loopback(address, monkeypatch) -> None:
    monkeypatch.delenv("STRATAGEM_PS_ALLOW_PLAINTEXT", raising=False)
    with pytest.raises(ValueError, match="clear text.*allow_plaintext=True"):
        PSClient([address], token=TOKEN)
    PSClient([address], token=TOKEN, allow_plaintext=True).close()  # explicit: allowed
    PSClient([address]).close()  # no token, nothing to leak
    monkeypatch.setenv("STRATAGEM_PS_ALLOW_PLAINTEXT", "1")
    PSClient([address], token=TOKEN).close()


@pytest.mark.parametrize("address", ["127.0.0.1:5000", "localhost:5000", "[::1]:5000"])
def test_client_sends_a_token_to_loopback(address) -> None:
    PSClient([address], token=TOKEN).close()


@pytest.mark.parametrize("address", ["unix:/tmp/ps.sock", "dns:///ps-0:5000", "unix:host:5000",
                                     "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:+80",
                                     "ipv4:127.0.0.1:5000", "::1:5000", "[zz::1]:5000",
                                     "host name:5000"])
def test_bad_shard_addresses_are_refused(address, monkeypatch) -> None:
    with pytest.raises(ValueError, match="refused|host:port"):
        ps_addresses.check_address(address)
    with pytest.raises(ValueError, match="host:port"):
        PSClient([address])
    monkeypatch.setenv("STRATAGEM_PS_ADDRS", f"127.0.0.1:5000,{address}")
    with pytest.raises(ValueError, match="STRATAGEM_PS_ADDRS"):
        ps_addresses.shard_addresses(None, who="test")


def test_a_token_file_readable_by_others_is_refused(tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text("a-secret-token")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_token_file(f)
    f.chmod(0o600)
    assert read_token_file(f) == "a-secret-token"


def test_a_fifo_as_token_file_is_refused_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    out: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(out, lambda: read_token_file(fifo)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(5)
    assert not t.is_alive(), "reading a FIFO token file blocked"
    assert time.monotonic() - t0 < 1.0
    assert out and "not a regular file" in str(out[0])
    with pytest.raises(ValueError, match="not a regular file"):
        read_token_file(tmp_path)  # a directory


def _catch(out: list[BaseException], fn) -> None:  # noqa: ANN001
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        out.append(exc)


@pytest.mark.parametrize("value", [math.inf, 1e-300, 0, -1, math.nan, 1e300])
def test_every_strategy_refuses_a_timeout_out_of_bounds(value, monkeypatch) -> None:
    from stratagem.registry import strategy_class, strategy_names

    monkeypatch.setenv("STRATAGEM_PS_ADDRS", "127.0.0.1:5000")  # nothing connects

    for name in strategy_names():
        with pytest.raises(ValueError, match=r"timeout must be a finite number in \[0.001"):
            strategy_class(name)(timeout=value)
    with pytest.raises(ValueError, match="timeout"):
        PSClient(["127.0.0.1:5000"], timeout=value)


def test_a_timeout_in_bounds_is_accepted() -> None:
    from stratagem.registry import strategy_class

    assert strategy_class("mirrored")(timeout=0.5).timeout == 0.5
    PSClient(["127.0.0.1:5000"], timeout=1e5).close()

