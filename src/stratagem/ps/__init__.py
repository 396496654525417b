"""Parameter-server runtime over gRPC: wire format, shard server and update rules, transport,
sharded table, placement.

Downpour SGD (Dean et al. 2012) and TensorFlow's ps/worker jobs (``SyncReplicasOptimizer``,
``DropStaleGradientOptimizer``, the tf_cnn_benchmarks variable manager), plus the asynchronous
EASGD elastic exchange (Zhang, Choromanska, LeCun 2015). Strategies use
:class:`ShardedParameters`; launchers use :func:`serve` or ``python -m stratagem.ps.server``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy exports (PEP 562): ``python -m stratagem.ps.server`` must not find the server module
# already imported by its package, and placement users need not load grpc.
_EXPORTS = {
    "PSClient": "transport", "PSFuture": "transport", "RemoteError": "transport",
    "PushOutcome": "table", "ShardedParameters": "table", "PSLink": "link",
    "ShardServer": "server", "serve": "server", "start_local_shards": "server",
    "optimizer_spec": "optim",
    "FixedShardsPartitioner": "placement", "MinSizePartitioner": "placement",
    "MaxSizePartitioner": "placement", "Placement": "placement", "greedy": "placement",
    "round_robin": "placement",
    "WireError": "wire",
}

__all__ = [
    "PSClient",
    "PSFuture",
    "PushOutcome",
    "RemoteError",
    "ShardedParameters",
    "PSLink",
    "ShardServer",
    "serve",
    "start_local_shards",
    "optimizer_spec",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "Placement",
    "greedy",
    "round_robin",
    "WireError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stratagem.ps' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stratagem.ps.{module}"), name)
