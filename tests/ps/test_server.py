"""Behaviour of shards through the client: optimizers, staleness, sync, elastic, sparse, state."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import shard_grads as _grads
from helpers import shard_params as _params
from torch.testing import assert_close

from stratagem.errors import PeerTimeoutError
from stratagem.ps import transport
from stratagem.ps.placement import FixedShardsPartitioner, MaxSizePartitioner
from stratagem.ps.server import ShardServer, start_local_shards
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = pytest.mark.timeout(30)


def test_register_is_idempotent_first_wins(client: PSClient) -> None:
    a, b = _params(0), _params(1)
    spec = {"name": "sgd", "lr": 0.1}
    got_a = ShardedParameters(client, a, optimizer_spec=spec).register()
    late = ShardedParameters(client, b, optimizer_spec=spec)
    got_b = late.register()  # a restarted/late worker gets the current values back
    for k in a:
        assert_close(got_a[k], a[k])
        assert_close(got_b[k], a[k])
    assert late.versions == {"w": 0, "b": 0, "e": 0}
    wrong = ShardedParameters(client, {"w": torch.zeros(3)}, optimizer_spec=spec)
    with pytest.raises(RemoteError, match="same model") as info:
        wrong.register()
    assert info.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("spec", [
    {"name": "sgd", "lr": 0.1},  # the shard's fast path: must equal torch exactly
    {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"name": "sgd", "lr": 0.1, "momentum": 0.5, "dampening": 0.1},
    {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.1, "amsgrad": True},
    {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
    {"name": "rmsprop", "lr": 0.01, "momentum": 0.9, "centered": True},
    {"name": "adagrad", "lr": 0.1, "lr_decay": 0.01},
])
def test_async_push_matches_local_torch_optim(shards, spec: dict) -> None:
    _, addrs = shards
    params = _params()
    with PSClient(addrs, timeout=10) as client:
        table = ShardedParameters(client, params, optimizer_spec=spec,
                                  partitioner=FixedShardsPartitioner(2))
        table.register()
        local = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
               "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}[spec["name"]]
        hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()
                 if k != "name"}
        opt = cls(local.values(), **hyper)
        for step in range(3):
            grads = _grads(params, step)
            out = table.push(grads)
            assert all(o.applied and o.staleness == 0 for o in out.values())
            for k, p in local.items():
                p.grad = grads[k]
            opt.step()
            got = table.pull()
            assert table.versions == {k: step + 1 for k in params}
            for k, p in local.items():
                assert_close(got[k], p.detach(), rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_names_valid_ones(client: PSClient) -> None:
    with pytest.raises(ValueError, match="valid: .*'adagrad'.*'sgd'"):
        ShardedParameters(client, _params(), optimizer_spec={"name": "lamb", "lr": 1})
    with pytest.raises(ValueError, match="no hyperparameter"):
        ShardedParameters(client, _params(), optimizer_spec={"name": "sgd", "lr": 1, "bogus": 2})


def test_stale_gradients_are_dropped(client: PSClient) -> None:
    params = {"w": torch.zeros(4)}
    t = ShardedParameters(client, params, optimizer_spec={"name": "sgd", "lr": 1.0},
                          max_staleness=1)
    t.register()
    one = {"w": torch.ones(4)}
    assert t.push(one, 0)["w"] == (0, "applied", 1)
    assert t.push(one, 0)["w"] == (1, "applied", 2)  # staleness 1 is allowed
    assert t.push(one, 0)["w"] == (2, "dropped", 2)  # staleness 2 > max_staleness
    assert t.push(one, 0, max_staleness=5)["w"] == (2, "applied", 3)  # per-call override
    assert_close(t.pull()["w"], torch.full((4,), -3.0))
    assert client.health()[0]["dropped"] + client.health()[1]["dropped"] == 1


def test_compressed_gradients_are_upcast(client: PSClient) -> None:
    params = {"w": torch.zeros(1000)}
    t = ShardedParameters(client, params, optimizer_spec={"name": "sgd", "lr": 1.0})
    t.register()
    g = torch.linspace(-1, 1, 1000)
    before = client.bytes_sent
    t.push({"w": g}, compress="bf16")
    assert client.bytes_sent - before < 1000 * 4  # sent 2 bytes per element
    got = t.pull()["w"]
    assert got.dtype == torch.float32
    assert_close(got, -g.bfloat16().float())
    t.push({"w": g}, compress="fp16")
    assert_close(t.pull()["w"], -g.bfloat16().float() - g.half().float())


def test_sync_applies_mean_of_exactly_replicas_and_drops_late(client: PSClient) -> None:
    params = {"w": torch.zeros(6), "v": torch.ones(2, 3)}
    t = ShardedParameters(client, params, mode="sync", replicas_to_aggregate=3,
                          optimizer_spec={"name": "sgd", "lr": 1.0})
    t.register()
    grads = [{k: torch.full_like(v, float(i + 1)) for k, v in params.items()} for i in range(4)]
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(t.wait_version(1, timeout=10)))
    waiter.start()
    assert t.push(grads[0], 0)["w"].status == "accumulated"
    assert t.push(grads[1], 0)["w"] == (0, "accumulated", 0)
    out = t.push(grads[2], 0)
    assert out["w"] == (0, "applied", 1) and out["v"] == (0, "applied", 1)
    waiter.join(10)
    mean = (1 + 2 + 3) / 3
    assert_close(results[0]["w"], torch.full((6,), -mean))
    assert_close(results[0]["v"], torch.full((2, 3), 1 - mean))
    late = t.push(grads[3], 0)  # a backup worker's gradient for version 0
    assert late["w"] == (1, "dropped", 1)
    assert_close(t.pull()["w"], torch.full((6,), -mean))
    assert sum(h["dropped"] for h in client.health()) == 2  # w and v


def test_wait_version_times_out_with_clear_error(client: PSClient) -> None:
    t = ShardedParameters(client, {"w": torch.zeros(2)}, mode="sync", replicas_to_aggregate=2,
                          optimizer_spec={"name": "sgd", "lr": 1.0})
    t.register()
    t.push({"w": torch.ones(2)}, 0)
    with pytest.raises(PeerTimeoutError, match="did not reach version 1 within 0.3 s"):
        t.wait_version(1, timeout=0.3)


def test_elastic_exchange_by_hand(client: PSClient) -> None:
    center0 = {"w": torch.tensor([0.0, 1.0, 2.0]), "m": torch.tensor([[4.0, -4.0]])}
    t = ShardedParameters(client, center0, mode="elastic")
    t.register()
    x = {"w": torch.tensor([1.0, 1.0, 0.0]), "m": torch.tensor([[0.0, 0.0]])}
    d = t.elastic_exchange(x, moving_rate=0.25)
    assert_close(d["w"], torch.tensor([1.0, 0.0, -2.0]))
    assert_close(d["m"], torch.tensor([[-4.0, 4.0]]))
    got = t.pull()
    assert_close(got["w"], torch.tensor([0.25, 1.0, 1.5]))
    assert_close(got["m"], torch.tensor([[3.0, -3.0]]))
    # Second worker: d is against the moved center.
    d2 = t.elastic_exchange({"w": torch.tensor([0.25, 1.0, 3.5]), "m": got["m"]}, 0.5)
    assert_close(d2["w"], torch.tensor([0.0, 0.0, 2.0]))
    assert_close(t.pull()["w"], torch.tensor([0.25, 1.0, 2.5]))
    with pytest.raises(RemoteError, match="elastic") as info:
        t.push({"w": torch.ones(3), "m": torch.ones(1, 2)})
    assert info.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("spec", [{"name": "sgd", "lr": 0.5}, {"name": "adagrad", "lr": 0.5},
                                  {"name": "adam", "lr": 0.1},
                                  {"name": "sgd", "lr": 0.5, "momentum": 0.9}])
def test_sparse_rows_match_dense_embedding(shards, spec: dict) -> None:
    _, addrs = shards
    g = torch.Generator().manual_seed(3)
    table0 = torch.randn(50, 4, generator=g)
    with PSClient(addrs, timeout=10) as client:
        t = ShardedParameters(client, {"emb": table0}, optimizer_spec=spec,
                              partitioner=FixedShardsPartitioner(2), small_tensor_bytes=0)
        t.register()
        assert {p.shard for p in t.placement.parts} == {0, 1}
        emb = torch.nn.Embedding.from_pretrained(table0.clone(), freeze=False)
        hyper = {k: v for k, v in spec.items() if k != "name"}
        opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
               "adam": torch.optim.Adam}[spec["name"]](emb.parameters(), **hyper)
        for step in range(3):
            idx = torch.tensor([3, 40, 3, 7 + step, 49])  # duplicates and both parts
            rows = t.pull_rows("emb", idx)
            assert_close(rows, emb.weight.detach()[idx])
            upstream = torch.randn(len(idx), 4, generator=g)
            out = t.push_sparse("emb", idx, upstream)
            assert out.applied
            opt.zero_grad()
            (emb(idx) * upstream).sum().backward()  # dense gradient with the same rows
            opt.step()
            assert_close(t.pull()["emb"], emb.weight.detach(), rtol=1e-5, atol=1e-6)
        with pytest.raises(IndexError, match=r"\[0, 50\)"):
            t.pull_rows("emb", torch.tensor([50]))


def test_get_set_state_round_trip_across_placements(shards) -> None:
    _, addrs = shards
    params = _params()
    spec = {"name": "adam", "lr": 0.01}
    with PSClient(addrs, timeout=10) as client:
        a = ShardedParameters(client, params, optimizer_spec=spec)
        a.register()
        for step in range(2):
            a.push(_grads(params, step))
        state = a.get_state()
        assert state["versions"] == {"w": 2, "b": 2, "e": 2}
        assert set(state["optimizer"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}
        servers3, addrs3 = start_local_shards(3)
        try:
            with PSClient(addrs3, timeout=10) as c3:
                b = ShardedParameters(c3, params, optimizer_spec=spec,
                                      partitioner=FixedShardsPartitioner(3))
                assert any(p.num_parts == 3 for p in b.placement.parts)
                b.set_state(state)
                assert b.versions == state["versions"]
                for k, v in b.pull().items():
                    assert_close(v, state["params"][k])
                # Same next step on both: the optimizer state came along.
                g = _grads(params, 7)
                a.push(g)
                b.push(g)
                after_a, after_b = a.pull(), b.pull()
                for k in params:
                    assert_close(after_a[k], after_b[k])
                s3 = b.get_state()
                for k in params:
                    assert_close(s3["optimizer"][k]["exp_avg"],
                                 a.get_state()["optimizer"][k]["exp_avg"])
        finally:
            for s in servers3:
                s.stop(0)


def test_pull_async_into_and_counters(client: PSClient) -> None:
    params = _params()
    t = ShardedParameters(client, params, optimizer_spec={"name": "sgd", "lr": 0.1},
                          partitioner=FixedShardsPartitioner(2))
    t.register()
    fut = t.pull_async()
    model = {k: torch.zeros_like(v) for k, v in params.items()}
    fut2 = t.pull_async(into=model)
    assert_close(fut.result()["w"], params["w"])
    fut2.result()
    for k in params:
        assert_close(model[k], params[k])
    st = t.stats()
    assert st["bytes_sent"] > 0 and st["bytes_received"] > 2 * sum(
        v.nbytes for v in params.values())
    assert st["comm_seconds"] > 0


def test_set_hyperparameters_changes_lr_on_shards(client: PSClient) -> None:
    t = ShardedParameters(client, {"w": torch.zeros(3)}, optimizer_spec={"name": "sgd", "lr": 1})
    t.register()
    t.set_hyperparameters(lr=0.5)
    t.push({"w": torch.ones(3)})
    assert_close(t.pull()["w"], torch.full((3,), -0.5))
    with pytest.raises(ValueError, match="no hyperparameter"):
        t.set_hyperparameters(betas=(0.9, 0.9))


def test_many_waiters_do_not_starve_pushes() -> None:
    # More waiting workers than half the server's threads: the final push must still get in.
    servers, addrs = start_local_shards(1, max_workers=4)
    try:
        with PSClient(addrs, timeout=10) as client:
            t = ShardedParameters(client, {"w": torch.zeros(2)}, mode="sync",
                                  replicas_to_aggregate=6,
                                  optimizer_spec={"name": "sgd", "lr": 1.0})
            t.register()
            done: list[dict] = []
            threads = []
            for _ in range(5):
                t.push({"w": torch.ones(2)}, 0)
                th = threading.Thread(target=lambda: done.append(t.wait_version(1, timeout=10)))
                th.start()
                threads.append(th)
            t.push({"w": torch.ones(2)}, 0)
            for th in threads:
                th.join(15)
            assert len(done) == 5
            assert_close(done[0]["w"], torch.full((2,), -1.0))
    finally:
        for s in servers:
            s.stop(0)


def test_push_fetch_returns_the_values_after_the_push(shards) -> None:
    _, addrs = shards
    params = _params()
    with PSClient(addrs, timeout=10) as client:
        table = ShardedParameters(client, params, optimizer_spec={"name": "sgd", "lr": 0.5},
                                  partitioner=FixedShardsPartitioner(2))
        table.register()
        grads = _grads(params, 0)
        got = table.push_fetch_async({"w": grads["w"]}, fetch=["w", "b", "e"]).result()
        assert got.outcomes["w"].applied and got.versions == {"w": 1, "b": 0, "e": 0}
        pulled = table.pull()
        for k in params:
            assert_close(got.values[k], pulled[k], atol=0, rtol=0)
        assert_close(got.values["w"], params["w"] - 0.5 * grads["w"])


def test_concurrent_replies_carry_only_the_callers_tensors(shards) -> None:
    """Replies are built in freshly allocated buffers by several tensor threads at once: under
    concurrent push+fetch from many clients, each reply holds exactly the caller's tensors
    (never another client's bytes, never uninitialised memory)."""
    _, addrs = shards
    spec = {"name": "sgd", "lr": 1.0}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            params = {f"c{i}.w": torch.full((257, 33), float(i)),
                      f"c{i}.b": torch.full((3,), float(-i))}
            with PSClient(addrs, timeout=10) as client:
                table = ShardedParameters(client, params, optimizer_spec=spec)
                table.register()
                for step in range(1, 16):
                    grads = {k: torch.full_like(v, -1.0) for k, v in params.items()}
                    got = table.push_fetch_async(grads, fetch=list(params)).result()
                    # Only this client pushes to its tensors: each step adds exactly 1.
                    assert torch.equal(got.values[f"c{i}.w"],
                                       torch.full((257, 33), float(i + step)))
                    assert torch.equal(got.values[f"c{i}.b"], torch.full((3,), float(step - i)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


@pytest.mark.parametrize("cap", [1, 4096, 30_000])
def test_push_fetch_in_buckets_equals_one_call(shards, cap: int) -> None:
    # max_request_bytes cuts each shard's push-fetch into concurrent calls of whole parts;
    # each call fetches what it pushes, and names pushed nowhere ride on a shard's last call.
    _, addrs = shards
    params = _params()
    with PSClient(addrs, timeout=10) as client:
        table = ShardedParameters(client, params, optimizer_spec={"name": "adam", "lr": 0.1},
                                  partitioner=FixedShardsPartitioner(4), small_tensor_bytes=64)
        table.register()
        calls = client.num_calls
        for step in range(2):
            grads = _grads(params, step)
            del grads["e"]  # fetched, not pushed
            got = table.push_fetch_async(grads, fetch=["w", "b", "e"],
                                         max_request_bytes=cap).result()
            assert got.versions == {"w": step + 1, "b": step + 1, "e": 0}
            assert all(o.applied for o in got.outcomes.values())
        # One call per part pushed with cap=1; fewer as the cap grows; at least one per shard.
        parts = len(table.placement.parts_of("w")) + len(table.placement.parts_of("b"))
        made = (client.num_calls - calls) // 2
        assert (made == parts) if cap == 1 else (2 <= made <= parts)
        pulled = table.pull()
    with PSClient(addrs, timeout=10) as client:  # the same pushes in one call per shard
        ref = ShardedParameters(client, {f"r{k}": v for k, v in params.items()},
                                optimizer_spec={"name": "adam", "lr": 0.1},
                                partitioner=FixedShardsPartitioner(4), small_tensor_bytes=64)
        ref.register()
        for step in range(2):
            grads = {f"r{k}": v for k, v in _grads(params, step).items() if k != "e"}
            ref.push_fetch_async(grads, fetch=["rw", "rb", "re"]).result()
        expect = ref.pull()
    for k in params:
        assert_close(pulled[k], expect[f"r{k}"], atol=0, rtol=0)
    assert_close(got.values["w"], pulled["w"], atol=0, rtol=0)


def test_push_fetch_refuses_a_bad_request_size(client: PSClient) -> None:
    table = ShardedParameters(client, {"w": torch.zeros(4)},
                              optimizer_spec={"name": "sgd", "lr": 1.0})
    table.register()
    for bad in (0, -1, 1.5, "8"):
        with pytest.raises(ValueError, match=f"max_request_bytes must be None or a positive "
                                             f"int, got {bad!r}"):
            table.push_fetch_async({"w": torch.ones(4)}, fetch=["w"], max_request_bytes=bad)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_staleness_aware_lr_divides_by_the_staleness(client: PSClient, name: str) -> None:
    # Zhang et al. 2016: a gradient of staleness s is applied with lr / max(1, s). Compared
    # with a local torch optimizer stepped with those learning rates, by hand.
    spec = {"name": name, "lr": 0.5, "staleness_lr": True}
    t = ShardedParameters(client, {"w": torch.ones(3)}, optimizer_spec=spec)
    t.register()
    p = torch.nn.Parameter(torch.ones(3))
    local = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)([p], lr=0.5)
    seen = []
    for k, base in enumerate([0, 0, 0, 3, 1]):  # staleness 0, 1, 2, 0, 3
        g = torch.full((3,), float(k + 1))
        outcome = t.push({"w": g}, base)["w"]
        seen.append(outcome.staleness)
        local.param_groups[0]["lr"] = 0.5 / max(1, outcome.staleness)
        p.grad = g
        local.step()
    assert seen == [0, 1, 2, 0, 3]
    assert_close(t.pull()["w"], p.detach(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="'staleness_lr' must be true or false, got 1"):
        ShardedParameters(client, {"v": torch.ones(3)},
                          optimizer_spec={"name": "sgd", "lr": 0.1, "staleness_lr": 1})


def test_small_calls_run_on_the_loop_and_big_ones_on_threads_without_lost_updates() -> None:
    """Small pushes and pulls are served on the event loop while no tensor thread is busy
    (no thread hand-off); big ones go to the threads. Mixed concurrently, every update lands
    exactly once and the values are exact."""
    servers, addrs = start_local_shards(1)
    server = servers[0]
    offloaded: list[str] = []
    real_offload = server._offload

    async def counting(fn, *args):  # type: ignore[no-untyped-def]
        offloaded.append(getattr(fn, "__name__", "?"))
        return await real_offload(fn, *args)

    server._offload = counting  # type: ignore[method-assign]
    small, big = torch.zeros(1000), torch.zeros(600_000)  # 4 KB and 2.4 MB
    try:
        with PSClient(addrs, timeout=20) as client:
            # The gRPC path's scheduling (the shared-memory path is tests/ps/test_shm.py).
            table = ShardedParameters(client, {"small": small, "big": big},
                                      optimizer_spec={"name": "sgd", "lr": 1.0},
                                      shared_memory=False)
            table.register()
            offloaded.clear()
            for _ in range(20):  # one caller: nothing busy, so no hand-off at all
                table.push_fetch_async({"small": torch.ones(1000)}, fetch=["small"]).result()
            assert offloaded == []
            table.push_fetch_async({"big": torch.ones(600_000)}, fetch=["big"]).result()
            assert len(offloaded) == 1

            def pusher(name: str, n: int, steps: int) -> None:
                t = ShardedParameters(client, {"small": small, "big": big},
                                      optimizer_spec={"name": "sgd", "lr": 1.0},
                                      shared_memory=False)
                t.register()
                for _ in range(steps):
                    t.push_fetch_async({name: torch.ones(n)}, fetch=[name]).result()

            threads = [threading.Thread(target=pusher, args=a) for a in
                       [("small", 1000, 100), ("small", 1000, 100), ("big", 600_000, 10),
                        ("big", 600_000, 10)]]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
            values = table.pull()
            assert table.versions == {"small": 220, "big": 21}
            assert torch.equal(values["small"], torch.full((1000,), -220.0))
            assert torch.equal(values["big"], torch.full((600_000,), -21.0))
    finally:
        server.stop(0)


def test_client_reuses_its_call_threads_and_stops_them_on_close(shards) -> None:
    """Calls run on the client's own long-lived threads (gRPC's future() would start a thread
    per step): a loop of steps keeps one thread per concurrent call, and close() ends them."""
    _, addrs = shards

    def call_threads() -> int:
        return sum(t.name == "stratagem-ps-call" for t in threading.enumerate())

    before = call_threads()
    client = PSClient(addrs, timeout=10)
    params = _params()
    table = ShardedParameters(client, params, optimizer_spec={"name": "sgd", "lr": 0.1})
    table.register()
    for i in range(30):
        table.push_fetch_async(_grads(params, i), fetch=list(params)).result()
    assert 1 <= call_threads() - before <= 4  # two shards: two calls at a time
    client.close()
    deadline = time.monotonic() + 5
    while call_threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert call_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        client.health()


def test_calls_beyond_the_streams_cap_are_sent_again_and_applied_once(monkeypatch) -> None:
    """gRPC's client does not always wait for a free stream: with many calls opening while
    others close, calls beyond the shard's ``max_concurrent_streams`` on one connection are
    refused (HTTP/2 REFUSED_STREAM; about every other step here at 32 calls on a 4-stream
    shard). The client sends them again, and every push lands exactly once."""
    refused = []
    real = transport._refused_stream

    def counting(exc):  # type: ignore[no-untyped-def]
        refused.append(real(exc))
        return refused[-1]

    monkeypatch.setattr(transport, "_refused_stream", counting)
    with ShardServer("127.0.0.1", 0, max_concurrent_streams=4) as server:
        with PSClient([server.address], timeout=20) as client:
            table = ShardedParameters(client, {"w": torch.zeros(32 * 1024)},
                                      optimizer_spec={"name": "sgd", "lr": 1.0},
                                      partitioner=MaxSizePartitioner(4096, max_shards=32))
            table.register()
            steps = 0
            # Until a refusal was seen (it is a race, so steps are bounded, not fixed).
            while steps < 10 or (not any(refused) and steps < 300):
                table.push_fetch_async({"w": torch.ones(32 * 1024)}, fetch=["w"],
                                       max_request_bytes=4096).result()
                steps += 1
            assert torch.equal(table.pull()["w"], torch.full((32 * 1024,), -float(steps)))
            assert table.versions == {"w": steps}
    assert any(refused)  # calls were refused and sent again
