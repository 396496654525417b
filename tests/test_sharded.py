"""``sg.Sharded`` (FSDP2): equivalence with ``Mirrored``, clipping, tied weights, sharded and
consolidated checkpoints across world sizes and strategies.

Real processes (``sg.launch``): FSDP2's ``DeviceMesh.from_group`` needs a process group that
torch.distributed registered (``get_process_group_ranks``), which the thread ranks of
``stratagem.testing.run_ranks`` do not have (checked: ``KeyError`` in
``get_process_group_ranks``). Each launch costs several seconds on this machine, so each
worker runs several scenarios.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

pytestmark = pytest.mark.timeout(240)

STEPS = 20


class TiedLM(nn.Module):
    """A tiny language model whose output head shares the embedding (GPT's tie)."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.GELU(),
                          nn.Linear(3 * width, width)) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def _mlp() -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 7), nn.ReLU(),
                          nn.Linear(7, 3))  # 7 rows: uneven shards on 2, 3 and 4 ranks
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(512, 10, generator=gen), torch.randint(0, 3, (512,), generator=gen)


def _train(strategy: sg.Strategy, *, clip: float | None = None,
           steps: int = STEPS) -> dict[str, Any]:
    """AdamW on the MLP; returns the consensus state, the pre-clip norms and the losses."""
    with strategy.scope():
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(_data(), 32, shuffle=True, seed=3)
    micro, norms, epoch = 0, [], 0
    while micro < steps * strategy.accumulation_steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            strategy.backward(F.cross_entropy(model(x), y))
            if clip is not None:
                norms.append(float(strategy.clip_grad_norm_(model, clip)))
            opt.step()
            opt.zero_grad()
            micro += 1
            if micro == steps * strategy.accumulation_steps:
                break
        epoch += 1
    ev = strategy.eval_model(model)
    state = {k: v.detach().clone() for k, v in ev.state_dict().items()}
    return {"state": state, "norms": norms, "class": type(ev), "model": model, "opt": opt}


def _pair(precision: str = "fp32", accumulation: int = 1,
          clip: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    out = []
    for cls in (sg.Sharded, sg.Mirrored):
        strategy = cls(precision=precision, accumulation_steps=accumulation, timeout=30)
        result = _train(strategy, clip=clip)
        result.pop("model"), result.pop("opt")
        strategy.close()
        out.append(result)
    return out[0], out[1]


def _equivalence_job(scenarios: list[tuple[str, int, float | None]]) -> list[Any]:
    return [_pair(*s) for s in scenarios]


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def test_sharded_equals_mirrored_on_2_ranks_fp32_accumulation_bf16_and_clip():
    scenarios = [("fp32", 1, 0.5), ("fp32", 4, None), ("bf16", 1, None)]
    results = sg.launch(_equivalence_job, nprocs=2, args=(scenarios,), timeout=200)
    (s32, m32), (sacc, macc), (sbf, mbf) = results[0]
    assert s32["class"] is nn.Sequential  # eval_model: a plain module of the user's class
    _assert_close(s32["state"], m32["state"], atol=1e-5, rtol=1e-5)
    # clip_grad_norm_ over sharded gradients: the global norm, as Mirrored's all-reduced one.
    assert len(s32["norms"]) == STEPS and max(s32["norms"]) > 0.5  # clipping was active
    torch.testing.assert_close(torch.tensor(s32["norms"]), torch.tensor(m32["norms"]),
                               atol=1e-5, rtol=1e-5)
    _assert_close(sacc["state"], macc["state"], atol=1e-5, rtol=1e-5)
    # bf16: FSDP2 computes with bf16 copies of the parameters and reduces in bf16, Mirrored
    # autocasts the matmuls and reduces in fp32; both keep fp32 masters. Same trajectory up
    # to bf16 rounding (measured max difference ~1.3e-3 after 20 steps of lr 0.01).
    _assert_close(sbf["state"], mbf["state"], atol=1e-2, rtol=1e-2)
    moved = max(float((sbf["state"][k] - _mlp().state_dict()[k]).abs().max())
                for k in sbf["state"])
    assert moved > 0.05  # it trained: the tolerance is far below the distance travelled
    # Every replica holds the same consensus model.
    for (s, _), (s0, _) in zip(results[1], results[0]):
        _assert_close(s["state"], s0["state"], atol=0, rtol=0)


def test_row_ranges_default_units_and_argument_errors():
    # Pure functions and constructor checks: no process group needed.
    from stratagem.strategies.sharded import default_units, row_range

    assert [row_range(7, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert [row_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    model = TiedLM()
    units = default_units(model)
    assert model.blocks[0] in units and model.blocks[1] in units
    # The tied embedding and head stay with the root: FSDP2 gives a parameter one unit.
    assert model.embed not in units and model.head not in units
    with pytest.raises(ValueError, match="cpu_offload=True .* needs a CUDA device"):
        sg.Sharded(cpu_offload=True, comm=sg.Comm.single(), device="cpu")
    with pytest.raises(TypeError, match="shard_modules must be"):
        sg.Sharded(shard_modules=["Block"], comm=sg.Comm.single())
