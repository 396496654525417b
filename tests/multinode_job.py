"""The training script of ``tests/test_multinode.py``, run by ``stratagem run`` on every node.

    stratagem run --nproc 2 --nnodes 2 --node-rank R ... --strategy NAME multinode_job.py OUT STEPS

A small MLP trained with SGD for STEPS steps under ``sg.from_env()``; each worker then writes
``OUT/rank<R>.json``: its node environment, the consensus model (``eval_model`` after
``finalize``), the initial parameters, its loss, the strategy's metrics and the TCP sockets
listening in its namespace (the node) while the whole job is up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.testing.netns import listening_sockets

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
       "GLOO_SOCKET_IFNAME", "STRATAGEM_PS_ADDRS")


def main(out: str, steps: int) -> None:
    strategy = sg.from_env(timeout=30.0)
    torch.manual_seed(0)  # the same initial model on every replica
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 4))
        initial = {k: v.tolist() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        model, optimizer = strategy.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 16, generator=g)
    y = x[:, :4].argmax(1)
    loader = strategy.distribute_dataset((x, y), global_batch_size=64, shuffle=True, seed=0)
    step, epoch = 0, 0
    loss = torch.zeros(())
    while step < steps:
        loader.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            strategy.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == steps:
                break
        epoch += 1
    strategy.finalize(model)
    final = strategy.eval_model(model)
    report = {"env": {k: os.environ.get(k) for k in ENV},
              "initial": initial,
              "final": {k: v.tolist() for k, v in final.state_dict().items()},
              "loss": float(strategy.reduce("mean", loss.detach())),
              "listening": sorted(listening_sockets().values()),
              "metrics": {k: v for k, v in strategy.metrics().items()
                          if isinstance(v, (int, float))}}
    rank = os.environ["RANK"]
    tmp = Path(out, f"rank{rank}.tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, Path(out, f"rank{rank}.json"))
    strategy.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # The report is written and the group released: skip the interpreter's teardown of torch
    # and gloo (seconds per worker on 2 loaded cores; clean exits are test_clean_exit's topic).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
