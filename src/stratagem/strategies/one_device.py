"""``OneDevice``: one process, no communication; the default when nothing is launched."""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..strategy import Strategy

__all__ = ["OneDevice"]


class OneDevice(Strategy):
    """Everything on one device; every collective is the identity. Never fails for peers."""

    name = "one_device"

    def __init__(self, device: torch.device | str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("comm", Comm.single())
        super().__init__(device=device, **kwargs)
