"""Checkpoints: atomic versions, manifest, keep_last, fall-back, complete state, and
refusal of malicious files (safetensors headers, pickles) without big allocations."""

from __future__ import annotations

import json
import os
import pickle
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from helpers import make_data, make_model
from torch import nn

import stratagem as sg
from stratagem.checkpoint import MAX_HEADER_BYTES, load_pt, read_safetensors
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def _trained(strategy: sg.Strategy, steps: int = 3, precision_model: nn.Module | None = None):
    with strategy.scope():
        model = precision_model or make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(make_data(64), 16, seed=1)
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return model, opt, loader


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- layout and manifest
def test_layout_manifest_and_checksums(tmp_path: Path) -> None:
    s = sg.OneDevice()
    model, opt, loader = _trained(s)
    s.save(tmp_path / "ck", model=model, optimizer=opt, loader=loader, step=3, note="hi")
    link = tmp_path / "ck"
    assert link.is_symlink()
    target = link.resolve()
    assert target.parent.name == ".ck.versions" and target.name.startswith("000000000003-")
    manifest = json.loads((link / "manifest.json").read_text())
    assert manifest["strategy"] == "OneDevice" and manifest["world_size"] == 1
    assert manifest["step"] == 3 and manifest["extra"] == {"step": 3, "note": "hi"}
    assert set(manifest["files"]) >= {"model.safetensors", "optimizer.safetensors",
                                      "rng.rank0.safetensors"}
    import hashlib
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((link / name).read_bytes()).hexdigest() == digest
    # The model file loads into a plain module with plain safetensors.
    plain = make_model(seed=5)
    safetensors.torch.load_model(plain, link / "model.safetensors")
    torch.testing.assert_close(_state(plain), _state(model), atol=0, rtol=0)


def test_keep_last_and_a_resumed_lower_step_is_kept(tmp_path: Path) -> None:
    s = sg.OneDevice()
    model = s.prepare(make_model())
    for step in (1, 2, 3, 4):
        s.save(tmp_path / "ck", model=model, step=step, keep_last=3)
    versions = sorted(p.name[:12] for p in (tmp_path / ".ck.versions").iterdir())
    assert versions == ["000000000002", "000000000003", "000000000004"]
    # Regression: a job resumed from step 2 saves step 3 again; ordering by step would have
    # made keep_last delete the version just written and left the link dangling.
    s.save(tmp_path / "ck", model=model, step=1, keep_last=2)
    assert (tmp_path / "ck").exists()
    assert s.restore(tmp_path / "ck", model=model)["step"] == 1
    assert len(list((tmp_path / ".ck.versions").iterdir())) == 2
    with pytest.raises(ValueError, match="keep_last"):
        s.save(tmp_path / "ck", model=model, keep_last=0)


def test_corrupt_newest_falls_back_with_warning_and_all_corrupt_raises(tmp_path: Path) -> None:
    s = sg.OneDevice()
    model = s.prepare(make_model())
    s.save(tmp_path / "ck", model=model, step=1)
    first = _state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    s.save(tmp_path / "ck", model=model, step=2)
    newest = (tmp_path / "ck").resolve()
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    fresh = s.prepare(make_model(seed=9))
    with pytest.warns(RuntimeWarning, match="checksum mismatch.*newest intact"):
        assert s.restore(tmp_path / "ck", model=fresh)["step"] == 1
    torch.testing.assert_close(_state(fresh), first, atol=0, rtol=0)
    for d in (tmp_path / ".ck.versions").iterdir():
        (d / "manifest.json").write_text("{not json")
    with pytest.raises(sg.CheckpointError, match="no intact checkpoint.*Fix"):
        s.restore(tmp_path / "ck", model=fresh)


def test_missing_checkpoint_and_unknown_object_are_explained(tmp_path: Path) -> None:
    s = sg.OneDevice()
    model = s.prepare(make_model())
    with pytest.raises(sg.CheckpointError, match="no intact checkpoint"):
        s.restore(tmp_path / "nothing", model=model)
    s.save(tmp_path / "ck", model=model)
    with pytest.raises(sg.CheckpointError, match="holds no 'critic'"):
        s.restore(tmp_path / "ck", critic=model)
    with pytest.raises(sg.CheckpointError, match="no pickle"):
        s.save(tmp_path / "ck2", model=model, thing=object())
    assert not (tmp_path / "ck2").exists()


def test_complete_state_round_trip(tmp_path: Path) -> None:
    """Model, optimizer, loss scale, RNG, loader position, tensor and JSON extras."""
    s = sg.OneDevice(precision="fp16", init_scale=1024.0)
    model, opt, loader = _trained(s, steps=2)
    s.precision.scale = 256.0
    torch.manual_seed(123)
    s.save(tmp_path / "ck", model=model, optimizer=opt, loader=loader, step=2,
           ema={"w": torch.arange(3.0)}, tag="run-1")
    expected_rand = torch.rand(3)
    saved_model, saved_opt = _state(model), opt.state_dict()

    s2 = sg.OneDevice(precision="fp16")
    with s2.scope():
        m2 = make_model(seed=7)
        o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
        m2, o2 = s2.prepare(m2, o2)
    l2 = s2.distribute_dataset(make_data(64), 16, seed=1)
    torch.manual_seed(999)
    out = s2.restore(tmp_path / "ck", model=m2, optimizer=o2, loader=l2)
    assert out["step"] == 2 and out["tag"] == "run-1"
    torch.testing.assert_close(out["ema"]["w"], torch.arange(3.0))
    torch.testing.assert_close(torch.rand(3), expected_rand, atol=0, rtol=0)  # RNG restored
    torch.testing.assert_close(_state(m2), saved_model, atol=0, rtol=0)
    for k, v in saved_opt["state"][0].items():
        torch.testing.assert_close(o2.state_dict()["state"][0][k], v, atol=0, rtol=0)
    assert s2.precision.scale == 256.0 and s2.metrics()["steps"] == 2
    assert l2.state_dict() == {"epoch": 0, "step_in_epoch": 2, "seed": 1}
    assert len(list(l2)) == len(loader) - 2  # resumes at the third batch


# ---------------------------------------------------------------------- bare model files
def test_restore_accepts_a_bare_model_file(tmp_path: Path) -> None:
    src = make_model(seed=3)
    torch.save(src.state_dict(), tmp_path / "m.pt")
    safetensors.torch.save_file(src.state_dict(), tmp_path / "m.safetensors")
    for name in ("m.pt", "m.safetensors"):
        s = sg.OneDevice()
        model = s.prepare(make_model(seed=0))
        assert s.restore(tmp_path / name, model=model) == {"step": 0}
        torch.testing.assert_close(_state(model), _state(src), atol=0, rtol=0)
    assert load_pt(tmp_path / "m.pt").keys() == src.state_dict().keys()


class _Evil:
    def __reduce__(self):  # what a malicious pickle does: run a command at load time
        return (os.system, ("touch /tmp/stratagem-pwned",))


def test_pickle_payloads_are_never_executed(tmp_path: Path) -> None:
    marker = Path("/tmp/stratagem-pwned")
    marker.unlink(missing_ok=True)
    torch.save({"w": torch.ones(2), "evil": _Evil()}, tmp_path / "evil.pt")
    (tmp_path / "raw.pt").write_bytes(pickle.dumps(_Evil()))
    for name in ("evil.pt", "raw.pt"):
        with pytest.raises(sg.CheckpointError, match="weights_only=True"):
            load_pt(tmp_path / name)
        s = sg.OneDevice()
        with pytest.raises(sg.CheckpointError):
            s.restore(tmp_path / name, model=s.prepare(make_model()))
    assert not marker.exists()
    torch.save({"w": torch.ones(2), "lr": 0.1}, tmp_path / "mixed.pt")  # loads, not a state dict
    with pytest.raises(sg.CheckpointError, match="holds a float at 'lr'"):
        load_pt(tmp_path / "mixed.pt")


# ---------------------------------------------------------------------- malicious safetensors
def _st_file(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


_GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
MALICIOUS = {
    "huge header length": _st_file(_GOOD, bytes(8), length=1 << 62),
    "header longer than file": _st_file(_GOOD, bytes(8), length=MAX_HEADER_BYTES - 1),
    "bad JSON": _st_file(b"{\"w\": [", bytes(8)),
    "header not an object": _st_file([1, 2, 3], bytes(8)),
    "offsets out of range": _st_file(
        {"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}, bytes(8)),
    "offsets not matching shape": _st_file(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)),
    "dtype not allowed": _st_file(
        {"w": {"dtype": "OBJECT", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "negative shape": _st_file(
        {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
    "truncated": b"\x01\x02",
}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_malicious_safetensors_refused_without_big_allocation(tmp_path: Path, case: str) -> None:
    f = tmp_path / "bad.safetensors"
    f.write_bytes(MALICIOUS[case])
    tracemalloc.start()
    # CPU time of this thread: "refused without work" must not depend on the machine's load.
    t0 = time.thread_time()
    try:
        with pytest.raises(sg.CheckpointError, match="Fix"):
            read_safetensors(f)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and time.thread_time() - t0 < 1.0


def test_malicious_file_inside_a_checkpoint_with_a_forged_manifest(tmp_path: Path) -> None:
    """An attacker who can write the directory can also fix the checksums: the header checks
    and the manifest's file list still hold."""
    import hashlib

    s = sg.OneDevice()
    model = s.prepare(make_model())
    s.save(tmp_path / "ck", model=model)
    d = (tmp_path / "ck").resolve()
    bad = MALICIOUS["huge header length"]
    (d / "model.safetensors").write_bytes(bad)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = hashlib.sha256(bad).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sg.CheckpointError, match="header length"):
        s.restore(tmp_path / "ck", model=model)
    manifest["objects"]["model"]["file"] = "../../etc/passwd"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sg.CheckpointError, match="not one of its checksummed files"):
        s.restore(tmp_path / "ck", model=model)


# ---------------------------------------------------------------------- preemption (threads)
def test_preemption_signal_on_one_replica_saves_everywhere_at_the_same_step(tmp_path) -> None:
    data = make_data(256)

    def fn(comm):
        s = sg.Mirrored(comm=comm)
        with s.scope():
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = s.prepare(model, opt)
        loader = s.distribute_dataset(data, 32, seed=0)
        handler = s.on_preemption(tmp_path / "pre", model=model, optimizer=opt, loader=loader,
                                  exit=False, step=lambda: s.metrics()["steps"])
        for i, (x, y) in enumerate(loader):
            if i == 3 and comm.rank == 1:
                handler.trigger()  # only rank 1 got the signal
            s.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            if handler.saved:
                return i + 1
        return -1

    assert run_ranks(fn, 2) == [4, 4]
    manifest = json.loads((tmp_path / "pre" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["objects"]["loader"]["state"]["step_in_epoch"] == 4


def test_preemption_exits_with_the_documented_code(tmp_path: Path) -> None:
    from stratagem.preemption import PREEMPTED_EXIT_CODE

    s = sg.OneDevice()
    with s.scope():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = s.prepare(model, opt)
    handler = s.on_preemption(tmp_path / "pre", model=model, optimizer=opt)
    try:
        x, y = make_data(8)
        s.backward(F.cross_entropy(model(x), y))
        opt.step()  # no signal yet
        assert not (tmp_path / "pre").exists()
        import signal
        os.kill(os.getpid(), signal.SIGTERM)  # main thread: the real handler records it
        s.backward(F.cross_entropy(model(x), y))
        with pytest.raises(SystemExit) as info:
            opt.step()
        assert info.value.code == PREEMPTED_EXIT_CODE == 143
        assert s.restore(tmp_path / "pre", model=model)["step"] == 2
    finally:
        handler.uninstall()
