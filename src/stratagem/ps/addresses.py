"""Where the parameter-server shards are: an explicit list or ``STRATAGEM_PS_ADDRS``, and
whether they are on this machine (:func:`all_on_this_host`: what ``ParameterServer`` picks its
default ``bucket_cap_mb`` from).

An address is ``host:port``: a DNS name or IPv4 address, or a bracketed IPv6 address
(``[::1]:5000``), and a port in 1..65535. Nothing else reaches gRPC: its other target forms
(``unix:/path``, ``dns:///name``, ``ipv4:``...) would connect somewhere the token checks in
:mod:`stratagem.ps.auth` (loopback or not) cannot judge, so they are refused.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Sequence

from stratagem._rendezvous import interface_of_address, is_loopback

__all__ = ["shard_addresses", "check_address", "is_on_this_host", "all_on_this_host"]

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*\.?$")


def check_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``; ``ValueError`` naming what is wrong otherwise."""
    if not isinstance(address, str):
        raise ValueError(f"parameter-server shard address must be a 'host:port' string, got "
                         f"{address!r}")
    host, sep, port_text = address.strip().rpartition(":")
    why = None
    if not sep or not host:
        why = "it is not 'host:port'"
    elif not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        why = f"port {port_text!r} is not an integer in 1..65535"
    elif host.startswith("["):
        try:
            ok = host.endswith("]") and isinstance(ipaddress.ip_address(host[1:-1]),
                                                    ipaddress.IPv6Address)
        except ValueError:
            ok = False
        if not ok:
            why = f"{host!r} is not a bracketed IPv6 address"
    elif ":" in host or "/" in host:
        why = (f"{host!r} is a gRPC target scheme (unix:, dns:, ...) or an unbracketed IPv6 "
               "address; only host:port (IPv6 as [addr]:port) is accepted")
    elif len(host) > 253 or not _NAME.match(host):
        why = f"{host!r} is not a host name or IPv4 address"
    if why is not None:
        raise ValueError(f"parameter-server shard address {address!r} refused: {why}. Fix: "
                         "list shards as host:port with a port in 1..65535, e.g. "
                         "127.0.0.1:5000,[::1]:5001")
    return host, int(port_text)


def shard_addresses(given: str | Sequence[str] | None, *, who: str) -> list[str]:
    """``given`` (a list or a comma-separated string) or else ``STRATAGEM_PS_ADDRS``, as a list
    of ``host:port`` (each checked by :func:`check_address`); ``ValueError`` naming the value
    and the fix otherwise. The order matters: every worker must list the shards in the same
    order (placement is by position)."""
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
    for a in addresses:
        try:
            check_address(a)
        except ValueError as exc:
            raise ValueError(f"{who}: {source}: {exc}") from None
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
