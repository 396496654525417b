"""Checkpoints never delete or read outside what they own: planted links
next to a checkpoint, symlinked members, one read per file, bounded ``.pt`` inputs, malformed
manifests and headers. Each refusal is a ``CheckpointError`` naming the path or field, and
what a planted link points at stays byte for byte."""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import struct
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from helpers import make_model
from torch import nn

import stratagem as sg
import stratagem.checkpoint.format as ckpt_format
import stratagem.checkpoint.storage as ckpt_storage
from stratagem.checkpoint import load_pt, read_extras, read_safetensors

pytestmark = pytest.mark.timeout(60)


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root`` (not following links): kind and bytes / link target."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def _victim(root: Path) -> Path:
    """A user's directory holding entries that look like ours (our version pattern, a
    manifest, tmp-* names) and some that do not."""
    root.mkdir()
    for name in ("000000000001-00000000000000000001", "000000000002-00000000000000000002",
                 "tmp-" + "a" * 32, "precious"):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(os.urandom(64))
        (root / name / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))
    (root / "notes.txt").write_text("do not delete")
    old = time.time() - 7200
    os.utime(root / ("tmp-" + "a" * 32), (old, old))
    return root


def _saver() -> tuple[sg.OneDevice, nn.Module]:
    s = sg.OneDevice()
    return s, s.prepare(make_model())


# ---------------------------------------------------------------------- save: planted links
def test_planted_versions_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = _victim(tmp_path / "victim")
    before = _snapshot(victim)
    os.symlink(victim, tmp_path / ".ck.versions")
    s, model = _saver()
    for step in range(4):  # the old code deleted the victim's version-like dirs here
        with pytest.raises(sg.CheckpointError, match=r"\.ck\.versions is a symbolic link.*Fix"):
            s.save(tmp_path / "ck", model=model, step=step, keep_last=1)
    assert _snapshot(victim) == before
    assert not (tmp_path / "ck").exists()
    # Restoring through it is refused as well.
    os.symlink(".ck.versions/000000000001-00000000000000000001", tmp_path / "ck")
    with pytest.raises(sg.CheckpointError, match=r"\.ck\.versions is a symbolic link"):
        s.restore(tmp_path / "ck", model=model)
    assert _snapshot(victim) == before


def test_planted_entries_inside_our_versions_dir_are_never_deleted(tmp_path: Path) -> None:
    """A link named like a version, a version-named directory without our manifest, a stale
    tmp-* link, and a foreign file inside one of our versions: keep_last removes only ours."""
    victim = _victim(tmp_path / "victim")
    before = _snapshot(victim)
    s, model = _saver()
    s.save(tmp_path / "ck", model=model, step=0)
    versions = tmp_path / ".ck.versions"
    ours = (tmp_path / "ck").resolve()
    (ours / "user-notes.txt").write_text("mine")  # a file we did not write, in our version
    os.symlink(victim / "000000000001-00000000000000000001",
               versions / "000000000001-00000000000000000001")
    os.symlink(victim / ("tmp-" + "a" * 32), versions / ("tmp-" + "b" * 32))
    stranger = versions / "000000000000-00000000000000000003"
    stranger.mkdir()
    (stranger / "data.bin").write_bytes(b"not ours")
    for step in range(1, 5):
        s.save(tmp_path / "ck", model=model, step=step, keep_last=1)
    assert _snapshot(victim) == before
    assert (versions / "000000000001-00000000000000000001").is_symlink()
    assert (versions / ("tmp-" + "b" * 32)).is_symlink()
    assert (stranger / "data.bin").read_bytes() == b"not ours"
    # Our old version's files are gone, the foreign file stayed (in a renamed directory).
    leftovers = [p for p in versions.rglob("user-notes.txt")]
    assert len(leftovers) == 1 and leftovers[0].read_text() == "mine"
    assert not any(p.name == "model.safetensors" for p in leftovers[0].parent.iterdir())
    mine = [d for d in versions.iterdir() if ckpt_storage._is_our_version(d)]
    assert mine == [(tmp_path / "ck").resolve()]


def test_foreign_link_or_file_at_path_is_refused(tmp_path: Path) -> None:
    victim = _victim(tmp_path / "victim")
    before = _snapshot(victim)
    s, model = _saver()
    os.symlink(victim, tmp_path / "ck")
    with pytest.raises(sg.CheckpointError, match=r"ck is a symbolic link to .*victim.*did not "
                                                 r"create.*Fix"):
        s.save(tmp_path / "ck", model=model)
    os.symlink("victim/precious", tmp_path / "rel")  # relative, but not into our versions
    with pytest.raises(sg.CheckpointError, match="did not create"):
        s.save(tmp_path / "rel", model=model)
    (tmp_path / "file").write_text("data")
    with pytest.raises(sg.CheckpointError, match="not a stratagem checkpoint"):
        s.save(tmp_path / "file", model=model)
    assert _snapshot(victim) == before and (tmp_path / "file").read_text() == "data"
    assert (tmp_path / "ck").is_symlink()


def test_legacy_directory_at_path_is_moved_into_versions(tmp_path: Path) -> None:
    s, model = _saver()
    s.save(tmp_path / "ck", model=model, step=5)
    # The older flat layout: path itself a directory holding a checkpoint.
    real = (tmp_path / "ck").resolve()
    (tmp_path / "ck").unlink()
    os.replace(real, tmp_path / "ck")
    s.save(tmp_path / "ck", model=model, step=6)
    names = sorted(d.name for d in (tmp_path / ".ck.versions").iterdir())
    assert len(names) == 2 and "legacy" in names[0]
    assert s.restore(tmp_path / "ck", model=model)["step"] == 6


def test_our_link_into_a_planted_version_link_is_not_followed(tmp_path: Path) -> None:
    """``path`` pointing (with our pattern) at a link planted in the versions directory: the
    link's target is never read; restore falls back to the newest real version."""
    s, model = _saver()
    s.save(tmp_path / "ck", model=model, step=1)
    first = {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}
    real = (tmp_path / "ck").resolve()
    elsewhere = tmp_path / "elsewhere"
    with torch.no_grad():
        for p in s.unwrap(model).parameters():
            p.add_(1.0)
    s.save(elsewhere, model=model, step=9)  # a valid checkpoint, outside our directory
    planted = tmp_path / ".ck.versions" / "000000000009-00000000000000000009"
    os.symlink(elsewhere.resolve(), planted)
    (tmp_path / "ck").unlink()
    os.symlink(f".ck.versions/{planted.name}", tmp_path / "ck")
    with pytest.warns(RuntimeWarning, match=f"symbolic link.*newest intact one, {real}"):
        assert s.restore(tmp_path / "ck", model=model)["step"] == 1
    torch.testing.assert_close(s.unwrap(model).state_dict(), first, atol=0, rtol=0)


# ---------------------------------------------------------------------- restore: members
def test_symlinked_member_is_refused_even_with_matching_checksum(tmp_path: Path) -> None:
    s, model = _saver()
    s.save(tmp_path / "ck", model=model)
    d = (tmp_path / "ck").resolve()
    outside = tmp_path / "outside.safetensors"
    os.replace(d / "model.safetensors", outside)
    os.symlink(outside, d / "model.safetensors")  # same bytes: the checksum would match
    with pytest.raises(sg.CheckpointError, match="model.safetensors is a symbolic link"):
        s.restore(tmp_path / "ck", model=model)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")  # a FIFO would block a plain open()
    with pytest.raises(sg.CheckpointError, match="not a regular file"):
        s.restore(tmp_path / "ck", model=model)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", ".hidden.safetensors",
                                  "sub/model.safetensors", "manifest.json"])
def test_manifest_names_outside_the_directory_are_refused(tmp_path: Path, name: str) -> None:
    s, model = _saver()
    s.save(tmp_path / "ck", model=model)
    d = (tmp_path / "ck").resolve()
    m = json.loads((d / "manifest.json").read_text())
    m["files"][name] = m["files"].pop("model.safetensors")
    m["objects"]["model"]["file"] = name
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(sg.CheckpointError, match="not a name stratagem writes"):
        s.restore(tmp_path / "ck", model=model)


def test_each_member_is_opened_once_and_the_hashed_bytes_are_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """restore reads each file once: a file swapped on disk right after it was opened (the
    window between a hash and a second read) cannot change what is loaded."""
    s = sg.OneDevice()
    with s.scope():
        m = make_model(seed=1)
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        model, opt = s.prepare(m, opt)
    s.save(tmp_path / "ck", model=model, optimizer=opt, step=3, ema=torch.ones(2))
    saved = {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}
    d = (tmp_path / "ck").resolve()
    members = set(json.loads((d / "manifest.json").read_text())["files"]) | {"manifest.json"}
    forged = safetensors.torch.save({k: v + 1 for k, v in saved.items()})
    opens: dict[str, int] = {}
    real_os_open, real_open = os.open, builtins.open

    def count(path: Any) -> None:
        name = os.path.basename(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else ""
        if name in members:
            opens[name] = opens.get(name, 0) + 1
            if name == "model.safetensors" and opens[name] == 1:
                (d / "swap").write_bytes(forged)
                os.replace(d / "swap", d / "model.safetensors")  # the open fd keeps the old

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(path, *args, **kwargs)
        count(path)
        return fd

    def open_(path: Any, *args: Any, **kwargs: Any) -> Any:
        f = real_open(path, *args, **kwargs)
        count(path)
        return f

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    s2 = sg.OneDevice()
    with s2.scope():
        m2 = make_model(seed=7)
        o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
        model2, o2 = s2.prepare(m2, o2)
    out = s2.restore(tmp_path / "ck", model=model2, optimizer=o2)
    monkeypatch.undo()
    assert opens == {name: 1 for name in members}
    assert out["step"] == 3
    torch.testing.assert_close(s2.unwrap(model2).state_dict(), saved, atol=0, rtol=0)


# ---------------------------------------------------------------------- .pt inputs
def _zip_bomb(path: Path, inflated: int) -> Path:
    """A real torch.save file re-zipped with deflate: its tensor member inflates from a few
    KiB to ``inflated`` bytes of zeros."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(inflated // 4)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, \
            zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(info.filename, src.read(info.filename), compress_type=method)
    return path


def test_compressed_pt_is_refused_before_torch_load(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = _zip_bomb(tmp_path / "bomb.pt", 64 << 20)
    assert bomb.stat().st_size < 1 << 20
    called: list[Any] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(a))
    tracemalloc.start()
    # CPU time of this thread (here and below): "refused before the work" must not depend on
    # how loaded the machine is.
    t0 = time.thread_time()
    try:
        with pytest.raises(sg.CheckpointError, match=r"bomb.pt: zip member .* is compressed "
                                                     r"\(method 8, .*-> 67108864 bytes\).*Fix"):
            load_pt(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not called and peak < 4 * bomb.stat().st_size + (1 << 20)
    assert time.thread_time() - t0 < 1.0
    s, model = _saver()
    with pytest.raises(sg.CheckpointError, match="compressed"):
        s.restore(bomb, model=model)


def test_pt_declared_sizes_beyond_the_file_are_refused(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(64)}, buf)
    data = bytearray(buf.getvalue())
    # Raise one member's uncompressed size in the central directory (offset 24 in its entry).
    entry = data.index(b"PK\x01\x02")
    struct.pack_into("<I", data, entry + 24, 0x7FFF0000)
    (tmp_path / "big.pt").write_bytes(bytes(data))
    with pytest.raises(sg.CheckpointError, match=r"big.pt: its zip members declare \d+ bytes, "
                                                 r"more than the file's \d+ bytes.*Fix"):
        load_pt(tmp_path / "big.pt")


def test_pt_with_too_many_members_or_legacy_format_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save({"w": torch.ones(4)}, tmp_path / "ok.pt")
    assert load_pt(tmp_path / "ok.pt")["w"].tolist() == [1.0] * 4
    monkeypatch.setattr(ckpt_format, "MAX_PT_MEMBERS", 2)  # where load_pt reads it
    with pytest.raises(sg.CheckpointError, match=r"ok.pt holds \d+ zip members, over the limit "
                                                 r"of 2.*Fix"):
        load_pt(tmp_path / "ok.pt")
    monkeypatch.undo()
    torch.save({"w": torch.ones(4)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(sg.CheckpointError, match="legacy format is refused.*Fix"):
        load_pt(tmp_path / "old.pt")


# ---------------------------------------------------------------------- malformed manifests
def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


MANIFEST_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "top level a list": (lambda m: [m], "the manifest is 'list'"),
    "format a string": (lambda m: {**m, "format": "1"}, "unknown checkpoint format"),
    "files a list": (lambda m: {**m, "files": list(m["files"])}, "files is"),
    "sha256 an int": (lambda m: {**m, "files": {k: 7 for k in m["files"]}}, "sha256 hex digest"),
    "objects a list": (lambda m: {**m, "objects": []}, "objects is"),
    "object not a dict": (lambda m: {**m, "objects": {"model": 3}}, r"objects\['model'\] is 3"),
    "unknown kind": (lambda m: {**m, "objects": {"model": {"kind": "pickle"}}},
                     "module, optimizer or loader"),
    "local_steps a string": (lambda m: {**m, "objects": {"model": {
        **m["objects"]["model"], "local_steps": "9"}}}, "local_steps is '9'"),
    "aliases a list": (lambda m: {**m, "objects": {"model": {
        **m["objects"]["model"], "aliases": ["x"]}}}, "aliases"),
    "per_rank a string": (lambda m: {**m, "objects": {**m["objects"], "optimizer": {
        "kind": "optimizer", "per_rank": "2"}}}, "per_rank is '2'"),
    "per_rank negative": (lambda m: {**m, "objects": {**m["objects"], "optimizer": {
        "kind": "optimizer", "per_rank": -1}}}, "per_rank is -1"),
    "loader without epoch": (lambda m: {**m, "objects": {**m["objects"], "loader": {
        "kind": "loader", "state": {"step_in_epoch": 1}}}}, "state is"),
    "extra a list": (lambda m: {**m, "extra": [1]}, "extra is"),
    "scale not a number": (lambda m: {**m, "precision": {"scale": "big"}}, "precision.scale"),
    "scale NaN": (lambda m: {**m, "precision": {"scale": float("nan")}}, "precision.scale"),
    "steps a string": (lambda m: {**m, "steps": "3"}, "steps is '3'"),
    "world_size zero": (lambda m: {**m, "world_size": 0}, "world_size is 0"),
    "deep nesting": (lambda m: json.dumps({**m, "extra": {"x": 0}}).replace(
        '"x": 0', '"x": ' + "[" * 100_000 + "]" * 100_000), "nested deeper than"),
}


def _forge(d: Path, manifest: Any) -> None:
    (d / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_malformed_manifest_is_a_checkpoint_error(tmp_path: Path, case: str) -> None:
    mutate, text = MANIFEST_CASES[case]
    s = sg.OneDevice()
    with s.scope():
        m = make_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        model, opt = s.prepare(m, opt)
    loader = s.distribute_dataset((torch.zeros(8, 10), torch.zeros(8).long()), 4)
    s.save(tmp_path / "ck", model=model, optimizer=opt, loader=loader)
    d = (tmp_path / "ck").resolve()
    _forge(d, mutate(json.loads((d / "manifest.json").read_text())))
    t0 = time.thread_time()
    for call in (lambda: s.restore(tmp_path / "ck", model=model, optimizer=opt, loader=loader),
                 lambda: read_extras(tmp_path / "ck")):
        with pytest.raises(sg.CheckpointError, match=text):
            call()
    assert time.thread_time() - t0 < 2.0


def _replace_member(d: Path, name: str, data: bytes) -> None:
    """Rewrite a member and fix its checksum (an attacker who can write the directory)."""
    (d / name).write_bytes(data)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][name] = hashlib.sha256(data).hexdigest()
    _forge(d, m)


@pytest.mark.parametrize("rng", [{"torch": torch.zeros(3, dtype=torch.uint8)},
                                 {"torch": torch.zeros(5056)}, {"torch": "state"}, [1, 2],
                                 {"torch": torch.get_rng_state(), "cuda": 5}])
def test_bad_rng_fields_are_a_checkpoint_error(tmp_path: Path, rng: Any) -> None:
    s, model = _saver()
    s.save(tmp_path / "ck", model=model)
    _replace_member((tmp_path / "ck").resolve(), "rng.rank0.safetensors",
                    ckpt_format.pack(rng, "test"))
    with pytest.raises(sg.CheckpointError, match="rng.rank0.safetensors"):
        s.restore(tmp_path / "ck", model=model)


@pytest.mark.parametrize("skeleton, text", [
    (json.dumps({"__dict__": 5}), "not a list of"),
    (json.dumps({"__list__": {"a": 1}}), "not a list"),
    (json.dumps({"__tensor__": ["x"]}), "not stored"),
    (json.dumps([1, 2]), "bare JSON list"),
    ("[" * 5000 + "]" * 5000, "nested deeper than"),
    (json.dumps({"__dict__": [[{"__list__": [1]}, 1]]}), "dict key is a dict, not str or int"),
])
def test_malformed_skeletons_are_a_checkpoint_error(tmp_path: Path, skeleton: str,
                                                    text: str) -> None:
    s, model = _saver()
    s.save(tmp_path / "ck", model=model, ema=torch.ones(2))
    data = safetensors.torch.save({"/ema": torch.ones(2)}, metadata={"skeleton": skeleton})
    _replace_member((tmp_path / "ck").resolve(), "extra.safetensors", data)
    with pytest.raises(sg.CheckpointError, match=text):
        s.restore(tmp_path / "ck", model=model)


def test_optimizer_state_that_does_not_fit_is_a_checkpoint_error(tmp_path: Path) -> None:
    s = sg.OneDevice()
    with s.scope():
        m = make_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        model, opt = s.prepare(m, opt)
    s.save(tmp_path / "ck", model=model, optimizer=opt)
    bad = ckpt_format.pack({"state": {}, "param_groups": [{"params": [0]}]}, "test")
    _replace_member((tmp_path / "ck").resolve(), "optimizer.safetensors", bad)
    with pytest.raises(sg.CheckpointError, match="does not fit the .*Fix"):
        s.restore(tmp_path / "ck", model=model, optimizer=opt)


def test_extras_too_deep_are_refused_at_save(tmp_path: Path) -> None:
    s, model = _saver()
    with pytest.raises(sg.CheckpointError, match="nested deeper than"):
        s.save(tmp_path / "ck", model=model, config=_deep(200))
    with pytest.raises(sg.CheckpointError, match="nested"):
        s.save(tmp_path / "ck", model=model, config=[_deep(200), torch.ones(1)])
    assert not (tmp_path / "ck").exists()
    s.save(tmp_path / "ck", model=model, config=_deep(40))
    assert read_extras(tmp_path / "ck")["config"] == _deep(40)


# ---------------------------------------------------------------------- header caps
def _header_file(entries: int, each: int) -> bytes:
    header = {f"t{i}": {"dtype": "U8", "shape": [each], "data_offsets": [i * each, (i + 1) * each]}
              for i in range(entries)}
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(entries * each)


@pytest.mark.parametrize("entries, each, text", [
    (90_000, 0, "header length"),           # a 5 MiB header of empty entries, no data
    (14_000, 0, "more than 4096 tensors"),  # under 1 MiB of header, all empty
    (90_000, 2, "more than"),               # a 5 MiB header of tiny tensors
    (1_500, 0, "more than 1024 empty"),
])
def test_header_of_many_entries_is_refused_quickly(tmp_path: Path, entries: int, each: int,
                                                   text: str) -> None:
    f = tmp_path / "many.safetensors"
    f.write_bytes(_header_file(entries, each))
    t0 = time.thread_time()
    with pytest.raises(sg.CheckpointError, match=text):
        read_safetensors(f)
    assert time.thread_time() - t0 < 1.0


def test_deeply_nested_header_is_refused_without_recursion(tmp_path: Path) -> None:
    raw = b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    f = tmp_path / "deep.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(sg.CheckpointError, match="nested deeper than 96"):
        read_safetensors(f)
