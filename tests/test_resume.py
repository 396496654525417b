"""Resuming: portable checkpoints across strategies and worker counts, exact
resume, and with real processes a SIGKILLed worker restarted by ``stratagem run
--max-restarts`` (bitwise equal to an uninterrupted run) and a SIGTERM preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from helpers import make_data, make_model
from torch import nn

import stratagem as sg
from stratagem import cli
from stratagem.testing import run_ranks

SRC = str(Path(cli.__file__).resolve().parent.parent)
DATA = make_data(256)


def _prepared(strategy: sg.Strategy, seed: int = 0, lr: float = 0.05):
    with strategy.scope():
        model = make_model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        return strategy.prepare(model, opt)


def _train(strategy: sg.Strategy, model, opt, steps: int, epoch: int = 0) -> None:
    loader = strategy.distribute_dataset(DATA, 48, seed=epoch)
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _saved(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(path / "model.safetensors")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------- portability (threads)
@pytest.mark.timeout(60)
def test_mirrored_2_to_easgd_3_model_is_center_and_every_start(tmp_path: Path) -> None:
    def write(comm):
        s = sg.Mirrored(comm=comm)
        model, opt = _prepared(s)
        _train(s, model, opt, 3)
        s.save(tmp_path / "ck", model=model, optimizer=opt, step=3)

    run_ranks(write, 2)
    saved = _saved(tmp_path / "ck")

    def read(comm):
        s = sg.ElasticAveraging(period=2, comm=comm)
        model, opt = _prepared(s, seed=comm.rank + 10)  # different inits: restore must win
        assert s.restore(tmp_path / "ck", model=model, optimizer=opt)["step"] == 3
        local = _state(s.unwrap(model))
        center = _state(s.eval_model(model))
        _train(s, model, opt, 2)  # and it trains on from there
        return local, center

    for local, center in run_ranks(read, 3):
        _equal(local, saved)
        _equal(center, saved)


@pytest.mark.timeout(60)
def test_easgd_2_center_to_mirrored_1_and_one_device(tmp_path: Path) -> None:
    def write(comm):
        s = sg.ElasticAveraging(period=2, moving_rate=0.25, comm=comm)
        model, opt = _prepared(s)
        _train(s, model, opt, 3)  # an odd step: locals differ from the center
        s.save(tmp_path / "ck", model=model, optimizer=opt)
        return _state(s.eval_model(model)), _state(s.unwrap(model))

    (center, local0), (_, local1) = run_ranks(write, 2)
    assert not torch.equal(local0["0.weight"], local1["0.weight"])
    _equal(_saved(tmp_path / "ck"), center)

    def read(comm):
        s = sg.Mirrored(comm=comm)
        model, opt = _prepared(s, seed=4)
        s.restore(tmp_path / "ck", model=model, optimizer=opt)
        return _state(s.unwrap(model))

    _equal(run_ranks(read, 1)[0], center)
    s = sg.OneDevice()
    model, opt = _prepared(s, seed=4)
    s.restore(tmp_path / "ck", model=model, optimizer=opt)
    _equal(_state(model), center)


@pytest.mark.timeout(60)
def test_local_sgd_to_diloco_same_workers_keeps_locals(tmp_path: Path) -> None:
    def write(comm):
        s = sg.LocalSGD(period=4, comm=comm)
        model, opt = _prepared(s)
        _train(s, model, opt, 3)
        s.save(tmp_path / "ck", model=model, optimizer=opt)
        return _state(s.unwrap(model))

    locals_ = run_ranks(write, 2)
    mean = _saved(tmp_path / "ck")

    def read(comm):
        s = sg.DiLoCo(period=2, outer_lr=1.0, outer_momentum=0.0, comm=comm)
        model, opt = _prepared(s, seed=7)
        s.restore(tmp_path / "ck", model=model, optimizer=opt)
        local = _state(s.unwrap(model))
        s.save(tmp_path / "ck2", model=model)  # DiLoCo's consensus is the outer parameters
        return local

    for r, local in enumerate(run_ranks(read, 2)):
        _equal(local, locals_[r])
    _equal(_saved(tmp_path / "ck2"), mean)


@pytest.mark.timeout(90)
def test_parameter_server_to_mirrored_and_back_across_shard_counts(tmp_path: Path) -> None:
    pytest.importorskip("stratagem.strategies.parameter_server")
    from stratagem.ps.server import start_local_shards

    servers2, addrs2 = start_local_shards(2)
    servers1, addrs1 = start_local_shards(1)
    try:
        def write(comm):
            s = sg.ParameterServer(comm=comm, ps_addresses=addrs2, small_tensor_bytes=64)
            model, opt = _prepared(s)
            _train(s, model, opt, 3)
            s.save(tmp_path / "ps", model=model, optimizer=opt)
            out = _state(s.eval_model(model))
            s.close()
            return out

        global_model = run_ranks(write, 2)[0]
        _equal(_saved(tmp_path / "ps"), global_model)

        def to_mirrored(comm):
            s = sg.Mirrored(comm=comm)
            model, opt = _prepared(s, seed=3)
            s.restore(tmp_path / "ps", model=model, optimizer=opt)
            got = _state(s.unwrap(model))
            s.save(tmp_path / "mirrored", model=model, optimizer=opt)
            return got

        for got in run_ranks(to_mirrored, 3):
            _equal(got, global_model)

        def to_ps(comm):  # one shard now: the partitions re-split
            s = sg.ParameterServer(comm=comm, ps_addresses=addrs1)
            model, opt = _prepared(s, seed=5)
            s.restore(tmp_path / "mirrored", model=model, optimizer=opt)
            out = _state(s.eval_model(model))
            s.close()
            return out

        for got in run_ranks(to_ps, 2):
            _equal(got, global_model)
    finally:
        for srv in servers1 + servers2:
            srv.stop(0)


@pytest.mark.timeout(60)
def test_same_workers_resume_exactly_with_adam_and_loader(tmp_path: Path) -> None:
    """Straight 8 steps == 5 steps, save, fresh objects + restore, 3 steps (bitwise). Ranks
    as threads share torch's global RNG, so dropout is left to the real-process test."""

    def fn(comm, stop_at, restore):
        s = sg.Mirrored(comm=comm)
        with s.scope():
            model = make_model(seed=2)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            model, opt = s.prepare(model, opt)
        loader = s.distribute_dataset(DATA, 64, seed=3)  # 4 steps per epoch
        if restore:
            s.restore(tmp_path / "ck", model=model, optimizer=opt, loader=loader)
        step = s.metrics()["steps"]
        for epoch in range(loader.epoch, 2):
            loader.set_epoch(epoch)
            for x, y in loader:
                s.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
                step += 1
                if step == stop_at:
                    s.save(tmp_path / "ck", model=model, optimizer=opt, loader=loader)
                    return None
        return _state(s.unwrap(model))

    straight = run_ranks(fn, 2, args=(-1, False))
    run_ranks(fn, 2, args=(5, False))
    resumed = run_ranks(fn, 2, args=(-1, True))
    for a, b in zip(straight, resumed):
        _equal(a, b)


# ---------------------------------------------------------------------- real processes
TRAIN_SCRIPT = r"""
import os, signal, sys, json
import torch, torch.nn.functional as F
from torch import nn
import safetensors.torch
import stratagem as sg

ckpt, out, kill_at, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
s = sg.Mirrored(timeout=30)
torch.manual_seed(100 + s.replica_id)  # dropout differs per replica; restored from the ckpt
g = torch.Generator().manual_seed(0)
with s.scope():
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = s.prepare(model, opt)
X, Y = torch.randn(200, 10, generator=g), torch.randint(0, 3, (200,), generator=g)
loader = s.distribute_dataset((X, Y), 32, seed=7)  # 7 steps per epoch (the tail is split)
step = 0
if mode == "preempt":
    s.on_preemption(ckpt, model=model, optimizer=opt, loader=loader, step=lambda: step)
if os.path.exists(ckpt):
    step = s.restore(ckpt, model=model, optimizer=opt, loader=loader)["step"]
try:
    for epoch in range(loader.epoch, 3 if mode != "preempt" else 10**6):
        loader.set_epoch(epoch)
        for x, y in loader:
            s.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            step += 1
            if mode == "preempt":
                if step == 3:
                    open(os.path.join(out, f"ready{s.replica_id}"), "w").close()
                import time; time.sleep(0.05)
                continue
            if step == kill_at and attempt == 0 and s.replica_id == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # step 9 done, not saved: it is replayed
            if step % 2 == 0:
                s.save(ckpt, model=model, optimizer=opt, loader=loader, step=step)
except SystemExit as e:
    open(os.path.join(out, f"exit{s.replica_id}"), "w").write(json.dumps([e.code, step]))
    raise
if s.is_chief:
    safetensors.torch.save_file(s.unwrap(model).state_dict(), out)
    print("ATTEMPT", attempt, "STEPS", step, flush=True)
"""


def _stratagem(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "stratagem.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(180)
def test_sigkilled_worker_restarted_by_stratagem_run_is_bitwise_equal(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    ref = _stratagem("run", "--nproc", "2", str(script), str(tmp_path / "ck_ref"),
                     str(tmp_path / "ref.safetensors"), "-1", "train")
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = _stratagem("run", "--nproc", "2", "--max-restarts", "2", str(script),
                   str(tmp_path / "ck"), str(tmp_path / "out.safetensors"), "9", "train")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ATTEMPT 1 STEPS 21" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert "ATTEMPT 0 STEPS 21" in ref.stdout
    _equal(safetensors.torch.load_file(tmp_path / "out.safetensors"),
           safetensors.torch.load_file(tmp_path / "ref.safetensors"))


@pytest.mark.timeout(180)
def test_sigterm_checkpoints_every_worker_at_one_step_and_exits_143(tmp_path: Path) -> None:
    from stratagem.preemption import PREEMPTED_EXIT_CODE

    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "stratagem.cli", "run", "--nproc", "2",
                             str(script), str(tmp_path / "ck"), str(tmp_path), "-1", "preempt"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(
                (tmp_path / f"ready{r}").exists() for r in range(2)):
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # as a scheduler would: to the job's launcher
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    exits = [json.loads((tmp_path / f"exit{r}").read_text()) for r in range(2)]
    assert exits[0] == exits[1] and exits[0][0] == PREEMPTED_EXIT_CODE, (exits, err[-2000:])
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["step"] == exits[0][1] and manifest["world_size"] == 2
    assert elapsed < 30
