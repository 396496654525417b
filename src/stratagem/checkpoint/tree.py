"""A nested state as tensors + a JSON skeleton, and back: the one codec of checkpoints and heals.

``encode(tree)`` walks a nested state (an optimizer's ``state_dict()``, an LR scheduler's, a
``GradScaler``'s, a user object's, or torchft's ``{"user": ..., "torchft": ...}``) and returns
``(tensors, skeleton)``: every tensor moved to the CPU under a unique name, and a skeleton made
only of JSON values in which each tensor is a reference. ``decode(tensors, skeleton)`` rebuilds
the state. Nothing is pickled, so nothing a file or a peer sends can run code when it is read.

The skeleton records what JSON would lose, with one tag per container so a user's own key can
never be mistaken for a tag:

* a dict is ``{"__dict__": [[key, value], ...]}``: keys must be ``str`` or ``int`` (an optimizer's
  parameter ids) and come back with their type;
* a list is ``{"__list__": [...]}``, a tuple ``{"__tuple__": [...]}``;
* a tensor is ``{"__tensor__": name}``; the same view of one storage (tied weights) is stored
  once and comes back as one tensor, different overlapping views are stored as copies;
* a non-finite float is ``{"__float__": "nan" | "inf" | "-inf"}``, so the JSON text stays strict
  (no ``NaN`` token); finite floats, ints, bools, strings and ``None`` are themselves (Python's
  float ``repr`` round-trips exactly, so a float comes back bit for bit).

Anything else (a function, a lambda, a module, a numpy scalar, a set, a namedtuple, a DTensor,
a sparse tensor, a key of another type) is refused with :class:`~stratagem.CheckpointError`
naming its key path, e.g. ``scheduler.lr_lambdas[0].fn``, and the fix. ``decode`` accepts only
what ``encode`` writes (and the untagged non-finite floats of format-1 checkpoint files, whose
JSON text is parsed by :mod:`.format`); its recursion is bounded by the depth check the caller
made before parsing the JSON text (``format.loads_checked``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = ["encode", "decode", "path_join", "MAX_DEPTH"]

#: Deepest skeleton ``encode`` writes, in JSON levels (a dict takes 3: the tag object, the list
#: of pairs, the pair; a list or tuple 2); equal to what checkpoint readers accept.
MAX_DEPTH = 96
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_FIX = ("Fix: make state_dict() return only tensors, None, bool, int, float, str and "
        "lists/tuples/dicts (str or int keys) of them, and rebuild anything else (functions, "
        "modules, other objects) in the object's constructor; nothing is pickled")


def path_join(path: str, key: Any) -> str:
    """``path`` extended by ``key`` the way Python would index it: ``a.b`` for identifier
    strings, ``a['x y']`` for other strings, ``a[0]`` for ints and list positions."""
    if isinstance(key, str) and _IDENT_RE.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


class _Encoder:
    def __init__(self, what: str, max_depth: int) -> None:
        self.what = what
        self.max_depth = max_depth
        self.tensors: dict[str, torch.Tensor] = {}
        # (device, storage pointer) -> [(view, name)]: one name per identical view of a storage.
        self.views: dict[tuple[Any, int], list[tuple[tuple[Any, ...], str]]] = {}

    def refuse(self, path: str, why: str) -> CheckpointError:
        where = path or "the top level"
        return CheckpointError(f"cannot store {self.what}: {where} {why}. {_FIX}")

    def tensor(self, value: torch.Tensor, path: str) -> dict[str, str]:
        t = value.detach()
        if type(t) is not torch.Tensor:
            raise self.refuse(path, f"is a {type(value).__name__} (a tensor subclass; for a "
                              "DTensor store .full_tensor() or its local shard)")
        if t.layout != torch.strided or t.device.type == "meta" or t.is_quantized:
            raise self.refuse(path, f"is a {t.layout} {t.device.type} tensor"
                              f"{' (quantized)' if t.is_quantized else ''}; only dense tensors "
                              "with data are stored (call .to_dense() or materialize it)")
        name = path or "_"
        if name in self.tensors:  # "a/b" and a -> b print alike: keep the names unique
            name = f"{name}#{len(self.tensors)}"
        stored = t.cpu().contiguous()
        if t.numel():
            storage = (t.device, t.untyped_storage().data_ptr())
            view = (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)
            seen = self.views.setdefault(storage, [])
            for other, other_name in seen:
                if other == view:  # tied: stored once, one tensor object again on decode
                    return {"__tensor__": other_name}
            if seen:
                # Another view of a storage already stored: safetensors refuses shared
                # memory, so this one is stored as a copy.
                stored = stored.clone()
            seen.append((view, name))
        self.tensors[name] = stored
        return {"__tensor__": name}

    def walk(self, obj: Any, path: str, depth: int) -> Any:
        if depth > self.max_depth:
            raise self.refuse(path, f"is nested deeper than {self.max_depth} JSON levels (a "
                              "dict level takes 3, a list level 2); flatten the structure")
        if obj is None or isinstance(obj, bool):
            return obj
        if isinstance(obj, int):
            return int(obj)  # an IntEnum is stored (and comes back) as its value
        if isinstance(obj, float):
            value = float(obj)
            if math.isfinite(value):
                return value
            return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, dict):
            pairs = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise self.refuse(path_join(path, k), f"has a key of type {type(k).__name__}; "
                                      "dict keys must be str or int")
                key = str(k) if isinstance(k, str) else int(k)
                pairs.append([key, self.walk(v, path_join(path, key), depth + 3)])
            return {"__dict__": pairs}
        if isinstance(obj, list) or type(obj) is tuple:
            tag = "__list__" if isinstance(obj, list) else "__tuple__"
            return {tag: [self.walk(v, path_join(path, i), depth + 2) for i, v in enumerate(obj)]}
        kind = type(obj).__name__
        if isinstance(obj, tuple):
            why = f"is a {kind} (a tuple subclass, which would come back as a plain tuple)"
        elif callable(obj):
            why = f"is a {kind} (callables cannot be stored without pickle)"
        else:
            why = f"is a {kind}"
        raise self.refuse(path, why)


def encode(tree: Any, *, what: str = "the state", path: str = "",
           max_depth: int = MAX_DEPTH) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, skeleton)`` of ``tree``; see the module docstring. ``path`` prefixes the key
    paths named in errors (e.g. ``"scheduler"``); ``what`` names the whole in them."""
    enc = _Encoder(what, max_depth)
    return enc.tensors, enc.walk(tree, path, 1)


def _bad(what: str, why: str) -> CheckpointError:
    return CheckpointError(f"{what}: {why}. Fix: the data is corrupt or was not written by "
                           "stratagem; use another copy")


def decode(tensors: dict[str, torch.Tensor], skeleton: Any, *, what: str = "the state") -> Any:
    """The tree :func:`encode` was given, from its tensors and (parsed) skeleton. Every shape
    ``encode`` never writes is a :class:`~stratagem.CheckpointError`; recursion is bounded by
    the depth check made before the skeleton's JSON was parsed."""
    if isinstance(skeleton, dict):
        if len(skeleton) != 1:
            raise _bad(what, f"a stored value is an object with keys {sorted(map(str, skeleton))[:3]}"
                       ", not one tag")
        (tag, body), = skeleton.items()
        if tag == "__tensor__":
            if not isinstance(body, str) or body not in tensors:
                raise _bad(what, f"it refers to tensor {body!r:.80} that is not stored")
            return tensors[body]
        if tag == "__dict__":
            if not isinstance(body, list):
                raise _bad(what, "a stored dict is not a list of [key, value] pairs")
            out: dict[Any, Any] = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise _bad(what, "a stored dict is not a list of [key, value] pairs")
                key, value = pair
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise _bad(what, f"a stored dict key is a {type(key).__name__}, not str or int")
                out[key] = decode(tensors, value, what=what)
            return out
        if tag in ("__list__", "__tuple__"):
            if not isinstance(body, list):
                raise _bad(what, f"{tag} holds a {type(body).__name__}, not a list")
            items = [decode(tensors, v, what=what) for v in body]
            return items if tag == "__list__" else tuple(items)
        if tag == "__float__":
            if not isinstance(body, str) or body not in _FLOATS:
                raise _bad(what, f"__float__ holds {body!r:.40}, not one of {sorted(_FLOATS)}")
            return _FLOATS[body]
        raise _bad(what, f"unexpected tag {str(tag)!r:.40} in the stored JSON")
    if isinstance(skeleton, list):
        raise _bad(what, "a bare JSON list where a stored value was expected")
    if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
        return skeleton
    raise _bad(what, f"a stored value is a {type(skeleton).__name__}")
