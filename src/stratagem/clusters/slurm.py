"""Slurm's environment: where a job step runs, read from the variables ``srun`` sets.

Two shapes of job are read here:

- one launcher per node, ``srun --ntasks-per-node=1 stratagem run ...`` (:func:`node`): the
  nodes, this node's rank, and the rendezvous address (the first host of the step's node list)
  and port (derived from ``SLURM_JOB_ID``);
- one task per process, ``srun python train.py`` (:func:`tasks`): each task's rank, local
  rank and the world, as torchrun would have set them.

Only a job *step* (``srun``) is read: a batch script's own shell (``sbatch``, no ``srun``)
sees the allocation's ``SLURM_NTASKS`` and ``SLURM_NNODES`` but runs once, on the first node,
and taking those as the world would make it wait for peers that never start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from stratagem.clusters.base import ClusterEnvError, NodePlacement, TaskPlacement, env_int

__all__ = ["node", "tasks", "first_host", "expand_nodelist", "tasks_per_node", "derived_port",
           "PORT_BASE", "PORT_SPAN"]

#: The rendezvous port a Slurm job uses unless ``MASTER_PORT`` is set: ``PORT_BASE +
#: SLURM_JOB_ID % PORT_SPAN``, below Linux's ephemeral range (32768-60999), so two jobs that
#: share a node get different ports unless their ids differ by a multiple of PORT_SPAN.
PORT_BASE = 20000
PORT_SPAN = 10000
#: The most hosts :func:`expand_nodelist` writes out (a node list is a compact range notation:
#: ``n[1-1000000]`` is a few bytes).
MAX_HOSTS = 65536

_GROUP = re.compile(r"\[([^\]]*)\]")


def _bound(count: int, nodelist: str) -> None:
    if count > MAX_HOSTS:
        raise ClusterEnvError(f"SLURM node list {nodelist!r} names more than {MAX_HOSTS} "
                              "hosts")


def _split_top(nodelist: str) -> list[str]:
    """``nodelist`` cut at the commas outside brackets: ``a[1,3],b2`` -> ``a[1,3]``, ``b2``."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ClusterEnvError(f"SLURM node list {nodelist!r} has an unmatched ']'")
        elif ch == "," and depth == 0:
            out.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ClusterEnvError(f"SLURM node list {nodelist!r} has an unmatched '['")
    out.append(nodelist[start:])
    return [p for p in (s.strip() for s in out) if p]


def _range_items(spec: str, nodelist: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07`` (zero padding kept, as Slurm writes it)."""
    items: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ClusterEnvError(f"SLURM node list {nodelist!r}: {part!r} is not a number or "
                                  "a range of numbers (e.g. 01-03)")
        if not sep:
            items.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise ClusterEnvError(f"SLURM node list {nodelist!r}: range {part!r} runs backwards")
        _bound(len(items) + b - a + 1, nodelist)
        width = len(lo)
        items += [str(i).zfill(width) for i in range(a, b + 1)]
    return items


def _expand_one(item: str, nodelist: str) -> list[str]:
    """One top-level item: ``rack[1-2]-n[01-02]`` -> every combination, in Slurm's order."""
    hosts = [""]
    pos = 0
    for m in _GROUP.finditer(item):
        literal = item[pos:m.start()]
        hosts = [h + literal + x for h in hosts for x in _range_items(m.group(1), nodelist)]
        _bound(len(hosts), nodelist)
        pos = m.end()
    return [h + item[pos:] for h in hosts]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm node list, in order: ``node[01-03,07],gpu5`` -> ``node01 node02
    node03 node07 gpu5``. :class:`ClusterEnvError` for a malformed list or more than
    :data:`MAX_HOSTS` hosts."""
    hosts: list[str] = []
    for item in _split_top(nodelist):
        hosts += _expand_one(item, nodelist)
        _bound(len(hosts), nodelist)
    if not hosts:
        raise ClusterEnvError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (the rendezvous host), without writing out the
    rest: ``node[07-09]`` -> ``node07``."""
    items = _split_top(nodelist)
    if not items:
        raise ClusterEnvError(f"SLURM node list {nodelist!r} names no host")
    item, out, pos = items[0], "", 0
    for m in _GROUP.finditer(item):
        first = m.group(1).split(",")[0].strip().partition("-")[0]
        _range_items(first, nodelist)  # checked: digits
        out += item[pos:m.start()] + first
        pos = m.end()
    return out + item[pos:]


def tasks_per_node(value: str, nnodes: int, what: str) -> list[int]:
    """Slurm's tasks-per-node notation, one count per node: ``2(x3),1`` -> ``2 2 2 1``."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ClusterEnvError(f"{what}={value!r} is not Slurm's tasks-per-node notation "
                                  "(e.g. 2(x3),1)")
        times = int(m.group(2) or 1)
        if len(counts) + times > MAX_HOSTS:
            raise ClusterEnvError(f"{what}={value!r} counts more than {MAX_HOSTS} nodes")
        counts += [int(m.group(1))] * times
    if len(counts) != nnodes:
        raise ClusterEnvError(f"{what}={value!r} gives {len(counts)} nodes, the step has "
                              f"{nnodes}")
    return counts


def derived_port(env: Mapping[str, str]) -> int | None:
    """The rendezvous port of this job (see :data:`PORT_BASE`), or None without a job id."""
    job = env_int(env, "SLURM_JOB_ID", minimum=0)
    return None if job is None else PORT_BASE + job % PORT_SPAN


def _in_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a job step (``srun``), not a batch script's shell."""
    return bool(env.get("SLURM_JOB_ID")) and env.get("SLURM_PROCID") is not None and (
        env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEPID") is not None)


def _step_nodes(env: Mapping[str, str]) -> tuple[int, str]:
    nnodes = env_int(env, "SLURM_STEP_NUM_NODES", minimum=1)
    if nnodes is None:
        nnodes = env_int(env, "SLURM_NNODES", minimum=1) or 1
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    return nnodes, nodelist


def _master(env: Mapping[str, str], nodelist: str) -> tuple[str, int | None, str]:
    if not nodelist:
        raise ClusterEnvError("SLURM_JOB_NODELIST is not set, so the rendezvous host is "
                              "unknown. Fix: set MASTER_ADDR to the first node's address")
    port = derived_port(env)
    how = (f"first host of {nodelist!r}, port {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}"
           if port is not None else f"first host of {nodelist!r}")
    return first_host(nodelist), port, how


def node(env: Mapping[str, str]) -> NodePlacement | None:
    """This node's place when ``stratagem run`` is a Slurm task, one per node; None outside a
    job step. :class:`ClusterEnvError` when the step runs several launchers on one node."""
    if not _in_step(env):
        return None
    nnodes, nodelist = _step_nodes(env)
    ntasks = env_int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
    if ntasks is None:
        ntasks = env_int(env, "SLURM_NTASKS", minimum=1) or 1
    if ntasks != nnodes:
        raise ClusterEnvError(
            f"Slurm started {ntasks} tasks on {nnodes} node(s) (SLURM_STEP_NUM_TASKS / "
            f"SLURM_NTASKS={ntasks}, SLURM_STEP_NUM_NODES / SLURM_NNODES={nnodes}); `stratagem "
            "run` is one launcher per node that starts the node's workers itself. Fix: srun "
            "--ntasks-per-node=1 stratagem run --nproc N ..., or run the script as one task "
            "per process without stratagem run: srun python train.py")
    node_rank = env_int(env, "SLURM_NODEID", minimum=0)
    if node_rank is None or node_rank >= nnodes:
        raise ClusterEnvError(f"SLURM_NODEID={env.get('SLURM_NODEID')!r} is not a node rank "
                              f"below SLURM_NNODES={nnodes}")
    if nnodes == 1:
        return NodePlacement("Slurm", nnodes=1, node_rank=0)
    host, port, how = _master(env, nodelist)
    return NodePlacement("Slurm", nnodes=nnodes, node_rank=node_rank, master_addr=host,
                         master_port=port, how=how)


def tasks(env: Mapping[str, str]) -> TaskPlacement | None:
    """This process's place when Slurm started every process (``srun python train.py``);
    None outside a job step or in a step of one task."""
    if not _in_step(env):
        return None
    world = env_int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
    if world is None:
        world = env_int(env, "SLURM_NTASKS", minimum=1) or 1
    if world <= 1:
        return None
    rank = env_int(env, "SLURM_PROCID", minimum=0)
    local_rank = env_int(env, "SLURM_LOCALID", minimum=0)
    node_rank = env_int(env, "SLURM_NODEID", minimum=0)
    if rank is None or local_rank is None or node_rank is None or rank >= world:
        raise ClusterEnvError(
            f"Slurm step of {world} tasks with SLURM_PROCID={env.get('SLURM_PROCID')!r}, "
            f"SLURM_LOCALID={env.get('SLURM_LOCALID')!r}, SLURM_NODEID="
            f"{env.get('SLURM_NODEID')!r}: each must be an int, the rank below {world}")
    nnodes, nodelist = _step_nodes(env)
    per_node_raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_raw:
        per_node = tasks_per_node(per_node_raw, nnodes, "SLURM_STEP_TASKS_PER_NODE")
    elif world % nnodes == 0:
        per_node = [world // nnodes] * nnodes
    else:
        raise ClusterEnvError(f"a Slurm step of {world} tasks on {nnodes} nodes without "
                              "SLURM_STEP_TASKS_PER_NODE: tasks per node unknown")
    if node_rank >= nnodes or sum(per_node) != world:
        raise ClusterEnvError(f"Slurm step: SLURM_NODEID={node_rank}, {nnodes} nodes and "
                              f"tasks per node {per_node} do not add up to {world} tasks")
    host, port, how = (("127.0.0.1", derived_port(env), "one node: loopback")
                       if nnodes == 1 else _master(env, nodelist))
    return TaskPlacement("Slurm", rank=rank, world_size=world, local_rank=local_rank,
                         local_world_size=per_node[node_rank], node_rank=node_rank,
                         nnodes=nnodes, master_addr=host, master_port=port, how=how)
