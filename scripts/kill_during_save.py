"""Kill during save: SIGKILL a process that saves a few-MB model in a loop, at
random instants, and check that the newest intact checkpoint always loads and equals one of
the saved versions.

    .venv/bin/python scripts/kill_during_save.py --trials 20 --seed 0

Prints one line per trial and ``intact x/N``; exit code 0 only when every trial restored.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAVER = r"""
import sys, torch
import stratagem as sg
path = sys.argv[1]
s = sg.OneDevice()
model = s.prepare(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512)))
start = int(sys.argv[2])
for i in range(start, start + 10**6):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(i))  # version i: every parameter equals i
    print("saving", i, flush=True)
    s.save(path, model=model, step=i, keep_last=2)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=1.5,
                    help="kill at a uniform random delay in [0, max-delay] s after the first save")
    args = ap.parse_args(argv)
    import torch

    import stratagem as sg

    rng = random.Random(args.seed)
    src = str(Path(__file__).resolve().parents[1] / "src")
    # Prepend src without leaving an empty entry (which would put the cwd on sys.path).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
    work = Path(tempfile.mkdtemp(prefix="sg-kill-save-"))
    (work / "saver.py").write_text(SAVER)
    path = work / "ckpt"
    ok, started, mid_write = 0, 0, 0
    for trial in range(args.trials):
        before = set((path.parent / ".ckpt.versions").glob("tmp-*"))
        proc = subprocess.Popen([sys.executable, str(work / "saver.py"), str(path),
                                 str(started)], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # the first save has begun: torch is imported
        delay = rng.uniform(0, args.max_delay)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
        versions = [int(x.split()[1]) for x in rest.splitlines() if x.startswith("saving")]
        last_started = max(versions, default=started)
        started = last_started + 1
        tmp = set((path.parent / ".ckpt.versions").glob("tmp-*")) - before
        mid_write += bool(tmp)
        s = sg.OneDevice()
        model = s.prepare(torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                              torch.nn.Linear(1024, 512)))
        try:
            step = s.restore(path, model=model)["step"]
            values = {float(v) for p in model.parameters() for v in p.detach().unique()}
            good = values == {float(step)} and step <= last_started
        except sg.CheckpointError as exc:
            step, good = f"CheckpointError: {exc}", False
        ok += good
        print(f"trial {trial:2d}: killed after {delay:.3f} s while saving version "
              f"{last_started}; restored step {step}; "
              f"{'OK' if good else 'FAILED'}{' (killed mid-write)' if tmp else ''}", flush=True)
    print(f"intact {ok}/{args.trials} (kills that left a partial version behind: {mid_write})")
    return 0 if ok == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
