"""Strategy overhead on a GPU: stratagem's step against the plain PyTorch step on the same
model, data and device, in alternating blocks of one run (so drift hits both).

    python benchmarks/gpu.py [--steps 50] [--rounds 10] [--width 4096] [--smoke] [--out-dir DIR]

Step-time rows (stratagem vs the same thing written by hand, alternating rounds): ``OneDevice``
vs a plain loop under fp32, bf16 (``torch.autocast``) and fp16 (``torch.amp.GradScaler``);
``Mirrored`` vs raw ``DistributedDataParallel`` and ``Sharded`` vs hand-written FSDP2
(``fully_shard`` on each ``Linear`` and the root) in one process over NCCL (world size 1);
and, when the machine has two GPUs or more, ``Mirrored`` vs DDP in 2 processes. Throughput
rows: DiLoCo's int4 and int8 quantize / dequantize of a CUDA tensor (GB/s of fp32 input), and
a heal of a CUDA state between two processes on the GPU through ``SafeHealTransport`` (GB/s:
the sender's encode, then the receiver's fetch and copy onto the GPU; needs torchft). A row
that fails is recorded with its error and the others still run. Prints the median of the
per-round ratios with their range and writes ``gpu.json`` / ``gpu.md`` to
``benchmarks/results`` (or ``--out-dir``). Sized for at most 5 minutes on one GPU.
``--smoke``: 2 steps, 1 round, width 256, 1 MiB, output to a temporary folder. Needs CUDA:
without it, it says so, writes no result and exits 77 (the exit code ``stratagem bench``
records as "skipped", not failed), or with ``--smoke`` prints ``skipped: no CUDA`` and exits
0 (there is no CPU path to check: every row times CUDA work).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SKIPPED, add_ledger_args, output_dir, write_result  # noqa: E402


def _model(width: int) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _median_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    ratios = [x / y for x, y in zip(a, b)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _timed(cfg: dict[str, Any], ours: Any, theirs: Any, sync: Any) -> tuple[list[float],
                                                                          list[float]]:
    """Seconds per step of ``ours`` and ``theirs`` in alternating blocks after a warm-up."""
    def block(fn: Any) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            fn()
        sync()
        return (time.perf_counter() - t0) / cfg["steps"]

    block(ours), block(theirs)  # warm-up
    a: list[float] = []
    b: list[float] = []
    for r in range(cfg["rounds"]):
        for fn in ((ours, theirs) if r % 2 == 0 else (theirs, ours)):
            (a if fn is ours else b).append(block(fn))
    return a, b


def one_device_row(cfg: dict[str, Any], precision: str) -> dict[str, Any]:
    import stratagem as sg

    device = torch.device("cuda")
    x = torch.randn(cfg["batch"], 1024, device=device)
    y = torch.randint(0, 10, (cfg["batch"],), device=device)
    strategy = sg.OneDevice(device=device, precision=precision)
    model = _model(cfg["width"])
    model, opt = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    plain = _model(cfg["width"]).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    def ours() -> None:
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    def theirs() -> None:
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(plain(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(plain_opt)
            scaler.update()
        else:
            loss.backward()
            plain_opt.step()
        plain_opt.zero_grad()

    a, b = _timed(cfg, ours, theirs, torch.cuda.synchronize)
    med, lo, hi = _median_ratio(a, b)
    row = {"case": f"OneDevice {precision} vs plain PyTorch", "ours_ms":
           1e3 * statistics.median(a), "plain_ms": 1e3 * statistics.median(b),
           "ratio": med, "ratio_min": lo, "ratio_max": hi,
           "skipped_steps": strategy.metrics()["skipped_steps"]}
    strategy.close()
    return row


def _race(cfg: dict[str, Any], strategy: Any, model: nn.Module, opt: Any, plain: nn.Module,
          plain_opt: Any) -> dict[str, Any]:
    """A launched process's step times: ``strategy``'s prepared model against ``plain`` (the
    same model wrapped by hand), alternating rounds on one batch."""
    import torch.distributed as dist

    device = strategy.device
    x = torch.randn(cfg["batch"], 1024, device=device)
    y = torch.randint(0, 10, (cfg["batch"],), device=device)

    def ours() -> None:
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    def theirs() -> None:
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def sync() -> None:
        dist.barrier()
        torch.cuda.synchronize()

    try:
        a, b = _timed(cfg, ours, theirs, sync)
        strategy.close()
    finally:  # a default group left to interpreter exit can abort the process after its work
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"ours": a, "theirs": b}


def _join(cfg: dict[str, Any]) -> Any:
    """This launched process's GPU and torch.distributed's default group over NCCL (and gloo
    for CPU tensors), which raw DDP and FSDP2 need; a world of one gets one too."""
    import torch.distributed as dist

    import stratagem as sg

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    return device, sg.Comm.from_env(timeout=120, device=device)


def _mirrored_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import stratagem as sg

    device, comm = _join(cfg)
    strategy = sg.Mirrored(comm=comm, device=device)  # NCCL: one GPU per process
    model, opt = strategy.prepare(model := _model(cfg["width"]),
                                  torch.optim.SGD(model.parameters(), lr=0.01))
    ddp = DDP(_model(cfg["width"]).to(device), device_ids=[device.index])
    return _race(cfg, strategy, model, opt, ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))


def _sharded_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import stratagem as sg

    device, comm = _join(cfg)
    # The same units as by hand below.
    strategy = sg.Sharded(shard_modules=[nn.Linear], comm=comm, device=device)
    model, opt = strategy.prepare(model := _model(cfg["width"]),
                                  torch.optim.SGD(model.parameters(), lr=0.01))
    raw = _model(cfg["width"]).to(strategy.device)
    world = dist.group.WORLD  # the default group Sharded's first call created
    assert world is not None
    mesh = DeviceMesh.from_group(world, "cuda")
    for layer in raw.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(raw, mesh=mesh)
    return _race(cfg, strategy, model, opt, raw, torch.optim.SGD(raw.parameters(), lr=0.01))


def _launched_row(case: str, worker: Any, cfg: dict[str, Any], nprocs: int) -> dict[str, Any]:
    from stratagem.launcher import launch

    res = launch(worker, nprocs=nprocs, args=(cfg,), timeout=600)
    med, lo, hi = _median_ratio(res[0]["ours"], res[0]["theirs"])
    return {"case": case, "ours_ms": 1e3 * statistics.median(res[0]["ours"]),
            "plain_ms": 1e3 * statistics.median(res[0]["theirs"]), "ratio": med,
            "ratio_min": lo, "ratio_max": hi}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def quantize_rows(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """DiLoCo's outer-sync codec on CUDA: GB/s of fp32 input through quantize and dequantize
    (median of ``rounds`` timings of ``steps`` calls), and the round trip's largest error
    relative to the largest value."""
    from stratagem.quantize import dequantize, quantize

    n, device = cfg["values"], cfg.get("device", "cuda")
    x = torch.randn(n, device=device)
    rows = []
    for kind in ("int4", "int8"):
        payload = quantize(x, kind)
        back = dequantize(payload, kind, n)
        err = float((back - x).abs().max() / x.abs().max())
        times: dict[str, list[float]] = {"quantize": [], "dequantize": []}
        for _ in range(cfg["rounds"]):
            for name in ("quantize", "dequantize"):
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(cfg["steps"]):
                    if name == "quantize":
                        quantize(x, kind)
                    else:
                        dequantize(payload, kind, n)
                _sync(device)
                times[name].append((time.perf_counter() - t0) / cfg["steps"])
        for name, ts in times.items():
            rows.append({"case": f"DiLoCo {kind} {name}, {4 * n / 2**20:.0f} MiB fp32",
                         "gb_per_s": 4 * n / statistics.median(ts) / 1e9,
                         "ms": 1e3 * statistics.median(ts), "max_rel_error": err,
                         "payload_bytes": int(payload.numel())})
    return rows


def _heal_receiver(metadata: str, token: bytes, mib: int, repeat: int, conn: Any,
                   device: str) -> None:
    """The joining process: fetch each step's state and copy it onto the GPU, timed."""
    from stratagem.ft.transport import SafeHealTransport

    transport = SafeHealTransport(token=token, timeout=120.0, max_bytes=(mib + 16) << 20)
    try:
        for step in range(repeat):
            conn.recv()  # the sender serves this step now
            t0 = time.perf_counter()
            got = transport.recv_checkpoint(0, metadata, step, timedelta(seconds=120))
            on_gpu = [v.to(device) for v in got["model"].values()]
            _sync(device)
            seconds = time.perf_counter() - t0
            checksum = float(sum(float(v.double().sum()) for v in on_gpu))
            conn.send((seconds, checksum))
    finally:
        transport.shutdown()


def heal_row(cfg: dict[str, Any]) -> dict[str, Any]:
    """A heal of ``mib`` MiB of CUDA tensors from this process to another on the same GPU
    through ``SafeHealTransport`` (authenticated, safetensors, no pickle): the sender encodes
    (CUDA -> host), the receiver fetches over loopback and copies onto the GPU."""
    import multiprocessing as mp

    from stratagem.ft.transport import SafeHealTransport

    mib, repeat, device = cfg["heal_mib"], cfg["heal_repeat"], cfg.get("device", "cuda")
    state = {"model": {f"w{i}": torch.randn(256, 1024, device=device) for i in range(mib)}}
    want = float(sum(float(v.double().sum()) for v in state["model"].values()))
    token = secrets.token_bytes(32)
    sender = SafeHealTransport(token=token, timeout=120.0, max_bytes=(mib + 16) << 20)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_heal_receiver, args=(sender.metadata(), token, mib, repeat, child,
                                                           device))
    proc.start()
    totals, sends, recvs = [], [], []
    try:
        for step in range(repeat):
            _sync(device)
            t0 = time.perf_counter()
            sender.send_checkpoint([1], step, state, timedelta(seconds=120))
            send_s = time.perf_counter() - t0
            parent.send("go")
            if not parent.poll(300):
                raise TimeoutError("the receiving process sent nothing back within 300 s")
            recv_s, checksum = parent.recv()
            sender.disallow_checkpoint()
            if abs(checksum - want) > 1e-6 * max(1.0, abs(want)):
                raise AssertionError(f"the healed state differs: checksum {checksum} != {want}")
            sends.append(send_s)
            recvs.append(recv_s)
            totals.append(send_s + recv_s)
    finally:
        sender.shutdown()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    best = min(totals)
    return {"case": f"heal of {mib} MiB of CUDA state, 2 processes, 1 GPU",
            "gb_per_s": (mib << 20) / best / 1e9, "best_s": best,
            "median_s": statistics.median(totals), "encode_s": min(sends),
            "fetch_and_upload_s": min(recvs), "repeat": repeat}


def _guarded(case: str, fn: Any, *args: Any) -> list[dict[str, Any]]:
    """``fn(*args)``'s row(s), or one row naming the error: one failing row must not cost the
    others (a GPU machine is lent for minutes)."""
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, printed
        traceback.print_exc()
        return [{"case": case, "error": f"{type(exc).__name__}: {exc}"[:500]}]
    return out if isinstance(out, list) else [out]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--heal-mib", type=int, default=512, help="heal state size in MiB")
    p.add_argument("--quantize-mib", type=int, default=256, help="codec input in MiB of fp32")
    p.add_argument("--out", dest="out_dir", help=argparse.SUPPRESS)  # the old --out-dir
    add_ledger_args(p, smoke="2 steps, 1 round, width 256, 1 MiB; without CUDA: skipped, exit 0")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        if args.smoke:
            print("skipped: no CUDA (benchmarks/gpu.py times CUDA work only)")
            return 0
        print("skipped: benchmarks/gpu.py needs a CUDA device (torch.cuda.is_available() is "
              "False); no result written. Fix: run it on a machine with a GPU and a CUDA build "
              "of torch", file=sys.stderr)
        return SKIPPED
    t_start = time.perf_counter()
    cfg = {"steps": 2 if args.smoke else args.steps, "rounds": 1 if args.smoke else args.rounds,
           "width": 256 if args.smoke else args.width, "batch": args.batch,
           "heal_mib": 1 if args.smoke else args.heal_mib, "heal_repeat": 1 if args.smoke else 3,
           "values": (1 if args.smoke else args.quantize_mib) << 18}
    out = output_dir(args)
    rows: list[dict[str, Any]] = []
    for precision in ("fp32", "bf16", "fp16"):
        rows += _guarded(f"OneDevice {precision} vs plain PyTorch", one_device_row, cfg,
                         precision)
    rows += _guarded("Mirrored vs DDP, NCCL, 1 process", _launched_row,
                     "Mirrored vs DDP, NCCL, 1 process", _mirrored_worker, cfg, 1)
    rows += _guarded("Sharded vs hand-written FSDP2, NCCL, 1 process", _launched_row,
                     "Sharded vs hand-written FSDP2, NCCL, 1 process", _sharded_worker, cfg, 1)
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        rows += _guarded("Mirrored vs DDP, NCCL, 2 processes", _launched_row,
                         "Mirrored vs DDP, NCCL, 2 processes", _mirrored_worker, cfg, 2)
    rows += _guarded("DiLoCo int4/int8 quantize and dequantize", quantize_rows, cfg)
    try:
        import torchft  # noqa: F401 - SafeHealTransport is a torchft CheckpointTransport
    except ImportError:
        rows.append({"case": "heal of CUDA state, 2 processes", "error":
                     "not run: torchft is not installed (pip install 'stratagem[ft]')"})
    else:
        rows += _guarded("heal of CUDA state, 2 processes", heal_row, cfg)
    host = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda}
    md = [f"# Strategy overhead on a GPU\n\nHost: {host['gpu']} x{gpus}, torch {host['torch']} "
          f"(CUDA {host['cuda']}). MLP 1024-{cfg['width']}-{cfg['width']}-10, batch "
          f"{cfg['batch']}, {cfg['rounds']} alternating rounds of {cfg['steps']} steps after a "
          f"warm-up; the ratio is the median of the per-round ratios.\n",
          "| case | stratagem ms/step | plain ms/step | ratio (median) | per-round range |",
          "|---|---:|---:|---:|---|"]
    for r in rows:
        if "ratio" in r:
            md.append(f"| {r['case']} | {r['ours_ms']:.3f} | {r['plain_ms']:.3f} | "
                      f"{r['ratio']:.3f} | {r['ratio_min']:.3f}..{r['ratio_max']:.3f} |")
    md += ["", "| throughput | GB/s | detail |", "|---|---:|---|"]
    for r in rows:
        if "gb_per_s" in r and "max_rel_error" in r:
            md.append(f"| {r['case']} | {r['gb_per_s']:.1f} | {r['ms']:.3f} ms per call, "
                      f"round-trip error {r['max_rel_error']:.3g} of max |")
        elif "gb_per_s" in r:
            md.append(f"| {r['case']} | {r['gb_per_s']:.2f} | best {r['best_s']:.3f} s of "
                      f"{r['repeat']} (encode {r['encode_s']:.3f} s, fetch + upload "
                      f"{r['fetch_and_upload_s']:.3f} s) |")
    failed = [r for r in rows if "error" in r]
    if failed:
        md += ["", "Not measured:"] + [f"- {r['case']}: {r['error']}" for r in failed]
    if gpus < 2:
        md.append("\nMirrored vs DDP over NCCL in 2 processes needs two GPUs: not run (one GPU "
                  "here).")
    write_result("gpu", {"host": host, "rows": rows}, md, out_dir=out,
                 duration_s=time.perf_counter() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
