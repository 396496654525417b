"""Mirrored: gradient compression (fp16/bf16, error feedback), sparse gradients, and fp16
precision together with compression."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_states_close, make_data, make_model, train
from torch import nn

import stratagem as sg
from stratagem.compression import ErrorFeedback, compress, decompress
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- compression helper
def test_compress_roundtrip_and_fp16_overflow_is_inf():
    t = torch.tensor([1.0, -2.5, 1e5, 1e-9])
    payload, ctx = compress(t, "fp16")
    assert payload.dtype == torch.float16 and payload.element_size() == 2
    back = decompress(payload, ctx)
    assert back.dtype == torch.float32
    assert back[0] == 1.0 and back[1] == -2.5
    assert torch.isinf(back[2])  # beyond 65504: inf, never a silent clamp
    assert back[3] == 0.0  # below fp16's smallest subnormal
    assert torch.isfinite(decompress(*compress(t, "bf16"))).all()  # bf16 has fp32's range
    with pytest.raises(ValueError, match="compression must be one of"):
        compress(t, "int8")


def test_error_feedback_carries_what_the_cast_lost_and_drops_inf():
    ef = ErrorFeedback("fp16")
    tiny = torch.full((3,), 1e-8)  # below fp16's smallest subnormal (~6e-8): cast to 0
    sent = torch.zeros(3)
    for _ in range(100):
        payload, ctx = ef.compress("g", tiny)
        sent += decompress(payload, ctx)
    # Everything is delivered eventually: sent + residual == 100 * tiny.
    torch.testing.assert_close(sent + ef.residual("g"), 100 * tiny, rtol=1e-5, atol=0)
    assert sent.sum() > 0
    assert ErrorFeedback("fp16").compress("g", tiny)[0].abs().sum() == 0
    ef.compress("g", torch.tensor([1e6, 0.0, 0.0]))
    assert ef.residual("g") is None  # an overflow's residual is never carried


def test_error_feedback_deferred_commit_and_discard():
    ef = ErrorFeedback("bf16", deferred=True)
    g = torch.tensor([1.0 + 2**-10])  # bf16 keeps 8 bits: the 2**-10 is lost
    ef.compress("k", g)
    assert ef.residual("k") is None
    ef.discard()  # the step was skipped
    ef.compress("k", g)
    ef.commit()
    torch.testing.assert_close(ef.residual("k"), torch.tensor([2**-10]))


# ---------------------------------------------------------------------- Mirrored + compression
def _bytes_per_step(comm, **kwargs):
    data = make_data()
    strategy = sg.Mirrored(comm=comm, **kwargs)
    model = make_model()
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = strategy.metrics()["bytes_sent"]
    x, y = data[0][:16], data[1][:16]
    for _ in range(5):
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return (strategy.metrics()["bytes_sent"] - before) / 5


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_compression_halves_bytes(kind, error_feedback):
    plain = run_ranks(lambda comm: _bytes_per_step(comm), 2)
    packed = run_ranks(lambda comm: _bytes_per_step(comm, compression=kind,
                                                    error_feedback=error_feedback), 2)
    ratio = packed[0] / plain[0]
    print(f"{kind} (error_feedback={error_feedback}): {packed[0]:.0f} / {plain[0]:.0f} "
          f"bytes sent per step = {ratio:.4f}")
    assert ratio == pytest.approx(0.5, rel=0.01)
    assert packed[0] == packed[1]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_compressed_training_stays_close_to_uncompressed(kind, error_feedback):
    data = make_data()
    ref = run_ranks(lambda comm: train(sg.Mirrored(comm=comm), data, steps=40, lr=0.2), 2)
    got = run_ranks(lambda comm: train(sg.Mirrored(comm=comm, compression=kind,
                                                   error_feedback=error_feedback),
                                       data, steps=40, lr=0.2), 2)
    assert_states_close(got[0][0], got[1][0], atol=0, rtol=0)  # replicas stay identical
    tol = 2e-3 if kind == "fp16" else 2e-2  # 11 vs 8 significant bits
    assert_states_close(got[0][0], ref[0][0], atol=tol, rtol=tol)
    X, Y = data
    losses = []
    for state in (ref[0][0], got[0][0]):
        model = make_model()
        model.load_state_dict(state)
        losses.append(F.cross_entropy(model(X), Y).item())
    assert losses[1] == pytest.approx(losses[0], rel=0.02)


class _Scalar(nn.Module):
    """loss = sum(w * c): the gradient of w is exactly c."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


@pytest.mark.parametrize("error_feedback", [False, True])
def test_error_feedback_moves_parameter_with_sub_resolution_gradient(error_feedback):
    """A gradient of 1e-8 (5e-9 per replica after the 1/world scaling) is below fp16's
    smallest subnormal: without error feedback the cast sends 0 forever; with it the residual
    builds up until it is sent, and on average the full gradient arrives."""

    def job(comm):
        s = sg.Mirrored(comm=comm, compression="fp16", error_feedback=error_feedback)
        model = _Scalar()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
        c = torch.full((4,), 1e-8)
        for _ in range(120):
            s.backward(model(c))
            opt.step()
            opt.zero_grad()
        return s.unwrap(model).w.detach().clone(), s.metrics()

    (w0, m0), (w1, _) = run_ranks(job, 2)
    torch.testing.assert_close(w0, w1, atol=0, rtol=0)
    if error_feedback:
        # 120 steps of lr * 1e-8, minus at most one pending residual per replica (< 6e-8).
        torch.testing.assert_close(w0, torch.full((4,), -120e-8), rtol=0, atol=1.3e-7)
        assert m0["error_feedback_norm"] > 0
    else:
        assert torch.equal(w0, torch.zeros(4))


def test_fp16_compression_overflow_is_caught_on_every_replica():
    """fp32 training, fp16 wire: a gradient beyond 65504 on one replica must not be silently
    clamped: it becomes inf in the all-reduce and every replica skips the step."""
    X, Y = make_data()

    def job(comm, compression):
        s = sg.Mirrored(comm=comm, compression=compression, on_nonfinite="skip")
        model = make_model()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-9))
        for step in range(3):
            loss = F.cross_entropy(model(X[:8]), Y[:8])
            if step == 1 and comm.rank == 1:
                loss = loss * 1e7  # gradients ~1e6: finite in fp32, inf in fp16
            s.backward(loss)
            opt.step()
            opt.zero_grad()
        return s.metrics()["skipped_steps"], s.unwrap(model).state_dict()

    compressed = run_ranks(job, 2, args=("fp16",))
    assert [c[0] for c in compressed] == [1, 1]
    assert_states_close(compressed[0][1], compressed[1][1], atol=0, rtol=0)
    assert [c[0] for c in run_ranks(job, 2, args=(None,))] == [0, 0]  # fp32 wire: finite


@pytest.mark.parametrize("error_feedback", [False, True])
def test_fp16_precision_with_compression_skips_consistently(error_feedback):
    X, Y = make_data()

    def job(comm):
        s = sg.Mirrored(comm=comm, precision="fp16", compression="fp16",
                        error_feedback=error_feedback, growth_interval=100, init_scale=1024.0)
        model = make_model()
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        scales = []
        for step in range(1, 6):
            x, y = X[step * 8:(step + 1) * 8], Y[step * 8:(step + 1) * 8]
            loss = F.cross_entropy(model(x), y)
            before = {k: v.clone() for k, v in s.unwrap(model).state_dict().items()}
            if step == 3 and comm.rank == 1:
                loss = loss * float("inf")  # only this replica, before the all-reduce
            s.backward(loss)
            opt.step()
            opt.zero_grad()
            scales.append(s.metrics()["loss_scale"])
            if step == 3:
                assert_states_close(s.unwrap(model).state_dict(), before, atol=0, rtol=0)
        return scales, s.metrics(), s.unwrap(model).state_dict()

    (sc0, m0, st0), (sc1, m1, st1) = run_ranks(job, 2)
    assert sc0 == sc1 == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert m0["skipped_steps"] == m1["skipped_steps"] == 1
    assert m0["steps"] == 4
    assert_states_close(st0, st1, atol=0, rtol=0)
    if error_feedback:
        # Finite: the inf step's residual was dropped, not carried. (It may be exactly 0: fp16
        # autocast makes the weight gradients fp16 values already, which the cast keeps.)
        assert 0 <= m0["error_feedback_norm"] < 1.0


def test_error_feedback_requires_compression():
    with pytest.raises(ValueError, match="error_feedback=True needs a lossy compression"):
        sg.Mirrored(error_feedback=True)


# ---------------------------------------------------------------------- sparse gradients
class _EmbeddingNet(nn.Module):
    def __init__(self, sparse: bool, rows: int = 5000, dim: int = 16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(rows, dim, sparse=sparse)
        self.head = nn.Linear(dim, 3)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(rows, dim, generator=gen) * 0.3)
            self.head.weight.copy_(torch.randn(3, dim, generator=gen) * 0.3)
            self.head.bias.zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).mean(dim=1))


def _sparse_data(n: int = 512, rows: int = 5000, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    # A popular head of rows shared by replicas (rows repeat across them) and a long tail.
    idx = torch.where(torch.rand(n, 4, generator=gen) < 0.5,
                      torch.randint(0, 20, (n, 4), generator=gen),
                      torch.randint(0, rows, (n, 4), generator=gen))
    return idx, torch.randint(0, 3, (n,), generator=gen)


def _train_embedding(strategy, sparse, steps=12, gbs=32):
    data = _sparse_data()
    with strategy.scope():
        model = _EmbeddingNet(sparse)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(data, gbs, shuffle=False)
    start_bytes = strategy.metrics()["bytes_sent"]  # prepare's broadcast is not a step
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    module = strategy.unwrap(model)
    metrics = strategy.metrics()
    metrics["step_bytes_sent"] = metrics["bytes_sent"] - start_bytes
    return ({k: v.detach().clone() for k, v in module.state_dict().items()},
            metrics, module.emb.weight.grad)


def test_sparse_embedding_matches_one_device_and_saves_bytes():
    reference, _, _ = _train_embedding(sg.OneDevice(), sparse=True)
    sparse = run_ranks(lambda comm: _train_embedding(sg.Mirrored(comm=comm), True), 2)
    dense = run_ranks(lambda comm: _train_embedding(sg.Mirrored(comm=comm), False), 2)
    for state, metrics, _ in sparse:
        assert_states_close(state, reference, atol=1e-5, rtol=1e-5)
        assert metrics["steps"] == 12
    assert_states_close(dense[0][0], reference, atol=1e-5, rtol=1e-5)
    sparse_bytes = sparse[0][1]["step_bytes_sent"]
    dense_bytes = dense[0][1]["step_bytes_sent"]
    print(f"sparse embedding: {sparse_bytes / 12:,.0f} bytes sent per step; dense: "
          f"{dense_bytes / 12:,.0f}; ratio {sparse_bytes / dense_bytes:.4f}")
    assert 0 < sparse_bytes < 0.05 * dense_bytes


def test_sparse_gradient_stays_sparse_after_the_allreduce():
    def job(comm):
        s = sg.Mirrored(comm=comm)
        model = _EmbeddingNet(sparse=True)
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        idx = torch.tensor([[comm.rank * 7, 3, 3, 11]])
        s.backward(model(idx).sum())
        grad = s.unwrap(model).emb.weight.grad
        rows = sorted(grad.coalesce().indices()[0].tolist())
        return grad.layout, rows

    for layout, rows in run_ranks(job, 2):
        assert layout == torch.sparse_coo
        assert rows == [0, 3, 7, 11]  # the union of both replicas' rows, not all 5000


def test_sparse_embedding_with_compression_and_accumulation():
    """Sparse buckets go uncompressed while dense ones are cast; accumulation over micro
    batches sums the sparse gradients before the one all-reduce."""
    reference, _, _ = _train_embedding(sg.OneDevice(), sparse=True, steps=6, gbs=32)

    def job(comm):
        return _train_embedding(sg.Mirrored(comm=comm, compression="bf16",
                                            accumulation_steps=2), True, steps=12, gbs=16)

    for state, metrics, _ in run_ranks(job, 2):
        assert metrics["steps"] == 6
        assert_states_close(state, reference, atol=2e-2, rtol=2e-2)
        # The embedding took no cast: its rows are exact up to fp32 summation order.
        torch.testing.assert_close(state["emb.weight"], reference["emb.weight"],
                                   atol=1e-2, rtol=1e-2)
