"""A strategy's declaration of what it is made of: :class:`Plan` (its parts, in order, on
the strategy's Comm) and :class:`NodePlan` (``Hierarchical``: an inner plan on each node's
Comm, an outer plan across nodes).

The capabilities of a strategy are those of its parts (:class:`~stratagem.parts.base.
Capability`), read off the plan before any Comm exists, so a constructor can refuse what
the parts cannot do (``fault_tolerant=True``, ``keep_global_batch=True``) at once.
"""

from __future__ import annotations

from typing import Any

from ..comm import Comm
from .base import Capability, Part, PartSpec

__all__ = ["Plan", "NodePlan"]


class Plan:
    """The parts of a strategy, in the order their hooks run, all over the strategy's Comm."""

    def __init__(self, *specs: PartSpec) -> None:
        for spec in specs:
            if not isinstance(spec, PartSpec):
                raise TypeError(f"Plan takes part specs (SomePart.spec(**config)), got "
                                f"{type(spec).__name__}. Fix: e.g. Plan(GradientSync.spec())")
        self.specs = tuple(specs)

    # ------------------------------------------------------------------ capabilities
    def has(self, capability: str) -> bool:
        """True when any part brings ``capability``."""
        return any(capability in s.capabilities for s in self.specs)

    def all(self, capability: str) -> bool:
        """True when there are parts and every one brings ``capability``."""
        return bool(self.specs) and all(capability in s.capabilities for s in self.specs)

    @property
    def fault_tolerant(self) -> bool:
        """Every part on the fault-tolerant Comm commits through its transactions."""
        return self.all(Capability.TRANSACTIONS)

    @property
    def keeps_global_batch(self) -> bool:
        return self.all(Capability.KEEPS_GLOBAL_BATCH)

    @property
    def replica_groups(self) -> bool:
        """True when the plan runs on fault-tolerant replica groups of several processes."""
        return False

    @property
    def roles(self) -> tuple[str, ...]:
        """Where ``Hierarchical`` accepts a strategy of this plan: "inner" (no parts, or parts
        that synchronise a node every step), "outer" (parts that synchronise across nodes)."""
        out = []
        if all(Capability.INNER in s.capabilities for s in self.specs):
            out.append(Capability.INNER)
        if self.all(Capability.OUTER):
            out.append(Capability.OUTER)
        return tuple(out)

    # ------------------------------------------------------------------ building
    def build(self, comm: Comm) -> list[Part]:
        """The parts over ``comm`` (called once, when the strategy first needs them)."""
        return [spec.build(comm) for spec in self.specs]

    def metrics(self, comm: Comm) -> dict[str, Any]:
        """Counters of the Comms the plan made itself beside ``comm`` (none for a flat
        plan)."""
        return {}


class NodePlan(Plan):
    """``inner``'s parts over the processes of a node, then ``outer``'s across nodes.

    When the inner plan keeps a whole, identical model on every process of a node, the
    cross-node Comm is a :class:`~stratagem.comm.RelayComm` (one copy of the model crosses
    per node, spread over its processes); a sharded inner plan synchronises each shard with
    its peers (the processes with the same local rank) directly. Under fault tolerance a
    node is one replica group.
    """

    def __init__(self, inner: Plan, outer: Plan, *, local_world_size: int | None = None,
                  inner_name: str = "the inner strategy") -> None:
        super().__init__(*inner.specs, *outer.specs)
        self.inner, self.outer = inner, outer
        self.inner_name = inner_name
        self.local_world_size = local_world_size
        self.intra: Comm | None = None
        self.inter: Comm | None = None

    def has(self, capability: str) -> bool:
        # A node plan never materialises a meta model itself (its inner Sharded would have
        # to do it on a node's Comm); it is a node plan, not a layer of another one.
        if capability in (Capability.MATERIALIZES_META, Capability.INNER, Capability.OUTER):
            return False
        return super().has(capability)

    @property
    def fault_tolerant(self) -> bool:
        # Only the outer parts run on the fault-tolerant Comm (the inner ones on a group's).
        return self.outer.fault_tolerant

    @property
    def keeps_global_batch(self) -> bool:
        return False

    @property
    def replica_groups(self) -> bool:
        return True

    @property
    def roles(self) -> tuple[str, ...]:
        return ()

    def build(self, comm: Comm) -> list[Part]:
        groups = comm.node_groups(self.local_world_size)
        if self.inner.has(Capability.SHARDS_MODEL) or groups.local_world_size == 1:
            across: Comm = groups.inter  # each shard meets its peers on the other nodes
        else:
            across = groups.relay()
        inner_parts = self.inner.build(groups.intra)
        if not inner_parts and groups.local_world_size > 1:
            raise ValueError(
                f"{self.inner_name} synchronises nothing inside a node, but each node runs "
                f"{groups.local_world_size} processes (local_world_size), whose models would "
                "drift apart. Fix: inner=sg.Mirrored(), or one process per node")
        self.intra, self.inter = groups.intra, groups.inter
        return [*inner_parts, *self.outer.build(across)]

    def metrics(self, comm: Comm) -> dict[str, Any]:
        if self.intra is None or self.inter is None:
            return {}
        intra, inter = self.intra, self.inter
        return {"intra_node_bytes_sent": intra.bytes_sent,
                "inter_node_bytes_sent": inter.bytes_sent,
                "intra_node_bytes_received": intra.bytes_received,
                "inter_node_bytes_received": inter.bytes_received,
                # Every byte this process moved, on whichever group it moved.
                "bytes_sent": comm.bytes_sent + intra.bytes_sent + inter.bytes_sent,
                "bytes_received": comm.bytes_received + intra.bytes_received
                + inter.bytes_received,
                "comm_seconds": comm.seconds + intra.seconds + inter.seconds}
