"""Kubernetes: Kubeflow Trainer's ``TrainJob`` and the older ``PyTorchJob`` set torchrun's own
arguments as ``PET_*`` variables in every pod (one pod per node): ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``."""

from __future__ import annotations

from collections.abc import Mapping

from stratagem.clusters.base import ClusterEnvError, NodePlacement, env_int

__all__ = ["node"]


def node(env: Mapping[str, str]) -> NodePlacement | None:
    """This pod's place in the job, or None when no ``PET_*`` variable is set."""
    if not any(k.startswith("PET_") for k in env):
        return None
    nnodes_raw = env.get("PET_NNODES")
    nnodes = None
    if nnodes_raw is not None and nnodes_raw.strip():
        # torchrun accepts MIN:MAX here; a TrainJob sets one number.
        if ":" in nnodes_raw:
            raise ClusterEnvError(f"PET_NNODES={nnodes_raw!r}: elastic MIN:MAX node counts are "
                                  "not supported by stratagem run. Fix: a fixed node count")
        nnodes = env_int(env, "PET_NNODES", minimum=1)
    node_rank = env_int(env, "PET_NODE_RANK", minimum=0)
    if nnodes is not None and node_rank is not None and node_rank >= nnodes:
        raise ClusterEnvError(f"PET_NODE_RANK={node_rank} is not below PET_NNODES={nnodes}")
    nproc_raw = env.get("PET_NPROC_PER_NODE", "")
    nproc = None if nproc_raw.strip() in ("", "auto", "cpu", "gpu") else env_int(
        env, "PET_NPROC_PER_NODE", minimum=1)
    addr = env.get("PET_MASTER_ADDR") or None
    return NodePlacement("Kubeflow (PET_*)", nnodes=nnodes, node_rank=node_rank,
                         master_addr=addr, master_port=env_int(env, "PET_MASTER_PORT", minimum=1),
                         nproc_per_node=nproc, how="PET_MASTER_ADDR / PET_MASTER_PORT")
