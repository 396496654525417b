"""Async chaos: EASGD async (or ``--strategy ps-async``) with 4 workers on MNIST-5k, one worker SIGKILLed about
every ``--kill-every`` seconds and restarted alone by ``sg.launch(restart="failed")``; the
final center accuracy is compared with a fault-free run of the same job.

    .venv/bin/python scripts/chaos_async.py --workers 4 --epochs 8 --kill-every 10

Each worker is its own single-process job (``comm=sg.Comm.single()``; the center lives on a
parameter-server shard), trains on its quarter of the data and records its position (epoch,
step in epoch) in a small JSON file every few steps; a restarted worker starts from the
current center (registration: first wins) and continues from its recorded position, so the
faulty run does about as much work as the fault-free one (the steps since the last record are
redone). Prints both accuracies, the number of kills and the wall times as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import stratagem as sg
    from stratagem.data import DistributedLoader
    from stratagem.demo import MLP, load_mnist5k

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    work = Path(cfg["dir"])
    (work / f"pid{rank}").write_text(str(os.getpid()))
    torch.manual_seed(rank + 1000 * attempt)
    (train, test) = load_mnist5k()
    s: sg.Strategy
    if cfg["strategy"] == "ps-async":
        s = sg.ParameterServer(mode="async", comm=sg.Comm.single(), timeout=60)
    else:
        s = sg.ElasticAveraging(mode="async", period=cfg["period"],
                                moving_rate=cfg["moving_rate"], comm=sg.Comm.single(), timeout=60)
    with s.scope():
        torch.manual_seed(0)
        model = MLP()
        # Downpour applies every worker's gradient to the shared model as it arrives: SGD with
        # momentum 0.9 at EASGD's lr diverged (chance accuracy); Adam as in examples/mnist.py.
        opt: torch.optim.Optimizer = (
            torch.optim.Adam(model.parameters(), lr=2e-3) if cfg["strategy"] == "ps-async"
            else torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9))
        model, opt = s.prepare(model, opt)  # a restarted worker starts from the shared model
    loader = DistributedLoader(train, cfg["batch"] * world, num_replicas=world, replica_id=rank,
                               seed=0)
    progress = work / f"progress{rank}.json"
    if progress.exists():
        loader.load_state_dict(json.loads(progress.read_text()))
    for epoch in range(loader.epoch, cfg["epochs"]):
        loader.set_epoch(epoch)
        for x, y in loader:
            s.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            if loader.step_in_epoch % 5 == 0:
                tmp = progress.with_suffix(".tmp")
                tmp.write_text(json.dumps(loader.state_dict()))
                os.replace(tmp, progress)
    (work / f"done{rank}").write_text("1")
    center = s.eval_model(model)
    with torch.no_grad():
        acc = float((center(test[0]).argmax(1) == test[1]).float().mean())
    s.close()
    return {"rank": rank, "attempt": attempt, "finished": time.time(), "accuracy": acc}


def _killer(work: Path, workers: int, every: float, stop: threading.Event,
            kills: list[tuple[float, int]], rng: random.Random) -> None:
    t0 = time.time()
    while not stop.wait(every * rng.uniform(0.8, 1.2)):
        live = [r for r in range(workers) if (work / f"pid{r}").exists()
                and not (work / f"done{r}").exists()]
        if not live:
            continue
        r = rng.choice(live)
        pid = int((work / f"pid{r}").read_text())
        try:
            os.kill(pid, signal.SIGKILL)
            (work / f"pid{r}").unlink()
            kills.append((round(time.time() - t0, 1), r))
            print(f"[chaos] t={time.time() - t0:.1f}s SIGKILL worker {r} (pid {pid})",
                  flush=True)
        except ProcessLookupError:
            pass


def run(cfg: dict[str, Any], workers: int, kill_every: float | None, seed: int) -> dict[str, Any]:
    import tempfile

    import stratagem as sg

    work = Path(tempfile.mkdtemp(prefix="sg-chaos-"))
    cfg = {**cfg, "dir": str(work)}
    stop = threading.Event()
    kills: list[tuple[float, int]] = []
    killer = None
    if kill_every:
        killer = threading.Thread(target=_killer, args=(work, workers, kill_every, stop, kills,
                                                        random.Random(seed)), daemon=True)
        killer.start()
    t0 = time.time()
    try:
        results = sg.launch(worker, nprocs=workers, num_ps=1, args=(cfg,),
                            max_restarts=1000 if kill_every else 0, restart="failed")
    finally:
        stop.set()
    last = max(results, key=lambda r: r["finished"])
    return {"accuracy": last["accuracy"], "seconds": round(time.time() - t0, 1),
            "kills": kills, "attempts": [r["attempt"] for r in results]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", choices=["easgd-async", "ps-async"], default="easgd-async")
    args = ap.parse_args(argv)
    cfg = {"strategy": args.strategy, "epochs": args.epochs, "batch": 32, "lr": 0.05,
           "period": 4, "moving_rate": 0.1}
    clean = run(cfg, args.workers, None, args.seed)
    print("[chaos] fault-free:", json.dumps(clean), flush=True)
    faulty = run(cfg, args.workers, args.kill_every, args.seed)
    print("[chaos] faulty:", json.dumps(faulty), flush=True)
    gap = abs(clean["accuracy"] - faulty["accuracy"]) * 100
    print(json.dumps({"strategy": args.strategy, "fault_free_accuracy": clean["accuracy"],
                      "faulty_accuracy": faulty["accuracy"], "gap_points": round(gap, 2),
                      "kills": len(faulty["kills"]), "fault_free_s": clean["seconds"],
                      "faulty_s": faulty["seconds"]}), flush=True)
    return 0 if gap <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
