"""Fault-tolerant synchronous training (issue 22): replicas as threads, declared faults.

Every test runs real torchft quorums (a Lighthouse on loopback), real reconfigurable gloo
groups and real heals through stratagem's heal transport; only process death is simulated
(``stratagem.testing.ft``: the dead replica's manager, heal server and sockets are torn down
as a killed process's would be).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

pytest.importorskip("torchft")

from stratagem.testing.ft import ReplicaFaults, run_replicas  # noqa: E402

pytestmark = pytest.mark.timeout(180)

N_SAMPLES = 512


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_SAMPLES, 20, generator=g)
    w = torch.randn(20, 4, generator=g)
    return x, (x @ w).argmax(1)


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, width)
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _train(comm, make, steps, faults, width=32):
    torch.manual_seed(1000 + comm.slot)  # different inits: the first quorum makes them equal
    strategy = make(comm)
    model = Net(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(_data(), global_batch_size=48, shuffle=True, seed=3)
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            if faults is not None:
                faults.check(comm, strategy.steps)
            if strategy.steps >= steps:
                break
        if strategy.steps >= steps:
            break
    strategy.finalize(model)
    module = strategy.unwrap(model)
    return ({k: v.detach().clone() for k, v in module.state_dict().items()},
            strategy.steps, comm.heals, comm.failed_steps, dict(loader.state_dict()))


STRATEGIES = {
    "mirrored": lambda comm: sg.Mirrored(comm=comm),
    "local_sgd": lambda comm: sg.LocalSGD(comm=comm, period=4),
    "diloco": lambda comm: sg.DiLoCo(comm=comm, period=4, fragments=2),
}


def _assert_equal(results):
    first = results[0][0]
    for state, *_ in results[1:]:
        for k in first:
            assert torch.equal(first[k], state[k]), k


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_killed_replica_is_restarted_and_healed_bitwise(name):
    faults = ReplicaFaults().fail_at(1, 6)
    results = run_replicas(_train, 3, args=(STRATEGIES[name], 16, faults), faults=faults)
    assert faults.deaths == [(1, 6)]
    _assert_equal(results)
    assert all(r[1] == 16 for r in results)
    assert results[1][2] >= 1  # the replacement healed from a peer
    positions = {tuple(sorted(r[4].items())) for r in results}
    assert len(positions) == 1  # the healed replica resumed at its peers' data position


def test_without_faults_replicas_stay_bitwise_equal_and_nothing_fails():
    results = run_replicas(_train, 3, args=(STRATEGIES["mirrored"], 10, None))
    _assert_equal(results)
    assert all(r[3] == 0 for r in results)
