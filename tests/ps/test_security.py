"""Bad clients are refused cleanly while good clients on the same shard keep working."""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from stratagem.ps import wire
from stratagem.ps.rpc import grpc
from stratagem.ps.server import ShardServer
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = pytest.mark.timeout(30)

TOKEN = "s3cret-token"


@pytest.fixture
def secured():
    server = ShardServer(token=TOKEN, max_message_bytes=1 << 20)
    server.start()
    good = PSClient([server.address], token=TOKEN, timeout=5, max_message_bytes=1 << 20)
    table = ShardedParameters(good, {"w": torch.arange(4.0)},
                              optimizer_spec={"name": "sgd", "lr": 1.0})
    table.register()
    yield server, table
    good.close()
    server.stop(0)


def _raw_call(address: str, data: bytes, token: str | None = TOKEN) -> grpc.RpcError:
    with grpc.insecure_channel(address, options=wire.channel_options(64 << 20)) as ch:
        stub = ch.unary_unary(wire.METHOD)
        md = ((wire.TOKEN_METADATA_KEY, token),) if token is not None else None
        with pytest.raises(grpc.RpcError) as info:
            stub(data, timeout=5, metadata=md)
    return info.value


def _still_serves(table: ShardedParameters) -> None:
    table.push({"w": torch.ones(4)})
    assert_close(table.pull()["w"], torch.arange(4.0) - table.versions["w"])


@pytest.mark.parametrize("token, data, code", [
    (None, wire.encode("health"), grpc.StatusCode.UNAUTHENTICATED),
    ("wrong", wire.encode("health"), grpc.StatusCode.UNAUTHENTICATED),
    ("", wire.encode("shutdown"), grpc.StatusCode.UNAUTHENTICATED),
    (TOKEN, struct.pack("<4sHHI", wire.MAGIC, 1, 0, 0x7FFFFFFF) + b"{}",
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TOKEN, os.urandom(4096), grpc.StatusCode.INVALID_ARGUMENT),
    (TOKEN, pickle.dumps(object()), grpc.StatusCode.INVALID_ARGUMENT),
    (TOKEN, pickle.dumps({"op": "shutdown"}), grpc.StatusCode.INVALID_ARGUMENT),
    (TOKEN, wire.encode("rm -rf"), grpc.StatusCode.INVALID_ARGUMENT),
    (TOKEN, wire.encode("pull", {"names": ["nope"]}), grpc.StatusCode.NOT_FOUND),
    (TOKEN, wire.encode("push", None, [wire.Entry("w", torch.ones(3), 0)]),
     grpc.StatusCode.FAILED_PRECONDITION),
    (TOKEN, bytes(2 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over the 1 MiB gRPC cap
])
def test_bad_requests_are_refused_and_server_keeps_serving(secured, token, data, code) -> None:
    server, table = secured
    err = _raw_call(server.address, data, token)
    assert err.code() == code, err.details()
    _still_serves(table)
    assert not server.wait(0)  # not shut down


def test_client_with_wrong_token_gets_remote_error(secured) -> None:
    server, table = secured
    with PSClient([server.address], token="nope", timeout=5) as bad:
        with pytest.raises(RemoteError, match="STRATAGEM_PS_TOKEN") as info:
            bad.health()
        assert info.value.code == "UNAUTHENTICATED"
    _still_serves(table)


def test_token_from_environment(secured, monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = secured
    monkeypatch.setenv("STRATAGEM_PS_TOKEN", TOKEN)
    with PSClient([server.address], timeout=5) as c:
        assert c.health()[0]["num_tensors"] == 1


def test_shutdown_needs_token_and_stops_server(secured) -> None:
    server, table = secured
    with PSClient([server.address], token="bad", timeout=5) as bad:
        with pytest.raises(RemoteError):
            bad.shutdown()
    assert not server.wait(0.2)
    table.client.shutdown()
    assert server.wait(5)


def test_binding_all_interfaces_warns_without_listening() -> None:
    # The warning comes from the constructor; we never start it, so nothing listens.
    with pytest.warns(RuntimeWarning, match="every network interface.*STRATAGEM_PS_TOKEN"):
        ShardServer("0.0.0.0", 0)
    with pytest.warns(RuntimeWarning, match="every network interface"):
        ShardServer("::", 0, token="t")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_with_token(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    with ShardServer(token=TOKEN, tls_cert=cert, tls_key=key) as server:
        with PSClient([server.address], token=TOKEN, tls_root_cert=cert, timeout=5) as c:
            assert c.health()[0]["ok"]
        # A plaintext client cannot talk to a TLS shard.
        with PSClient([server.address], token=TOKEN, timeout=1) as plain:
            with pytest.raises(Exception, match=server.address):
                plain.health()
