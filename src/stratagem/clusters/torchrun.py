"""torchrun's variables as a user (or ``srun torchrun``) sets them for a launcher:
``MASTER_ADDR`` and ``MASTER_PORT``. (``RANK`` and ``WORLD_SIZE`` describe one worker
process, not a node: a launcher does not read them.)"""

from __future__ import annotations

from collections.abc import Mapping

from stratagem.clusters.base import NodePlacement, env_int

__all__ = ["node", "launched"]


def node(env: Mapping[str, str]) -> NodePlacement | None:
    addr = env.get("MASTER_ADDR") or None
    port = env_int(env, "MASTER_PORT", minimum=1)
    if addr is None and port is None:
        return None
    return NodePlacement("MASTER_ADDR / MASTER_PORT", master_addr=addr, master_port=port,
                         how="MASTER_ADDR / MASTER_PORT")


def launched(env: Mapping[str, str]) -> bool:
    """Whether a torchrun-style launcher (torchrun, ``stratagem run``, ``sg.launch``) started
    this process: it set ``RANK`` and ``WORLD_SIZE``."""
    return bool(env.get("RANK", "").strip()) and bool(env.get("WORLD_SIZE", "").strip())
