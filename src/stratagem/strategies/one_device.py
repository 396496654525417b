"""``OneDevice``: one process, no communication; the default when nothing is launched."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from ..comm import Comm
from ..strategy import Strategy

__all__ = ["OneDevice"]


class OneDevice(Strategy):
    """Everything on one device; every collective is the identity. Never fails for peers.

    Built in a process that a multi-process launcher started (``WORLD_SIZE > 1`` in the
    environment: ``stratagem run --nproc N``, torchrun) it warns: every such process would
    train alone as the chief of a world of one."""

    name = "one_device"

    def __init__(self, device: torch.device | str | None = None, **kwargs: Any) -> None:
        if "comm" not in kwargs:
            _warn_if_launched()
        kwargs.setdefault("comm", Comm.single())
        super().__init__(device=device, **kwargs)


def _warn_if_launched() -> None:
    from stratagem.clusters import ClusterEnvError, adopt_tasks

    with contextlib.suppress(ClusterEnvError):  # a malformed cluster env: not for OneDevice
        adopt_tasks()  # srun python train.py: WORLD_SIZE from Slurm's variables
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        return
    if world > 1:
        warnings.warn(
            f"OneDevice is a single-process strategy, but this process was launched as one of "
            f"WORLD_SIZE={world} processes (RANK={os.environ.get('RANK', '?')}): each process "
            f"would train alone on all the data and act as chief of a world of one. Fix: use a "
            f"multi-process strategy (sg.Mirrored(), or sg.from_env() with stratagem run "
            f"--strategy NAME), or launch a single process", RuntimeWarning, stacklevel=3)
