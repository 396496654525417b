"""A Hugging Face ``transformers`` GPT-2 (tiny config, random init, no download, the token
embedding tied to the LM head) trained under every strategy; the saved ``model.safetensors``
loads back with ``GPT2LMHeadModel.from_pretrained`` (no missing or unexpected names, the tie
restored) and holds the consensus model.

Multi-worker strategies run as 2 thread ranks; the parameter-server ones (and EASGD async)
against one in-process shard."""

from __future__ import annotations

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import stratagem as sg  # noqa: E402
from stratagem.comm import Comm  # noqa: E402
from stratagem.ps.server import start_local_shards  # noqa: E402
from stratagem.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(60)

STEPS = 3
#: registry name -> (extra strategy arguments, needs a PS shard)
STRATEGIES: dict[str, tuple[dict, bool]] = {
    "one_device": ({}, False),
    "mirrored": ({}, False),
    "local_sgd": ({"period": 2}, False),
    "diloco": ({"period": 2}, False),
    "diloco-async": ({"period": 2}, True),
    "easgd": ({"period": 2}, False),
    "eamsgd": ({"period": 2}, False),
    "easgd-async": ({"period": 2, "moving_rate": 0.25}, True),
    "ps-sync": ({}, True),
    "ps-async": ({}, True),
    "hierarchical": ({"inner": "mirrored", "outer": "diloco", "outer_period": 2}, False),
}
#: registry name -> (ranks, simulated nodes), where not (2, 1)
LAYOUT: dict[str, tuple[int, int]] = {"hierarchical": (4, 2)}
#: Strategies that need real processes (FSDP2's DeviceMesh needs a process group
#: torch.distributed registered, not a thread rank's own group): covered elsewhere.
PROCESS_ONLY = {"sharded": "tests/test_sharded.py (tied GPT, consolidated model.safetensors)"}


def test_every_registered_strategy_is_covered():
    assert sorted([*STRATEGIES, *PROCESS_ONLY]) == sg.strategy_names()


def tiny_config() -> GPT2Config:
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def train_gpt2(strategy: sg.Strategy, path: str) -> dict[str, object]:
    """A few steps of a plain loop; returns the losses and the consensus model's tensors."""
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_config())
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
        model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset((tokens,), global_batch_size=8, shuffle=True, seed=0)
    losses = []
    for step, (x,) in enumerate(loader):
        if step == STEPS:
            break
        loss = model(input_ids=x, labels=x).loss
        strategy.backward(loss)
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    strategy.finalize(model)
    strategy.save(path, model=model, optimizer=optimizer, step=STEPS)
    # After the save (a collective: every worker has stopped pushing, even the async ones).
    consensus = strategy.eval_model(model)
    assert isinstance(consensus, GPT2LMHeadModel)
    state = {k: v.detach().clone() for k, v in consensus.state_dict().items()}
    strategy.close()
    return {"losses": losses, "state": state}


@pytest.mark.filterwarnings("ignore:EAMSGD:RuntimeWarning")  # AdamW + momentum: intended here
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_gpt2_trains_and_loads_with_from_pretrained(name, tmp_path):
    kwargs, needs_ps = STRATEGIES[name]
    servers, addrs = start_local_shards(1) if needs_ps else ([], [])
    ckpt = str(tmp_path / "ckpt")
    try:
        if needs_ps:
            kwargs = {**kwargs, "ps_addresses": addrs}
        if name == "one_device":
            results = [train_gpt2(sg.from_name(name, comm=Comm.single()), ckpt)]
        else:
            world, nnodes = LAYOUT.get(name, (2, 1))
            results = run_ranks(lambda comm: train_gpt2(
                sg.from_name(name, comm=comm, timeout=20, **kwargs), ckpt), world,
                timeout=50.0, comm_timeout=20.0, nnodes=nnodes)
    finally:
        for s in servers:
            s.stop(0)
    for r in results:
        assert len(r["losses"]) == STEPS
        assert all(torch.isfinite(torch.tensor(r["losses"])))

    # What transformers needs: a directory with config.json and model.safetensors.
    hf_dir = tmp_path / "hf"
    tiny_config().save_pretrained(hf_dir)
    shutil.copy(tmp_path / "ckpt" / "model.safetensors", hf_dir / "model.safetensors")
    loaded, info = GPT2LMHeadModel.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

    # The names in the file are GPT-2's own, the tied weight stored once or twice but equal.
    saved = load_file(str(hf_dir / "model.safetensors"))
    own = set(loaded.state_dict())
    assert set(saved) <= own and own - set(saved) <= {"lm_head.weight"}
    # The file holds the consensus model (what eval_model returned after finalize), trained.
    consensus = results[0]["state"]
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, consensus[key], msg=lambda m, k=key: f"{k}: {m}")
    torch.manual_seed(0)  # the initial model of train_gpt2: training moved it
    initial = GPT2LMHeadModel(tiny_config())
    assert not torch.equal(loaded.transformer.wte.weight, initial.transformer.wte.weight)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(loaded(input_ids=ids).logits).all()
