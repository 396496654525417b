"""Strategy core, OneDevice and Mirrored: equivalence, replica checks, reduce/gather, input."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_states_close, make_data, make_model, train
from torch import nn

import stratagem as sg
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def test_default_strategy_is_one_device_and_scope_nests():
    assert isinstance(sg.get_strategy(), sg.OneDevice)
    outer, inner = sg.OneDevice(), sg.OneDevice()
    with outer.scope():
        assert sg.get_strategy() is outer
        with inner.scope():
            assert sg.get_strategy() is inner
        assert sg.get_strategy() is outer
    assert sg.get_strategy() is not outer


@pytest.mark.parametrize("world", [2, 4])
def test_mirrored_equals_one_device_with_global_batch(world):
    data = make_data()
    reference, _ = train(sg.OneDevice(), data, global_batch_size=8 * world, steps=20)
    results = run_ranks(lambda comm: train(sg.Mirrored(comm=comm), data,
                                           global_batch_size=8 * world, steps=20), world)
    for state, metrics in results:
        assert_states_close(state, reference, atol=1e-5, rtol=1e-5)
        assert metrics["steps"] == 20
        assert metrics["bytes_sent"] > 0


def test_mirrored_bytes_match_ring_allreduce_theory():
    data = make_data()
    n_bytes = sum(p.numel() * 4 for p in make_model().parameters())

    def job(comm):
        strategy = sg.Mirrored(comm=comm)
        with strategy.scope():
            model = make_model()
            model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = strategy.metrics()["bytes_sent"]
        x, y = data[0][:16], data[1][:16]
        for _ in range(5):
            strategy.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        return strategy.metrics()["bytes_sent"] - before

    sent = run_ranks(job, 2)
    assert sent[0] == pytest.approx(5 * 2 * (2 - 1) / 2 * n_bytes, rel=0.01)


def test_prepare_broadcasts_rank0_state_once(monkeypatch):
    # Every replica starts from rank 0's state: prepare broadcasts it itself, and DDP's
    # constructor must not broadcast it again (init_sync=False, where torch's DDP takes it).
    import torch.nn.parallel.distributed as ddp_module

    from stratagem.comm import Comm
    from stratagem.parts import grad_sync

    calls: list[str] = []
    real_ddp_sync = ddp_module._sync_module_states
    real_broadcast = Comm.broadcast_coalesced

    def ddp_sync(*args, **kwargs):
        calls.append("ddp")
        return real_ddp_sync(*args, **kwargs)

    def broadcast(self, *args, **kwargs):
        calls.append("stratagem")
        return real_broadcast(self, *args, **kwargs)

    monkeypatch.setattr(ddp_module, "_sync_module_states", ddp_sync)
    monkeypatch.setattr(Comm, "broadcast_coalesced", broadcast)

    def job(comm):
        strategy = sg.Mirrored(comm=comm)
        model = strategy.prepare(make_model(seed=comm.rank))
        return strategy.unwrap(model).state_dict()

    a, b = run_ranks(job, 2)
    assert_states_close(a, b, atol=0, rtol=0)
    assert_states_close(a, make_model(seed=0).state_dict(), atol=0, rtol=0)
    expected_ddp = [] if grad_sync._DDP_TAKES_INIT_SYNC else ["ddp", "ddp"]
    assert sorted(calls) == sorted(["stratagem", "stratagem", *expected_ddp])


def test_mismatched_models_raise_naming_parameter_and_ranks():
    def job(comm):
        strategy = sg.Mirrored(comm=comm)
        hidden = 16 if comm.rank == 0 else 17
        with pytest.raises(sg.ReplicaMismatchError) as info:
            strategy.prepare(make_model(hidden=hidden))
        return str(info.value)

    messages = run_ranks(job, 2)
    for msg in messages:
        assert "0.weight" in msg and "rank 0" in msg and "rank 1" in msg and "17" in msg


def test_dtype_mismatch_is_named():
    def job(comm):
        strategy = sg.Mirrored(comm=comm)
        model = make_model()
        if comm.rank == 1:
            model = model.double()
        with pytest.raises(sg.ReplicaMismatchError, match="float64"):
            strategy.prepare(model)

    run_ranks(job, 2)


def test_reduce_nested_values_and_ops():
    def job(comm):
        s = sg.Mirrored(comm=comm)
        r = comm.rank
        value = {"t": torch.tensor([1.0, 2.0]) * (r + 1), "n": [r, 2.5 * r], "i": (torch.tensor([r, 5]),)}
        return (s.reduce("sum", value), s.reduce(sg.ReduceOp.MEAN, value),
                s.reduce("max", r), s.reduce("min", float(r)), s.reduce("mean", 3))

    for summed, mean, mx, mn, m3 in run_ranks(job, 2):
        torch.testing.assert_close(summed["t"], torch.tensor([3.0, 6.0]))
        assert summed["n"] == [1, 2.5] and isinstance(summed["n"][0], int)
        torch.testing.assert_close(summed["i"][0], torch.tensor([1, 10]))
        torch.testing.assert_close(mean["t"], torch.tensor([1.5, 3.0]))
        assert mean["n"] == [0.5, 1.25]
        assert mx == 1 and mn == 0.0 and m3 == 3.0


def test_reduce_non_contiguous_tensor():
    def job(comm):
        s = sg.Mirrored(comm=comm)
        t = torch.arange(6.0).reshape(2, 3).t() * (comm.rank + 1)
        assert not t.is_contiguous()
        return s.reduce("sum", t)

    for out in run_ranks(job, 2):
        torch.testing.assert_close(out, torch.arange(6.0).reshape(2, 3).t() * 3)


def test_reduce_shape_drift_raises_on_every_replica():
    def job(comm):
        s = sg.Mirrored(comm=comm)
        with pytest.raises(sg.ReplicaMismatchError, match="rank 1"):
            s.reduce("sum", torch.ones(2 + comm.rank))
        with pytest.raises(sg.ReplicaMismatchError):
            s.reduce("sum", torch.ones(2, dtype=torch.float32 if comm.rank == 0 else torch.float64))

    run_ranks(job, 2)


def test_reduce_rejects_bad_op_and_type():
    s = sg.OneDevice()
    with pytest.raises(ValueError, match="sum, mean, max, min"):
        s.reduce("avg", 1.0)
    with pytest.raises(TypeError, match="str"):
        s.reduce("sum", "x")


def test_gather_uneven_along_axis_and_nested():
    def job(comm):
        s = sg.Mirrored(comm=comm)
        r = comm.rank
        return s.gather({"a": torch.full((2, r + 1), float(r)), "b": [r]}, axis=1)

    for out in run_ranks(job, 3):
        assert out["a"].shape == (2, 6)
        torch.testing.assert_close(out["a"][0], torch.tensor([0.0, 1, 1, 2, 2, 2]))
        torch.testing.assert_close(out["b"][0], torch.tensor([0, 1, 2]))


def test_run_and_replica_context():
    def job(comm):
        s = sg.Mirrored(comm=comm)

        def fn(x):
            ctx = sg.get_replica_context()
            return ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.all_reduce("sum", x), \
                ctx.all_gather(torch.tensor([x]))

        return s.run(fn, args=(comm.rank + 1,))

    for rid, (replica, n, total, gathered) in enumerate(run_ranks(job, 2)):
        assert (replica, n, total) == (rid, 2, 3)
        torch.testing.assert_close(gathered, torch.tensor([1, 2]))


def test_invalid_arguments_name_the_value():
    with pytest.raises(ValueError, match="accumulation_steps"):
        sg.OneDevice(accumulation_steps=0)
    with pytest.raises(ValueError, match="compression"):
        sg.Mirrored(compression="int8")
    with pytest.raises(ValueError, match="precision"):
        sg.OneDevice(precision="fp8")
    with pytest.raises(ValueError, match="timeout"):
        sg.OneDevice(timeout=0)


def test_from_name_lists_valid_names():
    with pytest.raises(ValueError, match="mirrored"):
        sg.from_name("horovod")
    assert isinstance(sg.from_name("one_device"), sg.OneDevice)


def test_optimizer_without_strategy_backward_under_fp32():
    s = sg.OneDevice()
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model[0].weight.detach().clone()
    x, y = make_data(8)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)
    assert s.metrics()["steps"] == 1


def test_lr_scheduler_accepts_wrapped_optimizer():
    s = sg.OneDevice()
    model = make_model()
    model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = make_data(8)
    s.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_broadcast_coalesced_in_buckets_sets_every_tensor_to_rank0s():
    """Buckets smaller than the model: several collectives, big contiguous tensors sent in
    place, a non-contiguous one and a second dtype copied back, all equal to rank 0's."""
    def job(comm):
        gen = torch.Generator().manual_seed(comm.rank)
        tensors = [torch.randn(300, generator=gen), torch.randn(10, generator=gen),
                   torch.randn(40, 50, generator=gen).t(),  # non-contiguous, 8 kB
                   torch.randn(7, generator=gen), torch.randint(0, 9, (20,), generator=gen),
                   torch.randn(3, generator=gen)]
        before = comm.num_collectives
        comm.broadcast_coalesced(tensors, src=0, bucket_bytes=1024)
        return [t.clone() for t in tensors], comm.num_collectives - before

    (a, calls_a), (b, calls_b) = run_ranks(job, 2)
    gen = torch.Generator().manual_seed(0)
    want = [torch.randn(300, generator=gen), torch.randn(10, generator=gen),
            torch.randn(40, 50, generator=gen).t(), torch.randn(7, generator=gen),
            torch.randint(0, 9, (20,), generator=gen), torch.randn(3, generator=gen)]
    for x, y, w in zip(a, b, want):
        assert torch.equal(x, w) and torch.equal(y, w)
    # float32: [300] alone (1200 B >= 1024, in place), the 8 kB transpose alone (not
    # contiguous: through a flat copy), [10, 7, 3] one bucket; int64: [20] -> 4 broadcasts.
    assert calls_a == calls_b == 4


def test_release_host_memory_returns_freed_blocks_to_the_os():
    """After ``release_host_memory`` a freed 8 MiB tensor leaves resident memory even the
    second time (glibc's default raises its mmap threshold after the first free, so the
    second block would come from the heap and stay resident)."""
    code = (
        "import sys, torch\n"
        "from stratagem.strategies.sharded import release_host_memory\n"
        "def rss():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmRSS:'): return int(line.split()[1]) * 1024\n"
        "release = sys.argv[1] == '1'\n"
        "assert release_host_memory() if release else True\n"
        "grown = []\n"
        "for _ in range(3):\n"
        "    base = rss(); t = torch.ones(2 << 20); del t; grown.append(rss() - base)\n"
        "print(max(grown[1:]))\n")
    import subprocess
    import sys

    out = {flag: int(subprocess.run([sys.executable, "-c", code, flag], check=True,
                                    capture_output=True, text=True, timeout=60).stdout)
           for flag in ("0", "1")}
    assert out["1"] < 1 << 20, out
    assert out["0"] > 4 << 20, out  # the default keeps it: what the setting is for
