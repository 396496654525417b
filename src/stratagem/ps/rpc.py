"""gRPC as the parameter-server runtime imports it: with gRPC core's receive tuning turned on.

A real link paces a big message: it arrives a few packets at a time. By default gRPC core wakes
up and reads on every arrival, so on a 100 Mbit/s link a 1 MB push costs the receiving process
hundreds of wake-ups (softirq, context switches, the poller thread waking the event loop). Two
gRPC core experiments fix this together: ``tcp_frame_size_tuning`` lets the HTTP/2 transport tell
the TCP endpoint how many bytes the frame it is reading still needs, and ``tcp_rcv_lowat`` sets
``SO_RCVLOWAT`` to that, so the kernel wakes gRPC once per chunk instead of once per packet.

Measured (4 workers on 100 Mbit/s links pushing and fetching a 1 MB MLP to one shard): the shard's
CPU per worker step fell by about a fifth to a third and the workers' by a sixth to a half; see
``docs/status.md`` for the figures and command. On loopback a message arrives in bulk, so
there is little to gain (not measured side by side).

gRPC reads ``GRPC_EXPERIMENTS`` once, when it is first imported, so this module sets it only
around that import and removes it again: the process environment is unchanged afterwards and
children are not affected. It does nothing when the variable is already set (set it, even to an
empty string, to choose yourself) or when something imported gRPC before stratagem did.

Experiments come and go between gRPC releases, and gRPC logs an error line in every process for a
name it does not know. So the tuning is turned on only for the releases in which both names were
checked to exist (``TESTED_GRPCIO``: 1.60, 1.66, 1.72 and 1.85 were tried); any other release
runs with gRPC's own defaults, which work, only with more wake-ups on slow links.

Every stratagem module that needs gRPC imports it from here (``from stratagem.ps.rpc import
grpc``).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

#: The gRPC core experiments turned on (see the module docstring).
EXPERIMENTS = "tcp_frame_size_tuning,tcp_rcv_lowat"

#: The grpcio releases (major, minor), inclusive, known to have both experiments.
TESTED_GRPCIO = ((1, 60), (1, 85))


def grpcio_release(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of the installed grpcio (or of ``version``), read from its metadata
    without importing it; None when it cannot be told."""
    if version is None:
        try:
            version = importlib.metadata.version("grpcio")
        except importlib.metadata.PackageNotFoundError:
            return None
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def is_tested_release(release: tuple[int, int] | None) -> bool:
    """Whether ``release`` (from :func:`grpcio_release`) is in ``TESTED_GRPCIO``."""
    return release is not None and TESTED_GRPCIO[0] <= release <= TESTED_GRPCIO[1]


_TUNE = ("grpc" not in sys.modules and "GRPC_EXPERIMENTS" not in os.environ
         and is_tested_release(grpcio_release()))
if _TUNE:
    os.environ["GRPC_EXPERIMENTS"] = EXPERIMENTS
try:
    import grpc
    import grpc.aio
finally:
    if _TUNE:
        os.environ.pop("GRPC_EXPERIMENTS", None)

#: Whether this import turned the experiments on (False: gRPC was imported earlier, the user
#: set ``GRPC_EXPERIMENTS``, or the installed grpcio is outside ``TESTED_GRPCIO``).
TUNED = _TUNE

__all__ = ["EXPERIMENTS", "TESTED_GRPCIO", "TUNED", "grpc", "grpcio_release", "is_tested_release"]
