"""Atomic, verified, portable checkpoints: safetensors + JSON, never pickle.

Layout: ``path`` is a symbolic link to ``<parent>/.<name>.versions/<step>-<id>/``, a directory
holding ``model.safetensors`` (the model users keep, under the module's own names: the
replicated model, or the global/center model of parameter-server and elastic-averaging
strategies), optimizer state (``optimizer.safetensors`` + ``optimizer.json``, one pair per rank
when the state is local to each worker), ``strategy.safetensors`` (center, outer momentum,
...), ``rng.safetensors`` (every rank's RNG states), ``extra.safetensors`` and
``manifest.json`` (strategy, world size, step, JSON extras, sha256 of every file).

A save writes and fsyncs a new version directory, then swaps the link with one
``os.replace``: a crash at any instant leaves ``path`` pointing at a complete checkpoint.
``restore`` verifies every checksum and, if ``path`` is damaged, falls back to the newest
intact version with a warning. ``save`` and ``restore`` are collectives: each replica
contributes what only it holds, the chief writes.

Nothing is ever unpickled: every ``.safetensors`` header is checked (length, JSON, dtypes,
shapes, offsets) against the file size *before* any tensor is allocated, so a malicious or
truncated file raises :class:`~stratagem.CheckpointError` instead of allocating what its
header claims; a ``.pt`` file is read only through ``torch.load(weights_only=True)`` and only
when it holds tensors (:func:`load_pt`). See ``docs/reliability.md`` for the guarantees.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from .data import DistributedLoader
from .errors import CheckpointError

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["save", "restore", "exists", "load_model_state", "load_pt", "read_safetensors",
           "FORMAT_VERSION", "MAX_HEADER_BYTES"]

FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
#: Largest safetensors JSON header accepted (the format's own reference limit is 100 MB; ours
#: hold names, shapes and an optimizer skeleton, a few MB for the largest models).
MAX_HEADER_BYTES = 64 << 20
#: Bytes per element of the dtypes a checkpoint may hold (anything else is refused).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


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


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"checkpoint refers to tensor {key!r} that is not stored")
            return tensors[key]
        if "__dict__" in obj:
            return {k: _join(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [_join(v, tensors) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(_join(v, tensors) for v in obj["__tuple__"])
        raise CheckpointError(f"unexpected entry in checkpoint JSON: {sorted(obj)[:3]}")
    return obj


def _pack(obj: Any) -> bytes:
    """A nested state as one byte string: safetensors (tensors + the JSON skeleton in its
    metadata header)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(obj, "", tensors)
    return st_save(tensors, metadata={"skeleton": json.dumps(skeleton)})


def _unpack(data: bytes, what: str) -> Any:
    header = _check_header(data[:8], lambda n: data[8:8 + n], len(data), what)
    tensors = _st_load(data, what)
    try:
        skeleton = json.loads(header.get("__metadata__", {}).get("skeleton", "null"))
    except ValueError as exc:
        raise CheckpointError(f"{what}: its skeleton metadata is not valid JSON: {exc}") from exc
    return _join(skeleton, tensors)


# ---------------------------------------------------------------------- safe parsing
def _check_header(head: bytes, read: Any, size: int, what: str) -> dict[str, Any]:
    """Validate a safetensors header without trusting it: ``head`` is the first 8 bytes,
    ``read(n)`` returns the next ``n`` bytes, ``size`` is the whole file's size. Returns the
    parsed header; raises ``CheckpointError`` (and allocates at most ``MAX_HEADER_BYTES``)."""
    fix = "Fix: the file is corrupt or not a stratagem/safetensors file; restore another version."
    if len(head) < 8:
        raise CheckpointError(f"{what} is not a safetensors file: {size} bytes, shorter than "
                              f"the 8-byte header length. {fix}")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise CheckpointError(f"{what}: header length {n} is over the limit "
                              f"(max {min(MAX_HEADER_BYTES, max(size - 8, 0))} bytes for this "
                              f"{size}-byte file). {fix}")
    raw = read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what}: header is not valid JSON ({exc}). {fix}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{what}: header must be a JSON object, got "
                              f"{type(header).__name__}. {fix}")
    data_len = size - 8 - n
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{what}: __metadata__ must map strings to strings. {fix}")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(f"{what}: entry {name!r} is not an object. {fix}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise CheckpointError(f"{what}: tensor {name!r} has dtype {dtype!r}, not one of the "
                                  f"allowed {sorted(_DTYPE_BYTES)}. {fix}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                and 0 <= d < 1 << 48 for d in shape)):
            raise CheckpointError(f"{what}: tensor {name!r} has shape {shape!r}; expected a list "
                                  f"of non-negative ints. {fix}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise CheckpointError(f"{what}: tensor {name!r} has data_offsets {offsets!r}; "
                                  f"expected [begin, end]. {fix}")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * _DTYPE_BYTES[dtype]:
            raise CheckpointError(
                f"{what}: tensor {name!r} ({dtype}, shape {shape}) has data_offsets "
                f"[{begin}, {end}], out of range for {data_len} data bytes or not "
                f"{numel * _DTYPE_BYTES[dtype]} bytes long. {fix}")
    return header


def _st_load(data: bytes, what: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt file
        raise CheckpointError(f"{what} is not a valid safetensors file: {exc}") from exc


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file as a dict of tensors, its header checked before anything is
    allocated (see the module docstring). Raises ``CheckpointError`` for a bad file."""
    file = Path(path)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            _check_header(f.read(8), f.read, size, str(file))
            f.seek(0)
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return _st_load(data, str(file))


def load_pt(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A ``.pt``/``.pth`` state dict read with ``torch.load(weights_only=True)`` (no arbitrary
    unpickling). Refused with ``CheckpointError`` unless it holds a tensor or a (nested)
    mapping of string keys to tensors; nested mappings are flattened with ``.`` as in
    ``state_dict()``."""
    file = Path(path)
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, zip errors, OSError...
        raise CheckpointError(
            f"{file} was refused by torch.load(weights_only=True): {str(exc).splitlines()[0]}. "
            "Fix: only plain tensor state dicts load; re-save with "
            "torch.save(model.state_dict(), path) or, better, safetensors") from exc
    out: dict[str, torch.Tensor] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix or "_"] = value
        elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            raise CheckpointError(
                f"{file} holds a {type(value).__name__} at {prefix or 'the top level'!r}; only "
                "tensors and dicts of them load as a state dict. Fix: save "
                "model.state_dict() alone")

    walk(obj, "")
    return out


# ---------------------------------------------------------------------- files
def _fsync_write(path: Path, data: bytes) -> str:
    with open(path, "wb") as f:
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


def _versions_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.versions"


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds (or once held, with versions left) a stratagem checkpoint."""
    p = Path(os.fspath(path).rstrip("/") or ".")
    return p.exists() or p.is_symlink() or _versions_dir(p).is_dir()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify(directory: Path) -> dict[str, Any]:
    """The manifest of an intact checkpoint directory; ``CheckpointError`` otherwise."""
    manifest_path = directory / _MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory} has no {_MANIFEST}: not a complete checkpoint")
    try:
        if manifest_path.stat().st_size > MAX_HEADER_BYTES:
            raise ValueError(f"{manifest_path.stat().st_size} bytes, over {MAX_HEADER_BYTES}")
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise CheckpointError(f"{manifest_path} is not a stratagem manifest")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: unknown checkpoint format {manifest.get('format')!r}")
    for name, digest in manifest.get("files", {}).items():
        f = directory / name
        if "/" in name or name.startswith(".") or not f.is_file():
            raise CheckpointError(f"{directory}: file {name!r} listed in the manifest is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{directory}: checksum mismatch in {name} (file corrupted)")
    return manifest


def _written_at(d: Path) -> int:
    """The ``time_ns`` a version directory ``<step>-<ns>`` was committed at (0 if unknown)."""
    tail = d.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0


def _candidates(path: Path) -> list[Path]:
    """Committed version directories, most recently written first. Ordered by commit time, not
    by step: a job that resumed from an older step and saved again must see its new version as
    the newest (ordering by step would let ``keep_last`` delete it)."""
    versions = _versions_dir(path)
    found = [d for d in versions.iterdir() if d.is_dir() and not d.name.startswith("tmp-")] \
        if versions.is_dir() else []
    return sorted(found, key=lambda d: (_written_at(d), d.name), reverse=True)


def _resolve(path: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to load at ``path``: itself if intact, else the newest intact version."""
    errors: list[str] = []
    if path.exists():
        try:
            return path.resolve(), _verify(path)
        except CheckpointError as exc:
            errors.append(str(exc))
    for candidate in _candidates(path):
        if path.exists() and candidate == path.resolve():
            continue
        try:
            manifest = _verify(candidate)
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        warnings.warn(f"checkpoint at {path} is damaged or missing ({errors[0] if errors else 'missing'}); "
                      f"restoring the newest intact one, {candidate}", RuntimeWarning, stacklevel=3)
        return candidate, manifest
    raise CheckpointError(f"no intact checkpoint at {path}" + (f": {'; '.join(errors)}" if errors else "")
                          + ". Fix: check the path, or save a checkpoint first.")


# ---------------------------------------------------------------------- save
def save(strategy: Strategy, path: str | os.PathLike[str], *, keep_last: int = 2, **state: Any) -> Path:
    """Collective save; see the module docstring. Returns the version directory written."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    path = Path(os.fspath(path).rstrip("/") or ".")
    comm = strategy.comm
    files: dict[str, bytes] = {}
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION, "strategy": type(strategy).__name__,
        "world_size": comm.world_size, "time": time.time(), "objects": {}, "extra": {},
    }
    extra_tensors: dict[str, Any] = {}
    strategy_state: dict[str, torch.Tensor] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            prepared = strategy._find_prepared(obj)
            tensors = strategy._checkpoint_model(prepared) if prepared is not None else \
                {k: v.detach() for k, v in obj.state_dict().items()}
            name = "model.safetensors" if key == "model" else f"{key}.safetensors"
            files[name] = st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                                  metadata={"format": "pt"})
            manifest["objects"][key] = {"kind": "module", "file": name}
            if prepared is not None:
                # The local step counter keeps periodic schedules (averaging, elastic
                # exchange, outer steps) in phase across a resume.
                manifest["objects"][key]["local_steps"] = prepared.local_steps
                for k, v in strategy._strategy_state(prepared).items():
                    strategy_state[f"{key}/{k}"] = v.detach().cpu().contiguous()
        elif isinstance(obj, torch.optim.Optimizer):
            sd = strategy._optimizer_state(obj)
            blob = _pack(sd)
            if strategy._local_optimizer_state and comm.world_size > 1:
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
            try:
                json.dumps(obj)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"cannot checkpoint {key}={type(obj).__name__}: extras must be "
                                      "tensors or JSON-able values (no pickle)") from exc
            manifest["extra"][key] = obj
    if strategy_state:
        files["strategy.safetensors"] = st_save(strategy_state)
    if extra_tensors:
        files["extra.safetensors"] = _pack(extra_tensors)
    manifest["precision"] = strategy.precision.state_dict()
    manifest["steps"] = strategy._steps
    step = manifest["extra"].get("step", strategy._steps)
    manifest["step"] = int(step) if isinstance(step, (int, float)) else strategy._steps
    rng = _pack({"torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None})
    for r, b in enumerate(comm.all_gather_bytes(rng)):
        files[f"rng.rank{r}.safetensors"] = b

    written: Path | None = None
    failed = torch.zeros(1)
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            written = _commit(path, files, manifest, keep_last)
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below
            error = exc
            failed.fill_(1.0)
    comm.all_reduce(failed, "max")
    if error is not None:
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


def _commit(path: Path, files: dict[str, bytes], manifest: dict[str, Any], keep_last: int) -> Path:
    versions = _versions_dir(path)
    if not versions.is_dir():
        versions.mkdir(parents=True, exist_ok=True)
        _fsync_dir(versions.parent)  # the new directory entry itself must survive a crash
    if path.exists() and not path.is_symlink():
        if not (path / _MANIFEST).is_file():
            raise CheckpointError(f"{path} exists and is not a stratagem checkpoint; refusing to "
                                  "replace it. Fix: choose another path or remove it.")
        os.replace(path, versions / f"{0:012d}-legacy-{uuid.uuid4().hex[:8]}")
    name = f"{manifest['step']:012d}-{time.time_ns():020d}"
    tmp = versions / f"tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    manifest["files"] = {fname: _fsync_write(tmp / fname, data) for fname, data in files.items()}
    _fsync_write(tmp / _MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _fsync_dir(tmp)
    final = versions / name
    os.replace(tmp, final)
    _fsync_dir(versions)
    link_tmp = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(os.path.relpath(final, path.parent), link_tmp)
    os.replace(link_tmp, path)
    _fsync_dir(path.parent)
    for old in [d for d in _candidates(path) if d != final][keep_last - 1:]:
        # Renamed out of sight first (one atomic rename), so a kill during the removal never
        # leaves a half-deleted version that looks like a candidate.
        doomed = versions / f"tmp-del-{uuid.uuid4().hex}"
        with contextlib.suppress(OSError):
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    for stale in versions.glob("tmp-*"):
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    return final


# ---------------------------------------------------------------------- restore
def load_model_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The verified ``model.safetensors`` of a checkpoint, as a state dict."""
    directory, _ = _resolve(Path(os.fspath(path).rstrip("/") or "."))
    return _read_tensors(directory / "model.safetensors")


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(file)


def _member(directory: Path, manifest: dict[str, Any], name: Any) -> Path:
    """A file of the checkpoint, only if the manifest lists (and so checksummed) it: a forged
    manifest cannot point a load at another path."""
    if not isinstance(name, str) or name not in manifest.get("files", {}):
        raise CheckpointError(f"{directory}: the manifest refers to {name!r}, which is not one "
                              "of its checksummed files. Fix: the checkpoint is corrupt; "
                              "restore another version")
    return directory / name


def _read_file_model(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix in (".pt", ".pth", ".bin"):
        return load_pt(file)
    return read_safetensors(file)


def restore(strategy: Strategy, path: str | os.PathLike[str], **state: Any) -> dict[str, Any]:
    """Collective restore; returns the saved extras (``step`` and the rest).

    ``path`` is a checkpoint written by :func:`save` (verified; the newest intact version is
    used, with a warning, when it is damaged) or a bare model file (``.safetensors``, or
    ``.pt``/``.pth`` read with ``torch.load(weights_only=True)``), which then fills the single
    module passed (``model=``) and returns ``{"step": 0}``."""
    raw = Path(os.fspath(path).rstrip("/") or ".")
    if raw.is_file():
        return _restore_model_file(strategy, raw, state)
    directory, manifest = _resolve(raw)
    comm = strategy.comm
    objects = manifest.get("objects", {})
    files = manifest.get("files", {})
    strategy_state = (_read_tensors(_member(directory, manifest, "strategy.safetensors"))
                      if "strategy.safetensors" in files else {})
    result: dict[str, Any] = dict(manifest.get("extra", {}))
    if "extra.safetensors" in files:
        extra_file = _member(directory, manifest, "extra.safetensors")
        result.update(_unpack(extra_file.read_bytes(), str(extra_file)))
    for key, obj in state.items():
        entry = objects.get(key)
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint {directory} holds no {key!r}; it holds "
                                  f"{sorted(objects) or 'no objects'}")
        if isinstance(obj, nn.Module):
            tensors = _read_tensors(_member(directory, manifest, entry.get("file")))
            prepared = strategy._find_prepared(obj)
            if prepared is None:
                obj.load_state_dict(tensors)
            else:
                prepared.local_steps = int(entry.get("local_steps", prepared.local_steps))
                strategy._load_model(prepared, tensors)
                prefix = f"{key}/"
                strategy._load_strategy_state(prepared, {k[len(prefix):]: v for k, v in
                                                         strategy_state.items() if k.startswith(prefix)})
        elif isinstance(obj, torch.optim.Optimizer):
            per_rank = int(entry.get("per_rank", 0))
            # Local optimizer state saved by N workers, restored by M: rank r takes worker
            # r mod N's (the state of an identical model; exact when M == N).
            name = f"{key}.rank{comm.rank % per_rank}.safetensors" if per_rank else f"{key}.safetensors"
            strategy._load_optimizer_state(
                obj, _unpack(_member(directory, manifest, name).read_bytes(), name))
        elif isinstance(obj, DistributedLoader):
            obj.load_state_dict(entry["state"])
        else:
            raise TypeError(f"restore({key}=...) takes modules, optimizers and loaders; got "
                            f"{type(obj).__name__}")
    strategy.precision.load_state_dict(manifest.get("precision", {}))
    rng_name = f"rng.rank{comm.rank}.safetensors"
    # RNG states are per rank: restored only when the job has as many ranks as the writer.
    if manifest.get("world_size") == comm.world_size and rng_name in files:
        rng = _unpack(_member(directory, manifest, rng_name).read_bytes(), rng_name)
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    strategy._steps = int(manifest.get("steps", strategy._steps))
    result.setdefault("step", manifest.get("steps", 0))
    return result


def _restore_model_file(strategy: Strategy, file: Path, state: dict[str, Any]) -> dict[str, Any]:
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1 or len(state) != 1:
        raise CheckpointError(f"{file} is a bare model file: pass exactly one module to restore "
                              f"(e.g. model=model), got {sorted(state)}")
    tensors = _read_file_model(file)
    module = modules[0][1]
    prepared = strategy._find_prepared(module)
    if prepared is None:
        module.load_state_dict(tensors)
    else:
        strategy._load_model(prepared, tensors)
    return {"step": 0}
