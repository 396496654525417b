"""Where the parameter-server shards are: an explicit list or ``STRATAGEM_PS_ADDRS``, and
whether they are on this machine (:func:`all_on_this_host`: what ``ParameterServer`` picks its
default ``bucket_cap_mb`` from)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence

from stratagem._rendezvous import interface_of_address, is_loopback

__all__ = ["shard_addresses", "is_on_this_host", "all_on_this_host"]


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


def is_on_this_host(address: str) -> bool:
    """Whether the shard at ``address`` (``host:port``) runs on this machine: its host is
    loopback (``localhost``, 127.0.0.0/8, ``::1``), or every IPv4 address it names or resolves
    to is held by an interface of this machine (in this network namespace: a shard in another
    namespace behind a shaped link is remote). A name that does not resolve, or a non-loopback
    IPv6 address, counts as remote (the choice that is never slow on a slow link)."""
    host = address.strip().rpartition(":")[0].strip().strip("[]")
    if not host:
        return False
    if is_loopback(host):
        return True
    try:
        ips = [str(ipaddress.ip_address(host))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        ips = sorted({str(info[4][0]) for info in infos})
    return bool(ips) and all(
        is_loopback(ip) or interface_of_address(ip) is not None for ip in ips)


def all_on_this_host(addresses: Sequence[str]) -> bool:
    """Whether every shard address is on this machine (:func:`is_on_this_host`); False for an
    empty list."""
    return bool(addresses) and all(is_on_this_host(a) for a in addresses)
