"""Stall soak ("done when"): one connection holds 32+ stalled streams while a good
client keeps calling; every good call must complete in under 1 s, for 60 s.

The shard runs as a process of its own (``python -m stratagem.ps.server``, token on). The
hostile side opens ``--stalled`` authenticated streams on one connection and as many
unauthenticated ones on another, none of which ever sends its request message; the good
client (its own connection) pushes a gradient and pulls the parameters in a loop.

    .venv/bin/python scripts/ps_stall_soak.py [--seconds 60] [--stalled 40]

Prints the number of good calls, their latency percentiles and the worst one, the shard's
calls in flight and its RSS; exits 1 if any good call took 1 s or more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from stratagem.launcher import child_pythonpath
from stratagem.ps import wire
from stratagem.ps.rpc import grpc
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient

TOKEN = "soak-token"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--stalled", type=int, default=40, help="stalled streams per connection")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stratagem-soak-"))
    (tmp / "token").write_text(TOKEN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = child_pythonpath(env)
    shard = subprocess.Popen([sys.executable, "-m", "stratagem.ps.server", "--port-file",
                              str(tmp / "port"), "--token-file", str(tmp / "token")],
                             env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ((tmp / "port").exists() and (tmp / "port").read_text().strip()):
            if shard.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("shard did not start")
            time.sleep(0.05)
        addr = f"127.0.0.1:{int((tmp / 'port').read_text())}"
        good = PSClient([addr], token=TOKEN, timeout=10)
        table = ShardedParameters(good, {"w": torch.zeros(64, 1024)},
                                  optimizer_spec={"name": "sgd", "lr": 0.01})
        table.register()

        release = threading.Event()

        def never() -> Iterator[bytes]:
            release.wait(args.seconds + 60)
            return
            yield b""

        chans, calls = [], []
        for token in (TOKEN, None):
            ch = grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
            stub = ch.stream_unary(wire.METHOD)
            md = ((wire.TOKEN_METADATA_KEY, token),) if token else None
            calls += [stub.future(never(), timeout=args.seconds + 60, metadata=md)
                      for _ in range(args.stalled)]
            chans.append(ch)
        time.sleep(1.0)
        held = good.health()[0]["calls_in_flight"] - 1
        rss0 = _rss_mib(shard.pid)
        lat: list[float] = []
        end = time.monotonic() + args.seconds
        g = torch.full((64, 1024), 1e-3)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            table.push({"w": g})
            table.pull()
            lat.append(time.perf_counter() - t0)
            time.sleep(0.02)
        held_end = good.health()[0]["calls_in_flight"] - 1
        rss1 = _rss_mib(shard.pid)
        release.set()
        for c in calls:
            c.cancel()
        for ch in chans:
            ch.close()
        good.close()
    finally:
        shard.terminate()
        shard.wait(10)
    q = statistics.quantiles(lat, n=100)
    print(f"stall soak: {args.seconds:g} s, {args.stalled} authenticated stalled streams on one "
          f"connection (shard held {held} at the start, {held_end} at the end) + "
          f"{args.stalled} unauthenticated on another")
    print(f"good push+pull of 256 KiB: {len(lat)} calls, median {q[49] * 1e3:.1f} ms, "
          f"p99 {q[98] * 1e3:.1f} ms, worst {max(lat) * 1e3:.1f} ms, "
          f"{sum(t >= 1.0 for t in lat)} at >= 1 s")
    print(f"shard RSS {rss0:.0f} MiB -> {rss1:.0f} MiB")
    return 0 if max(lat) < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
