"""What a strategy saves and restores: the collective ``save`` and ``restore``.

Walks the objects passed (modules, optimizers, loaders, extras) through the strategy's public
state protocol (``Strategy.model_state``, ``strategy_state``, ``optimizer_state``,
``local_steps``, ``steps`` and their ``load_*`` counterparts), stores tied parameters once
with aliases, sees through ``torch.compile``'s ``_orig_mod.`` names, and hands the files to
``storage.commit``; ``restore`` reads them back through ``storage.resolve``, one rank's share
each.

Any other object with ``state_dict()`` and ``load_state_dict()`` (an LR scheduler, a
``torch.amp.GradScaler``, a user's object: PyTorch DCP's ``Stateful`` protocol) is *stateful*:
its ``state_dict()`` is stored through :mod:`.tree` (tensors in safetensors, the rest strict
JSON, no pickle) in ``<key>.safetensors``, or in ``<key>.rank<r>.safetensors`` per rank when
the replicas' states differ (a loss scale per asynchronous worker); ``restore`` hands it to
the object's ``load_state_dict()`` in place. An LR scheduler restored without its optimizer
sets the optimizer's learning rates to the restored ``_last_lr``, so the first step after a
resume uses the scheduled rate.
"""


from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..comm import Comm
from ..data import DistributedLoader
from ..errors import CheckpointError
from ..strategy import Strategy, register_feature
from ..validation import check_int
from . import sharded
from .format import (
    CORRUPT_FIX,
    FORMAT_VERSION,
    KEY_RE,
    MAX_JSON_DEPTH,
    check_optimizer_state,
    dumps_checked,
    load_pt,
    pack,
    read_safetensors,
    save_tensors,
    unpack,
)
from .storage import (
    Wanted,
    clean_path,
    commit,
    discard_staged,
    extras_of,
    member_bytes,
    member_tensors,
    merge_shards,
    resolve,
    stage,
    write_file,
)


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


# ---------------------------------------------------------------------- stateful objects
#: File stems stratagem writes itself: no keyword may take them.
_RESERVED_KEYS = frozenset({"strategy", "extra", "rng", "manifest"})


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` (not a class) follows the ``state_dict()`` / ``load_state_dict()``
    protocol. Modules, optimizers and loaders follow it too: ``save`` and ``restore`` test
    for them first, as they have entries of their own."""
    return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def _save_stateful(comm: Comm, key: str, obj: Any, files: dict[str, bytes]) -> dict[str, Any]:
    """Store ``obj.state_dict()`` once when every replica holds the same, else per rank; every
    rank takes part in the gathers even when its own state is refused, so a refusal on one
    replica is an error on all of them instead of a hang."""
    what = f"{key} (state_dict() of a {type(obj).__name__})"
    blob, error = b"", None
    try:
        blob = pack(obj.state_dict(), what, path=key)
    except CheckpointError as exc:
        error = exc
    digests = comm.all_gather_bytes(hashlib.sha256(blob).digest() if error is None else b"")
    if error is not None:
        raise error
    if b"" in digests:
        raise CheckpointError(f"cannot checkpoint {what}: rank {digests.index(b'')} refused "
                              "its state (see its error)")
    entry: dict[str, Any] = {"kind": "stateful", "type": type(obj).__name__, "per_rank": 0}
    if len(set(digests)) == 1:
        files[f"{key}.safetensors"] = blob
    else:
        for r, b in enumerate(comm.all_gather_bytes(blob)):
            files[f"{key}.rank{r}.safetensors"] = b
        entry["per_rank"] = comm.world_size
    return entry


def _check_key(key: str, obj: Any) -> None:
    if KEY_RE.fullmatch(key) is None or key in _RESERVED_KEYS:
        raise CheckpointError(f"cannot checkpoint {key!r}: a {type(obj).__name__} is stored in a "
                              f"file named after its keyword, which must match {KEY_RE.pattern} "
                              f"and not be one of {sorted(_RESERVED_KEYS)}. Fix: pass it under "
                              "another name, e.g. model=..., optimizer=..., scheduler=...")


def _sync_scheduler_lrs(scheduler: Any, restored: list[Any]) -> None:
    """An LR scheduler restored without its optimizer: the optimizer's ``lr`` still holds the
    initial rate, which the next step would use (and chainable schedules such as
    ``CosineAnnealingLR`` would build on); set it to the restored ``_last_lr``."""
    opt = getattr(scheduler, "optimizer", None)
    last = getattr(scheduler, "_last_lr", None)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or opt is None \
            or not isinstance(last, list):
        return
    if any(o is opt or getattr(o, "optimizer", None) is opt
           or getattr(opt, "optimizer", None) is o for o in restored):
        return  # its optimizer was restored too: its saved lr is the scheduled one
    groups = opt.param_groups
    if len(last) != len(groups):
        raise CheckpointError(f"the restored {type(scheduler).__name__} has {len(last)} learning "
                              f"rates for an optimizer with {len(groups)} parameter groups. Fix: "
                              "restore with the same parameter groups as the saved run")
    for group, lr in zip(groups, last, strict=True):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


# ---------------------------------------------------------------------- save
def save(strategy: Strategy, path: str | os.PathLike[str], *, keep_last: int = 2,
         consolidate: bool = False, **state: Any) -> Path:
    """Collective save; see the module docstring. Returns the version directory written.
    State held in shards (``sg.Sharded``) is written by each replica, see
    :mod:`stratagem.checkpoint.sharded`; ``consolidate=True`` gathers it into the usual files."""
    check_int("keep_last", keep_last, minimum=1, fix="pass how many versions to keep, e.g. 2")
    path = clean_path(path)
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
        if isinstance(obj, (nn.Module, torch.optim.Optimizer)) or (
                is_stateful(obj) and not isinstance(obj, DistributedLoader)):
            _check_key(key, obj)
        if isinstance(obj, nn.Module):
            prepared = strategy.find_prepared(obj)
            raw = strategy.model_state(obj)
            if sharded.is_sharded(raw) and not consolidate:
                entry = sharded.save_entry(comm, key, {_clean_name(k): v for k, v in raw.items()},
                                           own, "module", pack)
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
            files[fname] = save_tensors(unique, {"format": "pt"}, key)
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
                manifest["objects"][key] = sharded.save_entry(comm, key, sd, own, "optimizer", pack)
                continue
            sd = sharded.gather_full(sd) if sharded.is_sharded(sd) else sd
            blob = pack(sd, f"{key} (optimizer state)")
            if strategy.optimizer_state_is_local and comm.world_size > 1:
                for r, b in enumerate(comm.all_gather_bytes(blob)):
                    files[f"{key}.rank{r}.safetensors"] = b
                manifest["objects"][key] = {"kind": "optimizer", "per_rank": comm.world_size}
            else:
                files[f"{key}.safetensors"] = blob
                manifest["objects"][key] = {"kind": "optimizer", "per_rank": 0}
        elif isinstance(obj, DistributedLoader):
            manifest["objects"][key] = {"kind": "loader", "state": obj.state_dict()}
        elif is_stateful(obj):
            manifest["objects"][key] = _save_stateful(comm, key, obj, files)
        elif isinstance(obj, torch.Tensor) or (isinstance(obj, (dict, list, tuple)) and _has_tensor(obj)):
            extra_tensors[key] = obj
        else:
            # Two levels less: the manifest holds it under "extra".
            dumps_checked(obj, f"{key}={type(obj).__name__}", MAX_JSON_DEPTH - 2)
            manifest["extra"][key] = obj
    if strategy_state:
        # Strategies look each of their names up on restore: copies, not aliases.
        unique, _ = _dedupe(strategy_state, "strategy state", alias=False)
        files["strategy.safetensors"] = save_tensors(unique, None, "strategy state")
    if extra_tensors:
        files["extra.safetensors"] = pack(extra_tensors, "the tensor extras")
    manifest["precision"] = strategy.precision.state_dict()
    manifest["steps"] = strategy.steps
    step = manifest["extra"].get("step", strategy.steps)
    manifest["step"] = int(step) if isinstance(step, (int, float)) and math.isfinite(step) \
        else strategy.steps
    rng = pack({"torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                "the RNG state")
    for r, b in enumerate(comm.all_gather_bytes(rng)):
        files[f"rng.rank{r}.safetensors"] = b

    written: Path | None = None
    failed = torch.zeros(1)
    error: BaseException | None = None
    if own:
        written, error = sharded.commit_with_shards(
            comm, own, stage=lambda: stage(path), write=write_file, abort=discard_staged,
            commit=lambda tmp, digests: commit(path, files, manifest, keep_last, (tmp, digests)))
        failed.fill_(1.0 if error is not None else 0.0)
    elif comm.rank == 0:
        try:
            written = commit(path, files, manifest, keep_last)
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



# ---------------------------------------------------------------------- restore
def _set_rng(rng: Any, what: str) -> None:
    expected = torch.get_rng_state()
    state = rng.get("torch") if isinstance(rng, dict) else None
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1
            and state.numel() == expected.numel()):
        raise CheckpointError(f"{what}: the CPU RNG state must be a uint8 vector of "
                              f"{expected.numel()} bytes, got "
                              f"{getattr(state, 'dtype', type(state).__name__)} "
                              f"{tuple(getattr(state, 'shape', ()))}. {CORRUPT_FIX}")
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8):
        raise CheckpointError(f"{what}: the CUDA RNG state must be a uint8 tensor or None, got "
                              f"{type(cuda).__name__}. {CORRUPT_FIX}")
    try:
        torch.set_rng_state(state)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{what}: the RNG state was refused by torch ({exc}). "
                              f"{CORRUPT_FIX}") from exc


def _wanted_by(rank: int, world_size: int, state: dict[str, Any]) -> Wanted:
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
            elif entry.get("kind") in ("optimizer", "stateful"):
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
    raw = clean_path(path)
    if raw.is_file():
        return _restore_model_file(strategy, raw, state)
    comm = strategy.comm
    directory, manifest, blobs = resolve(raw, _wanted_by(comm.rank, comm.world_size, state))
    objects = manifest.get("objects", {})
    files = manifest["files"]
    strategy_state = (member_tensors(directory, blobs, "strategy.safetensors")
                      if "strategy.safetensors" in files else {})
    result = extras_of(directory, manifest, blobs)
    optimizers: list[Any] = []
    schedulers: list[Any] = []
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
                       else member_tensors(directory, blobs, entry["file"]))
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
                         unpack(member_bytes(directory, blobs, name), str(directory / name)))
            if not isinstance(opt_state, dict):
                raise CheckpointError(f"{directory / name} holds a {type(opt_state).__name__}, "
                                      f"not an optimizer state dict. {CORRUPT_FIX}")
            check_optimizer_state(obj, opt_state, f"{directory}: {key!r}")
            try:
                strategy.load_optimizer_state(obj, opt_state)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise CheckpointError(
                    f"{directory / name} does not fit the {type(obj).__name__} given ({exc!r:.200}). "
                    "Fix: restore with the same optimizer class and parameter groups as the "
                    "saved one, or restore the model alone") from exc
            optimizers.append(obj)
        elif isinstance(obj, DistributedLoader):
            if entry["kind"] != "loader":
                raise CheckpointError(f"checkpoint {directory}: {key!r} is a saved "
                                      f"{entry['kind']}, not a loader")
            obj.load_state_dict(entry["state"])
        elif is_stateful(obj):
            if entry["kind"] != "stateful":
                raise CheckpointError(f"checkpoint {directory}: {key!r} is a saved "
                                      f"{entry['kind']}, not an object with load_state_dict(). "
                                      f"Fix: pass {key}= the kind of object that was saved "
                                      "under that name")
            per_rank = int(entry.get("per_rank", 0))
            name = f"{key}.rank{comm.rank % per_rank}.safetensors" if per_rank else f"{key}.safetensors"
            value = unpack(member_bytes(directory, blobs, name), str(directory / name))
            try:
                obj.load_state_dict(value)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError,
                    RuntimeError) as exc:
                raise CheckpointError(
                    f"{directory / name} (a saved {entry.get('type', 'object')!s:.80}) does not "
                    f"fit the {type(obj).__name__} given: load_state_dict raised {exc!r:.200}. "
                    f"Fix: restore {key}= with an object of the saved class and "
                    "configuration") from exc
            schedulers.append(obj)
        else:
            raise TypeError(f"restore({key}=...) takes modules, optimizers, loaders and objects "
                            f"with load_state_dict(); got {type(obj).__name__}")
    for obj in schedulers:
        _sync_scheduler_lrs(obj, optimizers)
    strategy.precision.load_state_dict(manifest.get("precision", {}))
    rng_name = f"rng.rank{comm.rank}.safetensors"
    # RNG states are per rank: restored only when the job has as many ranks as the writer.
    if manifest.get("world_size") == comm.world_size and rng_name in files:
        _set_rng(unpack(member_bytes(directory, blobs, rng_name), str(directory / rng_name)),
                 str(directory / rng_name))
    strategy.steps = int(manifest.get("steps", strategy.steps))
    return result


def _merge_shards(directory: Path, blobs: dict[str, bytes], entry: dict[str, Any]) -> Any:
    return merge_shards(directory, blobs, entry)


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
