"""The heal transport of fault-tolerant training (the hostile-input rules):
``stratagem.ft.transport.SafeHealTransport`` round-trips torchft's state dict bitwise, refuses
a wrong token before sending anything, never unpickles (a hostile peer's pickle has no side
effect), refuses oversized declarations before allocating, binds loopback only, and times
out. Threads and loopback only."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import pickle
import secrets
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.ft import transport as ft_transport  # noqa: E402
from stratagem.ft.transport import MAGIC, SafeHealTransport  # noqa: E402

pytestmark = pytest.mark.timeout(30)
TOKEN = secrets.token_bytes(32)
T = timedelta(seconds=5)


def _transport(token: bytes = TOKEN, **kw: Any) -> SafeHealTransport:
    kw.setdefault("timeout", 5.0)
    kw.setdefault("max_bytes", 1 << 24)
    return SafeHealTransport(token=token, **kw)


def _torchft_state() -> dict[str, Any]:
    """What torchft's Manager._manager_state_dict hands over: model, optimizer (int keys),
    ints, floats, strings, under "user", and the manager's own counters under "torchft"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
    # AdamW's state_dict() after one step, written out (a real step would import
    # torch._dynamo, ~10 s on this machine, for the same dict).
    optim = {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                           "exp_avg_sq": torch.rand_like(p)}
                       for i, p in enumerate(model.parameters())},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                               "weight_decay": 0.01, "amsgrad": False, "maximize": False,
                               "foreach": None, "capturable": False, "differentiable": False,
                               "fused": None, "params": [0, 1, 2, 3]}]}
    return {
        "user": {
            "model": model.state_dict(),
            "optim": optim,
            "extra": {"bf16": torch.randn(3).bfloat16(), "ids": torch.arange(4),
                      "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 3),
                      "loss": 0.1 + 0.2, "inf": math.inf, "name": "run-1", "shape": (2, 3),
                      "none": None, "big": 2 ** 62},
        },
        "torchft": {"step": 7, "batches_committed": 28},
    }


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), f"{where}: {a!r} != {b!r}"


# ---------------------------------------------------------------------- round trip
def test_round_trip_bitwise_to_two_joiners_and_a_joiner_that_asks_first() -> None:
    server, client, other = _transport(), _transport(), _transport()
    try:
        assert isinstance(server, CheckpointTransport)
        state = _torchft_state()
        # A joiner may ask before the live replica's send_checkpoint ran: it waits for it.
        early: list[Any] = []
        t = threading.Thread(target=lambda: early.append(
            other.recv_checkpoint(0, server.metadata(), 7, T)))
        t.start()
        time.sleep(0.2)
        server.send_checkpoint([1, 2], 7, state, T)
        got = client.recv_checkpoint(0, server.metadata(), 7, T)
        t.join(5)
        for received in (got, early[0]):
            _same(state, received)
            assert list(received["user"]["optim"]["state"]) == [0, 1, 2, 3]  # int keys
        # The state was encoded once, as a snapshot: changing it after send does not leak.
        state["user"]["model"]["0.weight"].add_(1.0)
        again = client.recv_checkpoint(0, server.metadata(), 7, T)
        assert not again["user"]["model"]["0.weight"].equal(state["user"]["model"]["0.weight"])
        # The byte counters (what a heal moved): one copy of the state per fetch.
        tensor_bytes = sum(v.numel() * v.element_size() for v in state["user"]["model"].values())
        one = other.bytes_received
        assert one > tensor_bytes and client.bytes_received == 2 * one
        deadline = time.monotonic() + 2.0
        while server.bytes_served < 3 * one and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.bytes_served == 3 * one
        # A wrong step is refused by the server, naming both.
        with pytest.raises(sg.CheckpointError, match="serving step 7, asked for step 8"):
            client.recv_checkpoint(0, server.metadata(), 8, T)
        # After disallow_checkpoint nothing is served: the joiner times out.
        server.disallow_checkpoint()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="timed out"):
            client.recv_checkpoint(0, server.metadata(), 7, timedelta(seconds=0.5))
        assert time.monotonic() - t0 < 2.0
    finally:
        for x in (server, client, other):
            x.shutdown()


def test_sender_refuses_what_the_codec_cannot_store_and_oversized_states() -> None:
    server = _transport(max_bytes=4096)
    try:
        with pytest.raises(sg.CheckpointError, match=r"user\.sched\.fn is a function"):
            server.send_checkpoint([1], 1, {"user": {"sched": {"fn": lambda s: s}}}, T)
        with pytest.raises(sg.CheckpointError, match="over max_bytes=4096.*Fix: raise max_bytes"):
            server.send_checkpoint([1], 1, {"user": {"w": torch.zeros(2048)}}, T)
    finally:
        server.shutdown()


def test_constructor_validates_its_arguments() -> None:
    with pytest.raises(TypeError, match="token must be bytes"):
        SafeHealTransport(token="secret-secret-secret", timeout=1.0, max_bytes=10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SafeHealTransport(token=b"short", timeout=1.0, max_bytes=10)
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        SafeHealTransport(token=TOKEN, timeout=math.inf, max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        SafeHealTransport(token=TOKEN, timeout=1.0, max_bytes=0)


# ---------------------------------------------------------------------- exposure
def _listening(port: int) -> list[str]:
    """Local addresses of this machine's listening TCP sockets on ``port`` (/proc/net)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":
                found.append(addr)
    return found


def test_server_binds_loopback_only_and_refuses_other_hosts() -> None:
    server = _transport()
    try:
        host, port = server.metadata().rsplit(":", 1)
        assert host == "127.0.0.1"
        assert _listening(int(port)) == ["0100007F"]  # 127.0.0.1, nothing else
    finally:
        server.shutdown()
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="every network interface"):
            _transport(host=host, allow_remote=True)
    with pytest.raises(ValueError, match="not a loopback address.*allow_remote=True"):
        _transport(host="10.1.2.3")
    client = _transport()
    try:
        with pytest.raises(sg.CheckpointError, match="not on loopback.*allow_remote"):
            client.recv_checkpoint(0, "10.1.2.3:4000", 1, T)
        with pytest.raises(sg.CheckpointError, match="no valid host and port"):
            client.recv_checkpoint(0, "127.0.0.1:99999", 1, T)
    finally:
        client.shutdown()


# ---------------------------------------------------------------------- authentication
def test_wrong_token_is_refused_and_nothing_is_sent() -> None:
    server = _transport()
    good, bad = _transport(), _transport(token=secrets.token_bytes(32))
    try:
        server.send_checkpoint([1], 3, _torchft_state(), T)
        with pytest.raises(sg.CheckpointError, match="refused our token"):
            bad.recv_checkpoint(0, server.metadata(), 3, T)
        # By hand: after a wrong MAC the server closes; not one byte past its greeting.
        host, port = server.metadata().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.settimeout(5)
            hello = _read(s, 40)
            assert hello[:8] == MAGIC
            s.sendall(MAGIC + secrets.token_bytes(32) + struct.pack(">q", 3) + b"\0" * 32)
            assert s.recv(1 << 16) == b""  # EOF: nothing sent
        # A good client next to it is still served.
        _same(good.recv_checkpoint(0, server.metadata(), 3, T), _torchft_state())
    finally:
        for x in (server, good, bad):
            x.shutdown()


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


# ---------------------------------------------------------------------- hostile servers
class _Hostile:
    """A fake heal server on loopback: ``behave(conn)`` speaks (or not) the protocol."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.behave = behave
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                self.behave(conn)
            except OSError:
                pass

    @property
    def metadata(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


def _signed(token: bytes, tensors: bytes, text: bytes, *, step: int = 1,
            declare: tuple[int, int] | None = None) -> Callable[[socket.socket], None]:
    """A server that knows ``token`` and follows the protocol, sending the given parts."""

    def behave(conn: socket.socket) -> None:
        nonce = secrets.token_bytes(32)
        conn.sendall(MAGIC + nonce)
        auth = _read(conn, 80)
        client_nonce = auth[8:40]
        n_t, n_j = declare if declare is not None else (len(tensors), len(text))
        head = struct.pack(">8sBqQQ32s32s", MAGIC, 0, step, n_t, n_j,
                           hashlib.sha256(tensors).digest(), hashlib.sha256(text).digest())
        mac = hmac.new(token, b"server\0" + client_nonce + nonce + head, hashlib.sha256).digest()
        conn.sendall(head + mac + tensors + text)
        conn.settimeout(5)
        conn.recv(1)  # until the client closes

    return behave


class _Payload:
    """Unpickling this creates a file: the side effect that must never happen."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_pickle_from_a_hostile_server_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    client = _transport()
    cases = {
        # no token: raw pickle bytes in place of the greeting
        "raw": (lambda conn: conn.sendall(evil + b"\0" * 200), "not a stratagem heal server"),
        # a peer with the token (a compromised replica): pickle as the tensor part
        "tensors": (_signed(TOKEN, evil, b"null"), "header length|not a safetensors|not valid"),
        # ... and as the JSON part
        "json": (_signed(TOKEN, _st_empty(), evil), "not valid JSON"),
        # without the token, a well-formed frame carrying a pickle
        "unsigned": (_signed(secrets.token_bytes(32), evil, b"null"), "not signed with our token"),
    }
    try:
        for name, (behave, text) in cases.items():
            hostile = _Hostile(behave)
            try:
                with pytest.raises(sg.CheckpointError, match=text):
                    client.recv_checkpoint(0, hostile.metadata, 1, T)
            finally:
                hostile.close()
            assert not marker.exists(), f"{name}: the pickle ran"
        # Check the probe itself: unpickling it does create the file.
        pickle.loads(evil).close()
        assert marker.exists()
    finally:
        client.shutdown()


def _st_empty() -> bytes:
    import safetensors.torch
    return safetensors.torch.save({})


@pytest.mark.parametrize("signed", [True, False])
def test_oversized_declaration_is_refused_before_allocation(signed: bool) -> None:
    token = TOKEN if signed else secrets.token_bytes(32)
    hostile = _Hostile(_signed(token, b"", b"", declare=(1 << 40, 1 << 30)))
    client = _transport(max_bytes=1 << 20)
    try:
        tracemalloc.start()
        try:
            text = "over max_bytes=1048576; nothing was allocated" if signed else "not signed"
            with pytest.raises(sg.CheckpointError, match=text):
                client.recv_checkpoint(0, hostile.metadata, 1, T)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 256 << 10, peak  # well under max_bytes, let alone the 1 TiB declared
    finally:
        hostile.close()
        client.shutdown()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_declared_2_gib_state_is_refused_by_the_joiners_own_bound() -> None:
    """A peer holding the token declares 2 GiB to a joiner whose own state is 4 KiB: refused
    against the bound that follows the joiner's state (4x + 16 MiB), before any allocation,
    although max_bytes (the cap) would allow it."""
    own = {"user": {"w": torch.ones(1024)}}
    bound = ft_transport.heal_bound(own)
    assert bound == 4 * 4096 + ft_transport.HEAL_BOUND_SLACK
    hostile = _Hostile(_signed(TOKEN, b"", b"", declare=(2 << 30, 0)))
    client = _transport(max_bytes=64 << 30, bound=lambda: ft_transport.heal_bound(own))
    try:
        tracemalloc.start()
        try:
            with pytest.raises(sg.CheckpointError,
                               match=rf"declares 2147483648 bytes.*over this replica's bound of "
                                     rf"{bound} bytes.*nothing was allocated"):
                client.recv_checkpoint(0, hostile.metadata, 1, T)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 256 << 10, peak
    finally:
        hostile.close()
        client.shutdown()


def test_the_receive_buffer_grows_as_the_bytes_arrive() -> None:
    """A peer with the token declares 512 MiB (within the bound) and sends 1 MiB, then
    nothing: the joiner times out having committed about what arrived, not 512 MiB."""
    declared, sent = 512 << 20, 1 << 20

    def stall(conn: socket.socket) -> None:
        _signed(TOKEN, b"\0" * sent, b"", declare=(declared, 0))(conn)

    hostile = _Hostile(stall)
    client = _transport(max_bytes=1 << 30)
    try:
        before = _rss()
        with pytest.raises(TimeoutError, match="timed out"):
            client.recv_checkpoint(0, hostile.metadata, 1, timedelta(seconds=1.0))
        grown = _rss() - before
        assert grown < 64 << 20, grown  # 1 MiB arrived; zero-filling would be 512 MiB
    finally:
        hostile.close()
        client.shutdown()


def test_an_idle_connection_flood_does_not_lock_out_a_joiner() -> None:
    """More idle, never-authenticating connections than the server admits at once, opened
    before and kept open during a joiner's heal: the joiner is served at once; the idle
    ones are evicted (oldest first) or dropped at the authentication deadline."""
    server = _transport(timeout=30.0)
    client = _transport()
    idle: list[socket.socket] = []
    try:
        server.send_checkpoint([1], 2, {"user": {"w": torch.ones(3)}, "torchft": {"step": 2}}, T)
        host, port = server.metadata().rsplit(":", 1)
        for _ in range(ft_transport.MAX_PENDING + ft_transport.MAX_CONNECTIONS + 8):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        t0 = time.monotonic()
        got = client.recv_checkpoint(0, server.metadata(), 2, T)
        assert got["user"]["w"].equal(torch.ones(3))
        assert time.monotonic() - t0 < 2.0  # not after the idle ones' deadline (5 s)
        # The oldest were evicted to make room: they read the greeting, then the end.
        first = idle[0]
        first.settimeout(5)
        assert _read(first, 40)[:8] == MAGIC and first.recv(1) == b""
        # The newest are dropped at the authentication deadline (its own, shorter than the
        # heal's 30 s timeout).
        last = idle[-1]
        last.settimeout(ft_transport.AUTH_TIMEOUT + 5)
        assert _read(last, 40)[:8] == MAGIC
        t0 = time.monotonic()
        assert last.recv(1) == b""
        assert time.monotonic() - t0 < ft_transport.AUTH_TIMEOUT + 2
    finally:
        for sock in idle:
            sock.close()
        server.shutdown()
        client.shutdown()


# ---------------------------------------------------------------------- timeouts
def test_a_silent_or_trickling_server_times_out_within_the_timeout() -> None:
    def silent(conn: socket.socket) -> None:  # accepts, then says nothing until closed
        conn.settimeout(5)
        conn.recv(1)

    def trickle(conn: socket.socket) -> None:  # one byte per 0.2 s: each recv succeeds
        for b in MAGIC + b"\0" * 32:
            conn.sendall(bytes([b]))
            time.sleep(0.2)

    client = _transport()
    try:
        for behave in (silent, trickle):
            hostile = _Hostile(behave)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError, match="timed out"):
                    client.recv_checkpoint(0, hostile.metadata, 1, timedelta(seconds=0.6))
                assert time.monotonic() - t0 < 1.5
            finally:
                hostile.close()
    finally:
        client.shutdown()


def test_a_client_that_never_authenticates_is_dropped_and_others_are_served() -> None:
    server = _transport(timeout=0.5)
    client = _transport()
    try:
        server.send_checkpoint([1], 2, {"user": {"w": torch.ones(3)}, "torchft": {"step": 2}}, T)
        host, port = server.metadata().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as idle:
            idle.settimeout(5)
            assert _read(idle, 40)[:8] == MAGIC
            got = client.recv_checkpoint(0, server.metadata(), 2, T)  # served meanwhile
            assert got["user"]["w"].equal(torch.ones(3))
            t0 = time.monotonic()
            assert idle.recv(1) == b""  # dropped after the server's timeout
            assert time.monotonic() - t0 < 2.0
    finally:
        server.shutdown()
        client.shutdown()
    # shutdown closed the server and joined its thread.
    assert not server._thread.is_alive()  # noqa: SLF001 - the join is the behaviour tested
    assert ft_transport.MAX_CONNECTIONS >= 2


# ---------------------------------------------------------------------- in torchft's Manager
class _Counting(SafeHealTransport):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.sent = self.received = 0

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        self.sent += 1
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict[str, Any]:
        out = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.received += 1
        return out


@pytest.mark.timeout(60)
def test_torchft_manager_heals_through_it() -> None:
    """Two replica groups (threads) with different initial weights: torchft's init_sync heals
    one from the other at step 0 through SafeHealTransport, and they end bitwise equal."""
    import torch.distributed as dist
    from torchft._torchft import LighthouseServer
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)

    def replica(rid: int) -> tuple[dict[str, torch.Tensor], _Counting]:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        torch.manual_seed(rid)  # different weights: only a heal makes them equal
        model = torch.nn.Linear(3, 4)
        opt = torch.optim.Adam(model.parameters())

        def load(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])

        transport = _Counting(token=TOKEN, timeout=10.0, max_bytes=1 << 20)
        manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2, load_state_dict=load,
                          state_dict=lambda: {"model": model.state_dict(),
                                              "optim": opt.state_dict()},
                          replica_id=str(rid), store_addr="127.0.0.1", store_port=store.port,
                          rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
                          hostname="127.0.0.1", timeout=timedelta(seconds=10),
                          checkpoint_transport=transport)
        try:
            ddp, wrapped = DistributedDataParallel(manager, model), OptimizerWrapper(manager, opt)
            gen = torch.Generator().manual_seed(rid)
            while manager.current_step() < 3:
                wrapped.zero_grad()
                ddp(torch.rand(2, 3, generator=gen)).sum().backward()
                wrapped.step()
            return {k: v.clone() for k, v in model.state_dict().items()}, transport
        finally:
            manager.shutdown(wait=False)

    try:
        results: list[Any] = [None, None]
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, replica(r)))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        lighthouse.shutdown()
    assert all(r is not None for r in results), "a replica failed (see the log)"
    (a, ta), (b, tb) = results
    _same(a, b)
    assert ta.sent + tb.sent >= 1 and ta.received + tb.received == 1  # one heal, at step 0


def test_stratagem_imports_without_torchft(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft is optional: with it unimportable, stratagem.ft imports and only the transport
    module needs it; no other stratagem module imports torchft. (In process: a fresh
    interpreter took 46 s to import torch on this loaded machine.)"""
    import importlib
    import re
    import sys

    for name in [m for m in sys.modules if m == "torchft" or m.startswith("torchft.")]:
        monkeypatch.setitem(sys.modules, name, None)  # "not installed"
    monkeypatch.setitem(sys.modules, "torchft", None)
    for name in ("stratagem.ft", "stratagem.ft.transport"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("stratagem.ft")
    with pytest.raises(ImportError):
        importlib.import_module("stratagem.ft.transport")
    src = Path(sg.__file__).resolve().parent
    users = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                   if re.search(r"^\s*(from|import) torchft", p.read_text(), re.M))
    # Only the fault-tolerance package talks to torchft (comm.py imports it inside the
    # functions that need it, so `import stratagem` never does; the quorum service speaks
    # torchft's protocol without importing it).
    assert users == ["ft/comm.py", "ft/transport.py", "ft/upstream.py"]
    importlib.import_module("stratagem.ft.comm")
    importlib.import_module("stratagem.ft.launch")


def test_a_valid_but_unaligned_blob_from_a_peer_is_read_correctly() -> None:
    """The receiver builds tensors on the received buffer after the header check: a header
    not padded to 8 bytes (legal safetensors) puts the data at an odd offset; the values are
    still exact (copied into aligned tensors) and int keys and NaN tags decode."""
    import json as _json

    header = _json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "y": {"dtype": "I64", "shape": [0], "data_offsets": [8, 8]}}).encode()
    assert (8 + len(header)) % 4  # unaligned for float32
    values = torch.tensor([1.5, -2.25])
    blob = len(header).to_bytes(8, "little") + header + values.numpy().tobytes()
    skeleton = _json.dumps({"__dict__": [["user", {"__dict__": [[0, {"__tensor__": "x"}],
                                                                 [1, {"__tensor__": "y"}],
                                                                 [2, {"__float__": "nan"}]]}]]})
    hostile = _Hostile(_signed(TOKEN, blob, skeleton.encode()))
    client = _transport()
    try:
        got = client.recv_checkpoint(0, hostile.metadata, 1, T)
    finally:
        hostile.close()
        client.shutdown()
    assert got["user"][0].equal(values) and got["user"][1].shape == (0,)
    assert math.isnan(got["user"][2])
