"""Strategies by name: ``sg.from_name("easgd", period=4)`` and ``sg.from_env()`` (what
``stratagem run --strategy NAME --strategy-arg k=v`` sets for an unmodified script).

:data:`STRATEGIES` is the one table of strategies: it feeds ``from_name`` /
``strategy_names`` here and the lazy ``sg.<Class>`` exports of ``stratagem/__init__.py``.
Adding a strategy is one row. Modules are imported on first use only, so a row whose module
is not installed yet (a strategy landing from another branch) neither breaks ``import
stratagem`` nor shows up in ``strategy_names()``; ``from_name`` names what is missing.

The registry also supplies the default strategy that ``sg.get_strategy()`` returns outside
any scope (a single-process ``OneDevice``): ``context`` is a leaf of the import graph and
cannot import a strategy itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._argnames import (
    Arguments,
    check_argument_names,
    check_names,
    class_arguments,
    cli_line,
    source_arguments,
)
from .context import set_default_strategy_factory

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["StrategyEntry", "STRATEGIES", "from_name", "from_env", "strategy_names",
           "canonical_name", "is_available", "lazy_exports", "strategy_class",
           "check_argument_names_early", "cli_name_problem"]


@dataclass(frozen=True)
class StrategyEntry:
    """One registered strategy: ``sg.<public>`` (None: a preset of a class exported by
    another row), the registry ``name``, where the class lives, and preset arguments."""

    public: str | None
    name: str
    module: str
    cls: str
    preset: dict[str, Any] = field(default_factory=dict)


#: Every strategy, by registry name; the first row of a class carries its public name.
STRATEGIES: tuple[StrategyEntry, ...] = (
    StrategyEntry("OneDevice", "one_device", "stratagem.strategies.one_device", "OneDevice"),
    StrategyEntry("Mirrored", "mirrored", "stratagem.strategies.mirrored", "Mirrored"),
    StrategyEntry("ParameterServer", "ps-async", "stratagem.strategies.parameter_server",
                  "ParameterServer", {"mode": "async"}),
    StrategyEntry(None, "ps-sync", "stratagem.strategies.parameter_server", "ParameterServer",
                  {"mode": "sync"}),
    StrategyEntry("ElasticAveraging", "easgd", "stratagem.strategies.elastic_average",
                  "ElasticAveraging", {"mode": "sync"}),
    StrategyEntry(None, "easgd-async", "stratagem.strategies.elastic_average",
                  "ElasticAveraging", {"mode": "async"}),
    StrategyEntry(None, "eamsgd", "stratagem.strategies.elastic_average", "ElasticAveraging",
                  {"momentum": 0.9}),
    StrategyEntry("LocalSGD", "local_sgd", "stratagem.strategies.local_sgd", "LocalSGD"),
    StrategyEntry("DiLoCo", "diloco", "stratagem.strategies.local_sgd", "DiLoCo"),
    StrategyEntry(None, "diloco-async", "stratagem.strategies.local_sgd", "DiLoCo",
                  {"mode": "async"}),
    # Landing from other branches: listed once their module exists.
    StrategyEntry("Hierarchical", "hierarchical", "stratagem.strategies.hierarchical",
                  "Hierarchical"),
    StrategyEntry("Sharded", "sharded", "stratagem.strategies.sharded", "Sharded"),
)

_BY_NAME: dict[str, StrategyEntry] = {e.name: e for e in STRATEGIES}
_ALIASES = {"onedevice": "one_device", "ps": "ps-async", "parameter_server": "ps-async",
            "localsgd": "local_sgd", "local-sgd": "local_sgd", "one-device": "one_device",
            "elastic_averaging": "easgd", "easgd-sync": "easgd"}


def is_available(entry: StrategyEntry) -> bool:
    """Whether ``entry``'s module is installed (found without importing it)."""
    try:
        return importlib.util.find_spec(entry.module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def lazy_exports() -> dict[str, tuple[str, str]]:
    """``sg.<public>`` -> (module, class) for every available strategy with a public name."""
    return {e.public: (e.module, e.cls) for e in STRATEGIES
            if e.public is not None and is_available(e)}


def strategy_names() -> list[str]:
    """The names ``from_name`` accepts (strategies whose module is installed)."""
    return sorted(e.name for e in STRATEGIES if is_available(e))


def canonical_name(name: str) -> str:
    """The registry key for ``name`` (aliases and class names accepted); ``ValueError``
    listing the valid names otherwise, also for a registered strategy whose module is not
    installed (``stratagem run`` checks this before starting any worker)."""
    lowered = name.lower()
    by_class = [e.name for e in STRATEGIES if lowered == e.cls.lower() and not e.preset]
    key = by_class[0] if by_class else _ALIASES.get(lowered, lowered)
    if key not in _BY_NAME:
        raise ValueError(f"unknown strategy {name!r}; valid names: {', '.join(strategy_names())}")
    if not is_available(_BY_NAME[key]):
        raise ValueError(f"strategy {key!r} is registered but its module {_BY_NAME[key].module} "
                         f"is not installed in this version of stratagem; valid names: "
                         f"{', '.join(strategy_names())}")
    return key


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under ``name`` (imported now); ``ValueError`` for an unknown
    name or a registered one whose module is not installed."""
    entry = _BY_NAME[canonical_name(name)]
    return getattr(importlib.import_module(entry.module), entry.cls)  # type: ignore[no-any-return]


def _arguments_early(name: str) -> tuple[str, Arguments]:
    entry = _BY_NAME[canonical_name(name)]
    found = source_arguments(entry.module, entry.cls)
    return entry.name, found if found is not None else class_arguments(strategy_class(name))


def check_argument_names_early(name: str, kwargs: dict[str, Any]) -> None:
    """What ``from_name(name, **kwargs)`` checks by name — the ``ValueError`` for an unknown
    strategy, the one-line ``TypeError`` for an unknown argument — read from the strategy's
    source where it can be, so without importing torch (``stratagem run`` calls it before
    anything else: a misspelt ``--strategy-arg`` exits in well under a second after Python's
    start-up). Values are not checked: building the strategy does that."""
    entry = _BY_NAME[canonical_name(name)]
    registry_name, arguments = _arguments_early(name)
    check_argument_names(registry_name, arguments, {**entry.preset, **kwargs},
                         resolve=_arguments_early)


def cli_name_problem(name: str, kwargs: dict[str, Any]) -> str | None:
    """``stratagem run``'s first check, before torch is imported: the strategy's name and
    its arguments' names (:func:`check_argument_names_early`); None, or
    the one-line problem."""
    try:
        check_argument_names_early(name, kwargs)
    except (TypeError, ValueError) as e:
        return cli_line(kwargs, e)
    return None


def from_name(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy from its short name; ``kwargs`` override the preset arguments.

    An unknown argument is a ``TypeError`` naming it, the nearest valid name and the
    strategy's arguments (one line, the same that ``stratagem run`` prints before starting
    any worker); a bad value raises the strategy's own ``ValueError`` / ``TypeError``."""
    entry = _BY_NAME[canonical_name(name)]
    cls = strategy_class(entry.name)
    args = {**entry.preset, **kwargs}
    check_names(entry.name, cls, args,
                resolve=lambda spec: (canonical_name(spec), strategy_class(spec)))
    return cls(**args)


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


def _default_strategy() -> Strategy:
    from .comm import Comm  # torch: imported on first use, not with stratagem

    # An explicit comm: the implicit default must not warn about a launcher's WORLD_SIZE.
    return from_name("one_device", comm=Comm.single())


set_default_strategy_factory(_default_strategy)
