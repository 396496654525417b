"""Parameter-server push+pull throughput against raw gRPC and a local memory copy.

One step of a Downpour worker (Dean et al. 2012) pushes a gradient for every parameter and
pulls every parameter back. We time that step for 1-2 shards and 1-4 worker threads over a
parameter set of ``--mb`` MB, and in the same run the same traffic as bare gRPC calls on the
same channel options (one ``Exchange`` call per shard: the shard's gradient bytes in, its
parameter bytes out; no framing, no optimizer) and as a local ``copy_`` of the same bytes. Shards (ours and the raw
ones) run as separate processes so they do not share the workers' GIL.

    PYTHONPATH=src python benchmarks/ps_throughput.py [--mb 8] [--seconds 2]
        [--before-src DIR [--before-two-calls]]

Ours is one Downpour step: ``push_fetch_async`` (push and fetch in one round trip per
shard), timed twice: "ours, gRPC" with every byte through gRPC (``shared_memory=False``, the
like-for-like comparison with raw gRPC), and "ours" as ``ShardedParameters`` runs it by
default, which on one host moves the tensors through a shared-memory region; "ours, buckets" is the same step cut as ``ParameterServer(mode="async")`` cuts it by
default (``bucket_cap_mb``: at most 16 concurrent calls per step). With ``--before-src DIR`` (another checkout's ``src``, e.g.
``git archive HEAD src | tar -x -C /tmp/before``) the same cells also time that version's
shard processes, alternating with the others, driven by this checkout's client with the same
``push_fetch_async`` step (so "before" isolates shard-side changes); ``--before-two-calls``
drives them with ``push()`` then ``pull()`` instead (the data path before ``push_fetch``).

The raw baseline has the same shape as ours: one raw server process per shard holding that
shard's bytes, each worker its own channels, and every step's calls to the shards issued
concurrently (futures), so for 2 shards both sides split the bytes over 2 processes alike.
Like our push+fetch it is one round trip per shard (not a ``Put`` then a ``Get``), and it is
timed on both a thread-pool ``grpc.server`` and a ``grpc.aio`` server; the ratio divides by
the faster of the two.

Writes benchmarks/results/ps_throughput.{json,md}; prints the table. Target: ours, gRPC / raw >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import torch
from _common import add_ledger_args, output_dir, write_report

from stratagem.ps import wire
from stratagem.ps.placement import MaxSizePartitioner, greedy, specs_of

# gRPC as stratagem imports it (its receive tuning on), so raw and ours run the same gRPC.
from stratagem.ps.rpc import grpc
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient

RAW_SERVICE = "stratagem.bench.Raw"


def make_params(mb: float) -> dict[str, torch.Tensor]:
    """Mixed sizes like a small CNN/MLP: a few big matrices plus small biases."""
    total = int(mb * (1 << 20)) // 4
    sizes = [0.35, 0.25, 0.2, 0.12, 0.08]
    params: dict[str, torch.Tensor] = {}
    for i, frac in enumerate(sizes):
        n = int(total * frac)
        params[f"layer{i}.weight"] = torch.randn(n // 256, 256)
        params[f"layer{i}.bias"] = torch.randn(256)
    return params


# -- raw gRPC baseline server -----------------------------------------------------------------

def raw_server_main(port_file: str, nbytes: int, max_bytes: int, use_aio: bool) -> None:
    """One raw shard: ``Exchange`` takes the gradient bytes and answers the parameter bytes
    (one round trip, the shape of our push+fetch); ``Put``/``Get`` are the two halves."""
    wire.tune_malloc()  # same process settings as our shards (stratagem.ps.server.serve)
    blob = os.urandom(nbytes)
    if use_aio:
        asyncio.run(_raw_aio_server(port_file, blob, max_bytes))
        return
    serve_thread_pool(port_file, max_bytes, {"Exchange": lambda req, ctx: blob,
                                             "Put": lambda req, ctx: b"",
                                             "Get": lambda req, ctx: blob})


def _service(handlers: dict[str, Any]) -> Any:
    """The benchmark service with ``handlers`` (method name -> unary function or coroutine)."""
    return grpc.method_handlers_generic_handler(
        RAW_SERVICE, {k: grpc.unary_unary_rpc_method_handler(h) for k, h in handlers.items()})


def serve_thread_pool(port_file: str, max_bytes: int, handlers: dict[str, Any]) -> None:
    """Serve the functions ``handlers`` on a thread-pool ``grpc.server`` until SIGTERM; the
    port goes to ``port_file``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=wire.channel_options(max_bytes))
    server.add_generic_rpc_handlers((_service(handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    server.stop(0)


async def _raw_aio_server(port_file: str, blob: bytes, max_bytes: int) -> None:
    """The same raw service on ``grpc.aio`` (what our shard runs on): the baseline is the
    faster of the two, so a win cannot come from a slow baseline server."""
    async def exchange(req: bytes, ctx: Any) -> bytes:
        return blob

    async def put(req: bytes, ctx: Any) -> bytes:
        return b""

    await serve_aio(port_file, max_bytes, {"Exchange": exchange, "Put": put, "Get": exchange})


async def serve_aio(port_file: str, max_bytes: int, handlers: dict[str, Any]) -> None:
    """Serve the coroutine ``handlers`` on a ``grpc.aio`` server until SIGTERM; the port goes
    to ``port_file``."""
    server = grpc.aio.server(options=wire.channel_options(max_bytes))
    server.add_generic_rpc_handlers((_service(handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def minimal_server_main(port_file: str, nbytes: int, max_bytes: int, use_aio: bool) -> None:
    """The least a Python gRPC parameter server can do per step, for the "minimal PS" column:
    view the request as the gradient (no framing, no checks), one SGD step into the shard's
    parameters, and a copy of them into the reply (gRPC sends only ``bytes``). On a thread-pool
    server (under a lock) or on ``grpc.aio`` (on the event loop, no hop): like the raw
    baseline, the column takes the faster of the two."""
    wire.tune_malloc()
    torch.set_num_threads(1)
    param = torch.randn(nbytes // 4)
    lock = threading.Lock()

    def step(req: bytes) -> bytes:
        param.add_(torch.frombuffer(req, dtype=torch.float32), alpha=-1e-3)
        return param.numpy().tobytes()

    if use_aio:
        async def exchange(req: bytes, ctx: Any) -> bytes:
            return step(req)

        asyncio.run(serve_aio(port_file, max_bytes, {"Exchange": exchange}))
        return

    def locked(req: bytes, ctx: Any) -> bytes:
        with lock:
            return step(req)

    serve_thread_pool(port_file, max_bytes, {"Exchange": locked})


def start(args: list[str], src: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process; returns it and the file it will write its port to."""
    fd, port_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(port_file)
    env = {**os.environ, "PYTHONPATH": src or str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, *args, "--port-file", port_file], env=env,
                            stderr=subprocess.DEVNULL)
    return proc, port_file


def address(proc: subprocess.Popen[bytes], port_file: str, args: list[str]) -> str:
    """Wait (up to 30 s) for a started server's port; returns its loopback address."""
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file) or not Path(port_file).read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server {args} did not start")
        time.sleep(0.05)
    port = int(Path(port_file).read_text())
    os.unlink(port_file)
    return f"127.0.0.1:{port}"


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


# -- measurement ------------------------------------------------------------------------------

def run_workers(num_workers: int, seconds: float, make_step: Callable[[int], Callable[[], int]]
                ) -> float:
    """Run ``num_workers`` threads doing steps for ``seconds``; returns MB/s moved in total."""
    steps = [make_step(i) for i in range(num_workers)]
    for s in steps:  # warm-up: connections, first optimizer step
        s()
    moved = [0] * num_workers
    start = threading.Barrier(num_workers + 1)
    end = [0.0]

    errors: list[BaseException] = []

    def loop(i: int) -> None:
        start.wait()
        try:
            while time.perf_counter() < end[0]:
                moved[i] += steps[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below: a dead worker thread
            errors.append(exc)        # must fail the cell, not lower its throughput

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(num_workers)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    end[0] = t0 + seconds
    start.wait()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {num_workers} worker threads failed") from errors[0]
    return sum(moved) / (time.perf_counter() - t0) / 1e6


def ours_step_factory(addrs: list[str], params: dict[str, torch.Tensor],
                      two_calls: bool = False, buckets: bool = False,
                      shared_memory: bool | None = None
                      ) -> Callable[[int], Callable[[], int]]:
    """Our Downpour step: one push+fetch call per shard, or with ``buckets`` as
    ``ParameterServer(mode="async")`` runs it by default (``bucket_cap_mb=0.125``, raised so a
    step makes at most 16 calls; big tensors cut to the bucket size). ``shared_memory``: as
    ``ShardedParameters`` takes it (None: the same-host shared-memory region where it can be
    used, as on this loopback; False: every byte through gRPC)."""
    grads = {k: torch.randn_like(v) * 1e-6 for k, v in params.items()}
    nbytes = 2 * sum(v.nbytes for v in params.values())
    bucket = max(1 << 17, -(-nbytes // 2 // 16)) if buckets else None
    kwargs: dict[str, Any] = {"optimizer_spec": {"name": "sgd", "lr": 1e-3},
                              "shared_memory": shared_memory}
    if bucket is not None:
        kwargs["partitioner"] = MaxSizePartitioner(bucket, max_shards=16)
    # The first worker registers; the others get the existing values back.
    ShardedParameters(PSClient(addrs), params, **kwargs).register()

    def make(_: int) -> Callable[[], int]:
        table = ShardedParameters(PSClient(addrs), params, **kwargs)
        table.register()

        names = list(params)

        def step() -> int:
            if two_calls:  # the data path before push_fetch: two round trips
                table.push(grads)
                table.pull()
            else:
                table.push_fetch_async(grads, fetch=names, max_request_bytes=bucket).result()
            return nbytes
        return step
    return make


def raw_step_factory(addrs: list[str], shard_bytes: list[int], max_bytes: int
                     ) -> Callable[[int], Callable[[], int]]:
    blobs = [os.urandom(n) for n in shard_bytes]

    def make(_: int) -> Callable[[], int]:
        chans = [grpc.insecure_channel(a, options=wire.channel_options(max_bytes))
                 for a in addrs]
        calls = [c.unary_unary(f"/{RAW_SERVICE}/Exchange") for c in chans]

        def step() -> int:
            # One round trip per shard, all shards concurrently: the shape of push_fetch.
            fs = [c.future(b, timeout=60) for c, b in zip(calls, blobs, strict=True)]
            return sum(len(b) for b in blobs) + sum(len(f.result()) for f in fs)
        return step
    return make


def minimal_step_factory(addrs: list[str], params: dict[str, torch.Tensor],
                         shard_bytes: list[int], max_bytes: int
                         ) -> Callable[[int], Callable[[], int]]:
    """The client half of the minimal PS: each shard's gradient bytes copied out of tensors
    into one ``bytes`` per call (as any tensor sent over Python gRPC must be), one call per
    shard, the reply viewed as tensors (no copy)."""
    flat = torch.cat([v.reshape(-1) for v in params.values()]) * 1e-6
    cuts, start = [], 0
    for n in shard_bytes:
        cuts.append(flat[start:start + n // 4])
        start += n // 4

    def make(_: int) -> Callable[[], int]:
        chans = [grpc.insecure_channel(a, options=wire.channel_options(max_bytes))
                 for a in addrs]
        calls = [c.unary_unary(f"/{RAW_SERVICE}/Exchange") for c in chans]

        def step() -> int:
            fs = [c.future(g.numpy().tobytes(), timeout=60)
                  for c, g in zip(calls, cuts, strict=True)]
            got = [torch.frombuffer(f.result(), dtype=torch.float32) for f in fs]
            return 2 * sum(t.nbytes for t in got)
        return step
    return make


def local_copy_mbps(params: dict[str, torch.Tensor], seconds: float) -> float:
    src = list(params.values())
    dst = [torch.empty_like(t) for t in src]
    nbytes = 2 * sum(t.nbytes for t in src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for s, d in zip(src, dst, strict=True):  # "push" ...
            d.copy_(s)
        for s, d in zip(src, dst, strict=True):  # ... and "pull"
            s.copy_(d)
        n += 1
    return n * nbytes / (time.perf_counter() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="parameter set size in MB")
    ap.add_argument("--seconds", type=float, default=2.0, help="measurement time per cell")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell")
    ap.add_argument("--shards", default="1,2")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--before-src", default=None,
                    help="another checkout's src directory to time as 'before'")
    ap.add_argument("--before-two-calls", action="store_true",
                    help="drive the 'before' shards with push() then pull() (two round trips)")
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    ap.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--aio", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--minimal-server", action="store_true", help=argparse.SUPPRESS)
    add_ledger_args(ap, smoke="0.5 MB, 1 shard, 1 worker, 1 round of 0.2 s")
    args = ap.parse_args()
    if args.smoke:
        args.mb, args.seconds, args.rounds, args.shards, args.workers = 0.5, 0.2, 1, "1", "1"
    max_bytes = wire.DEFAULT_MAX_MESSAGE_BYTES
    if args.raw_server:
        raw_server_main(args.port_file, args.nbytes, max_bytes, args.aio)
        return
    if args.minimal_server:
        minimal_server_main(args.port_file, args.nbytes, max_bytes, args.aio)
        return
    out_dir = output_dir(args)
    torch.set_num_threads(1)
    load_at_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    # Worker-side opt-in; applies to the raw-gRPC workers in this process just the same.
    tuned = wire.tune_malloc()
    params = make_params(args.mb)
    total_mb = sum(v.nbytes for v in params.values()) / 1e6
    local = local_copy_mbps(params, args.seconds)
    rows: list[dict[str, Any]] = []
    for num_shards in [int(x) for x in args.shards.split(",")]:
        shard_bytes = greedy(specs_of(params), num_shards).shard_bytes
        for num_workers in [int(x) for x in args.workers.split(",")]:
            procs: list[subprocess.Popen[bytes]] = []
            try:
                addrs: dict[str, list[str]] = {"ours": [], "ours_grpc": [],
                                               "ours_buckets": [], "raw": [],
                                               "raw_aio": [], "minimal": [], "minimal_aio": [],
                                               "before": []}
                starting: list[tuple[str, subprocess.Popen[bytes], str, list[str]]] = []
                for n in shard_bytes:
                    for side, cmd, src in (
                            ("ours", ["-m", "stratagem.ps.server"], None),
                            ("ours_grpc", ["-m", "stratagem.ps.server"], None),
                            ("ours_buckets", ["-m", "stratagem.ps.server"], None),
                            ("raw", [__file__, "--raw-server", "--nbytes", str(n)], None),
                            ("raw_aio", [__file__, "--raw-server", "--aio", "--nbytes", str(n)],
                             None),
                            ("minimal", [__file__, "--minimal-server", "--nbytes", str(n)], None),
                            ("minimal_aio", [__file__, "--minimal-server", "--aio", "--nbytes",
                                             str(n)], None),
                            ("before", ["-m", "stratagem.ps.server"], args.before_src)):
                        if side == "before" and not args.before_src:
                            continue
                        # Every server starts at once (their imports overlap); the
                        # addresses are read below, once all are on their way.
                        p, port_file = start(cmd, src=src)
                        procs.append(p)
                        starting.append((side, p, port_file, cmd))
                for side, p, port_file, cmd in starting:
                    addrs[side].append(address(p, port_file, cmd))
                sides: dict[str, Callable[[int], Callable[[], int]]] = {
                    "ours": ours_step_factory(addrs["ours"], params),
                    "ours_grpc": ours_step_factory(addrs["ours_grpc"], params,
                                                   shared_memory=False),
                    "ours_buckets": ours_step_factory(addrs["ours_buckets"], params,
                                                      buckets=True),
                    "raw": raw_step_factory(addrs["raw"], shard_bytes, max_bytes),
                    "raw_aio": raw_step_factory(addrs["raw_aio"], shard_bytes, max_bytes),
                    "minimal": minimal_step_factory(addrs["minimal"], params, shard_bytes,
                                                    max_bytes),
                    "minimal_aio": minimal_step_factory(addrs["minimal_aio"], params,
                                                        shard_bytes, max_bytes)}
                if args.before_src:
                    sides["before"] = ours_step_factory(addrs["before"], params,
                                                        two_calls=args.before_two_calls)
                # Alternate short rounds so a change in machine load hits all sides alike.
                got: dict[str, list[float]] = {k: [] for k in sides}
                for _ in range(args.rounds):
                    for side, steps in sides.items():
                        got[side].append(run_workers(num_workers, args.seconds / args.rounds,
                                                     steps))
            finally:
                stop_all(procs)
            mean = {k: sum(v) / len(v) for k, v in got.items()}
            # The baseline is the faster raw server (thread pool or asyncio) of this cell.
            raw = max(mean["raw"], mean["raw_aio"])
            minimal = max(mean["minimal"], mean["minimal_aio"])  # likewise
            row = {"shards": num_shards, "workers": num_workers,
                   "ours_MBps": round(mean["ours"], 1),
                   "raw_sync_MBps": round(mean["raw"], 1),
                   "raw_aio_MBps": round(mean["raw_aio"], 1),
                   "raw_grpc_MBps": round(raw, 1), "ratio": round(mean["ours"] / raw, 3),
                   "ours_grpc_MBps": round(mean["ours_grpc"], 1),
                   "ours_grpc_ratio": round(mean["ours_grpc"] / raw, 3),
                   "ours_buckets_MBps": round(mean["ours_buckets"], 1),
                   "ours_buckets_ratio": round(mean["ours_buckets"] / raw, 3),
                   "minimal_sync_MBps": round(mean["minimal"], 1),
                   "minimal_aio_MBps": round(mean["minimal_aio"], 1),
                   "minimal_MBps": round(minimal, 1),
                   "minimal_over_raw": round(minimal / raw, 3),
                   "minimal_aio_over_raw_aio": round(mean["minimal_aio"] / mean["raw_aio"], 3),
                   "ours_over_minimal": round(mean["ours"] / minimal, 3),
                   "ours_grpc_over_minimal": round(mean["ours_grpc"] / minimal, 3),
                   "local_copy_MBps": round(local, 1),
                   "rounds_MBps": {k: [round(x, 1) for x in v] for k, v in got.items()}}
            if "before" in mean:
                row.update(before_MBps=round(mean["before"], 1),
                           before_ratio=round(mean["before"] / raw, 3))
            rows.append(row)
            print(row, flush=True)
    meta = {"param_MB": round(total_mb, 2), "num_tensors": len(params),
            "seconds_per_cell": args.seconds, "rounds": args.rounds,
            "python": platform.python_version(), "torch": torch.__version__,
            "malloc_tuned": tuned, "grpc": grpc.__version__, "cpus": os.cpu_count(),
            "load_at_start": load_at_start,
            "command": " ".join(["python", "benchmarks/ps_throughput.py", *sys.argv[1:]])}
    if args.before_src:
        meta["before_step"] = "push+pull" if args.before_two_calls else "push_fetch_async"
    lines = [f"# Parameter-server throughput ({total_mb:.1f} MB of parameters, push+pull per "
             "step)", ""]
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("shards", lambda r: str(r["shards"])), ("workers", lambda r: str(r["workers"]))]
    if args.before_src:
        cols.append(("before MB/s", lambda r: str(r["before_MBps"])))
    cols += [("ours, gRPC MB/s", lambda r: str(r["ours_grpc_MBps"])),
             ("ours MB/s", lambda r: str(r["ours_MBps"])),
             ("ours, buckets MB/s", lambda r: str(r["ours_buckets_MBps"])),
             ("raw sync MB/s", lambda r: str(r["raw_sync_MBps"])),
             ("raw aio MB/s", lambda r: str(r["raw_aio_MBps"])),
             ("minimal PS sync MB/s", lambda r: str(r["minimal_sync_MBps"])),
             ("minimal PS aio MB/s", lambda r: str(r["minimal_aio_MBps"]))]
    if args.before_src:
        cols.append(("before / raw", lambda r: f"{r['before_ratio']:.2f}"))
    cols += [("**ours, gRPC / raw**", lambda r: f"**{r['ours_grpc_ratio']:.2f}**"),
             ("ours / raw", lambda r: f"{r['ratio']:.2f}"),
             ("ours, buckets / raw", lambda r: f"{r['ours_buckets_ratio']:.2f}"),
             ("minimal / raw", lambda r: f"{r['minimal_over_raw']:.2f}"),
             ("minimal aio / raw aio", lambda r: f"{r['minimal_aio_over_raw_aio']:.2f}"),
             ("ours, gRPC / minimal", lambda r: f"{r['ours_grpc_over_minimal']:.2f}"),
             ("local copy MB/s", lambda r: str(r["local_copy_MBps"]))]
    lines += ["| " + " | ".join(c for c, _ in cols) + " |",
              "|" + "---:|" * len(cols)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows]
    lines += ["", f"Load average at start {meta['load_at_start']}. MB/s counts gradient "
              "bytes pushed plus parameter bytes pulled. \"ours, gRPC\" is one push+fetch "
              "call per shard with every byte through gRPC (`shared_memory=False`); \"ours\" "
              "is the same step as `ShardedParameters` takes it by default, which on one host "
              "puts the tensors in a shared-memory region and sends only a small gRPC message "
              "(so ours / raw is not a like-for-like comparison: raw copies every byte through "
              "gRPC). The ratios divide by the faster raw "
              "server (thread-pool `grpc.server` or `grpc.aio`), each answering one `Exchange` "
              "call per shard per step (gradient bytes in, parameter bytes out), the shape of "
              "our push+fetch. \"ours, buckets\" is the same step cut as "
              "`ParameterServer(mode=\"async\")` cuts it by default (`bucket_cap_mb=0.125`, raised "
              "to at most 16 concurrent calls per step, big tensors partitioned to the bucket "
              "size). \"minimal PS\" is the least a Python gRPC parameter server does "
              "per step: the client copies the gradient tensors into the request `bytes`, the "
              "shard views them (no framing, header or checks), applies one SGD step and copies "
              "the parameters into the reply, on a thread-pool server and on `grpc.aio` (minimal "
              "/ raw and ours, gRPC / minimal use the faster of the two); ours, gRPC / "
              "minimal is what "
              "framing, validation, the non-finite check and the optimizer's generality cost on "
              "top of that."]
    if args.before_src:
        lines += ["", f"\"before\": the shard processes of `{args.before_src}`, driven by this "
                  f"checkout's client with `{meta['before_step']}` per step."]
    write_report("ps_throughput", meta, rows, lines, out_dir=out_dir)


if __name__ == "__main__":
    main()
