"""Smoke tests: every example runs end to end with tiny settings.

Single-process examples run in this process (``runpy``: no interpreter start-up); the ones
whose point is several processes run as subprocesses, bounded by a timeout.
"""

from __future__ import annotations

import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stratagem.testing import run_ranks

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


# ---------------------------------------------------------------------- examples/gpt.py
def _gpt_example() -> dict:
    """The example's functions (``runpy`` without ``__main__``: nothing runs)."""
    return runpy.run_path(str(EXAMPLES / "gpt.py"), run_name="gpt_example")


def _assert_plain_model_generates(ckpt: Path) -> None:
    """The saved ``model.safetensors`` loads into a plain GPT built from the saved extras,
    with the head re-tied to the embedding, and generates text."""
    from safetensors.torch import load_model

    from stratagem.checkpoint import read_extras
    from stratagem.demo_lm import GPT, GPTConfig, decode, encode

    plain = GPT(GPTConfig(**read_extras(ckpt)["model_args"]))
    load_model(plain, str(ckpt / "model.safetensors"))
    assert plain.head.weight is plain.tok_emb.weight
    out = plain.generate(encode("The ").view(1, -1), 20,
                         generator=torch.Generator().manual_seed(0))
    text = decode(out[0])
    assert text.startswith("The ") and len(text) == 24


def test_gpt_one_process_then_resume(monkeypatch, capsys, tmp_path):
    run_example("gpt.py", ["--tiny", "--max-iters", "4", "--out-dir", str(tmp_path)],
                monkeypatch)
    out = capsys.readouterr().out
    assert "Mirrored on 1 worker(s)" in out and "from scratch" in out
    final = [line for line in out.splitlines() if line.startswith("final (step 4)")]
    assert final, out
    val = float(final[0].split("val loss ")[1].split(";")[0])
    assert math.isfinite(val) and val < math.log(96) + 0.5  # not worse than uniform by much
    sample = out.split("--- sample (64 characters) ---\n")[1].split("\n---")[0]
    assert sample.startswith("The ") and len(sample) == 4 + 64
    _assert_plain_model_generates(tmp_path / "ckpt")
    # Resume: the model shape comes from the extras, the loop continues at step 4.
    run_example("gpt.py", ["--tiny", "--resume", "--max-iters", "6", "--n-embd", "48",
                           "--out-dir", str(tmp_path)], monkeypatch)
    out = capsys.readouterr().out
    assert "resuming at step 4" in out and "final (step 6)" in out
    assert "iter 5:" in out and "iter 4:" not in out


@pytest.mark.parametrize("name,kwargs", [("mirrored", {}), ("diloco", {"period": 2}),
                                         ("local_sgd", {"period": 2}), ("ps-sync", {})])
def test_gpt_two_thread_ranks(name, kwargs, tmp_path):
    import stratagem as sg
    from stratagem.ps.server import start_local_shards

    main = _gpt_example()["main"]
    argv = ["--tiny", "--global-accumulation-steps", "4", "--out-dir", str(tmp_path)]
    servers, addrs = start_local_shards(1) if name.startswith("ps") else ([], [])
    if addrs:
        kwargs = {**kwargs, "ps_addresses": addrs}
    try:
        results = run_ranks(lambda comm: main(argv, sg.from_name(name, comm=comm, **kwargs)),
                            2, timeout=90.0)
    finally:
        for server in servers:
            server.stop(0)
    for r in results:
        assert r["steps"] == 6
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"])
    assert results[0]["val_loss"] == results[1]["val_loss"]  # one consensus model, reduced
    assert results[0]["sample"].startswith("The ") and len(results[0]["sample"]) == 4 + 64
    assert results[1]["sample"] == ""  # only the chief samples
    _assert_plain_model_generates(tmp_path / "ckpt")
