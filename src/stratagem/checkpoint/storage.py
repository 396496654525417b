"""Atomic, versioned checkpoint directories on disk, and their verified reading.

``path`` is a symbolic link to ``<parent>/.<name>.versions/<step>-<time>/``; ``commit``
writes and fsyncs a new version directory, then swaps the link with one ``os.replace`` (a
crash at any instant leaves ``path`` at a complete checkpoint) and prunes old versions.
Ownership rules (what may be replaced or deleted) and the verified read (each member opened
once with ``O_NOFOLLOW``, hashed, and the same bytes parsed; fall back to the newest intact
version) live here too. What the files contain is ``format``'s business.
"""


from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from . import sharded
from .format import (
    CORRUPT_FIX,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MEMBER_RE,
    check_header,
    check_manifest,
    check_real_size,
    check_safetensors_fd,
    load_tensors,
    loads_checked,
    read_fd,
    unpack,
)

#: Names we create, and the only ones we read or delete.
_VERSION_RE = re.compile(r"\d{12}-(?:\d{20}|legacy-[0-9a-f]{8})")
_TMP_RE = re.compile(r"tmp-(?:del-)?[0-9a-f]{32}")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Opening a directory or a member of one: never through a link.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_MEMBER_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
#: Modes of what ``save`` creates, whatever the umask adds: nobody but the owner writes.
_DIR_MODE = 0o755
_FILE_MODE = 0o644
_OWNER_FIX = ("Fix: remove it (check first what it holds) or choose another path; to use a "
              "checkpoint someone else shared, copy it into a directory of your own")


# ---------------------------------------------------------------------- files and ownership
def check_owner(st: os.stat_result, what: str) -> None:
    """Refuse a checkpoint directory, member or link that another user controls: owned by
    anyone but this user (or root), or (not a link) writable by its group or others. Another
    user who can write there can swap what a restore loads (a pre-created
    ``.ck.versions`` of mode 0777 in ``/tmp``)."""
    if not hasattr(os, "geteuid"):
        return  # no POSIX owners on this platform
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise CheckpointError(
            f"{what} is owned by uid {st.st_uid}, not by this user (uid {uid}) or root: its "
            "owner could replace what it holds, so stratagem refuses to save into it or "
            f"restore from it. {_OWNER_FIX}")
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        raise CheckpointError(
            f"{what} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): anyone who "
            "can write there could swap what a restore loads, so stratagem refuses to save "
            f"into it or restore from it. Fix: chmod go-w {what} if you trust what it holds; "
            "otherwise remove it or choose another path")


def _fsync_write(path: Path, data: bytes) -> str:
    # O_EXCL | O_NOFOLLOW: a fresh file in our fresh directory, never a link; mode 0644
    # whatever the umask would allow.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                 _FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_path(path: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(path).rstrip("/") or ".")


def _versions_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.versions"


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds (or once held, with versions left) a stratagem checkpoint."""
    p = clean_path(path)
    return p.exists() or p.is_symlink() or _versions_dir(p).is_dir()


def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_our_link(path: Path) -> bool:
    """A link ``save`` made: relative, ``.<name>.versions/<our version pattern>``."""
    try:
        parts = os.readlink(path).split("/")
    except OSError:
        return False
    return (len(parts) == 2 and parts[0] == f".{path.name}.versions"
            and _VERSION_RE.fullmatch(parts[1]) is not None)


def _check_versions_dir(path: Path) -> Path:
    """The versions directory of ``path`` if it is absent or a plain directory; a link or any
    other file there is refused (a planted link would make ``keep_last`` delete its target's
    entries)."""
    versions = _versions_dir(path)
    try:
        st = os.lstat(versions)
    except FileNotFoundError:
        return versions
    except OSError as exc:
        raise CheckpointError(f"cannot inspect {versions}: {exc}") from exc
    _check_versions_stat(versions, st)
    return versions


def _check_versions_stat(versions: Path, st: os.stat_result) -> None:
    """A versions directory must be a plain directory (not a link) that only we control."""
    if not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise CheckpointError(
            f"{versions} is {what}; stratagem creates it as a plain directory and never follows "
            "a link out of what it owns, so it refuses to save or restore through it. Fix: "
            f"remove {versions} (check first what it points to) or choose another path")
    check_owner(st, str(versions))


def _read_manifest_at(directory: Path) -> Any:
    """The parsed manifest of a directory, read without following a link (``None`` if absent,
    not a regular file or not JSON)."""
    try:
        fd = os.open(directory / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return loads_checked(read_fd(fd, str(directory / MANIFEST_NAME), MAX_MANIFEST_BYTES),
                      str(directory / MANIFEST_NAME))
    except CheckpointError:
        return None


def _is_our_version(d: Path) -> bool:
    """Our naming pattern, a plain directory, and our manifest inside, naming this version."""
    if _VERSION_RE.fullmatch(d.name) is None:
        return False
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return False
    except OSError:
        return False
    m = _read_manifest_at(d)
    if not (isinstance(m, dict) and m.get("format") == FORMAT_VERSION
            and isinstance(m.get("files"), dict)):
        return False
    # Versions name themselves in their manifest; a legacy one (a checkpoint of the older flat
    # layout, moved aside by save) and those written before the field existed do not.
    return m.get("version", d.name) == d.name or "-legacy-" in d.name


def _remove_ours(d: Path) -> None:
    """Remove the files of our naming pattern in ``d`` (a plain directory), then ``d`` if that
    emptied it; anything else (a file we did not write, a link) stays, and so does ``d``."""
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return
        with os.scandir(d) as entries:
            names = [e.name for e in entries
                     if (e.name == MANIFEST_NAME or MEMBER_RE.fullmatch(e.name))
                     and e.is_file(follow_symlinks=False)]
        for name in sorted(names, key=lambda n: n == MANIFEST_NAME):  # the manifest last
            os.unlink(d / name)
        os.rmdir(d)
    except OSError:
        pass  # foreign content, or a concurrent clean-up: leave it


def _written_at(d: Path) -> int:
    """The ``time_ns`` a version directory ``<step>-<ns>`` was committed at (0 if unknown)."""
    tail = d.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0


def _candidates(path: Path) -> list[Path]:
    """Version directories of our naming pattern (plain directories, never links), most
    recently written first. Ordered by commit time, not by step: a job that resumed from an
    older step and saved again must see its new version as the newest (ordering by step would
    let ``keep_last`` delete it)."""
    versions = _check_versions_dir(path)
    try:
        with os.scandir(versions) as entries:
            found = [versions / e.name for e in entries
                     if _VERSION_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list {versions}: {exc}") from exc
    return sorted(found, key=lambda d: (_written_at(d), d.name), reverse=True)


# ---------------------------------------------------------------------- verified reading
# Restore resolves ``path`` once and reads everything through directory file descriptors:
# the parent is opened once, the link read once (readlink at the parent's fd), the versions
# and version directories opened with ``O_NOFOLLOW`` at their parent's fd and their owner and
# mode checked on the open descriptor, every member opened at the version's fd. A swap of any
# name after that (the link, the versions directory, a version) cannot redirect the restore.
def _is_link_at(dfd: int, name: str) -> bool:
    """Whether ``name`` at ``dfd`` is a symbolic link (why an ``O_NOFOLLOW`` open failed)."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_dir_at(dfd: int, name: str, what: str) -> int:
    """A directory opened once at ``dfd`` (never through a link), its owner and mode checked
    on the descriptor."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if _is_link_at(dfd, name):
            raise CheckpointError(f"{what} is a symbolic link, not a version directory "
                                  "stratagem wrote; refusing to follow it") from exc
        raise CheckpointError(f"{what} is not a readable checkpoint directory: {exc}") from exc
    try:
        check_owner(os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_member(dfd: int, directory: Path, name: str) -> int:
    """A member opened once at its directory's fd (``O_NOFOLLOW``): a regular file of ours,
    and (a safetensors file) its declared size equal to its real size, checked before a byte
    of its data is read, allocated or hashed."""
    what = str(directory / name)
    try:
        fd = os.open(name, _MEMBER_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if _is_link_at(dfd, name):
            raise CheckpointError(f"{what} is a symbolic link; a checkpoint's files "
                                  "are regular files inside its directory and links are never "
                                  f"followed. {CORRUPT_FIX}") from exc
        raise CheckpointError(f"{directory}: cannot read {name} ({exc}): not a complete "
                              "checkpoint") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{what} is not a regular file; refusing to read it. Fix: "
                                  "point at the checkpoint's own files")
        check_owner(st, what)
        if name == MANIFEST_NAME:
            check_real_size(st, what)
        else:
            check_safetensors_fd(fd, st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_member(dfd: int, directory: Path, name: str, limit: int | None = None) -> bytes:
    return read_fd(_open_member(dfd, directory, name), str(directory / name), limit)


def _hash_member(dfd: int, directory: Path, name: str) -> str:
    """sha256 of a member this rank does not load (other ranks' files), streamed."""
    with os.fdopen(_open_member(dfd, directory, name), "rb") as f:
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()



Wanted = Callable[[dict[str, Any]], Collection[str]]


def _verify(dfd: int, directory: Path, wanted: Wanted) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest of the intact checkpoint directory open at ``dfd`` and the bytes of the
    files ``wanted`` names; ``CheckpointError`` otherwise. Every member is opened once: the
    files loaded are hashed in memory and the same bytes returned; the others are hashed
    streaming."""
    try:
        raw = _read_member(dfd, directory, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except CheckpointError as exc:
        raise CheckpointError(f"{directory} has no readable {MANIFEST_NAME}: not a complete "
                              f"checkpoint ({exc})") from exc
    manifest = check_manifest(loads_checked(raw, str(directory / MANIFEST_NAME)), directory)
    keep = set(wanted(manifest))
    blobs: dict[str, bytes] = {}
    for name, digest in manifest["files"].items():
        if name in keep:
            data = _read_member(dfd, directory, name)
            actual = hashlib.sha256(data).hexdigest()
        else:
            actual = _hash_member(dfd, directory, name)
        if actual != digest:
            raise CheckpointError(f"{directory}: checksum mismatch in {name} (file corrupted)")
        if name in keep:
            blobs[name] = data
    return manifest, blobs


def _open_current(pfd: int, path: Path, st: os.stat_result, versions: Callable[[], int]
                  ) -> tuple[int, Path]:
    """The directory ``path`` names, opened once: through a link of ours only into our
    versions directory (``versions()`` opens it), through a link the user made (its owner
    checked) once, or itself."""
    check_owner(st, str(path))
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path.name, dir_fd=pfd)  # read once; never followed again
        except OSError as exc:
            raise CheckpointError(f"cannot read the link {path}: {exc}") from exc
        parts = target.split("/")
        if (len(parts) == 2 and parts[0] == f".{path.name}.versions"
                and _VERSION_RE.fullmatch(parts[1])):
            where = _versions_dir(path) / parts[1]
            return _open_dir_at(versions(), parts[1], str(where)), where
        try:  # a link the user made (e.g. latest -> run3/ck): their choice, followed once
            fd = os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC, dir_fd=pfd)
        except OSError as exc:
            raise CheckpointError(f"{path} -> {target!r:.200} is not a readable checkpoint "
                                  f"directory: {exc}") from exc
        where = Path(os.path.normpath(path.parent / target))
        try:
            check_owner(os.fstat(fd), str(where))
        except BaseException:
            os.close(fd)
            raise
        return fd, where
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path} is not a checkpoint directory")
    return _open_dir_at(pfd, path.name, str(path)), path


def resolve(path: Path, wanted: Wanted) -> tuple[Path, dict[str, Any], dict[str, bytes]]:
    """The checkpoint to load at ``path``: itself if intact, else the newest intact version
    (a link of ours is only followed into a plain versions directory of ours). Resolved once
    and read through directory descriptors (see above)."""
    errors: list[str] = []
    if path.name in ("", ".", ".."):  # "." or "..": name it from its parent
        path = Path(os.path.abspath(path))
    versions = _versions_dir(path)
    try:
        pfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"no intact checkpoint at {path}: cannot open {path.parent} "
                              f"({exc}). Fix: check the path, or save a checkpoint first.") from exc
    vfds: list[int | None] = []

    def versions_fd(missing_ok: bool = False) -> int | None:
        """The versions directory, opened (and checked) once, on first use."""
        if not vfds:
            try:
                st = os.stat(versions.name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                vfds.append(None)
            except OSError as exc:
                raise CheckpointError(f"cannot inspect {versions}: {exc}") from exc
            else:
                _check_versions_stat(versions, st)
                vfds.append(_open_dir_at(pfd, versions.name, str(versions)))
        if vfds[0] is None and not missing_ok:
            raise CheckpointError(f"{versions} does not exist: not a complete checkpoint")
        return vfds[0]

    def versions_required() -> int:
        fd = versions_fd()
        assert fd is not None
        return fd

    try:
        current: tuple[int, int] | None = None
        try:
            st: os.stat_result | None = os.stat(path.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise CheckpointError(f"cannot inspect {path}: {exc}") from exc
        if st is not None:
            try:
                dfd, where = _open_current(pfd, path, st, versions_required)
                try:
                    dst = os.fstat(dfd)
                    current = (dst.st_dev, dst.st_ino)
                    return where, *_verify(dfd, where, wanted)
                finally:
                    os.close(dfd)
            except CheckpointError as exc:
                errors.append(str(exc))
        vfd = versions_fd(missing_ok=True)
        for name in _candidate_names(vfd, versions) if vfd is not None else []:
            assert vfd is not None
            where = versions / name
            try:
                dfd = _open_dir_at(vfd, name, str(where))
                try:
                    dst = os.fstat(dfd)
                    if (dst.st_dev, dst.st_ino) == current:
                        continue
                    manifest, blobs = _verify(dfd, where, wanted)
                finally:
                    os.close(dfd)
            except CheckpointError as exc:
                errors.append(str(exc))
                continue
            warnings.warn(f"checkpoint at {path} is damaged or missing "
                          f"({errors[0] if errors else 'missing'}); restoring the newest intact "
                          f"one, {where}", RuntimeWarning, stacklevel=3)
            return where, manifest, blobs
    finally:
        for fd in [pfd, *(v for v in vfds if v is not None)]:
            os.close(fd)
    raise CheckpointError(f"no intact checkpoint at {path}" + (f": {'; '.join(errors)}" if errors else "")
                          + ". Fix: check the path, or save a checkpoint first.")


def _candidate_names(vfd: int, versions: Path) -> list[str]:
    """Names of the version directories (our pattern, not links) in the versions directory
    open at ``vfd``, most recently written first (see :func:`_candidates`)."""
    try:
        with os.scandir(vfd) as entries:
            found = [e.name for e in entries
                     if _VERSION_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError as exc:
        raise CheckpointError(f"cannot list {versions}: {exc}") from exc
    return sorted(found, key=lambda n: (_written_at(Path(n)), n), reverse=True)


def member_bytes(directory: Path, blobs: dict[str, bytes], name: Any) -> bytes:
    """A verified file of the checkpoint, only if the manifest lists (and so checksummed) it:
    a forged manifest cannot point a load at another path."""
    if not isinstance(name, str) or name not in blobs:
        raise CheckpointError(f"{directory}: the manifest refers to {name!r:.80}, which is not "
                              "one of its checksummed files. Fix: the checkpoint is corrupt; "
                              "restore another version")
    return blobs[name]


def member_tensors(directory: Path, blobs: dict[str, bytes], name: Any) -> dict[str, torch.Tensor]:
    data = member_bytes(directory, blobs, name)
    what = str(directory / name)
    check_header(data, what)
    return load_tensors(data, what)


def merge_shards(directory: Path, blobs: dict[str, bytes], entry: dict[str, Any]) -> Any:
    """The full state of a sharded entry from its verified files: the index checked first,
    then each file's header against it (no tensor allocated), then each file unpacked once."""
    return sharded.load_entry(
        entry, lambda f: unpack(member_bytes(directory, blobs, f), str(directory / f)),
        str(directory),
        header=lambda f: check_header(member_bytes(directory, blobs, f), str(directory / f)))


def extras_of(directory: Path, manifest: dict[str, Any], blobs: dict[str, bytes]) -> dict[str, Any]:
    result: dict[str, Any] = dict(manifest.get("extra", {}))
    if "extra.safetensors" in manifest["files"]:
        extra = unpack(member_bytes(directory, blobs, "extra.safetensors"),
                        str(directory / "extra.safetensors"))
        if not isinstance(extra, dict):
            raise CheckpointError(f"{directory}/extra.safetensors holds a "
                                  f"{type(extra).__name__}, not a dict. {CORRUPT_FIX}")
        result.update(extra)
    result.setdefault("step", manifest.get("steps", 0))
    return result


def read_extras(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The saved extras of the checkpoint at ``path`` (``step`` and every keyword given to
    ``save`` that is not a module, optimizer or loader), readable before any model or strategy
    exists — e.g. the model configuration needed to build the model. The manifest and the
    extras file are verified as by ``restore`` (same fall-back to the newest intact version);
    nothing else is loaded."""
    directory, manifest, blobs = resolve(clean_path(path), lambda m: {"extra.safetensors"})
    return extras_of(directory, manifest, blobs)


def load_model_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The verified ``model.safetensors`` of a checkpoint, as a state dict (shared parameters
    under every one of their names)."""
    def wanted(m: dict[str, Any]) -> set[str]:
        entry = m.get("objects", {}).get("model")
        if isinstance(entry, dict) and isinstance(entry.get("sharded"), dict):
            return set(sharded.shard_files(entry, str(path)))
        return {"model.safetensors"}

    directory, manifest, blobs = resolve(clean_path(path), wanted)
    entry = manifest.get("objects", {}).get("model", {})
    if "sharded" in entry:  # one file per replica's rows (sg.Sharded): concatenated here
        tensors = merge_shards(directory, blobs, entry)
    else:
        tensors = member_tensors(directory, blobs, "model.safetensors")
    for alias, canonical in entry.get("aliases", {}).items():
        if canonical in tensors:
            tensors.setdefault(alias, tensors[canonical])
    return tensors



def _prepare_path(path: Path) -> Path:
    """Check that ``save`` may replace ``path`` and may write its versions directory: ``path``
    is absent, a link of ours, or a checkpoint directory of the older flat layout (moved into
    the versions as ``<step>-legacy-<id>``); anything else is refused, naming it."""
    versions = _check_versions_dir(path)
    _check_parent(path.parent)
    if _is_link(path) and not _is_our_link(path):
        raise CheckpointError(
            f"{path} is a symbolic link to {os.readlink(path)!r}, which stratagem did not create "
            f"(its links point to .{path.name}.versions/<step>-<time>); refusing to replace it. "
            "Fix: remove the link or choose another path")
    if _is_link(path):
        check_owner(os.lstat(path), str(path))
    if not versions.exists():
        versions.parent.mkdir(parents=True, exist_ok=True)
        try:
            versions.mkdir(mode=_DIR_MODE)
        except FileExistsError:
            pass  # another saver made it meanwhile: checked below like any other
        _fsync_dir(versions.parent)  # the new directory entry itself must survive a crash
        _check_versions_dir(path)
    if path.exists() and not _is_link(path):
        m = _read_manifest_at(path) if path.is_dir() else None
        if not (isinstance(m, dict) and m.get("format") == FORMAT_VERSION):
            raise CheckpointError(f"{path} exists and is not a stratagem checkpoint; refusing to "
                                  "replace it. Fix: choose another path or remove it.")
        check_owner(os.lstat(path), str(path))  # never adopt another user's directory
        os.replace(path, versions / f"{0:012d}-legacy-{uuid.uuid4().hex[:8]}")
    return versions


def _check_parent(parent: Path) -> None:
    """Refuse to save into a directory anyone may rename entries of (writable by others,
    without the sticky bit of ``/tmp``): they could swap the versions directory between our
    check and our writes. ``/tmp`` itself is fine: the sticky bit keeps others' hands off
    our entries, and what they pre-create there is refused by its owner."""
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        return  # created by save, with the process's umask
    except OSError as exc:
        raise CheckpointError(f"cannot inspect {parent}: {exc}") from exc
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise CheckpointError(
            f"{parent} is writable by others without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): any user could rename the checkpoint's "
            "versions directory and swap in their own while it is written. Fix: save into a "
            f"directory only you can write, or chmod +t {parent} (as /tmp is)")


def write_file(path: Path, data: bytes) -> str:
    """Write and fsync a fresh file (never through a link); returns its sha256."""
    return _fsync_write(path, data)


def stage(path: Path) -> Path:
    """A fresh staging directory in ``path``'s versions directory, for replicas that write
    files of their own (sharded checkpoints) before :func:`commit`."""
    tmp = _prepare_path(path) / f"tmp-{uuid.uuid4().hex}"
    tmp.mkdir(mode=_DIR_MODE)
    return tmp


def discard_staged(tmp: Path) -> None:
    """Remove a staging directory's files of our naming pattern, then the directory."""
    _remove_ours(tmp)


def commit(path: Path, files: dict[str, bytes], manifest: dict[str, Any], keep_last: int,
           staged: tuple[Path, dict[str, str]] | None = None) -> Path:
    """Write ``files`` and the manifest, then swap the link. ``staged``: a directory from
    :func:`stage` already holding files (name -> sha256) other replicas wrote."""
    versions = _prepare_path(path)
    name = f"{manifest['step'] % 10**12:012d}-{time.time_ns():020d}"
    manifest["version"] = name
    manifest["files"] = {fname: hashlib.sha256(data).hexdigest() for fname, data in files.items()}
    manifest["files"].update(staged[1] if staged is not None else {})
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if len(text) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"the manifest would take {len(text)} bytes, over the limit of "
                              f"{MAX_MANIFEST_BYTES} that restore reads. Fix: store large "
                              "extras as tensors (they go to extra.safetensors)")
    tmp = staged[0] if staged is not None else versions / f"tmp-{uuid.uuid4().hex}"
    if staged is None:
        tmp.mkdir(mode=_DIR_MODE)
    for fname, data in files.items():
        _fsync_write(tmp / fname, data)
    _fsync_write(tmp / MANIFEST_NAME, text)
    _fsync_dir(tmp)
    final = versions / name
    os.replace(tmp, final)
    _fsync_dir(versions)
    link_tmp = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(f"{versions.name}/{name}", link_tmp)
    os.replace(link_tmp, path)
    _fsync_dir(path.parent)
    ours = [d for d in _candidates(path) if d != final and _is_our_version(d)]
    for old in ours[keep_last - 1:]:
        # Renamed out of sight first (one atomic rename), so a kill during the removal never
        # leaves a half-deleted version that looks like a candidate.
        doomed = versions / f"tmp-del-{uuid.uuid4().hex}"
        try:
            os.replace(old, doomed)
        except OSError:
            continue
        _remove_ours(doomed)
    with os.scandir(versions) as entries:
        stale = [versions / e.name for e in entries
                 if _TMP_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    for d in stale:
        try:
            old_enough = time.time() - os.lstat(d).st_mtime > 3600
        except OSError:
            continue
        if old_enough:
            _remove_ours(d)
    return final
