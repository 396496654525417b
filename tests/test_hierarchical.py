"""Hierarchical: inner synchronisation inside a node, outer across nodes."""

from __future__ import annotations

import pytest
import torch
from helpers import mse_steps
from torch import nn
from torch.testing import assert_close

import stratagem as sg
from stratagem.comm import Comm
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    # Initialised from a generator of its own: ranks are threads sharing torch's global RNG.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)

def _train(strategy: sg.Strategy, steps: int, lr: float = 0.1,
           opt_fn=None) -> dict[str, torch.Tensor]:
    model = _model()
    opt = (opt_fn or (lambda ps: torch.optim.SGD(ps, lr=lr)))(model.parameters())
    model, opt = strategy.prepare(model, opt)
    mse_steps(strategy, model, opt, steps, _batch)
    return {k: v.detach().clone() for k, v in strategy.eval_model(model).state_dict().items()}


def test_outer_local_sgd_period_1_equals_flat_mirrored() -> None:
    """Mean over nodes of (x - lr * node-mean gradient) is x - lr * global-mean gradient:
    Hierarchical(Mirrored, LocalSGD(period=1)) on 2 nodes x 2 == Mirrored on 4, to 1e-5."""

    def hier(comm: Comm) -> dict[str, torch.Tensor]:
        st = sg.Hierarchical(inner=sg.Mirrored(), outer=sg.LocalSGD(period=1), comm=comm)
        return _train(st, 20)

    def flat(comm: Comm) -> dict[str, torch.Tensor]:
        return _train(sg.Mirrored(comm=comm), 20)

    got = run_ranks(hier, 4, nnodes=2)
    want = run_ranks(flat, 4)
    for g in got:
        for k in want[0]:
            assert_close(g[k], want[0][k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nnodes", [2, 4])
def test_outer_diloco_matches_flat_diloco_over_node_means(nnodes: int) -> None:
    """With one process per node, Hierarchical(OneDevice, DiLoCo) is exactly flat DiLoCo."""
    world = 4

    def hier(comm: Comm) -> dict[str, torch.Tensor]:
        st = sg.Hierarchical(inner="one_device", outer="diloco", outer_period=3, comm=comm)
        return _train(st, 10)

    def flat(comm: Comm) -> dict[str, torch.Tensor]:
        return _train(sg.DiLoCo(period=3, comm=comm), 10)

    if nnodes != world:
        with pytest.raises(ValueError, match="synchronises nothing inside a node"):
            run_ranks(hier, world, nnodes=nnodes)
        return
    got = run_ranks(hier, world, nnodes=nnodes)
    want = run_ranks(flat, world)
    for g, w in zip(got, want, strict=True):
        for k in w:
            assert_close(g[k], w[k], atol=1e-6, rtol=1e-6)


def test_hierarchical_diloco_relay_sends_one_copy_per_node() -> None:
    """The outer all-reduce crosses nodes once per node (split over the local ranks), not
    once per process: inter-node bytes per process = the model / local_world_size."""
    period = 4

    def job(comm: Comm) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        st = sg.Hierarchical(inner=sg.Mirrored(), outer=sg.DiLoCo(period=period), comm=comm)
        out = _train(st, 2 * period)
        return out, st.metrics()

    results = run_ranks(job, 4, nnodes=2)
    states = [r[0] for r in results]
    for s in states[1:]:
        for k in states[0]:
            assert_close(s[k], states[0][k])
    model_bytes = sum(p.numel() * 4 for p in _model().parameters())
    for _, m in results:
        # 2 outer steps, each all-reducing half the model across 2 nodes (2 (N-1)/N = 1):
        # chunks are padded to equal size, hence the tolerance. The model here is below the
        # relay's split threshold, so each process all-reduces the whole model.
        assert m["inter_node_bytes_sent"] > 0
        assert m["outer_steps"] == 2
        assert m["inter_node_bytes_sent"] <= 2 * model_bytes * 1.01 + 64
        assert m["intra_node_bytes_sent"] > 0


def test_relay_all_reduce_splits_across_local_ranks() -> None:
    def job(comm: Comm) -> tuple[float, float, int]:
        groups = comm.node_groups()
        x = torch.full((40_000,), float(comm.node_rank + 1))
        groups.relay().all_reduce(x)
        return x.min().item(), x.max().item(), groups.inter.bytes_sent

    for lo, hi, inter in run_ranks(job, 4, nnodes=2):
        assert lo == hi == 3.0
        assert inter == 20_000 * 4  # half the tensor per local rank, 2 (N-1)/N = 1


def test_node_groups_layout() -> None:
    def job(comm: Comm) -> tuple[int, int, int, int, float, float]:
        groups = comm.node_groups()
        a = torch.tensor([float(comm.rank)])
        groups.intra.all_reduce(a)
        b = torch.tensor([float(comm.rank)])
        groups.inter.all_reduce(b)
        return (comm.node_rank, comm.local_rank, groups.intra.rank, groups.inter.rank,
                a.item(), b.item())

    assert run_ranks(job, 6, nnodes=3) == [
        (0, 0, 0, 0, 1.0, 6.0), (0, 1, 1, 0, 1.0, 9.0),
        (1, 0, 0, 1, 5.0, 6.0), (1, 1, 1, 1, 5.0, 9.0),
        (2, 0, 0, 2, 9.0, 6.0), (2, 1, 1, 2, 9.0, 9.0)]


def test_split_rejects_a_non_partition() -> None:
    def job(comm: Comm) -> None:
        comm.split([[0], [0, 1]])

    with pytest.raises(ValueError, match="partition"):
        run_ranks(job, 2)


@pytest.mark.parametrize("kwargs, text", [
    ({"inner": "diloco"}, "cannot be Hierarchical's inner"),
    ({"outer": "mirrored"}, "cannot be Hierarchical's outer"),
    ({"inner": 3}, "must be a Strategy or a strategy name"),
    ({"outer": sg.DiLoCo(period=2, comm=Comm.single()), "outer_period": 3}, "already a DiLoCo"),
    ({"local_world_size": 0}, "local_world_size must be an int"),
])
def test_bad_arguments_name_the_fix(kwargs: dict, text: str) -> None:
    with pytest.raises((ValueError, TypeError), match=text) as info:
        sg.Hierarchical(comm=Comm.single(), **kwargs)
    assert "Fix" in str(info.value)


def test_from_name_routes_prefixed_arguments() -> None:
    st = sg.from_name("hierarchical", inner="mirrored", outer="diloco", outer_period=7,
                      outer_outer_lr=0.5, comm=Comm.single())
    assert st.outer.period == 7 and st.outer.outer_lr == 0.5
    assert type(st.inner).__name__ == "Mirrored"


def test_outer_elastic_averaging_sync() -> None:
    """Hierarchical(Mirrored, EASGD sync): node replicas stay equal, the center is the
    consensus, and the plain module loads it."""

    def job(comm: Comm) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        st = sg.Hierarchical(inner=sg.Mirrored(),
                             outer=sg.ElasticAveraging(period=2, moving_rate=0.3), comm=comm)
        out = _train(st, 6)
        return out, st.metrics()

    results = run_ranks(job, 4, nnodes=2)
    for state, m in results:
        assert m["exchanges"] == 3 and m["moving_rate"] == 0.3
        for k in results[0][0]:
            assert_close(state[k], results[0][0][k])
    with pytest.raises(ValueError, match="mode='sync', rho=0"):
        run_ranks(lambda c: sg.Hierarchical(
            outer=sg.ElasticAveraging(period=2, rho=0.1, moving_rate=0.1), comm=c).parts,
            2, nnodes=2)


def test_checkpoints_move_between_hierarchical_and_flat(tmp_path) -> None:
    """Hierarchical(2 nodes x 2) -> Mirrored(3) -> Hierarchical(2 x 2): the consensus model
    travels under the model's own names and loads into a plain module."""
    first = str(tmp_path / "hier")
    second = str(tmp_path / "flat")

    def hier_save(comm: Comm) -> dict[str, torch.Tensor]:
        st = sg.Hierarchical(inner="mirrored", outer="diloco", outer_period=3, comm=comm)
        model = _model()
        model, opt = st.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        mse_steps(st, model, opt, 5, _batch)
        st.save(first, model=model, optimizer=opt, step=5)
        return {k: v.clone() for k, v in st.eval_model(model).state_dict().items()}

    saved = run_ranks(hier_save, 4, nnodes=2)[0]
    plain = _model()
    plain.load_state_dict(sg.checkpoint.load_model_state(first))
    for k, v in plain.state_dict().items():
        assert_close(v, saved[k])

    def flat(comm: Comm) -> dict[str, torch.Tensor]:
        st = sg.Mirrored(comm=comm)
        model = _model()
        model, opt = st.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        extra = st.restore(first, model=model, optimizer=opt)
        assert extra["step"] == 5
        st.save(second, model=model, optimizer=opt)
        return {k: v.clone() for k, v in model.module.state_dict().items()} \
            if hasattr(model, "module") else dict(model.state_dict())

    for state in run_ranks(flat, 3):
        for k in saved:
            assert_close(state[k], saved[k])

    def hier_load(comm: Comm) -> dict[str, torch.Tensor]:
        st = sg.Hierarchical(inner="mirrored", outer="diloco", outer_period=3, comm=comm)
        model = _model()
        model, opt = st.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        st.restore(second, model=model, optimizer=opt)
        return {k: v.clone() for k, v in st.eval_model(model).state_dict().items()}

    for state in run_ranks(hier_load, 4, nnodes=2):
        for k in saved:
            assert_close(state[k], saved[k])


NODE_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK",
             "STRATAGEM_NNODES"]


def _launched_job() -> tuple[list[int], list[int], float, dict[str, str | None]]:
    import os

    import torch.distributed as dist

    st = sg.Hierarchical(inner="mirrored", outer="diloco", outer_period=2)
    model = _model()
    model, opt = st.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mse_steps(st, model, opt, 4, _batch)
    groups = st.comm.node_groups()
    # Sub-groups of the default group are known to torch.distributed (FSDP2's DeviceMesh
    # looks them up).
    intra = dist.get_process_group_ranks(groups.intra.group)
    inter = dist.get_process_group_ranks(groups.inter.group)
    weight = float(st.eval_model(model)[0].weight.sum())
    st.close()
    return intra, inter, weight, {k: os.environ.get(k) for k in NODE_VARS}


@pytest.mark.timeout(180)
def test_hierarchical_in_launched_processes_on_two_simulated_nodes() -> None:
    """Also sg.launch's node simulation: nprocs=4, nnodes=2 is two nodes of two,
    numbered node by node with torchrun's variables (one launch checks both: each costs
    ~15-20 s on this machine)."""
    results = sg.launch(_launched_job, nprocs=4, nnodes=2, timeout=150)
    for rank, r in enumerate(results):
        node, local = divmod(rank, 2)
        assert r[3] == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": "2",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
            "NODE_RANK": str(node), "STRATAGEM_NNODES": "2"}, rank
    # Node 0 holds ranks 0+1, node 1 ranks 2+3; local rank l meets l and l+2 across nodes.
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert len({r[2] for r in results}) == 1
