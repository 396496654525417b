"""Optimizer specs: the user's ``torch.optim`` optimizer rebuilt on the parameter-server shards.

As in TensorFlow's parameter-server training (and Downpour SGD, Dean et al. 2012), the update
rule runs where the parameters live. A worker describes its optimizer as a JSON spec
``{"name": "adam", "lr": 1e-3, "betas": [0.9, 0.999], ...}`` and each shard builds the real
``torch.optim`` class over its tensors, one optimizer per tensor. That is exact for the
supported optimizers because all of them (SGD, Adam, AdamW, RMSprop, Adagrad) update every
element independently, and it lets different tensors be updated concurrently.

Sparse gradients (rows of an ``nn.Embedding``) are applied as torch sparse gradients where
torch's optimizer supports them *and* the result equals the dense update: SGD without momentum
or weight decay, Adagrad without weight decay. For every other configuration the rows are
scattered into a dense zero gradient first, which is exactly what a dense backward would give.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from stratagem.ps.updates import DOWN_KINDS

__all__ = ["OPTIMIZERS", "STALENESS_LR", "OUTER_GRACE", "OUTER_STALENESS", "OUTER_ROUND",
           "OUTER_DOWNLOAD",
           "STALENESS_RULES",
           "MAX_LR", "optimizer_spec", "validate_spec", "build_optimizer",
           "check_spec", "state_layout", "supports_sparse", "jsonable"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}
_NAMES = {cls: name for name, cls in OPTIMIZERS.items()}
# Implementation switches that depend on the device, not the maths; the shard chooses its own.
_IGNORED = frozenset({"foreach", "fused", "capturable", "differentiable"})
#: Not torch's: a shard-side switch of the update rule (async mode). True: each gradient is
#: applied with ``lr / max(1, staleness)`` (staleness-aware async SGD, Zhang et al., IJCAI
#: 2016). Carried in the spec so it travels, is validated and is checkpointed with the rest.
STALENESS_LR = "staleness_lr"
#: Not torch's: shard-side switches of the outer (asynchronous DiLoCo) rule, carried in the
#: spec for the same reasons. ``outer_grace``: seconds after a round's first contribution
#: when a waiting replica may close the round with fewer than ``min_contributions`` (None:
#: never). ``outer_staleness``: how a contribution computed on an older model is weighted
#: (:data:`STALENESS_RULES`).
OUTER_GRACE = "outer_grace"
OUTER_STALENESS = "outer_staleness"
#: ``outer_round_samples``: the samples of a full round (replicas x period): a round's summed
#: pseudo-gradients are divided by the larger of it and the samples they cover, so every
#: sample moves the model by the same amount however the rounds are grouped (None: by the
#: samples they cover, a plain weighted mean).
OUTER_ROUND = "outer_round_samples"
#: ``outer_download``: None, or the kind ("bf16", "fp16", "int8", "int4") the model comes
#: down in: the shard sets its model to the encoded round update applied to the previous
#: one, with error feedback on the shard, and serves replicas a round or a few behind the
#: encoded updates instead of the model (:mod:`stratagem.ps.updates`).
OUTER_DOWNLOAD = "outer_download"
#: ``"inverse"``: weight ``1 / (1 + staleness)``; ``"none"``: no correction.
STALENESS_RULES = ("inverse", "none")
_SWITCHES = frozenset({STALENESS_LR, OUTER_GRACE, OUTER_STALENESS, OUTER_ROUND, OUTER_DOWNLOAD})


#: Largest learning rate a shard accepts (at register, set_hyperparams and set_state). A
#: finite ``lr=1e30`` turns any later finite gradient into an overflow; the shards refuse such
#: steps anyway (:mod:`stratagem.ps.rules`), and this bound refuses the configuration early.
MAX_LR = 1e3

_ALLOWED: dict[type, frozenset[str]] = {}


def _allowed(cls: type[torch.optim.Optimizer]) -> frozenset[str]:
    # Cached: a strategy compares its optimizer's spec every step (LR schedulers).
    found = _ALLOWED.get(cls)
    if found is None:
        params = inspect.signature(cls.__init__).parameters
        found = _ALLOWED[cls] = frozenset(p for p in params
                                          if p not in ("self", "params")) - _IGNORED
    return found


def jsonable(key: str, value: Any) -> Any:
    """``value`` of hyperparameter ``key`` as JSON can carry it (one-element tensors become
    numbers); ``TypeError`` naming it when it cannot be sent to the shards."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
        return [float(v) for v in value]
    raise TypeError(f"optimizer hyperparameter {key}={value!r} cannot be sent to the "
                    "parameter servers; use numbers, booleans or tuples of numbers")


def optimizer_spec(optimizer: torch.optim.Optimizer, group: int = 0) -> dict[str, Any]:
    """The spec of ``optimizer``'s param group ``group`` (raises ``TypeError`` if unsupported)."""
    name = _NAMES.get(type(optimizer))
    if name is None:
        raise TypeError(f"optimizer {type(optimizer).__name__} cannot run on parameter-server "
                        f"shards; supported: {', '.join(c.__name__ for c in OPTIMIZERS.values())}"
                        ". Fix: build one of those (the shards rebuild it from its class and "
                        "hyperparameters), or use a strategy that steps locally (Mirrored)")
    allowed = _allowed(type(optimizer))
    spec: dict[str, Any] = {"name": name}
    for k, v in optimizer.param_groups[group].items():
        if k in allowed:
            spec[k] = jsonable(k, v)
    return spec


def validate_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Check a spec; returns the hyperparameters. Raises ``ValueError`` naming what is wrong."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ValueError(f"optimizer spec must be a dict with a string 'name', got {spec!r}")
    cls = OPTIMIZERS.get(spec["name"].lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {spec['name']!r}; valid: {sorted(OPTIMIZERS)}")
    allowed = _allowed(cls)
    flag = spec.get(STALENESS_LR, False)
    if not isinstance(flag, bool):
        raise ValueError(f"optimizer spec key {STALENESS_LR!r} must be true or false, got "
                         f"{flag!r}")
    grace = spec.get(OUTER_GRACE)
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, (int, float))
                              or not 0.0 <= float(grace) <= 86400.0):
        raise ValueError(f"optimizer spec key {OUTER_GRACE!r} must be null or a number of "
                         f"seconds in [0, 86400], got {grace!r}")
    per_round = spec.get(OUTER_ROUND)
    if per_round is not None and (isinstance(per_round, bool)
                                  or not isinstance(per_round, (int, float))
                                  or not 0.0 < float(per_round) <= 1e12):
        raise ValueError(f"optimizer spec key {OUTER_ROUND!r} must be null or a number in "
                         f"(0, 1e12], got {per_round!r}")
    down = spec.get(OUTER_DOWNLOAD)
    if down is not None and down not in DOWN_KINDS:
        raise ValueError(f"optimizer spec key {OUTER_DOWNLOAD!r} must be null or one of "
                         f"{list(DOWN_KINDS)}, got {down!r}")
    rule = spec.get(OUTER_STALENESS, "inverse")
    if rule not in STALENESS_RULES:
        raise ValueError(f"optimizer spec key {OUTER_STALENESS!r} must be one of "
                         f"{list(STALENESS_RULES)}, got {rule!r}")
    hyper = {k: v for k, v in spec.items()
             if k != "name" and k not in _SWITCHES and k not in _IGNORED}
    unknown = sorted(set(hyper) - allowed)
    if unknown:
        raise ValueError(f"optimizer {spec['name']!r} has no hyperparameter(s) {unknown}; "
                         f"valid: {sorted(allowed)}")
    for k, v in hyper.items():
        hyper[k] = tuple(v) if isinstance(v, list) else jsonable(k, v)
    lr = hyper.get("lr")
    if lr is not None and not isinstance(lr, tuple) and not isinstance(lr, bool):
        ok = False
        if isinstance(lr, (int, float)):
            try:
                ok = math.isfinite(float(lr)) and lr <= MAX_LR  # torch refuses < 0
            except OverflowError:
                ok = False
        if not ok:
            raise ValueError(f"optimizer hyperparameter lr must be a finite number <= "
                             f"{MAX_LR:g} on parameter-server shards (stratagem.ps.optim."
                             f"MAX_LR), got {lr!r}. Fix: pass a smaller learning rate")
    return hyper


_CHECKED: dict[str, tuple[dict[str, Any], dict[str, bool]]] = {}


def _finite_numbers(key: str, v: Any) -> None:
    items = v if isinstance(v, (list, tuple)) else [v]
    for x in items:
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            try:
                ok = math.isfinite(float(x))
            except OverflowError:
                ok = False
            if not ok:
                raise ValueError(f"optimizer hyperparameter {key}={v!r} is not a finite number; "
                                 "pass a finite value")


def check_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``spec`` the way torch would, by building its optimizer over a one-element
    tensor and taking one step (some bad values, e.g. ``betas`` of length 3, only fail in
    ``step``). Returns the param group torch built (validated, normalised values), without
    ``params``. Raises ``ValueError`` carrying torch's own message. Cached per spec."""
    hyper = validate_spec(spec)
    for k, v in hyper.items():
        _finite_numbers(k, v)
    cls = OPTIMIZERS[spec["name"].lower()]
    try:
        key = json.dumps({"name": cls.__name__, **hyper}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        key = None
    if key is not None and key in _CHECKED:
        return dict(_CHECKED[key][0])
    p = torch.nn.Parameter(torch.zeros(2))
    try:
        opt = cls([p], **hyper)
        p.grad = torch.ones(2)
        opt.step()
    except Exception as exc:  # noqa: BLE001 - torch raises Value/Type/Index/KeyError alike
        raise ValueError(f"optimizer spec {dict(spec)!r} was refused by torch."
                         f"{cls.__name__}: {type(exc).__name__}: {exc}") from None
    if not bool(torch.isfinite(p.detach()).all()):
        raise ValueError(f"optimizer spec {dict(spec)!r} turns a unit gradient into a "
                         "non-finite parameter; pass smaller hyperparameters")
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    # Which state entries torch keeps, and whether each has the parameter's shape.
    layout = {k: isinstance(v, torch.Tensor) and tuple(v.shape) == (2,)
              for k, v in opt.state[p].items()}
    if key is not None:
        if len(_CHECKED) >= 1024:  # bounded: specs come from the network
            _CHECKED.clear()
        _CHECKED[key] = (group, layout)
    return dict(group)


def state_layout(spec: Mapping[str, Any]) -> dict[str, bool]:
    """The optimizer state keys torch keeps for ``spec`` after a step, each mapped to
    whether it has the parameter's shape (else it is a scalar such as ``step``)."""
    check_spec(spec)
    hyper = validate_spec(spec)
    cls = OPTIMIZERS[spec["name"].lower()]
    key = json.dumps({"name": cls.__name__, **hyper}, sort_keys=True, allow_nan=False)
    found = _CHECKED.get(key)
    if found is None:  # evicted in between: check again
        _CHECKED.clear()
        check_spec(spec)
        found = _CHECKED[key]
    return dict(found[1])


def build_optimizer(spec: Mapping[str, Any], param: torch.Tensor) -> torch.optim.Optimizer:
    """Build the torch optimizer of ``spec`` over the single tensor ``param`` (validated by
    :func:`check_spec` first, so a spec torch refuses never reaches a shard's slot)."""
    check_spec(spec)
    hyper = validate_spec(spec)
    cls = OPTIMIZERS[spec["name"].lower()]
    return cls([param], **hyper)


def supports_sparse(spec: Mapping[str, Any]) -> bool:
    """Whether a torch sparse gradient gives exactly the dense update under ``spec``."""
    name = spec["name"].lower()
    wd = spec.get("weight_decay", 0) or 0
    if name == "sgd":
        return not (spec.get("momentum", 0) or 0) and not wd and not spec.get("maximize")
    return name == "adagrad" and not wd and not spec.get("maximize")
