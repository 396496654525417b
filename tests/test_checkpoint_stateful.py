"""Any stateful object in checkpoints: LR schedulers, ``GradScaler`` and a
user's object round-trip bitwise through ``save``/``restore`` under every strategy, without
pickle; a value that fits neither safetensors nor strict JSON is refused naming its key path;
a restored scheduler resumes at the scheduled learning rate. Also the codec itself
(:mod:`stratagem.checkpoint.tree`)."""

from __future__ import annotations

import functools
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_model
from torch.optim import lr_scheduler

import stratagem as sg
from stratagem.checkpoint import tree
from stratagem.comm import Comm
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(120)
DATA = make_data(96)


class Meter:
    """A user's object: ints, floats (non-finite too), int keys, tuples, strings, a tensor."""

    def __init__(self, seed: int = 0) -> None:
        self.count = seed
        self.history = [0.1 * seed, math.inf, -math.inf, math.nan, 1e-310, -0.0]
        self.by_id = {0: "zero", 7: "seven", "name": (1, 2.5, None, True)}
        self.ema = torch.full((3,), float(seed), dtype=torch.float64)
        self.nested = OrderedDict(a=[{"b": torch.arange(4, dtype=torch.int32)}])

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": list(self.history), "by_id": dict(self.by_id),
                "ema": self.ema, "nested": self.nested}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.history = state["count"], state["history"]
        self.by_id, self.ema, self.nested = state["by_id"], state["ema"], state["nested"]


def _warmup_linear(step: int, *, warmup: int, total: int) -> float:
    """transformers' get_linear_schedule_with_warmup lambda (it is a functools.partial)."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality of nested states: types, tensors' dtype/shape/bytes, floats' bits."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), \
        f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b)), \
            f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _objects(opt: torch.optim.Optimizer, seed: int) -> dict[str, Any]:
    lam = functools.partial(_warmup_linear, warmup=2, total=20)
    return {
        "scheduler": lr_scheduler.CosineAnnealingLR(opt, T_max=7, eta_min=1e-4),
        "warmup": lr_scheduler.LambdaLR(opt, lam),
        "plateau": lr_scheduler.ReduceLROnPlateau(opt, patience=1),  # holds inf
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3),
        "meter": Meter(seed),
    }


def _advance(objs: dict[str, Any], steps: int, rank: int) -> None:
    for i in range(steps):
        objs["scheduler"].step()
        objs["warmup"].step()
        objs["plateau"].step(1.0 / (i + 1))
        objs["scaler"].scale(torch.ones(1))  # (creates its scale tensor)
        objs["scaler"].update(2.0 ** (12 - i))  # a scale set by hand, the same on all ranks
    objs["meter"].count += 100 + rank  # differs per rank: stored per rank


def _job(make: Callable[[Comm], sg.Strategy], path: Path, comm: Comm) -> list[dict[str, Any]]:
    """Train 3 steps with the objects, save them; restore into fresh objects (another seed);
    return (saved, restored) state dicts of every object."""
    s = make(comm)
    try:
        model, opt = _prepared(s, 0)
        objs = _objects(opt, seed=comm.rank)
        loader = s.distribute_dataset(DATA, 16, seed=0)
        for i, (x, y) in enumerate(loader):
            if i == 3:
                break
            s.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        _advance(objs, 3, comm.rank)
        s.save(path, model=model, optimizer=opt, step=3, **objs)
        saved = {k: o.state_dict() for k, o in objs.items()}
        model2, opt2 = _prepared(s, 5)
        fresh = _objects(opt2, seed=50 + comm.rank)
        assert s.restore(path, model=model2, optimizer=opt2, **fresh)["step"] == 3
        return [saved, {k: o.state_dict() for k, o in fresh.items()}]
    finally:
        s.close()


def _prepared(s: sg.Strategy, seed: int) -> tuple[Any, Any]:
    with s.scope():
        model = make_model(seed)
        return s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


STRATEGIES: dict[str, Callable[[list[str]], Callable[[Comm], sg.Strategy]]] = {
    "mirrored": lambda a: lambda comm: sg.Mirrored(comm=comm),
    "local_sgd": lambda a: lambda comm: sg.LocalSGD(period=2, comm=comm),
    "diloco": lambda a: lambda comm: sg.DiLoCo(period=2, comm=comm),
    "easgd_sync": lambda a: lambda comm: sg.ElasticAveraging(period=2, moving_rate=0.3, comm=comm),
    "ps_sync": lambda a: lambda comm: sg.ParameterServer(ps_addresses=a, mode="sync", comm=comm,
                                                         timeout=10),
    "ps_async": lambda a: lambda comm: sg.ParameterServer(ps_addresses=a, mode="async",
                                                          comm=comm, timeout=10),
    "hierarchical": lambda a: lambda comm: sg.Hierarchical(inner=sg.Mirrored(),
                                                           outer=sg.DiLoCo(period=2), comm=comm),
}


def _check_round_trip(results: list[list[dict[str, Any]]], path: Path) -> None:
    for rank, (saved, restored) in enumerate(results):
        for key in saved:
            _same(saved[key], restored[key], f"rank{rank}.{key}")
        assert restored["meter"]["count"] == 100 + 2 * rank  # its own rank's state
    manifest = json.loads((path / "manifest.json").read_text())
    objects = manifest["objects"]
    assert objects["scheduler"] == {"kind": "stateful", "type": "CosineAnnealingLR", "per_rank": 0}
    per_rank = len(results) if len(results) > 1 else 0  # states differ only across ranks
    assert objects["meter"]["per_rank"] == per_rank
    files = set(manifest["files"])
    meter = "meter.rank0.safetensors" if per_rank else "meter.safetensors"
    assert {"scheduler.safetensors", "scaler.safetensors", meter} <= files
    # No pickle anywhere: every member is a safetensors file (8-byte length + JSON header).
    for name in files:
        raw = (path / name).read_bytes()
        assert raw[8:9] == b"{" and b"\x80\x04" not in raw[:2]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_schedulers_scaler_and_user_object_round_trip_bitwise(name: str, shards: list[str],
                                                              tmp_path: Path) -> None:
    make = STRATEGIES[name](shards)
    path = tmp_path / "ck"
    world, nnodes = (4, 2) if name == "hierarchical" else (2, 1)
    results = run_ranks(lambda comm: _job(make, path, comm), world, nnodes=nnodes)
    _check_round_trip(results, path)


@pytest.mark.parametrize("make", [lambda: sg.OneDevice(), lambda: sg.Sharded(comm=Comm.single())],
                         ids=["one_device", "sharded"])
def test_round_trip_in_one_process(make: Callable[[], sg.Strategy], tmp_path: Path) -> None:
    """OneDevice, and Sharded (FSDP2) in a world of one: its threads-as-ranks form does not
    exist (see tests/test_sharded.py); the stateful objects take the same path there."""
    results = [_job(lambda comm: make(), tmp_path / "ck", Comm.single())]
    _check_round_trip(results, tmp_path / "ck")


# ---------------------------------------------------------------------- refusals
class _Schedule:
    """A callable lr_lambda object: LambdaLR saves its __dict__, here holding a function."""

    def __init__(self) -> None:
        self.fn = lambda step: 0.5 ** step

    def __call__(self, step: int) -> float:
        return float(self.fn(step))


def test_a_value_that_fits_neither_is_refused_naming_its_key_path(tmp_path: Path) -> None:
    s = sg.OneDevice()
    model, opt = _prepared(s, 0)
    sched = lr_scheduler.LambdaLR(opt, _Schedule())
    with pytest.raises(sg.CheckpointError,
                       match=r"scheduler\.lr_lambdas\[0\]\.fn is a function \(callables .*Fix: "
                             r"make state_dict\(\) return only tensors"):
        s.save(tmp_path / "ck", model=model, optimizer=opt, scheduler=sched)
    assert not (tmp_path / "ck").exists()

    class Holder:
        def __init__(self, value: Any) -> None:
            self.value = value

        def state_dict(self) -> dict[str, Any]:
            return {"inner": {3: [0, self.value]}}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.value = state["inner"][3][1]

    for value, text in ((object(), r"user\.inner\[3\]\[1\] is a object"),
                        ({1, 2}, r"user\.inner\[3\]\[1\] is a set"),
                        ({(1, 2): 0}, r"user\.inner\[3\]\[1\]\[\(1, 2\)\] has a key of type tuple"),
                        (torch.ones(2).to_sparse(), r"user\.inner\[3\]\[1\] is a torch\.sparse_coo")):
        with pytest.raises(sg.CheckpointError, match=text):
            s.save(tmp_path / "ck", model=model, user=Holder(value))
    # Keys that would collide with stratagem's own files are refused.
    with pytest.raises(sg.CheckpointError, match="not be one of .*'rng'"):
        s.save(tmp_path / "ck", rng=Holder(1))
    # A saved object restored into another kind of object is refused with the fix.
    s.save(tmp_path / "ck", model=model, user=Holder(1))
    with pytest.raises(sg.CheckpointError, match="does not fit the GradScaler given.*Fix"):
        s.restore(tmp_path / "ck", user=torch.amp.GradScaler("cpu"))
    with pytest.raises(sg.CheckpointError, match="'model' is a saved module, not an object with"):
        s.restore(tmp_path / "ck", model=Holder(1))
    fresh = Holder(0)
    s.restore(tmp_path / "ck", user=fresh)
    assert fresh.value == 1


# ---------------------------------------------------------------------- resuming the LR
def _lr_run(tmp_path: Path, comm: Comm, *, stop: int | None, resume: str | None) -> Any:
    """Mirrored with CosineAnnealingLR (its chainable form builds each LR on the optimizer's
    current one): 8 steps, or `stop` steps then save, or restore (`resume`) and finish."""
    s = sg.Mirrored(comm=comm)
    model, opt = _prepared(s, 0)
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=0.01)
    start = 0
    if resume == "all":
        start = s.restore(tmp_path / "ck", model=model, optimizer=opt, scheduler=sched)["step"]
    elif resume == "scheduler":
        start = s.restore(tmp_path / "ck", scheduler=sched)["step"]
        return [g["lr"] for g in opt.param_groups], sched.get_last_lr(), start
    lrs = []
    loader = s.distribute_dataset(DATA, 16, seed=0)
    for i, (x, y) in enumerate(loader):
        if i < start:
            continue
        if i == 8 or (stop is not None and i == stop):
            break
        lrs.append(opt.param_groups[0]["lr"])
        s.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        sched.step()
    if stop is not None:
        s.save(tmp_path / "ck", model=model, optimizer=opt, scheduler=sched, step=stop)
    return lrs, {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}


def test_restored_scheduler_resumes_at_the_scheduled_lr(tmp_path: Path) -> None:
    whole = run_ranks(lambda c: _lr_run(tmp_path, c, stop=None, resume=None), 2)
    first = run_ranks(lambda c: _lr_run(tmp_path, c, stop=4, resume=None), 2)
    rest = run_ranks(lambda c: _lr_run(tmp_path, c, stop=None, resume="all"), 2)
    for r in range(2):
        assert first[r][0] + rest[r][0] == whole[r][0]  # the same LR at every step
        _same(rest[r][1], whole[r][1], f"rank{r} model")
    # The scheduler restored alone sets its optimizer's LR to the scheduled one.
    alone = run_ranks(lambda c: _lr_run(tmp_path, c, stop=None, resume="scheduler"), 2)
    for lrs, last, start in alone:
        assert start == 4 and lrs == last == [whole[0][0][4]] and lrs[0] != 0.1


# ---------------------------------------------------------------------- the codec
def test_codec_round_trip_ties_and_strict_json() -> None:
    w = torch.randn(3, 4)
    state = {"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}, "tied": w, "again": w,
             "view": w[1:], "t": (1, [2.5, None], "s", False), 3: {"x": math.nan},
             "big": 2 ** 70, "neg_zero": -0.0}
    tensors, skeleton = tree.encode(state)
    text = json.dumps(skeleton, allow_nan=False)  # strict JSON: no NaN token
    out = tree.decode(tensors, json.loads(text))
    _same(out, state)
    assert out["tied"] is out["again"] and out["view"] is not out["tied"]  # tie kept
    assert len(tensors) == 4  # "a/b" and a -> b both kept, the tie stored once
    import safetensors.torch
    safetensors.torch.save(tensors)  # the view is a copy: no shared memory refused
    with pytest.raises(sg.CheckpointError, match=r"opt\.state\[0\]\.step is a int64"):
        import numpy as np
        tree.encode({"state": {0: {"step": np.int64(3)}}}, path="opt")
    with pytest.raises(sg.CheckpointError, match=r"x\[True\] has a key of type bool"):
        tree.encode({True: 1}, path="x")
    with pytest.raises(sg.CheckpointError, match="nested deeper than 96"):
        deep: Any = 1
        for _ in range(60):
            deep = [deep]
        tree.encode(deep)
    for bad, text in (({"__float__": "NaN"}, "not one of"), ({"__set__": []}, "unexpected tag"),
                      ({"__dict__": [[1.5, 2]]}, "key is a float"),
                      ({"__dict__": [], "__list__": []}, "not one tag")):
        with pytest.raises(sg.CheckpointError, match=text):
            tree.decode({}, bad)
