"""``Hierarchical``: synchronous training inside a node, communication-efficient averaging
across nodes.

How DiLoCo and local SGD are deployed in practice: the processes of a node (a rack, an island
of GPUs) train synchronously over fast local links, and the nodes meet every ``period`` steps
over slow links — the DiLoCo paper's islands (Douillard et al. 2023), torchft's HSDP inside a
replica group with DiLoCo across groups, Lin et al.'s hierarchical local SGD (ICLR 2020).

Assembled from parts: the ``inner`` strategy's parts over a Comm of the node's processes,
then the ``outer`` strategy's parts over a Comm across nodes. When the inner strategy keeps a
whole, identical model on every process of a node (``OneDevice``, ``Mirrored``), the
cross-node Comm is a :class:`~stratagem.comm.RelayComm`: each outer all-reduce is split into
one chunk per local rank, each chunk all-reduced with the same local rank of the other nodes,
then all-gathered inside the node — one copy of the model crosses per node instead of one
per process, spread over all of the node's links. A sharded inner strategy synchronises each
shard with its peers (the processes with the same local rank) directly.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..parts import NodePlan, Plan
from ..registry import from_name
from ..strategy import Strategy
from ..validation import check_int

__all__ = ["Hierarchical"]

#: Keyword prefixes routed to the inner / outer strategy (``outer_period=50``), so that
#: ``stratagem run --strategy-arg outer_period=50`` can configure them.
_PREFIXES = ("inner_", "outer_")


def _build(spec: Strategy | str, role: str, args: dict[str, Any]) -> Strategy:
    if isinstance(spec, str):
        with warnings.catch_warnings():
            # OneDevice warns when built in a launched process; as an inner strategy it is
            # configuration only and never joins anything.
            warnings.simplefilter("ignore", RuntimeWarning)
            strategy = from_name(spec, **args)
    elif isinstance(spec, Strategy):
        if args:
            raise ValueError(f"{role}_* arguments ({', '.join(sorted(args))}) configure a "
                             f"{role} strategy given by name, but {role} is already a "
                             f"{type(spec).__name__} instance. Fix: pass those arguments to it")
        strategy = spec
    else:
        raise TypeError(f"{role} must be a Strategy or a strategy name, got "
                        f"{type(spec).__name__}. Fix: e.g. {role}=sg.Mirrored() or "
                        f"{role}='mirrored'")
    if role not in strategy.layer_plan().roles:
        allowed = ("OneDevice, Mirrored, Sharded" if role == "inner"
                   else "DiLoCo, LocalSGD, ElasticAveraging(mode='sync')")
        raise ValueError(f"{type(strategy).__name__} cannot be Hierarchical's {role} strategy; "
                         f"{role} may be: {allowed}. Fix: e.g. Hierarchical(inner=sg.Mirrored(),"
                         " outer=sg.DiLoCo(period=100))")
    return strategy


class Hierarchical(Strategy):
    """``inner`` synchronises the processes of a node every step; ``outer`` synchronises the
    nodes (``sg.Hierarchical(inner=sg.Mirrored(), outer=sg.DiLoCo(period=100))``).

    Arguments: ``inner`` (``OneDevice``, ``Mirrored``, ``Sharded``, or a name; default
    "mirrored"),
    ``outer`` (``DiLoCo``, ``LocalSGD``, ``ElasticAveraging(mode="sync")`` without ``rho`` /
    ``momentum``, or a name; default "diloco"), ``local_world_size``
    (processes per node; default torchrun's ``LOCAL_WORLD_SIZE``, which ``sg.launch(...,
    nnodes=K)`` and ``stratagem run --nnodes`` set), keywords prefixed ``inner_`` / ``outer_``
    (passed to a strategy given by name: ``outer_period=50``), plus the common strategy
    arguments, which are Hierarchical's own (those of ``inner`` / ``outer`` instances are not
    used: precision, accumulation, timeout and device apply to the whole job).

    ``num_replicas_in_sync`` and ``replica_id`` count every process of the job (each reads its
    own data shard). The checkpointed and evaluated model is the outer strategy's consensus
    (DiLoCo's outer parameters, LocalSGD's average), so checkpoints move freely between
    ``Hierarchical`` and flat strategies of any size. ``metrics()`` splits the bytes into
    ``intra_node_bytes_sent`` and ``inter_node_bytes_sent``.

    On failure: a dead or stalled process makes the inner gradient all-reduce (same node) or
    the outer all-reduce (another node) fail within ``timeout``; the step raises
    ``PeerTimeoutError`` naming the peer by its rank in that group. Resume from the last
    checkpoint. Memory: the inner strategy's plus the outer strategy's (DiLoCo: two copies of
    the parameters), plus a transient chunk of ``1/local_world_size`` of the model per outer
    all-reduce.
    """

    name = "hierarchical"
    #: Keys with these prefixes go to the strategy named by ``inner`` / ``outer``: what
    #: ``sg.from_name`` checks them against (stratagem._argnames).
    _argument_prefixes = _PREFIXES

    def __init__(self, *, inner: Strategy | str = "mirrored", outer: Strategy | str = "diloco",
                 local_world_size: int | None = None, **kwargs: Any) -> None:
        routed: dict[str, dict[str, Any]] = {"inner": {}, "outer": {}}
        common: dict[str, Any] = {}
        for key, value in kwargs.items():
            prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
            if prefix is None:
                common[key] = value
            else:
                routed[prefix[:-1]][key[len(prefix):]] = value
        if local_world_size is not None:
            check_int("local_world_size", local_world_size, minimum=1,
                      fix="pass the number of processes per node, or omit it to use "
                          "LOCAL_WORLD_SIZE")
        self.inner = _build(inner, "inner", routed["inner"])
        self.outer = _build(outer, "outer", routed["outer"])
        self.local_world_size = local_world_size
        super().__init__(**common)

    def plan(self) -> Plan:
        """The inner strategy's parts on each node's Comm, the outer strategy's across nodes
        (under fault tolerance: a node is one replica group)."""
        return NodePlan(self.inner.layer_plan(), self.outer.layer_plan(),
                        local_world_size=self.local_world_size,
                        inner_name=f"inner={type(self.inner).__name__}")

    def __repr__(self) -> str:
        return (f"Hierarchical(inner={type(self.inner).__name__}, outer="
                f"{type(self.outer).__name__}, replica {self.replica_id}/"
                f"{self.num_replicas_in_sync})")
