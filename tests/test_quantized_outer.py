"""Quantized outer synchronisation: blockwise int8/int4, the quantized all-reduce
on Comm's primitives, error feedback, Streaming-DiLoCo overlap (sync_delay, alpha), and the
checkpointed residuals / in-flight all-reduce."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from helpers import make_model

import stratagem as sg
from stratagem.comm import Comm, flatten, views
from stratagem.parts.outer import split_fragments
from stratagem.quantize import DEFAULT_BLOCK, dequantize, payload_bytes, quantize
from stratagem.strategies.local_sgd import DiLoCo
from stratagem.testing import FaultyComm, run_ranks

pytestmark = pytest.mark.timeout(120)
QMAX = {"int8": 127, "int4": 7}


def _half_steps(x: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Per value, half the quantization step of its block (x padded to whole blocks)."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block)
    padded[:n] = x
    step = padded.view(-1, block).abs().amax(dim=1) / QMAX[kind]
    return (step[:, None] / 2).expand(-1, block).reshape(-1)[:n]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_dequantize_error_within_half_step(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * DEFAULT_BLOCK, generator=g) * torch.logspace(-6, 3, 16 * DEFAULT_BLOCK)
    x[:DEFAULT_BLOCK] = 0.0  # an all-zero block: scale 0, exact
    payload = quantize(x, kind)
    assert payload.dtype == torch.uint8
    assert payload.numel() == payload_bytes(x.numel(), kind) == (
        x.numel() // (1 if kind == "int8" else 2) + 4 * x.numel() // DEFAULT_BLOCK)
    y = dequantize(payload, kind, x.numel())
    err = (x - y).abs()
    assert bool((err <= _half_steps(x, kind) * (1 + 1e-6) + 1e-30).all())
    assert torch.equal(y[:DEFAULT_BLOCK], torch.zeros(DEFAULT_BLOCK))
    assert float(err.max()) > 0  # it does quantize
    assert torch.equal(quantize(x, kind), payload)  # deterministic
    bad = x.clone()
    bad[DEFAULT_BLOCK + 3] = float("inf")
    z = dequantize(quantize(bad, kind), kind, x.numel())
    assert bool(torch.isnan(z[DEFAULT_BLOCK:2 * DEFAULT_BLOCK]).all())  # never hidden
    assert torch.equal(z[2 * DEFAULT_BLOCK:], y[2 * DEFAULT_BLOCK:])


@pytest.mark.parametrize("kind, ratio", [("int8", 0.27), ("int4", 0.14)])
def test_quantized_all_reduce_is_the_sum_within_the_bound_and_bitwise_equal(kind, ratio):
    n = 50_000 + 7  # not a multiple of anything: padded to whole blocks per rank

    def job(comm):
        x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank)) * (comm.rank + 1)
        lost = torch.empty_like(x)
        before = comm.bytes_sent, comm.bytes_received
        out = comm.all_reduce_quantized(x, kind, lost=lost)
        moved = comm.bytes_sent - before[0], comm.bytes_received - before[1]
        exact = x.clone()
        comm.all_reduce(exact)
        return x, out, lost, moved, comm.allreduce_bytes(4 * n)

    results = run_ranks(job, 3)
    xs = [r[0] for r in results]
    out = results[0][1]
    for r in results:
        assert torch.equal(r[1], out)  # every replica decodes the same bytes
    exact = sum(xs)
    # Bound: each rank's first quantization, then the re-quantization of the sum.
    bound = sum(_half_steps(x, kind) for x in xs)
    requant = _half_steps(exact, kind) + bound / QMAX[kind]  # the sum's block max moves too
    assert bool(((out - exact).abs() <= (bound + requant) * 1.0001 + 1e-6).all())
    mean_err = ((out - exact) / 3).abs().max()
    assert float(mean_err) < float(((bound + requant) / 3).max())
    # The lost tensors account for everything dropped: sum(x) - out == sum(lost).
    torch.testing.assert_close(sum(r[2] for r in results), exact - out, atol=2e-5, rtol=0)
    for _, _, _, (sent, received), fp32 in results:
        chunk = -(-n // (3 * DEFAULT_BLOCK)) * DEFAULT_BLOCK
        assert sent == received == 2 * 2 * payload_bytes(chunk, kind)  # 2 (W-1) P
        assert sent <= ratio * fp32


def test_error_feedback_tracks_the_fp32_sum_over_50_rounds():
    # Values far below the block's step (one large entry per block): without error feedback
    # they round to 0 every round and the running sum drifts linearly; with it, the drift
    # stays within one round's error.
    rounds, n = 50, 4 * DEFAULT_BLOCK

    def job(comm):
        g = torch.Generator().manual_seed(comm.rank)
        residual = torch.zeros(n)
        total_fb, total_plain, total_exact = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        worst = 0.0
        for _ in range(rounds):
            x = 0.03 + torch.rand(n, generator=g) * 0.04  # below half of int4 step 1/7
            x[::DEFAULT_BLOCK] = 1.0
            lost = torch.empty_like(x)
            total_fb += comm.all_reduce_quantized(x + residual, "int4", lost=lost)
            residual = lost
            total_plain += comm.all_reduce_quantized(x, "int4")
            exact = x.clone()
            comm.all_reduce(exact)
            total_exact += exact
            worst = max(worst, float((total_fb - total_exact).abs().max()))
        return total_fb, total_plain, total_exact, worst

    for fb, plain, exact, worst in run_ranks(job, 2):
        drift_fb = float((fb - exact).abs().max())
        drift_plain = float((plain - exact).abs().max())
        one_round = 2 * 2 * (1.0 / 7) / 2 + 0.2  # two ranks' half steps, the re-quantization
        assert worst <= one_round  # bounded over all 50 rounds, not growing
        assert drift_fb <= one_round
        assert drift_plain > 5 * one_round  # without feedback: linear drift


def test_quantized_all_reduce_runs_on_primitives_a_faulty_comm_injects_into():
    def job(comm):
        faulty = FaultyComm(comm).fail_at(op="all_to_all", call=1, peer=1)
        try:
            faulty.all_reduce_quantized(torch.ones(300), "int8")
        except Exception as exc:  # noqa: BLE001 - asserted below
            return type(exc).__name__, str(exc)
        return None

    results = run_ranks(job, 2)
    assert results[1][0] == "InjectedFault"
    assert results[0][0] == "PeerTimeoutError" and "all_to_all" in results[0][1]


# ---------------------------------------------------------------------- DiLoCo
def _setup(strategy, *, seed=0, lr=0.05, hidden=None):
    with strategy.scope():
        model = make_model(seed) if hidden is None else make_model(seed, hidden=hidden)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        return strategy.prepare(model, opt)


def _batches(rank, n, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(n)]


def _step(strategy, model, opt, batch):
    x, y = batch
    strategy.backward(F.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()


def _state(strategy, model):
    return {k: v.detach().clone() for k, v in strategy.unwrap(model).state_dict().items()}


def test_sync_delay_0_is_the_synchronous_fragment_schedule_exactly():
    # Today's code path, written out: every `period` steps fragment k's pseudo-gradient is
    # all-reduced (fp32 sum, / world), handed to Nesterov SGD over theta_prev, and copied in.
    period, fragments, steps = 4, 2, 12

    def reference(comm):
        model = make_model(0)
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=0.05)
        prev = [p.detach().clone() for p in params]
        outer = torch.optim.SGD(prev, lr=0.7, momentum=0.9, nesterov=True)
        frags = split_fragments(params, fragments)
        offsets = [k * period // fragments for k in range(fragments)]
        out = []
        for t, (x, y) in enumerate(_batches(comm.rank, steps), start=1):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            for k, off in enumerate(offsets):
                if t % period != off:
                    continue
                with torch.no_grad():
                    ps = [params[i] for i in frags[k]]
                    delta = flatten([prev[i] for i in frags[k]]).sub_(flatten(ps))
                    comm.all_reduce(delta)
                    delta.div_(comm.world_size)
                    for i, d in zip(frags[k], views(delta, ps), strict=True):
                        prev[i].grad = d
                outer.step()
                with torch.no_grad():
                    for i in frags[k]:
                        prev[i].grad = None
                        params[i].copy_(prev[i])
            out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return out

    def job(comm):
        strategy = DiLoCo(period=period, fragments=fragments, sync_delay=0, alpha=0.0,
                          comm=comm)
        model, opt = _setup(strategy)
        states = []
        for batch in _batches(comm.rank, steps):
            _step(strategy, model, opt, batch)
            states.append(_state(strategy, model))
        return states, reference(comm)

    for mine, ref in run_ranks(job, 2):
        for a, b in zip(mine, ref, strict=True):
            for name in a:
                assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_overlapped_outer_step_lands_sync_delay_steps_later_mixed_by_alpha(alpha):
    # Outer SGD lr 1, no momentum: a landed outer step sets theta_prev to the replicas' mean
    # at the step the all-reduce started; the local fragment becomes alpha*local+(1-alpha)*it.
    period, fragments, delay = 4, 2, 1

    def job(comm):
        strategy = DiLoCo(period=period, fragments=fragments, sync_delay=delay, alpha=alpha,
                          outer_lr=1.0, outer_momentum=0.0, comm=comm)
        model, opt = _setup(strategy)
        module = strategy.unwrap(model)
        st = strategy._prepared[0].state["outer_step"]
        after = []
        for batch in _batches(comm.rank, 9):
            x, y = batch
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()  # after_update runs inside
            opt.zero_grad()
            after.append({n: p.detach().clone() for n, p in module.named_parameters()})
        outer = {n: q.clone() for n, q in zip(st.names, st.prev, strict=True)}
        frags = [[st.names[i] for i in f] for f in st.fragments]
        return after, outer, frags, strategy.metrics()

    results = run_ranks(job, 2)
    frags = results[0][2]
    for _, _, _, metrics in results:
        assert metrics["outer_steps"] == 4  # sent at steps 2, 4, 6, 8; landed at 3, 5, 7, 9
    a0, a1 = results[0][0], results[1][0]
    # Fragment 1 is sent at step 6 (phase 2) and lands at step 7; fragment 0 at 8 -> 9.
    for land, frag in ((7, frags[1]), (9, frags[0])):
        for name in frag:
            same = torch.equal(a0[land - 1][name], a1[land - 1][name])
            assert same == (alpha == 0.0), (land, name)
            # ...and not at the step the all-reduce started (it had not landed yet)
            assert not torch.equal(a0[land - 2][name], a1[land - 2][name])


def test_overlapped_outer_step_equals_the_synchronous_step_on_the_sent_snapshot():
    # sync_delay=1, alpha=0, lr 1, mu 0: after landing, fragment k = mean over replicas of
    # fragment k at the step it was sent (the snapshot), whatever the next inner step did.
    def job(comm, delay):
        strategy = DiLoCo(period=4, fragments=2, sync_delay=delay, outer_lr=1.0,
                          outer_momentum=0.0, comm=comm)
        model, opt = _setup(strategy)
        module = strategy.unwrap(model)
        seen = []
        for batch in _batches(comm.rank, 7):
            _step(strategy, model, opt, batch)
            seen.append({n: p.detach().clone() for n, p in module.named_parameters()})
        st = strategy._prepared[0].state["outer_step"]
        return seen, [[st.names[i] for i in f] for f in st.fragments]

    def both(comm):
        return job(comm, 0), job(comm, 1)

    (sync0, over0), (sync1, over1) = run_ranks(both, 2)
    frags = sync0[1]
    # Steps 1..6 are identical up to the first landing at step 3 (fragment 1, sent at 2).
    # With delay 1 the outer step of fragment 1 that the synchronous run applied at step 2
    # is applied at step 3 on the step-2 snapshot: theta_prev after it is the same mean.
    for name in frags[1]:
        mean = (sync0[0][1][name] + sync1[0][1][name]) / 2  # synchronous: landed at step 2
        torch.testing.assert_close(over0[0][2][name], mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(over1[0][2][name], mean, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_diloco_bytes_and_replicas(kind):
    ratio = {"int8": 0.27, "int4": 0.14}[kind]

    def job(comm):
        out = {}
        for compression in (None, kind):
            strategy = DiLoCo(period=2, compression=compression, comm=comm)
            with strategy.scope():
                model = make_model(0, hidden=512)  # 7.7k values: padding is a few percent
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                model, opt = strategy.prepare(model, opt)
            before = strategy.metrics()["bytes_sent"]
            for batch in _batches(comm.rank, 4):
                _step(strategy, model, opt, batch)
            out[compression] = (strategy.metrics()["bytes_sent"] - before,
                                _state(strategy, model))
        return out

    r0, r1 = run_ranks(job, 2)
    fp32_bytes, fp32_state = r0[None]
    q_bytes, q_state = r0[kind]
    assert q_bytes <= ratio * fp32_bytes
    for name in q_state:
        assert torch.equal(q_state[name], r1[kind][1][name])  # replicas bitwise equal
        torch.testing.assert_close(q_state[name], fp32_state[name], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("compression", ["int4", "topk:0.05+int2"])
def test_residuals_and_in_flight_all_reduce_survive_save_and_restore_bitwise(tmp_path,
                                                                             compression):
    # fragments 2, period 4, sync_delay 1: saved after step 6, when fragment 1's all-reduce
    # (sent at step 6) is in flight and the residuals are non-zero (top-k: most of the
    # pseudo-gradient).
    def make(comm):
        return DiLoCo(period=4, fragments=2, sync_delay=1, alpha=0.5, compression=compression,
                      comm=comm)

    def run(comm, batches, restore_from=None, save_to=None):
        strategy = make(comm)
        model, opt = _setup(strategy)
        if restore_from is not None:
            strategy.restore(restore_from, model=model, optimizer=opt)
        for batch in batches:
            _step(strategy, model, opt, batch)
        st = strategy._prepared[0].state["outer_step"]
        residual = [e.clone() for e in st.residual]
        in_flight = st.flight is not None
        if save_to is not None:
            strategy.save(save_to, model=model, optimizer=opt)
        return _state(strategy, model), residual, in_flight

    def job(comm):
        batches = _batches(comm.rank, 10)
        straight, res_straight, _ = run(comm, batches)
        _, res_saved, in_flight = run(comm, batches[:6], save_to=tmp_path / "ck")
        resumed, res_resumed, _ = run(comm, batches[6:], restore_from=tmp_path / "ck")
        return straight, resumed, res_straight, res_resumed, res_saved, in_flight

    results = run_ranks(job, 2)
    saved = safetensors.torch.load_file(tmp_path / "ck" / "strategy.safetensors")
    for straight, resumed, res_a, res_b, res_saved, in_flight in results:
        assert in_flight
        assert any(float(e.abs().max()) > 0 for e in res_saved)
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), name
        for a, b in zip(res_a, res_b, strict=True):
            assert torch.equal(a, b)
    assert "model/residual.rank1/0.weight" in saved and "model/pending_outer.meta" in saved


@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_quantized_diloco_checkpoint_moves_to_mirrored(tmp_path, compression):
    def job(comm):
        strategy = DiLoCo(period=2, compression=compression, comm=comm)
        model, opt = _setup(strategy)
        for batch in _batches(comm.rank, 5):
            _step(strategy, model, opt, batch)
        strategy.save(tmp_path / "ck", model=model)
        st = strategy._prepared[0].state["outer_step"]
        outer = [q.clone() for q in st.prev]
        mirrored = sg.Mirrored(comm=comm)
        with mirrored.scope():
            m2 = make_model(7)
            o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
            m2, o2 = mirrored.prepare(m2, o2)
        mirrored.restore(tmp_path / "ck", model=m2)
        loaded = [p.detach().clone() for p in mirrored.unwrap(m2).parameters()]
        return outer, loaded

    for outer, loaded in run_ranks(job, 2):
        for q, p in zip(outer, loaded, strict=True):
            assert torch.equal(q, p)


def test_hierarchical_outer_diloco_int8_keeps_replicas_equal():
    def job(comm):
        strategy = sg.Hierarchical(inner="mirrored", outer="diloco", outer_period=2,
                                   outer_compression="int8", comm=comm)
        model, opt = _setup(strategy)
        for batch in _batches(comm.node_rank, 4):
            _step(strategy, model, opt, batch)
        return _state(strategy, model), strategy.metrics()

    results = run_ranks(job, 4, nnodes=2)
    first = results[0][0]
    for state, _ in results[1:]:
        for name in first:
            assert torch.equal(first[name], state[name])


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, text", [
    ({"sync_delay": 2, "period": 4, "fragments": 2}, "sync_delay must be < period // fragments"),
    ({"sync_delay": -1}, "sync_delay must be an int >= 0, got -1"),
    ({"alpha": 1.0}, "alpha must be a number in [0, 1), got 1.0"),
    ({"compression": "int3"}, "got 'int3'"),
])
def test_invalid_overlap_and_quantization_arguments_name_the_value(kwargs, text):
    with pytest.raises(ValueError, match="Fix") as info:
        DiLoCo(comm=Comm.single(), **kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_mirrored_and_ps_refuse_quantized_kinds_with_where_they_work(kind):
    with pytest.raises(ValueError, match=rf"got '{kind}'.*outer synchronisation only: DiLoCo"):
        sg.Mirrored(compression=kind, comm=Comm.single())


# ---------------------------------------------------------------------- Mirrored's residuals
def test_mirrored_bf16_error_feedback_residuals_survive_save_and_restore(tmp_path):
    # Residuals that restarted at zero after a restore would make a resumed run drift
    # from the uninterrupted one by what the casts had not sent yet.
    def run(comm, batches, restore_from=None, save_to=None):
        strategy = sg.Mirrored(compression="bf16", error_feedback=True, comm=comm)
        with strategy.scope():
            model = make_model(0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model, opt = strategy.prepare(model, opt)
        if restore_from is not None:
            strategy.restore(restore_from, model=model, optimizer=opt)
        for batch in batches:
            _step(strategy, model, opt, batch)
        if save_to is not None:
            strategy.save(save_to, model=model, optimizer=opt)
        return _state(strategy, model), strategy.metrics()["error_feedback_norm"]

    def job(comm):
        batches = _batches(comm.rank, 6)
        straight, norm = run(comm, batches)
        _, saved_norm = run(comm, batches[:3], save_to=tmp_path / "ck")
        resumed, resumed_norm = run(comm, batches[3:], restore_from=tmp_path / "ck")
        return straight, resumed, norm, saved_norm, resumed_norm

    for straight, resumed, norm, saved_norm, resumed_norm in run_ranks(job, 2):
        assert saved_norm > 0
        assert resumed_norm == norm
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), name
    keys = safetensors.torch.load_file(tmp_path / "ck" / "strategy.safetensors")
    assert "model/ef_residual.rank1/0.weight" in keys


def test_a_peer_lost_during_the_background_all_reduce_raises_at_the_step_it_is_due():
    def job(comm):
        strategy = DiLoCo(period=4, fragments=2, sync_delay=1, compression="int8", comm=comm)
        model, opt = _setup(strategy)
        batches = _batches(comm.rank, 4)
        if comm.rank == 1:
            _step(strategy, model, opt, batches[0])
            return None  # leaves before fragment 1's all-reduce (sent at step 2)
        _step(strategy, model, opt, batches[0])
        _step(strategy, model, opt, batches[1])  # launches it in the background: no wait
        try:
            _step(strategy, model, opt, batches[2])  # due here
        except sg.PeerTimeoutError as exc:
            return str(exc)
        return "no error"

    message = run_ranks(job, 2, comm_timeout=3.0)[0]
    assert "peer rank(s) 1" in message or "rank 1" in message, message


# ---------------------------------------------------------------------- torchft
class _FakeManager:
    """What torchft's DiLoCo asks of its Manager, over a stratagem Comm: a fixed quorum of
    every replica, commits that always succeed, and Manager.allreduce's average (a sum, then
    ``/= num_participants``)."""

    _use_async_quorum = False

    def __init__(self, comm):
        self.comm = comm
        self.step = 0

    def allreduce(self, tensor, should_quantize=False):
        self.comm.all_reduce(tensor)
        tensor /= self.comm.world_size

        class _Done:
            def wait(self, timeout=None):
                return True

        return _Done()

    def should_commit(self):
        self.step += 1
        return True

    def current_step(self):
        return self.step

    def start_quorum(self):
        pass

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass

    def register_state_dict_fn(self, *args):
        pass


def test_fp32_diloco_without_overlap_equals_torchft_diloco():
    local_sgd = pytest.importorskip("torchft.local_sgd")
    period, steps = 3, 9

    def job(comm):
        batches = _batches(comm.rank, steps)
        strategy = DiLoCo(period=period, outer_lr=0.7, outer_momentum=0.9, comm=comm)
        model, opt = _setup(strategy)
        for batch in batches:
            _step(strategy, model, opt, batch)
        ours = _state(strategy, model)

        theirs = make_model(0)
        inner = torch.optim.Adam(theirs.parameters(), lr=0.05)
        outer = torch.optim.SGD(theirs.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with local_sgd.DiLoCo(_FakeManager(comm), [theirs], inner, outer, sync_every=period,
                              pin_memory=False):
            for x, y in batches:
                F.cross_entropy(theirs(x), y).backward()
                inner.step()
                inner.zero_grad()
        return ours, {k: v.detach().clone() for k, v in theirs.state_dict().items()}

    for ours, theirs in run_ranks(job, 2):
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0)
