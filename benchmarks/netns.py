"""Shaped links for benchmarks: one Linux network namespace per worker, a bridge, tbf caps.

Topology (all on a private subnet, default ``10.77.0.0/24``; nothing is routed anywhere else)::

    root namespace: bridge <prefix>br = 10.77.0.1  (hosts the TCPStore and PS shards)
      |-- veth <prefix>v0 ==== <prefix>p0 in netns <prefix>0 = 10.77.0.10  (worker 0)
      |-- veth <prefix>v1 ==== <prefix>p1 in netns <prefix>1 = 10.77.0.11  (worker 1)
      ...

Each worker link is capped in both directions with a token-bucket filter
(``tc qdisc ... tbf rate R burst 64kb latency 100ms``): on the namespace side (what the worker
sends) and on the bridge side (what it receives). Worker-to-worker traffic crosses two capped
links, like hosts behind a switch with R ports; the store and the PS shards sit on the bridge
itself (a server with an uncapped port). ``netem`` is not available here, so no delay is added.

The namespaces have no default route, so workers can only reach 10.77.0.0/24.
Needs root (CAP_NET_ADMIN). ``Topology`` is a context manager; ``down()`` is idempotent and
also removes leftovers of an earlier run killed before it could clean up.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["Topology", "NetnsUnavailable", "check_netns"]


class NetnsUnavailable(RuntimeError):
    """Network namespaces, veth, bridges or tbf cannot be used on this machine."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def check_netns(prefix: str = "sgchk") -> None:
    """Raise ``NetnsUnavailable`` with the reason unless we can build a shaped link."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetnsUnavailable("the `ip` and `tc` commands (iproute2) are not installed")
    topo = Topology(1, prefix=prefix, subnet="10.77.254")
    try:
        topo.up()
        topo.shape("100mbit")
    finally:
        topo.down()


class Topology:
    """``num_workers`` namespaces joined by veth pairs to a bridge in the root namespace."""

    def __init__(self, num_workers: int, *, prefix: str = "sgcv", subnet: str = "10.77.0") -> None:
        if len(prefix) > 6:
            raise ValueError(f"prefix must be <= 6 characters (interface names are <= 15), "
                             f"got {prefix!r}")
        self.num_workers = num_workers
        self.prefix = prefix
        self.subnet = subnet
        self.bridge = f"{prefix}br"
        self.host_ip = f"{subnet}.1"
        self.rate: str | None = None
        self._up = False

    def netns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def worker_ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def worker_ifname(self, i: int) -> str:
        """The worker's interface inside its namespace (what GLOO_SOCKET_IFNAME names)."""
        return f"{self.prefix}p{i}"

    def _host_ifname(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prepend to a command to run it in worker ``i``'s namespace."""
        return ["ip", "netns", "exec", self.netns(i)]

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> None:
        self.down()  # leftovers of a killed run with the same prefix
        self._up = True
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.num_workers):
            ns, host_if, ns_if = self.netns(i), self._host_ifname(i), self.worker_ifname(i)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
            _run(["ip", "link", "set", ns_if, "netns", ns])
            _run(["ip", "link", "set", host_if, "master", self.bridge])
            _run(["ip", "link", "set", host_if, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.worker_ip(i)}/24", "dev", ns_if])
            _run(["ip", "-n", ns, "link", "set", ns_if, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def shape(self, rate: str | None) -> None:
        """Cap every worker link at ``rate`` (tc syntax, e.g. "100mbit") both ways, or remove
        the caps with ``None``."""
        for i in range(self.num_workers):
            for netns_args, dev in ((["-n", self.netns(i)], self.worker_ifname(i)),
                                    ([], self._host_ifname(i))):
                if rate is None:
                    _run(["tc", *netns_args, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    _run(["tc", *netns_args, "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", rate, "burst", "64kb", "latency", "100ms"])
        self.rate = rate

    def down(self) -> None:
        """Delete our namespaces (which deletes their veth ends, hence the pairs) and the
        bridge. Safe to call more than once and on a partial set-up."""
        existing = _run(["ip", "netns", "list"], check=False).stdout.split()
        for i in range(max(self.num_workers, 16)):
            if self.netns(i) in existing:
                _run(["ip", "netns", "del", self.netns(i)], check=False)
            _run(["ip", "link", "del", self._host_ifname(i)], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        self._up = False

    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
