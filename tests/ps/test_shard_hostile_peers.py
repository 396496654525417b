"""Hostile peers of a parameter-server shard that hold its token (every worker does): each
case runs the hostile client next to a good one and checks that the good one is still
served. Doorbell pipes wired into each other, workers that die with a busy doorbell, calls
that walk every tensor of a big shard, and a huge chunked request."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import ProcShard
from helpers import shard_grads as _grads
from helpers import shard_params as _params

from stratagem.launcher import child_pythonpath
from stratagem.ps import shm, wire
from stratagem.ps.rpc import grpc
from stratagem.ps.server import ShardServer
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient, RemoteError

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not shm.supported(), reason="needs memfd and /proc")]

TOKEN = "hostile-peers-token"
MiB = 1 << 20
ADAM = {"name": "adam", "lr": 0.01}


def _wait(cond: Callable[[], bool], what: str, timeout: float) -> None:
    due = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < due, what
        time.sleep(0.05)


class _Good:
    """A good worker: Downpour steps (push + fetch) over gRPC, timed one by one."""

    def __init__(self, address: str) -> None:
        self.client = PSClient([address], token=TOKEN, timeout=30)
        self.params = _params()
        self.table = ShardedParameters(self.client, self.params, optimizer_spec=ADAM,
                                       shared_memory=False)
        self.table.register()
        self.steps = 0

    def step(self) -> float:
        t0 = time.perf_counter()
        self.table.push_fetch_async(_grads(self.params, self.steps),
                                    fetch=list(self.params)).result()
        self.steps += 1
        return time.perf_counter() - t0

    def steps_for(self, seconds: float) -> list[float]:
        took: list[float] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            took.append(self.step())
            time.sleep(0.005)
        return took

    def close(self) -> None:
        self.client.close()


def _attach(client: PSClient, region: shm.WorkerRegion, bell: list[int] | None
            ) -> dict[str, object]:
    lay = region.layout
    fields = {"pid": os.getpid(), "fd": region.fd, "size": lay.size,
              "nonce": region.nonce.hex(), "entries": [[k, "float32"] for k in lay.names],
              "bell": bell}
    try:
        return client.call(0, "shm_attach", fields).fields
    finally:
        region.close_fd()


def _layout() -> shm.Layout:
    return shm.layout([(k, torch.float32, torch.float32, v.shape)
                       for k, v in _params().items()])


def _crossed_pair(client: PSClient) -> tuple[list[object], list[int]]:
    """Two regions whose doorbells share their pipes: the request pipe of one is the reply
    pipe of the other. Then one push into the first. Returns what to keep alive and close."""
    p1r, p1w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    p2r, p2w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    a, b = shm.WorkerRegion(_layout()), shm.WorkerRegion(_layout())
    os.write(p1w, a.nonce)  # the proofs each attach reads from its request pipe
    os.write(p2w, b.nonce)
    got_a = _attach(client, a, [p1r, p2w])
    got_b = _attach(client, b, [p2r, p1w])
    push = wire.encode("shm_push", {"region": got_a["region"], "push": [], "fetch": []})
    os.write(p1w, len(push).to_bytes(4, "little") + push)
    return [a, b, got_a, got_b], [p1r, p1w, p2r, p2w]


#: Fresh shards and a fresh baseline per attempt: on 2 cores beside other work (three pytest
#: workers and two busy loops, load ~13) one 3 s window's median ratio drifted 0.63 -> 1.10
#: between two windows of an unattacked pair. The attack this guards against cost 4x in both
#: figures, in every window; noise does not repeat itself three times.
CROSSED_ATTEMPTS = 3


def _crossed_pipe_attack(root: Path) -> tuple[bool, str]:
    """One attempt of the test below on new shards under ``root``: whether both figures held,
    and the figures. The bounds that are not timing (the attack measured within 5 s, at most
    one doorbell of each pair accepted) are asserted here."""
    root.mkdir()
    (root / "x").mkdir()
    (root / "y").mkdir()
    shards = [ProcShard(root / "x", token=TOKEN),  # started together
              ProcShard(root / "y", token=TOKEN)]
    clients: list[PSClient] = []
    goods: list[_Good] = []
    fds: list[int] = []
    keep: list[object] = []
    try:
        for shard in shards:
            shard.wait()
        goods = [_Good(shard.address) for shard in shards]
        for shard in shards:
            legit = PSClient([shard.address], token=TOKEN, timeout=30)
            clients.append(legit)
            params = _params()
            table = ShardedParameters(legit, params, optimizer_spec=ADAM, shared_memory=True)
            table.register()
            table.push_fetch_async(_grads(params, 0), fetch=list(params)).result()
            assert table._shm_regions[0].bell is not None
        hostile = PSClient([shards[0].address], token=TOKEN, timeout=30)
        clients.append(hostile)

        def window(seconds: float) -> tuple[list[float], list[float], float, int]:
            """Per shard: CPU s/s and the good client's median step; and the median ratio
            of each step on the attacked shard to the control's step beside it (a pair of
            steps meets the same load of the machine's other work; which shard goes first
            alternates, so neither is always the one stepped right after a pause)."""
            c0, t0 = [s.cpu() for s in shards], time.monotonic()
            took: list[list[float]] = [[], []]
            turn = 0
            while time.monotonic() - t0 < seconds:
                for i in ((0, 1) if turn % 2 == 0 else (1, 0)):
                    took[i].append(goods[i].step())
                    time.sleep(0.005)
                turn += 1
            dt = time.monotonic() - t0
            paired = statistics.median(x / y for x, y in zip(*took, strict=True))
            return ([(s.cpu() - c) / dt for s, c in zip(shards, c0, strict=True)],
                    [statistics.median(t) for t in took], paired, len(took[0]))

        window(1.0)  # warm up: connections, allocator, the optimizer's state
        cpu0, lat0, pair0, n0 = window(3.0)
        attacked = time.monotonic()
        for _ in range(8):
            k, f = _crossed_pair(hostile)
            keep += k
            fds += f
        cpu1, lat1, pair1, n1 = window(3.0)
        assert time.monotonic() - attacked < 5.0 + 1.0
        health = goods[0].client.health()[0]
        assert health["shm_bells"] <= 1 + 8  # at most one doorbell of each pair accepted
        cpu_drift = cpu1[1] / cpu0[1]  # the control's
        cpu_x, lat_x = cpu1[0] / cpu0[0] / cpu_drift, pair1 / pair0
        figures = (f"attacked shard CPU {cpu0[0]:.3f} -> {cpu1[0]:.3f} s/s, good median step "
                   f"{lat0[0] * 1e3:.2f} -> {lat1[0] * 1e3:.2f} ms; control {cpu0[1]:.3f} -> "
                   f"{cpu1[1]:.3f} s/s, {lat0[1] * 1e3:.2f} -> {lat1[1] * 1e3:.2f} ms; "
                   f"ratios against the control: CPU {cpu_x:.2f}x, latency {lat_x:.2f}x "
                   f"({n0} / {n1} steps per shard)")
        # 1.2x each, with a small absolute floor (0.05 s/s, 1.5 ms of the control's median
        # step) for a busy 2-core machine's noise.
        held = (cpu1[0] <= 1.2 * cpu0[0] * cpu_drift + 0.05
                and pair1 <= 1.2 * pair0 + 0.0015 / lat1[1])
        return held, figures
    finally:
        for fd in fds:
            os.close(fd)
        for c in clients:
            c.close()
        for good in goods:
            good.close()
        for shard in shards:
            shard.stop()


@pytest.mark.timeout(300)  # up to three attempts of ~30 s each on a busy machine
def test_doorbells_wired_into_each_other_cost_the_shard_nothing(tmp_path: Path) -> None:
    """8 pairs of regions whose doorbells are each other's pipes, and one push into each
    (before the fix the pairs answered each other's refusals forever: 0.2 -> 0.95 s/s of
    shard CPU, 4.4 -> 17.1 ms per good step). Measured in this test, within 5 s of the
    attack: the shard's CPU and a good gRPC client's median step stay within 1.2x of their
    baseline before the attack, taken against a control: a second shard, not attacked, that
    the same good client steps on in alternation (one step on each in turn), so the load of
    the machine's other work reaches both alike. CPU: the attacked shard's s/s over the
    control's drift; latency: the median ratio of each step to the control's beside it.
    Both shards have a legitimate same-host worker's doorbell attached, idle: any doorbell
    turns off the event loop's inline path for small calls (by design), which is not what
    is measured here. Up to ``CROSSED_ATTEMPTS`` attempts, each on new shards with its own
    baseline; one attempt within both bounds passes."""
    seen = []
    for attempt in range(CROSSED_ATTEMPTS):
        held, figures = _crossed_pipe_attack(tmp_path / f"attempt{attempt}")
        print(f"attempt {attempt + 1}: {figures}")
        seen.append(figures)
        if held:
            return
    pytest.fail(f"the crossed-pipe attack cost the shard more than 1.2x in "
                f"{CROSSED_ATTEMPTS} attempts of {CROSSED_ATTEMPTS}: " + "; ".join(seen))


def test_two_shards_wired_into_each_other_close_both_doorbells_unanswered() -> None:
    """Crossed pipes across two shards (each shard's own check cannot see the other's
    pipes): the first reply that reaches the other shard's request pipe is not a request,
    so that doorbell is closed unanswered and the exchange stops; a good client is served."""
    with ShardServer(token=TOKEN) as s1, ShardServer(token=TOKEN) as s2, \
            PSClient([s1.address], token=TOKEN, timeout=10) as c1, \
            PSClient([s2.address], token=TOKEN, timeout=10) as c2:
        good = _Good(s1.address)
        ShardedParameters(c2, _params(), optimizer_spec=ADAM, shared_memory=False).register()
        p1r, p1w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        p2r, p2w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        a, b = shm.WorkerRegion(_layout()), shm.WorkerRegion(_layout())
        try:
            os.write(p1w, a.nonce)
            os.write(p2w, b.nonce)
            got_a, got_b = _attach(c1, a, [p1r, p2w]), _attach(c2, b, [p2r, p1w])
            assert got_a["bell"] is True and got_b["bell"] is True  # neither can tell
            push = wire.encode("shm_push", {"region": got_a["region"], "push": [],
                                            "fetch": []})
            os.write(p1w, len(push).to_bytes(4, "little") + push)
            # s1 answers into s2's request pipe; s2 closes that doorbell unanswered.
            _wait(lambda: not s2.shm.regions and s2.shm.bells == 0, "s2's doorbell closed", 5.0)
            time.sleep(0.5)
            assert s1.shm.regions and s1.shm.bells == 1  # s1 answered its own request, once
            good.steps_for(0.3)
            assert good.steps > 0
        finally:
            for fd in (p1r, p1w, p2r, p2w):
                os.close(fd)
            a.release()
            b.release()
            good.close()


_WORKER = r"""
import json, os, sys
from stratagem.ps import shm
from stratagem.ps.transport import PSClient
import torch
address, token, shapes, req_r, req_w, rep_w = sys.argv[1:7]
req_r, req_w, rep_w = int(req_r), int(req_w), int(rep_w)
lay = shm.layout([(k, torch.float32, torch.float32, s) for k, s in json.loads(shapes)])
region = shm.WorkerRegion(lay)
os.write(req_w, region.nonce)
with PSClient([address], token=token, timeout=30) as c:
    got = c.call(0, "shm_attach", {"pid": os.getpid(), "fd": region.fd, "size": lay.size,
                                   "nonce": region.nonce.hex(), "bell": [req_r, rep_w],
                                   "entries": [[k, "float32"] for k in lay.names]}).fields
print(json.dumps(got), flush=True)
os._exit(0)  # dies without detaching
"""


def test_a_dead_workers_busy_doorbell_is_dropped_on_a_timer() -> None:
    """A worker attaches a region with a doorbell and dies without detaching, while another
    process keeps that doorbell busy (it holds the other ends of the pipes): the shard finds
    the dead worker within a few seconds anyway, drops its region and ends the doorbell."""
    with ShardServer(token=TOKEN, body_timeout=5.0) as s:
        good = _Good(s.address)
        req_r, req_w = os.pipe2(os.O_NONBLOCK)
        rep_r, rep_w = os.pipe2(os.O_NONBLOCK)
        stop = threading.Event()
        try:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            env["PYTHONPATH"] = child_pythonpath(env)
            shapes = json.dumps([[k, list(v.shape)] for k, v in _params().items()])
            done = subprocess.run(
                [sys.executable, "-c", _WORKER, s.address, TOKEN, shapes, str(req_r),
                 str(req_w), str(rep_w)], pass_fds=(req_r, req_w, rep_w), env=env,
                capture_output=True, text=True, timeout=120, check=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            assert got["bell"] is True and s.shm.bells == 1
            os.close(req_r)
            os.close(rep_w)
            push = wire.encode("shm_push", {"region": got["region"], "push": [], "fetch": []})
            answered = [0]

            def keep_busy() -> None:  # a request as soon as the last answer came
                try:
                    while not stop.is_set():
                        shm.bell_send(req_w, push, time.monotonic() + 5)
                        shm.bell_receive(rep_r, time.monotonic() + 5)
                        answered[0] += 1
                except (shm.BellClosed, shm.BellTimeout):
                    pass

            busy = threading.Thread(target=keep_busy, daemon=True)
            busy.start()
            t0 = time.monotonic()
            _wait(lambda: not s.shm.regions and s.shm.bells == 0, "the dead worker's region", 8.0)
            took = time.monotonic() - t0
            assert answered[0] > 10  # it was busy, never idle for 0.5 s
            busy.join(10)
            assert not busy.is_alive()  # the shard closed its ends: the busy loop saw EOF
            good.steps_for(0.3)
            assert good.steps > 0
            print(f"dead worker's busy doorbell dropped after {took:.2f} s "
                  f"({answered[0]} requests answered meanwhile)")
        finally:
            stop.set()
            for fd in (req_w, rep_r):
                os.close(fd)
            good.close()


def test_calls_over_every_tensor_are_refused_by_count_before_any_lock() -> None:
    """A shard holding more tensors than one reply may list: get_state, pull, wait_version,
    set_hyperparams without names and health are refused from the count alone, at once,
    even while a slot's lock is held (they never wait for it); the error names the bound,
    the count and the fix; a good client naming its tensors is served."""
    with ShardServer(token=TOKEN) as s:
        s.limits = replace(s.limits, max_tensors=64)
        good = _Good(s.address)  # 3 tensors
        with PSClient([s.address], token=TOKEN, timeout=10) as hostile:
            tiny = [wire.Entry(f"t{i:03d}", torch.zeros(1)) for i in range(62)]
            hostile.call(0, "register", {"entries": [{"mode": "async", "spec": 0}] * 62,
                                         "specs": [{"name": "sgd", "lr": 0.1}]}, tiny)
            calls = [("get_state", {}, "name the tensors"), ("pull", {}, "name the tensors"),
                     ("wait_version", {"min_version": 1, "timeout": 1.0}, "name the tensors"),
                     ("set_hyperparams", {"hyperparams": {"lr": 0.5}}, "name the tensors"),
                     ("health", {}, "more shards")]
            held = s.service.slots["t000"].lock
            held.acquire()  # a slot busy for as long as this test wants
            try:
                for op, fields, fix in calls:
                    t0 = time.monotonic()
                    with pytest.raises(RemoteError) as info:
                        hostile.call(0, op, fields)
                    took = time.monotonic() - t0
                    text = str(info.value)
                    assert info.value.code == "RESOURCE_EXHAUSTED", text
                    assert "max_tensors=64" in text and "(65)" in text and fix in text, text
                    assert took < 2.0, (op, took)
                    assert good.step() < 2.0  # its own tensors: served
            finally:
                held.release()
        # At the bound exactly, a call over every tensor is served.
        s.limits = replace(s.limits, max_tensors=65)
        with PSClient([s.address], token=TOKEN, timeout=10) as c:
            assert c.health()[0]["num_tensors"] == 65
        good.close()


def test_a_huge_chunked_request_does_not_stall_the_event_loop() -> None:
    """A chunked request declaring 1000 MiB whose first chunk is a valid header: its buffer
    is mapped, not zero-filled on the event loop (a bytearray of that size took 0.75-1.24 s,
    during which no call was served), so a good client's steps stay fast meanwhile."""
    declared = 1000 * MiB
    with ShardServer(token=TOKEN, max_message_bytes=declared + MiB,
                     max_inflight_bytes=2 * declared + 4 * MiB) as s:
        good = _Good(s.address)
        good.steps_for(0.5)
        header = wire.encode("push", {}, [wire.Entry("w", torch.zeros(0))])
        release = threading.Event()
        sent = threading.Event()

        def chunks() -> Iterator[bytes]:
            yield header.ljust(wire.REQUEST_CHUNK_BYTES, b"\0")
            sent.set()
            release.wait(30)

        def hostile() -> None:
            with grpc.insecure_channel(s.address) as ch:
                md = ((wire.TOKEN_METADATA_KEY, TOKEN), (wire.SIZE_METADATA_KEY, str(declared)))
                try:
                    ch.stream_unary(wire.METHOD)(chunks(), timeout=60, metadata=md)
                except grpc.RpcError:
                    pass  # refused when it ends short: that is fine

        rss0 = _rss()
        t = threading.Thread(target=hostile, daemon=True)
        t.start()
        try:
            assert sent.wait(30)
            worst = max(good.steps_for(2.0))
            assert s.admission.receiving_bytes == declared  # admitted and being received
            grew = _rss() - rss0
        finally:
            release.set()
            t.join(30)
        print(f"good step worst {worst * 1e3:.1f} ms beside a 1000 MiB request; "
              f"RSS grew {grew / MiB:.0f} MiB")
        assert worst < 0.5, worst
        assert grew < 200 * MiB, grew  # its pages were never all touched
        good.close()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
