"""Plumbing shared by the benchmark scripts (not a benchmark itself).

- :func:`run_job`: start one multi-process job (workers, an optional evaluator and PS shard,
  in network namespaces on a shaped link or on loopback), wait for it, stop it, and read the
  per-rank JSON results (``convergence.py``, ``lm.py`` and through them
  ``diloco_compression.py`` and ``hierarchical.py``).
- :func:`shaped_links_usable` and :func:`run_matrix`: the link x seed x strategy loop of those
  scripts, with the namespace set-up and clean-up on SIGTERM / Ctrl-C.
- :func:`write_result`: the one writer of every benchmark's result, ``NAME.md`` and
  ``NAME.json`` in one shape (name, commit, dirty, date, command, versions, host, duration_s,
  and the benchmark's own payload under ``results``); :func:`write_outputs` and
  :func:`write_report` are its front ends for the matrix scripts and the PS micro-benchmarks.
- :func:`add_ledger_args` and :func:`output_dir`: ``--smoke`` (1-2 steps on loopback, the
  result in a temporary folder) and ``--out-dir DIR``, the same in every script; a smoke run
  never writes to ``results/``.

Every script puts this folder first on ``sys.path`` (it is the script's own folder), so
``from _common import ...`` works both when run and when imported by another benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
#: When this process started its benchmark (every script imports this module first): the
#: default ``duration_s`` of its result.
_STARTED = time.monotonic()
#: The exit code of a benchmark that cannot run on this machine (``gpu.py`` without CUDA):
#: ``stratagem bench`` records it as skipped, not failed (automake's convention for tests).
SKIPPED = 77


# =========================================================================== worker side

_TAG = "bench/"


def _store(timeout: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                    int(os.environ.get("WORLD_SIZE", "1")), is_master=False,
                    timeout=timedelta(seconds=timeout), wait_for_workers=False)


class _Progress(threading.Thread):
    """Async workers: publish this worker's step count and watch for the stop key from a
    thread with its own store client, so the training loop never waits on the store (which
    shares the shaped link)."""

    def __init__(self, rank: int, timeout: float) -> None:
        super().__init__(daemon=True)
        self.rank, self.timeout = rank, timeout
        self.step = 0
        self.stop = threading.Event()

    def run(self) -> None:
        store = _store(self.timeout)
        last = -1
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                if self.step != last:
                    last = self.step
                    store.set(f"{_TAG}step/{self.rank}", str(last))
                if store.check([f"{_TAG}stop"]):
                    self.stop.set()
            time.sleep(0.02)


def start_together(ctrl: Any, rank: int, world: int, sync: bool, timeout: float
                   ) -> _Progress | None:
    """Everybody starts the clock together (after start-up, prepare and PS registration):
    mark this worker ready and wait for the others (and the evaluator when not ``sync``).
    Returns the started :class:`_Progress` thread of an asynchronous worker, else None."""
    progress = None
    parties = world
    if not sync:
        progress = _Progress(rank, timeout)
        ctrl.set(f"{_TAG}step/{rank}", "0")
        progress.start()
        parties += 1  # the evaluator
    ctrl.set(f"{_TAG}ready/{rank}", "1")
    ctrl.wait([f"{_TAG}ready/{r}" for r in range(parties)], timedelta(seconds=timeout))
    return progress


def traffic(metrics: dict[str, Any], wall: float) -> dict[str, Any]:
    """A worker result's steps, training seconds and bytes per step from ``metrics``."""
    steps = max(1, int(metrics["steps"]))
    return {
        "steps": int(metrics["steps"]), "wall_seconds": wall,
        "bytes_per_step": (metrics["bytes_sent"] + metrics["bytes_received"]) / steps,
        "bytes_sent_per_step": metrics["bytes_sent"] / steps,
        "comm_seconds": metrics["comm_seconds"],
    }


def finish_worker(cfg: dict[str, Any], ctrl: Any, strategy: Any, result: dict[str, Any], *,
                  rank: int, world: int, step: int, progress: _Progress | None,
                  timeout: float) -> None:
    """Write ``rank{rank}.json``, tell the others (or the evaluator) this worker is done and
    wait for them, close the strategy and exit the process."""
    Path(cfg["result_dir"], f"rank{rank}.json").write_text(json.dumps(result))
    if progress is not None:
        progress.stop.set()
        ctrl.set(f"{_TAG}step/{rank}", str(step))
        ctrl.set(f"{_TAG}finished/{rank}", "1")
    else:
        # Nobody closes its sockets while a peer may still be reading the last collective.
        ctrl.set(f"{_TAG}done/{rank}", "1")
        ctrl.wait([f"{_TAG}done/{r}" for r in range(world)], timedelta(seconds=timeout))
    strategy.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo/gRPC destructors) once the result is out


def run_evaluator(cfg: dict[str, Any], build: Callable[[], tuple[Any, Any, Any]],
                  score: Callable[[Any, Any], float], hit: Callable[[float], bool],
                  stop: Callable[[dict[str, Any] | None, float], bool], *,
                  metric: str, stop_mean: float | None = None,
                  final_after_finish: bool = False) -> None:
    """The evaluator process of an asynchronous job: once every worker is ready, ``build()``
    a strategy instance that never steps, then each time the workers' mean step count
    crosses a multiple of ``eval_every`` record ``score(strategy, model)``; the first score
    for which ``hit`` is true is ``reached``; ``stop(reached, wall)``, or the mean step count
    reaching ``stop_mean`` (a budget of samples), sets the stop key; with
    ``final_after_finish`` the model is scored once more after every worker has finished
    (what they had in flight has landed). Writes
    ``evaluator.json`` (``curve``, ``final_<metric>``, ``reached``) and exits."""
    world, timeout = int(os.environ["WORLD_SIZE"]), float(cfg["timeout"])
    every = int(cfg["eval_every"])
    store = _store(timeout)
    store.wait([f"{_TAG}ready/{r}" for r in range(world)], timedelta(seconds=timeout))
    # Registered after every worker: it only reads the center / global parameters.
    strategy, model, _ = build()
    store.set(f"{_TAG}ready/{world}", "1")
    store.wait([f"{_TAG}ready/{r}" for r in range(world + 1)], timedelta(seconds=timeout))
    start = time.perf_counter()
    step_keys = [f"{_TAG}step/{r}" for r in range(world)]
    finished = [f"{_TAG}finished/{r}" for r in range(world)]
    curve: list[tuple[float, float, float]] = []
    reached = None
    next_at = 0.0
    while True:
        done = store.check(finished)
        mean = sum(int(v) for v in store.multi_get(step_keys)) / world
        if mean >= next_at or done:
            wall = time.perf_counter() - start
            value = score(strategy, model)
            curve.append((wall, mean, value))
            next_at = (math.floor(mean / every) + 1) * every
            if reached is None and hit(value):
                reached = {"wall": wall, "step": mean, metric: value}
            if stop(reached, wall) or (stop_mean is not None and mean >= stop_mean):
                store.set(f"{_TAG}stop", "1")
                break
        if done:
            break
        time.sleep(0.01)
    if final_after_finish:
        store.wait(finished, timedelta(seconds=timeout))
        wall = time.perf_counter() - start
        mean = sum(int(v) for v in store.multi_get(step_keys)) / world
        value = score(strategy, model)
        curve.append((wall, mean, value))
        if reached is None and hit(value):
            reached = {"wall": wall, "step": mean, metric: value}
    Path(cfg["result_dir"], "evaluator.json").write_text(json.dumps(
        {"curve": curve, f"final_{metric}": curve[-1][2], "reached": reached}))
    strategy.close()
    sys.stdout.flush()
    os._exit(0)


# =========================================================================== parent side


def _clean(value: Any) -> Any:
    """inf/nan -> None, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """SIGTERM every process group, then SIGKILL whatever is still alive after ``grace`` s."""
    for p in procs:
        if p.poll() is None:
            _kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)


def run_job(script: str, run_dir: Path, cfg: dict[str, Any], header: dict[str, Any], *,
            workers: int, sync: bool, needs_ps: bool, topo: Any, timeout: float,
            run_timeout: float, nnodes: int | None = None,
            job_env: dict[str, str] | None = None, ps_shards: int = 1,
            kill_every: float | None = None, kill_seed: int = 0
            ) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """One job of ``script``: ``workers`` processes ``script --worker CFG`` (rank r in
    namespace r, or r // (workers // nnodes) with ``nnodes``; loopback when ``topo`` is None),
    plus ``script --evaluator CFG`` when not ``sync`` and ``ps_shards`` PS shards when
    ``needs_ps``.

    ``cfg`` is written to ``run_dir/cfg.json``; ``job_env`` is added to every process's
    environment. Returns ``(out, chief, ranks)``: ``out`` is ``header`` plus ``job_seconds``
    and ``error`` (and ``log_tail`` when the job failed or left no result); ``chief`` is worker
    0's result merged with the evaluator's (None when the job failed); ``ranks`` the workers'
    results that exist.

    ``kill_every`` (asynchronous jobs whose workers restart alone): every that many seconds a
    random live worker is SIGKILLed and started again at once (``TORCHELASTIC_RESTART_COUNT``
    counts its attempts); ``out["kills"]`` says how many. For an asynchronous job with shards
    ``out["merged_samples"]`` is the shards' count of samples merged into the global model
    (asynchronous DiLoCo), read before they stop."""
    import random

    from torch.distributed import TCPStore

    from stratagem.launcher import child_pythonpath, start_ps_shards, worker_env

    W = workers
    per_node = W // (nnodes or 1)
    job_env = job_env or {}
    host = "127.0.0.1" if topo is None else topo.host_ip
    cfg_path = run_dir / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    store = TCPStore(host, 0, W, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout))
    shards = None
    procs: list[subprocess.Popen[bytes]] = []
    starts: list[tuple[list[str], dict[str, str], Any]] = []
    kills = 0
    merged_samples = None
    logs = []
    t0 = time.perf_counter()
    error = None
    try:
        if needs_ps:
            shards = start_ps_shards(ps_shards, host=host, env={**os.environ, **job_env})
        argv0 = [sys.executable, script]
        # Async strategies get an evaluator (rank W here) on the bridge, next to the shard.
        for r in range(W if sync else W + 1):
            env = dict(os.environ)
            env.update(worker_env(rank=r, world_size=W, master_port=store.port,
                                  master_addr=host, nnodes=nnodes or 1,
                                  ps_addrs=shards.addresses if shards else (), base={}))
            if shards is not None:
                env.update(shards.env())  # the job's shard token file
            env["OMP_NUM_THREADS"] = "1"
            if shards is not None and topo is not None:
                # The shard is on the bridge (10.77.0.1), not loopback: the client refuses to
                # send the token in clear there. This is a private namespace link made for
                # the benchmark, so say so explicitly (a real network would use TLS:
                # --tls-cert/--tls-key on the shards, STRATAGEM_PS_TLS_ROOT_CERT on workers).
                env["STRATAGEM_PS_ALLOW_PLAINTEXT"] = "1"
            env.update(job_env)
            env["PYTHONPATH"] = child_pythonpath(env)
            if r < W:
                ns = r if nnodes is None else r // per_node
                env["GLOO_SOCKET_IFNAME"] = "lo" if topo is None else topo.worker_ifname(ns)
                argv = [*([] if topo is None else topo.exec_prefix(ns)), *argv0, "--worker"]
            else:
                argv = [*argv0, "--evaluator"]
            log = open(run_dir / f"rank{r}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            starts.append(([*argv, str(cfg_path)], env, log))
            procs.append(subprocess.Popen([*argv, str(cfg_path)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + run_timeout
        rng = random.Random(kill_seed)
        # The kill clock starts once every worker (and the evaluator) is ready to train.
        next_kill = math.inf
        ready = [f"{_TAG}ready/{r}" for r in range(W if sync else W + 1)]
        killed: set[int] = set()
        while any(p.poll() is None for p in procs) or killed:
            if kill_every is not None and next_kill == math.inf and store.check(ready):
                next_kill = time.monotonic() + kill_every
            if next_kill < math.inf and store.check([f"{_TAG}stop"]):
                next_kill = -math.inf  # the run is ending: no more kills
            if time.monotonic() >= next_kill > -math.inf:
                alive = [r for r in range(W) if procs[r].poll() is None]
                if alive:
                    victim = rng.choice(alive)
                    _kill_group(procs[victim], signal.SIGKILL)
                    killed.add(victim)
                    kills += 1
                next_kill += kill_every
            for r in sorted(killed):
                if procs[r].poll() is not None:  # the killed worker is gone: start it again
                    killed.discard(r)
                    argv_r, env_r, log_r = starts[r]
                    env_r["TORCHELASTIC_RESTART_COUNT"] = str(
                        int(env_r.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1)
                    procs[r] = subprocess.Popen(argv_r, env=env_r, stdout=log_r,
                                                stderr=subprocess.STDOUT,
                                                start_new_session=True)
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)
                   and r not in killed]
            if bad:
                error = f"rank {bad[0]} exited with code {procs[bad[0]].returncode}"
                break
            if time.monotonic() > deadline:
                error = f"timed out after {run_timeout:g} s"
                break
            time.sleep(0.1)
        if error is None:
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            if bad:
                error = f"rank {bad[0]} exited with code {procs[bad[0]].returncode}"
    finally:
        _stop_all(procs)
        for log in logs:
            log.close()
        if shards is not None:
            if not sync:
                try:
                    merged_samples = _merged_samples(shards.addresses, shards.token)
                except Exception as exc:  # noqa: BLE001 - reported, the run's result stands
                    merged_samples = None
                    print(f"could not read the shard's merged samples: {exc}", flush=True)
            shards.stop()
        del store
    job_seconds = time.perf_counter() - t0
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(W)
             if (run_dir / f"rank{r}.json").exists()]
    out: dict[str, Any] = {**header, "job_seconds": job_seconds, "error": error,
                           "kills": kills, "merged_samples": merged_samples}
    evaluator = run_dir / ("rank0.json" if sync else "evaluator.json")
    if error is not None or not ranks or ranks[0]["rank"] != 0 or not evaluator.exists():
        texts = [(run_dir / f"rank{r}.log").read_text(errors="replace")
                 for r in range(len(procs))]
        out["error"] = error or "no result from worker 0 or the evaluator"
        out["log_tail"] = texts[0][-3000:] + "".join(
            f"\n--- rank {r}\n{t[-1500:]}" for r, t in enumerate(texts)
            if r and ("Error" in t or "Traceback" in t))
        return out, None, ranks
    return out, {**ranks[0], **json.loads(evaluator.read_text())}, ranks


def _merged_samples(addresses: list[str], token: str | None) -> float:
    """The samples (inner steps) asynchronous DiLoCo's shards merged into the global model
    (the largest count over shards: every pseudo-gradient covers every shard's tensors)."""
    from stratagem.ps.transport import PSClient

    # The shard sits on the benchmark's private bridge (see the workers' environment above).
    os.environ["STRATAGEM_PS_ALLOW_PLAINTEXT"] = "1"
    with PSClient(addresses, token=token, timeout=10) as client:
        return max(float(h.get("outer_merged_samples", 0.0)) for h in client.health())


def shaped_links_usable(links: list[str], notes: list[str]) -> bool:
    """Whether the shaped (non-``lo``) links in ``links`` can be built here: root and working
    ``ip netns`` / ``tc``. When not, says why on stdout and in ``notes``."""
    from stratagem.testing.netns import NetnsUnavailable, check_netns

    shaped = [link for link in links if link != "lo"]
    if not shaped:
        return True
    try:
        if os.geteuid() != 0:
            raise NetnsUnavailable("shaped links need root (ip netns, tc)")
        check_netns()
    except NetnsUnavailable as e:
        print(f"cannot build shaped links ({e}); running loopback only", flush=True)
        notes.append(f"shaped links {shaped} skipped: {e}")
        return False
    return True


def run_matrix(links: list[str], seeds: Callable[[str], int], keys: list[str], topo: Any,
               notes: list[str], run: Callable[[str, str, int, Any, Path], dict[str, Any]],
               *, meta: dict[str, Any], tmp_prefix: str) -> list[dict[str, Any]]:
    """``run(key, link, seed, topo or None on lo, tmp)`` for every link, ``seeds(link)`` seeds
    and key, the keys' order rotated per seed so that no key always runs first (load drifts).

    ``topo`` (when not None) is brought up first, shaped per link and always taken down;
    SIGTERM and Ctrl-C stop the loop and keep the runs so far (a note says so). Sets
    ``meta["total_minutes"]``."""
    t_start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    signal.signal(signal.SIGTERM, _interrupt)  # -> KeyboardInterrupt: namespaces removed
    try:
        with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmpdir:
            if topo is not None:
                topo.up()
            for link in links:
                if link != "lo":
                    assert topo is not None
                    topo.shape(link)
                for seed in range(seeds(link)):
                    k = seed % len(keys)
                    for key in keys[k:] + keys[:k]:
                        runs.append(run(key, link, seed, None if link == "lo" else topo,
                                        Path(tmpdir)))
    except KeyboardInterrupt:
        print("interrupted: cleaning up and writing partial results", file=sys.stderr)
        notes.append("interrupted: partial results")
    finally:
        if topo is not None:
            topo.down()
    meta["total_minutes"] = (time.perf_counter() - t_start) / 60
    return runs


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` found (without importing it)."""
    from importlib import metadata

    for dist in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None


def _cpu_model() -> str:
    for line in read_text(Path("/proc/cpuinfo")).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    """The first CUDA device's name, None without one (asks torch only when a benchmark
    imported it already, else ``nvidia-smi``)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_available():
                return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
            return None
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            if names:
                return f"{len(names)}x {names[0]}"
    return None


def provenance(name: str, *, duration_s: float | None = None,
               command: str | None = None) -> dict[str, Any]:
    """The ledger fields of a result: what ran (commit, whether the tree had uncommitted
    changes outside ``results/``, command), when, with which versions, on what host, for how long."""
    script = Path(sys.argv[0])
    with contextlib.suppress(ValueError):
        script = script.resolve().relative_to(ROOT)
    # Changes to what does not run (results written earlier in the same `make bench`, the
    # docs, *.md) are not changes to what ran: the same files `stratagem bench` leaves out of
    # the code digest of its record.
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                 ":(exclude)benchmarks/results", ":(exclude)docs", ":(exclude,glob)**/*.md")
    return {
        "name": name,
        "commit": _git("rev-parse", "--short=12", "HEAD"),
        "dirty": None if dirty is None else bool(dirty),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command or " ".join(["python", str(script), *sys.argv[1:]]),
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "torchft": _version("torchft-nightly", "torchft"),
                     "grpcio": _version("grpcio")},
        "host": {"cores": os.cpu_count(), "cpu": _cpu_model(), "gpu": _gpu()},
        "duration_s": round(time.monotonic() - _STARTED if duration_s is None else duration_s,
                            1),
    }


def _ledger_header(record: dict[str, Any]) -> list[str]:
    v, h = record["versions"], record["host"]
    commit = record["commit"] or "unknown"
    if record.get("dirty"):
        commit += " (with uncommitted changes)"
    return [f"Commit {commit}, {record['date']}, {record['duration_s']:g} s. "
            f"Command: `{record['command']}`", "",
            f"Versions: Python {v['python']}, torch {v['torch']}, torchft {v['torchft']}, "
            f"grpcio {v['grpcio']}. Host: {h['cores']} cores ({h['cpu']}), "
            f"GPU: {h['gpu'] or 'none'}.", ""]


def write_result(name: str, results: Any, markdown: str | list[str], *,
                 out_dir: Path | str | None = None, duration_s: float | None = None,
                 command: str | None = None, quiet: bool = False) -> Path:
    """The one writer of a benchmark result: ``OUT_DIR/NAME.json`` (:func:`provenance` plus
    ``results``, inf/nan as null) and ``OUT_DIR/NAME.md`` (``markdown`` after a line with the
    commit, date, command, versions and host). ``out_dir`` defaults to ``results/``. Prints
    the markdown (unless ``quiet``) and ``wrote OUT_DIR/NAME.json and OUT_DIR/NAME.md``;
    returns the JSON path."""
    directory = Path(out_dir) if out_dir is not None else RESULTS
    if "/" in name or name.startswith(".") or not name:
        raise ValueError(f"a result name is a file stem, got {name!r}. Fix: pass the directory "
                         "as out_dir")
    directory.mkdir(parents=True, exist_ok=True)
    record = provenance(name, duration_s=duration_s, command=command)
    record["results"] = _clean(results)
    text = markdown if isinstance(markdown, str) else "\n".join(markdown)
    lines = text.rstrip("\n").split("\n")
    # The benchmark's title (if any) stays first; the ledger lines follow it.
    head, body = ([lines[0], ""], lines[1:]) if lines[0].startswith("# ") else ([], lines)
    while body and not body[0].strip():
        body = body[1:]
    (directory / f"{name}.md").write_text("\n".join([*head, *_ledger_header(record), *body])
                                          + "\n")
    path = directory / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    if not quiet:
        print()
        print(text)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return path


def payload(data: dict[str, Any]) -> Any:
    """A result JSON's benchmark payload: ``results`` of the ledger shape (or the whole of an
    older file, written before the ledger)."""
    return data["results"] if "results" in data and "commit" in data else data


def add_ledger_args(p: argparse.ArgumentParser, *, smoke: str) -> None:
    """``--smoke`` (described by ``smoke``: what the script runs then) and ``--out-dir``."""
    p.add_argument("--smoke", action="store_true",
                   help=f"a seconds-long check that the script runs end to end ({smoke}); "
                        "the result goes to a new temporary folder (or --out-dir), never to "
                        "benchmarks/results/")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="write NAME.json / NAME.md here (default: benchmarks/results/, or a "
                        "temporary folder with --smoke)")


def output_dir(args: argparse.Namespace) -> Path:
    """Where the result goes: ``--out-dir``; else a new temporary folder for ``--smoke``, else
    ``results/``. A smoke run refuses ``results/``: its figures are not results."""
    if args.out_dir is not None:
        directory = Path(args.out_dir)
    elif args.smoke:
        directory = Path(tempfile.mkdtemp(prefix="stratagem-bench-smoke-"))
    else:
        directory = RESULTS
    if args.smoke and directory.resolve() == RESULTS.resolve():
        raise SystemExit(f"--smoke never writes to {RESULTS}: its figures are not results. "
                         "Fix: drop --out-dir, or point it elsewhere")
    args.out_dir = str(directory)  # later calls (and child processes) use the same folder
    return directory


#: ``stratagem bench --quick`` (``make bench-quick``): small settings of every benchmark, on
#: loopback, chosen so that the whole profile finishes in at most 10 minutes on a 2-core
#: machine (timed once at c76d27d beside other work: 11.4 min; ps_demo_path, lm and
#: sharded_memory trimmed since, by about 2 minutes). Its figures show that each benchmark runs end to end, not results: the profile
#: writes them to a temporary folder (``--out-dir``) and records only its own timings (in
#: ``results/bench_quick``). A benchmark missing here runs its ``--smoke``.
QUICK_PROFILE: dict[str, list[str]] = {
    "mirrored_vs_ddp": ["--procs", "2", "--steps", "10", "--rounds", "4"],
    "ps_throughput": ["--mb", "2", "--seconds", "1", "--rounds", "1", "--shards", "1",
                      "--workers", "2"],
    "compression": ["--epochs", "1", "--seeds", "0", "--rows", "10000"],
    "convergence": ["--quick", "--links", "lo", "--workers", "2", "--max-epochs", "2",
                    "--strategies", "mirrored,ps-async"],
    "ckpt_hostile_memory": ["--gib", "1"],
    "diloco_compression": ["--quick", "--links", "lo", "--workers", "2", "--max-steps", "32",
                           "--period", "8", "--max-wall", "60"],
    "fault_tolerance": ["--nproc", "2", "--steps", "50", "--width", "64", "--modes", "plain,ft"],
    "ft_grid": ["--smoke"],  # 4 workers with kills do not fit the budget
    "ft_kills": ["--smoke"],
    "gpu": ["--smoke"],  # skipped without CUDA
    "heal_transport": ["--mib", "16", "--repeat", "2"],
    "hierarchical": ["--smoke"],  # anything more needs namespaces and 4 workers
    "import_time": ["--rounds", "2"],
    "lm": ["--quick", "--links", "lo", "--workers", "2", "--max-steps", "24",
           "--strategies", "mirrored,diloco", "--max-wall", "60"],
    "ps_demo_path": ["--rounds", "1", "--epochs", "1", "--rows", "mirrored,ps shm + doorbell"],
    "ps_prefetch": ["--hidden", "256", "--batch", "64", "--steps", "10", "--rounds", "2",
                    "--modes", "async"],
    "sharded_memory": ["--smoke"],  # one launch; its three launches took 71 s
}


def write_outputs(out: Path, table: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                  runs: list[dict[str, Any]], *, wrote: str,
                  plot: Callable[[], None] | None = None) -> None:
    """:func:`write_result` of ``OUT.md`` / ``OUT.json`` (``results``: meta, summary rows and
    runs), then call ``plot`` (if any, it writes ``OUT.png``)."""
    duration = meta.get("total_minutes")
    write_result(out.name, {"meta": meta, "summary": rows, "runs": runs}, table,
                 out_dir=out.parent, duration_s=None if duration is None else 60 * duration)
    if plot is not None:
        plot()
        if out.with_suffix(".png").exists():
            print(f"wrote {out.with_suffix('.png')}")


def write_report(name: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                 lines: list[str], *, out_dir: Path | str | None = None) -> None:
    """:func:`write_result` of ``NAME.json`` (``results``: meta and rows) and ``NAME.md``
    (``lines``)."""
    write_result(name, {"meta": meta, "rows": rows}, lines, out_dir=out_dir)


def read_text(path: Path) -> str:
    """``path``'s text, or "" when it does not exist (yet) or cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return ""


def ft_stamps(out: Path, slot: int) -> list[tuple[int, float]]:
    """``(step, time)`` of every step ``tests/ft_scripts/train_ft.py`` (or the torchft
    baseline) committed on ``slot``, from ``OUT/times.<slot>``; a line still being written is
    skipped."""
    rows = []
    for line in read_text(out / f"times.{slot}").splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def ft_progress(out: Path, slot: int) -> int:
    """The last step ``slot`` wrote to ``OUT/progress.<slot>`` (0 before the first, or while
    the file is being rewritten)."""
    try:
        return int(read_text(out / f"progress.{slot}") or 0)
    except ValueError:
        return 0


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]`` (a comma-list flag)."""
    return [s.strip() for s in text.split(",") if s.strip()]


def choose(text: str, table: Mapping[str, Any], what: str = "strategies") -> list[str] | None:
    """The keys of the comma list ``text``, or None (after saying which on stderr) when one
    is not in ``table``."""
    keys = split_list(text)
    unknown = [s for s in keys if s not in table]
    if unknown:
        print(f"unknown {what} {unknown}; choose from {list(table)}", file=sys.stderr)
        return None
    return keys


def seeds_per_link(spec: str, links: list[str]) -> dict[str, int] | None:
    """``--seeds``: ``N`` for every link, or ``LINK=N,LINK=N`` covering every link; None
    (after saying why on stderr) when it is neither."""
    try:
        if "=" in spec:
            per_link = {k.strip(): int(v) for k, v in
                        (item.split("=", 1) for item in spec.split(","))}
            missing_links = [link for link in links if link not in per_link]
            if missing_links:
                raise ValueError(f"no seed count for {missing_links}")
        else:
            per_link = dict.fromkeys(links, int(spec))
    except ValueError as e:
        print(f"--seeds must be N or LINK=N,LINK=N covering every link, got {spec!r} "
              f"({e})", file=sys.stderr)
        return None
    return per_link


def matrix_parser(doc: str | None, *, table: Mapping[str, Any], quick: list[str],
                  quick_links: str) -> argparse.ArgumentParser:
    """The options that ``convergence.py`` and ``lm.py`` share before their own: seeds,
    links, strategies (the keys of ``table``), ``--quick`` and the worker count."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="3",
                   help="number of seeds (0..N-1), or per link: lo=3,100mbit=3,20mbit=1")
    p.add_argument("--links", default="lo,100mbit,20mbit",
                   help="comma list: lo and/or tc rates such as 100mbit,20mbit")
    p.add_argument("--strategies", default=",".join(table),
                   help=f"comma list from {', '.join(table)}")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: 1 seed, {quick_links.replace(',', ' + ')}, "
                        f"{', '.join(quick)}")
    p.add_argument("--workers", type=int, default=4)
    add_ledger_args(p, smoke=f"2 workers on loopback, 1 seed, 2 steps, {quick[0]} unless "
                             "--strategies says otherwise")
    return p


def smoke_matrix(args: argparse.Namespace, p: argparse.ArgumentParser, first: str) -> None:
    """``--smoke`` of a link x seed x strategy script: 1 seed, loopback, 2 workers, ``first``
    only unless ``--strategies`` was given, 2 steps evaluated after each; the output under
    :func:`output_dir` with the name of ``--out``."""
    args.seeds, args.links, args.workers = "1", "lo", 2
    if args.strategies == p.get_default("strategies"):
        args.strategies = first
    args.max_steps, args.eval_every, args.timeout, args.run_timeout = 2, 1, 60.0, 120.0
    args.out = str(output_dir(args) / Path(args.out).name)


def parse_matrix_args(p: argparse.ArgumentParser, argv: list[str] | None, *, out: Path,
                      quick: list[str], quick_links: str) -> argparse.Namespace:
    """Add the output and the (hidden) child-process options to ``p`` and parse ``argv``;
    ``--quick`` means 1 seed, ``quick_links`` and the ``quick`` strategies unless those
    were given; ``--smoke`` is :func:`smoke_matrix`."""
    p.add_argument("--out", default=str(out),
                   help="output path without extension (.json, .md, .png are written); a "
                        "bare name goes under --out-dir")
    p.add_argument("--from-json", metavar="PATH",
                   help="only re-render the table and plot from an earlier run's JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--evaluator", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = "1"
        if args.links == p.get_default("links"):
            args.links = quick_links
        if args.strategies == p.get_default("strategies"):
            args.strategies = ",".join(quick)
    if args.smoke:
        smoke_matrix(args, p, quick[0])
    elif args.out_dir is not None:
        args.out = str(Path(args.out_dir) / Path(args.out).name)
    return args


def figure(panels: int) -> tuple[Any, Any, list[str]]:
    """A matplotlib (Agg) figure of ``panels`` plots side by side: the figure, its axes and
    the colour cycle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 5.0), squeeze=False)
    return fig, axes[0], plt.rcParams["axes.prop_cycle"].by_key()["color"]


def draw_seeds(ax: Any, runs: list[dict[str, Any]], link: str, strategies: list[str],
               colors: list[str], target: float) -> list[tuple[float, float]]:
    """One line per successful run on ``link`` (a colour per strategy, one legend entry per
    strategy) of its ``curve`` against training wall time on a log axis, from t > 0, and a
    dashed line at ``target``. Returns every (wall, value) point drawn."""
    drawn: list[tuple[float, float]] = []
    for i, key in enumerate(strategies):
        labelled = False
        for r in runs:
            if r["strategy"] != key or r["link"] != link or r.get("error") is not None:
                continue
            points = [(w, v) for w, _, v in r["curve"] if w > 0]
            if not points:
                continue
            drawn += points
            wall, value = zip(*points, strict=True)
            ax.plot(wall, value, color=colors[i % len(colors)], lw=1.1, alpha=0.8,
                    label=None if labelled else key)
            labelled = True
    ax.axhline(target, color="k", ls="--", lw=0.8)
    ax.set_title(f"link: {link}")
    ax.set_xscale("log")
    return drawn


def save_figure(fig: Any, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rewrite_from_json(path: str, out: Path,
                      write_results: Callable[[dict[str, Any], list[dict[str, Any]],
                                               list[str], Path], None]) -> int:
    """``--from-json PATH``: re-render the table (and plot) of an earlier run, no training."""
    data = payload(json.loads(Path(path).read_text()))
    meta, runs = data["meta"], data["runs"]
    write_results(meta, runs, list(meta["strategies"]), out)
    return 0


def dispatch(args: argparse.Namespace, *, worker: Callable[[str], int],
             evaluator: Callable[[str], int],
             write_results: Callable[[dict[str, Any], list[dict[str, Any]], list[str], Path],
                                     None]) -> int | None:
    """Run what ``--worker CFG``, ``--evaluator CFG`` or ``--from-json PATH`` asks for and
    return its exit code; None when none was given (the parent of a benchmark run)."""
    if args.worker:
        return worker(args.worker)
    if args.evaluator:
        return evaluator(args.evaluator)
    if args.from_json:
        return rewrite_from_json(args.from_json, Path(args.out), write_results)
    return None
