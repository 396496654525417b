"""``FaultyComm`` itself: transparent until a declared fault, counted per operation, and its
declarations checked (the diagnosis it drives is tested in ``test_dead_peer.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.comm import Comm
from stratagem.testing import FaultyComm, InjectedFault, run_ranks


def test_without_faults_it_is_the_comm_it_wraps():
    # Mirrored's DDP built-in path runs through the wrapper's group: the same training, the
    # counters are the wrapped Comm's, and every collective is counted.
    def job(comm):
        faulty = FaultyComm(comm)
        assert isinstance(faulty, Comm) and faulty.rank == comm.rank
        s = sg.Mirrored(comm=faulty)
        torch.manual_seed(comm.rank)  # different inits: prepare broadcasts rank 0's
        model = torch.nn.Linear(4, 3)
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(comm.rank))
        for _ in range(3):
            s.backward(F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)))
            opt.step()
            opt.zero_grad()
        assert faulty.bytes_sent == comm.bytes_sent > 0
        assert faulty.num_collectives == comm.num_collectives
        gathered = faulty.all_gather(torch.tensor([float(comm.rank)]))
        state = {k: v.detach().clone() for k, v in s.unwrap(model).state_dict().items()}
        return state, faulty.calls("all_reduce"), faulty.calls("all_gather"), gathered

    (s0, ar0, ag0, g0), (s1, ar1, _, _) = run_ranks(job, 2)
    for k in s0:
        torch.testing.assert_close(s0[k], s1[k], atol=0, rtol=0)
    assert ar0 == ar1 == 3  # one bucket per backward
    assert ag0 >= 2  # DDP's construction check, then ours
    torch.testing.assert_close(torch.cat(g0), torch.tensor([0.0, 1.0]))


def test_a_failed_all_gather_names_the_dead_peer():
    def job(comm):
        faulty = FaultyComm(comm).fail_at(op="all_gather", call=2, peer=1)
        faulty.all_gather(torch.zeros(2))
        try:
            faulty.all_gather(torch.zeros(2))
        except (sg.PeerTimeoutError, InjectedFault) as exc:
            return type(exc).__name__, getattr(exc, "ranks", None)
        return "no error", None

    assert run_ranks(job, 2, heartbeat=True, comm_timeout=2.0) == [
        ("PeerTimeoutError", (1,)), ("InjectedFault", None)]


def test_declarations_name_the_bad_value():
    faulty = FaultyComm(Comm.single())
    with pytest.raises(ValueError, match="op must be one of .* got 'allreduce'"):
        faulty.fail_at(op="allreduce", call=1, peer=0)
    with pytest.raises(ValueError, match="call must be an integer >= 1, got 0"):
        faulty.stall_at(op="all_reduce", call=0, seconds=1)
    with pytest.raises(ValueError, match="peer must be a rank below world_size=1, got 1"):
        faulty.fail_at(op="broadcast", call=1, peer=1)
    with pytest.raises(ValueError, match="seconds must be a positive number, got 0"):
        faulty.stall_at(op="all_gather", call=1, seconds=0)
    with pytest.raises(TypeError, match="already a FaultyComm"):
        FaultyComm(faulty)
    # A world of one runs no collective, so nothing fires.
    faulty.stall_at(op="all_reduce", call=1, seconds=30)
    assert faulty.all_reduce(torch.ones(1)).item() == 1.0 and faulty.fired == []
