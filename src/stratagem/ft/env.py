"""The environment a fault-tolerant worker is launched with (no torchft import here).

``stratagem run --fault-tolerant`` and ``sg.launch(..., fault_tolerant=True)`` start the
quorum service and give every worker these variables; a strategy built with
``fault_tolerant=None`` (the default) turns fault tolerance on when they are set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["LIGHTHOUSE_ENV", "SLOT_ENV", "SLOTS_ENV", "MIN_REPLICAS_ENV", "TOKEN_FILE_ENV",
           "HOST_ENV", "GROUP_RANK_ENV", "GROUP_SIZE_ENV", "launched_fault_tolerant"]

#: The quorum service (torchft Lighthouse) address, ``http://host:port``.
LIGHTHOUSE_ENV = "STRATAGEM_FT_LIGHTHOUSE"
#: This worker's replica (group): its fixed place in the job (a restarted worker gets its
#: old slot).
SLOT_ENV = "STRATAGEM_FT_SLOT"
#: How many replicas (groups) the job was launched with.
SLOTS_ENV = "STRATAGEM_FT_SLOTS"
#: This worker's place in its replica group, and the group's size (``sg.launch(...,
#: nnodes=K, fault_tolerant=True)``: a node of ``Hierarchical`` is a replica group; unset:
#: one process per replica).
GROUP_RANK_ENV = "STRATAGEM_FT_GROUP_RANK"
GROUP_SIZE_ENV = "STRATAGEM_FT_GROUP_SIZE"
#: The fewest replicas training continues with.
MIN_REPLICAS_ENV = "STRATAGEM_FT_MIN_REPLICAS"
#: A file (mode 0600) holding the job's secret for the heal transport.
TOKEN_FILE_ENV = "STRATAGEM_FT_TOKEN_FILE"
#: The address this worker's servers (manager, heal, store) listen on: loopback on one node.
HOST_ENV = "STRATAGEM_FT_HOST"


def launched_fault_tolerant(env: Mapping[str, str] | None = None) -> bool:
    """True in a worker started by a fault-tolerant launcher."""
    return bool((os.environ if env is None else env).get(LIGHTHOUSE_ENV))
