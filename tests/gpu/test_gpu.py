"""The CUDA paths, for the day a GPU is there: ``make test-gpu``.

- ``OneDevice`` on CUDA: fp16 with dynamic loss scaling (a non-finite step skipped, the scale
  halved then grown), bf16 autocast, fp32 equal to the CPU run; batches moved to the device.
- ``Mirrored``, ``LocalSGD``, ``DiLoCo`` and ``ElasticAveraging`` on CUDA tensors in 2
  processes sharing one GPU (``sg.launch``): over gloo, whose collectives take CUDA tensors
  (NCCL refuses two ranks on one device), so each strategy gets ``comm=Comm.from_env()``
  (gloo only) and ``device="cuda:0"``. Replicas agree exactly and match the same job on CPU.
- A ``ParameterServer`` worker on CUDA with its shards on the CPU (the wire copies to host).
- ``Sharded`` (FSDP2) on CUDA over NCCL: one process on one GPU, and two on two GPUs when
  there are two; equal to ``Mirrored``.
- Checkpoints of CUDA tensors restored on the CPU (model and optimizer state) and back.
- Fault tolerance on CUDA: the replicas' reconfigurable group builds an NCCL backend for CUDA
  tensors per quorum (a world of one, aborted and rebuilt), a replica trains over it, and a
  killed replica's CUDA state is healed through the heal transport (two replicas on one GPU:
  over gloo, since NCCL refuses two ranks on one device). Not run on a GPU yet.

Everything here is skipped without CUDA (``conftest.py``). Written against the code paths
(``Strategy(device=)``, ``prepare``'s ``module.to(device)``, ``DistributedLoader``'s
``move_to_device``, ``Comm.from_env``'s backend choice, ``ps.wire``'s host copy,
``checkpoint``'s ``.cpu()``) on a machine without a GPU. First run on a GPU on 2026-11-26: one
NVIDIA H200, torch 2.11.0+cu130, ``make test-gpu``: 7 passed, 1 skipped (the two-GPU Sharded
test), 43 s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_model
from torch import nn

import stratagem as sg

pytestmark = pytest.mark.timeout(600)

CUDA = "cuda:0"
#: The synchronous strategies run in 2 processes on one GPU: (registry name, arguments).
SYNC_RUNS: list[tuple[str, dict[str, Any]]] = [
    ("mirrored", {}),
    ("local_sgd", {"period": 2}),
    ("diloco", {"period": 4}),
    ("easgd", {"period": 2}),
]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def _data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 10, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _assert_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def _train(strategy: sg.Strategy, *, steps: int, optimizer: str = "sgd",
           seed: int = 0) -> tuple[nn.Module, Any, list[float], set[str]]:
    """SGD (or Adam) on the MLP for ``steps`` steps; returns the prepared model and optimizer,
    the losses and the device types the batches came on."""
    with strategy.scope():
        model = _model(seed)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
               else torch.optim.Adam(model.parameters(), lr=0.01))
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(_data(), 32, shuffle=True, seed=0)
    losses: list[float] = []
    devices: set[str] = set()
    epoch = 0
    while len(losses) < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            devices |= {x.device.type, y.device.type}
            loss = F.cross_entropy(model(x).float(), y)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if len(losses) == steps:
                break
        epoch += 1
    return model, opt, losses, devices


# ----------------------------------------------------------------- one device


def test_one_device_fp32_on_cuda_equals_cpu_and_moves_the_data():
    cuda = sg.OneDevice(device=CUDA)
    model, _, losses, devices = _train(cuda, steps=12)
    assert devices == {"cuda"}
    assert all(p.device.type == "cuda" for p in cuda.unwrap(model).parameters())
    cpu = sg.OneDevice(device="cpu")
    ref, _, ref_losses, _ = _train(cpu, steps=12)
    _assert_states(_cpu_state(cuda.unwrap(model)), _cpu_state(cpu.unwrap(ref)),
                   atol=1e-4, rtol=1e-4)
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    # reduce / gather of CUDA values, and nested batches moved to the device.
    assert cuda.reduce("mean", torch.ones(2, device=CUDA)).device.type == "cuda"
    batch = next(iter(cuda.distribute_dataset(_DictSet(), 8, shuffle=False)))
    assert batch["x"].device.type == "cuda" and batch["pair"][1].device.type == "cuda"


class _DictSet(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((3,), float(i)), "pair": (torch.tensor(i), torch.zeros(2))}


def test_one_device_fp16_on_cuda_scales_skips_and_trains():
    s = sg.OneDevice(device=CUDA, precision="fp16", init_scale=1024.0, growth_interval=3)
    with s.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = s.prepare(model, opt)
    loader = s.distribute_dataset(_data(), 32, shuffle=True, seed=0)
    scales, losses = [], []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for x, y in loader:
            out = model(x)
            assert out.dtype == torch.float16  # autocast on the prepared module
            loss = F.cross_entropy(out.float(), y)
            step = len(scales)
            before = _cpu_state(s.unwrap(model))
            s.backward(loss * float("inf") if step == 2 else loss)
            opt.step()
            opt.zero_grad()
            if step == 2:  # the overflow: skipped, parameters untouched
                _assert_states(_cpu_state(s.unwrap(model)), before, atol=0, rtol=0)
            scales.append(s.metrics()["loss_scale"])
            losses.append(float(loss.detach()))
    # Steps 0, 1 clean; 2 skipped (halve); 3, 4, 5 clean -> doubled after 3 clean steps.
    assert scales[:6] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
    assert s.metrics()["skipped_steps"] == 1 and s.metrics()["steps"] == len(scales) - 1
    assert sum(losses[-4:]) < sum(losses[:4])
    assert all(torch.isfinite(p).all() for p in s.unwrap(model).parameters())


def test_one_device_bf16_on_cuda_trains_without_loss_scaling():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    s = sg.OneDevice(device=CUDA, precision="bf16")
    model, _, losses, _ = _train(s, steps=24)
    assert model(torch.randn(4, 10, device=CUDA)).dtype == torch.bfloat16
    assert s.metrics()["loss_scale"] == 1.0 and s.metrics()["skipped_steps"] == 0
    assert sum(losses[-4:]) < sum(losses[:4])


# ----------------------------------------------------------------- 2 processes, 1 GPU


def _sync_worker(device: str) -> dict[str, dict[str, Any]]:
    """Each synchronous strategy in turn on ``device``, over gloo; the consensus model."""
    out: dict[str, dict[str, Any]] = {}
    for name, kwargs in SYNC_RUNS:
        # gloo only (no device= on the Comm): both processes share GPU 0, which NCCL refuses.
        strategy = sg.from_name(name, comm=sg.Comm.from_env(timeout=60), device=device,
                                timeout=60, **kwargs)
        model, _, losses, devices = _train(strategy, steps=10)
        strategy.finalize(model)
        consensus = strategy.eval_model(model)
        mean_loss = strategy.reduce("mean", torch.tensor(losses[-1], device=device))
        out[name] = {"state": _cpu_state(consensus), "data": sorted(devices),
                     "params": sorted({p.device.type for p in strategy.unwrap(model).parameters()}),
                     "mean_loss": float(mean_loss), "sent": strategy.metrics()["bytes_sent"]}
        strategy.close()
    return out


def test_sync_strategies_on_cuda_tensors_over_gloo_in_2_processes():
    cuda = sg.launch(_sync_worker, nprocs=2, args=(CUDA,), timeout=500)
    cpu = sg.launch(_sync_worker, nprocs=2, args=("cpu",), timeout=500)
    for name, _ in SYNC_RUNS:
        r0, r1 = cuda[0][name], cuda[1][name]
        assert r0["data"] == r0["params"] == ["cuda"], name
        assert r0["sent"] > 0 and r0["mean_loss"] == r1["mean_loss"], name
        _assert_states(r0["state"], r1["state"], atol=0, rtol=0)  # replicas agree exactly
        _assert_states(r0["state"], cpu[0][name]["state"], atol=1e-4, rtol=1e-4)


def _defaults_worker() -> dict[str, Any]:
    """More processes than GPUs, everything left to its default (device and comm): the
    group must not ask NCCL for two ranks on one GPU (it refuses: "Duplicate GPU detected")."""
    import warnings

    out: dict[str, Any] = {}
    for name, kwargs in (("mirrored", {}), ("diloco", {"period": 4, "compression": "int4"})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy = sg.from_name(name, timeout=60, **kwargs)
            model, _, losses, devices = _train(strategy, steps=8)
        strategy.finalize(model)
        out[name] = {"device": str(strategy.device), "data": sorted(devices),
                     "state": _cpu_state(strategy.eval_model(model)),
                     "warned": any("NCCL refuses two ranks on one GPU" in str(w.message)
                                   for w in caught)}
        strategy.close()
    return out


def test_more_processes_than_gpus_with_default_device_run_over_gloo():
    nprocs = torch.cuda.device_count() + 1
    results = sg.launch(_defaults_worker, nprocs=nprocs, timeout=300)
    for name in ("mirrored", "diloco"):
        r0 = results[0][name]
        assert r0["device"].startswith("cuda") and r0["data"] == ["cuda"], (name, r0["device"])
        assert all(r[name]["warned"] for r in results), name
        for r in results[1:]:
            _assert_states(r0["state"], r[name]["state"], atol=0, rtol=0)


# ----------------------------------------------------------------- parameter server


def test_ps_worker_on_cuda_with_cpu_shards_equals_one_device(shards, tmp_path):
    ps = sg.ParameterServer(ps_addresses=shards, comm=sg.Comm.single(), device=CUDA,
                            timeout=30)
    model, opt, _, devices = _train(ps, steps=8)
    assert devices == {"cuda"}
    assert all(p.device.type == "cuda" for p in ps.unwrap(model).parameters())
    ref_strategy = sg.OneDevice(device="cpu")
    ref, _, _, _ = _train(ref_strategy, steps=8)
    expected = _cpu_state(ref_strategy.unwrap(ref))
    _assert_states(_cpu_state(ps.eval_model(model)), expected, atol=1e-5, rtol=1e-5)
    ps.save(tmp_path / "ck", model=model, optimizer=opt)  # the global model, read from shards
    plain = _model(seed=9)
    load_model(plain, str(tmp_path / "ck" / "model.safetensors"))
    _assert_states(_cpu_state(plain), expected, atol=1e-5, rtol=1e-5)
    ps.close()


@pytest.mark.parametrize("compression", [None, "int4"])
def test_async_diloco_on_cuda_with_cpu_shards_equals_cpu(compression, tmp_path):
    # One replica, so each round closes on its own pseudo-gradient: deterministic. The
    # fetched model (and, with int4, the encoded updates rebuilt on the host) lands on the
    # CUDA parameters.
    from stratagem.ps.server import start_local_shards

    states = {}
    for device in (CUDA, "cpu"):
        servers, addrs = start_local_shards(1)
        try:
            s = sg.DiLoCo(mode="async", period=2, ps_addresses=addrs, comm=sg.Comm.single(),
                          device=device, timeout=30, compression=compression)
            model, _, _, _ = _train(s, steps=8)
            assert all(p.device.type == torch.device(device).type
                       for p in s.unwrap(model).parameters())
            assert s.metrics()["outer_landed"] >= 3
            s.finalize(model)
            states[device] = _cpu_state(s.unwrap(model))
            s.close()
        finally:
            for srv in servers:
                srv.stop(0)
    _assert_states(states[CUDA], states["cpu"], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- sharded (FSDP2)


def _sharded_worker(gpu_per_rank: bool) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank if gpu_per_rank else 0)
    torch.cuda.set_device(device)
    # Our own default group, so that a world of one has one too (FSDP2 needs a group).
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    try:
        out = {}
        for cls in (sg.Sharded, sg.Mirrored):
            strategy = cls(comm=sg.Comm.from_env(timeout=60, device=device), device=device,
                           timeout=60)
            model, _, _, devices = _train(strategy, steps=10, optimizer="adam")
            assert devices == {"cuda"}
            out[cls.__name__] = _cpu_state(strategy.eval_model(model))
            strategy.close()
        return out
    finally:
        dist.destroy_process_group()


def test_sharded_on_one_gpu_equals_mirrored():
    (result,) = sg.launch(_sharded_worker, nprocs=1, args=(False,), timeout=500)
    _assert_states(result["Sharded"], result["Mirrored"], atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL, one per rank)")
def test_sharded_on_two_gpus_equals_mirrored():
    r0, r1 = sg.launch(_sharded_worker, nprocs=2, args=(True,), timeout=500)
    _assert_states(r0["Sharded"], r0["Mirrored"], atol=1e-5, rtol=1e-4)
    _assert_states(r0["Sharded"], r1["Sharded"], atol=0, rtol=0)


# ----------------------------------------------------------------- checkpoints


def test_checkpoint_of_cuda_tensors_restores_on_cpu_and_back(tmp_path: Path):
    gpu = sg.OneDevice(device=CUDA)
    model, opt, _, _ = _train(gpu, steps=5, optimizer="adam")
    gpu.save(tmp_path / "from_gpu", model=model, optimizer=opt, step=5)
    gpu_state = _cpu_state(gpu.unwrap(model))
    gpu_opt = opt.state_dict()["state"]

    cpu = sg.OneDevice(device="cpu")
    with cpu.scope():
        m_cpu = _model(seed=5)
        o_cpu = torch.optim.Adam(m_cpu.parameters(), lr=0.01)
        m_cpu, o_cpu = cpu.prepare(m_cpu, o_cpu)
    assert cpu.restore(tmp_path / "from_gpu", model=m_cpu, optimizer=o_cpu)["step"] == 5
    _assert_states(_cpu_state(cpu.unwrap(m_cpu)), gpu_state, atol=0, rtol=0)
    for i, st in o_cpu.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].device.type == "cpu"
            torch.testing.assert_close(st[key], gpu_opt[i][key].cpu(), atol=0, rtol=0)
    plain = _model(seed=9)
    load_model(plain, str(tmp_path / "from_gpu" / "model.safetensors"))
    _assert_states(_cpu_state(plain), gpu_state, atol=0, rtol=0)

    # ... and back: written on the CPU, restored into a CUDA model and optimizer.
    cpu.save(tmp_path / "from_cpu", model=m_cpu, optimizer=o_cpu, step=6)
    back = sg.OneDevice(device=CUDA)
    with back.scope():
        m_back = _model(seed=7)
        o_back = torch.optim.Adam(m_back.parameters(), lr=0.01)
        m_back, o_back = back.prepare(m_back, o_back)
    assert back.restore(tmp_path / "from_cpu", model=m_back, optimizer=o_back)["step"] == 6
    assert all(p.device.type == "cuda" for p in back.unwrap(m_back).parameters())
    _assert_states(_cpu_state(back.unwrap(m_back)), gpu_state, atol=0, rtol=0)
    for st in o_back.state_dict()["state"].values():
        assert st["exp_avg"].device.type == "cuda"
    # One more step from the restored state: the same on CUDA and on the CPU.
    x, y = (t[:32] for t in _data())
    for strategy, m, o in ((back, m_back, o_back), (cpu, m_cpu, o_cpu)):
        strategy.backward(F.cross_entropy(m(x.to(strategy.device)), y.to(strategy.device)))
        o.step()
        o.zero_grad()
    _assert_states(_cpu_state(back.unwrap(m_back)), _cpu_state(cpu.unwrap(m_cpu)),
                   atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- fault tolerance on CUDA
def _allreduce_sum(pg: Any, t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    return t


def test_fault_tolerant_group_on_cuda_runs_nccl_and_is_aborted_and_rebuilt():
    """The replicas' reconfigurable group on CUDA: each quorum (here two, of one member:
    NCCL refuses two ranks on one GPU) builds an NCCL backend for CUDA tensors beside gloo
    for CPU ones; an abort drops it and the next quorum builds a new one that works."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import TCPStore
    from torchft.process_group import reconfigure_with_store

    from stratagem.ft import upstream

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    pg = upstream.bound_gloo_group(timedelta(seconds=60), "127.0.0.1",
                                   device=torch.device(CUDA))
    backends = []
    try:
        for quorum in (1, 2):
            reconfigure_with_store(pg, f"127.0.0.1:{store.port}/q/{quorum}", 0, 1,
                                   timedelta(seconds=60))
            assert isinstance(pg.nccl, dist.ProcessGroupNCCL)
            assert pg.device_backend("cuda") is pg.nccl
            assert pg.device_backend("cpu") is not pg.nccl
            t = _allreduce_sum(pg, torch.full((1 << 20,), 2.0, device=CUDA))
            torch.cuda.synchronize()
            assert torch.equal(t.cpu(), torch.full((1 << 20,), 2.0))
            assert _allreduce_sum(pg, torch.ones(3)).tolist() == [1.0, 1.0, 1.0]  # gloo
            backends.append(pg.nccl)
            pg.abort(errored=False)
            assert pg.nccl is None and pg.device_backend("cuda") is None
        assert backends[0] is not backends[1] and pg.nccl_built == 2
    finally:
        pg.shutdown()


def _ft_train(comm: Any, steps: int, faults: Any) -> tuple[Any, ...]:
    strategy = sg.Mirrored(comm=comm, device=CUDA)
    model = _model(seed=comm.slot)  # different inits: the first quorum makes them equal
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(_data(), 32, shuffle=True, seed=0)
    epoch = 0
    while strategy.steps < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            if faults is not None:
                faults.check(comm, strategy.steps)
            if strategy.steps >= steps:
                break
        epoch += 1
    strategy.finalize(model)
    pg = comm._pg
    # A world of one skips its collectives: send one CUDA tensor through the group itself.
    over_cuda = (_allreduce_sum(pg, torch.full((4,), 3.0, device=CUDA)).tolist()
                 if comm.world_size == 1 else None)
    return (_cpu_state(model), strategy.steps, comm.heals, next(model.parameters()).device.type,
            pg.nccl_built, type(pg.nccl).__name__, over_cuda)


def test_a_fault_tolerant_replica_on_cuda_runs_over_nccl():
    pytest.importorskip("torchft")
    from stratagem.testing.ft import run_replicas

    ((state, steps, heals, device, built, backend, over_cuda),) = run_replicas(
        _ft_train, 1, args=(6, None), device=torch.device(CUDA), timeout=60, deadline=300)
    assert steps == 6 and device == "cuda" and built >= 1 and backend == "ProcessGroupNCCL"
    assert over_cuda == [3.0] * 4


@pytest.mark.filterwarnings("ignore:.*NCCL refuses two ranks on one GPU")
def test_a_killed_replica_on_cuda_is_healed_bitwise_through_the_heal_transport(monkeypatch):
    """Two replicas on one GPU (NCCL refuses two ranks on one device, so their group stays
    on gloo, as LOCAL_WORLD_SIZE=2 says); one is killed and its replacement heals from the
    other: model and optimizer state on CUDA, moved through stratagem's authenticated heal
    transport (safetensors, no pickle), loaded back onto the GPU."""
    pytest.importorskip("torchft")
    from stratagem.testing.ft import ReplicaFaults, run_replicas

    # More processes than GPUs (here: threads) keep the group on gloo, on any machine.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(torch.cuda.device_count() + 1))
    faults = ReplicaFaults().fail_at(1, 4)
    results = run_replicas(_ft_train, 2, args=(10, faults), faults=faults, min_replicas=2,
                           device=torch.device(CUDA), timeout=60, deadline=300)
    assert faults.deaths == [(1, 4)]
    assert all(r[1] == 10 and r[3] == "cuda" for r in results)
    assert results[1][2] >= 1  # the replacement healed from its peer
    _assert_states(results[0][0], results[1][0], atol=0, rtol=0)
