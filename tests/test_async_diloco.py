"""Asynchronous DiLoCo (``DiLoCo(mode="async")``): the round rules by hand (weights by steps,
the staleness rule, the full-round divisor), replicas that never wait for a slow one, a
killed replica restarted alone, checkpoints across strategies, and the refusals."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_model
from torch import nn

import stratagem as sg
from stratagem.launcher import launch
from stratagem.ps import optim as ps_optim
from stratagem.ps import rules
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(90)


# ---------------------------------------------------------------------- the round rules
def _slot(k: int, *, grace: float | None = None, staleness: str = "inverse",
          full: float | None = None) -> rules.Slot:
    spec = {"name": "sgd", "lr": 1.0, ps_optim.OUTER_GRACE: grace,
            ps_optim.OUTER_STALENESS: staleness, ps_optim.OUTER_ROUND: full}
    return rules.make_slot("w", torch.zeros(2), "outer", spec, k)


def _add(slot: rules.Slot, base: int, samples: float, delta: list[float], now: float = 0.0):
    return rules.contribute(slot, base, samples, lambda: torch.tensor(delta), now)


def test_a_round_is_the_step_weighted_mean_and_closes_at_min_contributions():
    slot = _slot(2)
    assert _add(slot, 0, 4, [1.0, 2.0]) == [0, "accumulated", 0]
    assert slot.value.tolist() == [0.0, 0.0]
    assert _add(slot, 0, 2, [4.0, -4.0]) == [0, "applied", 1]
    # (4 * [1, 2] + 2 * [4, -4]) / 6 = [2, 0], one SGD step of lr 1.
    assert slot.value.tolist() == [-2.0, 0.0] and slot.merged == 2


def test_staleness_discounts_by_one_over_one_plus_staleness_unless_none():
    for rule, expected in (("inverse", [-3.5, -3.5]), ("none", [-5.0, -5.0])):
        slot = _slot(1, staleness=rule)
        _add(slot, 0, 1, [2.0, 2.0])  # version 1: value -2
        # computed on version 0, merged at version 1: staleness 1, weight 1 / 2 (inverse):
        # 0.5 * 3 / 1 sample = 1.5 (inverse) or 3 (none)
        assert _add(slot, 0, 1, [3.0, 3.0])[:2] == [1, "applied"]
        assert slot.value.tolist() == expected


def test_a_partial_round_divides_by_the_full_round_and_a_future_base_is_dropped():
    slot = _slot(1, full=8.0)
    _add(slot, 0, 4, [2.0, 4.0])
    assert slot.value.tolist() == [-1.0, -2.0]  # 4 * [2, 4] / max(4, 8)
    assert _add(slot, 5, 4, [1.0, 1.0])[1] == "dropped" and slot.dropped == 1


def test_the_grace_window_closes_a_round_only_once_it_is_over():
    slot = _slot(3, grace=5.0)
    _add(slot, 0, 2, [2.0, 2.0], now=100.0)
    assert rules.close_round(slot, 0, now=104.0) == ["open", 0]
    assert rules.close_round(slot, 0, now=105.0) == ["applied", 1]
    assert slot.value.tolist() == [-2.0, -2.0]
    assert rules.close_round(slot, 0, now=200.0) == ["closed", 1]
    assert rules.close_round(slot, 1, now=200.0) == ["empty", 1]
    # force closes at once; leaving lowers the contributions later rounds need
    _add(slot, 1, 2, [2.0, 2.0], now=300.0)
    assert rules.close_round(slot, 1, now=300.0, force=True, leaving=True) == ["applied", 2]
    assert slot.replicas_to_aggregate == 2


def test_no_window_means_a_round_waits_for_its_contributions():
    slot = _slot(2, grace=None)
    _add(slot, 0, 1, [1.0, 1.0], now=0.0)
    assert rules.close_round(slot, 0, now=1e6) == ["open", 0]


def test_the_model_down_keeps_its_error_feedback_on_the_shard():
    # With a download kind the shard's model is the encoded updates applied in turn; what
    # the encodings dropped is carried on the shard, so model + residual is the exact
    # trajectory (plain SGD, lr 1: the initial value minus every round's merged mean).
    from stratagem.ps import updates

    spec = {"name": "sgd", "lr": 1.0, ps_optim.OUTER_DOWNLOAD: "int4"}
    slot = rules.make_slot("w", torch.zeros(1000), "outer", spec, 1)
    g = torch.Generator().manual_seed(0)
    exact, held = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000)
    for r in range(6):
        d = torch.randn(1000, generator=g)
        assert rules.contribute(slot, r, 1, lambda d=d: d, 0.0)[1] == "applied"
        exact -= d.double()
        (version, payload), = rules.updates_since(slot, r, slot.lineage)
        assert version == r + 1 and payload.numel() < slot.value.nbytes / 7
        held = updates.apply(held, payload, "int4")
        assert torch.equal(held, slot.value)  # what a replica rebuilds is the shard's model
        assert slot.down_residual is not None
        err = (slot.value.double() + slot.down_residual.double() - exact).abs().max()
        assert float(err) < 1e-5
        assert float((slot.value.double() - exact).abs().max()) > 1e-3  # int4 is lossy
    # kept: the last HISTORY rounds; older holders, and other lineages, get the model
    assert len(rules.updates_since(slot, 6 - updates.HISTORY, slot.lineage)) == updates.HISTORY
    assert rules.updates_since(slot, 1, slot.lineage) is None
    assert rules.updates_since(slot, 5, slot.lineage + 1) is None
    assert rules.updates_since(slot, 6, slot.lineage) is None  # nothing newer
    # a refused round (non-finite) ends the chain: the next fetch is the model itself
    assert rules.contribute(slot, 6, 1, lambda: torch.full((1000,), float("nan")), 0.0)[1] == "refused"
    assert rules.updates_since(slot, 6, slot.lineage) is None


# ---------------------------------------------------------------------- by hand, end to end
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.0))
        self.b = nn.Parameter(torch.tensor(1.0))


def _pair_replica(strategy: sg.Strategy, slope: float):
    """SGD lr 1 on ``-slope * (a + b)``: every inner step adds ``slope`` to both."""
    with strategy.scope():
        model = Pair()
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))

    def step() -> None:
        strategy.backward(-slope * (model.a + model.b))
        opt.step()
        opt.zero_grad()

    return model, step


def _settle(strategy: sg.Strategy, model: nn.Module) -> None:
    """Wait until the pseudo-gradient in flight has its round's outcome (it lands at the
    next step)."""
    flight = strategy.find_prepared(model).state["async_outer"].flight
    if flight is not None:
        flight.future.result(timeout=30)


def _values(model: nn.Module) -> tuple[float, float]:
    return (float(model.a.detach()), float(model.b.detach()))


@pytest.mark.parametrize("staleness, global_after_b", [("inverse", (2.0, 3.0)),
                                                       ("none", (3.0, 4.0))])
def test_two_replicas_by_hand(shards, monkeypatch, staleness, global_after_b):
    # Two replicas launched alone (Comm.single) in a job of 2 (WORLD_SIZE): a full round is
    # 2 replicas x period 2 = 4 steps. min_contributions=1: every pseudo-gradient is a round.
    monkeypatch.setenv("WORLD_SIZE", "2")
    make = lambda: sg.DiLoCo(mode="async", period=2, outer_lr=1.0, outer_momentum=0.0,  # noqa: E731
                             min_contributions=1, staleness=staleness, ps_addresses=shards,
                             comm=sg.Comm.single(), timeout=20)
    a, b = make(), make()
    model_a, step_a = _pair_replica(a, 1.0)
    model_b, step_b = _pair_replica(b, 2.0)  # starts from the global (0, 1) too
    try:
        step_a()
        step_a()  # A at (2, 3) sends (-2, -2) x 2 steps: global -= 2 * -2 / 4 -> (1, 2)
        _settle(a, model_a)
        assert _values(a.eval_model(model_a)) == (1.0, 2.0)
        step_b()
        step_b()  # B at (4, 5) sends (-4, -4) computed on version 0, merged at version 1
        _settle(b, model_b)
        assert _values(b.eval_model(model_b)) == global_after_b
        # A lands at its next step: theta = global + (theta - theta_sent) = (1,2) + (3,4)-(2,3)
        step_a()
        assert _values(model_a) == (2.0, 3.0)
        step_b()  # B lands: (2,3) or (3,4) + (6,7) - (4,5)
        assert _values(model_b) == (global_after_b[0] + 2, global_after_b[1] + 2)
        assert a.metrics()["outer_landed"] == 1 and b.metrics()["outer_max_staleness"] == 1
    finally:
        a.close()
        b.close()


def test_sync_delay_0_lands_each_round_before_the_next_inner_step(shards, monkeypatch):
    # As above, but each replica waits for its round when it sends: no inner step is taken on
    # the model its pseudo-gradient was computed from, so nothing is grafted on.
    monkeypatch.setenv("WORLD_SIZE", "2")
    make = lambda: sg.DiLoCo(mode="async", period=2, outer_lr=1.0, outer_momentum=0.0,  # noqa: E731
                             min_contributions=1, sync_delay=0, ps_addresses=shards,
                             comm=sg.Comm.single(), timeout=20)
    a, b = make(), make()
    model_a, step_a = _pair_replica(a, 1.0)
    model_b, step_b = _pair_replica(b, 2.0)
    try:
        step_a()
        step_a()  # A sends (-2, -2) x 2 steps and takes its round's model: (1, 2)
        assert _values(model_a) == (1.0, 2.0)
        step_b()
        step_b()  # B's (-4, -4) of version 0 lands at version 1, halved: the model (2, 3)
        assert _values(model_b) == (2.0, 3.0)
        step_a()  # a plain inner step from the model A landed on
        assert _values(model_a) == (2.0, 3.0)
        assert a.metrics()["outer_landed"] == 1 and b.metrics()["outer_landed"] == 1
    finally:
        a.close()
        b.close()


def test_unequal_steps_share_a_round_and_the_last_contribution_closes_it(monkeypatch):
    from stratagem.ps.server import start_local_shards

    monkeypatch.setenv("WORLD_SIZE", "2")
    servers, shards = start_local_shards(1)
    make = lambda: sg.DiLoCo(mode="async", period=2, outer_lr=1.0, outer_momentum=0.0,  # noqa: E731
                             min_contributions=2, ps_addresses=shards, comm=sg.Comm.single(),
                             timeout=20)
    a, b = make(), make()
    model_a, step_a = _pair_replica(a, 1.0)
    model_b, step_b = _pair_replica(b, 2.0)
    try:
        step_a()
        step_a()  # 2 steps of (-1, -1) each: waits in the round (1 of 2)
        # A sends on a background thread: B's round must find A's pseudo-gradient there.
        slots = servers[0].service.slots
        deadline = time.monotonic() + 20
        while not all(s.acc_count == 1 for s in slots.values()):
            assert time.monotonic() < deadline, "A's pseudo-gradient never reached the shard"
            time.sleep(0.01)
        step_b()
        b.finalize(model_b)  # 1 step of (-2, -2): sent at once, closes the round
        # (2 * -2 + 1 * -2) / max(3, 4) = -1.5 -> global (1.5, 2.5); B takes it
        assert _values(model_b) == (1.5, 2.5)
        _settle(a, model_a)
        assert _values(a.eval_model(model_a)) == (1.5, 2.5)
    finally:
        a.close()
        b.close()
        for server in servers:
            server.stop(0)


# ---------------------------------------------------------------------- never waits
def _train(strategy, data, *, steps, seed=0, on_step=None, batch=48, hidden=16):
    with strategy.scope():
        model = make_model(seed, hidden=hidden)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(data, batch, shuffle=True, seed=3)
    losses, epoch = [], 0
    while len(losses) < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(len(losses))
            if len(losses) == steps:
                break
        epoch += 1
    return model, losses


@pytest.mark.parametrize("sync_delay", [None, 0])
def test_fast_replicas_never_wait_for_a_stalled_one(shards, sync_delay):
    # Three replicas (min_contributions = 3 - 1 = 2). Replica 2 stalls after 3 steps until
    # replicas 0 and 1 have finished all 40: had either waited for it, replica 2's wait would
    # end at its 30 s limit instead (an ordering, not a wall-clock margin). With sync_delay=0
    # each waits for its round at every send, which the other fast one completes.
    data = make_data()
    fast_done = threading.Semaphore(0)
    held: list[bool] = []

    def pause(step: int) -> None:
        if step == 3:
            held.append(fast_done.acquire(timeout=30) and fast_done.acquire(timeout=30))

    def job(comm):
        s = sg.DiLoCo(mode="async", period=4, ps_addresses=shards, comm=comm, timeout=30,
                      sync_delay=sync_delay)
        model, losses = _train(s, data, steps=40, on_step=pause if comm.rank == 2 else None)
        if comm.rank != 2:
            fast_done.release()
        s.finalize(model)
        out = (losses, s.metrics(), {k: v.clone() for k, v in model.state_dict().items()})
        s.close()
        return out

    results = run_ranks(job, 3)
    assert held == [True]
    for losses, metrics, _ in results:
        assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5])
        assert metrics["min_contributions"] == 2 and metrics["outer_sent"] == 10
    # Counted: a fast replica waits only for the other fast one's next pseudo-gradient (a
    # period of a few milliseconds of steps); a wait for the stalled one would have lasted
    # until its grace window (30 s) closed the round.
    for _, metrics, _ in results[:2]:
        assert metrics["outer_wait_seconds"] < 10.0, metrics
    # The stalled replica's pseudo-gradients were merged late, discounted by their staleness.
    assert results[2][1]["outer_max_staleness"] >= 1
    # finalize leaves every replica on the same global model
    for _, _, state in results[1:]:
        for k, v in state.items():
            assert torch.equal(v, results[0][2][k]), k


def test_a_compressed_model_down_moves_fewer_bytes_and_replicas_end_equal():
    # Two replicas, int4 both ways (the default) against int4 up only: the same training
    # with ~3.6k parameters, 8 rounds; the model comes down as int4 updates (all but the
    # first round's: the join, the first fetch and finalize's pull bring the model itself),
    # so each replica receives far fewer bytes (~0.4x here), and finalize still leaves both
    # on the shards' model, bitwise.
    from stratagem.ps.server import start_local_shards

    data = make_data()

    def run(compress_download: bool):
        servers, addrs = start_local_shards(1)

        def job(comm):
            s = sg.DiLoCo(mode="async", period=4, ps_addresses=addrs, comm=comm, timeout=30,
                          compression="int4", compress_download=compress_download,
                          min_contributions=2)
            model, losses = _train(s, data, steps=32, batch=32, hidden=256)
            s.finalize(model)
            out = (losses, s.metrics(),
                   {k: v.clone() for k, v in model.state_dict().items()})
            s.close()
            return out

        try:
            return run_ranks(job, 2)
        finally:
            for srv in servers:
                srv.stop(0)

    both, up_only = run(True), run(False)
    for results in (both, up_only):
        for losses, metrics, _ in results:
            assert metrics["outer_landed"] >= 3 and sum(losses[-4:]) < sum(losses[:4])
        for k, v in results[1][2].items():
            assert torch.equal(v, results[0][2][k]), k
    received = [sum(m["ps_bytes_received"] for _, m, _ in r) for r in (both, up_only)]
    assert received[0] < 0.6 * received[1], received


def test_a_replica_slower_than_the_grace_window_sends_partial_pseudo_gradients():
    # Replica 1 takes ~0.1 s a step, so a period of 8 steps (~0.8 s) outlasts the 0.3 s
    # grace window: it sends what it has every few steps, each weighted by the steps it
    # covers. Every step of both replicas is merged (the shard counts samples = steps).
    from stratagem.ps.server import start_local_shards

    data = make_data()
    servers, addrs = start_local_shards(1)

    def slow(step: int) -> None:
        time.sleep(0.1)

    def job(comm):
        s = sg.DiLoCo(mode="async", period=8, ps_addresses=addrs, comm=comm, timeout=30,
                      grace_window=0.3)
        model, losses = _train(s, data, steps=16, on_step=slow if comm.rank == 1 else None)
        s.finalize(model)
        out = s.metrics()
        s.close()
        return out

    try:
        metrics = run_ranks(job, 2)
        slots = [sl for sl in servers[0].service.slots.values() if sl.mode == "outer"]
    finally:
        for srv in servers:
            srv.stop(0)
    assert metrics[1]["outer_partial"] >= 2 and metrics[1]["outer_sent"] > 16 // 8 + 1
    assert slots and all(sl.merged_samples == 32.0 for sl in slots), [
        sl.merged_samples for sl in slots]


# ---------------------------------------------------------------------- a killed replica
STEPS = 24


def _task(seed: int = 1, n: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=gen)
    return x, (x @ torch.randn(10, 3, generator=gen)).argmax(dim=1)


def _async_replica(kill_rank: int, kill_step: int) -> dict[str, float]:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    s = sg.DiLoCo(mode="async", period=4, outer_lr=0.7, comm=sg.Comm.single(), timeout=30,
                  grace_window=5.0)
    with s.scope():
        model = make_model(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = s.prepare(model, opt)  # a restarted replica starts from the global model
    fresh = make_model(seed=0).state_dict()
    from_global = any(not torch.equal(v, fresh[k]) for k, v in model.state_dict().items())
    loader = s.distribute_dataset(_task(), 30, seed=rank)
    step = 0
    while step < STEPS:
        loader.set_epoch(step)
        for x, y in loader:
            s.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            step += 1
            if rank == kill_rank and attempt == 0 and step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == STEPS:
                break
    s.finalize(model)
    with torch.no_grad():
        x, y = _task(seed=1)
        acc = float((s.eval_model(model)(x).argmax(dim=1) == y).float().mean())
    s.close()
    return {"attempt": attempt, "from_global": from_global, "accuracy": acc}


@pytest.mark.chaos
@pytest.mark.timeout(150)
def test_a_killed_replica_is_restarted_alone_from_the_global_model() -> None:
    # Two replicas (min_contributions = 1): replica 1 is SIGKILLed at step 10 of 24.
    results = launch(_async_replica, nprocs=2, num_ps=1, args=(1, 10), max_restarts=1,
                     restart="failed", timeout=120)
    assert [r["attempt"] for r in results] == [0, 1]
    assert results[1]["from_global"]  # it did not start from its own initialisation
    assert min(r["accuracy"] for r in results) > 0.7, results


# ---------------------------------------------------------------------- checkpoints
def _loop(strategy, model, opt, data, steps):
    for i in range(steps):
        x, y = data[0][i * 16:(i + 1) * 16], data[1][i * 16:(i + 1) * 16]
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()


def _prepared(strategy, seed=5):
    with strategy.scope():
        model = make_model(seed)
        return strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_checkpoints_restore_across_sync_and_async_diloco_and_mirrored(shards, tmp_path):
    data = make_data()
    single = sg.Comm.single
    a = sg.DiLoCo(mode="async", period=2, min_contributions=1, ps_addresses=shards,
                  comm=single(), timeout=20)
    model, opt = _prepared(a)
    _loop(a, model, opt, data, 6)
    a.finalize(model)
    a.save(tmp_path / "async", model=model, optimizer=opt)
    with PSClient(shards, timeout=10) as client:
        table = ShardedParameters(client, dict(make_model().state_dict()), mode="outer",
                                  optimizer_spec={"name": "sgd", "lr": 0.7})
        shard_state = table.get_state()
    global_model = shard_state["params"]
    a.close()

    # async -> sync DiLoCo: the global model, and the outer momentum the shards kept
    d = sg.DiLoCo(period=2, comm=single())
    model_d, opt_d = _prepared(d, seed=9)
    d.restore(tmp_path / "async", model=model_d, optimizer=opt_d)
    for k, v in model_d.state_dict().items():
        assert torch.equal(v, global_model[k]), k
    outer = d.find_prepared(model_d).state["outer_step"]
    for name, q in zip(outer.names, outer.prev, strict=True):
        assert torch.equal(outer.optimizer.state[q]["momentum_buffer"],
                           shard_state["optimizer"][name]["momentum_buffer"]), name
    # async -> Mirrored: the global model
    m = sg.Mirrored(comm=single())
    model_m, opt_m = _prepared(m, seed=9)
    m.restore(tmp_path / "async", model=model_m, optimizer=opt_m)
    for k, v in m.unwrap(model_m).state_dict().items():
        assert torch.equal(v, global_model[k]), k

    # sync -> async: the shards take the saved model and momentum
    _loop(d, model_d, opt_d, data, 4)
    d.save(tmp_path / "sync", model=model_d, optimizer=opt_d)
    saved_momentum = {n: outer.optimizer.state[q]["momentum_buffer"].clone()
                      for n, q in zip(outer.names, outer.prev, strict=True)}
    saved_model = {k: v.clone() for k, v in d.consensus(model_d).items()} \
        if hasattr(d, "consensus") else None
    b = sg.DiLoCo(mode="async", period=2, min_contributions=1, ps_addresses=shards,
                  comm=single(), timeout=20)
    model_b, opt_b = _prepared(b, seed=11)
    b.restore(tmp_path / "sync", model=model_b, optimizer=opt_b)
    with PSClient(shards, timeout=10) as client:
        table = ShardedParameters(client, dict(make_model().state_dict()), mode="outer",
                                  optimizer_spec={"name": "sgd", "lr": 0.7})
        after = table.get_state()
    for k, v in b.unwrap(model_b).state_dict().items():
        assert torch.equal(after["params"][k], v), k
        if saved_model is not None:
            assert torch.equal(v, saved_model[k]), k
    for n, mom in saved_momentum.items():
        assert torch.equal(after["optimizer"][n]["momentum_buffer"], mom), n
    _loop(b, model_b, opt_b, data, 4)  # and it trains on from there
    b.close()


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kwargs, text", [
    ({"mode": "ring"}, "mode must be 'sync' or 'async', got 'ring'"),
    ({"mode": "async", "fragments": 2, "period": 4}, "got fragments=2"),
    ({"mode": "async", "compression": "topk"}, "'topk' is mode='sync' only"),
    ({"mode": "async", "fault_tolerant": True}, "fault tolerant by construction"),
    ({"mode": "async", "min_contributions": 0}, "min_contributions"),
    ({"mode": "async", "staleness": "square"}, "staleness must be"),
    ({"mode": "async", "grace_window": -1.0}, "grace_window"),
    ({"mode": "async", "sync_delay": 4, "period": 4},
     "sync_delay must be < period = 4 with mode='async'"),
    ({"min_contributions": 2}, "min_contributions only applies to mode='async'"),
])
def test_invalid_arguments_name_the_value_and_fix(kwargs, text, monkeypatch):
    monkeypatch.setenv("STRATAGEM_PS_ADDRS", "127.0.0.1:1")
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        sg.DiLoCo(comm=sg.Comm.single(), **kwargs)


def test_async_without_addresses_names_the_variable(monkeypatch):
    monkeypatch.delenv("STRATAGEM_PS_ADDRS", raising=False)
    with pytest.raises(ValueError, match="STRATAGEM_PS_ADDRS"):
        sg.DiLoCo(mode="async", comm=sg.Comm.single())


def test_gradient_pushes_to_outer_tensors_are_refused():
    slot = _slot(1)
    with pytest.raises(Exception, match="takes 'contribute' calls"):
        rules.offer(slot, 0, None, lambda: torch.zeros(2))


# ---------------------------------------------------------------------- a lost syncer
def test_a_lost_shard_is_reseeded_by_the_replicas_without_losing_committed_rounds(
        monkeypatch):
    from stratagem.ps.server import ShardServer

    monkeypatch.setenv("WORLD_SIZE", "1")
    server = ShardServer("127.0.0.1", 0)
    server.start()
    port = int(server.address.rsplit(":", 1)[1])
    data = make_data()
    s = sg.DiLoCo(mode="async", period=2, min_contributions=1, ps_addresses=[server.address],
                  comm=sg.Comm.single(), timeout=10)

    def versions() -> dict[str, int]:
        with PSClient([f"127.0.0.1:{port}"], timeout=10) as client:
            return client.health()[0]["versions"]

    try:
        model, opt = _prepared(s)
        _loop(s, model, opt, data, 8)  # 4 rounds of one pseudo-gradient each
        _settle(s, model)
        committed = min(versions().values())
        assert committed >= 3
        server.stop(0)  # the syncer is lost with everything it held ...
        server = ShardServer("127.0.0.1", port)  # ... and a new, empty one starts there
        server.start()
        _loop(s, model, opt, (data[0][128:], data[1][128:]), 4)
        s.finalize(model)
        assert s.metrics()["outer_shard_recoveries"] >= 1
        # The replica seeded the new shard with the newest model it held: no round lost.
        assert min(versions().values()) >= committed + 1
    finally:
        s.close()
        server.stop(0)
