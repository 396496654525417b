"""Strategies by name: ``sg.from_name("easgd", period=4)`` and ``sg.from_env()`` (what
``stratagem run --strategy NAME --strategy-arg k=v`` sets for an unmodified script)."""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["from_name", "from_env", "strategy_names", "canonical_name"]

# name -> (module, class, preset keyword arguments)
_NAMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "one_device": ("stratagem.strategies.one_device", "OneDevice", {}),
    "mirrored": ("stratagem.strategies.mirrored", "Mirrored", {}),
    "ps-async": ("stratagem.strategies.parameter_server", "ParameterServer", {"mode": "async"}),
    "ps-sync": ("stratagem.strategies.parameter_server", "ParameterServer", {"mode": "sync"}),
    "easgd": ("stratagem.strategies.elastic_average", "ElasticAveraging", {"mode": "sync"}),
    "easgd-async": ("stratagem.strategies.elastic_average", "ElasticAveraging", {"mode": "async"}),
    "eamsgd": ("stratagem.strategies.elastic_average", "ElasticAveraging", {"momentum": 0.9}),
    "local_sgd": ("stratagem.strategies.local_sgd", "LocalSGD", {}),
    "diloco": ("stratagem.strategies.local_sgd", "DiLoCo", {}),
    "hierarchical": ("stratagem.strategies.hierarchical", "Hierarchical", {}),
}
_ALIASES = {"onedevice": "one_device", "ps": "ps-async", "parameter_server": "ps-async",
            "localsgd": "local_sgd", "local-sgd": "local_sgd", "one-device": "one_device",
            "elastic_averaging": "easgd", "easgd-sync": "easgd"}


def strategy_names() -> list[str]:
    """The names ``from_name`` accepts."""
    return sorted(_NAMES)


def canonical_name(name: str) -> str:
    """The registry key for ``name`` (aliases and class names accepted); ``ValueError``
    listing the valid names otherwise."""
    lowered = name.lower()
    for key, (_, cls, preset) in _NAMES.items():
        if lowered == cls.lower() and not preset:
            return key
    key = _ALIASES.get(lowered, lowered)
    if key not in _NAMES:
        raise ValueError(f"unknown strategy {name!r}; valid names: {', '.join(strategy_names())}")
    return key


def from_name(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy from its short name; ``kwargs`` override the preset arguments."""
    module, cls, preset = _NAMES[canonical_name(name)]
    strategy_cls = getattr(importlib.import_module(module), cls)
    return strategy_cls(**{**preset, **kwargs})  # type: ignore[no-any-return]


def from_env(default: str = "one_device", **kwargs: Any) -> Strategy:
    """The strategy named by ``STRATAGEM_STRATEGY`` (JSON arguments in
    ``STRATAGEM_STRATEGY_ARGS``), else ``default``; ``kwargs`` fill in what the env omits."""
    name = os.environ.get("STRATAGEM_STRATEGY", default)
    raw = os.environ.get("STRATAGEM_STRATEGY_ARGS", "{}")
    try:
        env_args = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"STRATAGEM_STRATEGY_ARGS must be a JSON object, got {raw!r}") from exc
    if not isinstance(env_args, dict):
        raise ValueError(f"STRATAGEM_STRATEGY_ARGS must be a JSON object, got {raw!r}")
    return from_name(name, **{**kwargs, **env_args})
