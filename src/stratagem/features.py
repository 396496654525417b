"""Entry points of ``Strategy`` implemented elsewhere: ``save`` / ``restore``
(:mod:`stratagem.checkpoint`), ``fit`` (:mod:`stratagem.fit`), ``on_preemption``
(:mod:`stratagem.preemption`). Those modules import ``Strategy``, so the base class cannot
import them without a cycle: each registers its implementation here when imported, and
:func:`feature` imports the module on the first call that needs it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["register_feature", "feature"]

_FEATURES: dict[str, Callable[..., Any]] = {}
_FEATURE_MODULES = {"save": "stratagem.checkpoint", "restore": "stratagem.checkpoint",
                    "fit": "stratagem.fit", "on_preemption": "stratagem.preemption"}


def register_feature(name: str, implementation: Callable[..., Any]) -> None:
    """Plug in what ``Strategy.<name>`` runs: ``implementation(strategy, *args, **kwargs)``.
    ``name`` is one of ``save``, ``restore``, ``fit``, ``on_preemption``; registering again
    replaces the previous implementation (a test double, an alternative format)."""
    if name not in _FEATURE_MODULES:
        raise ValueError(f"unknown feature {name!r}; features: {sorted(_FEATURE_MODULES)}")
    _FEATURES[name] = implementation


def feature(name: str) -> Callable[..., Any]:
    """The implementation of ``Strategy.<name>``, importing its module on first use."""
    if name not in _FEATURES:
        importlib.import_module(_FEATURE_MODULES[name])  # it registers itself
    try:
        return _FEATURES[name]
    except KeyError:
        raise RuntimeError(f"Strategy.{name} is implemented by {_FEATURE_MODULES[name]}, which "
                           "did not register it. Fix: call stratagem.strategy.register_feature("
                           f"{name!r}, implementation)") from None
