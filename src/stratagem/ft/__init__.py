"""Fault-tolerant synchronous training on torchft (issue 22): replicas that die are dropped at
the next step, the others keep training, and a returning replica heals from a live peer.

``stratagem.ft.transport`` holds :class:`~stratagem.ft.transport.SafeHealTransport`, the heal
transport handed to ``torchft.Manager(checkpoint_transport=...)``: safetensors + strict JSON,
token-authenticated, sizes bounded before allocation; nothing received is ever unpickled.
Importing this package does not import torchft.
"""

from __future__ import annotations

__all__: list[str] = []
