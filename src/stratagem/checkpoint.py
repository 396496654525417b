"""Atomic, verified, portable checkpoints: safetensors + JSON, never pickle.

Layout: ``path`` is a symbolic link to ``<parent>/.<name>.versions/<step>-<id>/``, a directory
holding ``model.safetensors`` (the model users keep, under the module's own names: the
replicated model, or the global/center model of parameter-server and elastic-averaging
strategies), optimizer state (``optimizer.safetensors``: tensors plus the JSON skeleton in its
metadata; ``optimizer.rank<r>.safetensors`` per rank when the state is local to each worker),
``strategy.safetensors`` (center, outer momentum, ...), ``rng.rank<r>.safetensors`` (every
rank's RNG states), ``extra.safetensors`` (tensor extras) and ``manifest.json`` (strategy,
world size, step, JSON extras, aliases of shared parameters, sha256 of every file).

A save writes and fsyncs a new version directory, then swaps the link with one
``os.replace``: a crash at any instant leaves ``path`` pointing at a complete checkpoint.
``restore`` verifies every checksum and, if ``path`` is damaged, falls back to the newest
intact version with a warning. ``save`` and ``restore`` are collectives: each replica
contributes what only it holds, the chief writes.

Ownership: ``save`` replaces ``path`` only when it is a link of ours (relative, into our own
versions directory, our naming pattern) or a legacy checkpoint directory, and removes only
version directories of our naming pattern holding our manifest, and inside them only the
files of our naming pattern; a versions directory or member that is a symbolic link is
refused. ``restore`` opens each member once (``O_NOFOLLOW``, regular files only, names from
the manifest checked against our pattern), hashes those bytes and parses the same bytes.

Shared (tied) parameters are stored once under their first name (safetensors' own convention,
so ``safetensors.torch.load_model`` re-ties them); the other names are recorded as
``aliases`` in the manifest and filled in again on restore. ``torch.compile``'s ``_orig_mod.``
segments never reach a file.

Nothing is ever unpickled: every ``.safetensors`` header is checked (length proportionate to
the data, nesting depth, JSON, dtypes, shapes, offsets, number of entries) against the file
size *before* any tensor is allocated, so a malicious or truncated file raises
:class:`~stratagem.CheckpointError` instead of allocating what its header claims; a ``.pt``
file is read only through ``torch.load(weights_only=True)``, only after its zip directory
showed uncompressed members no larger than the file, and only when it holds tensors
(:func:`load_pt`). See ``docs/reliability.md`` for the guarantees.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
import time
import uuid
import warnings
import zipfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from . import sharded_checkpoint as sharded
from .data import DistributedLoader
from .errors import CheckpointError
from .strategy import Strategy, register_feature
from .validation import check_int

__all__ = ["save", "restore", "exists", "read_extras", "load_model_state", "load_pt",
           "read_safetensors", "FORMAT_VERSION", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH",
           "MAX_MANIFEST_BYTES", "MAX_EMPTY_TENSORS", "MAX_PT_MEMBERS"]

FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
#: Largest safetensors JSON header accepted (the format's own reference limit is 100 MB; ours
#: hold names, shapes and an optimizer skeleton, a few MB for the largest models).
MAX_HEADER_BYTES = 64 << 20
#: A header may always take this many bytes; beyond it, at most ``_HEADER_BYTES_PER_DATA_BYTE``
#: header bytes per data byte (one entry is ~100 bytes of JSON and holds >= 1 data byte unless
#: it is empty), so a header full of empty entries is refused before it is parsed.
_HEADER_BASE_BYTES = 1 << 20
_HEADER_BYTES_PER_DATA_BYTE = 64
#: Entries holding no data (shape with a 0) a safetensors header may list: they cost a tensor
#: object each and nothing on disk.
MAX_EMPTY_TENSORS = 1024
#: Tensors a safetensors file may list: ``_ENTRIES_BASE`` plus one per ``_DATA_BYTES_PER_ENTRY``
#: bytes of data. Each entry costs ~35 us and a tensor object to parse and load (measured: 20k
#: two-byte tensors took 0.75 s), so a header of many tiny entries is refused before it is
#: loaded; real checkpoints average kilobytes per tensor (an Adam state of 64-wide LayerNorms:
#: ~170 bytes per entry).
_ENTRIES_BASE = 4096
_DATA_BYTES_PER_ENTRY = 64
#: Deepest JSON nesting accepted in a manifest or a header (objects and arrays count one level
#: each; a Python dict of dicts stored by ``save`` takes three levels per level).
MAX_JSON_DEPTH = 96
#: Largest ``manifest.json`` accepted (names, checksums, JSON extras, loader state).
MAX_MANIFEST_BYTES = 16 << 20
#: Most members a ``.pt`` zip may hold (torch writes one per storage plus a few records).
MAX_PT_MEMBERS = 1 << 16
#: Bytes per element of the dtypes a checkpoint may hold (anything else is refused).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: Names we create, and the only ones we read or delete.
_VERSION_RE = re.compile(r"\d{12}-(?:\d{20}|legacy-[0-9a-f]{8})")
_TMP_RE = re.compile(r"tmp-(?:del-)?[0-9a-f]{32}")
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_MEMBER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}(?:\.rank\d{1,6})?\.safetensors")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CORRUPT = "Fix: the checkpoint is corrupt or was not written by stratagem; restore another version"


# ---------------------------------------------------------------------- bounded JSON
_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN_CLOSE = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _brackets(raw: bytes) -> bytes:
    """The structural brackets of the JSON text ``raw`` (those outside strings), in order."""
    return _STRING_RE.sub(b"", raw).translate(None, _NOT_BRACKETS)


def _json_depth_ok(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``raw`` nests at most ``limit`` levels, decided at C speed (strings
    removed by one regex pass, brackets kept, running depth by a chunked cumsum) so a deep
    document is refused before ``json.loads`` recurses into it."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return True
    brackets = _brackets(raw).translate(_OPEN_CLOSE)
    depth = 0
    chunk = 1 << 20
    for start in range(0, len(brackets), chunk):
        part = torch.frombuffer(bytearray(brackets[start:start + chunk]), dtype=torch.int8)
        running = torch.cumsum(part, 0, dtype=torch.int64) + depth
        if int(running.max()) > limit:
            return False
        depth = int(running[-1])
    return True


def _loads(raw: bytes | str, what: str) -> Any:
    """``json.loads`` bounded in depth; every failure is a ``CheckpointError``."""
    data = raw.encode() if isinstance(raw, str) else raw
    if not _json_depth_ok(data):
        raise CheckpointError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels. "
                              f"{_CORRUPT}")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{what} is not valid JSON ({exc}). {_CORRUPT}") from exc


def _dumps_checked(obj: Any, what: str, depth: int = MAX_JSON_DEPTH) -> str:
    """``json.dumps`` of something ``save`` writes, refused if ``restore`` would refuse it."""
    try:
        text = json.dumps(obj, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot checkpoint {what}: not JSON-able ({exc}). Fix: extras must "
                              "be tensors or JSON-able values (no pickle)") from exc
    if not _json_depth_ok(text.encode(), depth):
        raise CheckpointError(f"cannot checkpoint {what}: nested deeper than {depth} "
                              "JSON levels (a Python dict/list level takes up to 3). Fix: "
                              "flatten the structure")
    return text


# ---------------------------------------------------------------------- state <-> (tensors, json)
def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace tensors in a nested structure by references; collect them in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_split(k, "", {}) if not isinstance(k, (str, int)) else k,
                              _split(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__":
                [_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot checkpoint a {type(obj).__name__} at {prefix!r}: only tensors, "
                          "numbers, strings, None and dict/list/tuple of them are stored (no pickle)")


def _join(obj: Any, tensors: dict[str, torch.Tensor], what: str) -> Any:
    """Inverse of :func:`_split`; any shape it never writes is refused (recursion is bounded
    by the depth check made before the JSON was parsed)."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            if not isinstance(key, str) or key not in tensors:
                raise CheckpointError(f"{what} refers to tensor {key!r:.80} that is not stored. "
                                      f"{_CORRUPT}")
            return tensors[key]
        if "__dict__" in obj:
            items = obj["__dict__"]
            if not isinstance(items, list) or not all(
                    isinstance(kv, list) and len(kv) == 2 for kv in items):
                raise CheckpointError(f"{what}: a stored dict is not a list of [key, value] "
                                      f"pairs. {_CORRUPT}")
            out: dict[Any, Any] = {}
            for k, v in items:
                key = _join(k, tensors, what) if isinstance(k, dict) else k
                if not isinstance(key, (str, int, float, bool, tuple)) or key is None:
                    raise CheckpointError(f"{what}: a stored dict key is a "
                                          f"{type(key).__name__}. {_CORRUPT}")
                try:
                    out[key] = _join(v, tensors, what)
                except TypeError as exc:  # a tuple key holding something unhashable
                    raise CheckpointError(f"{what}: unusable dict key ({exc}). {_CORRUPT}") from exc
            return out
        for tag, kind in (("__list__", list), ("__tuple__", tuple)):
            if tag in obj:
                values = obj[tag]
                if not isinstance(values, list):
                    raise CheckpointError(f"{what}: {tag} holds a {type(values).__name__}, not "
                                          f"a list. {_CORRUPT}")
                return kind(_join(v, tensors, what) for v in values)
        raise CheckpointError(f"{what}: unexpected entry in checkpoint JSON: "
                              f"{sorted(map(str, obj))[:3]}. {_CORRUPT}")
    if isinstance(obj, list):
        raise CheckpointError(f"{what}: a bare JSON list where a stored value was expected. "
                              f"{_CORRUPT}")
    return obj


def _pack(obj: Any, what: str) -> bytes:
    """A nested state as one byte string: safetensors (tensors + the JSON skeleton in its
    metadata header), checked against the limits ``restore`` applies."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        skeleton = _split(obj, "", tensors)
    except RecursionError as exc:
        raise CheckpointError(f"cannot checkpoint {what}: nested too deeply. Fix: flatten the "
                              "structure") from exc
    data = _st_save(tensors, {"skeleton": _dumps_checked(skeleton, what)}, what)
    _check_header(data, f"{what} (as written)")
    return data


def _unpack(data: bytes, what: str) -> Any:
    header = _check_header(data, what)
    tensors = _st_load(data, what)
    skeleton = _loads(header.get("__metadata__", {}).get("skeleton", "null"),
                      f"{what} skeleton metadata")
    return _join(skeleton, tensors, what)


def _st_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
             what: str) -> bytes:
    try:
        return st_save(tensors, metadata=metadata)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"cannot write {what} as safetensors: {exc}. Fix: store dense, "
                              "non-overlapping tensors") from exc


# ---------------------------------------------------------------------- safe parsing
def _header_limit(size: int) -> int:
    """Most header bytes a ``size``-byte file may spend: ``_HEADER_BASE_BYTES``, or beyond that
    at most ``_HEADER_BYTES_PER_DATA_BYTE`` per byte of tensor data, so a header that is all
    empty entries is refused before it is parsed."""
    room = max(size - 8, 0)
    proportional = _HEADER_BYTES_PER_DATA_BYTE * room // (_HEADER_BYTES_PER_DATA_BYTE + 1)
    return min(MAX_HEADER_BYTES, room, max(_HEADER_BASE_BYTES, proportional))


def _check_header(data: bytes, what: str) -> dict[str, Any]:
    """Validate the safetensors header of ``data`` (a whole file's bytes) without trusting it.
    Returns the parsed header; raises ``CheckpointError`` before anything proportional to
    what the header claims is allocated."""
    fix = "Fix: the file is corrupt or not a stratagem/safetensors file; restore another version."
    size = len(data)
    if size < 8:
        raise CheckpointError(f"{what} is not a safetensors file: {size} bytes, shorter than "
                              f"the 8-byte header length. {fix}")
    n = int.from_bytes(data[:8], "little")
    limit = _header_limit(size)
    if n > limit:
        raise CheckpointError(f"{what}: header length {n} is over the limit "
                              f"(max {limit} bytes for this {size}-byte file: "
                              f"{_HEADER_BASE_BYTES} + {_HEADER_BYTES_PER_DATA_BYTE} per data "
                              f"byte, at most {MAX_HEADER_BYTES}). {fix}")
    raw = bytes(data[8:8 + n])
    data_len = size - 8 - n
    most = _ENTRIES_BASE + data_len // _DATA_BYTES_PER_ENTRY
    # Every entry is a JSON object: count them (outside strings) before parsing anything.
    if raw.count(b"{") - 1 > most and _brackets(raw).count(b"{") - 1 > most:
        raise CheckpointError(f"{what}: header lists more than {most} tensors for {data_len} "
                              f"data bytes ({_ENTRIES_BASE} plus one per "
                              f"{_DATA_BYTES_PER_ENTRY} data bytes). {fix}")
    header = _loads(raw, f"{what}: header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{what}: header must be a JSON object, got "
                              f"{type(header).__name__}. {fix}")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{what}: __metadata__ must map strings to strings. {fix}")
    entries = len(header) - ("__metadata__" in header)
    if entries > most:
        raise CheckpointError(f"{what}: header lists {entries} tensors for {data_len} data "
                              f"bytes, over the limit of {most} ({_ENTRIES_BASE} plus one per "
                              f"{_DATA_BYTES_PER_ENTRY} data bytes). {fix}")
    empty = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(f"{what}: entry {name!r:.80} is not an object. {fix}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
            raise CheckpointError(f"{what}: tensor {name!r:.80} has dtype {dtype!r:.40}, not one "
                                  f"of the allowed {sorted(_DTYPE_BYTES)}. {fix}")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48
                for d in shape)):
            raise CheckpointError(f"{what}: tensor {name!r:.80} has shape {shape!r:.80}; "
                                  f"expected a list of at most 64 non-negative ints. {fix}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise CheckpointError(f"{what}: tensor {name!r:.80} has data_offsets "
                                  f"{offsets!r:.80}; expected [begin, end]. {fix}")
        begin, end = offsets
        numel = math.prod(shape)
        if numel == 0:
            empty += 1
            if empty > MAX_EMPTY_TENSORS:
                raise CheckpointError(f"{what}: more than {MAX_EMPTY_TENSORS} empty tensors in "
                                      f"the header. {fix}")
        if not 0 <= begin <= end <= data_len or end - begin != numel * _DTYPE_BYTES[dtype]:
            raise CheckpointError(
                f"{what}: tensor {name!r:.80} ({dtype}, shape {shape}) has data_offsets "
                f"[{begin}, {end}], out of range for {data_len} data bytes or not "
                f"{numel * _DTYPE_BYTES[dtype]} bytes long. {fix}")
    return header


def _st_load(data: bytes, what: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CheckpointError(f"{what} is not a valid safetensors file: {exc}") from exc


def _read_regular(file: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file, read once (a FIFO or device is refused before reading)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {exc}") from exc
    return _read_fd(fd, what, limit)


def _read_fd(fd: int, what: str, limit: int | None) -> bytes:
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{what} is not a regular file; refusing to read it. Fix: "
                                  "point at the checkpoint's own files")
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"{what} is {st.st_size} bytes, over the limit of {limit}. "
                                  f"{_CORRUPT}")
        data = f.read(st.st_size + 1)
    if len(data) != st.st_size:
        raise CheckpointError(f"{what} changed size while being read ({st.st_size} -> "
                              f"{len(data)} bytes). Fix: do not write a checkpoint while "
                              "restoring it")
    return data


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file as a dict of tensors, its header checked before anything is
    allocated (see the module docstring). Raises ``CheckpointError`` for a bad file."""
    file = Path(path)
    data = _read_regular(file, str(file))
    _check_header(data, str(file))
    return _st_load(data, str(file))


def _check_pt_zip(data: bytes, file: Path) -> None:
    """Bound what ``torch.load`` may allocate for ``data`` (a ``.pt`` file's bytes): torch
    writes a zip of STORED members, one per storage; a compressed member or declared sizes
    larger than the file could inflate to any size."""
    fix = ("Fix: re-save it with torch.save(model.state_dict(), path) (uncompressed zip, the "
           "default) or, better, with safetensors")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise CheckpointError(f"{file} is not a zip-format torch.save file; the legacy format "
                              "is refused because its sizes cannot be checked before "
                              f"torch.load(weights_only=True) allocates them. {fix}")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as exc:
        raise CheckpointError(f"{file} is not a readable zip ({exc}). {fix}") from exc
    if len(infos) > MAX_PT_MEMBERS:
        raise CheckpointError(f"{file} holds {len(infos)} zip members, over the limit of "
                              f"{MAX_PT_MEMBERS}. {fix}")
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{file}: zip member {info.filename!r:.80} is compressed "
                                  f"(method {info.compress_type}, {info.compress_size} -> "
                                  f"{info.file_size} bytes); torch writes members stored, and a "
                                  f"compressed one may inflate without bound. {fix}")
        total += info.file_size
    if total > len(data):
        raise CheckpointError(f"{file}: its zip members declare {total} bytes, more than the "
                              f"file's {len(data)} bytes (stored members cannot be larger "
                              f"than the file holding them). {fix}")


def load_pt(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A ``.pt``/``.pth`` state dict read with ``torch.load(weights_only=True)`` (no arbitrary
    unpickling), after its zip directory was bounded by the file size (:func:`_check_pt_zip`).
    Refused with ``CheckpointError`` unless it holds a tensor or a (nested) mapping of string
    keys to tensors; nested mappings are flattened with ``.`` as in ``state_dict()``. The file
    is read once: the bytes checked are the bytes loaded."""
    file = Path(path)
    data = _read_regular(file, str(file))
    _check_pt_zip(data, file)
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, zip errors, OSError...
        raise CheckpointError(
            f"{file} was refused by torch.load(weights_only=True): {str(exc).splitlines()[0]}. "
            "Fix: only plain tensor state dicts load; re-save with "
            "torch.save(model.state_dict(), path) or, better, safetensors") from exc
    out: dict[str, torch.Tensor] = {}

    def walk(value: Any, prefix: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix or "_"] = value
        elif isinstance(value, dict) and all(isinstance(k, str) for k in value) and depth < 64:
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else k, depth + 1)
        else:
            raise CheckpointError(
                f"{file} holds a {type(value).__name__} at {prefix or 'the top level'!r}; only "
                "tensors and dicts of them (at most 64 levels) load as a state dict. Fix: save "
                "model.state_dict() alone")

    walk(obj, "", 0)
    return out


# ---------------------------------------------------------------------- files and ownership
def _fsync_write(path: Path, data: bytes) -> str:
    with open(path, "xb") as f:  # "x": a fresh file in our fresh directory, never a link
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


def _clean_path(path: str | os.PathLike[str]) -> Path:
    return Path(os.fspath(path).rstrip("/") or ".")


def _versions_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.versions"


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds (or once held, with versions left) a stratagem checkpoint."""
    p = _clean_path(path)
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
        mode = os.lstat(versions).st_mode
    except FileNotFoundError:
        return versions
    except OSError as exc:
        raise CheckpointError(f"cannot inspect {versions}: {exc}") from exc
    if not stat.S_ISDIR(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
        raise CheckpointError(
            f"{versions} is {what}; stratagem creates it as a plain directory and never follows "
            "a link out of what it owns, so it refuses to save or restore through it. Fix: "
            f"remove {versions} (check first what it points to) or choose another path")
    return versions


def _read_manifest_at(directory: Path) -> Any:
    """The parsed manifest of a directory, read without following a link (``None`` if absent,
    not a regular file or not JSON)."""
    try:
        fd = os.open(directory / _MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return _loads(_read_fd(fd, str(directory / _MANIFEST), MAX_MANIFEST_BYTES),
                      str(directory / _MANIFEST))
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
                     if (e.name == _MANIFEST or _MEMBER_RE.fullmatch(e.name))
                     and e.is_file(follow_symlinks=False)]
        for name in sorted(names, key=lambda n: n == _MANIFEST):  # the manifest last
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
def _open_member(dfd: int, directory: Path, name: str) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as exc:
        if _is_link(directory / name):
            raise CheckpointError(f"{directory / name} is a symbolic link; a checkpoint's files "
                                  "are regular files inside its directory and links are never "
                                  f"followed. {_CORRUPT}") from exc
        raise CheckpointError(f"{directory}: cannot read {name} ({exc}): not a complete "
                              "checkpoint") from exc


def _read_member(dfd: int, directory: Path, name: str, limit: int | None = None) -> bytes:
    return _read_fd(_open_member(dfd, directory, name), str(directory / name), limit)


def _hash_member(dfd: int, directory: Path, name: str) -> str:
    """sha256 of a member this rank does not load (other ranks' files), streamed."""
    with os.fdopen(_open_member(dfd, directory, name), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"{directory / name} is not a regular file. {_CORRUPT}")
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _int(value: Any, low: int = 0, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _bad(where: Path, field: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{where / _MANIFEST}: {field} is {value!r:.80}, expected "
                           f"{expected}. {_CORRUPT}")


def _check_manifest(m: Any, where: Path) -> dict[str, Any]:
    """Every field ``restore`` uses, with the type it uses it as (a malformed manifest is a
    ``CheckpointError``, never a ``TypeError``/``KeyError`` deep in a load)."""
    if not isinstance(m, dict):
        raise _bad(where, "the manifest", type(m).__name__, "a JSON object")
    if m.get("format") != FORMAT_VERSION or isinstance(m.get("format"), bool):
        raise CheckpointError(f"{where}: unknown checkpoint format {m.get('format')!r:.40}; this "
                              f"stratagem reads format {FORMAT_VERSION}. Fix: restore it with "
                              "the stratagem version that wrote it")
    files = m.get("files")
    if not isinstance(files, dict):
        raise _bad(where, "files", files, "an object of file name -> sha256")
    for name, digest in files.items():
        if _MEMBER_RE.fullmatch(name) is None:
            raise CheckpointError(f"{where}: the manifest lists file {name!r:.80}, not a name "
                                  "stratagem writes (<key>[.rank<r>].safetensors, no path "
                                  f"separators, no links out). {_CORRUPT}")
        if not isinstance(digest, str) or _SHA256_RE.fullmatch(digest) is None:
            raise _bad(where, f"files[{name!r}]", digest, "a sha256 hex digest")
    objects = m.get("objects", {})
    if not isinstance(objects, dict):
        raise _bad(where, "objects", objects, "an object")
    for key, entry in objects.items():
        if not isinstance(entry, dict):
            raise _bad(where, f"objects[{key!r}]", entry, "an object")
        kind = entry.get("kind")
        if kind == "module":
            if not isinstance(entry.get("file"), str) or entry["file"] not in files:
                raise CheckpointError(f"{where}: the manifest refers to "
                                      f"{entry.get('file')!r:.80} for {key!r}, which is not one "
                                      f"of its checksummed files. {_CORRUPT}")
            if "local_steps" in entry and not _int(entry["local_steps"]):
                raise _bad(where, f"objects[{key!r}].local_steps", entry["local_steps"],
                           "an int >= 0")
            aliases = entry.get("aliases", {})
            if not (isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())):
                raise _bad(where, f"objects[{key!r}].aliases", aliases,
                           "an object of alias -> stored name")
        elif kind == "optimizer":
            if not _int(entry.get("per_rank", 0), 0, 1 << 16):
                raise _bad(where, f"objects[{key!r}].per_rank", entry.get("per_rank"),
                           "an int in [0, 65536]")
        elif kind == "loader":
            state = entry.get("state")
            if not (isinstance(state, dict) and _int(state.get("epoch"))
                    and _int(state.get("step_in_epoch"))):
                raise _bad(where, f"objects[{key!r}].state", state,
                           "{'epoch': int >= 0, 'step_in_epoch': int >= 0, ...}")
        else:
            raise _bad(where, f"objects[{key!r}].kind", kind, "module, optimizer or loader")
    if not isinstance(m.get("extra", {}), dict):
        raise _bad(where, "extra", m.get("extra"), "an object")
    precision = m.get("precision", {})
    if not isinstance(precision, dict):
        raise _bad(where, "precision", precision, "an object")
    if "scale" in precision and not (
            isinstance(precision["scale"], (int, float)) and not isinstance(precision["scale"], bool)
            and math.isfinite(precision["scale"]) and precision["scale"] > 0):
        raise _bad(where, "precision.scale", precision["scale"], "a finite number > 0")
    if "growth_tracker" in precision and not _int(precision["growth_tracker"]):
        raise _bad(where, "precision.growth_tracker", precision["growth_tracker"], "an int >= 0")
    for field, low in (("steps", 0), ("step", -(1 << 62)), ("world_size", 1)):
        if field in m and not _int(m[field], low):
            raise _bad(where, field, m[field], f"an int >= {low}")
    return m


_Wanted = Callable[[dict[str, Any]], Collection[str]]


def _verify(directory: Path, wanted: _Wanted) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest of an intact checkpoint directory and the bytes of the files ``wanted``
    names; ``CheckpointError`` otherwise. Every member is opened once: the files loaded are
    hashed in memory and the same bytes returned; the others are hashed streaming."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise CheckpointError(f"{directory} is not a readable checkpoint directory: {exc}") from exc
    try:
        try:
            raw = _read_member(dfd, directory, _MANIFEST, MAX_MANIFEST_BYTES)
        except CheckpointError as exc:
            raise CheckpointError(f"{directory} has no readable {_MANIFEST}: not a complete "
                                  f"checkpoint ({exc})") from exc
        manifest = _check_manifest(_loads(raw, str(directory / _MANIFEST)), directory)
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
    finally:
        os.close(dfd)


def _resolve(path: Path, wanted: _Wanted) -> tuple[Path, dict[str, Any], dict[str, bytes]]:
    """The checkpoint to load at ``path``: itself if intact, else the newest intact version
    (a link of ours is only followed into a plain versions directory)."""
    errors: list[str] = []
    follow = True
    if _is_our_link(path):
        target = _check_versions_dir(path) / os.readlink(path).split("/")[1]
        if _is_link(target):
            follow = False  # a link planted in our versions directory is never followed
            errors.append(f"{target} is a symbolic link, not a version directory stratagem "
                          "wrote; refusing to follow it")
    current: Path | None = None
    if follow and path.exists():
        current = path.resolve()
        try:
            return current, *_verify(current, wanted)
        except CheckpointError as exc:
            errors.append(str(exc))
    for candidate in _candidates(path):
        if candidate.resolve() == current:
            continue
        try:
            manifest, blobs = _verify(candidate, wanted)
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        warnings.warn(f"checkpoint at {path} is damaged or missing ({errors[0] if errors else 'missing'}); "
                      f"restoring the newest intact one, {candidate}", RuntimeWarning, stacklevel=3)
        return candidate, manifest, blobs
    raise CheckpointError(f"no intact checkpoint at {path}" + (f": {'; '.join(errors)}" if errors else "")
                          + ". Fix: check the path, or save a checkpoint first.")


def _member(directory: Path, blobs: dict[str, bytes], name: Any) -> bytes:
    """A verified file of the checkpoint, only if the manifest lists (and so checksummed) it:
    a forged manifest cannot point a load at another path."""
    if not isinstance(name, str) or name not in blobs:
        raise CheckpointError(f"{directory}: the manifest refers to {name!r:.80}, which is not "
                              "one of its checksummed files. Fix: the checkpoint is corrupt; "
                              "restore another version")
    return blobs[name]


def _tensors(directory: Path, blobs: dict[str, bytes], name: Any) -> dict[str, torch.Tensor]:
    data = _member(directory, blobs, name)
    what = str(directory / name)
    _check_header(data, what)
    return _st_load(data, what)


def _extras(directory: Path, manifest: dict[str, Any], blobs: dict[str, bytes]) -> dict[str, Any]:
    result: dict[str, Any] = dict(manifest.get("extra", {}))
    if "extra.safetensors" in manifest["files"]:
        extra = _unpack(_member(directory, blobs, "extra.safetensors"),
                        str(directory / "extra.safetensors"))
        if not isinstance(extra, dict):
            raise CheckpointError(f"{directory}/extra.safetensors holds a "
                                  f"{type(extra).__name__}, not a dict. {_CORRUPT}")
        result.update(extra)
    result.setdefault("step", manifest.get("steps", 0))
    return result


def read_extras(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The saved extras of the checkpoint at ``path`` (``step`` and every keyword given to
    ``save`` that is not a module, optimizer or loader), readable before any model or strategy
    exists — e.g. the model configuration needed to build the model. The manifest and the
    extras file are verified as by ``restore`` (same fall-back to the newest intact version);
    nothing else is loaded."""
    directory, manifest, blobs = _resolve(_clean_path(path), lambda m: {"extra.safetensors"})
    return _extras(directory, manifest, blobs)


def load_model_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The verified ``model.safetensors`` of a checkpoint, as a state dict (shared parameters
    under every one of their names)."""
    def wanted(m: dict[str, Any]) -> set[str]:
        entry = m.get("objects", {}).get("model")
        if isinstance(entry, dict) and isinstance(entry.get("sharded"), dict):
            return set(sharded.shard_files(entry, str(path)))
        return {"model.safetensors"}

    directory, manifest, blobs = _resolve(_clean_path(path), wanted)
    entry = manifest.get("objects", {}).get("model", {})
    tensors = (_merge_shards(directory, blobs, entry) if "sharded" in entry
               else _tensors(directory, blobs, "model.safetensors"))
    for alias, canonical in entry.get("aliases", {}).items():
        if canonical in tensors:
            tensors.setdefault(alias, tensors[canonical])
    return tensors


# ---------------------------------------------------------------------- module names and ties
def _clean_name(name: str) -> str:
    """A state-dict name without ``torch.compile``'s ``_orig_mod`` segments (a compiled module,
    or a compiled submodule, saves and loads under the plain module's names)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of its storage a (non-empty) tensor can touch."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = int(t.storage_offset()) * t.element_size()
    return start, start + (int(last) + 1) * t.element_size()


def _dedupe(tensors: dict[str, torch.Tensor], what: str, *, alias: bool = True
            ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each storage once: names that are the same view of one storage (tied parameters) become
    aliases of the first name, which alone is stored (safetensors' own convention: its
    ``load_model`` re-ties them); with ``alias=False`` they are stored as copies instead (for
    state whose reader looks every name up). Different views overlapping in one storage cannot
    be stored as views; they are stored as copies. Returns (tensors to store on the CPU,
    alias -> name)."""
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"cannot checkpoint {what}: state entry {name!r} is a "
                                  f"{type(value).__name__}, not a tensor (no pickle)")
        t = value.detach()
        if t.numel() and t.layout == torch.strided and t.device.type != "meta":
            view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                    tuple(t.shape), tuple(t.stride()), t.dtype)
            if view in seen:
                if alias:
                    aliases[name] = seen[view]
                    continue
                t = t.clone()
                view = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                        tuple(t.shape), tuple(t.stride()), t.dtype)
            seen[view] = name
        out[name] = t
    spans: dict[tuple[Any, int], list[tuple[int, int, str]]] = {}
    for view, name in seen.items():
        spans.setdefault((view[0], view[1]), []).append((*_extent(out[name]), name))
    for group in spans.values():
        group.sort()
        end, prev = -1, ""
        for start, stop, name in group:
            if start < end:  # overlaps an earlier view: store both as independent copies
                out[prev], out[name] = out[prev].clone(), out[name].clone()
            if stop > end:
                end, prev = stop, name
    return {k: v.cpu().contiguous() for k, v in out.items()}, aliases


def _fit_module(module: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                what: str) -> dict[str, torch.Tensor]:
    """The saved tensors under ``module``'s own state-dict names: ``_orig_mod`` seen through,
    aliases of shared parameters filled from their stored name (recorded ones, and ties of
    ``module`` itself, so a file written by ``safetensors.torch.save_model`` loads too), and
    names and shapes checked so a mismatch is a ``CheckpointError`` naming them."""
    own = module.state_dict(keep_vars=True)
    keys = {_clean_name(k): k for k in own}
    filled = {_clean_name(k): v for k, v in tensors.items()}
    for alias, canonical in aliases.items():
        if alias in keys and alias not in filled and canonical in filled:
            filled[alias] = filled[canonical]
    ties: dict[int, list[str]] = {}
    for k, v in own.items():
        ties.setdefault(id(v), []).append(_clean_name(k))
    for names in ties.values():
        source = next((n for n in names if n in filled), None)
        if len(names) > 1 and source is not None:
            for n in names:
                filled.setdefault(n, filled[source])
    missing = [k for k in keys if k not in filled]
    unexpected = [k for k in filled if k not in keys]
    fix = ("Fix: build the model with the same class and configuration as the saved one "
           "(sg.checkpoint.read_extras(path) reads the saved extras before the model exists)")
    if missing or unexpected:
        raise CheckpointError(f"{what} does not fit the {type(module).__name__} given: missing "
                              f"{missing[:5]} ({len(missing)} in all), unexpected "
                              f"{unexpected[:5]} ({len(unexpected)} in all). {fix}")
    for name, key in keys.items():
        have, saved = own[key], filled[name]
        if isinstance(have, torch.Tensor) and tuple(have.shape) != tuple(saved.shape):
            raise CheckpointError(f"{what}: {name} has shape {tuple(saved.shape)} in the "
                                  f"checkpoint and {tuple(have.shape)} in the model. {fix}")
    return {keys[name]: t for name, t in filled.items()}


def _load_into(strategy: Strategy, module: nn.Module, tensors: dict[str, torch.Tensor],
               aliases: dict[str, str], what: str) -> None:
    """Load into a prepared model (every replica, collective) or a plain module."""
    prepared = strategy.find_prepared(module)
    target = prepared.module if prepared is not None else module
    strategy.load_model_state(module, _fit_module(target, tensors, aliases, what))


# ---------------------------------------------------------------------- save
def save(strategy: Strategy, path: str | os.PathLike[str], *, keep_last: int = 2,
         consolidate: bool = False, **state: Any) -> Path:
    """Collective save; see the module docstring. Returns the version directory written.
    State held in shards (``sg.Sharded``) is written by each replica, see
    :mod:`stratagem.sharded_checkpoint`; ``consolidate=True`` gathers it into the usual files."""
    check_int("keep_last", keep_last, minimum=1, fix="pass how many versions to keep, e.g. 2")
    path = _clean_path(path)
    comm = strategy.comm
    files: dict[str, bytes] = {}
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION, "strategy": type(strategy).__name__,
        "world_size": comm.world_size, "time": time.time(), "objects": {}, "extra": {},
    }
    extra_tensors: dict[str, Any] = {}
    strategy_state: dict[str, torch.Tensor] = {}
    own: dict[str, bytes] = {}  # files this replica writes itself (sharded state)
    for key, obj in state.items():
        if isinstance(obj, (nn.Module, torch.optim.Optimizer)) and _KEY_RE.fullmatch(key) is None:
            raise CheckpointError(f"cannot checkpoint {key!r}: modules and optimizers are stored "
                                  "in files named after their keyword, which must match "
                                  f"{_KEY_RE.pattern}. Fix: pass it as e.g. model=...")
        if isinstance(obj, nn.Module):
            prepared = strategy.find_prepared(obj)
            raw = strategy.model_state(obj)
            if sharded.is_sharded(raw) and not consolidate:
                entry = sharded.save_entry(comm, key, {_clean_name(k): v for k, v in raw.items()},
                                           own, "module", _pack)
                if prepared is not None:
                    entry["local_steps"] = strategy.local_steps(obj)
                    for k, v in sharded.gather_full(strategy.strategy_state(obj)).items():
                        strategy_state[f"{key}/{k}"] = v.detach()
                manifest["objects"][key] = entry
                continue
            raw = sharded.gather_full(raw) if sharded.is_sharded(raw) else raw
            tensors: dict[str, torch.Tensor] = {}
            for k, v in raw.items():
                name = _clean_name(k)
                if name in tensors:
                    raise CheckpointError(f"cannot checkpoint {key}: {k!r} and another entry "
                                          f"are both {name!r} once torch.compile's _orig_mod "
                                          "is seen through. Fix: rename one of them")
                tensors[name] = v
            unique, aliases = _dedupe(tensors, key)
            fname = "model.safetensors" if key == "model" else f"{key}.safetensors"
            files[fname] = _st_save(unique, {"format": "pt"}, key)
            manifest["objects"][key] = {"kind": "module", "file": fname}
            if aliases:
                manifest["objects"][key]["aliases"] = aliases
            if prepared is not None:
                # The local step counter keeps periodic schedules (averaging, elastic
                # exchange, outer steps) in phase across a resume.
                manifest["objects"][key]["local_steps"] = strategy.local_steps(obj)
                for k, v in sharded.gather_full(strategy.strategy_state(obj)).items():
                    strategy_state[f"{key}/{k}"] = v.detach()
        elif isinstance(obj, torch.optim.Optimizer):
            sd = strategy.optimizer_state(obj)
            if sharded.is_sharded(sd) and not consolidate:
                manifest["objects"][key] = sharded.save_entry(comm, key, sd, own, "optimizer", _pack)
                continue
            sd = sharded.gather_full(sd) if sharded.is_sharded(sd) else sd
            blob = _pack(sd, f"{key} (optimizer state)")
            if strategy.optimizer_state_is_local and comm.world_size > 1:
                for r, b in enumerate(comm.all_gather_bytes(blob)):
                    files[f"{key}.rank{r}.safetensors"] = b
                manifest["objects"][key] = {"kind": "optimizer", "per_rank": comm.world_size}
            else:
                files[f"{key}.safetensors"] = blob
                manifest["objects"][key] = {"kind": "optimizer", "per_rank": 0}
        elif isinstance(obj, DistributedLoader):
            manifest["objects"][key] = {"kind": "loader", "state": obj.state_dict()}
        elif isinstance(obj, torch.Tensor) or (isinstance(obj, (dict, list, tuple)) and _has_tensor(obj)):
            extra_tensors[key] = obj
        else:
            # Two levels less: the manifest holds it under "extra".
            _dumps_checked(obj, f"{key}={type(obj).__name__}", MAX_JSON_DEPTH - 2)
            manifest["extra"][key] = obj
    if strategy_state:
        # Strategies look each of their names up on restore: copies, not aliases.
        unique, _ = _dedupe(strategy_state, "strategy state", alias=False)
        files["strategy.safetensors"] = _st_save(unique, None, "strategy state")
    if extra_tensors:
        files["extra.safetensors"] = _pack(extra_tensors, "the tensor extras")
    manifest["precision"] = strategy.precision.state_dict()
    manifest["steps"] = strategy.steps
    step = manifest["extra"].get("step", strategy.steps)
    manifest["step"] = int(step) if isinstance(step, (int, float)) and math.isfinite(step) \
        else strategy.steps
    rng = _pack({"torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                "the RNG state")
    for r, b in enumerate(comm.all_gather_bytes(rng)):
        files[f"rng.rank{r}.safetensors"] = b

    written: Path | None = None
    failed = torch.zeros(1)
    error: BaseException | None = None
    if own:
        written, error = sharded.commit_with_shards(
            comm, own, stage=lambda: _stage(path), write=_fsync_write, abort=_remove_ours,
            commit=lambda tmp, digests: _commit(path, files, manifest, keep_last, (tmp, digests)))
        failed.fill_(1.0 if error is not None else 0.0)
    elif comm.rank == 0:
        try:
            written = _commit(path, files, manifest, keep_last)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
            failed.fill_(1.0)
    comm.all_reduce(failed, "max")
    if error is not None:
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"writing checkpoint {path} was refused: {error}") from error
        raise CheckpointError(f"writing checkpoint {path} failed: {error}") from error
    if failed.item() > 0:
        raise CheckpointError(f"the chief (rank 0) failed to write checkpoint {path}; see its log")
    return written if written is not None else path


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _prepare_path(path: Path) -> Path:
    """Check that ``save`` may replace ``path`` and may write its versions directory: ``path``
    is absent, a link of ours, or a checkpoint directory of the older flat layout (moved into
    the versions as ``<step>-legacy-<id>``); anything else is refused, naming it."""
    versions = _check_versions_dir(path)
    if _is_link(path) and not _is_our_link(path):
        raise CheckpointError(
            f"{path} is a symbolic link to {os.readlink(path)!r}, which stratagem did not create "
            f"(its links point to .{path.name}.versions/<step>-<time>); refusing to replace it. "
            "Fix: remove the link or choose another path")
    if not versions.exists():
        versions.mkdir(parents=True, exist_ok=True)
        _fsync_dir(versions.parent)  # the new directory entry itself must survive a crash
        _check_versions_dir(path)
    if path.exists() and not _is_link(path):
        m = _read_manifest_at(path) if path.is_dir() else None
        if not (isinstance(m, dict) and m.get("format") == FORMAT_VERSION):
            raise CheckpointError(f"{path} exists and is not a stratagem checkpoint; refusing to "
                                  "replace it. Fix: choose another path or remove it.")
        os.replace(path, versions / f"{0:012d}-legacy-{uuid.uuid4().hex[:8]}")
    return versions


def _stage(path: Path) -> Path:
    """A fresh staging directory in ``path``'s versions directory, for replicas that write
    files of their own (sharded checkpoints) before :func:`_commit`."""
    tmp = _prepare_path(path) / f"tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    return tmp


def _commit(path: Path, files: dict[str, bytes], manifest: dict[str, Any], keep_last: int,
            staged: tuple[Path, dict[str, str]] | None = None) -> Path:
    """Write ``files`` and the manifest, then swap the link. ``staged``: a directory from
    :func:`_stage` already holding files (name -> sha256) other replicas wrote."""
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
        tmp.mkdir()
    for fname, data in files.items():
        _fsync_write(tmp / fname, data)
    _fsync_write(tmp / _MANIFEST, text)
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


# ---------------------------------------------------------------------- restore
def _set_rng(rng: Any, what: str) -> None:
    expected = torch.get_rng_state()
    state = rng.get("torch") if isinstance(rng, dict) else None
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1
            and state.numel() == expected.numel()):
        raise CheckpointError(f"{what}: the CPU RNG state must be a uint8 vector of "
                              f"{expected.numel()} bytes, got "
                              f"{getattr(state, 'dtype', type(state).__name__)} "
                              f"{tuple(getattr(state, 'shape', ()))}. {_CORRUPT}")
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8):
        raise CheckpointError(f"{what}: the CUDA RNG state must be a uint8 tensor or None, got "
                              f"{type(cuda).__name__}. {_CORRUPT}")
    try:
        torch.set_rng_state(state)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{what}: the RNG state was refused by torch ({exc}). "
                              f"{_CORRUPT}") from exc


def _wanted_by(rank: int, world_size: int, state: dict[str, Any]) -> _Wanted:
    """Which files this rank loads (the others are only hashed): its modules, its optimizer
    file, the strategy and extra files, and its RNG file when the world size matches."""
    def wanted(m: dict[str, Any]) -> set[str]:
        objects = m.get("objects", {})
        names = {"strategy.safetensors", "extra.safetensors"}
        for key in state:
            entry = objects.get(key)
            if not isinstance(entry, dict):
                continue
            if isinstance(entry.get("sharded"), dict):
                names.update(sharded.shard_files(entry, str(key)))
            elif entry.get("kind") == "module":
                names.add(entry["file"])
            elif entry.get("kind") == "optimizer":
                per_rank = entry.get("per_rank", 0)
                names.add(f"{key}.rank{rank % per_rank}.safetensors" if per_rank
                          else f"{key}.safetensors")
        if m.get("world_size") == world_size:
            names.add(f"rng.rank{rank}.safetensors")
        return names
    return wanted


def restore(strategy: Strategy, path: str | os.PathLike[str], **state: Any) -> dict[str, Any]:
    """Collective restore; returns the saved extras (``step`` and the rest).

    ``path`` is a checkpoint written by :func:`save` (verified; the newest intact version is
    used, with a warning, when it is damaged) or a bare model file (``.safetensors``, or
    ``.pt``/``.pth`` read with ``torch.load(weights_only=True)``), which then fills the single
    module passed (``model=``) and returns ``{"step": 0}``."""
    raw = _clean_path(path)
    if raw.is_file():
        return _restore_model_file(strategy, raw, state)
    comm = strategy.comm
    directory, manifest, blobs = _resolve(raw, _wanted_by(comm.rank, comm.world_size, state))
    objects = manifest.get("objects", {})
    files = manifest["files"]
    strategy_state = (_tensors(directory, blobs, "strategy.safetensors")
                      if "strategy.safetensors" in files else {})
    result = _extras(directory, manifest, blobs)
    for key, obj in state.items():
        entry = objects.get(key)
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint {directory} holds no {key!r}; it holds "
                                  f"{sorted(objects) or 'no objects'}")
        if isinstance(obj, nn.Module):
            if entry["kind"] != "module":
                raise CheckpointError(f"checkpoint {directory}: {key!r} is a saved "
                                      f"{entry['kind']}, not a module. Fix: pass {key}= the "
                                      "kind of object that was saved under that name")
            tensors = (_merge_shards(directory, blobs, entry) if "sharded" in entry
                       else _tensors(directory, blobs, entry["file"]))
            if strategy.find_prepared(obj) is not None:
                strategy.set_local_steps(obj, int(entry.get("local_steps",
                                                            strategy.local_steps(obj))))
            _load_into(strategy, obj, tensors, entry.get("aliases", {}),
                       str(directory / entry["file"]))
            prefix = f"{key}/"
            strategy.load_strategy_state(obj, {k[len(prefix):]: v for k, v in
                                               strategy_state.items() if k.startswith(prefix)})
        elif isinstance(obj, torch.optim.Optimizer):
            if entry["kind"] != "optimizer":
                raise CheckpointError(f"checkpoint {directory}: {key!r} is a saved "
                                      f"{entry['kind']}, not an optimizer")
            per_rank = int(entry.get("per_rank", 0))
            # Local optimizer state saved by N workers, restored by M: rank r takes worker
            # r mod N's (the state of an identical model; exact when M == N).
            name = f"{key}.rank{comm.rank % per_rank}.safetensors" if per_rank else f"{key}.safetensors"
            opt_state = (_merge_shards(directory, blobs, entry) if "sharded" in entry else
                         _unpack(_member(directory, blobs, name), str(directory / name)))
            if not isinstance(opt_state, dict):
                raise CheckpointError(f"{directory / name} holds a {type(opt_state).__name__}, "
                                      f"not an optimizer state dict. {_CORRUPT}")
            try:
                strategy.load_optimizer_state(obj, opt_state)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise CheckpointError(
                    f"{directory / name} does not fit the {type(obj).__name__} given ({exc!r:.200}). "
                    "Fix: restore with the same optimizer class and parameter groups as the "
                    "saved one, or restore the model alone") from exc
        elif isinstance(obj, DistributedLoader):
            if entry["kind"] != "loader":
                raise CheckpointError(f"checkpoint {directory}: {key!r} is a saved "
                                      f"{entry['kind']}, not a loader")
            obj.load_state_dict(entry["state"])
        else:
            raise TypeError(f"restore({key}=...) takes modules, optimizers and loaders; got "
                            f"{type(obj).__name__}")
    strategy.precision.load_state_dict(manifest.get("precision", {}))
    rng_name = f"rng.rank{comm.rank}.safetensors"
    # RNG states are per rank: restored only when the job has as many ranks as the writer.
    if manifest.get("world_size") == comm.world_size and rng_name in files:
        _set_rng(_unpack(_member(directory, blobs, rng_name), str(directory / rng_name)),
                 str(directory / rng_name))
    strategy.steps = int(manifest.get("steps", strategy.steps))
    return result


def _merge_shards(directory: Path, blobs: dict[str, bytes], entry: dict[str, Any]) -> Any:
    return sharded.load_entry(entry, lambda f: _unpack(_member(directory, blobs, f),
                                                        str(directory / f)), str(directory))


def _restore_model_file(strategy: Strategy, file: Path, state: dict[str, Any]) -> dict[str, Any]:
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1 or len(state) != 1:
        raise CheckpointError(f"{file} is a bare model file: pass exactly one module to restore "
                              f"(e.g. model=model), got {sorted(state)}")
    tensors = load_pt(file) if file.suffix in (".pt", ".pth", ".bin") else read_safetensors(file)
    _load_into(strategy, modules[0][1], tensors, {}, str(file))
    return {"step": 0}


register_feature("save", save)
register_feature("restore", restore)
