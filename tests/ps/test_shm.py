"""The same-host shared-memory data path (stratagem.ps.shm): same results as gRPC, fallback,
hostile regions refused with a good client still served, nothing left behind."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import tempfile
from collections.abc import Iterator

import pytest
import torch
from helpers import shard_grads as _grads
from helpers import shard_params as _params
from torch.testing import assert_close

from stratagem.ps import shm
from stratagem.ps.server import ShardServer
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = pytest.mark.timeout(60)

TOKEN = "shm-test-token"
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.01}


@pytest.fixture
def shard() -> Iterator[ShardServer]:
    s = ShardServer("127.0.0.1", 0, token=TOKEN)
    s.start()
    yield s
    s.stop(0)


def _regions(client: PSClient) -> int:
    return int(client.health()[0]["shm_regions"])


def _train(address: str, steps: int, *, shared_memory: bool | None,
           compress: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, int],
                                                 list[int]]:
    """``steps`` Downpour steps of one worker (push all, fetch all), from fresh tensors."""
    params = _params()
    with PSClient([address], token=TOKEN, timeout=10) as client:
        table = ShardedParameters(client, params, optimizer_spec=ADAM,
                                  shared_memory=shared_memory)
        values = table.register()
        versions = table.versions
        for step in range(steps):
            got = table.push_fetch_async(_grads(params, step), versions, fetch=list(params),
                                         compress=compress).result()
            assert all(o.applied for o in got.outcomes.values())
            values, versions = got.values, got.versions
        used = table.shared_memory_shards
        assert client.health()[0]["shm_pushes"] == (steps if used else 0)
    return values, versions, used


@pytest.mark.parametrize("compress", [None, "bf16"])
def test_shared_memory_gives_bitwise_the_grpc_parameters(compress: str | None) -> None:
    results = []
    for shared in (True, False):  # a fresh shard each: both start from the same values
        with ShardServer("127.0.0.1", 0, token=TOKEN) as s:
            results.append(_train(s.address, 6, shared_memory=shared, compress=compress))
    (v_shm, ver_shm, used_shm), (v_grpc, ver_grpc, used_grpc) = results
    assert used_shm == [0] and used_grpc == []
    assert ver_shm == ver_grpc == {"w": 6, "b": 6, "e": 6}
    for k in v_grpc:
        assert_close(v_shm[k], v_grpc[k], atol=0, rtol=0)


def test_fallback_when_disabled_or_unavailable(shard: ShardServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shm.ENV, "0")
    v_off, _, used = _train(shard.address, 2, shared_memory=None)
    assert used == []
    monkeypatch.delenv(shm.ENV)

    def no_memfd(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSYS, "memfd_create not here")

    monkeypatch.setattr(shm.WorkerRegion, "__init__", no_memfd)
    v_none, _, used = _train(shard.address, 2, shared_memory=True)
    assert used == []
    for k in v_off:  # same shard, two more steps: the values moved on, over gRPC
        assert not torch.equal(v_off[k], v_none[k])
    with PSClient([shard.address], token=TOKEN, timeout=10) as client:
        assert _regions(client) == 0


def test_shard_without_shared_memory_falls_back(shard: ShardServer) -> None:
    """An older shard (no shm ops) refuses the attach; the worker then uses gRPC."""
    del shard.service.ops["shm_attach"]
    _, versions, used = _train(shard.address, 2, shared_memory=True)
    assert used == [] and versions == {"w": 2, "b": 2, "e": 2}


def test_nonfinite_gradient_is_refused_and_region_stays_usable(shard: ShardServer) -> None:
    params = _params()
    with PSClient([shard.address], token=TOKEN, timeout=10) as client:
        table = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
        before = table.register()
        bad = _grads(params, 0)
        bad["b"][3] = float("nan")
        with pytest.raises(RemoteError, match="non-finite|NaN|finite") as info:
            table.push_fetch_async(bad, fetch=list(params)).result()
        assert info.value.code == "INVALID_ARGUMENT"
        now = table.pull()
        for k in params:
            assert_close(now[k], before[k], atol=0, rtol=0)
        got = table.push_fetch_async(_grads(params, 1), fetch=list(params)).result()
        assert got.versions == {"w": 1, "b": 1, "e": 1}
        assert table.shared_memory_shards == [0]


def _sealed(size: int, mode: int = 0o600, seal: bool = True) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.fchmod(fd, mode)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def test_hostile_regions_are_refused_and_a_good_client_is_served(
        shard: ShardServer, caplog: pytest.LogCaptureFixture) -> None:
    """Each bad region is refused with one generic sentence (nothing about the file, which
    may be another process's: its type, size, owner or mode); the check that failed is in
    the shard's log only."""
    caplog.set_level(logging.WARNING, logger="stratagem.ps.server")
    shard.service.throttle.every = 0.0  # log every refusal here (one per 10 s otherwise)
    params = _params()
    good = PSClient([shard.address], token=TOKEN, timeout=10)
    table = ShardedParameters(good, params, optimizer_spec=ADAM, shared_memory=True)
    table.register()
    table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
    assert table.shared_memory_shards == [0]
    lay = shm.layout([(k, torch.float32, torch.float32, v.shape) for k, v in params.items()])
    entries = [[k, "float32"] for k in params]
    nonce = os.urandom(shm.NONCE_BYTES)
    tmpdir = tempfile.mkdtemp(prefix="stratagem-shm-test-")
    regular = os.path.join(tmpdir, "plain")
    with open(regular, "wb") as f:
        f.truncate(lay.size)
    os.chmod(regular, 0o600)
    link = os.path.join(tmpdir, "link")
    os.symlink(regular, link)
    cases: list[tuple[str, int, dict[str, object]]] = [
        ("not a memfd sealed", os.open(regular, os.O_RDWR), {}),
        ("not a memfd sealed|not a regular|cannot open",
         os.open(link, os.O_PATH | os.O_NOFOLLOW), {}),
        ("mode is 644", _sealed(lay.size, 0o644), {}),
        ("not a memfd sealed", _sealed(lay.size, seal=False), {}),
        ("holds", _sealed(lay.size + 64), {}),
        ("layout of its tensors on this shard needs", _sealed(lay.size), {"size": 4096}),
        ("nonce", _sealed(lay.size), {}),
        ("not a regular file", os.open(tmpdir, os.O_RDONLY), {}),
    ]
    hostile = PSClient([shard.address], token=TOKEN, timeout=10)
    try:
        for i, (why, fd, extra) in enumerate(cases):
            fields = {"pid": os.getpid(), "fd": fd, "size": lay.size, "nonce": nonce.hex(),
                      "entries": entries, **extra}
            caplog.clear()
            try:
                with pytest.raises(RemoteError) as info:
                    hostile.call(0, "shm_attach", fields)
            finally:
                os.close(fd)
            told = str(info.value)
            if info.value.code == "PERMISSION_DENIED":  # about the file: generic, detail logged
                assert shm.REGION_REFUSED in told, (i, told)
                # The shard's own address is named (its random port held "644" once).
                about = told.replace(shard.address, "<shard>")
                for secret in ("644", str(lay.size + 64), "uid 0", "regular", "/proc/"):
                    assert secret not in about, (i, secret, told)
                logged = "\n".join(r.getMessage() for r in caplog.records)
                assert re.search(why, logged), (i, why, logged)
            else:  # about the request itself: named
                assert info.value.code == "INVALID_ARGUMENT" and re.search(why, told), told
            got = table.push_fetch_async(_grads(params, i + 1), fetch=list(params)).result()
            assert got.versions["w"] == i + 2  # the good client is still served, by shm
        assert table.shared_memory_shards == [0]
        assert good.health()[0]["shm_pushes"] == len(cases) + 1
        # Unauthenticated: refused before anything is read.
        fd = _sealed(lay.size)
        with PSClient([shard.address], timeout=10) as anonymous:
            with pytest.raises(RemoteError) as info:
                anonymous.call(0, "shm_attach", {"pid": os.getpid(), "fd": fd,
                                                 "size": lay.size, "nonce": nonce.hex(),
                                                 "entries": entries})
        os.close(fd)
        assert info.value.code == "UNAUTHENTICATED"
        # A push naming a region that is not there is refused, not applied.
        with pytest.raises(RemoteError, match="unknown shared-memory region"):
            hostile.call(0, "shm_push", {"region": "0" * 32, "push": [["b", 0]]})
        assert _regions(good) == 1
    finally:
        hostile.close()
        good.close()
        os.unlink(link)
        os.unlink(regular)
        os.rmdir(tmpdir)


def test_region_cannot_be_truncated_and_is_gone_after_close(shard: ShardServer) -> None:
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    params = _params()
    client = PSClient([shard.address], token=TOKEN, timeout=10)
    table = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
    table.register()
    table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
    region = table._shm_regions[0]
    assert region.fd is None  # closed once the shard had opened it: nobody else can
    # The seals make a truncation (SIGBUS in the shard) impossible for anyone.
    probe = shm.WorkerRegion(region.layout)
    assert probe.fd is not None
    with pytest.raises(OSError) as info:
        os.ftruncate(probe.fd, 0)
    assert info.value.errno == errno.EPERM
    probe.release()
    assert _regions(client) == 1
    client.close()
    assert region.dead and not region.values
    with PSClient([shard.address], token=TOKEN, timeout=10) as other:
        assert _regions(other) == 0
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before


def test_regions_of_dead_workers_are_dropped(shard: ShardServer) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    dead_pid = int(done.stdout)
    params = _params()
    with PSClient([shard.address], token=TOKEN, timeout=10) as client:
        table = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
        table.register()
        table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
        (rid, region), = shard.shm.regions.items()
        region.pid = dead_pid  # as if that worker had died without detaching
        other = ShardedParameters(client, params, optimizer_spec=ADAM, shared_memory=True)
        other.register()
        other.push_fetch_async(_grads(params, 1), fetch=list(params)).result()
        assert rid not in shard.shm.regions and _regions(client) == 1
