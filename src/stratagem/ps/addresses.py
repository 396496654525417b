"""Where the parameter-server shards are: an explicit list or ``STRATAGEM_PS_ADDRS``."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["shard_addresses"]


def shard_addresses(given: str | Sequence[str] | None, *, who: str) -> list[str]:
    """``given`` (a list or a comma-separated string) or else ``STRATAGEM_PS_ADDRS``, as a list
    of ``host:port``; ``ValueError`` naming the value and the fix otherwise. The order matters:
    every worker must list the shards in the same order (placement is by position)."""
    raw: str | Sequence[str] | None = given
    source = "ps_addresses"
    if raw is None:
        raw = os.environ.get("STRATAGEM_PS_ADDRS", "")
        source = "STRATAGEM_PS_ADDRS"
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    addresses = [a.strip() for a in items if isinstance(a, str) and a.strip()]
    if not addresses or len(addresses) != len(items) or any(
            not a.rpartition(":")[2].isdigit() for a in addresses):
        raise ValueError(f"{who} needs parameter-server shard addresses 'host:port', got "
                         f"{source}={raw!r}. Fix: start shards (stratagem run --num-ps K, "
                         "sg.launch(..., num_ps=K), or stratagem ps) and set "
                         "STRATAGEM_PS_ADDRS=host:port,... or pass ps_addresses=[...]")
    return addresses
