"""stratagem: distribution strategies for PyTorch.

``import stratagem as sg``; pick a strategy (``sg.Mirrored()``, ``sg.ParameterServer()``,
``sg.ElasticAveraging()``, ``sg.LocalSGD()``, ``sg.DiLoCo()``, ``sg.OneDevice()``), then
``scope`` / ``prepare`` / ``distribute_dataset`` / ``backward`` / ``optimizer.step()``.
Importing has no side effects.
"""

from __future__ import annotations

from typing import Any

# Strategy.save / restore / fit / on_preemption are implemented by these modules, which
# register themselves with stratagem.strategy when imported (see register_feature there).
from . import checkpoint as _checkpoint  # noqa: F401
from . import fit as _fit  # noqa: F401
from .comm import Comm
from .context import InputContext, ReplicaContext, get_replica_context, get_strategy, has_strategy
from .errors import (
    CheckpointError,
    ParameterServerUnavailable,
    PeerTimeoutError,
    ReplicaMismatchError,
    StratagemError,
    WorkerError,
)
from .preemption import PREEMPTED_EXIT_CODE
from .registry import from_env, from_name, strategy_names
from .registry import lazy_exports as _lazy_exports
from .strategies.mirrored import Mirrored
from .strategies.one_device import OneDevice
from .strategy import ReduceOp, Strategy

__version__ = "0.1.0"

__all__ = [
    "Strategy",
    "OneDevice",
    "Mirrored",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "ReduceOp",
    "InputContext",
    "ReplicaContext",
    "Comm",
    "get_strategy",
    "get_replica_context",
    "has_strategy",
    "from_name",
    "from_env",
    "strategy_names",
    "launch",
    "PREEMPTED_EXIT_CODE",
    "StratagemError",
    "ReplicaMismatchError",
    "WorkerError",
    "PeerTimeoutError",
    "ParameterServerUnavailable",
    "CheckpointError",
]

# Load on first use: the strategies of the registry's table (one table for sg.<Class> and
# sg.from_name; a strategy whose module is not installed is simply absent) and helpers whose
# modules pull in heavier dependencies (gRPC).
_LAZY: dict[str, tuple[str, str]] = {
    **_lazy_exports(),
    "FixedShardsPartitioner": ("stratagem.ps.placement", "FixedShardsPartitioner"),
    "MinSizePartitioner": ("stratagem.ps.placement", "MinSizePartitioner"),
    "MaxSizePartitioner": ("stratagem.ps.placement", "MaxSizePartitioner"),
    "launch": ("stratagem.launcher", "launch"),
}
__all__ += [name for name in _LAZY if name not in __all__]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    from .registry import STRATEGIES

    for entry in STRATEGIES:
        if entry.public == name:  # in the table, but its module is not installed (yet)
            raise AttributeError(f"module 'stratagem' has no attribute {name!r}: the strategy is "
                                 f"registered but {entry.module} is not installed in this "
                                 "version of stratagem")
    raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
