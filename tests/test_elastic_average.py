"""ElasticAveraging (EASGD / EAMSGD): exact hand-computed trajectories in sync and async mode,
the paper's stability condition, equivalences, checkpoints, byte accounting, rejoin."""

from __future__ import annotations

import threading
import time

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from helpers import assert_states_close, join_with_late_chief, make_data, make_model
from torch import nn

import stratagem as sg
from stratagem.comm import Comm
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient
from stratagem.strategies.elastic_average import ElasticAveraging
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


class Pair(nn.Module):
    """Two scalar parameters starting at 0 and 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.0))
        self.b = nn.Parameter(torch.tensor(1.0))


def _values(module: nn.Module) -> tuple[float, float]:
    return (float(module.a.detach()), float(module.b.detach()))


def _center(strategy: sg.Strategy, model: nn.Module) -> tuple[float, float]:
    return _values(strategy.eval_model(model))


def _pair_worker(strategy: sg.Strategy, slope: float):
    """A Pair under ``strategy`` with SGD lr 1 and loss ``-slope * (a + b)``: every local step
    adds ``slope`` to both values before the elastic exchange."""
    with strategy.scope():
        model = Pair()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))

    def step() -> None:
        strategy.backward(-slope * (model.a + model.b))
        opt.step()
        opt.zero_grad()

    return model, step


# ---------------------------------------------------------------------- (a) one worker
def test_one_worker_trajectory_by_hand_and_checkpoint_holds_center(tmp_path):
    # period 2, moving_rate 1: at steps 2 and 4, d = x - c; x -= d (x becomes c); c += d.
    # step 1: x = (1,2)            c = (0,1)
    # step 2: x = (2,3) -> d = (2,2), x = (0,1), c = (2,3)
    # step 3: x = (1,2)            c = (2,3)
    # step 4: x = (2,3) -> d = (0,0), x = (2,3), c = (2,3)
    strategy = ElasticAveraging(period=2, moving_rate=1.0, comm=Comm.single())
    model, step = _pair_worker(strategy, 1.0)
    expected_local = [(1, 2), (0, 1), (1, 2), (2, 3)]
    expected_center = [(0, 1), (2, 3), (2, 3), (2, 3)]
    for local, center in zip(expected_local, expected_center, strict=True):
        step()
        assert _values(model) == local
        assert _center(strategy, model) == center
    strategy.save(tmp_path / "ckpt", model=model)
    saved = safetensors.torch.load_file(tmp_path / "ckpt" / "model.safetensors")
    assert saved == {"a": torch.tensor(2.0), "b": torch.tensor(3.0)}
    plain = Pair()
    safetensors.torch.load_model(plain, tmp_path / "ckpt" / "model.safetensors")
    assert _values(plain) == (2.0, 3.0)
    assert strategy.metrics()["exchanges"] == 2


# ---------------------------------------------------------------------- (b) two workers
# Worker 0 adds 1 per step, worker 1 adds 2 (loss -(r+1)(a+b), SGD lr 1); period 2,
# moving_rate 0.5; both start at x = c = (0,1).
SYNC_EXPECTED = [
    # (x0, x1, center) after steps 1..4. Sync: all d_i are measured against the same c.
    ((1, 2), (2, 3), (0, 1)),
    # step 2: x0 = (2,3), x1 = (4,5); d0 = (2,2), d1 = (4,4); x0 -= d0/2 -> (1,2);
    # x1 -= d1/2 -> (2,3); c += (d0 + d1)/2 = (3,3) -> (3,4)
    ((1, 2), (2, 3), (3, 4)),
    ((2, 3), (4, 5), (3, 4)),
    # step 4: x0 = (3,4), x1 = (6,7); d0 = (0,0), d1 = (3,3); x0 = (3,4); x1 = (4.5,5.5);
    # c += (0 + 3)/2 -> (4.5,5.5)
    ((3, 4), (4.5, 5.5), (4.5, 5.5)),
]


def test_two_workers_sync_by_hand():
    def job(comm):
        strategy = ElasticAveraging(period=2, moving_rate=0.5, comm=comm)
        model, step = _pair_worker(strategy, float(comm.rank + 1))
        out = []
        for _ in range(4):
            step()
            out.append((_values(model), _center(strategy, model)))
        return out

    r0, r1 = run_ranks(job, 2)
    for (x0, c0), (x1, c1), (e0, e1, ec) in zip(r0, r1, SYNC_EXPECTED, strict=True):
        assert (x0, x1) == (e0, e1)
        assert c0 == c1 == ec


ASYNC_EXPECTED = [
    # Interleaving A1 B1 A2 B2 A3 B3 A4 B4 (A adds 1, B adds 2); each exchange is applied on
    # the shards when it arrives: d = x - c; c += d/2; x -= d/2.
    # (xA, xB, center) after each pair of steps:
    ((1, 2), (2, 3), (0, 1)),
    # A2: xA = (2,3), d = (2,2), c = (1,2), xA = (1,2)
    # B2: xB = (4,5), d = (3,3) (against the moved center), c = (2.5,3.5), xB = (2.5,3.5)
    ((1, 2), (2.5, 3.5), (2.5, 3.5)),
    ((2, 3), (4.5, 5.5), (2.5, 3.5)),
    # A4: xA = (3,4), d = (0.5,0.5), c = (2.75,3.75), xA = (2.75,3.75)
    # B4: xB = (6.5,7.5), d = (3.75,3.75), c = (4.625,5.625), xB = (4.625,5.625)
    ((2.75, 3.75), (4.625, 5.625), (4.625, 5.625)),
]


def test_two_workers_async_by_hand(shards):
    # Two async workers (each its own process group of one, as separately launched workers
    # would be) stepped in a fixed interleaving so the order of exchanges is known.
    a = ElasticAveraging(period=2, moving_rate=0.5, mode="async", ps_addresses=shards,
                         comm=Comm.single(), timeout=10)
    b = ElasticAveraging(period=2, moving_rate=0.5, mode="async", ps_addresses=",".join(shards),
                         comm=Comm.single(), timeout=10)
    model_a, step_a = _pair_worker(a, 1.0)
    model_b, step_b = _pair_worker(b, 2.0)
    try:
        for xa, xb, center in ASYNC_EXPECTED:
            step_a()
            step_b()
            assert _values(model_a) == xa
            assert _values(model_b) == xb
            assert _center(a, model_a) == center == _center(b, model_b)
    finally:
        a.close()
        b.close()


def test_async_threads_with_in_process_shards_train_and_never_wait(shards):
    # Two async workers share a process group (run_ranks) and two in-process shards. Worker 1
    # stalls after 5 steps until worker 0 has finished its 30 steps: if worker 0 waited for
    # worker 1 at any point, worker 1's wait would end at its 20 s limit instead (an ordering,
    # not a wall-clock margin, so a loaded machine cannot fail it).
    data = make_data()
    worker0_done = threading.Event()
    stalled_until_worker0_done: list[bool] = []

    def pause(step: int) -> None:
        if step == 5:
            stalled_until_worker0_done.append(worker0_done.wait(20))

    def job(comm):
        strategy = ElasticAveraging(period=2, mode="async", ps_addresses=shards, comm=comm,
                                    moving_rate=0.2)
        losses = _train(strategy, data, steps=30, on_step=pause if comm.rank == 1 else None)
        if comm.rank == 0:
            worker0_done.set()
        center = dict(strategy.eval_model(strategy._prepared[0].module).state_dict())
        strategy.close()
        return losses, center

    (l0, c0), (l1, c1) = run_ranks(job, 2)
    assert stalled_until_worker0_done == [True] and len(l0) == len(l1) == 30
    assert sum(l0[-5:]) < sum(l0[:5]) and sum(l1[-5:]) < sum(l1[:5])
    # Worker 1 finished last: the center it read is the final one.
    with PSClient(shards, timeout=10) as client:
        final = ShardedParameters(client, c1, mode="elastic").pull()
    assert_states_close(c1, final, atol=0, rtol=0)


def test_async_non_chief_waits_for_the_chief_without_provoking_refusals(shards, caplog):
    # The chief registers the center late; the other worker waits on the shards' health
    # (ShardedParameters.join), not by pulling names the shards do not hold yet, which each
    # shard refused and logged ("refused a call ... NOT_FOUND"). Both start from the center.
    chief, other, refusals = join_with_late_chief(
        lambda comm: ElasticAveraging(period=2, mode="async", ps_addresses=shards, comm=comm,
                                      moving_rate=0.2), caplog)
    assert_states_close(chief, other, atol=0, rtol=0)
    assert_states_close(chief, make_model(seed=0).state_dict(), atol=0, rtol=0)
    assert refusals == []


def _train(strategy, data, *, steps, lr=0.1, seed=0, opt="sgd", batch=32, on_step=None):
    with strategy.scope():
        model = make_model(seed)
        optim = (torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=lr))
        model, optim = strategy.prepare(model, optim)
    loader = strategy.distribute_dataset(data, batch, shuffle=True, seed=3)
    losses, epoch = [], 0
    while len(losses) < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            optim.step()
            optim.zero_grad()
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(len(losses))
            if len(losses) == steps:
                break
        epoch += 1
    return losses


# ---------------------------------------------------------------------- rejoin
def test_async_late_and_restarted_worker_start_from_center_without_blocking(shards):
    data = make_data()
    first = ElasticAveraging(period=1, moving_rate=0.5, mode="async", ps_addresses=shards,
                             comm=Comm.single())
    _train(first, data, steps=5)
    with PSClient(shards, timeout=10) as client:
        names = list(make_model().state_dict())
        table = ShardedParameters(client, dict(make_model().state_dict()), mode="elastic")
        center = table.pull()
    assert not torch.equal(center[names[0]], make_model(seed=0).state_dict()[names[0]])

    # A worker joining late, built from another initialisation, starts from the center.
    late = ElasticAveraging(period=1, moving_rate=0.5, mode="async", ps_addresses=shards,
                            comm=Comm.single())
    with late.scope():
        model = late.prepare(make_model(seed=7))
    assert_states_close(late.unwrap(model).state_dict(), center, atol=0, rtol=0)
    late.close()  # the worker "dies" ...
    again = ElasticAveraging(period=1, moving_rate=0.5, mode="async", ps_addresses=shards,
                             comm=Comm.single())
    with again.scope():  # ... and restarts: it rejoins from the (unchanged) center
        model = again.prepare(make_model(seed=8))
    assert_states_close(again.unwrap(model).state_dict(), center, atol=0, rtol=0)

    # A stalled worker (prepared, then silent) does not block a running one.
    release = threading.Event()

    def stalled() -> None:
        worker = ElasticAveraging(period=1, moving_rate=0.5, mode="async", ps_addresses=shards,
                                  comm=Comm.single())
        with worker.scope():
            worker.prepare(make_model(seed=3))
        release.wait(30)
        worker.close()

    thread = threading.Thread(target=stalled, daemon=True)
    thread.start()
    t0 = time.monotonic()
    losses = _train(first, data, steps=20)
    # Blocked by the stalled worker, it would wait past the stalled thread's 30 s; 20 steps
    # take ~1 s (a few s on a loaded machine). The bound is about the midpoint.
    assert time.monotonic() - t0 < 15 and thread.is_alive()
    release.set()
    thread.join(5)
    assert len(losses) == 20
    for s in (first, again):
        s.close()


def test_async_penalty_form_matches_sync_for_one_worker(shards):
    # rho > 0 with one worker: the shards' exchange and the local center copy must give the
    # same trajectory as the replicated center.
    def trajectory(**kwargs):
        strategy = ElasticAveraging(period=2, moving_rate=0.5, rho=0.25, momentum=0.5,
                                    comm=Comm.single(), **kwargs)
        model, step = _pair_worker(strategy, 1.0)
        out = []
        for _ in range(5):
            step()
            out.append((_values(model), _center(strategy, model)))
        strategy.close()
        return out

    assert trajectory(mode="async", ps_addresses=shards) == trajectory()


def test_async_wait_for_all_starts_together(shards):
    # Rank 1 joins 1 s late. With wait_for_all, rank 0 starts stepping only after rank 1 has
    # begun to join: an ordering of two clock readings, which a loaded machine cannot reverse
    # (without the wait, rank 0 would start ~1 s before rank 1 even begins).
    def job(comm):
        if comm.rank == 1:
            time.sleep(1.0)
        joining = time.monotonic()
        strategy = ElasticAveraging(period=1, moving_rate=0.5, mode="async", ps_addresses=shards,
                                    wait_for_all=True, comm=comm)
        model, step = _pair_worker(strategy, 1.0)
        started = time.monotonic()
        step()
        strategy.close()
        return joining, started

    (_, started0), (joining1, started1) = run_ranks(job, 2)
    assert joining1 < started0 and joining1 < started1


# ---------------------------------------------------------------------- (e) stability
def _quadratic_run(eta: float, moving_rate: float, rho: float, steps: int) -> float:
    """One worker, period 1, f(x) = x^2 / 2 (gradient x), x = 1 and center 0 at the start."""
    strategy = ElasticAveraging(period=1, moving_rate=moving_rate, rho=rho, comm=Comm.single())
    x = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    holder = nn.Module()
    holder.x = x
    with strategy.scope():
        holder, opt = strategy.prepare(holder, torch.optim.SGD([x], lr=eta))
    with torch.no_grad():
        strategy._prepared[0].state["easgd"].center[0].zero_()
    size = 2.0
    for _ in range(steps):
        strategy.backward(0.5 * holder.x ** 2)
        opt.step()
        opt.zero_grad()
        size = abs(float(holder.x.detach())) + abs(float(strategy.eval_model(holder).x))
        if size > 1e6:
            break
    return size


@pytest.mark.parametrize("eta", [0.5, 1.0, 1.5])
def test_paper_stability_condition_on_a_quadratic(eta):
    # The paper's analysis (Zhang et al. 2015, round-robin / Eq. 5-6 with p = 1, f = x^2/2):
    #   x' = x - eta * x - alpha * (x - c),   c' = c + alpha * (x - c)
    # i.e. (x, c) <- M (x, c) with M = [[1 - eta - alpha, alpha], [alpha, 1 - alpha]].
    # Characteristic polynomial p(l) = l^2 - T l + D with T = 2 - eta - 2 alpha and
    # D = 1 - eta - 2 alpha + alpha eta. Jury: |D| < 1, p(1) = alpha eta > 0, and
    # p(-1) = 4 - 2 eta - 4 alpha + alpha eta > 0  <=>  alpha < (4 - 2 eta) / (4 - eta).
    # For 0 < eta < 2 and 0 < alpha <= 1 the first two hold, so the bound is exact: at it an
    # eigenvalue crosses -1. Our rho > 0 form is exactly that update with period 1 and
    # rho = alpha / eta: before the step, d = x - c is measured where the gradient is taken,
    # rho * d is added to the gradient (x' = x - eta x - alpha d) and c += alpha d.
    # (With rho = 0 the exchange follows the local step, M = E(alpha) diag(1 - eta, 1), whose
    # eigenvalue -1 boundary is alpha = (4 - 2 eta) / (4 - 3 eta) >= 1: stable for all
    # alpha in (0, 1] when eta < 2 -- checked last.)
    bound = (4 - 2 * eta) / (4 - eta)
    for alpha, converges in ((0.9 * bound, True), (bound - 0.02, True),
                             (bound + 0.02, False), (min(1.0, 1.1 * bound), False)):
        size = _quadratic_run(eta, alpha, alpha / eta, steps=800)
        # Spectral radius at bound -/+ 0.02 is about 0.96-0.97 / 1.03-1.04.
        assert (size < 1e-3 if converges else size > 1e6), (eta, alpha, bound, size)
    assert _quadratic_run(eta, min(1.0, 1.1 * bound), 0.0, steps=800) < 1e-3


# ---------------------------------------------------------------------- EAMSGD, buffers
def test_eamsgd_momentum_is_nesterov_sgd_between_exchanges():
    data = make_data()
    x, y = data[0][:32], data[1][:32]
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    strategy = ElasticAveraging(period=1000, moving_rate=0.5, momentum=0.9, comm=Comm.single())
    with strategy.scope():
        model = make_model()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for _ in range(6):
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    assert_states_close(strategy.unwrap(model).state_dict(), ref.state_dict(), atol=1e-6,
                        rtol=1e-5)


def test_sync_replicas_agree_on_center_and_buffers_are_averaged():
    def job(comm):
        strategy = ElasticAveraging(period=2, comm=comm)
        assert strategy.moving_rate == pytest.approx(0.9 / (2 * 2))
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
            model, opt = strategy.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(4):
            x = torch.randn(16, 4, generator=g) + comm.rank
            strategy.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
        center = {k: v.clone() for k, v in strategy.eval_model(model).state_dict().items()}
        return center, {k: v.clone() for k, v in model.state_dict().items()}

    (c0, l0), (c1, l1) = run_ranks(job, 2)
    assert_states_close(c0, c1, atol=0, rtol=0)
    assert not torch.equal(l0["1.running_mean"], l1["1.running_mean"])
    # The center's running mean moved by moving_rate * (sum of the workers' offsets).
    assert not torch.equal(c0["1.running_mean"], torch.zeros(8))
    assert c0["1.num_batches_tracked"] == 4


def test_average_buffers_false_keeps_center_buffers_local():
    strategy = ElasticAveraging(period=1, moving_rate=1.0, average_buffers=False,
                                comm=Comm.single())
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    strategy.backward(model(torch.randn(8, 3)).sum())
    opt.step()
    center = strategy.eval_model(model)
    assert torch.equal(center[1].running_mean, model[1].running_mean)


# ---------------------------------------------------------------------- checkpoints
def test_save_restore_center_and_locals(tmp_path):
    data = make_data()

    def job(comm):
        strategy = ElasticAveraging(period=3, moving_rate=0.3, momentum=0.5, comm=comm)
        _train(strategy, data, steps=4)
        prepared = strategy._prepared[0]
        model, opt = prepared.model, prepared.optimizers[0]
        strategy.save(tmp_path / "ckpt", model=model, optimizer=opt)
        center = {k: v.clone() for k, v in strategy.eval_model(model).state_dict().items()}
        local = {k: v.clone() for k, v in model.state_dict().items()}
        # A fresh job restores: center and this worker's local model come back exactly.
        fresh = ElasticAveraging(period=3, moving_rate=0.3, momentum=0.5, comm=comm)
        with fresh.scope():
            m2 = make_model(seed=5)
            m2, o2 = fresh.prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1))
        fresh.restore(tmp_path / "ckpt", model=m2, optimizer=o2)
        return (center, local, dict(fresh.eval_model(m2).state_dict()),
                dict(m2.state_dict()))

    results = run_ranks(job, 2)
    saved = safetensors.torch.load_file(tmp_path / "ckpt" / "model.safetensors")
    plain = make_model(seed=9)
    plain.load_state_dict(saved)
    for center, local, center2, local2 in results:
        assert_states_close(saved, center, atol=0, rtol=0)
        assert_states_close(center2, center, atol=0, rtol=0)
        assert_states_close(local2, local, atol=0, rtol=0)
    assert not torch.equal(results[0][1]["0.weight"], results[1][1]["0.weight"])


def test_async_checkpoint_reads_center_from_shards_and_restore_writes_it(shards, tmp_path):
    strategy = ElasticAveraging(period=1, moving_rate=0.5, mode="async", ps_addresses=shards,
                                comm=Comm.single())
    model, step = _pair_worker(strategy, 1.0)
    step()  # x = (1,2); d = (1,1); c = (0.5,1.5); x = (0.5,1.5)
    step()  # x = (1.5,2.5); d = (1,1); c = (1,2); x = (1,2)
    strategy.save(tmp_path / "ckpt", model=model)
    assert safetensors.torch.load_file(tmp_path / "ckpt" / "model.safetensors") == {
        "a": torch.tensor(1.0), "b": torch.tensor(2.0)}
    step()  # center moves on to (1.5, 2.5)
    strategy.restore(tmp_path / "ckpt", model=model)
    assert _values(model) == (1.0, 2.0)
    assert _center(strategy, model) == (1.0, 2.0)
    strategy.close()


# ---------------------------------------------------------------------- bytes
def _bytes_per_step(strategy, model_fn, steps, data):
    with strategy.scope():
        model = model_fn()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    before = strategy.metrics()
    x, y = data
    for _ in range(steps):
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    after = strategy.metrics()
    return ((after["bytes_sent"] - before["bytes_sent"]) / steps,
            (after["bytes_received"] - before["bytes_received"]) / steps)


def test_sync_bytes_are_one_period_of_mirrored():
    period, steps = 4, 8
    data = (torch.randn(8, 10), torch.randint(0, 3, (8,)))

    def job(comm):
        mirrored = _bytes_per_step(sg.Mirrored(comm=comm), make_model, steps, data)
        easgd = _bytes_per_step(ElasticAveraging(period=period, comm=comm), make_model, steps,
                                data)
        return mirrored, easgd

    for (m_sent, m_recv), (e_sent, e_recv) in run_ranks(job, 2):
        assert e_sent == pytest.approx(m_sent / period, rel=0.01)
        assert e_recv == pytest.approx(m_recv / period, rel=0.01)


def test_async_bytes_are_two_model_sizes_per_period(shards):
    period, steps = 2, 6

    def big():
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))

    size = sum(p.numel() * 4 for p in big().parameters())
    data = (torch.randn(4, 256), torch.randint(0, 3, (4,)))

    def job(comm):
        strategy = ElasticAveraging(period=period, moving_rate=0.1, mode="async",
                                    ps_addresses=shards, comm=comm)
        sent, recv = _bytes_per_step(strategy, big, steps, data)
        metrics = strategy.metrics()
        strategy.close()
        return sent, recv, metrics

    for sent, recv, metrics in run_ranks(job, 2):
        # Each exchange sends x and receives d: S each way, 2 S per period in all.
        assert sent + recv == pytest.approx(2 * size / period, rel=0.01)
        assert sent == pytest.approx(size / period, rel=0.01)
        assert metrics["ps_bytes_sent"] > 0 and metrics["exchanges"] == steps // period


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, text", [
    ({"period": 0}, "period must be an int >= 1, got 0"),
    ({"period": 2.5}, "got 2.5"),
    ({"moving_rate": 0.0}, "moving_rate must be None or a number in (0, 1], got 0.0"),
    ({"moving_rate": 1.5}, "got 1.5"),
    ({"beta": -1}, "beta must be a number > 0, got -1"),
    ({"beta": 30, "period": 1}, "= 30 / (1 * 1) = 30 is above 1"),
    ({"rho": -0.1}, "rho must be a number >= 0, got -0.1"),
    ({"momentum": 1.0}, "momentum must be a number in [0, 1), got 1.0"),
    ({"mode": "ring"}, "mode must be 'sync' or 'async', got 'ring'"),
    ({"mode": "async", "ps_addresses": "nowhere"}, "got ps_addresses='nowhere'"),
    ({"ps_addresses": ["127.0.0.1:1"]}, "ps_addresses only applies to mode='async'"),
])
def test_invalid_arguments_name_the_value(kwargs, text, monkeypatch):
    monkeypatch.delenv("STRATAGEM_PS_ADDRS", raising=False)
    with pytest.raises(ValueError, match="Fix|fix|True or False") as info:
        ElasticAveraging(comm=Comm.single(), **kwargs)
    assert text in str(info.value)


def test_async_without_addresses_names_the_variable(monkeypatch):
    monkeypatch.delenv("STRATAGEM_PS_ADDRS", raising=False)
    with pytest.raises(ValueError, match="STRATAGEM_PS_ADDRS=''"):
        ElasticAveraging(mode="async", comm=Comm.single())


def test_registry_names_build_elastic_averaging():
    s = sg.from_name("eamsgd", comm=Comm.single())
    assert isinstance(s, ElasticAveraging) and s.momentum == 0.9 and s.mode == "sync"
    assert sg.ElasticAveraging is ElasticAveraging


def test_eamsgd_warns_on_top_of_a_momentum_optimizer():
    strategy = sg.ElasticAveraging(momentum=0.9)
    model = torch.nn.Linear(2, 2)
    with pytest.warns(RuntimeWarning, match="plain SGD"):
        strategy.prepare(model, torch.optim.Adam(model.parameters()))
