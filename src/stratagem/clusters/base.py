"""What a cluster's environment says about where a process runs, whoever launched it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stratagem.errors import StratagemError

__all__ = ["ClusterEnvError", "NodePlacement", "TaskPlacement", "env_int"]


class ClusterEnvError(StratagemError, ValueError):
    """The environment a cluster set is malformed or contradicts itself; the message names
    the variables, their values and the fix."""


@dataclass(frozen=True)
class NodePlacement:
    """One node of a job, as a launcher that runs once per node needs it (``stratagem run``):
    any field may be unknown (None) to this source."""

    source: str
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    #: How the address and port were found, for the one line the launcher prints.
    how: str = ""


@dataclass(frozen=True)
class TaskPlacement:
    """One process of a job whose launcher started every process itself (``srun python
    train.py``): what torchrun would have set for it."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int | None
    how: str = ""


def env_int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    """``env[name]`` as an int >= ``minimum``; None when unset or empty;
    :class:`ClusterEnvError` naming the variable otherwise."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < minimum:
        raise ClusterEnvError(f"{name}={raw!r} must be an integer >= {minimum}; it is set by "
                              "the cluster's launcher (or by you): fix or unset it")
    return int(text)
