"""stratagem.demo_lm: the GPT's corpus, the model, and ``stratagem demo --task lm``."""

from __future__ import annotations

import json

import pytest
import torch

from stratagem import demo
from stratagem.demo_lm import (
    CORPUS_MIN_CHARS,
    GPT,
    VOCAB,
    GPTConfig,
    adamw_param_groups,
    corpus_sources,
    decode,
    encode,
    load_corpus,
    lr_at,
    split_corpus,
    windows,
)


def test_corpus_is_large_deterministic_and_in_the_vocabulary():
    text = load_corpus()
    assert len(text) >= CORPUS_MIN_CHARS
    assert set(text) <= set(VOCAB)
    names = [name for name, _ in corpus_sources()]
    assert names[0].startswith("pydoc_data.topics") and names[-1].startswith("docstrings of")
    load_corpus.cache_clear()
    assert load_corpus() == text  # rebuilt from the files: the same text
    assert "the" in text and "Python" in text


def test_too_little_text_names_what_was_looked_for():
    with pytest.raises(FileNotFoundError) as info:
        load_corpus.__wrapped__(min_chars=10**12)
    message = str(info.value)
    for looked in ("pydoc_data.topics", "LICENSE.txt", "common-licenses", "docstrings"):
        assert looked in message
    assert "Fix:" in message and "--text FILE" in message


def test_encode_decode_and_windows():
    assert decode(encode("Tab\there, caf\u00e9\n")) == "Tab    here, cafe\n"
    data = torch.arange(10)
    X, Y = windows(data, 4)
    assert X.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert Y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    with pytest.raises(ValueError, match="fewer than block_size"):
        windows(torch.arange(3), 4)
    train, val = split_corpus(torch.arange(100), chunk=10, val_every=5)
    assert val[:10].tolist() == list(range(40, 50)) and len(train) + len(val) == 100


def test_gpt_ties_head_to_embedding_and_checks_its_config():
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8))
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names  # one parameter
    groups = adamw_param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(names)
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0
    logits, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, len(VOCAB)) and torch.isfinite(loss)
    with pytest.raises(ValueError, match="longer than block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="n_embd must be divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, lr=1.0, min_lr=0.1, warmup=4, total=20) for s in range(25)]
    assert lrs[0] < lrs[3] < 1.0 and lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[20] == lrs[24] == pytest.approx(0.1)


def test_demo_task_lm_runs_every_strategy_in_process(tmp_path, capsys):
    code = demo.main(["--task", "lm", "--workers", "1", "--max-steps", "4", "--eval-every", "2",
                      "--target", "0.5", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| Mirrored | 1 | not reached |" in out
    assert "DiLoCo" in out and "LocalSGD" in out and "EASGD" in out
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["steps"] for r in rows] == [4, 4, 4, 4]
    assert all(r["reached"] is None and r["final_val_loss"] < 5.0 for r in rows)
