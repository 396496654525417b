"""The checkpoint file format: safetensors files and the JSON manifest, read safely.

What a checkpoint's bytes look like and how they are parsed without trusting them: the
limits (header size, nesting depth, entries, ``.pt`` members), bounded JSON, nested state
split into tensors + a JSON skeleton (``pack`` / ``unpack``), every safetensors header checked
against the file size before a tensor is allocated (``read_safetensors``), ``.pt`` files read
only through ``torch.load(weights_only=True)`` after their zip directory was checked
(``load_pt``), and the manifest's fields checked before any is used (``check_manifest``).
Nothing here touches a strategy or the file system layout (``storage``) or decides what is
saved (``state``).

Names without a leading underscore are shared by the modules of this package; the package's
public API is what ``stratagem.checkpoint`` exports.
"""


from __future__ import annotations

import io
import json
import math
import mmap
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import CheckpointError
from .tree import decode, encode

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
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
#: Bytes of a file that may be holes (not on disk) before it is refused as sparse, beyond
#: which at most half of it may be: see :func:`check_real_size`.
SPARSE_SLACK_BYTES = 16 << 20
#: Bytes per element of the dtypes a checkpoint may hold (anything else is refused).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MEMBER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}(?:\.rank\d{1,6})?\.safetensors")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
CORRUPT_FIX = "Fix: the checkpoint is corrupt or was not written by stratagem; restore another version"


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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite floats are stored tagged)")


def loads_checked(raw: bytes | str, what: str, *, strict: bool = False) -> Any:
    """``json.loads`` bounded in depth; every failure is a ``CheckpointError``. ``strict``
    also refuses the ``NaN``/``Infinity`` tokens Python's JSON accepts (what stratagem writes
    tags them; format-1 checkpoint files may hold them untagged)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if not _json_depth_ok(data):
        raise CheckpointError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels. "
                              f"{CORRUPT_FIX}")
    try:
        if strict:
            return json.loads(data, parse_constant=_no_constant)
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{what} is not valid JSON ({exc}). {CORRUPT_FIX}") from exc


def dumps_checked(obj: Any, what: str, depth: int = MAX_JSON_DEPTH) -> str:
    """``json.dumps`` of something ``save`` writes, refused if ``restore`` would refuse it."""
    try:
        text = json.dumps(obj, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"cannot checkpoint {what}: not JSON-able ({exc}). Fix: extras must "
                              "be tensors, JSON-able values or objects with state_dict() and "
                              "load_state_dict() (no pickle)") from exc
    if not _json_depth_ok(text.encode(), depth):
        raise CheckpointError(f"cannot checkpoint {what}: nested deeper than {depth} "
                              "JSON levels (a Python dict/list level takes up to 3). Fix: "
                              "flatten the structure")
    return text


# ---------------------------------------------------------------------- state <-> bytes
def pack(obj: Any, what: str, *, path: str = "") -> bytes:
    """A nested state as one byte string: safetensors (tensors + the JSON skeleton of
    :func:`.tree.encode` in its metadata header), checked against the limits ``restore``
    applies. ``path`` prefixes the key paths named in refusals (``scheduler.lr_lambdas[0]``)."""
    tensors, skeleton = encode(obj, what=what, path=path)
    data = save_tensors(tensors, {"skeleton": dumps_checked(skeleton, what)}, what)
    check_header(data, f"{what} (as written)")
    return data


def unpack(data: bytes, what: str) -> Any:
    header = check_header(data, what)
    tensors = load_tensors(data, what)
    skeleton = loads_checked(header.get("__metadata__", {}).get("skeleton", "null"),
                      f"{what} skeleton metadata")
    return decode(tensors, skeleton, what=what)


def save_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
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


def check_header(data: bytes | bytearray | mmap.mmap, what: str, size: int | None = None) -> dict[str, Any]:
    """Validate the safetensors header of ``data`` (a whole file's bytes, or with ``size`` the
    file's first bytes, header included) without trusting it. Returns the parsed header;
    raises ``CheckpointError`` before anything proportional to what the header claims is
    allocated."""
    fix = "Fix: the file is corrupt or not a stratagem/safetensors file; restore another version."
    size = len(data) if size is None else size
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
    if len(raw) != n:
        raise CheckpointError(f"{what}: the header is {n} bytes but only {len(raw)} could be "
                              f"read. {fix}")
    data_len = size - 8 - n
    most = _ENTRIES_BASE + data_len // _DATA_BYTES_PER_ENTRY
    # Every entry is a JSON object: count them (outside strings) before parsing anything.
    if raw.count(b"{") - 1 > most and _brackets(raw).count(b"{") - 1 > most:
        raise CheckpointError(f"{what}: header lists more than {most} tensors for {data_len} "
                              f"data bytes ({_ENTRIES_BASE} plus one per "
                              f"{_DATA_BYTES_PER_ENTRY} data bytes). {fix}")
    header = loads_checked(raw, f"{what}: header")
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


def declared_size(header: dict[str, Any], header_len: int) -> int:
    """The file size a checked safetensors header declares: the 8-byte length, the header
    and the data up to the last tensor's end (the format has no trailing bytes)."""
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
    return 8 + header_len + max(ends, default=0)


def check_real_size(st: os.stat_result, what: str) -> None:
    """Refuse a file whose size is mostly holes (a sparse file: a 3 GiB member costing its
    writer 16 KiB on disk), before a byte of it is read, allocated or hashed. Files stratagem
    writes are dense; up to ``SPARSE_SLACK_BYTES`` and half the file may be unallocated (tail
    packing, or blocks a compressing file system kept as holes)."""
    blocks = getattr(st, "st_blocks", None)
    if blocks is None:  # no block count on this platform: the declared-size check remains
        return
    missing = st.st_size - 512 * blocks
    if missing > max(SPARSE_SLACK_BYTES, st.st_size // 2):
        raise CheckpointError(
            f"{what} is {st.st_size} bytes long but only {512 * blocks} bytes of it are on "
            f"disk (a sparse file, {missing} bytes of holes): refused before it is read, as "
            "reading it would allocate and hash its full length for data nobody wrote. "
            f"{CORRUPT_FIX} (or, for a file you wrote yourself, copy it without holes: "
            "cp --sparse=never)")


def check_safetensors_fd(fd: int, st: os.stat_result, what: str) -> dict[str, Any]:
    """The checked header of the safetensors file open at ``fd`` (``st``: its ``fstat``),
    read with ``pread`` (the header's bytes only), and the size it declares checked against
    the file's real size: a sparse, padded or truncated file is refused before its data is
    read, allocated or hashed."""
    check_real_size(st, what)
    size = st.st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        check_header(head, what)  # refused: shorter than the 8-byte length
    n = int.from_bytes(head, "little")
    prefix = head + (os.pread(fd, n, 8) if n <= _header_limit(size) else b"")
    header = check_header(prefix, what, size)
    declared = declared_size(header, n)
    if declared != size:
        raise CheckpointError(
            f"{what}: its header declares {declared} bytes (8 + {n} of header + tensor data) "
            f"but the file holds {size} bytes; a safetensors file is exactly what its header "
            f"declares (padding or holes are refused before anything is allocated). "
            f"{CORRUPT_FIX}")
    return header


def load_tensors(data: bytes, what: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except MemoryError as exc:
        raise CheckpointError(f"{what}: not enough memory to load its {len(data)} bytes of "
                              "tensors. Fix: restore on a machine with more memory") from exc
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CheckpointError(f"{what} is not a valid safetensors file: {exc}") from exc


def _read_regular(file: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file, read once (a FIFO or device is refused before reading)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {exc}") from exc
    return read_fd(fd, what, limit)


def read_fd(fd: int, what: str, limit: int | None) -> bytes:
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{what} is not a regular file; refusing to read it. Fix: "
                                  "point at the checkpoint's own files")
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"{what} is {st.st_size} bytes, over the limit of {limit}. "
                                  f"{CORRUPT_FIX}")
        check_real_size(st, what)
        try:
            data = f.read(st.st_size + 1)
        except MemoryError as exc:
            raise CheckpointError(f"{what} is {st.st_size} bytes, more than this process can "
                                  "allocate. Fix: restore on a machine with more memory") from exc
    if len(data) != st.st_size:
        raise CheckpointError(f"{what} changed size while being read ({st.st_size} -> "
                              f"{len(data)} bytes). Fix: do not write a checkpoint while "
                              "restoring it")
    return data


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file as a dict of tensors, its header checked before anything is
    allocated (see the module docstring). Raises ``CheckpointError`` for a bad file."""
    file = Path(path)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            check_safetensors_fd(fd, st, str(file))
    except BaseException:
        os.close(fd)
        raise
    data = read_fd(fd, str(file), None)
    check_header(data, str(file))
    return load_tensors(data, str(file))


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



def _int(value: Any, low: int = 0, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _bad(where: Path, field: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{where / MANIFEST_NAME}: {field} is {value!r:.80}, expected "
                           f"{expected}. {CORRUPT_FIX}")


def check_manifest(m: Any, where: Path) -> dict[str, Any]:
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
        if MEMBER_RE.fullmatch(name) is None:
            raise CheckpointError(f"{where}: the manifest lists file {name!r:.80}, not a name "
                                  "stratagem writes (<key>[.rank<r>].safetensors, no path "
                                  f"separators, no links out). {CORRUPT_FIX}")
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
                                      f"of its checksummed files. {CORRUPT_FIX}")
            if "local_steps" in entry and not _int(entry["local_steps"]):
                raise _bad(where, f"objects[{key!r}].local_steps", entry["local_steps"],
                           "an int >= 0")
            aliases = entry.get("aliases", {})
            if not (isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())):
                raise _bad(where, f"objects[{key!r}].aliases", aliases,
                           "an object of alias -> stored name")
        elif kind in ("optimizer", "stateful"):
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
            raise _bad(where, f"objects[{key!r}].kind", kind,
                       "module, optimizer or loader (or stateful: an object's state_dict)")
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


# ---------------------------------------------------------------------- optimizer state
#: State a torch optimizer keeps shaped like its parameter, by name: checked for any
#: optimizer class (a custom optimizer using these names means the same).
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum",
                           "square_avg", "acc_delta", "grad_avg", "exp_inf", "prev",
                           "step_size", "ax", "variance"})


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any],
                          what: str) -> None:
    """Refuse saved optimizer state whose tensors do not fit the optimizer's parameters,
    naming the key, before it is loaded (torch's ``load_state_dict`` checks no shape: a
    wrong one surfaced as a ``RuntimeError`` at the first step). Saved indices map to the
    parameters in param-group order, as in ``load_state_dict``. For torch's own optimizers
    every tensor of one or more dims must have its parameter's shape, or the same number of
    dims with some of them 1 (Adafactor's factored moments); ``LBFGS`` (flat vectors of all
    parameters) is left to torch; for other classes the names torch uses for moments
    (``exp_avg``, ``momentum_buffer``, ...) are checked."""
    inner = optimizer
    wrapped = getattr(inner, "optimizer", None)
    while not type(inner).__module__.startswith("torch.optim") and isinstance(
            wrapped, torch.optim.Optimizer):
        inner = wrapped  # a wrapper (the strategy's StrategyOptimizer)
        wrapped = getattr(inner, "optimizer", None)
    if isinstance(inner, torch.optim.LBFGS):
        return
    builtin = type(inner).__module__.startswith("torch.optim")
    saved, groups = state.get("state", {}), state.get("param_groups", [])
    if not isinstance(saved, dict) or not isinstance(groups, list):
        return  # torch's load_state_dict refuses these (a CheckpointError at the caller)
    ids = [i for g in groups if isinstance(g, dict) and isinstance(g.get("params"), list)
           for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = dict(zip(ids, params, strict=False))
    for index, entry in saved.items():
        param = by_id.get(index)
        if param is None or not isinstance(entry, dict):
            continue
        shape = tuple(param.shape)
        for name, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if not builtin and name not in _PARAM_SHAPED:
                continue
            have = tuple(value.shape)
            fits = have == shape or (builtin and name not in _PARAM_SHAPED
                                     and len(have) == len(shape)
                                     and all(h in (s, 1) for h, s in zip(have, shape)))
            if not fits:
                raise CheckpointError(
                    f"{what}: optimizer state['state'][{index!r}][{name!r}] has shape "
                    f"{list(have)}, but the parameter it belongs to (index {index} in "
                    f"param-group order) has shape {list(shape)}. Fix: restore with the "
                    "model and optimizer the checkpoint was saved with (same parameters, same "
                    "order), or restore the model alone")
