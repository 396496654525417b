"""The training script of ``tests/test_multinode.py``, run by ``stratagem run`` on every node.

    stratagem run --nproc 2 --nnodes 2 --node-rank R ... --strategy NAME multinode_job.py OUT STEPS
        [NAME2 STEPS2 JSON_ARGS2 ...]

A small MLP trained with SGD for STEPS steps under ``sg.from_env()``; each worker then writes
``OUT/rank<R>.json``: its node environment, the consensus model (``eval_model`` after
``finalize``), the initial parameters, its loss, the strategy's metrics, the TCP sockets
listening in its namespace (the node) while the whole job is up, and the bytes its node's
interface sent and received during the training. Each further (NAME, STEPS, JSON_ARGS) is then
run the same way in the same processes, after the previous strategy was closed
(``sg.from_name``), and reported in ``OUT/<NAME>/rank<R>.json``: one job start-up (seconds of
process and rendezvous on 2 cores) for several strategies.
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


def _link_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this node's interface, read inside its namespace."""
    stats = Path("/sys/class/net", os.environ["GLOO_SOCKET_IFNAME"], "statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def main(out: str, steps: int, strategy: sg.Strategy) -> None:
    # Both ends of the training are collectives (prepare's broadcast or the PS join, and the
    # reduce below), so what the counters see between them is this strategy's traffic, plus
    # at most the other local worker's share of the edges.
    link_before = _link_bytes()
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
    mean_loss = float(strategy.reduce("mean", loss.detach()))
    link_after = _link_bytes()
    report = {"env": {k: os.environ.get(k) for k in ENV},
              "link_bytes": [link_after[0] - link_before[0], link_after[1] - link_before[1]],
              "initial": initial,
              "final": {k: v.tolist() for k, v in final.state_dict().items()},
              "loss": mean_loss,
              "listening": sorted(listening_sockets().values()),
              "metrics": {k: v for k, v in strategy.metrics().items()
                          if isinstance(v, (int, float))}}
    rank = os.environ["RANK"]
    Path(out).mkdir(exist_ok=True)
    tmp = Path(out, f"rank{rank}.tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, Path(out, f"rank{rank}.json"))
    strategy.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sg.from_env(timeout=30.0))
    rest = sys.argv[3:]
    for i in range(0, len(rest), 3):
        name, phase_steps, args = rest[i], int(rest[i + 1]), json.loads(rest[i + 2])
        main(str(Path(sys.argv[1], name)), phase_steps, sg.from_name(name, timeout=30.0, **args))
    # The report is written and the group released: skip the interpreter's teardown of torch
    # and gloo (seconds per worker on 2 loaded cores; clean exits are test_clean_exit's topic).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
