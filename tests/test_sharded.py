"""``sg.Sharded`` (FSDP2): equivalence with ``Mirrored``, clipping, tied weights, sharded and
consolidated checkpoints across world sizes and strategies.

Real processes (``sg.launch``): FSDP2's ``DeviceMesh.from_group`` needs a process group that
torch.distributed registered (``get_process_group_ranks``), which the thread ranks of
``stratagem.testing.run_ranks`` do not have (checked: ``KeyError`` in
``get_process_group_ranks``). Each launch costs several seconds on this machine, so each
worker runs several scenarios.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_batchnorm import check_consensus, sharded_batchnorm_job
from torch import nn

import stratagem as sg
from stratagem import checkpoint

pytestmark = pytest.mark.timeout(600)  # the launches share 2 cores; ~80 s on a quiet machine

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
    sent = strategy.metrics()["bytes_sent"]
    ev = strategy.eval_model(model)
    state = {k: v.detach().clone() for k, v in ev.state_dict().items()}
    return {"state": state, "norms": norms, "class": type(ev), "model": model, "opt": opt,
            "skipped": strategy.metrics()["skipped_steps"], "scale": strategy.precision.scale,
            "sent": sent}


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


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def test_sharded_keeps_rank_0s_batchnorm_statistics_and_refuses_cpu_syncbatchnorm(runs):
    """FSDP2 leaves buffers local; finalize broadcasts rank 0's, which the consensus
    checkpoint and eval_model hold on every rank (tests/test_batchnorm.py has the others)."""
    results = [r["batchnorm"] for r in runs["first"]]
    check_consensus("sharded", results, runs["root"] / "batchnorm")
    assert "nn.SyncBatchNorm" in results[0]["sync_bn_error"]


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
    from stratagem.strategies.sharded import FSDPSharding

    tied = FSDPSharding(sg.Comm.single(), device=torch.device("cpu"), shard_modules=[nn.Embedding])
    with pytest.raises(ValueError, match="'weight' is also used outside it"):
        tied.units(TiedLM())
    blocks = FSDPSharding(sg.Comm.single(), device=torch.device("cpu"),
                          shard_modules=lambda m: isinstance(m, nn.Sequential))
    assert blocks.units(model) == [model.blocks[0], model.blocks[1]]
    with pytest.raises(ValueError, match="cpu_offload=True .* needs a CUDA device"):
        sg.Sharded(cpu_offload=True, comm=sg.Comm.single(), device="cpu")
    with pytest.raises(TypeError, match="shard_modules must be"):
        sg.Sharded(shard_modules=["Block"], comm=sg.Comm.single())


# ---------------------------------------------------------------------- checkpoints
GLOBAL_BATCH = 24  # divisible by 2, 3 and 4 replicas
MORE = 3  # steps taken after a save, and again after each restore: they must agree


def _lm_batches(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (n, GLOBAL_BATCH, 9), generator=torch.Generator().manual_seed(seed))


def _lm(strategy: sg.Strategy) -> tuple[nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        torch.manual_seed(0)
        model = TiedLM()
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
        return strategy.prepare(model, opt)  # type: ignore[no-any-return]


def _lm_steps(strategy: sg.Strategy, model: nn.Module, opt: torch.optim.Optimizer,
              batches: torch.Tensor) -> None:
    """Plain steps on fixed global batches; each replica takes its contiguous share, so the
    mean gradient (and the trajectory) does not depend on the number of replicas."""
    share = GLOBAL_BATCH // strategy.num_replicas_in_sync
    for batch in batches:
        rows = batch[strategy.replica_id * share:(strategy.replica_id + 1) * share]
        logits = model(rows[:, :-1])
        strategy.backward(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()))
        strategy.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()


def _consensus(strategy: sg.Strategy, model: nn.Module) -> dict[str, torch.Tensor]:
    ev = strategy.eval_model(model)
    assert type(ev) is TiedLM and ev.head.weight is ev.embed.weight  # plain, tie kept
    return {k: v.detach().clone() for k, v in ev.state_dict().items()}


def _save_job(root: str) -> dict[str, Any]:
    """On 4 ranks: equivalence with Mirrored, then a sharded and a consolidated save of the
    tied LM, and the model after MORE further steps."""
    mlp_s, mlp_m = _pair("fp32", 1, 0.5)
    strategy = sg.Sharded(timeout=30)
    model, opt = _lm(strategy)
    _lm_steps(strategy, model, opt, _lm_batches(5, seed=1))
    saved = _consensus(strategy, model)
    # The per-rank bytes of parameters are a quarter of the model's (uneven rows aside).
    local = sum(p.to_local().numel() for p in strategy.unwrap(model).parameters())
    strategy.save(f"{root}/sharded", model=model, optimizer=opt, step=5, config={"vocab": 32})
    strategy.save(f"{root}/consolidated", model=model, optimizer=opt, step=5, consolidate=True)
    probe = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = strategy.eval_model(model)(probe)
    _lm_steps(strategy, model, opt, _lm_batches(MORE, seed=2))
    result = {"mlp": (mlp_s, mlp_m), "saved": saved, "continued": _consensus(strategy, model),
              "local": local, "probe": probe, "out": out}
    strategy.close()
    result["batchnorm"] = sharded_batchnorm_job(f"{root}/batchnorm")
    return result


def _failed_save(strategy: sg.Strategy, model: nn.Module, path: str) -> dict[str, Any]:
    """Rank 2 cannot write its shard file: every rank raises CheckpointError, the staging
    directory is removed, and ``path`` still holds the previous (fit's last) checkpoint."""
    import stratagem.checkpoint.storage as ck

    before = os.readlink(path)
    good = ck._fsync_write  # fault injection: this rank's writes fail

    def failing(file: Path, data: bytes) -> str:
        raise OSError(28, "No space left on device (injected)")

    if strategy.replica_id == 2:
        ck._fsync_write = failing
    try:
        strategy.save(path, model=model, step=99)
        error = ""
    except sg.CheckpointError as exc:
        error = str(exc)
    finally:
        ck._fsync_write = good
    versions = Path(path).parent / f".{Path(path).name}.versions"
    strategy.comm.barrier()
    return {"error": error, "link_kept": os.readlink(path) == before,
            "staging_left": [d.name for d in versions.iterdir() if d.name.startswith("tmp-")],
            "step": checkpoint.read_extras(path)["step"]}


class AttentionLM(TiedLM):
    """TiedLM plus a ``MultiheadAttention``, whose ``_reset_parameters`` re-initialises a
    tensor of its child ``out_proj`` (the parent's reset must win)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


class MaskedLM(TiedLM):
    """A buffer computed in the constructor: lost when built on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)))


def _meta_scenario() -> dict[str, Any]:
    """Models built under ``torch.device("meta")``: Sharded materialises only the shards,
    with the values eager construction gives from the same seed (ties and a parent's reset
    of its child's tensor included); what it cannot rebuild is refused by name, and a
    strategy that cannot materialise refuses a meta model."""
    def trained(meta: bool) -> dict[str, torch.Tensor]:
        strategy = sg.Sharded(timeout=30)
        torch.manual_seed(3)
        with torch.device("meta" if meta else "cpu"):
            model = AttentionLM()
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        torch.manual_seed(3)  # the materialisation draws what the constructor drew
        model, opt = strategy.prepare(model, opt)
        local = {n: str(p.to_local().device) for n, p in strategy.unwrap(model).named_parameters()}
        assert set(local.values()) == {"cpu"}, local
        _lm_steps(strategy, model, opt, _lm_batches(3, seed=4))
        ev = strategy.eval_model(model)
        assert ev.head.weight is ev.embed.weight
        out = {k: v.detach().clone() for k, v in ev.state_dict().items()}
        strategy.close()
        return out

    result: dict[str, Any] = {"meta": trained(True), "eager": trained(False)}
    strategy = sg.Sharded(timeout=30)
    with torch.device("meta"):
        masked = MaskedLM()
    try:
        strategy.prepare(masked)
    except ValueError as exc:
        result["masked_error"] = str(exc)
    strategy.close()
    with torch.device("meta"):
        masked = MaskedLM()
    try:
        sg.Mirrored(timeout=30).prepare(masked)
    except ValueError as exc:
        result["mirrored_error"] = str(exc)
    return result


def _restore_job(root: str, sources: list[str], save_mirrored: bool,
                 scenarios: list[tuple[str, int, float | None]]) -> tuple[list[Any], list[Any]]:
    """Restore each source into Sharded (and, with save_mirrored, into Mirrored, saving it
    again for the next job); return the restored and continued consensus models, and the
    (Sharded, Mirrored) results of the equivalence ``scenarios`` (one launch, fewer seconds)."""
    pairs: list[Any] = [_pair(*s) for s in scenarios]
    if not scenarios:  # the 3-rank job: fit, with evaluation and checkpoints, under Sharded
        strategy = sg.Sharded(timeout=30)
        with strategy.scope():
            model = _mlp()
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = _data()
        history = strategy.fit(model, opt, F.cross_entropy, (x[:384], y[:384]), epochs=3,
                               global_batch_size=48, eval_dataset=(x[384:], y[384:]),
                               checkpoint_dir=f"{root}/fit", progress=False)
        pairs.append(history)
        pairs.append(_failed_save(strategy, model, f"{root}/fit"))
        strategy.close()
        pairs.append(_meta_scenario())
    out = []
    kinds = [("sharded", s) for s in sources] + ([("mirrored", sources[0])] if save_mirrored else [])
    for kind, source in kinds:
        strategy = sg.Sharded(timeout=30) if kind == "sharded" else sg.Mirrored(timeout=30)
        model, opt = _lm(strategy)
        extras = strategy.restore(f"{root}/{source}", model=model, optimizer=opt)
        restored = _consensus(strategy, model)
        if kind == "mirrored":
            strategy.save(f"{root}/mirrored", model=model, optimizer=opt, step=extras["step"])
        _lm_steps(strategy, model, opt, _lm_batches(MORE, seed=2))
        out.append({"kind": kind, "source": source, "step": extras["step"],
                    "restored": restored, "continued": _consensus(strategy, model)})
        strategy.close()
    return out, pairs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three launches (4, 2, 3 ranks) every test below reads."""
    root = tmp_path_factory.mktemp("sharded")
    first = sg.launch(_save_job, nprocs=4, args=(str(root),), timeout=200)
    scenarios = [("fp32", 1, 0.5), ("fp32", 4, None), ("bf16", 1, None), ("fp16", 1, 1.0)]
    second = sg.launch(_restore_job, nprocs=2, args=(str(root), ["sharded"], True, scenarios),
                       timeout=200)
    third = sg.launch(_restore_job, nprocs=3, args=(str(root), ["sharded", "mirrored"], False, []),
                      timeout=200)
    return {"root": root, "first": first, "second": second, "third": third}


def test_sharded_equals_mirrored_on_2_ranks_fp32_accumulation_bf16_and_clip(runs):
    results = [r[1] for r in runs["second"]]
    (s32, m32), (sacc, macc), (sbf, mbf), (s16, m16) = results[0]
    assert s32["class"] is nn.Sequential  # eval_model: a plain module of the user's class
    _assert_close(s32["state"], m32["state"], atol=1e-5, rtol=1e-5)
    # clip_grad_norm_ over sharded gradients: the global norm, as Mirrored's all-reduced one.
    assert len(s32["norms"]) == STEPS and max(s32["norms"]) > 0.5  # clipping was active
    torch.testing.assert_close(torch.tensor(s32["norms"]), torch.tensor(m32["norms"]),
                               atol=1e-5, rtol=1e-5)
    _assert_close(sacc["state"], macc["state"], atol=1e-5, rtol=1e-5)
    # Traffic, counted like Mirrored's: all-gather (forward), again (backward), reduce-
    # scatter, each (W-1)/W of the parameters, against the all-reduce's 2 (W-1)/W.
    assert 1.3 < s32["sent"] / m32["sent"] < 1.55, (s32["sent"], m32["sent"])
    # Accumulation 4: four forwards (two gathers each), one reduce-scatter per step.
    assert 2.5 < sacc["sent"] / s32["sent"] < 3.1, (sacc["sent"], s32["sent"])
    # bf16: FSDP2 computes with bf16 copies of the parameters and reduces in bf16, Mirrored
    # autocasts the matmuls and reduces in fp32; both keep fp32 masters. Same trajectory up
    # to bf16 rounding (measured max difference ~1.3e-3 after 20 steps of lr 0.01).
    _assert_close(sbf["state"], mbf["state"], atol=1e-2, rtol=1e-2)
    moved = max(float((sbf["state"][k] - _mlp().state_dict()[k]).abs().max())
                for k in sbf["state"])
    assert moved > 0.05  # it trained: the tolerance is far below the distance travelled
    # fp16: dynamic loss scaling; the first step overflows at 2**16 in some replica's rows and
    # every replica skips it (the flag is all-reduced), like Mirrored's all-reduced gradient.
    assert s16["skipped"] == m16["skipped"] >= 1 and s16["scale"] == m16["scale"]
    assert all(r[1][3][0]["skipped"] == s16["skipped"] for r in runs["second"])
    _assert_close(s16["state"], m16["state"], atol=2e-3, rtol=2e-3)
    # Every replica holds the same consensus model.
    for (s, _), (s0, _) in zip(results[1], results[0]):
        _assert_close(s["state"], s0["state"], atol=0, rtol=0)


def test_sharded_equals_mirrored_on_4_ranks_and_holds_a_quarter(runs):
    first = runs["first"]
    mlp_s, mlp_m = first[0]["mlp"]
    _assert_close(mlp_s["state"], mlp_m["state"], atol=1e-5, rtol=1e-5)  # 4 ranks == Mirrored
    torch.testing.assert_close(torch.tensor(mlp_s["norms"]), torch.tensor(mlp_m["norms"]),
                               atol=1e-5, rtol=1e-5)
    total = sum(p.numel() for p in TiedLM().parameters())
    assert sum(r["local"] for r in first) == total and max(r["local"] for r in first) <= total // 3


def test_sharded_save_writes_per_rank_files_and_consolidates(runs):
    from safetensors.torch import load_model

    tmp_path, first = runs["root"], runs["first"]
    saved = first[0]["saved"]

    # Each replica wrote its own file; no single model.safetensors in the sharded save.
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert [f for f in files if f.startswith("model.")] == [
        f"model.rank{r}.safetensors" for r in range(4)]
    assert "optimizer.rank3.safetensors" in files
    assert checkpoint.read_extras(tmp_path / "sharded")["config"] == {"vocab": 32}
    _assert_close(checkpoint.load_model_state(tmp_path / "sharded"), saved, atol=0, rtol=0)

    # consolidate=True: one model.safetensors under the model's own names, the tie stored
    # once, loadable by safetensors into a plain module with identical outputs.
    plain = TiedLM()
    load_model(plain, str(tmp_path / "consolidated" / "model.safetensors"))
    assert plain.head.weight is plain.embed.weight
    with torch.no_grad():
        torch.testing.assert_close(plain(first[0]["probe"]), first[0]["out"], atol=0, rtol=0)



def test_fit_trains_evaluates_and_checkpoints_under_sharded(runs):
    history = runs["third"][0][1][0]
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    assert 0.0 <= history["val_accuracy"][-1] <= 1.0
    for r in runs["third"]:  # identical on every replica
        assert all(r[1][0][k] == history[k] for k in ("loss", "val_loss", "val_accuracy"))
    files = {p.name for p in (runs["root"] / "fit").iterdir()}
    assert {"model.rank0.safetensors", "model.rank2.safetensors"} <= files


def test_failed_shard_write_leaves_the_previous_checkpoint(runs):
    for r in runs["third"]:
        failed = r[1][1]
        assert "rank 2" in failed["error"] and "injected" in failed["error"]
        assert failed["link_kept"] and failed["staging_left"] == []
        assert failed["step"] != 99  # the last good checkpoint (fit's) is still the one read


def test_tampered_sharded_index_is_refused(runs, tmp_path):
    # A copy of the 4-rank checkpoint whose index claims rows no file holds.
    evil = tmp_path / "evil"
    shutil.copytree((runs["root"] / "sharded").resolve(), evil)
    manifest = json.loads((evil / "manifest.json").read_text())
    entry = manifest["objects"]["model"]["sharded"]["tensors"][0]
    entry["rows"][1] = [entry["rows"][1][0] + 1, entry["rows"][1][1]]  # a gap in the rows
    (evil / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sg.CheckpointError, match="inconsistent sharded index"):
        checkpoint.load_model_state(evil)
    manifest["objects"]["model"]["sharded"]["files"] = ["../../etc/passwd"]
    (evil / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sg.CheckpointError):
        checkpoint.load_model_state(evil)


def test_sharded_checkpoint_restores_on_2_and_3_ranks_and_through_mirrored(runs):
    # 4 -> 2 (Sharded), 4 -> Mirrored(2) which saves again; then 4 -> 3 and Mirrored(2) -> 3.
    saved, continued = runs["first"][0]["saved"], runs["first"][0]["continued"]
    restores = runs["second"][0][0] + runs["third"][0][0]
    assert [(r["kind"], r["source"]) for r in restores] == [
        ("sharded", "sharded"), ("mirrored", "sharded"), ("sharded", "sharded"),
        ("sharded", "mirrored")]
    for r in restores:
        assert r["step"] == 5
        _assert_close(r["restored"], saved, atol=0, rtol=0)
        # Same steps after the restore as after the save: the optimizer state came back too.
        _assert_close(r["continued"], continued, atol=1e-5, rtol=1e-5)


def test_a_model_built_on_the_meta_device_gets_only_its_shards_with_eager_values(runs):
    # 3 ranks: uneven rows. Same values as the eager model from the same seed, through 3
    # AdamW steps (exactly: the same reset_parameters draws, children first).
    for rank_result in runs["third"]:
        meta = rank_result[1][2]
        _assert_close(meta["meta"], meta["eager"], atol=0, rtol=0)
        assert "mask" in meta["masked_error"] and "reset_parameters" in meta["masked_error"]
        assert "meta device" in meta["mirrored_error"] and "sg.Sharded()" in meta["mirrored_error"]


def test_one_process_meta_model_keeps_its_ties_and_eager_values():
    """One process shards nothing; the meta model is materialised whole, a tied parameter
    still one tensor (``Module.to_empty`` would split it), with the eager build's values, and
    the optimizer steps the materialised parameters."""
    strategy = sg.Sharded()
    torch.manual_seed(5)
    with torch.device("meta"):
        model = AttentionLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    model, opt = strategy.prepare(model, opt)
    torch.manual_seed(5)
    eager = AttentionLM()
    assert model.head.weight is model.embed.weight
    _assert_close(model.state_dict(), eager.state_dict(), atol=0, rtol=0)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()}
    before = model.embed.weight.detach().clone()
    strategy.backward(F.cross_entropy(model(torch.randint(0, 32, (2, 8))).flatten(0, 1),
                                      torch.randint(0, 32, (16,))))
    opt.step()
    assert not torch.equal(model.embed.weight, before)
    strategy.close()
