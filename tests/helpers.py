"""Small models and data shared by the tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def make_model(seed: int = 0, d_in: int = 10, hidden: int = 16, d_out: int = 3) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def make_data(n: int = 640, d_in: int = 10, classes: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def train(strategy, data, *, global_batch_size: int = 32, steps: int = 20, lr: float = 0.1,
          optimizer: str = "sgd", seed: int = 0, shuffle: bool = True):
    """A custom loop; returns the final state dict (user names) and the metrics."""
    with strategy.scope():
        model = make_model(seed)
        opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
               else torch.optim.Adam(model.parameters(), lr=lr))
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(data, global_batch_size, shuffle=shuffle, seed=3)
    done, epoch = 0, 0
    while done < steps * strategy.accumulation_steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps * strategy.accumulation_steps:
                break
        epoch += 1
    state = {k: v.detach().clone() for k, v in strategy.unwrap(model).state_dict().items()}
    return state, strategy.metrics()


def assert_states_close(a, b, atol=1e-5, rtol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def train_briefly(strategy, steps: int = 3):
    """Prepare a small MLP and take ``steps`` steps on random data (for tests about what
    surrounds training: closing, exiting); returns ``(model, optimizer)``."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = strategy.prepare(model, opt)
    for _ in range(steps):
        strategy.backward(F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 2, (4,))))
        opt.step()
        opt.zero_grad()
    return model, opt


def mse_steps(strategy, model, opt, steps: int, batch) -> None:
    """``steps`` optimizer steps of the MSE loss on this replica's own batches
    (``batch(rank, step) -> (x, y)``)."""
    for step in range(steps):
        x, y = batch(strategy.replica_id, step)
        strategy.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()


def join_with_late_chief(make_strategy, caplog) -> tuple[dict, dict, list[str]]:
    """Two thread ranks, each building its model from its own seed; the chief (rank 0)
    prepares 0.5 s late. Returns both ranks' weights right after ``prepare`` and the
    shard's "refused a call" log lines (``caplog`` must capture ``stratagem.ps.server``)."""
    import logging
    import time

    from stratagem.testing import run_ranks

    caplog.set_level(logging.INFO, logger="stratagem.ps.server")

    def job(comm):
        if comm.rank == 0:
            time.sleep(0.5)
        s = make_strategy(comm)
        with s.scope():
            model = make_model(seed=comm.rank)  # different weights: the chief's must win
            model, _ = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        out = {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}
        s.close()
        return out

    chief, other = run_ranks(job, 2)
    refusals = [r.getMessage() for r in caplog.records if "refused a call" in r.getMessage()]
    return chief, other, refusals


def shard_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three tensors of a parameter-server shard's tests (a matrix, a vector, an embedding)."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 300, generator=g), "b": torch.randn(300, generator=g),
            "e": torch.randn(40, 8, generator=g)}


def shard_grads(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Gradients shaped like ``params``, reproducible per ``seed``."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in params.items()}


class ProcShard:
    """A parameter-server shard in a process of its own (its own interpreter, GIL, RSS and
    CPU time, as in a real job), started at once; :meth:`wait` for its address."""

    def __init__(self, tmp: Path, *extra: str, token: str) -> None:
        import os
        import subprocess
        import sys

        from stratagem.launcher import child_pythonpath

        tok, self.port_file = tmp / "token", tmp / "port"
        tmp.mkdir(parents=True, exist_ok=True)
        tok.write_text(token)
        tok.chmod(0o600)
        self.token = token
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = child_pythonpath(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stratagem.ps.server", "--port-file", str(self.port_file),
             "--token-file", str(tok), *extra], env=env, stderr=subprocess.DEVNULL)
        self.address = ""

    def wait(self) -> ProcShard:
        import time

        deadline = time.monotonic() + 180  # a loaded machine imports torch slowly
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            assert self.proc.poll() is None and time.monotonic() < deadline, "shard start"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(self.port_file.read_text())}"
        return self

    def cpu(self) -> float:
        """Seconds of CPU (user + system) the shard process has used."""
        import os
        from pathlib import Path

        text = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = text[text.rfind(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in bytes."""
        from pathlib import Path

        f = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status")
                 .read_text().splitlines() if ":" in line)
        return int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024

    def reset_peak(self) -> bool:
        from pathlib import Path

        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def health(self) -> dict:
        from stratagem.ps.transport import PSClient

        with PSClient([self.address], token=self.token, timeout=10) as c:
            return c.health()[0]

    def stop(self) -> None:
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def ft_progress(out: Path, slot: int) -> int:
    """The last step ``tests/ft_scripts/train_ft.py`` wrote for ``slot`` (0 before the first,
    or while the file is being rewritten)."""
    try:
        return int((out / f"progress.{slot}").read_text() or 0)
    except (OSError, ValueError):
        return 0


def ft_pids(out: Path, slot: int) -> list[int]:
    """The PIDs ``tests/ft_scripts/train_ft.py`` recorded for ``slot``, one per life ([]
    before the first)."""
    try:
        return [int(p) for p in (out / f"pids.{slot}").read_text().split()]
    except OSError:
        return []
