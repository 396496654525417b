"""Conformance of the parameter-server shard's transports: one set of cases run against the
service alone (``ShardService``, no transport: the reference) and against every transport
that carries it, gRPC and shared memory with its doorbell.

Each case runs the same requests through a *driver* and asserts bitwise-equal results and
the same refusal: its status, and the words that name the constraint. The shared-memory
transport carries pushes only (a ``shm_push`` whose tensors are in the worker's region,
over the region's doorbell; everything else goes over gRPC), so the push cases run against
all three drivers and the other operations against the service and gRPC. Where a transport
refuses a request by its own rule before it reaches the service (a name outside the
region's layout), the case says which status and words each transport gives and why.
Bounds of the transports themselves (bytes in flight, body deadlines, region and doorbell
counts) are cases here too, each against the transport that has it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from stratagem.ps import shm, wire
from stratagem.ps.server import ShardServer
from stratagem.ps.service import ShardService
from stratagem.ps.transport import PSClient, RemoteError
from stratagem.ps.wire import Entry, Message

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm.supported(), reason="needs memfd and /proc")]

TOKEN = "conformance-token"
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.01}
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
ALL = ["service", "grpc", "shm"]
NO_SHM = ["service", "grpc"]


class Refused(Exception):
    """A request a driver's shard refused: the status name and the detail it was told."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status, self.detail = status, detail


@dataclass
class Pushed:
    results: list[list[Any]]
    values: dict[str, torch.Tensor]
    versions: dict[str, int]


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.randn(5, generator=g),
            "e": torch.randn(16, 3, generator=g), "c": torch.randn(4, generator=g)}


def _grads(step: int, names: Sequence[str] = ("w", "b", "e")) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shapes = {k: v.shape for k, v in _model().items()}
    return {k: torch.randn(shapes[k], generator=g) for k in names}


def _register_request() -> tuple[dict[str, Any], list[Entry]]:
    """w, b with Adam; e with SGD+momentum; c for elastic averaging."""
    model = _model()
    modes = {"w": ("async", 0), "b": ("async", 0), "e": ("async", 1), "c": ("elastic", None)}
    metas = [{"mode": modes[k][0], "spec": modes[k][1]} for k in model]
    return {"entries": metas, "specs": [ADAM, SGD]}, [Entry(k, v) for k, v in model.items()]


class _Driver:
    """Requests to one shard through one transport; a refusal raises :class:`Refused`."""

    name = "?"

    def call(self, op: str, fields: Mapping[str, Any] | None = None,
             entries: Sequence[Entry] = ()) -> Message:
        raise NotImplementedError

    def push(self, grads: Mapping[str, torch.Tensor], bases: Mapping[str, int],
             fetch: Sequence[str], **fields: Any) -> Pushed:
        reply = self.call("push", {"fetch": list(fetch), **fields},
                          [Entry(k, g, bases[k]) for k, g in grads.items()])
        return Pushed(reply.fields["results"], {e.name: e.tensor.clone() for e in reply.entries},
                      {e.name: int(e.version or 0) for e in reply.entries})

    def values(self) -> dict[str, torch.Tensor]:
        return {e.name: e.tensor.clone() for e in self.call("pull").entries}

    def versions(self) -> dict[str, int]:
        return {e.name: int(e.version or 0) for e in self.call("pull").entries}

    def close(self) -> None:
        pass


class _ServiceDriver(_Driver):
    """The service alone: request bytes in, reply bytes out, refusals as the transports
    map them (:meth:`ShardService.refusal`)."""

    name = "service"

    def __init__(self, **limits: Any) -> None:
        self.svc = ShardService(limits=wire.Limits(**limits), max_bytes=1 << 30,
                                address="service")

    def call(self, op: str, fields: Mapping[str, Any] | None = None,
             entries: Sequence[Entry] = ()) -> Message:
        try:
            out = self.svc.run(wire.encode(op, dict(fields or {}), list(entries)))
            if isinstance(out, Message):  # wait_version: no transport to wait in
                out = self.svc.finish_wait(self.svc.plan_wait(out, 10.0))
        except Exception as exc:  # noqa: BLE001 - what every transport answers
            abort = self.svc.refusal(exc)
            raise Refused(abort.status, abort.detail) from None
        return wire.decode(out, wire.Limits(max_message_bytes=1 << 30))


class _GrpcDriver(_Driver):
    name = "grpc"

    def __init__(self, **limits: Any) -> None:
        self.server = ShardServer("127.0.0.1", 0, token=TOKEN, body_timeout=2.0, **limits)
        self.server.start()
        self.client = PSClient([self.server.address], token=TOKEN, timeout=10)

    def call(self, op: str, fields: Mapping[str, Any] | None = None,
             entries: Sequence[Entry] = ()) -> Message:
        try:
            return self.client.call(0, op, dict(fields or {}), entries)
        except RemoteError as exc:
            raise Refused(exc.code, str(exc)) from None

    def close(self) -> None:
        self.client.close()
        self.server.stop(0)


class _ShmDriver(_GrpcDriver):
    """gRPC for everything but pushes; a push is a ``shm_push`` over the region's doorbell,
    its gradients written into the region and its fetched values read back from it."""

    name = "shm"

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self.region: shm.WorkerRegion | None = None
        self.bell: shm.Bell | None = None
        self.rid = ""

    def attach(self) -> None:
        names = sorted(_model())
        lay = shm.layout([(k, torch.float32, torch.float32, _model()[k].shape) for k in names])
        self.region = shm.WorkerRegion(lay)
        self.bell = shm.Bell(self.region.nonce)
        fields = {"pid": os.getpid(), "fd": self.region.fd, "size": lay.size,
                  "nonce": self.region.nonce.hex(), "entries": [[k, "float32"] for k in names],
                  "bell": self.bell.declare()}
        try:
            reply = self.call("shm_attach", fields).fields
        finally:
            self.region.close_fd()
        assert reply["bell"] is True, reply
        self.bell.opened()
        self.rid = reply["region"]

    def push(self, grads: Mapping[str, torch.Tensor], bases: Mapping[str, int],
             fetch: Sequence[str], **fields: Any) -> Pushed:
        if self.region is None:
            self.attach()
        assert self.region is not None and self.bell is not None
        for k, g in grads.items():
            if k in self.region.grads:
                self.region.grads[k].copy_(g)
        data = wire.encode("shm_push", {"region": self.rid, "fetch": list(fetch),
                                        "push": [[k, bases[k]] for k in grads], **fields})
        reply = wire.decode(self.bell.call(data, time.monotonic() + 10), wire.Limits())
        if reply.op == "refused":
            raise Refused(reply.fields["status"], reply.fields["detail"])
        return Pushed(reply.fields["results"],
                      {k: self.region.values[k].clone() for k in fetch},
                      {k: int(v) for k, v in reply.fields["versions"].items()})

    def close(self) -> None:
        if self.bell is not None:
            self.bell.close()
        if self.region is not None:
            self.region.release()
        super().close()


_DRIVERS = {"service": _ServiceDriver, "grpc": _GrpcDriver, "shm": _ShmDriver}


def _open(name: str, register: bool = True, **limits: Any) -> _Driver:
    d = _DRIVERS[name](**limits)
    if register:
        fields, entries = _register_request()
        d.call("register", fields, entries)
    return d


@pytest.fixture
def drivers() -> Iterator[list[_Driver]]:
    opened: list[_Driver] = []
    yield opened
    for d in opened:
        d.close()


def _driver(drivers: list[_Driver], name: str, **kw: Any) -> _Driver:
    d = _open(name, **kw)
    drivers.append(d)
    return d


def _same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _assert_refused(d: _Driver, cases: Sequence[tuple[str, dict[str, Any], list[Entry], str,
                                                        str]]) -> None:
    """Each request refused with its status and the words that name the constraint."""
    for op, fields, entries, status, words in cases:
        with pytest.raises(Refused) as info:
            d.call(op, fields, entries)
        assert info.value.status == status, (op, info.value)
        assert words in info.value.detail, (op, info.value.detail)


# -- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_downpour_steps_are_bitwise_the_services(transport: str, drivers: list[_Driver]
                                                 ) -> None:
    """Six push+fetch steps (Adam and SGD+momentum tensors, one step fetching a subset, one
    with a stale base dropped by max_staleness): results, values and versions bitwise those
    of the service alone."""
    runs = []
    for name in ("service", transport):
        d = _driver(drivers, name)
        bases = d.versions()
        out = []
        for step in range(6):
            fetch = ["w", "b", "e"] if step != 3 else ["b"]
            pushed_bases = dict(bases)
            if step == 4:  # a worker two steps behind on w, with max_staleness=1
                pushed_bases["w"] -= 2
            got = d.push(_grads(step), pushed_bases, fetch, max_staleness=1)
            bases.update(got.versions)
            out.append(got)
        runs.append((out, d.values(), d.versions()))
    (ref, ref_values, ref_versions), (got, values, versions) = runs
    for a, b in zip(ref, got, strict=True):
        assert a.results == b.results
        assert a.versions == b.versions
        _same(a.values, b.values)
    assert [r[1] for r in ref[4].results] == ["dropped", "applied", "applied"]
    _same(ref_values, values)
    assert ref_versions == versions == {"w": 5, "b": 6, "e": 6, "c": 0}


@pytest.mark.parametrize("transport", NO_SHM)
def test_other_operations_are_bitwise_the_services(transport: str, drivers: list[_Driver]
                                                   ) -> None:
    """register (a second time: the reply carries what was there), pull of some tensors,
    pull_rows, push_sparse, elastic, set_hyperparams, get_state then set_state into a fresh
    shard, and wait_version: the same replies as the service alone."""
    def run(name: str) -> list[Any]:
        d = _driver(drivers, name)
        out: list[Any] = []
        fields, entries = _register_request()
        again = d.call("register", fields, entries)
        out.append((again.fields["created"], {e.name: e.tensor for e in again.entries}))
        out.append({e.name: e.tensor for e in d.call("pull", {"names": ["b", "w"]}).entries})
        rows = d.call("pull_rows", {"name": "e"}, [Entry("indices", torch.tensor([3, 0, 9]))])
        out.append(rows.entries[0].tensor)
        sparse = d.call("push_sparse", {"name": "e"},
                        [Entry("indices", torch.tensor([1, 5])),
                         Entry("values", torch.ones(2, 3), 0)])
        out.append(sparse.fields["results"])
        ex = d.call("elastic", {"moving_rate": 0.25}, [Entry("c", torch.full((4,), 2.0))])
        out.append((ex.entries[0].tensor, ex.entries[0].version))
        out.append(d.call("set_hyperparams", {"hyperparams": {"lr": 0.05},
                                              "names": ["w"]}).fields)
        d.push(_grads(0), d.versions(), ["w"])
        state = d.call("get_state")
        out.append((state.fields, {e.name: e.tensor for e in state.entries}))
        fresh = _driver(drivers, name, register=False)
        fresh.call("set_state", state.fields, state.entries)
        out.append(fresh.values())
        out.append(fresh.versions())
        waited = d.call("wait_version", {"min_version": 1, "names": ["w", "b"],
                                         "fetch": ["b"], "timeout": 1.0})
        out.append((waited.fields, {e.name: e.tensor for e in waited.entries}))
        return out

    ref, got = run("service"), run(transport)
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        _assert_same_tree(a, b)


def _assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b)
        for k in a:
            _assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_tree(x, y)
    else:
        assert a == b


# -- refusals --------------------------------------------------------------------------------


def _refused_push(d: _Driver, grads: Mapping[str, torch.Tensor], bases: Mapping[str, int],
                  fetch: Sequence[str] = (), **fields: Any) -> Refused:
    before, versions = d.values(), d.versions()
    with pytest.raises(Refused) as info:
        d.push(grads, bases, fetch, **fields)
    _same(before, d.values())  # nothing applied
    assert d.versions() == versions
    return info.value


@pytest.mark.parametrize("transport", ALL)
def test_a_non_finite_gradient_refuses_the_whole_push(transport: str,
                                                      drivers: list[_Driver]) -> None:
    d = _driver(drivers, transport)
    grads = _grads(0)
    grads["b"][2] = float("nan")
    r = _refused_push(d, grads, d.versions(), ["w"])
    assert r.status == "INVALID_ARGUMENT" and "'b'" in r.detail and "non-finite" in r.detail


@pytest.mark.parametrize("transport", ALL)
def test_a_push_to_an_elastic_tensor_is_refused(transport: str, drivers: list[_Driver]) -> None:
    d = _driver(drivers, transport)
    r = _refused_push(d, {"w": _grads(0)["w"], "c": torch.ones(4)}, d.versions())
    assert r.status == "FAILED_PRECONDITION" and "elastic averaging" in r.detail


@pytest.mark.parametrize("transport", ALL)
def test_a_bad_max_staleness_is_refused(transport: str, drivers: list[_Driver]) -> None:
    d = _driver(drivers, transport)
    for bad in (-1, True, 1.5, "2"):
        r = _refused_push(d, _grads(0, ["b"]), d.versions(), max_staleness=bad)
        assert r.status == "INVALID_ARGUMENT", bad
        assert "field 'max_staleness' must be an int >= 0" in r.detail, (bad, r.detail)


@pytest.mark.parametrize("transport", ALL)
def test_a_tensor_pushed_twice_in_one_request_is_refused(transport: str,
                                                         drivers: list[_Driver]) -> None:
    """gRPC and the service see two entries of one name; a doorbell push names it twice in
    its 'push' list. Either way: INVALID_ARGUMENT naming the tensor, nothing applied."""
    d = _driver(drivers, transport)
    if transport == "shm":
        assert isinstance(d, _ShmDriver)
        d.push(_grads(0, ["b"]), d.versions(), [])  # attached
        assert d.bell is not None
        data = wire.encode("shm_push", {"region": d.rid, "push": [["b", 1], ["b", 1]]})
        reply = wire.decode(d.bell.call(data, time.monotonic() + 10), wire.Limits())
        assert reply.op == "refused" and reply.fields["status"] == "INVALID_ARGUMENT"
        assert "'b' is pushed twice" in reply.fields["detail"]
        return
    g = torch.ones(5)
    with pytest.raises(Refused) as info:
        d.call("push", {}, [Entry("b", g, 0), Entry("b", g, 0)])
    assert info.value.status == "INVALID_ARGUMENT"
    assert "'b' appears more than once" in info.value.detail


@pytest.mark.parametrize("transport", ALL)
def test_an_unknown_tensor_is_refused(transport: str, drivers: list[_Driver]) -> None:
    """The service and gRPC: NOT_FOUND, "register it first". The doorbell: a name outside
    the region's layout (fixed at attach from the registered tensors) is refused by the
    transport itself, FAILED_PRECONDITION, before the service sees it."""
    d = _driver(drivers, transport)
    if transport == "shm":
        assert isinstance(d, _ShmDriver)
        d.push(_grads(0, ["b"]), d.versions(), [])
        assert d.bell is not None
        data = wire.encode("shm_push", {"region": d.rid, "push": [["zz", 0]]})
        reply = wire.decode(d.bell.call(data, time.monotonic() + 10), wire.Limits())
        assert reply.op == "refused" and reply.fields["status"] == "FAILED_PRECONDITION"
        assert "'zz' is not in this region's layout" in reply.fields["detail"]
        return
    r = _refused_push(d, {"zz": torch.ones(3)}, {"zz": 0})
    assert r.status == "NOT_FOUND" and "'zz' is not registered" in r.detail


@pytest.mark.parametrize("transport", NO_SHM)
def test_refusals_of_the_other_operations(transport: str, drivers: list[_Driver]) -> None:
    """Each with its status and the words that name the constraint; none changes the shard."""
    d = _driver(drivers, transport)
    before = d.values()
    cases: list[tuple[str, dict[str, Any], list[Entry], str, str]] = [
        ("nonsense", {}, [], "INVALID_ARGUMENT", "unknown op 'nonsense'"),
        ("register", {"entries": [{"mode": "async"}], "specs": []},
         [Entry("w", torch.zeros(3, 3))], "FAILED_PRECONDITION", "every worker must build"),
        ("register", {"entries": [{"mode": "bogus"}], "specs": []},
         [Entry("new", torch.zeros(3))], "INVALID_ARGUMENT", "mode must be one of"),
        ("pull", {"names": ["w", "w"]}, [], "INVALID_ARGUMENT", "names 'w' more than once"),
        ("pull_rows", {"name": "e"}, [Entry("indices", torch.tensor([1, 1]))],
         "INVALID_ARGUMENT", "repeat a row"),
        ("pull_rows", {"name": "e"}, [Entry("indices", torch.tensor([16]))],
         "INVALID_ARGUMENT", "indices must be in [0, 16)"),
        ("elastic", {"moving_rate": 1.5}, [Entry("c", torch.ones(4))],
         "INVALID_ARGUMENT", "moving_rate must be in (0, 1]"),
        ("elastic", {"moving_rate": 0.5}, [Entry("w", torch.ones(8, 5))],
         "FAILED_PRECONDITION", "not 'elastic'"),
        ("elastic", {"moving_rate": 0.5}, [Entry("c", torch.full((4,), float("inf")))],
         "INVALID_ARGUMENT", "non-finite"),
        ("set_hyperparams", {"hyperparams": {"lr": -1.0}, "names": ["w"]}, [],
         "INVALID_ARGUMENT", "learning rate"),
        ("set_state", {"slots": [{"name": "w", "param": 0}]}, [Entry("w", torch.zeros(2))],
         "FAILED_PRECONDITION", "restore a checkpoint of the same model"),
        ("wait_version", {"min_version": "x"}, [], "INVALID_ARGUMENT",
         "field 'min_version' must be an int >= 0"),
        ("wait_version", {"timeout": "soon"}, [], "INVALID_ARGUMENT",
         "field 'timeout' must be a finite number"),
    ]
    _assert_refused(d, cases)
    _same(before, d.values())


# -- bounds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", NO_SHM)
def test_replies_are_bounded_before_anything_is_read(transport: str,
                                                     drivers: list[_Driver]) -> None:
    """A reply above max_message_bytes, or listing more than max_tensors tensors, is refused
    (RESOURCE_EXHAUSTED) from sizes and counts alone; a push that would answer too much
    applies nothing. (A doorbell push answers into the worker's region, whose size the shard
    fixed at attach: it has no reply to bound.)"""
    d = _driver(drivers, transport, max_message_bytes=64 << 10)
    big = [Entry(f"t{i}", torch.zeros(4096)) for i in range(6)]  # 16 KiB each
    for part in (big[:3], big[3:]):  # each request within the bound, all six above it
        d.call("register", {"entries": [{"mode": "async", "spec": 0}] * 3, "specs": [SGD]},
               part)
    with pytest.raises(Refused) as info:
        d.call("pull")
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert "max_message_bytes=65536" in info.value.detail
    b = d.call("pull", {"names": ["b"]}).entries[0]
    with pytest.raises(Refused) as info:
        d.push(_grads(0, ["b"]), {"b": int(b.version or 0)}, [f"t{i}" for i in range(6)])
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert "push: the reply would be" in info.value.detail
    after = d.call("pull", {"names": ["b"]}).entries[0]  # nothing applied
    assert after.version == b.version and torch.equal(after.tensor, b.tensor)
    limits = replace(wire.Limits(), max_tensors=8)
    if isinstance(d, _ServiceDriver):
        d.svc.limits = limits
    else:
        assert isinstance(d, _GrpcDriver)
        d.server.limits = limits
    for op in ("pull", "get_state", "health"):
        with pytest.raises(Refused) as info:
            d.call(op)
        assert info.value.status == "RESOURCE_EXHAUSTED", op
        assert "max_tensors=8" in info.value.detail and "(10)" in info.value.detail, op


@pytest.mark.parametrize("transport", NO_SHM)
def test_the_quota_holds_and_refuses_all_or_nothing(transport: str,
                                                    drivers: list[_Driver]) -> None:
    d = _driver(drivers, transport, register=False)
    quota = 64 << 10
    if isinstance(d, _ServiceDriver):
        d.svc.max_bytes = quota
    else:
        assert isinstance(d, _GrpcDriver)
        d.server.service.max_bytes = quota
    small = [Entry("a", torch.zeros(1024))]
    d.call("register", {"entries": [{"mode": "async", "spec": 0}], "specs": [SGD]}, small)
    over = [Entry("x", torch.zeros(1024)), Entry("y", torch.zeros(16 << 10))]
    with pytest.raises(Refused) as info:
        d.call("register", {"entries": [{"mode": "async", "spec": 0}] * 2, "specs": [SGD]}, over)
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert f"max_bytes={quota}" in info.value.detail
    assert sorted(d.values()) == ["a"]  # neither x nor y


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_caller_without_the_secret_is_refused(transport: str, drivers: list[_Driver]) -> None:
    """gRPC: a call without the shard's token is UNAUTHENTICATED before its body is read.
    Shared memory: a region whose nonce does not prove the attaching worker made it is
    PERMISSION_DENIED with one generic sentence (what was wrong only in the shard's log)."""
    d = _driver(drivers, transport)
    assert isinstance(d, _GrpcDriver)
    if transport == "grpc":
        with PSClient([d.server.address], token="wrong", timeout=10) as stranger:
            with pytest.raises(RemoteError) as info:
                stranger.call(0, "pull")
        assert info.value.code == "UNAUTHENTICATED"
        return
    lay = shm.layout([("b", torch.float32, torch.float32, (5,))])
    region = shm.WorkerRegion(lay)
    try:
        fields = {"pid": os.getpid(), "fd": region.fd, "size": lay.size,
                  "nonce": ("00" * shm.NONCE_BYTES), "entries": [["b", "float32"]]}
        with pytest.raises(Refused) as info2:
            d.call("shm_attach", fields)
    finally:
        region.release()
    assert info2.value.status == "PERMISSION_DENIED"
    assert d.server.shm.regions == {}


def test_grpc_bounds_bytes_in_flight_and_body_time(drivers: list[_Driver]) -> None:
    """The gRPC transport's own bounds: a request that would pass max_inflight_bytes is
    refused at once, and one declaring more than max_message_bytes before a byte is read."""
    d = _driver(drivers, "grpc", max_message_bytes=1 << 20, max_inflight_bytes=4096)
    assert isinstance(d, _GrpcDriver)
    with pytest.raises(Refused) as info:
        d.call("push", {}, [Entry("w", torch.zeros(8, 5), 0)] + [
            Entry(f"pad{i}", torch.zeros(256)) for i in range(8)])
    assert info.value.status == "RESOURCE_EXHAUSTED"
    assert "max_inflight_bytes=4096" in info.value.detail
    assert d.server.admission.inflight_bytes == 0


def test_shm_bounds_regions_and_doorbell_pushes(drivers: list[_Driver],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared-memory transport's own bounds: at most MAX_REGIONS regions of live workers
    (the next attach is RESOURCE_EXHAUSTED and the worker uses gRPC), and doorbell pushes
    beyond the shard's tensor threads wait at most body_timeout, then are answered
    UNAVAILABLE."""
    from stratagem.ps import serve_shm

    d = _driver(drivers, "shm")
    assert isinstance(d, _ShmDriver)
    monkeypatch.setattr(serve_shm, "MAX_REGIONS", 1)
    d.push(_grads(0, ["b"]), d.versions(), [])  # the one region
    other = _ShmDriver.__new__(_ShmDriver)
    other.server, other.client = d.server, d.client
    other.region = other.bell = None
    with pytest.raises(Refused) as info:
        other.attach()
    assert other.region is not None
    other.region.release()
    assert other.bell is not None
    other.bell.close()
    assert info.value.status == "RESOURCE_EXHAUSTED" and "shared-memory regions" in info.value.detail
    slots = d.server.shm._bell_slots
    taken = 0
    while slots.acquire(blocking=False):  # every tensor thread busy
        taken += 1
    try:
        t0 = time.monotonic()
        with pytest.raises(Refused) as info:
            d.push(_grads(1, ["b"]), d.versions(), [])
        assert info.value.status == "UNAVAILABLE" and "busy" in info.value.detail
        assert time.monotonic() - t0 < 2.0 + 1.5  # body_timeout=2 s
    finally:
        for _ in range(taken):
            slots.release()
    assert d.push(_grads(2, ["b"]), d.versions(), []).results[0][1] == "applied"


# -- asynchronous DiLoCo's rounds ------------------------------------------------------------

OUTER = {"name": "sgd", "lr": 1.0, "outer_grace": 0.0, "outer_staleness": "inverse",
         "outer_round_samples": 8.0}


def _unlined(fields: dict[str, Any]) -> dict[str, Any]:
    """A reply's fields without the slots' lineages (random per slot, so per shard)."""
    assert all(isinstance(v, int) for v in fields.pop("lineage").values())
    return fields


def _with_outer(d: _Driver) -> _Driver:
    d.call("register", {"entries": [{"mode": "outer", "spec": 0, "replicas_to_aggregate": 2}],
                        "specs": [OUTER]}, [Entry("o", torch.zeros(300))])
    return d


@pytest.mark.parametrize("transport", NO_SHM)
def test_outer_rounds_are_bitwise_the_services(transport: str, drivers: list[_Driver]) -> None:
    from stratagem.quantize import quantize

    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(300, generator=g) for _ in range(3)]
    int4 = quantize(torch.cat([deltas[2], torch.zeros(84)]), "int4")

    def rounds(d: _Driver) -> tuple[list[Any], dict[str, torch.Tensor]]:
        out = [d.call("contribute", {"samples": 4}, [Entry("o", deltas[0], 0)]).fields,
               d.call("contribute", {"samples": 2, "compression": "bf16"},
                      [Entry("o", deltas[1].bfloat16(), 0)]).fields,
               d.call("contribute", {"samples": 3, "compression": "int4"},
                      [Entry("o", int4, 0)]).fields,  # stale by one round
               _unlined(d.call("close_round", {"versions": {"o": 1}, "fetch": True}).fields)]
        return out, {k: v for k, v in d.values().items() if k == "o"}

    ref = rounds(_with_outer(_driver(drivers, "service")))
    got = rounds(_with_outer(_driver(drivers, transport)))
    _assert_same_tree(got[0], ref[0])
    _same(got[1], ref[1])
    assert [r["results"][0][1] for r in ref[0][:3]] == ["accumulated", "applied",
                                                          "accumulated"]
    assert ref[0][3]["results"] == [["applied", 2]]  # closed by the (zero) grace window


@pytest.mark.parametrize("transport", NO_SHM)
def test_refusals_of_the_outer_operations(transport: str, drivers: list[_Driver]) -> None:
    d = _with_outer(_driver(drivers, transport))
    before = d.values()
    cases: list[tuple[str, dict[str, Any], list[Entry], str, str]] = [
        ("contribute", {"samples": 1}, [Entry("w", torch.zeros(8, 5), 0)],
         "FAILED_PRECONDITION", "not 'outer'"),
        ("contribute", {"samples": 0}, [Entry("o", torch.zeros(300), 0)],
         "INVALID_ARGUMENT", "samples must be a number in (0, 1e12]"),
        ("contribute", {"samples": 1, "compression": "zip"}, [Entry("o", torch.zeros(300), 0)],
         "INVALID_ARGUMENT", "compression must be one of"),
        ("contribute", {"samples": 1, "compression": "int4"},
         [Entry("o", torch.zeros(10, dtype=torch.uint8), 0)],
         "FAILED_PRECONDITION", "1-D uint8 payload of 204 bytes"),
        ("contribute", {"samples": 1}, [Entry("o", torch.full((300,), float("nan")), 0)],
         "INVALID_ARGUMENT", "NaN or Inf"),
        ("contribute", {"samples": 1}, [Entry("o", torch.zeros(300))],
         "INVALID_ARGUMENT", "carries no base version"),
        ("push", {}, [Entry("o", torch.zeros(300), 0)],
         "FAILED_PRECONDITION", "takes 'contribute' calls"),
        ("close_round", {"versions": ["o"]}, [], "INVALID_ARGUMENT",
         "close_round needs 'versions'"),
        ("close_round", {"versions": {"o": 0}, "force": "yes"}, [], "INVALID_ARGUMENT",
         "must be true or false"),
        ("set_state", {"slots": [], "if_newer": 1}, [], "INVALID_ARGUMENT",
         "if_newer must be true or false"),
    ]
    _assert_refused(d, cases)
    _same(before, d.values())


@pytest.mark.parametrize("transport", NO_SHM)
@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_the_model_comes_down_as_encoded_updates_bitwise_the_shards(
        transport: str, kind: str, drivers: list[_Driver]) -> None:
    # A replica that holds version v (of the slot's lineage) gets the encoded updates since v,
    # one entry per round, and rebuilds the shard's value bitwise; another lineage or a
    # version the shard no longer keeps gets the value itself.
    from stratagem.ps import updates

    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(300, generator=g) for _ in range(6)]

    def run(d: _Driver) -> tuple[list[Any], list[torch.Tensor]]:
        d.call("register", {"entries": [{"mode": "outer", "spec": 0,
                                         "replicas_to_aggregate": 2}],
                            "specs": [{**OUTER, "outer_download": kind}]},
               [Entry("o", torch.zeros(300))])
        first = d.call("close_round", {"versions": {"o": -1}, "fetch": True})
        lineage = first.fields["lineage"]["o"]
        held, held_version = first.entries[0].tensor.clone(), 0
        seen: list[Any] = []
        rebuilt: list[torch.Tensor] = []
        for r in range(3):
            for i in (2 * r, 2 * r + 1):
                d.call("contribute", {"samples": 4}, [Entry("o", deltas[i], r)])
            have = {"o": [held_version, lineage]} if r != 1 else {}  # round 1: not fetched
            reply = d.call("close_round", {"versions": {"o": -1}, "fetch": True,
                                           "have": have})
            seen.append(_unlined(dict(reply.fields)))
            if r == 1:
                continue
            if reply.fields["updates"]:
                for e in reply.entries:
                    held = updates.apply(held, e.tensor, kind)
                held_version = reply.entries[-1].version
            else:
                held, held_version = reply.entries[0].tensor.clone(), reply.entries[0].version
            rebuilt.append(held.clone())
            _same({"o": held}, {"o": d.values()["o"]})
        # another lineage, or a version no longer kept: the value itself
        for have in ({"o": [2, lineage + 1]}, {"o": [0, lineage]}):
            reply = d.call("close_round", {"versions": {"o": -1}, "fetch": True, "have": have})
            assert reply.fields["updates"] == {} or have["o"][0] == 0
            seen.append(_unlined(dict(reply.fields)))
        return seen, rebuilt

    ref = run(_driver(drivers, "service"))
    got = run(_driver(drivers, transport))
    _assert_same_tree(got[0], ref[0])
    for a, b in zip(got[1], ref[1], strict=True):
        assert torch.equal(a, b)
    # round 0: one update since version 0; round 2: the two since version 1 (in bf16 two
    # updates weigh the fp32 value: the value comes instead)
    assert ref[0][0]["updates"] == {"o": 1}
    assert ref[0][2]["updates"] == ({"o": 2} if kind == "int4" else {})
    assert ref[0][3]["updates"] == {}  # another lineage


def test_a_bad_have_is_refused(drivers: list[_Driver]) -> None:
    for transport in NO_SHM:
        d = _with_outer(_driver(drivers, transport))
        _assert_refused(d, [
            ("close_round", {"versions": {"o": 0}, "fetch": True, "have": {"o": 0}}, [],
             "INVALID_ARGUMENT", "'have' must be an object"),
            ("close_round", {"versions": {"o": 0}, "fetch": True, "have": {"x": [0, 1]}}, [],
             "INVALID_ARGUMENT", "'have' must be an object"),
        ])
