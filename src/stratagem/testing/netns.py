"""Network namespaces as machines: a bridge, one namespace per node (or worker), ``tc tbf`` caps.

Used by the multi-node tests (``stratagem run --nnodes K --node-rank i`` in each
namespace, the processes of a node sharing its namespace) and by the benchmarks that need
shaped links (``benchmarks/convergence.py``, ``lm.py``, ``hierarchical.py``). Topology, all on
a private subnet (nothing is routed anywhere else)::

    root namespace: bridge <prefix>br [= <subnet>.1 with bridge_ip=True]
      |-- veth <prefix>v0 ==== <prefix>p0 in netns <prefix>0 = <subnet>.10
      |-- veth <prefix>v1 ==== <prefix>p1 in netns <prefix>1 = <subnet>.11
      ...

Each link can be capped in both directions with a token-bucket filter
(``tc qdisc ... tbf rate R burst 64kb latency 100ms``): on the namespace side (what the node
sends) and on the bridge side (what it receives), so node-to-node traffic crosses two capped
links, like hosts behind a switch with R ports. ``netem`` is not available on the machines this
was written for, so no delay is added. Processes inside one namespace reach each other over
that namespace's own loopback path (the kernel never sends traffic for a local address through
the veth), which is what "intra-node" means here; the veth byte counters
(:meth:`Topology.link_bytes`) therefore count exactly the inter-node traffic.

``bridge_ip=True`` (the benchmarks' layout) gives the bridge an address so processes in the
root namespace (a TCPStore, PS shards) are reachable from every namespace; it also adds a
route in the root namespace, so two such topologies must use different subnets.
``bridge_ip=False`` (the tests' layout) keeps everything inside the namespaces: nothing changes
in the root namespace's routing, and parallel runs with distinct prefixes cannot collide.
:func:`unique_prefix` gives names unique to this process.

Needs root (CAP_NET_ADMIN) and iproute2; :func:`netns_unavailable_reason` says why not, for a
``pytest.skip``. ``Topology`` is a context manager; ``down()`` is idempotent, deletes only the
names this topology owns, and also runs when ``up()`` fails half-way. A process killed with
SIGKILL cannot clean up: its namespaces (``ip netns list``, names ``n<pid><n>...``) stay until
deleted by hand — they are not swept automatically, since a name alone does not prove who
created it.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Topology", "NetnsUnavailable", "check_netns", "netns_unavailable_reason",
           "listening_sockets",
           "unique_prefix"]

_COUNTER = itertools.count()
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


class NetnsUnavailable(RuntimeError):
    """Network namespaces, veth, bridges or tbf cannot be used on this machine."""


def listening_sockets(pid: int | None = None) -> dict[int, tuple[str, int]]:
    """Every listening TCP socket of the reader's network namespace (or process ``pid``'s),
    by socket inode: ``{inode: (ip, port)}`` from ``/proc/net/tcp{,6}`` (their addresses are
    hex, host byte order per 32-bit word). Empty where ``/proc`` cannot be read."""
    out: dict[int, tuple[str, int]] = {}
    root = "/proc" if pid is None else f"/proc/{pid}"
    for table in (f"{root}/net/tcp", f"{root}/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            addr, port = fields[1].rsplit(":", 1)
            raw = bytes.fromhex(addr)
            host = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[int(fields[9])] = (str(ipaddress.ip_address(host)), int(port, 16))
    return out


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _base36(n: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = _B36[d] + out
        if not n:
            return out


def unique_prefix() -> str:
    """A name prefix (<= 6 characters) no other live process uses: ``n`` + this process id and
    a per-process counter, both base 36, so concurrent test runs never share a namespace."""
    text = "n" + _base36(os.getpid()) + _base36(next(_COUNTER) % 36)
    if len(text) > 6:  # pid above 36**4: keep the low digits, still distinct among live pids
        text = "n" + text[-5:]
    return text


def netns_unavailable_reason() -> str | None:
    """None when namespaces can be built here, else the reason (for ``pytest.skip``)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not installed"
    try:
        check_netns()
    except (NetnsUnavailable, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot build a namespace with a shaped veth link here: {e}"
    return None


def check_netns(prefix: str | None = None) -> None:
    """Raise ``NetnsUnavailable`` with the reason unless we can build a shaped link."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsUnavailable("the `ip` and `tc` commands (iproute2) are not installed")
    topo = Topology(1, prefix=prefix or unique_prefix(), subnet="10.77.254", bridge_ip=False)
    try:
        topo.up()
        topo.shape("100mbit")
    finally:
        topo.down()


class Topology:
    """``num_nodes`` namespaces joined by veth pairs to a bridge in the root namespace.

    ``prefix`` (<= 6 characters; default :func:`unique_prefix`) names everything this topology
    creates; ``subnet`` is the first three octets of its /24.
    """

    def __init__(self, num_nodes: int, *, prefix: str | None = None, subnet: str = "10.77.0",
                 bridge_ip: bool = True) -> None:
        prefix = unique_prefix() if prefix is None else prefix
        if len(prefix) > 6:
            raise ValueError(f"prefix must be <= 6 characters (interface names are <= 15), "
                             f"got {prefix!r}")
        if not 1 <= num_nodes <= 200:
            raise ValueError(f"num_nodes must be in [1, 200] (addresses .10 to .209 of the "
                             f"subnet), got {num_nodes}")
        self.num_nodes = num_nodes
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}br"
        self.bridge_ip = bridge_ip
        self.host_ip = f"{subnet}.1"
        self.rate: str | None = None

    @property
    def num_workers(self) -> int:
        """The benchmarks' name for :attr:`num_nodes` (one worker per namespace there)."""
        return self.num_nodes

    def netns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def node_ifname(self, i: int) -> str:
        """The node's interface inside its namespace (what GLOO_SOCKET_IFNAME names)."""
        return f"{self.prefix}p{i}"

    worker_ip = node_ip
    worker_ifname = node_ifname

    def _host_ifname(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prepend to a command to run it in node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.netns(i)]

    def popen(self, i: int, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in node ``i``'s namespace (in a session of its own, so the whole
        process tree can be signalled with ``os.killpg``)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen([*self.exec_prefix(i), *cmd],
                                env=None if env is None else dict(env), **kwargs)

    # ------------------------------------------------------------------ counters
    def link_bytes(self, i: int) -> tuple[int, int]:
        """(bytes node ``i`` sent, bytes it received) over its veth since :meth:`up`: the
        bridge-side end's receive and transmit counters (read in the root namespace)."""
        stats = Path("/sys/class/net", self._host_ifname(i), "statistics")
        return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> None:
        self.down()  # leftovers of a killed run with the same prefix
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            if self.bridge_ip:
                _run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i in range(self.num_nodes):
                ns, host_if, ns_if = self.netns(i), self._host_ifname(i), self.node_ifname(i)
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
                _run(["ip", "link", "set", ns_if, "netns", ns])
                _run(["ip", "link", "set", host_if, "master", self.bridge])
                _run(["ip", "link", "set", host_if, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", ns_if])
                _run(["ip", "-n", ns, "link", "set", ns_if, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.down()
            raise

    def shape(self, rate: str | None, nodes: Sequence[int] | None = None) -> None:
        """Cap the links of ``nodes`` (default all) at ``rate`` (tc syntax, e.g. "20mbit")
        both ways, or remove the caps with ``None``."""
        for i in range(self.num_nodes) if nodes is None else nodes:
            for netns_args, dev in ((["-n", self.netns(i)], self.node_ifname(i)),
                                    ([], self._host_ifname(i))):
                if rate is None:
                    _run(["tc", *netns_args, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    _run(["tc", *netns_args, "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", rate, "burst", "64kb", "latency", "100ms"])
        self.rate = rate

    def down(self) -> None:
        """Delete our namespaces (which deletes their veth ends, hence the pairs) and the
        bridge. Safe to call more than once and on a partial set-up; touches no other name."""
        existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
        links = set(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else set()
        # Beyond num_nodes too: a killed earlier run with the same fixed prefix may have had more.
        for i in range(max(self.num_nodes, 16)):
            if self.netns(i) in existing:
                _run(["ip", "netns", "del", self.netns(i)], check=False)
            if self._host_ifname(i) in links:
                _run(["ip", "link", "del", self._host_ifname(i)], check=False)
        if self.bridge in links:
            _run(["ip", "link", "del", self.bridge], check=False)

    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
