"""Heal transports side by side: stratagem's ``SafeHealTransport`` (safetensors + strict JSON,
HMAC-authenticated, bounded) against torchft's ``HTTPTransport`` (pickle via ``torch.save``),
on loopback, in one run.

    python benchmarks/heal_transport.py [--mib 64] [--repeat 3]

A torchft-shaped state (``{"user": {"model": ...}, "torchft": {...}}``, fp32 tensors of 1 MiB)
is sent by one transport and received by another; the time is ``send_checkpoint`` +
``recv_checkpoint`` (best and median of ``--repeat``). Writes
``benchmarks/results/heal_transport.{json,md}`` (``--smoke``: a temporary folder) and prints the table with the ratio.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_ledger_args, output_dir, write_result  # noqa: E402


def _measure(make: Any, state: dict[str, Any], repeat: int) -> list[float]:
    timeout = timedelta(seconds=120)
    sender, receiver = make(), make()
    times = []
    try:
        for step in range(repeat):
            t0 = time.perf_counter()
            sender.send_checkpoint([1], step, state, timeout)
            got = receiver.recv_checkpoint(0, sender.metadata(), step, timeout)
            times.append(time.perf_counter() - t0)
            sender.disallow_checkpoint()
            assert got["torchft"]["step"] == state["torchft"]["step"]
    finally:
        sender.shutdown()
        receiver.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="state size in MiB")
    parser.add_argument("--repeat", type=int, default=3)
    add_ledger_args(parser, smoke="a 1 MiB state, once")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.repeat = 1, 1
    out_dir = output_dir(args)
    from torchft.checkpointing.http_transport import HTTPTransport

    from stratagem.ft.transport import SafeHealTransport

    state = {"user": {"model": {f"w{i}": torch.randn(256, 1024) for i in range(args.mib)}},
             "torchft": {"step": 1, "batches_committed": 2}}
    token = secrets.token_bytes(32)
    runs = {
        "torchft HTTPTransport": lambda: HTTPTransport(timedelta(seconds=120), num_chunks=0),
        "stratagem SafeHealTransport": lambda: SafeHealTransport(
            token=token, timeout=120.0, max_bytes=(args.mib + 16) << 20),
    }
    rows = []
    for name, make in runs.items():
        times = _measure(make, state, args.repeat)
        rows.append({"transport": name, "best_s": min(times), "median_s": statistics.median(times),
                     "mib_per_s": args.mib / min(times)})
    ratio = rows[1]["best_s"] / rows[0]["best_s"]
    lines = [f"Heal of a {args.mib} MiB state on loopback (send + receive, {args.repeat} runs)", "",
             "| transport | best s | median s | MiB/s |", "|---|---|---|---|"]
    lines += [f"| {r['transport']} | {r['best_s']:.3f} | {r['median_s']:.3f} | "
              f"{r['mib_per_s']:.0f} |" for r in rows]
    lines += ["", f"SafeHealTransport / HTTPTransport (best): {ratio:.2f}x"]
    write_result("heal_transport", {"mib": args.mib, "repeat": args.repeat, "rows": rows,
                                    "ratio_safe_over_http": ratio}, lines, out_dir=out_dir)


if __name__ == "__main__":
    main()
