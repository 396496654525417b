"""stratagem: distribution strategies for PyTorch.

``import stratagem as sg``; pick a strategy (``sg.Mirrored()``, ``sg.ParameterServer()``,
``sg.ElasticAveraging()``, ``sg.LocalSGD()``, ``sg.DiLoCo()``, ``sg.OneDevice()``), then
``scope`` / ``prepare`` / ``distribute_dataset`` / ``backward`` / ``optimizer.step()``.
Importing has no side effects.
"""

from __future__ import annotations

from typing import Any

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
from .strategies.mirrored import Mirrored
from .strategies.one_device import OneDevice
from .strategy import ReduceOp, Strategy

__version__ = "0.1.0"

__all__ = [
    "Strategy",
    "OneDevice",
    "Mirrored",
    "ParameterServer",
    "ElasticAveraging",
    "LocalSGD",
    "DiLoCo",
    "Hierarchical",
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

# Strategies and helpers whose modules pull in heavier dependencies (gRPC) load on first use.
_LAZY = {
    "ParameterServer": ("stratagem.strategies.parameter_server", "ParameterServer"),
    "ElasticAveraging": ("stratagem.strategies.elastic_average", "ElasticAveraging"),
    "LocalSGD": ("stratagem.strategies.local_sgd", "LocalSGD"),
    "DiLoCo": ("stratagem.strategies.local_sgd", "DiLoCo"),
    "Hierarchical": ("stratagem.strategies.hierarchical", "Hierarchical"),
    "FixedShardsPartitioner": ("stratagem.ps.placement", "FixedShardsPartitioner"),
    "MinSizePartitioner": ("stratagem.ps.placement", "MinSizePartitioner"),
    "MaxSizePartitioner": ("stratagem.ps.placement", "MaxSizePartitioner"),
    "launch": ("stratagem.launcher", "launch"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stratagem' has no attribute {name!r}")
