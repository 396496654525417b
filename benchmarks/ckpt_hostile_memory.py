"""What a hostile checkpoint costs ``restore`` before it is refused.

    PYTHONPATH=src python benchmarks/ckpt_hostile_memory.py [--cases dup,sparse] [--gib 3]

``dup``: one 8 MiB rank file listed 256 times; ``sparse``: a ``--gib`` GiB member, 16 KiB on
disk. Builds each checkpoint in a temporary directory, then runs the restore once and reports
the outcome, the wall time, the peak-RSS delta (``ru_maxrss``) and the ``tracemalloc`` peak.
Run it with ``PYTHONPATH`` at another tree's ``src`` to compare. Writes
``benchmarks/results/ckpt_hostile_memory.{json,md}`` (``--smoke``: a temporary folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stratagem as sg
from stratagem import checkpoint
from stratagem.checkpoint.format import pack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_ledger_args, output_dir, split_list, write_result  # noqa: E402


def duplicated_index(root: Path, s: sg.OneDevice, model: nn.Module) -> Callable[[], Any]:
    """A sharded index listing one 8 MiB rank file 256 times."""
    s.save(root / "ck", model=model, step=3)
    d = (root / "ck").resolve()
    m = json.loads((d / "manifest.json").read_text())
    full = {k: v.detach() for k, v in model.state_dict().items()}
    data = pack({"weight": full["weight"], "bias": full["bias"], "pad": torch.randn(2 << 20)},
                "rank 0")
    (d / "model.rank0.safetensors").write_bytes(data)
    m["files"]["model.rank0.safetensors"] = hashlib.sha256(data).hexdigest()
    m["objects"]["model"] = {"kind": "module", "file": "model.rank0.safetensors", "sharded": {
        "files": ["model.rank0.safetensors"] * 256,
        "tensors": [{"path": ["weight"], "shape": [7, 16], "dtype": "torch.float32",
                     "rows": [[0, 7]] + [[7, 7]] * 255}]}}
    (d / "manifest.json").write_text(json.dumps(m))
    return lambda: checkpoint.load_model_state(root / "ck")


def sparse_member(root: Path, s: sg.OneDevice, model: nn.Module, gib: int) -> Callable[[], Any]:
    """``model.safetensors`` replaced by a small header, then truncated to ``gib`` GiB."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s.save(root / "ck", model=model, optimizer=opt, step=2)
    d = (root / "ck").resolve()
    (d / "model.safetensors").unlink()
    head = json.dumps({"/w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"\0" * 16)
        f.truncate(gib << 30)
    return lambda: s.restore(root / "ck", model=model, optimizer=opt)


def measure(case: str, gib: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        s = sg.OneDevice()
        model = s.prepare(nn.Linear(16, 7))
        call = (duplicated_index(Path(tmp), s, model) if case == "dup" else
                sparse_member(Path(tmp), s, model, gib))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            call()
            outcome = "no error"
        except Exception as exc:  # noqa: BLE001 - reported, whatever it is
            outcome = f"{type(exc).__name__}: ...{str(exc)[-160:]}"
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{case}: {outcome}\n  {elapsed:.2f} s, peak RSS +{(after - before) / 1024:.1f} MiB, "
          f"tracemalloc peak {peak / 2**20:.2f} MiB", flush=True)
    return {"case": case, "outcome": outcome, "seconds": elapsed,
            "peak_rss_delta_mib": (after - before) / 1024, "tracemalloc_peak_mib": peak / 2**20}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="dup,sparse", help="comma list of dup, sparse")
    p.add_argument("--gib", type=int, default=3, help="the sparse member's size in GiB")
    add_ledger_args(p, smoke="both cases, the sparse member 1 GiB")
    args = p.parse_args(argv)
    if args.smoke:
        args.gib = 1
    cases = split_list(args.cases)
    if not cases or set(cases) - {"dup", "sparse"}:
        p.error(f"--cases must be a comma list of dup, sparse; got {args.cases!r}")
    out_dir = output_dir(args)
    rows = [measure(case, args.gib) for case in cases]
    lines = ["# What a hostile checkpoint costs restore before it is refused", "",
             f"dup: a sharded index listing one 8 MiB rank file 256 times; sparse: a "
             f"{args.gib} GiB member, 16 KiB on disk. One restore each.", "",
             "| case | outcome | s | peak RSS delta MiB | tracemalloc peak MiB |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['outcome'].replace('|', '/')} | {r['seconds']:.2f} | "
              f"{r['peak_rss_delta_mib']:.1f} | {r['tracemalloc_peak_mib']:.2f} |" for r in rows]
    write_result("ckpt_hostile_memory", {"gib": args.gib, "rows": rows}, lines, out_dir=out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
