"""SkyPilot: every node of a cluster gets ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NUM_NODES``,
``SKYPILOT_NODE_IPS`` (one address per line, the head node's first) and
``SKYPILOT_NUM_GPUS_PER_NODE``. SkyPilot sets no port: ``MASTER_PORT``, ``--master-port`` or
torchrun's default."""

from __future__ import annotations

from collections.abc import Mapping

from stratagem.clusters.base import ClusterEnvError, NodePlacement, env_int

__all__ = ["node"]


def node(env: Mapping[str, str]) -> NodePlacement | None:
    """This node's place in the cluster, or None when SkyPilot set nothing."""
    if not any(k in env for k in ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES",
                                  "SKYPILOT_NODE_IPS")):
        return None
    nnodes = env_int(env, "SKYPILOT_NUM_NODES", minimum=1)
    node_rank = env_int(env, "SKYPILOT_NODE_RANK", minimum=0)
    ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines()
           if line.strip()]
    if nnodes is not None and ips and len(ips) != nnodes:
        raise ClusterEnvError(f"SKYPILOT_NODE_IPS lists {len(ips)} addresses, "
                              f"SKYPILOT_NUM_NODES={nnodes}")
    if nnodes is not None and node_rank is not None and node_rank >= nnodes:
        raise ClusterEnvError(f"SKYPILOT_NODE_RANK={node_rank} is not below "
                              f"SKYPILOT_NUM_NODES={nnodes}")
    gpus = env_int(env, "SKYPILOT_NUM_GPUS_PER_NODE", minimum=0)
    return NodePlacement("SkyPilot (SKYPILOT_*)", nnodes=nnodes, node_rank=node_rank,
                         master_addr=ips[0] if ips else None,
                         nproc_per_node=gpus or None, how="first of SKYPILOT_NODE_IPS")
