"""``Hierarchical(inner=Sharded(), outer=DiLoCo())``: FSDP2 inside each node, DiLoCo across
nodes (HSDP + DiLoCo, as torchtitan with torchft runs it), on 2 simulated nodes x 2 real
processes (FSDP2 needs launched processes), trained on MNIST-5k."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg

pytestmark = pytest.mark.timeout(600)  # one 4-process launch on a shared 2-core machine

EPOCHS = 3


def _job(root: str) -> dict[str, Any]:
    from stratagem.demo import MLP, evaluate, load_mnist5k

    torch.set_num_threads(1)
    (x, y), (x_test, y_test) = load_mnist5k()
    strategy = sg.Hierarchical(inner=sg.Sharded(), outer=sg.DiLoCo(period=10), timeout=60)
    with strategy.scope():
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset((x, y), global_batch_size=64, shuffle=True, seed=0)
    t0 = time.perf_counter()
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            strategy.backward(F.cross_entropy(model(xb), yb))
            opt.step()
            opt.zero_grad()
    strategy.finalize(model)
    accuracy = evaluate(strategy, strategy.eval_model(model), x_test, y_test)
    strategy.save(f"{root}/hsdp", model=model, optimizer=opt, step=EPOCHS)
    result = {"accuracy": accuracy, "seconds": time.perf_counter() - t0,
              "metrics": strategy.metrics(), "local": sum(
                  p.to_local().numel() for p in strategy.unwrap(model).parameters())}
    strategy.close()
    return result


def test_hierarchical_sharded_inside_diloco_across_trains_mnist5k(tmp_path):
    from stratagem.checkpoint import load_model_state
    from stratagem.demo import MLP

    results = sg.launch(_job, nprocs=4, nnodes=2, args=(str(tmp_path),), timeout=580)
    assert all(r["accuracy"] == results[0]["accuracy"] for r in results)
    print(f"accuracy {results[0]['accuracy']:.4f}, {results[0]['seconds']:.1f} s of training")
    assert results[0]["accuracy"] >= 0.92, results[0]["accuracy"]
    total = sum(p.numel() for p in MLP().parameters())
    # Each process holds half of the model (sharded inside its node of 2).
    assert sum(r["local"] for r in results) == 2 * total
    # The checkpoint holds the consensus model, loadable into a plain module.
    MLP().load_state_dict(load_model_state(tmp_path / "hsdp"))
