"""BatchNorm running statistics (buffers) per strategy.

Each strategy keeps the buffers its own way while training (docs/guide.md, "BatchNorm and
buffers"); after ``finalize`` every replica, ``eval_model`` and the checkpoint hold the
documented consensus, worked out here by hand from each rank's buffers before ``finalize``:

- Mirrored, Sharded, parameter servers: rank 0's (DDP broadcasts them before every training
  forward; FSDP2 and the PS leave them local, ``finalize`` broadcasts the chief's);
- LocalSGD, DiLoCo: the mean over the workers;
- EASGD: the center after a last elastic exchange, ``c + a * sum_i (x_i - c)``.

And the saved ``model.safetensors``, loaded into a plain module, predicts exactly what
``eval_model`` predicts on every rank. ``nn.SyncBatchNorm`` is refused where torch cannot
synchronise it (CPU tensors; no default process group) and otherwise pointed at the
strategy's own group.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_model
from torch import nn

import stratagem as sg
from stratagem.parts.grad_sync import check_sync_batchnorm
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(160, 6, generator=gen) * 3 + 1
    y = (x[:, :3].sum(1) > 3).long() + (x[:, 3] > 1).long()
    return x[:112], y[:112], x[112:]


def _floats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers() if b.is_floating_point()}


def _train_and_save(strategy: sg.Strategy, path: str, **save_kwargs: Any) -> dict[str, Any]:
    """7 steps of 8 samples per rank (period 3: the last steps are not synchronised yet),
    then the buffers before / after finalize, eval_model's, and its predictions; saved."""
    x, y, probe = _data()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BNNet()
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = strategy.distribute_dataset((x, y), 16, shuffle=True, seed=1)
    for xb, yb in loader:
        strategy.backward(F.cross_entropy(model(xb), yb))
        opt.step()
        opt.zero_grad()
    out: dict[str, Any] = {"before": _floats(strategy.unwrap(model))}
    out["center"] = _floats(strategy.eval_model(model))  # EASGD: the center before finalize
    strategy.finalize(model)
    out["after"] = _floats(strategy.unwrap(model))
    ev = strategy.eval_model(model)
    out["eval"] = _floats(ev)
    ev.eval()
    with torch.no_grad():
        out["preds"] = ev(probe).argmax(1)
    out["moving_rate"] = getattr(strategy, "moving_rate", None)
    strategy.save(path, model=model, optimizer=opt, **save_kwargs)
    return out


def _expected(name: str, results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The documented consensus, from each rank's buffers before finalize."""
    before = [r["before"] for r in results]
    if name in ("local_sgd", "diloco"):
        return {k: sum(b[k] for b in before) / len(before) for k in before[0]}
    if name == "easgd":
        center, a = results[0]["center"], results[0]["moving_rate"]
        return {k: center[k] + a * sum(b[k] - center[k] for b in before) for k in center}
    return before[0]  # mirrored, sharded, parameter servers: rank 0's


def _check(name: str, results: list[dict[str, Any]], path: Path) -> None:
    before = [r["before"] for r in results]
    # Not vacuous: the replicas' statistics differed before finalize.
    assert not torch.equal(before[0]["bn.running_mean"], before[1]["bn.running_mean"])
    expected = _expected(name, results)
    plain = BNNet()
    load_model(plain, str(path / "model.safetensors"))
    saved = _floats(plain)
    for key in expected:
        torch.testing.assert_close(saved[key], expected[key], rtol=1e-6, atol=1e-6)
        for r in results:
            torch.testing.assert_close(r["eval"][key], saved[key], rtol=0, atol=0)
            if name != "easgd":  # EASGD pulls the workers towards the center, never onto it
                torch.testing.assert_close(r["after"][key], saved[key], rtol=0, atol=0)
    # The saved model's eval accuracy is eval_model's on every rank (the same predictions).
    plain.eval()
    with torch.no_grad():
        preds = plain(_data()[2]).argmax(1)
    for r in results:
        assert torch.equal(r["preds"], preds)


STRATEGIES = [("mirrored", {}), ("local_sgd", {"period": 3}), ("diloco", {"period": 3}),
              ("easgd", {"period": 3})]


@pytest.mark.parametrize("name,kwargs", STRATEGIES)
def test_saved_batchnorm_statistics_are_the_documented_consensus(name, kwargs, tmp_path):
    results = run_ranks(lambda comm: _train_and_save(sg.from_name(name, comm=comm, **kwargs),
                                                     str(tmp_path / "ckpt")), 2)
    _check(name, results, tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["ps-sync", "ps-async"])
def test_parameter_server_keeps_the_chiefs_batchnorm_statistics(name, shards, tmp_path):
    results = run_ranks(lambda comm: _train_and_save(
        sg.from_name(name, comm=comm, ps_addresses=shards), str(tmp_path / "ckpt")), 2)
    _check("ps", results, tmp_path / "ckpt")


def sharded_batchnorm_job(path: str) -> dict[str, Any]:
    """Run inside tests/test_sharded.py's 4-process launch (Sharded needs launched processes;
    a launch of its own would cost seconds); checked there with :func:`check_consensus`."""
    strategy = sg.Sharded(timeout=30)
    try:
        out = _train_and_save(strategy, path, consolidate=True)  # one model.safetensors
        try:
            strategy.prepare(nn.SyncBatchNorm.convert_sync_batchnorm(BNNet()))
        except ValueError as exc:
            out["sync_bn_error"] = str(exc)
        return out
    finally:
        strategy.close()


check_consensus = _check


# ---------------------------------------------------------------------- SyncBatchNorm
def test_mirrored_refuses_syncbatchnorm_on_cpu_with_the_fix():
    def rank(comm: sg.Comm) -> str:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(BNNet())
        with pytest.raises(ValueError) as info:
            sg.Mirrored(comm=comm).prepare(model)
        return str(info.value)

    message = run_ranks(rank, 2)[0]
    assert "1 nn.SyncBatchNorm layer(s)" in message and "GPU tensors only" in message
    assert "Fix: keep nn.BatchNorm on the CPU" in message


def test_syncbatchnorm_is_pointed_at_the_strategys_group(monkeypatch):
    """On CUDA (the device type is all the check reads) with torch.distributed's default
    group up, each SyncBatchNorm gets the strategy's own group, not torch's global one."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(BNNet())
    group = object()
    comm = types.SimpleNamespace(world_size=2, group=group)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    check_sync_batchnorm(comm, model, torch.device("cuda", 0))  # type: ignore[arg-type]
    assert model.bn.process_group is group


def test_syncbatchnorm_without_a_default_group_is_refused(monkeypatch):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(BNNet())
    comm = types.SimpleNamespace(world_size=2, group=object())
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="silently compute per-replica statistics"):
        check_sync_batchnorm(comm, model, torch.device("cuda", 0))  # type: ignore[arg-type]
    check_sync_batchnorm(types.SimpleNamespace(world_size=1, group=None), model,  # type: ignore[arg-type]
                         torch.device("cpu"))  # one replica: nothing to synchronise
