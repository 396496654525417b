"""Rendezvous stores that listen on loopback only, for single-node jobs (issue 10, item 3).

torch's ``TCPStore(host, port, is_master=True)`` ignores ``host`` when it listens: both of its
backends bind the wildcard address (``*:port``, every interface, IPv4 and IPv6; measured with
``ss -ltnp`` on torch 2.13). The store is unauthenticated — anyone who can connect may read and
write keys, and torchrun's c10d rendezvous backend unpickles what it reads there — so a
single-node job would be reachable from the whole network. The documented ``master_listen_fd``
option makes the server use a socket that is already bound: :func:`loopback_tcp_store` binds
one to the loopback address first, so the store accepts connections from this machine only.
Clients are unchanged (plain ``TCPStore(host, port)``, ``env://``), so user code calling
``torch.distributed.init_process_group()`` in a launched worker keeps working.

``python -m stratagem._torchrun ARGS`` (:func:`torchrun_main`) is ``torchrun ARGS`` whose static-rendezvous store
(hosted by the agent of node 0) goes through :func:`loopback_tcp_store` when ``--master-addr``
is a loopback address; ``stratagem run`` uses it for single-node jobs. Any other address is
left to torch unchanged (multi-node jobs must be reachable; see ``docs/reliability.md``).

Loopback is not isolation from other users of the same machine: gloo's own sockets listen on
loopback as well, unauthenticated. That boundary is the machine (or its network namespace).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["is_loopback", "loopback_env", "loopback_tcp_store", "torchrun_main"]

#: Interface-name variables of the collective backends: gloo (and NCCL's bootstrap) otherwise
#: listen on the address the host name resolves to, which is a LAN address on most machines.
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def _loopback_ifname() -> str | None:
    """The loopback interface's name ("lo" on Linux), or None where it cannot be told."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def loopback_env(base: Mapping[str, str]) -> dict[str, str]:
    """Variables that keep the workers' collective backends on loopback (single-node jobs).

    A variable the user already set in ``base`` is respected (and not returned).
    """
    name = _loopback_ifname()
    if name is None:
        return {}
    return {var: name for var in _IFNAME_VARS if var not in base}


def loopback_tcp_store(host: str = "127.0.0.1", port: int = 0, *,
                       world_size: int | None = None,
                       timeout: timedelta = timedelta(seconds=300),
                       wait_for_workers: bool = False, multi_tenant: bool = False,
                       **kwargs: Any) -> TCPStore:
    """A master ``TCPStore`` that listens on ``host`` (a loopback address) and nowhere else.

    ``port=0`` lets the OS pick a free port (read it back from ``store.port``). Raises
    ``ValueError`` for a non-loopback ``host`` and ``OSError`` (EADDRINUSE) naming
    ``host:port`` when the port is taken.
    """
    from torch.distributed import TCPStore

    if not is_loopback(host):
        raise ValueError(f"loopback_tcp_store needs a loopback host (127.0.0.1, ::1, localhost), "
                         f"got {host!r}; a store other machines must reach is created by torch "
                         "itself (TCPStore(host, port, is_master=True) listens on every interface)")
    # IPv4 first: "localhost" may resolve to ::1 first while clients try 127.0.0.1 first.
    family, kind, proto, _, address = min(
        socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM),
        key=lambda info: info[0] != socket.AF_INET)
    sock = socket.socket(family, kind, proto)
    try:
        # As torch does for its own listening socket: a fixed port whose previous owner's
        # connections are in TIME_WAIT can be reused at once (torchrun restarts, --master-port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise OSError(errno.EADDRINUSE,
                          f"EADDRINUSE: cannot bind the rendezvous store to {host}:{port}, the "
                          "port is already in use; pick another port (stratagem run "
                          "--master-port), or omit it to get a free one") from e
        sock.listen(socket.SOMAXCONN)
        bound_port = int(sock.getsockname()[1])
        store = TCPStore(host, bound_port, world_size, True, timeout,
                         wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                         master_listen_fd=sock.fileno(), **kwargs)
    except BaseException:
        with contextlib.suppress(OSError):
            sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it is destroyed
    return store


def _patch_static_rendezvous() -> None:
    """Make torchrun's static rendezvous host its store through :func:`loopback_tcp_store`
    when the master address is a loopback address (this process only)."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    original = getattr(static, "TCPStore", None)
    if original is None:
        raise RuntimeError(
            "stratagem cannot bind torchrun's rendezvous store to loopback with this torch "
            f"(torch.distributed.elastic.rendezvous.static_tcp_rendezvous has no TCPStore; "
            f"torch {_torch_version()}); use the torch version pinned in the Makefile, or run "
            "torchrun directly (its store then listens on every interface)")

    def store(host_name: str, port: int, world_size: int | None = None,
              is_master: bool = False, timeout: timedelta = timedelta(seconds=300),
              *args: Any, **kwargs: Any) -> Any:
        if is_master and not args and is_loopback(host_name):
            kwargs.setdefault("wait_for_workers", True)  # TCPStore's own default
            return loopback_tcp_store(host_name, port, world_size=world_size, timeout=timeout,
                                      **kwargs)
        return original(host_name, port, world_size, is_master, timeout, *args, **kwargs)

    static.TCPStore = store  # type: ignore[assignment,misc]


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def torchrun_main(argv: list[str] | None = None) -> None:
    """``torchrun`` (``torch.distributed.run.main``) with a loopback-only static store."""
    _patch_static_rendezvous()
    from torch.distributed.run import main

    main(argv)

