"""A hostile client next to a good one: the shard stays available, bounded and finite.

Each test runs a misbehaving client and checks (1) the refusal names the constraint and
(2) a good client on the same shard is still served (within 5 s, where a blocked one would
wait out its 10 s deadline; ~5 ms on a quiet machine). Amplification cases run the
shard as a process of its own and check its peak RSS (VmHWM) around the hostile request.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
from torch.testing import assert_close

from stratagem.launcher import child_pythonpath, start_ps_shards
from stratagem.ps import wire
from stratagem.ps.rpc import grpc
from stratagem.ps.server import ShardServer
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = pytest.mark.timeout(90)

TOKEN = "hostile-test-token"
MiB = 1 << 20
MD = ((wire.TOKEN_METADATA_KEY, TOKEN),)


# -- helpers ----------------------------------------------------------------------------------

def _raw(address: str, data: bytes, token: str | None = TOKEN, timeout: float = 10.0
         ) -> tuple[bytes | None, grpc.RpcError | None]:
    """One call on a connection of its own (not shared with the good client), sent as
    ``PSClient`` sends it: one message, or chunks with the size declared above
    ``wire.REQUEST_CHUNK_BYTES``."""
    opts = [*wire.channel_options(512 * MiB), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=opts) as ch:
        md = ((wire.TOKEN_METADATA_KEY, token),) if token is not None else ()
        try:
            if len(data) > wire.REQUEST_CHUNK_BYTES:
                md = (*md, (wire.SIZE_METADATA_KEY, str(len(data))))
                return ch.stream_unary(wire.METHOD)(wire.request_chunks(data), timeout=timeout,
                                                    metadata=md), None
            return ch.unary_unary(wire.METHOD)(data, timeout=timeout, metadata=md or None), None
        except grpc.RpcError as exc:
            return None, exc


def _refused(address: str, data: bytes, code: grpc.StatusCode, match: str = "",
             token: str | None = TOKEN) -> str:
    reply, err = _raw(address, data, token)
    assert err is not None, f"expected {code.name}, the shard answered"
    assert err.code() == code, err.details()
    assert match.lower() in (err.details() or "").lower(), err.details()
    return err.details() or ""


def _header_message(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """A frame with a hand-written header (to send what our encoder would never produce)."""
    raw = json.dumps(header).encode()
    head_end = 12 + len(raw)
    pad = (head_end + 7) // 8 * 8 - head_end
    return struct.pack("<4sHHI", wire.MAGIC, 1, 0, len(raw)) + raw + bytes(pad) + payload


# A good client's push+pull takes ~5 ms (p99 30 ms in scripts/ps_stall_soak.py). Delayed by the
# stalled streams, it would wait out its 10 s deadline (their body timeout is 120 s). The bound
# is about the midpoint, so a loaded machine's scheduling delays cannot fail it.
GOOD_STEP_BOUND = 5.0


class Good:
    """A well-behaved worker: its push+pull must keep completing within GOOD_STEP_BOUND."""

    def __init__(self, address: str, name: str = "good") -> None:
        self.client = PSClient([address], token=TOKEN, timeout=10)
        self.table = ShardedParameters(self.client, {f"{name}.w": torch.zeros(256)},
                                       optimizer_spec={"name": "sgd", "lr": 1.0})
        self.table.register()
        self.name = f"{name}.w"
        self.worst = 0.0

    def step(self) -> None:
        t0 = time.perf_counter()
        before = self.table.versions[self.name]
        out = self.table.push({self.name: torch.ones(256)})
        assert out[self.name].applied
        got = self.table.pull()[self.name]
        took = time.perf_counter() - t0
        self.worst = max(self.worst, took)
        assert took < GOOD_STEP_BOUND, f"good client's push+pull took {took:.2f} s"
        assert bool(torch.isfinite(got).all())
        assert self.table.versions[self.name] > before

    def close(self) -> None:
        self.client.close()


class Staller:
    """One connection holding ``n`` streams whose request message never comes."""

    def __init__(self, address: str, n: int, token: str | None) -> None:
        self.channel = grpc.insecure_channel(address,
                                             options=[("grpc.use_local_subchannel_pool", 1)])
        self.release = threading.Event()
        stub = self.channel.stream_unary(wire.METHOD)
        md = ((wire.TOKEN_METADATA_KEY, token),) if token is not None else None
        self.calls = [stub.future(self._never(), timeout=120, metadata=md) for _ in range(n)]

    def _never(self) -> Iterator[bytes]:
        self.release.wait(120)
        return
        yield b""  # a generator that sends nothing

    def close(self) -> None:
        self.release.set()
        for c in self.calls:
            c.cancel()
        self.channel.close()


@pytest.fixture
def shard() -> Iterator[ShardServer]:
    server = ShardServer(token=TOKEN, max_message_bytes=64 * MiB, max_bytes=256 * MiB)
    server.start()
    yield server
    server.stop(0)


@pytest.fixture
def good(shard: ShardServer) -> Iterator[Good]:
    g = Good(shard.address)
    yield g
    g.close()


def _hwm_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)


def _reset_hwm(pid: int) -> bool:
    try:  # "5" resets the peak RSS (Linux >= 4.0, own processes)
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class ProcShard(helpers.ProcShard):
    """A shard in a process of its own, so its RSS is its alone; started and waited for."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        super().__init__(tmp, *extra, token=TOKEN)
        self.wait()

    def growth(self, fn: Any) -> int:
        """Peak RSS growth (bytes) of the shard while ``fn()`` runs."""
        time.sleep(0.2)
        rss0, hwm0 = _hwm_bytes(self.proc.pid)
        base = rss0 if _reset_hwm(self.proc.pid) else hwm0
        fn()
        time.sleep(0.3)
        return _hwm_bytes(self.proc.pid)[1] - base

    def growth_refusing(self, data: bytes, code: grpc.StatusCode, match: str, *, good: str,
                        times: int = 1, token: str | None = TOKEN) -> int:
        """Peak RSS growth (bytes) while ``data`` is sent ``times`` times and refused with
        ``code``, a good client (named ``good``) stepping after each refusal."""
        client = Good(self.address, good)

        def attack() -> None:
            for _ in range(times):
                _refused(self.address, data, code, match, token=token)
                client.step()

        try:
            return self.growth(attack)
        finally:
            client.close()



@pytest.fixture(scope="module")
def proc_shard() -> Iterator[ProcShard]:
    tmp = Path(tempfile.mkdtemp(prefix="stratagem-hostile-"))
    shard = ProcShard(tmp, "--max-message-bytes", str(300 * MiB), "--max-bytes",
                      str(48 * MiB))
    yield shard
    shard.stop()
    shutil.rmtree(tmp, ignore_errors=True)


# -- 1. availability --------------------------------------------------------------------------

def test_stalled_streams_on_one_connection_do_not_delay_a_good_client(shard, good) -> None:
    # 40 authenticated streams that never send their message (the shard holds 32 of them:
    # max_concurrent_streams) and 40 unauthenticated ones on other connections, for ~10 s.
    stalled = Staller(shard.address, 40, TOKEN)
    intruder = Staller(shard.address, 40, None)
    try:
        deadline = time.monotonic() + 5
        while good.client.health()[0]["calls_in_flight"] < 33:  # 32 stalled + this call
            assert time.monotonic() < deadline, "the stalled streams never reached the shard"
            time.sleep(0.05)
        end = time.monotonic() + 10
        steps = 0
        while time.monotonic() < end:
            good.step()
            steps += 1
            time.sleep(0.05)
        # ~150 steps on a quiet machine; a blocked client would manage at most one.
        assert steps >= 10 and good.worst < GOOD_STEP_BOUND
        # The unauthenticated ones were refused at once, on their metadata alone.
        for c in intruder.calls:
            with pytest.raises(grpc.RpcError) as info:
                c.result(timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stalled.close()
        intruder.close()


def test_a_body_that_never_comes_is_cut_by_the_body_timeout() -> None:
    with ShardServer(token=TOKEN, body_timeout=1.0) as server:
        g = Good(server.address)
        stalled = Staller(server.address, 3, TOKEN)
        try:
            t0 = time.monotonic()
            for c in stalled.calls:
                with pytest.raises(grpc.RpcError) as info:
                    c.result(timeout=20)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "body_timeout" in (info.value.details() or "")
            # Cut at the 1 s body timeout; uncut, they would wait out the 20 s above.
            assert time.monotonic() - t0 < 1.0 + 5.0
            g.step()
        finally:
            stalled.close()
            g.close()


def test_a_chunked_body_that_stops_is_cut_and_gives_back_its_admission() -> None:
    # A chunked request is admitted by its declared size at once (no wait), then its first
    # chunk arrives and the rest never does: the body timeout cuts it, and its admission is
    # given back, so a chunked request after it is admitted and served.
    with ShardServer(token=TOKEN, body_timeout=1.0, max_inflight_bytes=8 * MiB) as server:
        release = threading.Event()
        declared = 2 * wire.REQUEST_CHUNK_BYTES

        def first_chunk_then_nothing() -> Iterator[bytes]:
            yield _header_message({"op": "pull", "fields": {}, "tensors": []}).ljust(
                wire.REQUEST_CHUNK_BYTES, b"\0")
            release.wait(60)

        channel = grpc.insecure_channel(server.address,
                                        options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            stub = channel.stream_unary(wire.METHOD)
            md = (*MD, (wire.SIZE_METADATA_KEY, str(declared)))
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                stub(first_chunk_then_nothing(), timeout=20, metadata=md)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "body_timeout" in (info.value.details() or "")
            assert time.monotonic() - t0 < 1.0 + 5.0
        finally:
            release.set()
            channel.close()
        assert server.admission.receiving_bytes == 0 and server.admission.inflight_bytes == 0
        client = PSClient([server.address], token=TOKEN, timeout=10)
        try:
            table = ShardedParameters(client, {"w": torch.zeros(3 * MiB // 4)},
                                      optimizer_spec={"name": "sgd", "lr": 1.0})
            table.register()  # 3 MiB: chunked, admitted after the cut one
            out = table.push({"w": torch.ones(3 * MiB // 4)})
            assert out["w"].applied
        finally:
            client.close()


def test_unauthenticated_huge_bodies_are_not_buffered(proc_shard) -> None:
    grew = proc_shard.growth_refusing(bytes(128 * MiB), grpc.StatusCode.UNAUTHENTICATED,
                                      "token", good="unauth", times=4, token=None)
    # 4 x 128 MiB refused on the metadata alone: nothing near a body was kept.
    assert grew < 32 * MiB, f"shard RSS peak grew by {grew / MiB:.1f} MiB"


# -- 2. bounded work --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big(proc_shard) -> Iterator[PSClient]:
    client = PSClient([proc_shard.address], token=TOKEN, timeout=30,
                      max_message_bytes=300 * MiB)
    table = ShardedParameters(client, {"big.w": torch.zeros(MiB // 4),
                                       "big.emb": torch.zeros(2, MiB // 4)},
                              optimizer_spec={"name": "sgd", "lr": 0.1})
    table.register()
    yield client
    client.close()


def test_pull_naming_one_tensor_256_times_is_refused_before_allocating(proc_shard, big) -> None:
    data = wire.encode("pull", {"names": ["big.w"] * 256})
    assert len(data) < 4096  # a ~3 KB request asking for 256 MiB
    grew = proc_shard.growth_refusing(data, grpc.StatusCode.INVALID_ARGUMENT, "more than once",
                                      good="amp1")
    assert grew < 16 * MiB, f"shard RSS peak grew by {grew / MiB:.1f} MiB"


def test_pull_rows_repeating_a_row_256_times_is_refused(proc_shard, big) -> None:
    data = wire.encode("pull_rows", {"name": "big.emb"},
                       [wire.Entry("indices", torch.zeros(256, dtype=torch.int64))])
    grew = proc_shard.growth_refusing(data, grpc.StatusCode.INVALID_ARGUMENT, "repeat",
                                      good="amp2")
    assert grew < 16 * MiB, f"shard RSS peak grew by {grew / MiB:.1f} MiB"


def test_set_state_pointing_200_entries_at_one_tensor_is_refused(proc_shard, big) -> None:
    slots = [{"name": f"evil{i}", "param": 0, "mode": "elastic"} for i in range(200)]
    data = wire.encode("set_state", {"slots": slots}, [wire.Entry("x", torch.zeros(MiB // 4))])
    grew = proc_shard.growth_refusing(data, grpc.StatusCode.INVALID_ARGUMENT, "used twice",
                                      good="amp3")
    assert grew < 16 * MiB, f"shard RSS peak grew by {grew / MiB:.1f} MiB"
    health = PSClient([proc_shard.address], token=TOKEN).health()[0]
    assert not any(n.startswith("evil") for n in health["versions"])


def test_registered_bytes_stop_at_the_quota(proc_shard, big) -> None:
    good = Good(proc_shard.address, "quota")
    before = PSClient([proc_shard.address], token=TOKEN).health()[0]["charged_bytes"]
    refused = 0
    rss = []
    try:
        for i in range(40):  # 40 x 4 MiB elastic tensors against a 48 MiB quota
            data = wire.encode("register", {"entries": [{"mode": "elastic"}], "specs": []},
                               [wire.Entry(f"fill{i}", torch.zeros(MiB))])
            reply, err = _raw(proc_shard.address, data)
            if err is not None:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
                assert "max_bytes" in (err.details() or "") and "--max-bytes" in (
                    err.details() or "")
                refused += 1
                rss.append(_hwm_bytes(proc_shard.proc.pid)[0])
            good.step()
        health = PSClient([proc_shard.address], token=TOKEN).health()[0]
        assert health["charged_bytes"] <= 48 * MiB and health["charged_bytes"] > before
        assert refused >= 25
        # Once the quota is reached, more requests do not grow the shard.
        assert rss[-1] - rss[0] < 24 * MiB, [r // MiB for r in rss]
    finally:
        good.close()


def test_reply_over_the_message_cap_is_refused_before_it_is_built() -> None:
    with ShardServer(token=TOKEN, max_message_bytes=2 * MiB) as server:
        good = Good(server.address)
        client = PSClient([server.address], token=TOKEN, timeout=5,
                          max_message_bytes=2 * MiB)
        a = ShardedParameters(client, {"a": torch.zeros(MiB // 8 * 3)},
                              optimizer_spec={"name": "sgd", "lr": 1.0})
        b = ShardedParameters(client, {"b": torch.zeros(MiB // 8 * 3)},
                              optimizer_spec={"name": "sgd", "lr": 1.0})
        a.register()
        b.register()
        # a and b fit one message each (1.5 MiB) but not together (3 MiB > 2 MiB).
        _refused(server.address, wire.encode("pull", {"names": ["a", "b"]}),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "max_message_bytes")
        good.step()
        client.close()
        good.close()


def test_register_is_all_or_nothing(shard, good) -> None:
    entries = [wire.Entry("ok", torch.zeros(4)), wire.Entry("bad", torch.tensor([1.0, math.nan]))]
    data = wire.encode("register", {"entries": [{"mode": "elastic"}] * 2, "specs": []}, entries)
    _refused(shard.address, data, grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")
    _refused(shard.address, wire.encode("pull", {"names": ["ok"]}), grpc.StatusCode.NOT_FOUND)
    good.step()


def test_set_state_may_not_change_a_registered_shape(shard, good) -> None:
    slots = [{"name": good.name, "param": 0, "mode": "async",
              "spec": {"name": "sgd", "lr": 1.0}}]
    data = wire.encode("set_state", {"slots": slots}, [wire.Entry("x", torch.zeros(10, 10))])
    _refused(shard.address, data, grpc.StatusCode.FAILED_PRECONDITION, "shape")
    # Optimizer state of the wrong shape (it would broadcast inside Adam) is refused too.
    slots = [{"name": "adam", "param": 0, "mode": "async", "spec": {"name": "adam"},
              "opt": {"step": 1, "exp_avg": 2, "exp_avg_sq": 3}}]
    data = wire.encode("set_state", {"slots": slots}, [
        wire.Entry("p", torch.zeros(8)), wire.Entry("s", torch.tensor(1.0)),
        wire.Entry("m", torch.zeros(1)), wire.Entry("v", torch.zeros(8))])
    _refused(shard.address, data, grpc.StatusCode.INVALID_ARGUMENT, "exp_avg")
    good.step()


# -- 3. no poisoning --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gradients_are_refused_and_the_model_stays_finite(shard, good, bad) -> None:
    evil = PSClient([shard.address], token=TOKEN, timeout=5)
    table = ShardedParameters(evil, {good.name: torch.zeros(256), "other": torch.zeros(3)},
                              optimizer_spec={"name": "sgd", "lr": 1.0})
    table.register()
    before = table.pull()
    g = torch.ones(256)
    g[7] = bad
    with pytest.raises(RemoteError, match="NaN or Inf") as info:
        table.push({"other": torch.ones(3), good.name: g})  # one bad tensor refuses all
    assert info.value.code == "INVALID_ARGUMENT"
    after = table.pull()
    for k in before:
        assert_close(after[k], before[k])  # nothing of the request was applied
    good.step()
    with pytest.raises(RemoteError, match="NaN or Inf"):
        table.push_sparse("other", torch.tensor([0]), torch.tensor([[bad]]).reshape(1))
    evil.close()


def test_non_finite_elastic_exchange_and_state_are_refused(shard, good) -> None:
    evil = PSClient([shard.address], token=TOKEN, timeout=5)
    center = ShardedParameters(evil, {"c": torch.ones(5)}, mode="elastic")
    center.register()
    with pytest.raises(RemoteError, match="NaN or Inf"):
        center.elastic_exchange({"c": torch.tensor([1.0, 2.0, math.nan, 0.0, 0.0])}, 0.5)
    assert_close(center.pull()["c"], torch.ones(5))
    with pytest.raises(RemoteError, match="NaN or Inf"):
        center.set_state({"params": {"c": torch.full((5,), math.inf)}})
    assert_close(center.pull()["c"], torch.ones(5))
    good.step()
    evil.close()


def _torch_error(cls: type[torch.optim.Optimizer], **hyper: Any) -> str:
    p = torch.nn.Parameter(torch.zeros(2))
    try:
        opt = cls([p], **hyper)
        p.grad = torch.ones(2)
        opt.step()
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    raise AssertionError(f"torch accepted {hyper}")


@pytest.mark.parametrize("name, raw, torch_hyper", [
    ("sgd", '{"lr": 1e400}', None),
    ("sgd", '{"lr": -5}', {"lr": -5}),
    ("sgd", '{"lr": [0.1]}', {"lr": (0.1,)}),  # lists arrive as tuples
    ("adam", '{"betas": [0.9]}', {"betas": (0.9,)}),
    ("adam", '{"betas": [0.9, 0.99, 0.5]}', {"betas": (0.9, 0.99, 0.5)}),
    ("adam", '{"eps": -1}', {"eps": -1}),
])
def test_bad_hyperparameters_are_refused_with_torchs_error(shard, good, name, raw,
                                                           torch_hyper) -> None:
    evil = PSClient([shard.address], token=TOKEN, timeout=5)
    table = ShardedParameters(evil, {"h": torch.zeros(3)},
                              optimizer_spec={"name": name, "lr": 1.0})
    table.register()
    # Hand-written JSON: our own client would refuse most of these before sending.
    header = ('{"op":"set_hyperparams","fields":{"names":["h"],"hyperparams":' + raw +
              '},"tensors":[]}').encode()
    data = struct.pack("<4sHHI", wire.MAGIC, 1, 0, len(header)) + header
    detail = _refused(shard.address, data, grpc.StatusCode.INVALID_ARGUMENT)
    if torch_hyper is not None:
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[name]
        assert _torch_error(cls, **torch_hyper) in detail
    else:
        assert "overflows" in detail
    # The slot still works with its old learning rate, for everybody.
    table.push({"h": torch.ones(3)})
    got = table.pull()["h"]
    assert bool(torch.isfinite(got).all()) and float(got[0]) < 0
    good.step()
    evil.close()


def test_refusals_are_logged_once_per_interval_without_tracebacks(shard, good, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stratagem.ps.server")
    for _ in range(30):
        _refused(shard.address, wire.encode("health"), grpc.StatusCode.UNAUTHENTICATED,
                 token="wrong")
        _refused(shard.address, wire.encode("pull", {"names": ["x", "x"]}),
                 grpc.StatusCode.INVALID_ARGUMENT)
    lines = [r for r in caplog.records if r.name == "stratagem.ps.server"
             and "refused" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert all(r.exc_info is None for r in caplog.records)
    good.step()


# -- 4. secure by default ---------------------------------------------------------------------

@pytest.mark.parametrize("token", ["", "   ", "\n\t"])
def test_blank_token_is_an_error_at_start_up(token, monkeypatch, tmp_path) -> None:
    with pytest.raises(ValueError, match="empty or whitespace"):
        ShardServer(token=token)
    with pytest.raises(ValueError, match="empty or whitespace"):
        PSClient(["127.0.0.1:1"], token=token)
    monkeypatch.setenv("STRATAGEM_PS_TOKEN", token)
    with pytest.raises(ValueError, match="STRATAGEM_PS_TOKEN"):
        ShardServer()
    monkeypatch.delenv("STRATAGEM_PS_TOKEN")
    f = tmp_path / "token"
    f.write_text(token)
    from stratagem.cli import main

    assert main(["ps", "--port", "0", "--token-file", str(f)]) == 2


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "::0", "[::]", "0:0:0:0:0:0:0:0", "",
                                  "10.1.2.3"])
def test_non_loopback_binds_warn(host) -> None:
    with pytest.warns(RuntimeWarning, match="without a token"):
        ShardServer(host, 0)
    with pytest.warns(RuntimeWarning, match="clear text"):
        ShardServer(host, 0, token="t")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"])
def test_loopback_binds_do_not_warn(host, recwarn) -> None:
    ShardServer(host, 0)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_start_up_line_names_address_auth_tls_and_limits(caplog) -> None:
    caplog.set_level(logging.INFO, logger="stratagem.ps.server")
    with ShardServer(token=TOKEN, max_bytes=123456) as server:
        line = next(r.getMessage() for r in caplog.records if "listening" in r.getMessage())
        for part in (server.address, "auth: token", "TLS: off", "max registered 123456 B",
                     "streams per connection", "connection age"):
            assert part in line, line


def test_tls_errors_are_reported_as_tls_errors(tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ValueError, match="TLS certificate/key refused"):
        ShardServer(token=TOKEN, tls_cert=cert, tls_key=key)
    with pytest.raises(ValueError, match="TLS certificate .*missing.pem.* cannot be read"):
        ShardServer(token=TOKEN, tls_cert=tmp_path / "missing.pem", tls_key=key)
    with pytest.raises(ValueError, match="not a PEM certificate"):
        ShardServer(token=TOKEN, tls_cert=b"junk", tls_key=b"junk")
    with pytest.raises(ValueError, match="root certificate.*nope.pem.*cannot be read"):
        PSClient(["127.0.0.1:1"], tls_root_cert=tmp_path / "nope.pem")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_mismatched_tls_key_is_a_tls_error(tmp_path) -> None:
    paths = {}
    for n in ("a", "b"):
        paths[n] = (tmp_path / f"{n}.key", tmp_path / f"{n}.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(paths[n][0]), "-out", str(paths[n][1]),
                        "-subj", "/CN=localhost"], check=True, capture_output=True, timeout=30)
    with pytest.raises(ValueError, match="TLS certificate/key refused"):
        ShardServer(token=TOKEN, tls_cert=paths["a"][1], tls_key=paths["b"][0])


@pytest.mark.timeout(120)
def test_launcher_shards_get_a_fresh_token_through_a_private_file() -> None:
    with start_ps_shards(1) as shards, start_ps_shards(1) as other:
        assert shards.token and other.token and shards.token != other.token
        assert shards.token_file is not None
        assert os.stat(shards.token_file).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(shards.token_file)).st_mode & 0o777 == 0o700
        cmdline = Path(f"/proc/{shards.procs[0].pid}/cmdline").read_bytes()
        assert shards.token.encode() not in cmdline
        env = shards.env()
        assert env["STRATAGEM_PS_TOKEN_FILE"] == shards.token_file
        # Without the token: refused, shutdown included.
        with PSClient(shards.addresses, timeout=5) as anon:
            with pytest.raises(RemoteError) as info:
                anon.shutdown()
            assert info.value.code == "UNAUTHENTICATED"
        # A worker built from the environment the launcher hands out is served.
        code = ("from stratagem.ps.transport import PSClient\nimport os\n"
                "c = PSClient(os.environ['STRATAGEM_PS_ADDRS'].split(','), timeout=10)\n"
                "print(c.health()[0]['ok'])\n")
        child = {k: v for k, v in os.environ.items() if not k.startswith("STRATAGEM_PS")}
        child.update(env)
        child["PYTHONPATH"] = child_pythonpath(child)
        out = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True,
                             timeout=60, text=True)
        assert out.stdout.strip() == "True", out.stderr
        assert all(p.poll() is None for p in shards.procs)


def test_a_failing_slot_logs_one_line_not_a_traceback_per_push(shard, good, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stratagem.ps.server")
    client = PSClient([shard.address], token=TOKEN, timeout=5)
    table = ShardedParameters(client, {"broken": torch.zeros(3)},
                              optimizer_spec={"name": "adam", "lr": 0.1})
    table.register()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise KeyError("exp_avg")

    shard.service.slots["broken"].optimizer.step = boom  # type: ignore[union-attr,method-assign]
    for _ in range(20):
        with pytest.raises(RemoteError, match="KeyError") as info:
            table.push({"broken": torch.ones(3)})
        assert info.value.code == "INTERNAL"
        good.step()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    assert "KeyError" in errors[0].getMessage()
    client.close()


def test_a_finite_gradient_whose_sum_overflows_is_accepted(shard) -> None:
    with PSClient([shard.address], token=TOKEN, timeout=5) as client:
        table = ShardedParameters(client, {"big_values": torch.zeros(4)},
                                  optimizer_spec={"name": "sgd", "lr": 1e-30})
        table.register()
        g = torch.full((4,), 3e38)  # finite, but the float32 sum is inf
        assert table.push({"big_values": g})["big_values"].applied
        assert_close(table.pull()["big_values"], torch.full((4,), -3e8))
