"""Plumbing shared by the benchmark scripts (not a benchmark itself).

- :func:`run_job`: start one multi-process job (workers, an optional evaluator and PS shard,
  in network namespaces on a shaped link or on loopback), wait for it, stop it, and read the
  per-rank JSON results (``convergence.py``, ``lm.py`` and through them
  ``diloco_compression.py`` and ``hierarchical.py``).
- :func:`shaped_links_usable` and :func:`run_matrix`: the link x seed x strategy loop of those
  scripts, with the namespace set-up and clean-up on SIGTERM / Ctrl-C.
- :func:`write_outputs` (the ``.md`` / ``.json`` results of those scripts) and
  :func:`write_report` (the ``results/NAME.json`` / ``.md`` of the PS micro-benchmarks).

Every script puts this folder first on ``sys.path`` (it is the script's own folder), so
``from _common import ...`` works both when run and when imported by another benchmark.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


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
            job_env: dict[str, str] | None = None
            ) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """One job of ``script``: ``workers`` processes ``script --worker CFG`` (rank r in
    namespace r, or r // (workers // nnodes) with ``nnodes``; loopback when ``topo`` is None),
    plus ``script --evaluator CFG`` when not ``sync`` and one PS shard when ``needs_ps``.

    ``cfg`` is written to ``run_dir/cfg.json``; ``job_env`` is added to every process's
    environment. Returns ``(out, chief, ranks)``: ``out`` is ``header`` plus ``job_seconds``
    and ``error`` (and ``log_tail`` when the job failed or left no result); ``chief`` is worker
    0's result merged with the evaluator's (None when the job failed); ``ranks`` the workers'
    results that exist."""
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
    logs = []
    t0 = time.perf_counter()
    error = None
    try:
        if needs_ps:
            shards = start_ps_shards(1, host=host, env={**os.environ, **job_env})
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
            procs.append(subprocess.Popen([*argv, str(cfg_path)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + run_timeout
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
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
            shards.stop()
        del store
    job_seconds = time.perf_counter() - t0
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(W)
             if (run_dir / f"rank{r}.json").exists()]
    out: dict[str, Any] = {**header, "job_seconds": job_seconds, "error": error}
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
               *, tmp_prefix: str) -> list[dict[str, Any]]:
    """``run(key, link, seed, topo or None on lo, tmp)`` for every link, ``seeds(link)`` seeds
    and key, the keys' order rotated per seed so that no key always runs first (load drifts).

    ``topo`` (when not None) is brought up first, shaped per link and always taken down;
    SIGTERM and Ctrl-C stop the loop and keep the runs so far (a note says so)."""
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
    return runs


def write_outputs(out: Path, table: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                  runs: list[dict[str, Any]], *, wrote: str,
                  plot: Callable[[], None] | None = None) -> None:
    """Write ``table`` to ``out.md`` and meta, summary rows and runs to ``out.json``, call
    ``plot`` (if any), then print the table and ``wrote OUT.md`` + ``wrote``."""
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps(
        _clean({"meta": meta, "summary": rows, "runs": runs}), indent=1, default=str))
    if plot is not None:
        plot()
    print()
    print(table)
    print(f"wrote {out.with_suffix('.md')}{wrote}")


def write_report(name: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                 lines: list[str]) -> None:
    """``results/NAME.json`` (meta and rows) and ``results/NAME.md`` (``lines``), then print
    the lines."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                     indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
