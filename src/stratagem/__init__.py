"""stratagem: distribution strategies for PyTorch.

``import stratagem as sg``; pick a strategy (``sg.Mirrored()``, ``sg.ParameterServer()``,
``sg.ElasticAveraging()``, ``sg.LocalSGD()``, ``sg.DiLoCo()``, ``sg.OneDevice()``), then
``scope`` / ``prepare`` / ``distribute_dataset`` / ``backward`` / ``optimizer.step()``.
Importing has no side effects, and does not import torch: every name that needs it is
loaded on first use (so ``stratagem run`` can refuse a misspelt argument before torch's ~2 s
import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .context import InputContext, ReplicaContext, get_replica_context, get_strategy, has_strategy
from .errors import (
    CheckpointError,
    ParameterServerUnavailable,
    PeerTimeoutError,
    ReplicaMismatchError,
    StratagemError,
    WorkerError,
)
from .registry import from_env, from_name, strategy_names
from .registry import lazy_exports as _lazy_exports

if TYPE_CHECKING:  # loaded on first use (torch), see _LAZY
    from .comm import Comm
    from .preemption import PREEMPTED_EXIT_CODE
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
    "Comm": ("stratagem.comm", "Comm"),
    "Strategy": ("stratagem.strategy", "Strategy"),
    "ReduceOp": ("stratagem.strategy", "ReduceOp"),
    "PREEMPTED_EXIT_CODE": ("stratagem.preemption", "PREEMPTED_EXIT_CODE"),
}
# Submodules that ``import stratagem`` used to import eagerly: ``sg.checkpoint.read_extras``
# keeps working without an explicit ``import stratagem.checkpoint``.
_SUBMODULES = frozenset({"checkpoint", "fit", "comm", "strategy", "preemption", "strategies",
                         "data", "parts", "precision"})
__all__ += [name for name in _LAZY if name not in __all__]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    from .registry import STRATEGIES

    for entry in STRATEGIES:
        if entry.public == name:  # in the table, but its module is not installed (yet)
            raise AttributeError(f"module 'stratagem' has no attribute {name!r}: the strategy is "
                                 f"registered but {entry.module} is not installed in this "
                                 "version of stratagem")
    raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
