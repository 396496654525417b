"""Training through failures, side by side: stratagem fault-tolerant vs
restart-all + resume vs torchft written by hand, with a worker SIGKILLed every T seconds.

Work: ``stratagem.demo.MLP`` (``--width`` hidden units) on MNIST-5k, 4 workers, a global
batch of 60 (15 per worker), SGD(0.05, momentum 0.9), ``--steps`` steps with ``--step-sleep``
seconds of simulated extra compute per step. Every system trains the same fixed number of
steps (not a wall budget), so the final accuracies compare the same number of updates and
the goodput compares the wall time each system needed for them. Systems:

- ``ft-mirrored``, ``ft-diloco``: ``stratagem run --nproc 4 --fault-tolerant``
  ``tests/ft_scripts/train_ft.py --strategy mirrored|diloco`` (a dead worker restarted alone,
  healed from a live peer; DiLoCo: period 4, outer lr 0.7, outer momentum 0: with 0.9 and the
  inner SGD momentum it diverges on this MLP, 20 % accuracy);
- ``restart-all``: ``stratagem run --nproc 4 --max-restarts N`` with ``Mirrored`` (torchrun
  restarts the whole group on a failure), ``strategy.save`` every ``--ckpt-every`` steps and
  ``strategy.restore`` at start-up;
- ``torchft``: ``benchmarks/_ft_grid_torchft.py`` (torchft ``Manager`` + Lighthouse on
  127.0.0.1 + ``ProcessGroupGloo`` + ``manager.allreduce`` of the gradients, its HTTP heal
  transport, which unpickles: loopback only), supervised here (a dead worker restarted alone).

Kills: from the first committed step, every T seconds (``--periods``), a random live worker
(``random.Random(--seed)``; live: its process runs and has committed a step since it
started) gets SIGKILL; no kill once the job is past ``--kill-until`` (80 %) of its steps.
Plus one fault-free run of each system (the reference). A run that does not finish within
``--max-wall`` (e.g. restart-all when kills come faster than a restart) is reported as such.

Columns (``timeline``: for each step number, the first time any worker committed it):

- goodput: committed samples per second (each worker's share, 15 samples, for every distinct
  step it committed; a step replayed after a restore counts once) over the same system's
  fault-free run;
- time lost per failure: kill -> the first commit of a step past the last step committed
  before the kill, minus the median step of the fault-free run (restart-all includes the
  replayed steps since its checkpoint);
- heal/restart: kill -> the killed worker's (replacement's) first committed step;
- final accuracy (test set, 1000 digits; ``--model gpt``: the validation loss of the
  character-level GPT of ``train_ft.py --model gpt``, AdamW, the same for torchft), bytes moved per heal (stratagem: the
  ``SafeHealTransport``'s count of the bytes the joiner received, via
  ``FaultTolerantComm.last_heal_bytes``; torchft: the tensors of the state dict received;
  restart-all: the checkpoint read by each of the 4 workers at each restart).

    PYTHONPATH=src python benchmarks/ft_grid.py [--periods 15,30,60] [--steps 1000]
        [--step-sleep 0.05] [--ckpt-every 50] [--systems ft-mirrored,ft-diloco,restart-all,torchft]

Writes benchmarks/results/ft_grid.{json,md} (``--smoke``: a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    add_ledger_args,
    ft_progress,
    ft_stamps,
    output_dir,
    read_text,
    split_list,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "ft_scripts" / "train_ft.py"
TORCHFT = Path(__file__).resolve().parent / "_ft_grid_torchft.py"
NPROC = 4
SHARE = 15  # samples per worker per step (global batch 60)
SYSTEMS = ("ft-mirrored", "ft-diloco", "restart-all", "torchft")


def _live(out: Path) -> list[int]:
    """Slots whose latest process runs and has committed a step since it started."""
    live = []
    for s in range(NPROC):
        pids = read_text(out / f"pids.{s}").split()
        if not pids:
            continue
        try:
            os.kill(int(pids[-1]), 0)
            started = (out / f"pids.{s}").stat().st_mtime
            if (out / f"times.{s}").stat().st_mtime > started + 1e-3:
                live.append(s)
        except OSError:
            continue
    return live


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (the launcher starts torchrun in its own session)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(read_text(entry / "stat").rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


class _TorchftJob:
    """The torchft baseline's supervisor: the Lighthouse on 127.0.0.1, 4 workers, a dead
    worker restarted alone (unless another already finished: then the job is over)."""

    def __init__(self, out: Path, worker_args: list[str], env: dict[str, str]) -> None:
        from torchft.coordination import LighthouseServer

        from stratagem.ft.launch import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS

        # The same Lighthouse settings as stratagem's QuorumService (stratagem.ft.launch).
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                           join_timeout_ms=JOIN_TIMEOUT_MS,
                                           heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
                                           quorum_tick_ms=50)
        self.cmd = [sys.executable, str(TORCHFT), "--out", str(out), *worker_args]
        # torchrun (the stratagem runs) sets OMP_NUM_THREADS=1 for several workers: the same.
        self.env = {**env, "FTG_LIGHTHOUSE": self.lighthouse.address(), "OMP_NUM_THREADS": "1"}
        self.log = open(out / "torchft.log", "ab")  # noqa: SIM115 - closed in finish()
        self.procs = {s: self._start(s) for s in range(NPROC)}
        self.finished: set[int] = set()
        self.failed: str | None = None

    def _start(self, slot: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.cmd, env={**self.env, "FTG_SLOT": str(slot)},
                                stdout=self.log, stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        for s, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None or s in self.finished:
                continue
            if rc == 0:
                self.finished.add(s)
            elif rc == -signal.SIGKILL and not self.finished:
                self.procs[s] = self._start(s)
            elif rc == -signal.SIGKILL:
                self.finished.add(s)  # killed after the others finished: nothing to heal from
            else:
                self.failed = f"torchft worker {s} exited with {rc}"
                return 1
        return 0 if len(self.finished) == NPROC else None

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def finish(self) -> None:
        self.log.close()
        self.lighthouse.shutdown()


def run(system: str, period: float | None, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"ftgrid-{system}-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    common = ["--steps", str(args.steps), "--step-sleep", str(args.step_sleep),
              "--width", str(args.width), "--timeout", str(args.timeout)]
    data = ["--data", "charlm", "--model", "gpt"] if args.model == "gpt" else [
        "--data", "mnist", "--model", "mlp"]
    torchft_job: _TorchftJob | None = None
    proc: subprocess.Popen[bytes] | None = None
    launcher = [sys.executable, "-m", "stratagem.cli", "run", "--nproc", str(NPROC)]
    train = [str(TRAIN), "--out", str(out), *data, *common]
    if system in ("ft-mirrored", "ft-diloco"):
        cmd = [*launcher, "--fault-tolerant", "--max-restarts", "50", *train,
               "--strategy", system.removeprefix("ft-")]
        if system == "ft-diloco":  # period 4, outer lr 0.7; momentum 0.9 diverges here
            cmd += ["--outer-momentum", "0"]
    elif system == "restart-all":
        cmd = [*launcher, "--max-restarts", "50", *train, "--strategy", "mirrored",
               "--ckpt-dir", str(out / "ckpt"), "--ckpt-every", str(args.ckpt_every)]
    else:
        cmd = []
    t0 = time.time()
    log = open(out / "job.log", "wb")  # noqa: SIM115
    if cmd:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    else:
        torchft_job = _TorchftJob(out, [*common, "--model", args.model], env)

    def poll() -> int | None:
        if proc is not None:
            return proc.poll()
        assert torchft_job is not None
        return torchft_job.poll()

    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    next_kill: float | None = None
    # A running max: the workers rewrite their progress files together after each step, so
    # one read may find them all truncated.
    progress = 0
    deadline = time.monotonic() + args.max_wall
    rc = None
    while rc is None:
        rc = poll()
        if rc is not None:
            break
        if time.monotonic() > deadline:
            rc = 124
            break
        time.sleep(0.05)
        if period is None:
            continue
        if next_kill is None:
            if any(read_text(out / f"times.{s}") for s in range(NPROC)):
                next_kill = time.time() + period
            continue
        progress = max(progress, *(ft_progress(out, s) for s in range(NPROC)))
        if time.time() < next_kill or progress >= args.kill_until * args.steps:
            continue
        live = _live(out)
        if not live:
            continue
        slot = rng.choice(live)
        before = max((st for s in range(NPROC) for st, _ in ft_stamps(out, s)), default=0)
        pid = int(read_text(out / f"pids.{slot}").split()[-1])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            at = time.time()
            kills.append({"slot": slot, "at": at, "step_before": before})
            print(f"  {system} T={period:g}: SIGKILL slot {slot} (pid {pid}) after step "
                  f"{before}", file=sys.stderr, flush=True)
            next_kill = at + period
    wall = time.time() - t0
    if rc != 0:
        if proc is not None:
            _kill_tree(proc.pid)
        if torchft_job is not None:
            torchft_job.kill()
    if torchft_job is not None:
        torchft_job.finish()
    log.close()
    if rc != 0:
        tail = read_text(out / "job.log")[-3000:] + read_text(out / "torchft.log")[-3000:]
        raise SystemExit(f"{system} (T={period}) failed with {rc} (see {out}):\n{tail}")
    return _measure(system, period, out, kills, wall, args)


def _measure(system: str, period: float | None, out: Path, kills: list[dict[str, Any]],
             wall: float, args: argparse.Namespace) -> dict[str, Any]:
    stamps = {s: ft_stamps(out, s) for s in range(NPROC)}
    first: dict[int, float] = {}
    for rows in stamps.values():
        for step, t in rows:
            first[step] = min(t, first.get(step, t))
    timeline = sorted(first.values())
    t_start, t_end = timeline[0], max(t for rows in stamps.values() for _, t in rows)
    diffs = [b - a for a, b in zip(timeline, timeline[1:])]
    slot_steps = sum(len({st for st, _ in rows}) for rows in stamps.values())
    accs = []
    for s in range(NPROC):
        text = read_text(out / f"acc.{s}").split()
        if text:
            accs.append(float(text[0]))
    # Heals after the first kill (the start-up syncs at step 0 do not count).
    first_kill = kills[0]["at"] if kills else float("inf")
    heals = [int(f[1]) for s in range(NPROC) for f in map(str.split, read_text(
        out / f"heal.{s}").splitlines()) if len(f) == 4 and float(f[3]) > first_kill]
    result: dict[str, Any] = {
        "system": system, "period_s": period, "kills": len(kills), "wall_s": wall,
        "train_s": t_end - t_start, "steps": max(first), "slot_steps": slot_steps,
        "samples_per_s": slot_steps * SHARE / (t_end - t_start),
        "median_step_ms": 1e3 * statistics.median(diffs[len(diffs) // 10:]),
        "accuracy": statistics.mean(accs) if accs else float("nan"),
        "finished": len(accs),
        "restarts_per_slot": [len(read_text(out / f"pids.{s}").split()) - 1 for s in range(NPROC)],
        "heals": len(heals), "heal_bytes": heals,
        "kill_slots": [k["slot"] for k in kills],
    }
    if system == "restart-all":
        ckpt = out / "ckpt" / "ckpt"
        if ckpt.exists():
            result["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.resolve().iterdir()
                                             if f.is_file())
    lost, back = [], []
    for k in kills:
        later = [t for step, t in first.items() if step > k["step_before"] and t > k["at"]]
        lost.append(min(later) - k["at"] if later else float("nan"))
        mine = [t for _, t in stamps[k["slot"]] if t > k["at"]]
        back.append(mine[0] - k["at"] if mine else float("nan"))
    result["kill_to_next_commit_s"] = lost
    result["kill_to_replacement_step_s"] = back
    return result


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.mean(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--periods", default="15,30,60", help="seconds between kills")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp",
                   help="mlp: the MNIST-5k MLP (metric: test accuracy); gpt: the LM demo's "
                        "character-level GPT (metric: validation loss)")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-until", type=float, default=0.8,
                   help="no kill once the job is past this fraction of its steps (a replacement "
                        "must have time to come back before the others finish)")
    p.add_argument("--max-wall", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--out", default="ft_grid", help="the result's name: OUT.{json,md}")
    add_ledger_args(p, smoke="ft-mirrored only, fault-free, 2 workers, 3 steps")
    args = p.parse_args()
    if args.smoke:
        global NPROC
        NPROC = 2
        args.periods, args.steps, args.step_sleep, args.width = "", 3, 0.0, 16
        if args.systems == p.get_default("systems"):
            args.systems = "ft-mirrored"
    out_dir = output_dir(args)
    systems = split_list(args.systems)
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    periods = [float(x) for x in split_list(args.periods)]
    rows: list[dict[str, Any]] = []
    free: dict[str, dict[str, Any]] = {}
    for system in systems:
        free[system] = r = run(system, None, args)
        r["goodput_vs_fault_free"] = 1.0
        rows.append(r)
        print(r, flush=True)
    for period in periods:
        for system in systems:
            try:
                r = run(system, period, args)
            except SystemExit as exc:
                print(exc, file=sys.stderr, flush=True)
                rows.append({"system": system, "period_s": period, "error": str(exc)[:2000]})
                continue
            ref = free[system]
            r["goodput_vs_fault_free"] = r["samples_per_s"] / ref["samples_per_s"]
            r["time_lost_per_failure_s"] = [x - ref["median_step_ms"] / 1e3
                                            for x in r["kill_to_next_commit_s"]]
            r["accuracy_delta_points"] = 100 * (r["accuracy"] - ref["accuracy"])
            r["metric_vs_fault_free"] = r["accuracy"] / ref["accuracy"]
            rows.append(r)
            print(r, flush=True)
    work, metric = (("the character-level GPT (2 layers, 64 wide, AdamW)", "validation loss")
                    if args.model == "gpt" else ("MNIST-5k MLP", "accuracy"))
    lines = [f"`PYTHONPATH=src python benchmarks/ft_grid.py --periods {args.periods} "
             f"--systems {args.systems} --steps {args.steps} --step-sleep {args.step_sleep} "
             f"--width {args.width} --ckpt-every {args.ckpt_every} --seed {args.seed} "
             f"--kill-until {args.kill_until} --model {args.model}` "
             f"({NPROC} workers, {work}, a random live worker SIGKILLed every T s)", "",
             "| T s | system | kills | goodput vs fault-free | time lost per failure s (mean; "
             f"each) | kill -> replacement's first step s (mean; max) | {metric} | bytes per "
             "heal | median step ms | train s |",
             "|---:|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {int(r['period_s'])} | {r['system']} | | did not finish within "
                         f"--max-wall {args.max_wall:g} s | | | | | | |")
            continue
        lost = r.get("time_lost_per_failure_s", [])
        back = r["kill_to_replacement_step_s"]
        if r["system"] == "restart-all":
            per_heal = NPROC * r.get("checkpoint_bytes", 0) if r["kills"] else 0
        else:
            per_heal = int(_mean([float(b) for b in r["heal_bytes"]])) if r["heal_bytes"] else 0
        lines.append(
            f"| {'none' if r['period_s'] is None else int(r['period_s'])} | {r['system']} | "
            f"{r['kills']} | {r['goodput_vs_fault_free']:.2f} | "
            + (f"{_mean(lost):.2f}; " + ", ".join(f"{x:.1f}" for x in lost) if lost else "")
            + " | "
            + (f"{_mean(back):.1f}; {max(back):.1f}" if back else "")
            + f" | {r['accuracy']:.4f} | {per_heal} | {r['median_step_ms']:.1f} | "
            f"{r['train_s']:.1f} |")
    lines += ["", "Bytes per heal: stratagem, what the joiner's SafeHealTransport received; "
              "torchft, the tensors of the state dict it received; restart-all, the "
              "checkpoint times 4 workers reading it."]
    write_report(args.out, {"argv": sys.argv[1:], "nproc": NPROC}, rows, lines,
                 out_dir=out_dir)


if __name__ == "__main__":
    main()
