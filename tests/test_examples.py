"""Smoke tests: every example runs end to end with tiny settings.

Single-process examples run in this process (``runpy``: no interpreter start-up); the ones
whose point is several processes run as subprocesses, bounded by a timeout.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.timeout(120)


def run_example(name: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("STRATAGEM_STRATEGY", "STRATAGEM_STRATEGY_ARGS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def run_process(cmd: list[str], timeout: float = 90.0) -> str:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STRATAGEM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_custom_loop(monkeypatch, capsys, tmp_path):
    run_example("custom_loop.py", ["--epochs", "2", "--steps", "5",
                                   "--checkpoint", str(tmp_path / "ckpt")], monkeypatch)
    out = capsys.readouterr().out
    assert "epoch 1: loss" in out and "(1 replica(s), Mirrored)" in out
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_gan(monkeypatch, capsys):
    run_example("gan.py", ["--steps", "5", "--global-batch-size", "64"], monkeypatch)
    assert "modes covered" in capsys.readouterr().out


def test_fit_mnist(monkeypatch, capsys, tmp_path):
    run_example("fit_mnist.py", ["--epochs", "1", "--limit", "256", "--no-progress",
                                 "--metrics-dir", str(tmp_path)], monkeypatch)
    assert "test accuracy" in capsys.readouterr().out
    assert (tmp_path / "metrics.csv").is_file()


def test_fit_mnist_under_stratagem_run_with_easgd():
    out = run_process([str(BIN / "stratagem"), "run", "--nproc", "2", "--strategy", "easgd",
                       "--strategy-arg", "period=4", "examples/fit_mnist.py", "--epochs", "1",
                       "--limit", "512", "--no-progress"])
    assert "ElasticAveraging on 2 worker(s)" in out


def test_rl_actor_learner_with_a_parameter_server():
    out = run_process([sys.executable, "examples/rl_actor_learner.py", "--actors", "1",
                       "--rounds", "3", "--episodes", "16", "--timeout", "30"])
    assert "learner: 3 updates" in out and "actor 1:" in out
