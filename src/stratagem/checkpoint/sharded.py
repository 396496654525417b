"""Sharded checkpoints: every replica writes its own rows, nothing is gathered to one rank.

Used by :mod:`stratagem.checkpoint.state` when a strategy's model or optimizer state holds
DTensor shards (``sg.Sharded``, FSDP2). The layout stays stratagem's own — safetensors + a
JSON index, never pickle — inside the same atomic, versioned directory as every other
checkpoint:

- ``<key>.rank<r>.safetensors``, written by replica ``r`` itself: its rows of every sharded
  tensor (and, on rank 0 only, the replicated tensors), with the nested structure as a JSON
  skeleton in the safetensors metadata (the format of ``optimizer.safetensors``);
- in ``manifest.json``, under the object's entry, ``"sharded": {"files": [...], "tensors":
  [{"path": [...], "shape": [...], "rows": [[start, stop] per file]}]}``: for each sharded
  tensor (its place in the structure), its full shape and which dim-0 rows each file holds.

Why not ``torch.distributed.checkpoint`` (DCP): its ``.metadata`` file is a pickle that its
reader unpickles, and stratagem's restore never unpickles (see :mod:`stratagem.checkpoint`);
its planner also exchanges pickled objects between ranks. The format here needs neither.

Atomicity: rank 0 creates the version's staging directory (``tmp-<uuid>`` in the versions
directory), every replica writes and fsyncs its files into it and reports their sha256,
then rank 0 writes the manifest and commits with the usual rename + link swap. A failure on
any replica removes the staging directory and raises on every replica; the previous
checkpoint at ``path`` stays. Replicas must see one filesystem (one machine, or a shared
file system across machines, as DCP also requires); otherwise the save fails naming it.

Restore onto any world size and any strategy: the rows of every file are concatenated back
into full tensors (each restoring replica reads them all: CPU memory of one full copy of the
model and optimizer state, transiently), then the strategy keeps what it holds (``Sharded``
its rows, ``Mirrored`` everything). ``save(..., consolidate=True)`` instead gathers the full
tensors (one all-gather per tensor) and writes the ordinary single ``model.safetensors``
under the model's own names, loadable by ``safetensors.torch.load_model`` into a plain module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Comm
from ..errors import CheckpointError
from ..parts.tensors import is_dtensor
from .tree import path_join

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_sharded", "gather_full", "localize", "shard_index", "shard_files", "merge",
           "save_entry", "load_entry", "commit_with_shards"]

_FILE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\.rank\d{1,6}\.safetensors")
_Path = list[Any]  # keys (str / int) from the root of a nested state to a tensor


def _walk(obj: Any, fn: Callable[[torch.Tensor, _Path], Any], path: _Path) -> Any:
    """``obj`` with every tensor leaf replaced by ``fn(leaf, path)`` (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, path)
    if isinstance(obj, dict):
        return {k: _walk(v, fn, [*path, k]) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, fn, [*path, i]) for i, v in enumerate(obj))
    return obj


def is_sharded(obj: Any) -> bool:
    """Whether a nested state holds a DTensor (a shard) anywhere."""
    found = False

    def see(t: torch.Tensor, _path: _Path) -> torch.Tensor:
        nonlocal found
        found = found or is_dtensor(t)
        return t

    _walk(obj, see, [])
    return found


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def gather_full(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its full tensor: one all-gather per tensor (a
    collective; every replica walks the same structure in the same order). Names sharing one
    shard (tied parameters) share one full tensor, so the writer stores it once."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}

    def full(t: torch.Tensor, _path: _Path) -> torch.Tensor:
        if not is_dtensor(t):
            return t
        key = _storage_key(t.to_local())
        if key not in seen:
            seen[key] = t.full_tensor().detach()
        return seen[key]

    return _walk(obj, full, [])


def localize(obj: Any, rank: int) -> tuple[Any, list[dict[str, Any]], dict[str, str]]:
    """This replica's part of a nested state: DTensor leaves become their local rows (CPU,
    contiguous); replicated tensors are kept on rank 0 only (``None`` elsewhere). Returns
    (local state, this replica's index entries, aliases of a flat model state: name ->
    the first name sharing its storage, i.e. tied parameters)."""
    index: list[dict[str, Any]] = []
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}

    def local(t: torch.Tensor, path: _Path) -> Any:
        if is_dtensor(t):
            # Imported here: a DTensor exists, so its module is loaded already (free).
            from torch.distributed.tensor import Shard

            if tuple(t.placements) != (Shard(0),):
                raise CheckpointError(f"cannot write a sharded checkpoint of {path}: placements "
                                      f"{t.placements}, only a 1-D mesh with Shard(0) is supported")
            rows = t.to_local()
            if len(path) == 1 and isinstance(path[0], str):
                key = _storage_key(rows)
                if key in first and rows.numel():
                    aliases[path[0]] = first[key]
                    return None
                first.setdefault(key, path[0])
            start = _offset(t)
            index.append({"path": path, "shape": list(t.shape), "dtype": str(t.dtype),
                          "rows": [start, start + rows.shape[0]]})
            return rows.detach().cpu().contiguous()
        return t.detach().cpu().contiguous() if rank == 0 else None

    return _walk(obj, local, []), index, aliases


def _offset(t: DTensor) -> int:
    """The first global row of a ``Shard(0)`` DTensor's local rows (``torch.chunk`` blocks)."""
    rows, world = t.shape[0], t.device_mesh.size()
    block = -(-rows // world) if rows else 0
    return min(t.device_mesh.get_local_rank() * block, rows)


def shard_index(key: str, per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The manifest's ``"sharded"`` entry from every replica's index (rank order). Rows held
    by several replicas (groups of shards repeated across nodes) are indexed once: a node's
    own optimizer state (Hierarchical with a DiLoCo outer) restores as the first node's."""
    files = [f"{key}.rank{r}.safetensors" for r in range(len(per_rank))]
    tensors: dict[str, dict[str, Any]] = {}
    for r, entries in enumerate(per_rank):
        for e in entries:
            slot = tensors.setdefault(json.dumps(e["path"]), {
                "path": e["path"], "shape": e["shape"], "dtype": e["dtype"],
                "rows": [[0, 0]] * len(per_rank)})
            slot["rows"][r] = e["rows"]
    for slot in tensors.values():
        # Shards on a mesh smaller than the job (Sharded inside each node of Hierarchical)
        # repeat across groups: the first complete tiling is kept, the repeats are indexed
        # as empty (their files are still written; restore reads the kept rows).
        stop = 0
        for r, (start, end) in enumerate(slot["rows"]):
            if start == stop and end > start:
                stop = end
            else:
                slot["rows"][r] = [start, start]
    return {"files": files, "tensors": list(tensors.values())}


def shard_files(entry: dict[str, Any], where: str) -> list[str]:
    """The files of a sharded entry (checked: ``<key>.rank<r>.safetensors`` names)."""
    sharded = entry.get("sharded")
    files = sharded.get("files") if isinstance(sharded, dict) else None
    if not (isinstance(files, list) and files and len(files) <= 1 << 16
            and all(isinstance(f, str) and _FILE_RE.fullmatch(f) for f in files)):
        raise CheckpointError(f"{where}: the sharded entry's files are {files!r:.80}, expected "
                              "a non-empty list of file names. Fix: the checkpoint is corrupt "
                              "or was not written by stratagem; restore another version")
    key = files[0].rpartition(".rank")[0]
    expected = [f"{key}.rank{r}.safetensors" for r in range(len(files))]
    if files != expected:
        odd = next(f"{f!r} at position {r}" for r, (f, e) in enumerate(zip(files, expected))
                   if f != e)
        raise CheckpointError(f"{where}: the sharded entry lists {odd:.120}; expected "
                              f"{key}.rank<r>.safetensors for r = 0..{len(files) - 1}, each "
                              "once in rank order (a file listed twice would be unpacked "
                              "twice). Fix: the checkpoint is corrupt or was not written by "
                              "stratagem; restore another version")
    return files


def _header_key(path: _Path) -> str:
    """The safetensors name ``format.pack`` gives the tensor at ``path``: the key path as
    :func:`.tree.path_join` prints it (``a.b[0]``, ``a['x y']``; ``_`` for the root), the
    name :func:`.tree.encode` stores a tensor under when no other path prints alike."""
    name = ""
    for k in path:
        name = path_join(name, k)
    return name or "_"


#: ``str(torch dtype)`` -> safetensors dtype code, for the dtypes a checkpoint may hold.
_ST_DTYPE = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16",
             "torch.bfloat16": "BF16", "torch.int64": "I64", "torch.int32": "I32",
             "torch.int16": "I16", "torch.int8": "I8", "torch.uint8": "U8", "torch.bool": "BOOL",
             "torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2"}


def check_index(sharded: Any, nfiles: int, where: str) -> dict[str, dict[str, Any]]:
    """The sharded index checked as untrusted input before any file is unpacked: each
    tensor listed once, a shape of at most 64 dims each < 2**48, a known dtype, one
    ``[start, stop]`` per file with ``0 <= start <= stop <= shape[0]``, and the non-empty
    ranges tiling ``[0, shape[0])`` in file order (empty ones, the repeats of a smaller mesh,
    cover nothing). Returns the entries by their JSON path."""
    bad = (f"{where}: inconsistent sharded index ({{}}). Fix: the checkpoint is corrupt or was "
           "not written by stratagem; restore another version")
    tensors = sharded.get("tensors") if isinstance(sharded, dict) else None
    if not isinstance(tensors, list):
        raise CheckpointError(bad.format("tensors is not a list"))
    paths = [json.dumps(e.get("path")) if isinstance(e, dict) else "" for e in tensors]
    if len(set(paths)) != len(paths):
        twice = next(p for i, p in enumerate(paths) if p in paths[:i])
        raise CheckpointError(bad.format(f"{twice:.80} is listed twice"))
    wanted: dict[str, dict[str, Any]] = {}
    for e in tensors:
        if not (isinstance(e, dict) and isinstance(e.get("path"), list)
                and isinstance(e.get("shape"), list) and 0 < len(e["shape"]) <= 64
                and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 48
                        for s in e["shape"])
                and e.get("dtype", "torch.float32") in _ST_DTYPE
                and isinstance(e.get("rows"), list) and len(e["rows"]) == nfiles):
            raise CheckpointError(bad.format(f"entry {str(e)[:80]}"))
        key = json.dumps(e["path"])
        if key in wanted:
            raise CheckpointError(bad.format(f"{e['path']!r:.80} is listed twice"))
        stop, length = 0, e["shape"][0]
        for r in e["rows"]:
            if not (isinstance(r, list) and len(r) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                    and 0 <= r[0] <= r[1] <= length and (r[0] == stop or r[0] == r[1])):
                raise CheckpointError(bad.format(f"rows {e['rows']!r:.80} of {e['path']!r:.80} "
                                                 f"for {length} rows"))
            if r[1] > r[0]:
                stop = r[1]
        if stop != length:
            raise CheckpointError(bad.format(f"rows of {e['path']!r:.80} cover {stop} of "
                                             f"{length}"))
        wanted[key] = e
    return wanted


def _check_headers(files: list[str], wanted: dict[str, dict[str, Any]],
                   header: Callable[[str], dict[str, Any]], bad: str) -> None:
    """Every indexed row range against the header of the file holding it (shape and dtype
    as the file declares them), before any file is unpacked."""
    for r, f in enumerate(files):
        # A file's non-empty row ranges; rank 0's file also holds the whole of a tensor of
        # no rows at all (shape [0, ...]).
        entries = [e for e in wanted.values() if e["rows"][r][1] > e["rows"][r][0]
                   or (r == 0 and e["shape"][0] == 0)]
        if not entries:
            continue
        h = header(f)
        for e in entries:
            start, stop = e["rows"][r]
            found = h.get(_header_key(e["path"]))
            if not isinstance(found, dict):
                continue  # not under the name pack gives it: checked after unpacking
            expected = [stop - start, *e["shape"][1:]]
            code = _ST_DTYPE[e.get("dtype", "torch.float32")]
            if found.get("shape") != expected or found.get("dtype") != code:
                raise CheckpointError(bad.format(
                    f"{f} holds {found.get('dtype')} {found.get('shape')!r:.80} for rows "
                    f"{start}:{stop} of {e['path']!r:.80}, declared {code} {expected!r:.80}"))


def merge(parts: list[Any], sharded: dict[str, Any], where: str) -> Any:
    """Full state from every file's part (file order): rank 0's structure, each indexed
    tensor the concatenation of the files' rows. The index is checked like any other
    untrusted input (:func:`check_index`), and every result has its declared shape and dtype."""
    bad = (f"{where}: inconsistent sharded index ({{}}). Fix: the checkpoint is corrupt or was "
           "not written by stratagem; restore another version")
    wanted = check_index(sharded, len(parts), where)

    def leaf(part: Any, path: _Path) -> Any:
        for k in path:
            if isinstance(part, dict) and k in part:
                part = part[k]
            elif isinstance(part, (list, tuple)) and isinstance(k, int) and 0 <= k < len(part):
                part = part[k]
            else:
                raise CheckpointError(bad.format(f"{path!r:.80} missing from a file"))
        return part

    def full(t: torch.Tensor, path: _Path) -> torch.Tensor:
        e = wanted.pop(json.dumps(path), None)
        if e is None:
            return t
        pieces = []
        for part, (start, stop) in zip(parts, e["rows"]):
            if start == stop:
                continue
            piece = leaf(part, path)
            if not (isinstance(piece, torch.Tensor) and piece.dtype == t.dtype
                    and list(piece.shape) == [stop - start, *e["shape"][1:]]):
                raise CheckpointError(bad.format(f"rows {start}:{stop} of {path!r:.80}"))
            pieces.append(piece)
        if not pieces:  # a tensor of 0 rows: rank 0's empty part is the whole of it
            if not (isinstance(t, torch.Tensor) and list(t.shape) == e["shape"]):
                raise CheckpointError(bad.format(
                    f"{path!r:.80} is declared {e['shape']!r:.80} with no rows in any file, but "
                    f"rank 0's file holds {list(getattr(t, 'shape', []))!r:.80}"))
            out = t
        else:
            out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if str(out.dtype) != e.get("dtype", str(out.dtype)) or list(out.shape) != e["shape"]:
            raise CheckpointError(bad.format(f"{path!r:.80} restores as {out.dtype} "
                                             f"{list(out.shape)}, declared {e.get('dtype')} "
                                             f"{e['shape']!r:.80}"))
        return out

    merged = _walk(parts[0], full, [])  # rank 0's file holds the whole structure
    if wanted:
        raise CheckpointError(bad.format(f"{len(wanted)} indexed tensor(s) absent, e.g. "
                                         f"{next(iter(wanted))[:80]}"))
    return merged


def save_entry(comm: Comm, key: str, state: Any, own: dict[str, bytes], kind: str,
               pack: Callable[[Any, str], bytes]) -> dict[str, Any]:
    """This replica's rows of ``state`` packed (``pack``: the checkpoint's own safetensors +
    JSON skeleton) into ``own[<key>.rank<r>.safetensors]``, which this replica writes; returns
    the manifest entry with every replica's index (one small all-gather of JSON)."""
    local, index, aliases = localize(state, comm.rank)
    own[f"{key}.rank{comm.rank}.safetensors"] = pack(local, f"{key} (rank {comm.rank}'s shards)")
    per_rank = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(index).encode())]
    entry: dict[str, Any] = {"kind": kind, "sharded": shard_index(key, per_rank)}
    if kind == "module":
        entry["file"] = f"{key}.rank0.safetensors"
        if aliases:
            entry["aliases"] = aliases
    return entry


def load_entry(entry: dict[str, Any], read: Callable[[str], Any], where: str,
               header: Callable[[str], dict[str, Any]] | None = None) -> Any:
    """The full state of a sharded entry: every file (``read``: verified and unpacked by the
    checkpoint reader), rows concatenated. Tied names of a module come back through the
    entry's aliases, not from the files. Before any file is unpacked: the file list (each
    once), the index (:func:`check_index`) and, with ``header`` (a file's checked
    safetensors header), every row range against the file holding it."""
    files = shard_files(entry, where)
    wanted = check_index(entry.get("sharded"), len(files), where)
    if header is not None:
        _check_headers(files, wanted, header,
                       f"{where}: inconsistent sharded index ({{}}). Fix: the checkpoint is "
                       "corrupt or was not written by stratagem; restore another version")
    parts = [read(f) for f in files]
    merged = merge(parts, entry["sharded"], where)
    if entry.get("kind") == "module":
        if not isinstance(merged, dict):
            raise CheckpointError(f"{where}: a sharded module's files hold a "
                                  f"{type(merged).__name__}, not a dict of tensors")
        merged = {k: v for k, v in merged.items() if v is not None}
    return merged


def commit_with_shards(comm: Comm, own: dict[str, bytes], *, stage: Callable[[], Path],
                       write: Callable[[Path, bytes], str],
                       commit: Callable[[Path, dict[str, str]], Path],
                       abort: Callable[[Path], None]) -> tuple[Path | None, BaseException | None]:
    """The collective part of a sharded save (see the module docstring): rank 0 ``stage``\\ s
    a directory, every replica ``write``\\ s its ``own`` files there (returning their sha256),
    rank 0 ``commit``\\ s with every replica's digests, or ``abort``\\ s when one failed.
    Returns (what rank 0 committed, this replica's view of a failure); no replica raises
    here, so all of them reach the caller's final all-reduce of the failure flag."""
    staged: Path | None = None
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            staged = stage()
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
    name = comm.all_gather_bytes(str(staged).encode() if staged is not None else b"")[0]
    if not name:
        return None, error if error is not None else CheckpointError(
            "the chief (rank 0) could not create the checkpoint's staging directory; see its log")
    directory = Path(name.decode())
    report: dict[str, Any]
    try:
        if not directory.is_dir():
            raise CheckpointError(
                f"rank {comm.rank} cannot see {directory}, which rank 0 created: a sharded "
                "checkpoint is written by every replica into one directory. Fix: save to a "
                "file system every replica shares, or save(..., consolidate=True)")
        report = {"files": {f: write(directory / f, data) for f, data in own.items()}}
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, raised by every rank
        report = {"error": f"rank {comm.rank}: {exc}"}
    reports = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(report).encode())]
    failures = [r["error"] for r in reports if "error" in r]
    if failures:
        if comm.rank == 0:
            abort(directory)
        return None, CheckpointError(f"writing the sharded checkpoint failed: {'; '.join(failures)}")
    if comm.rank != 0:
        return None, None
    digests = {f: d for r in reports for f, d in r["files"].items()}
    try:
        return commit(directory, digests), None
    except BaseException as exc:  # noqa: BLE001 - reported to every rank by the caller
        abort(directory)
        return None, exc
