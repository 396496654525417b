"""Shared (tied) parameters, torch.compile names and read_extras in checkpoints (
items 1, 5 and 6): a model whose output head is tied to its embedding saves each storage once
under every strategy, its ``model.safetensors`` loads into a plain module with
``safetensors.torch.load_model`` (re-tied), and restore keeps the tie."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.checkpoint import read_extras
from stratagem.comm import Comm
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(90)
VOCAB, DIM = 11, 6


class TiedLM(nn.Module):
    """A tiny language model whose output head is its embedding (GPT-2 / nanoGPT style)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(idx))))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (64,), generator=gen)
    return x, (x * 3 + 1) % VOCAB


def _tied(module: nn.Module) -> bool:
    return module.lm_head.weight is module.wte.weight  # type: ignore[union-attr]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _run(make: Callable[[Comm], sg.Strategy], path: Path, comm: Comm, seed: int,
         steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of a fresh tied model under ``make(comm)``; save to ``path`` if
    ``steps`` else restore from it; then save again to ``path.again``."""
    s = make(comm)
    try:
        with s.scope():
            model = TiedLM(seed)
            opt = torch.optim.Adam(model.parameters(), lr=0.05)
            model, opt = s.prepare(model, opt)
        if steps:
            loader = s.distribute_dataset(_data(), 16, seed=0)
            for i, (x, y) in enumerate(loader):
                if i == steps:
                    break
                s.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
            s.save(path, model=model, optimizer=opt, step=steps, config={"vocab": VOCAB})
            out: dict[str, Any] = {}
        else:
            out = s.restore(path, model=model, optimizer=opt)
            s.save(path.with_name(path.name + ".again"), model=model, optimizer=opt)
        out["tied"] = _tied(s.unwrap(model))
        return out
    finally:
        s.close()


def _check_file(path: Path) -> dict[str, torch.Tensor]:
    """One copy of the tied storage on disk, aliases in the manifest, a plain load re-ties."""
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["objects"]["model"]["aliases"] == {"lm_head.weight": "wte.weight"}
    stored = safetensors.torch.load_file(path / "model.safetensors")
    assert sorted(stored) == ["mid.bias", "mid.weight", "wte.weight"]
    plain = TiedLM(seed=7)
    safetensors.torch.load_model(plain, path / "model.safetensors")  # strict
    assert _tied(plain)
    torch.testing.assert_close(plain.wte.weight.detach(), stored["wte.weight"], atol=0, rtol=0)
    return stored


def _ps(addrs: list[str], mode: str) -> Callable[[Comm], sg.Strategy]:
    return lambda comm: sg.ParameterServer(ps_addresses=addrs, mode=mode, comm=comm, timeout=10)


def _easgd_async(addrs: list[str]) -> Callable[[Comm], sg.Strategy]:
    return lambda comm: sg.ElasticAveraging(mode="async", period=2, moving_rate=0.3,
                                            ps_addresses=addrs, comm=comm, timeout=10)


STRATEGIES: dict[str, Callable[[list[str]], Callable[[Comm], sg.Strategy]]] = {
    "mirrored": lambda a: lambda comm: sg.Mirrored(comm=comm),
    "local_sgd": lambda a: lambda comm: sg.LocalSGD(period=2, comm=comm),
    "diloco": lambda a: lambda comm: sg.DiLoCo(period=2, comm=comm),
    "easgd_sync": lambda a: lambda comm: sg.ElasticAveraging(period=2, moving_rate=0.3, comm=comm),
    "easgd_async": _easgd_async,
    "ps_sync": lambda a: _ps(a, "sync"),
    "ps_async": lambda a: _ps(a, "async"),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_tied_weights_save_once_and_retie_under_every_strategy(name: str, shards: list[str],
                                                               tmp_path: Path) -> None:
    make = STRATEGIES[name](shards)
    path = tmp_path / "ck"
    saved = run_ranks(lambda comm: _run(make, path, comm, seed=0, steps=3), 2)
    assert all(r["tied"] for r in saved)
    stored = _check_file(path)
    # Restore under the same strategy into a model built from another seed: the tie holds,
    # and saving again gives the same consensus model, itself saved once.
    restored = run_ranks(lambda comm: _run(make, path, comm, seed=5, steps=0), 2)
    for r in restored:
        assert r["tied"] and r["step"] == 3 and r["config"] == {"vocab": VOCAB}
    again = _check_file(tmp_path / "ck.again")
    for k in stored:
        torch.testing.assert_close(again[k], stored[k], atol=1e-6, rtol=1e-6)
    # And under OneDevice (any strategy restores under any other).
    s = sg.OneDevice()
    model = s.prepare(TiedLM(seed=9))
    s.restore(path, model=model)
    assert _tied(s.unwrap(model))
    torch.testing.assert_close(s.unwrap(model).lm_head.weight.detach(), stored["wte.weight"],
                               atol=0, rtol=0)


def test_tied_weights_under_one_device_and_unprepared(tmp_path: Path) -> None:
    s = sg.OneDevice()
    out = _run(lambda comm: sg.OneDevice(), tmp_path / "ck", Comm.single(), seed=0, steps=3)
    assert out["tied"]
    stored = _check_file(tmp_path / "ck")
    assert _run(lambda comm: sg.OneDevice(), tmp_path / "ck", Comm.single(), seed=4,
                steps=0)["tied"]
    # A module never prepared is saved and restored the same way.
    plain = TiedLM(seed=2)
    s.save(tmp_path / "plain", model=plain)
    _check_file(tmp_path / "plain")
    other = TiedLM(seed=3)
    s.restore(tmp_path / "ck", model=other)
    assert _tied(other)
    torch.testing.assert_close(other.lm_head.weight.detach(), stored["wte.weight"], atol=0, rtol=0)
    # A bare file written by safetensors.torch.save_model restores into a tied model too.
    safetensors.torch.save_model(plain, str(tmp_path / "bare.safetensors"))
    fresh = s.prepare(TiedLM(seed=6))
    assert s.restore(tmp_path / "bare.safetensors", model=fresh) == {"step": 0}
    assert _tied(s.unwrap(fresh))
    torch.testing.assert_close(_state(s.unwrap(fresh)), _state(plain), atol=0, rtol=0)


def test_overlapping_views_are_stored_as_copies_not_a_raw_error(tmp_path: Path) -> None:
    """Two parameters that are different, overlapping views of one storage cannot be tied by
    name: they are stored as independent copies (and a non-tensor entry is a CheckpointError)."""

    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("whole", torch.arange(6.0))
            self.register_buffer("head", self.whole[:4])

    s = sg.OneDevice()
    s.save(tmp_path / "ck", model=Views())
    stored = safetensors.torch.load_file(tmp_path / "ck" / "model.safetensors")
    torch.testing.assert_close(stored["head"], torch.arange(4.0), atol=0, rtol=0)
    fresh = Views()
    fresh.whole.zero_()
    s.restore(tmp_path / "ck", model=fresh)
    torch.testing.assert_close(fresh.whole, torch.arange(6.0), atol=0, rtol=0)


def test_mismatched_model_is_a_checkpoint_error_naming_the_names(tmp_path: Path) -> None:
    s = sg.OneDevice()
    s.save(tmp_path / "ck", model=TiedLM())
    wrong = nn.Sequential(nn.Linear(DIM, VOCAB))
    with pytest.raises(sg.CheckpointError, match=r"missing \['0.weight', '0.bias'\].*Fix"):
        s.restore(tmp_path / "ck", model=wrong)
    narrow = TiedLM()
    narrow.mid = nn.Linear(DIM, DIM, bias=False)
    narrow.mid.bias = nn.Parameter(torch.zeros(DIM + 1))
    with pytest.raises(sg.CheckpointError, match=r"mid.bias has shape \(6,\) in the checkpoint"):
        s.restore(tmp_path / "ck", model=narrow)


# ---------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("prepare", [False, True])
def test_compiled_model_saves_and_restores_under_its_own_names(tmp_path: Path,
                                                               prepare: bool) -> None:
    s = sg.OneDevice()
    net = TiedLM(seed=1)
    compiled = torch.compile(net, backend="eager")
    assert any("_orig_mod." in k for k in compiled.state_dict())
    model = s.prepare(compiled) if prepare else compiled
    s.save(tmp_path / "ck", model=model)
    stored = safetensors.torch.load_file(tmp_path / "ck" / "model.safetensors")
    assert sorted(stored) == ["mid.bias", "mid.weight", "wte.weight"]
    plain = TiedLM(seed=3)
    safetensors.torch.load_model(plain, tmp_path / "ck" / "model.safetensors")
    torch.testing.assert_close(_state(plain), _state(net), atol=0, rtol=0)
    # Restore into a compiled model, and into a plain one.
    target = torch.compile(TiedLM(seed=4), backend="eager")
    s.restore(tmp_path / "ck", model=s.prepare(target) if prepare else target)
    torch.testing.assert_close(_state(target._orig_mod), _state(net), atol=0, rtol=0)
    assert _tied(target._orig_mod)
    s.restore(tmp_path / "ck", model=plain)


def test_model_compiled_after_prepare_saves_the_strategys_model(tmp_path: Path) -> None:
    """``torch.compile(strategy.prepare(model))``: the compiled wrapper (around DDP under
    Mirrored) is seen through, so the file holds the module's own names, once each."""

    def job(comm: Comm) -> dict[str, torch.Tensor]:
        s = sg.Mirrored(comm=comm)
        with s.scope():
            model = s.prepare(TiedLM(seed=2))
        compiled = torch.compile(model, backend="eager")
        s.save(tmp_path / "ck", model=compiled)
        fresh = torch.compile(s.prepare(TiedLM(seed=8)), backend="eager")
        s.restore(tmp_path / "ck", model=fresh)
        return _state(s.unwrap(fresh._orig_mod))

    restored = run_ranks(job, 2)
    _check_file(tmp_path / "ck")
    for state in restored:
        torch.testing.assert_close(state, _state(TiedLM(seed=2)), atol=0, rtol=0)


# ---------------------------------------------------------------------- read_extras
def test_read_extras_before_any_model_exists(tmp_path: Path) -> None:
    s = sg.OneDevice()
    model = s.prepare(TiedLM())
    s.save(tmp_path / "ck", model=model, step=42,
           model_args={"vocab": VOCAB, "dim": DIM, "tied": True}, ema=torch.arange(3.0))
    assert "read_extras" in sg.checkpoint.__all__
    extras = read_extras(tmp_path / "ck")
    assert extras["step"] == 42 and extras["model_args"] == {"vocab": VOCAB, "dim": DIM,
                                                             "tied": True}
    torch.testing.assert_close(extras["ema"], torch.arange(3.0))
    assert "model" not in extras
    # Same verification as restore: a damaged extras file is refused...
    d = (tmp_path / "ck").resolve()
    data = bytearray((d / "extra.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (d / "extra.safetensors").write_bytes(bytes(data))
    with pytest.raises(sg.CheckpointError, match="checksum mismatch in extra.safetensors"):
        read_extras(tmp_path / "ck")
    # ... and a missing checkpoint is explained.
    with pytest.raises(sg.CheckpointError, match="no intact checkpoint.*Fix"):
        read_extras(tmp_path / "nothing")


def test_strategy_state_naming_one_tensor_twice_keeps_both_names(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """Strategy state is looked up name by name on restore: a tensor under two names is stored
    under both (as copies), never dropped as an alias."""
    s = sg.OneDevice()
    model = s.prepare(TiedLM())
    shared = torch.arange(4.0)
    monkeypatch.setattr(s, "strategy_state", lambda model: {"a": shared, "b": shared})
    seen: dict[str, torch.Tensor] = {}
    monkeypatch.setattr(s, "load_strategy_state", lambda model, state: seen.update(state))
    s.save(tmp_path / "ck", model=model)
    s.restore(tmp_path / "ck", model=model)
    assert sorted(seen) == ["a", "b"]
    torch.testing.assert_close(seen["b"], shared, atol=0, rtol=0)
