"""Hostile checkpoints and shared directories: another user's (or a
world-writable) versions directory, link or version; a link swapped between the check and
the read; a sharded index that repeats a file, a tensor or a row range, or declares shapes
its files do not hold; optimizer state shaped unlike the optimizer's parameters; sparse or
padded members. Each hostile case runs next to a good save/restore that still works, and
each refusal is a ``CheckpointError`` naming what it refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from helpers import make_model
from torch import nn

import stratagem as sg
import stratagem.checkpoint.storage as ckpt_storage
from stratagem import checkpoint
from stratagem.checkpoint.format import pack

pytestmark = pytest.mark.timeout(60)

OTHER_UID = 12345  # a user that is not us (the tests chown to it; they need root)
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="chown to another uid needs root")


def _saver(seed: int = 0) -> tuple[sg.OneDevice, nn.Module]:
    s = sg.OneDevice()
    return s, s.prepare(make_model(seed=seed))


def _state(s: sg.Strategy, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in s.unwrap(model).state_dict().items()}


def _good_round_trip(root: Path) -> None:
    """The good user next to every attack: a save and a restore of their own still work."""
    s, model = _saver(seed=3)
    s.save(root / "good", model=model, step=4)
    s2, model2 = _saver(seed=9)
    assert s2.restore(root / "good", model=model2)["step"] == 4
    torch.testing.assert_close(_state(s2, model2), _state(s, model), atol=0, rtol=0)


def _rewrite(d: Path, name: str, data: bytes | None = None, *, digest: bool = True) -> None:
    """Rewrite a member (``data`` None: keep it) and, with ``digest``, its checksum."""
    if data is not None:
        (d / name).unlink()
        (d / name).write_bytes(data)
    if digest:
        m = json.loads((d / "manifest.json").read_text())
        m["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
        (d / "manifest.json").write_text(json.dumps(m))


# ---------------------------------------------------------------------- 1. shared directories
@pytest.mark.parametrize("attack", [
    pytest.param("other-owner", marks=needs_root), "world-writable", "group-writable"])
def test_precreated_versions_dir_of_another_user_or_writable_is_refused(
        tmp_path: Path, attack: str) -> None:
    """Another user pre-creates ``.ck.versions`` in a shared (sticky, world-writable)
    directory: save refuses to adopt it, and a restore refuses a versions directory that
    became another user's; the good user's own checkpoint next to it still works."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    planted = shared / ".ck.versions"
    planted.mkdir()
    if attack == "other-owner":
        os.chown(planted, OTHER_UID, OTHER_UID)
        os.chmod(planted, 0o755)
        text = f"owned by uid {OTHER_UID}.*Fix"
    else:
        os.chmod(planted, 0o777 if attack == "world-writable" else 0o775)
        text = "writable by (others|its group).*Fix: chmod go-w"
    s, model = _saver()
    with pytest.raises(sg.CheckpointError, match=text):
        s.save(shared / "ck", model=model, step=1)
    assert list(planted.iterdir()) == []  # nothing of ours was written into it
    _good_round_trip(shared)
    # A checkpoint saved in the good directory whose versions directory is then handed over
    # (chown / chmod by its new "owner") is refused by restore too.
    s.save(shared / "mine", model=model, step=2)
    versions = shared / ".mine.versions"
    if attack == "other-owner":
        os.chown(versions, OTHER_UID, OTHER_UID)
    else:
        os.chmod(versions, 0o777 if attack == "world-writable" else 0o775)
    with pytest.raises(sg.CheckpointError, match=text):
        s.restore(shared / "mine", model=model)
    with pytest.raises(sg.CheckpointError, match=text):
        checkpoint.read_extras(shared / "mine")


@needs_root
def test_link_or_version_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """A link at ``path`` another user made (even one of our form), or a version directory
    of another user inside ours, is never read: restore falls back to the newest version of
    ours, or refuses."""
    s, model = _saver()
    s.save(tmp_path / "ck", model=model, step=1)
    mine = _state(s, model)
    with torch.no_grad():
        for p in s.unwrap(model).parameters():
            p.add_(1.0)
    s.save(tmp_path / "ck", model=model, step=2, keep_last=2)
    newest = (tmp_path / "ck").resolve()
    # The newest version now belongs to another user: restore falls back to step 1.
    os.chown(newest, OTHER_UID, OTHER_UID)
    s2, model2 = _saver(seed=5)
    with pytest.warns(RuntimeWarning, match=f"owned by uid {OTHER_UID}"):
        assert s2.restore(tmp_path / "ck", model=model2)["step"] == 1
    torch.testing.assert_close(_state(s2, model2), mine, atol=0, rtol=0)
    # A link of our form, but made by another user, at the path: refused.
    target = os.readlink(tmp_path / "ck")
    (tmp_path / "ck").unlink()
    os.symlink(target, tmp_path / "ck")
    os.lchown(tmp_path / "ck", OTHER_UID, OTHER_UID)
    with pytest.raises(sg.CheckpointError, match=f"ck is owned by uid {OTHER_UID}"):
        s.save(tmp_path / "ck", model=model, step=3)
    with pytest.warns(RuntimeWarning, match=f"ck is owned by uid {OTHER_UID}"):
        s2.restore(tmp_path / "ck", model=model2)  # ours only: the fall-back, step 1
    _good_round_trip(tmp_path)


def test_link_swapped_between_check_and_read_cannot_redirect_restore(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The link is read once: swapping it right after that read (here: inside the first
    ``readlink``, deterministic) to another of the user's checkpoints does not change what
    is loaded. The old code checked the link, then followed it again with
    ``path.resolve()`` and loaded the other checkpoint."""
    s, model = _saver(seed=1)
    s.save(tmp_path / "ck", model=model, step=1)
    wanted = _state(s, model)
    s_other, other = _saver(seed=2)
    s_other.save(tmp_path / "private", model=other, step=7)  # the victim's other checkpoint
    evil = str((tmp_path / "private").resolve())
    real_readlink = os.readlink
    swapped: list[bool] = []

    def readlink_then_swap(path: Any, *args: Any, **kwargs: Any) -> str:
        text = real_readlink(path, *args, **kwargs)
        if not swapped and os.path.basename(os.fspath(path)) == "ck":
            swapped.append(True)
            os.symlink(evil, tmp_path / "swap")
            os.replace(tmp_path / "swap", tmp_path / "ck")  # the attacker's link swap
        return text

    monkeypatch.setattr(os, "readlink", readlink_then_swap)
    s2, model2 = _saver(seed=5)
    extras = s2.restore(tmp_path / "ck", model=model2)
    monkeypatch.undo()
    assert swapped == [True]
    assert extras["step"] == 1
    torch.testing.assert_close(_state(s2, model2), wanted, atol=0, rtol=0)


def test_version_dir_renamed_after_open_is_still_read_by_descriptor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the version directory is open, renaming it away and putting a complete forged
    checkpoint under its name does not change what is read (members are opened at the
    directory's fd)."""
    s, model = _saver(seed=1)
    s.save(tmp_path / "ck", model=model, step=1)
    wanted = _state(s, model)
    d = (tmp_path / "ck").resolve()
    s_evil, evil = _saver(seed=2)
    s_evil.save(tmp_path / "evil", model=evil, step=7)
    real_verify = ckpt_storage._verify

    def verify_after_swap(*args: Any) -> Any:
        if not (tmp_path / "moved").exists():
            os.replace(d, tmp_path / "moved")
            shutil.copytree((tmp_path / "evil").resolve(), d)
        return real_verify(*args)

    monkeypatch.setattr(ckpt_storage, "_verify", verify_after_swap)
    s2, model2 = _saver(seed=5)
    assert s2.restore(tmp_path / "ck", model=model2)["step"] == 1
    torch.testing.assert_close(_state(s2, model2), wanted, atol=0, rtol=0)


def test_save_refuses_a_parent_anyone_may_rename_in(tmp_path: Path) -> None:
    """World-writable without the sticky bit: anyone could swap the versions directory
    while it is written. With the sticky bit (as /tmp) the save works."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    s, model = _saver()
    with pytest.raises(sg.CheckpointError, match="without the sticky bit.*Fix"):
        s.save(open_dir / "ck", model=model)
    os.chmod(open_dir, 0o1777)
    _good_round_trip(open_dir)
    assert stat_mode(open_dir / ".good.versions") & 0o022 == 0


def stat_mode(p: Path) -> int:
    return os.lstat(p).st_mode


def test_save_creates_its_directories_and_files_unwritable_by_others(tmp_path: Path) -> None:
    """Whatever the umask: a umask of 0 would otherwise make them writable by everyone
    (and refused by the next restore)."""
    old = os.umask(0)
    try:
        _good_round_trip(tmp_path)
    finally:
        os.umask(old)
    versions = tmp_path / ".good.versions"
    d = (tmp_path / "good").resolve()
    for p in [versions, d, *d.iterdir()]:
        assert stat_mode(p) & 0o022 == 0, p


# ---------------------------------------------------------------------- 3. sharded index
ROWS = [[0, 4], [4, 7]]


def _sharded_checkpoint(root: Path, pad: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of ``nn.Linear(16, 7)`` in the layout a 2-replica ``sg.Sharded`` save
    writes (``model.rank<r>.safetensors`` with each replica's rows of the weight, the bias
    on rank 0, a JSON index in the manifest), made in one process from a plain save.
    ``pad``: bytes of an extra replicated tensor in rank 0's file."""
    s = sg.OneDevice()
    model = s.prepare(nn.Linear(16, 7))
    s.save(root / "ck", model=model, step=3)
    full = _state(s, model)
    d = (root / "ck").resolve()
    m = json.loads((d / "manifest.json").read_text())
    del m["files"]["model.safetensors"]
    (d / "model.safetensors").unlink()
    rank0: dict[str, Any] = {"weight": full["weight"][:4].clone(), "bias": full["bias"]}
    if pad:
        rank0["pad"] = torch.zeros(pad // 4)
    parts = [rank0, {"weight": full["weight"][4:].clone(), "bias": None}]
    for r, part in enumerate(parts):
        data = pack(part, f"rank {r}")
        (d / f"model.rank{r}.safetensors").write_bytes(data)
        m["files"][f"model.rank{r}.safetensors"] = hashlib.sha256(data).hexdigest()
    m["objects"]["model"] = {
        "kind": "module", "file": "model.rank0.safetensors",
        "sharded": {"files": ["model.rank0.safetensors", "model.rank1.safetensors"],
                    "tensors": [{"path": ["weight"], "shape": [7, 16], "dtype": "torch.float32",
                                 "rows": [list(r) for r in ROWS]}]}}
    (d / "manifest.json").write_text(json.dumps(m))
    return d, full


def _edit_index(d: Path, edit: Any) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m["objects"]["model"]["sharded"])
    (d / "manifest.json").write_text(json.dumps(m))


def _tensor(sharded: dict[str, Any]) -> dict[str, Any]:
    return sharded["tensors"][0]  # type: ignore[no-any-return]


INDEX_ATTACKS: dict[str, tuple[Any, str]] = {
    # The old code kept the last of two entries for one tensor, silently.
    "tensor listed twice": (lambda sh: sh["tensors"].insert(0, dict(_tensor(sh))),
                            "listed twice"),
    # An empty range past the end counted as covering the rows: (4, 16) for (7, 16).
    "empty range past the end": (lambda sh: _tensor(sh).update(rows=[[0, 4], [7, 7]]),
                                 "cover 4 of 7"),
    # A shape of 0 rows: rank 0's (4, 16) came back for it.
    "shape [0, 2**60]": (lambda sh: _tensor(sh).update(shape=[0, 1 << 60], rows=[[0, 0], [0, 0]]),
                         "inconsistent sharded index"),
    "shape [0, 16]": (lambda sh: _tensor(sh).update(shape=[0, 16], rows=[[0, 0], [0, 0]]),
                      "holds F32 \\[4, 16\\] for rows 0:0.*declared F32 \\[0, 16\\]"),
    # Declared rows the file does not hold: refused from the header, before unpacking.
    "rows unlike the file": (lambda sh: _tensor(sh).update(rows=[[0, 5], [5, 7]]),
                             "rank0.safetensors holds F32 \\[4, 16\\] for rows 0:5"),
    "dtype unlike the file": (lambda sh: _tensor(sh).update(dtype="torch.float16"),
                              "holds F32 \\[4, 16\\].*declared F16"),
}


@pytest.mark.parametrize("attack", sorted(INDEX_ATTACKS))
def test_hostile_sharded_index_is_refused_before_unpacking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attack: str) -> None:
    edit, text = INDEX_ATTACKS[attack]
    (tmp_path / "good").mkdir()
    (tmp_path / "evil").mkdir()
    good, full = _sharded_checkpoint(tmp_path / "good")
    evil, _ = _sharded_checkpoint(tmp_path / "evil")
    _edit_index(evil, edit)
    unpacked: list[str] = []
    real_unpack = ckpt_storage.unpack

    def counting_unpack(data: bytes, what: str) -> Any:
        unpacked.append(what)
        return real_unpack(data, what)

    monkeypatch.setattr(ckpt_storage, "unpack", counting_unpack)
    for load in (checkpoint.load_model_state,
                 lambda p: sg.OneDevice().restore(p, model=nn.Linear(16, 7))):
        with pytest.raises(sg.CheckpointError, match=text):
            load(tmp_path / "evil" / "ck")
    assert not [w for w in unpacked if "model.rank" in w], unpacked  # refused before
    # The good sharded checkpoint next to it loads, through both readers.
    torch.testing.assert_close(checkpoint.load_model_state(tmp_path / "good" / "ck"), full)
    s = sg.OneDevice()
    model = s.prepare(nn.Linear(16, 7))
    assert s.restore(tmp_path / "good" / "ck", model=model)["step"] == 3
    torch.testing.assert_close(_state(s, model), full, atol=0, rtol=0)


def test_a_file_listed_256_times_is_refused_before_any_is_read(tmp_path: Path) -> None:
    """One rank file (1 MiB here; 8 MiB in the issue) listed 256 times: the old code
    unpacked it 256 times (256 MiB here, 2 GiB in the issue) before the index failed."""
    (tmp_path / "good").mkdir()
    (tmp_path / "evil").mkdir()
    _sharded_checkpoint(tmp_path / "good", pad=1 << 20)
    evil, _ = _sharded_checkpoint(tmp_path / "evil", pad=1 << 20)
    _edit_index(evil, lambda sh: (
        sh.update(files=["model.rank0.safetensors"] * 256),
        _tensor(sh).update(rows=[[0, 4], [4, 7]] + [[7, 7]] * 254)))
    tracemalloc.start()
    try:
        with pytest.raises(sg.CheckpointError, match="each once in rank order"):
            checkpoint.load_model_state(tmp_path / "evil" / "ck")
        with pytest.raises(sg.CheckpointError, match="each once in rank order"):
            sg.OneDevice().restore(tmp_path / "evil" / "ck", model=nn.Linear(16, 7))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # not even the file itself was read
    s = sg.OneDevice()
    model = s.prepare(nn.Linear(16, 7))
    with pytest.raises(sg.CheckpointError, match="unexpected \\['pad'\\]"):
        s.restore(tmp_path / "good" / "ck", model=model)  # read, merged, then fitted
    assert "pad" in checkpoint.load_model_state(tmp_path / "good" / "ck")


def test_optimizer_state_of_other_shapes_is_refused_at_restore(tmp_path: Path) -> None:
    """Adam state for a (4, 16) weight restored into an optimizer over a (7, 16) one: a
    CheckpointError at restore naming the key (torch's load_state_dict accepted it and the
    first step raised RuntimeError). Good ones next to it: the right state, and
    Adafactor's factored moments (not shaped like their parameter), restore and step."""
    def trained(rows: int, make: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(rows)
        model = nn.Linear(16, rows)
        opt = make(model.parameters())
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        return model, opt

    adam = lambda ps: torch.optim.Adam(ps, lr=0.1)  # noqa: E731
    small, small_opt = trained(4, adam)
    big, big_opt = trained(7, adam)
    s = sg.OneDevice()
    s.save(tmp_path / "evil", model=big, optimizer=small_opt)  # another model's state
    s.save(tmp_path / "good", model=big, optimizer=big_opt)
    fresh, fresh_opt = trained(7, adam)
    with pytest.raises(sg.CheckpointError,
                       match=r"'optimizer'.*\['state'\]\[0\]\['exp_avg'\] has shape \[4, 16\]"
                             r".*has shape \[7, 16\]\. Fix"):
        s.restore(tmp_path / "evil", model=fresh, optimizer=fresh_opt)
    s.restore(tmp_path / "good", model=fresh, optimizer=fresh_opt)
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"],
                               big_opt.state_dict()["state"][0]["exp_avg"])
    fresh(torch.randn(2, 16)).sum().backward()
    fresh_opt.step()
    factored = lambda ps: torch.optim.Adafactor(ps, lr=0.01)  # noqa: E731
    f_model, f_opt = trained(7, factored)
    s.save(tmp_path / "adafactor", model=f_model, optimizer=f_opt)
    g_model, g_opt = trained(7, factored)
    s.restore(tmp_path / "adafactor", model=g_model, optimizer=g_opt)
    assert g_opt.state_dict()["state"][0]["row_var"].shape == (7, 1)
    g_model(torch.randn(2, 16)).sum().backward()
    g_opt.step()


# ---------------------------------------------------------------------- 4. sparse / oversized
def _header(shape: list[int]) -> bytes:
    """A valid safetensors header (length + JSON, padded as safetensors pads) for one F32
    tensor of ``shape`` whose data would follow."""
    n = 4 * (1 if not shape else int(torch.tensor(shape).prod()))
    head = json.dumps({"/w": {"dtype": "F32", "shape": shape, "data_offsets": [0, n]}}).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


SPARSE = 3 << 30


@pytest.mark.parametrize("case", ["small header, truncated to 3 GiB",
                                  "3 GiB declared, all holes",
                                  "3 GiB of holes, a member only hashed",
                                  "1 MiB of real bytes past what the header declares"])
def test_sparse_or_padded_member_is_refused_before_it_is_read(tmp_path: Path, case: str) -> None:
    s = sg.OneDevice()
    with s.scope():
        m = make_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        model, opt = s.prepare(m, opt)
    s.save(tmp_path / "ck", model=model, optimizer=opt, step=2)
    d = (tmp_path / "ck").resolve()
    name = "optimizer.safetensors" if "hashed" in case else "model.safetensors"
    (d / name).unlink()
    with open(d / name, "wb") as f:
        if case.startswith("3 GiB declared"):
            f.write(_header([(SPARSE - 4096) // 4]))
            f.truncate(len(_header([(SPARSE - 4096) // 4])) + SPARSE - 4096)
        elif "1 MiB" in case:
            f.write(safetensors.torch.save({"w": torch.ones(4)}) + os.urandom(1 << 20))
        else:
            f.write(_header([4]) + b"\0" * 16)
            f.truncate(SPARSE)
    if "1 MiB" in case:
        _rewrite(d, name)  # a matching checksum: only the declared size can refuse it
    text = "sparse file" if "1 MiB" not in case else "header declares .* but the file holds"
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(sg.CheckpointError, match=text):
            if "hashed" in case:  # the optimizer file is not loaded, only hashed
                s.restore(tmp_path / "ck", model=model)
            else:
                s.restore(tmp_path / "ck", model=model, optimizer=opt)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0 and peak < 16 << 20, (elapsed, peak)
    (d / name).unlink()  # the 3 GiB of holes go away at once
    _good_round_trip(tmp_path)


def test_sparse_bare_safetensors_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "big.safetensors"
    with open(bad, "wb") as f:
        f.write(_header([4]) + b"\0" * 16)
        f.truncate(SPARSE)
    s, model = _saver()
    with pytest.raises(sg.CheckpointError, match="sparse file"):
        s.restore(bad, model=model)
    bad.unlink()
    good = tmp_path / "good.safetensors"
    safetensors.torch.save_model(s.unwrap(model), str(good))
    s2, model2 = _saver(seed=4)
    s2.restore(good, model=model2)
    torch.testing.assert_close(_state(s2, model2), _state(s, model))


def test_a_member_too_large_for_memory_is_a_checkpoint_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense member larger than memory (simulated: its read raises ``MemoryError``, as the
    40 GiB case did) is a ``CheckpointError`` naming the size, not a ``MemoryError``."""
    s, model = _saver()
    s.save(tmp_path / "ck", model=model, step=1)
    real_fdopen = os.fdopen

    class Starved:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> Starved:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.close()

        def fileno(self) -> int:
            return int(self.f.fileno())

        def read(self, n: int = -1) -> bytes:
            raise MemoryError

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        f = real_fdopen(fd, *args, **kwargs)
        return Starved(f) if os.fstat(fd).st_size > 1000 else f  # the model file, not the manifest

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(sg.CheckpointError, match="model.safetensors is \\d+ bytes, more than "
                                                 "this process can allocate.*Fix"):
        s.restore(tmp_path / "ck", model=model)
    monkeypatch.undo()
    _good_round_trip(tmp_path)
