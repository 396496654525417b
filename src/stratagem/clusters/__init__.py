"""Where a job runs, read from the environment its cluster's launcher set: one small reader
per launcher (:mod:`.torchrun`, :mod:`.kubeflow`, :mod:`.skypilot`, :mod:`.slurm`), each
tested alone, and the precedence between them here.

Two questions, two functions:

- :func:`resolve_node`: a launcher that runs once per node (``stratagem run`` without
  rendezvous flags under ``srun``, in a Kubeflow ``TrainJob`` pod, on a SkyPilot node) asks
  how many nodes, which one it is, and where node 0's rendezvous store is;
- :func:`adopt_tasks`: a process the cluster started itself, one per worker (``srun python
  train.py``), asks its rank and world; the answer is written as torchrun's variables
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so everything downstream reads one shape.

Precedence, highest first: explicit flags; torchrun's ``MASTER_ADDR`` / ``MASTER_PORT`` (and,
for a process, ``RANK`` / ``WORLD_SIZE``: ``srun torchrun`` sets both on purpose); Kubeflow's
``PET_*`` and SkyPilot's ``SKYPILOT_*``; Slurm's ``SLURM_*``. A value is taken from the
highest level that has it; two sources of one level that disagree are an error naming both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from stratagem.clusters import kubeflow, skypilot, slurm, torchrun
from stratagem.clusters.base import ClusterEnvError, NodePlacement, TaskPlacement

__all__ = ["ClusterEnvError", "NodePlacement", "TaskPlacement", "ResolvedNode",
           "resolve_node", "adopt_tasks", "SOURCE_ENV"]

#: Set by :func:`adopt_tasks` to the cluster's name when it derived the rendezvous port
#: from the cluster's job id (so a taken port can be named, with the variable that
#: overrides it); absent when ``MASTER_PORT`` was given.
SOURCE_ENV = "STRATAGEM_CLUSTER_SOURCE"

_Reader = Callable[[Mapping[str, str]], "NodePlacement | None"]
#: The node readers by precedence level (the flags are level 0, handled by the caller).
NODE_LEVELS: tuple[tuple[_Reader, ...], ...] = (
    (torchrun.node,),
    (kubeflow.node, skypilot.node),
    (slurm.node,),
)
_FIELDS = ("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node")


@dataclass
class ResolvedNode:
    """A node's place: each field's value and the source it came from (``"flag"``, or a
    reader's name)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)

    def from_environment(self) -> dict[str, str]:
        """The fields found in the environment (not given as flags), by name -> source."""
        return {k: v for k, v in self.sources.items() if v != "flag"}


def resolve_node(env: Mapping[str, str] | None = None, **flags: object) -> ResolvedNode:
    """The node's place from ``flags`` (``nnodes``, ``node_rank``, ``master_addr``,
    ``master_port``, ``nproc_per_node``; None: not given) and then the environment, by the
    precedence above. :class:`ClusterEnvError` when two sources of one level disagree."""
    env = os.environ if env is None else env
    unknown = set(flags) - set(_FIELDS)
    if unknown:
        raise TypeError(f"resolve_node() got unknown fields {sorted(unknown)}")
    out = ResolvedNode()
    for name in _FIELDS:
        value = flags.get(name)
        if value is not None:
            setattr(out, name, value)
            out.sources[name] = "flag"
    levels = [[p for p in (reader(env) for reader in level) if p is not None]
              for level in NODE_LEVELS]
    for name in _FIELDS:
        if name in out.sources:
            continue
        for placements in levels:
            found = [(getattr(p, name), p) for p in placements if getattr(p, name) is not None]
            if not found:
                continue
            (value, first), *others = found
            for other_value, other in others:
                if other_value != value:
                    raise ClusterEnvError(
                        f"two launchers' variables disagree on {name}: {first.source} says "
                        f"{value!r}, {other.source} says {other_value!r}. Fix: unset the "
                        f"variables of the launcher that did not start this job, or pass "
                        f"--{name.replace('_', '-').replace('-per-node', '')} explicitly")
            setattr(out, name, value)
            out.sources[name] = first.source
            if first.how:
                out.how[name] = first.how
            break
    return out


def adopt_tasks(environ: MutableMapping[str, str] | None = None) -> TaskPlacement | None:
    """In a process the cluster started as one of many workers (``srun python train.py``),
    write torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) from its cluster's, and return where it is. None (and nothing written)
    when a torchrun-style launcher already set them, or no cluster started several workers.
    ``MASTER_ADDR`` / ``MASTER_PORT`` already set are kept (they rank above the cluster's)."""
    environ = os.environ if environ is None else environ
    if torchrun.launched(environ):
        return None
    place = slurm.tasks(environ)
    if place is None:
        return None
    given = environ.get("MASTER_PORT")
    port = given or (str(place.master_port) if place.master_port is not None else None)
    if not port:
        raise ClusterEnvError(f"{place.source} started {place.world_size} workers but no "
                              "rendezvous port is known (no SLURM_JOB_ID). Fix: export "
                              "MASTER_PORT=<a free port on the first node>")
    lws = place.local_world_size
    uniform = place.world_size % lws == 0 and place.rank // lws == place.node_rank
    environ.update({
        "RANK": str(place.rank), "WORLD_SIZE": str(place.world_size),
        "LOCAL_RANK": str(place.local_rank), "GROUP_RANK": str(place.node_rank),
        "GROUP_WORLD_SIZE": str(place.nnodes), "MASTER_PORT": port,
    })
    if not given:
        environ[SOURCE_ENV] = place.source
    environ.setdefault("MASTER_ADDR", place.master_addr)
    if uniform:
        environ["LOCAL_WORLD_SIZE"] = str(lws)
    return place

