"""A fault-tolerant replica's DDP buckets are fixed at wrap time.

DDP regroups its buckets after the first backward, by the order the gradients became ready;
a replica that joins a running job would then reduce its first step's gradients in another
layout than its peers' (another bucket count, other parameters per bucket). Under a
fault-tolerant Comm the layout is pinned from the parameters' order when the model is
wrapped, so it is the same for an old replica and a new one, from the first backward on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from stratagem.comm import new_group
from stratagem.parts.grad_sync import _pin_bucket_layout


class Net(nn.Module):
    """Gradients become ready in an order unlike the registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(10, 10)  # registered first, used last
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c(torch.relu(self.b(torch.relu(self.a(x))))))


def _layouts(pin: bool, steps: int) -> list[list[list[str]]]:
    torch.manual_seed(0)
    model = Net()
    group = new_group(dist.HashStore(), 0, 1, 30.0)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.2, find_unused_parameters=False)
    if pin:
        _pin_bucket_layout(ddp)
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[list[str]] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        seen.append([names[id(p)] for p in bucket.parameters()])
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    out = []
    for _ in range(steps):
        seen.clear()
        ddp(torch.randn(4, 64)).sum().backward()
        out.append(list(seen))
    return out


def test_ddp_alone_changes_its_buckets_after_the_first_backward() -> None:
    # The hazard the pin removes (if a torch stops regrouping, this test says so).
    first, second = _layouts(pin=False, steps=2)
    assert first != second


def test_a_pinned_layout_is_the_same_from_the_first_backward_on_for_old_and_new_replicas(
) -> None:
    old = _layouts(pin=True, steps=3)
    new = _layouts(pin=True, steps=1)
    assert old[0] == old[1] == old[2] == new[0]
    assert len(old[0]) > 1  # several buckets: the layout is not trivially equal
    assert sorted(n for b in old[0] for n in b) == sorted(n for n, _ in Net().named_parameters())
