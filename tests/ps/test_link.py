"""``PSLink``: the shard connection both PS strategies hold (connect, tables, bytes folded
into the Comm, metrics, close)."""

from __future__ import annotations

import pytest
import torch

from stratagem.comm import Comm
from stratagem.ps.link import PSLink
from stratagem.ps.optim import optimizer_spec


def test_link_connects_on_first_use_and_counts_shard_bytes_in_the_comm(shards):
    _, addrs = shards
    comm = Comm.single()
    link = PSLink(addrs, comm=comm, timeout=10)
    assert not link.connected and link.metrics() == {}
    link.fold_bytes()  # nothing to count before connecting
    assert comm.bytes_sent == 0
    table = link.table({"w": torch.ones(3)}, mode="elastic")
    assert link.connected
    table.register()
    link.fold_bytes()
    sent, received = comm.bytes_sent, comm.bytes_received
    assert sent > 12 and received > 12  # the tensor went both ways, plus the health checks
    assert link.metrics() == {"ps_bytes_sent": sent, "ps_bytes_received": received}
    link.fold_bytes()  # a delta: nothing new
    assert (comm.bytes_sent, comm.bytes_received) == (sent, received)
    link.close()
    link.close()
    assert not link.connected and link.metrics() == {}


def test_link_without_addresses_says_so():
    link = PSLink([], comm=Comm.single(), timeout=1)
    with pytest.raises(ValueError, match="no shard addresses"):
        link.connect()
    with pytest.raises(ValueError, match=r"timeout must be a finite number in \[0.001, 1e\+06\], got 0"):
        PSLink(["127.0.0.1:1"], comm=Comm.single(), timeout=0)


def test_set_optimizer_specs_validates_and_is_sent_with_set_state(shards):
    _, addrs = shards
    link = PSLink(addrs, comm=Comm.single(), timeout=10)
    w = torch.nn.Parameter(torch.zeros(2))
    sgd = optimizer_spec(torch.optim.SGD([w], lr=0.1))
    table = link.table({"w": w.detach()}, mode="async", optimizer_spec=sgd)
    table.register()
    with pytest.raises(ValueError, match="unknown optimizer"):
        table.set_optimizer_specs({"w": {"name": "nope"}})
    with pytest.raises(KeyError, match="'v' is not one of the sharded tensors"):
        table.set_optimizer_specs({"v": sgd})
    table.set_optimizer_specs({"w": {**sgd, "lr": 1.0}})
    table.set_state(table.get_state())
    table.push({"w": torch.ones(2)})
    torch.testing.assert_close(table.pull()["w"], torch.full((2,), -1.0))  # lr 1.0 applied
    link.close()
