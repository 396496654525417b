"""Rendezvous stores that listen on loopback only, for single-node jobs.

torch's ``TCPStore(host, port, is_master=True)`` ignores ``host`` when it listens: both of its
backends bind the wildcard address (``*:port``, every interface, IPv4 and IPv6; measured with
``ss -ltnp`` on torch 2.13). The store is unauthenticated — anyone who can connect may read and
write keys, and torchrun's c10d rendezvous backend unpickles what it reads there — so a
single-node job would be reachable from the whole network. The documented ``master_listen_fd``
option makes the server use a socket that is already bound: :func:`loopback_tcp_store` binds
one to the loopback address first, so the store accepts connections from this machine only.
Clients are unchanged (plain ``TCPStore(host, port)``, ``env://``), so user code calling
``torch.distributed.init_process_group()`` in a launched worker keeps working.

``python -m stratagem._torchrun ARGS`` (:func:`torchrun_main`) is ``torchrun ARGS`` whose
static-rendezvous store (hosted by the agent of node 0) listens on ``--master-addr`` only, through
:func:`bound_tcp_store`: loopback for single-node jobs, node 0's own address for multi-node jobs
(``stratagem run --nnodes K`` uses it too). A wildcard master address is refused.

Multi-node jobs must be reachable by the other nodes, but not by every network the machine is
on: the store listens on the master address alone, and the workers' gloo/NCCL sockets on the
interface that holds this node's address (:func:`interface_towards` derives it from the route
to the master address; ``stratagem run --iface`` names it explicitly). Nothing authenticates
peers, so the network between the nodes must still be private (``docs/reliability.md``).

Loopback is not isolation from other users of the same machine: gloo's own sockets listen on
loopback as well, unauthenticated. That boundary is the machine (or its network namespace).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["is_loopback", "is_wildcard", "loopback_env", "loopback_tcp_store", "bound_tcp_store",
           "interface_env", "interface_of_address", "interface_towards", "torchrun_main"]

#: Interface-name variables of the collective backends: gloo (and NCCL's bootstrap) otherwise
#: listen on the address the host name resolves to, which is a LAN address on most machines.
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def bracket_host(host: str) -> str:
    """``host`` as it goes before ``:port`` in an address: an IPv6 literal in brackets
    (given with or without them), anything else as it is."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else host


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


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (``0.0.0.0``, ``::``, empty)."""
    name = host.strip().strip("[]")
    if not name:
        return True
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


_SIOCGIFADDR = 0x8915


def interface_of_address(address: str) -> str | None:
    """The name of the interface holding the IPv4 ``address`` on this machine (in this network
    namespace), or None. Reads each interface's primary address (``SIOCGIFADDR``)."""
    try:
        wanted = ipaddress.IPv4Address(address.strip())
    except ValueError:
        return None
    if wanted.is_loopback:
        return _loopback_ifname()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if ipaddress.IPv4Address(raw[20:24]) == wanted:
                return name
    return None


def interface_towards(host: str) -> tuple[str, str | None]:
    """``(source address, interface)`` this machine uses to reach ``host`` (an IPv4 address
    or a name): the kernel's route choice, read from a connected UDP socket (nothing is sent).
    On node 0 ``host`` is its own address and the answer is that address's interface."""
    infos = socket.getaddrinfo(host.strip().strip("[]"), 9, socket.AF_INET, socket.SOCK_DGRAM)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        source = str(s.getsockname()[0])
    return source, interface_of_address(source)


def interface_env(ifname: str, base: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = ``ifname``, but those set in ``base``."""
    return {var: ifname for var in _IFNAME_VARS if var not in base}


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
    if not is_loopback(host):
        raise ValueError(f"loopback_tcp_store needs a loopback host (127.0.0.1, ::1, localhost), "
                         f"got {host!r}; a store other machines must reach is bound_tcp_store("
                         "host=<this machine's address on the private network>)")
    return bound_tcp_store(host, port, world_size=world_size, timeout=timeout,
                           wait_for_workers=wait_for_workers, multi_tenant=multi_tenant, **kwargs)


def bound_tcp_store(host: str, port: int = 0, *, world_size: int | None = None,
                    timeout: timedelta = timedelta(seconds=300),
                    wait_for_workers: bool = False, multi_tenant: bool = False,
                    **kwargs: Any) -> TCPStore:
    """A master ``TCPStore`` that listens on ``host`` (one address of this machine) only.

    Multi-node jobs host the store on node 0's address on the private network,
    instead of torch's every-interface listener. Raises ``ValueError`` for a wildcard ``host``,
    ``OSError`` (EADDRINUSE) naming ``host:port`` when the port is taken and ``OSError``
    (EADDRNOTAVAIL) when ``host`` is not an address of this machine.
    """
    from torch.distributed import TCPStore

    if is_wildcard(host):
        raise ValueError(f"the rendezvous store must listen on one address, got {host!r} "
                         "(every interface, unauthenticated); pass node 0's address on the "
                         "network the nodes share, e.g. --master-addr 10.0.0.1")
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
            if e.errno == errno.EADDRNOTAVAIL:
                raise OSError(errno.EADDRNOTAVAIL,
                              f"EADDRNOTAVAIL: cannot bind the rendezvous store to {host}:{port}, "
                              "no interface of this machine holds that address; node 0 (the one "
                              "started with --node-rank 0) must run on the machine whose address "
                              "is --master-addr") from e
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
    """Make torchrun's static rendezvous host its store through :func:`bound_tcp_store`, on
    the master address only (this process only)."""
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
        if is_master and not args:
            kwargs.setdefault("wait_for_workers", True)  # TCPStore's own default
            return bound_tcp_store(host_name, port, world_size=world_size, timeout=timeout,
                                   **kwargs)
        return original(host_name, port, world_size, is_master, timeout, *args, **kwargs)

    static.TCPStore = store  # type: ignore[assignment,misc]


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def torchrun_main(argv: list[str] | None = None) -> None:
    """``torchrun`` (``torch.distributed.run.main``) whose static store listens on the master
    address only."""
    _patch_static_rendezvous()
    from torch.distributed.run import main

    main(argv)

