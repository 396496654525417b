"""The worker side's former single module, kept so that existing imports keep working.

The transport (gRPC channels, calls, errors) is :mod:`stratagem.ps.transport`; the sharded
table (placement, pushes, pulls, versions) is :mod:`stratagem.ps.table`. New code imports
from those, or from :mod:`stratagem.ps`.
"""

from __future__ import annotations

from stratagem.ps.table import PushFetch, PushOutcome, ShardedParameters
from stratagem.ps.transport import PSClient, PSFuture, RemoteError

__all__ = ["PSClient", "PSFuture", "ShardedParameters", "PushOutcome", "PushFetch",
           "RemoteError"]
