"""``fit``: same parameters as a custom loop, callbacks, resumption, metrics, progress."""

from __future__ import annotations

import csv
import io
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_states_close, make_data, make_model
from rich.console import Console

import stratagem as sg
import stratagem.fit.reporting as fit_reporting
from stratagem.fit import Callback, EarlyStopping, LearningRateScheduler, ModelCheckpoint, fit
from stratagem.fit.evaluation import evaluate
from stratagem.fit.reporting import mean_staleness, step_info
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(90)

GBS = 32  # 640 samples -> 20 steps per epoch
EVAL = make_data(n=100, seed=7)


def _optimizer(model, kind, lr):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=lr)


def custom_loop(strategy, data, *, epochs, seed=0, lr=0.05, kind="sgd", schedule=None):
    """The README's loop, written by hand; returns the final user-named state dict."""
    with strategy.scope():
        model = make_model(0)
        optimizer = _optimizer(model, kind, lr)
        model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset(data, GBS, shuffle=True, seed=seed)
    for epoch in range(epochs):
        if schedule is not None:
            for group in optimizer.param_groups:
                group["lr"] = schedule(epoch)
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            strategy.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        strategy.reduce("mean", loss)
    return _state(strategy, model)


def _state(strategy, model):
    return {k: v.detach().clone() for k, v in strategy.unwrap(model).state_dict().items()}


def run_fit(strategy, data, *, epochs, seed=0, lr=0.05, kind="sgd", init=0, **kwargs):
    model = make_model(init)
    optimizer = _optimizer(model, kind, lr)
    kwargs.setdefault("progress", False)
    history = fit(strategy, model, optimizer, F.cross_entropy, data, epochs=epochs,
                  global_batch_size=GBS, seed=seed, **kwargs)
    prepared = strategy._prepared[-1].model
    return _state(strategy, prepared), history


# ---------------------------------------------------------------------- equivalence
def test_fit_equals_custom_loop_on_one_device():
    data = make_data()
    reference = custom_loop(sg.OneDevice(), data, epochs=2, seed=5)
    state, history = run_fit(sg.OneDevice(), data, epochs=2, seed=5, eval_dataset=EVAL)
    assert_states_close(state, reference, atol=1e-7, rtol=1e-7)
    assert set(history) >= {"loss", "val_loss", "val_accuracy", "samples_per_second",
                            "comm_mb_per_second", "lr"}
    assert all(len(v) == 2 for v in history.values())
    assert history["comm_mb_per_second"] == [0.0, 0.0]
    assert 0.0 <= history["val_accuracy"][-1] <= 1.0
    assert history["loss"][1] < history["loss"][0]


def test_fit_equals_custom_loop_on_mirrored_two_ranks():
    data = make_data()
    loops = run_ranks(lambda comm: custom_loop(sg.Mirrored(comm=comm), data, epochs=2, seed=5), 2)
    fits = run_ranks(lambda comm: run_fit(sg.Mirrored(comm=comm), data, epochs=2, seed=5,
                                          eval_dataset=EVAL), 2)
    for (state, _), reference in zip(fits, loops, strict=True):
        assert_states_close(state, reference, atol=1e-6, rtol=1e-6)
    (_, h0), (_, h1) = fits
    assert h0 == h1  # every history value is reduced across replicas
    assert all(v > 0 for v in h0["comm_mb_per_second"])
    # Evaluation covers the whole eval set once: same numbers as OneDevice on the same params.
    single = sg.OneDevice()
    model = make_model(0)
    model.load_state_dict(fits[0][0])
    logs = evaluate(single, model, F.cross_entropy, EVAL, 16)
    assert logs["val_loss"] == pytest.approx(h0["val_loss"][-1], rel=1e-5)
    assert logs["val_accuracy"] == pytest.approx(h0["val_accuracy"][-1])


@pytest.mark.parametrize("name", ["local_sgd", "easgd"])
def test_fit_equals_custom_loop_on_periodic_strategies(name):
    data = make_data()

    def build(comm):
        return sg.from_name(name, period=4, comm=comm)

    loops = run_ranks(lambda comm: custom_loop(build(comm), data, epochs=1), 2)
    fits = run_ranks(lambda comm: run_fit(build(comm), data, epochs=1, eval_dataset=EVAL), 2)
    for (state, _), reference in zip(fits, loops, strict=True):
        assert_states_close(state, reference, atol=1e-6, rtol=1e-6)
    assert fits[0][1] == fits[1][1]


def test_strategy_fit_method_and_prepared_inputs_and_accumulation():
    data = make_data()
    reference = custom_loop(sg.OneDevice(accumulation_steps=2), data, epochs=1)
    strategy = sg.OneDevice(accumulation_steps=2)
    with strategy.scope():
        model = make_model(0)
        model, optimizer = strategy.prepare(model, _optimizer(model, "sgd", 0.05))
    history = strategy.fit(model, optimizer, F.cross_entropy, data, epochs=1,
                           global_batch_size=GBS, progress=False)
    assert_states_close(_state(strategy, model), reference, atol=1e-7, rtol=1e-7)
    assert strategy.metrics()["steps"] == 10  # 20 micro-batches, 2 per optimizer step
    assert len(history["loss"]) == 1


def test_fit_rejects_bad_arguments():
    data = make_data()
    strategy = sg.OneDevice()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="epochs must be an int >= 1, got 0"):
        fit(strategy, model, opt, F.cross_entropy, data, epochs=0, global_batch_size=GBS)
    with pytest.raises(TypeError, match="Callback"):
        fit(strategy, model, opt, F.cross_entropy, data, epochs=1, global_batch_size=GBS,
            callbacks=[object()])
    with pytest.raises(TypeError, match=r"\(inputs\.\.\., target\)"):
        fit(strategy, model, opt, F.cross_entropy, (data[0],), epochs=1, global_batch_size=GBS,
            progress=False)
    prepared = sg.OneDevice()
    m2 = prepared.prepare(make_model())
    with pytest.raises(ValueError, match="optimizer is not"):
        fit(prepared, m2, torch.optim.SGD(m2.parameters(), lr=0.1), F.cross_entropy, data,
            epochs=1, global_batch_size=GBS)


# ---------------------------------------------------------------------- callbacks
def test_early_stopping_stops_identically_on_all_ranks():
    data = make_data()

    def job(comm):
        # lr=0: val_loss never improves, so patience=1 stops after the third epoch.
        return run_fit(sg.Mirrored(comm=comm), data, epochs=10, lr=0.0, eval_dataset=EVAL,
                       callbacks=[EarlyStopping("val_loss", patience=1)])[1]

    h0, h1 = run_ranks(job, 2)
    assert len(h0["loss"]) == len(h1["loss"]) == 3
    assert h0 == h1


class _StopOnRank(Callback):
    def __init__(self, rank: int, epoch: int) -> None:
        self.rank, self.epoch = rank, epoch

    def on_epoch_end(self, epoch, logs):
        if self.context.strategy.replica_id == self.rank and epoch == self.epoch:
            self.stop_training = True


def test_stop_requested_on_one_rank_stops_every_rank():
    data = make_data()
    results = run_ranks(lambda comm: run_fit(sg.Mirrored(comm=comm), data, epochs=5,
                                             callbacks=[_StopOnRank(1, 1)])[1], 2)
    assert [len(h["loss"]) for h in results] == [2, 2]


def test_learning_rate_schedule_function_matches_custom_loop():
    data = make_data()

    def schedule(epoch):
        return 0.05 * 0.5**epoch

    reference = custom_loop(sg.OneDevice(), data, epochs=3, schedule=schedule)
    state, history = run_fit(sg.OneDevice(), data, epochs=3,
                             callbacks=[LearningRateScheduler(schedule)])
    assert history["lr"] == pytest.approx([0.05, 0.025, 0.0125])
    assert_states_close(state, reference, atol=1e-7, rtol=1e-7)


def test_learning_rate_schedule_torch_scheduler():
    data = make_data()
    strategy = sg.OneDevice()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    history = fit(strategy, model, opt, F.cross_entropy, data, epochs=4, global_batch_size=GBS,
                  callbacks=[LearningRateScheduler(sched)], progress=False)
    assert history["lr"] == pytest.approx([0.1, 0.1, 0.01, 0.01])
    with pytest.raises(ValueError, match="per_step=True needs a torch LR scheduler"):
        LearningRateScheduler(lambda e: 0.1, per_step=True)


def test_checkpoint_every_epoch_is_written_and_resumes_to_the_same_parameters(tmp_path):
    data = make_data()
    reference, ref_history = run_fit(sg.OneDevice(), data, epochs=3, kind="adam", lr=1e-2,
                                     eval_dataset=EVAL)
    ckpt = tmp_path / "ckpt"
    _, first = run_fit(sg.OneDevice(), data, epochs=1, kind="adam", lr=1e-2, eval_dataset=EVAL,
                       checkpoint_dir=ckpt)
    assert (ckpt / "model.safetensors").is_file() and len(first["loss"]) == 1
    # A fresh process would build a fresh model: a different init proves the restore.
    state, history = run_fit(sg.OneDevice(), data, epochs=3, kind="adam", lr=1e-2, init=9,
                             eval_dataset=EVAL, checkpoint_dir=ckpt)
    assert_states_close(state, reference, atol=1e-6, rtol=1e-6)
    assert history["loss"] == pytest.approx(ref_history["loss"], rel=1e-6)
    assert len(history["val_loss"]) == 3


class _Crash(Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_step_end(self, step, logs):
        if step == self.at_step:
            raise RuntimeError("simulated crash")


class _Nothing(Callback):
    pass


def test_mid_epoch_checkpoint_resumes_at_the_saved_batch(tmp_path):
    data = make_data()
    reference, _ = run_fit(sg.OneDevice(), data, epochs=2, kind="adam", lr=1e-2)
    ckpt = tmp_path / "ckpt"
    every5 = [ModelCheckpoint(every_n_steps=5, every_n_epochs=None)]
    with pytest.raises(RuntimeError, match="simulated crash"):
        # Step 27 = epoch 1, batch 7: the last checkpoint is at batch 5 of epoch 1.
        run_fit(sg.OneDevice(), data, epochs=2, kind="adam", lr=1e-2, checkpoint_dir=ckpt,
                callbacks=[_Crash(27), *every5])
    state, history = run_fit(sg.OneDevice(), data, epochs=2, kind="adam", lr=1e-2, init=9,
                             checkpoint_dir=ckpt,
                             callbacks=[_Nothing(), ModelCheckpoint(every_n_steps=5,
                                                                    every_n_epochs=None)])
    assert_states_close(state, reference, atol=1e-6, rtol=1e-6)
    assert len(history["loss"]) == 2


def test_mirrored_checkpoint_resume(tmp_path):
    data = make_data()
    ckpt = tmp_path / "ckpt"
    reference = run_ranks(lambda comm: run_fit(sg.Mirrored(comm=comm), data, epochs=2)[0], 2)
    run_ranks(lambda comm: run_fit(sg.Mirrored(comm=comm), data, epochs=1,
                                   checkpoint_dir=ckpt), 2)
    resumed = run_ranks(lambda comm: run_fit(sg.Mirrored(comm=comm), data, epochs=2, init=3,
                                             checkpoint_dir=ckpt), 2)
    for state, ref in zip(resumed, reference, strict=True):
        assert_states_close(state[0], ref, atol=1e-6, rtol=1e-6)


def test_resume_from_a_checkpoint_not_written_by_fit_explains(tmp_path):
    strategy = sg.OneDevice()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = strategy.prepare(model, opt)
    strategy.save(tmp_path / "c", model=model, optimizer=opt, step=0)
    with pytest.raises(sg.CheckpointError, match="written by fit"):
        fit(strategy, model, opt, F.cross_entropy, make_data(), epochs=1, global_batch_size=GBS,
            checkpoint_dir=tmp_path / "c", progress=False)


# ---------------------------------------------------------------------- metrics & progress
def test_csv_is_written_by_the_chief_only(tmp_path):
    data = make_data()
    run_ranks(lambda comm: run_fit(sg.Mirrored(comm=comm), data, epochs=2, eval_dataset=EVAL,
                                   metrics_dir=tmp_path), 2)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    for key in ("loss", "val_loss", "val_accuracy", "samples_per_second", "comm_mb_per_second"):
        assert math.isfinite(float(rows[-1][key]))


def test_tensorboard_is_used_when_importable(tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def flush(self):
            pass

        def close(self):
            scalars.append(("closed", -1))

    monkeypatch.setattr(fit_reporting, "_summary_writer_class", lambda: FakeWriter)
    run_fit(sg.OneDevice(), make_data(), epochs=1, metrics_dir=tmp_path)
    tags = {t for t, _ in scalars}
    assert {"train/loss", "epoch/loss", "closed"} <= tags


def test_progress_bar_does_not_crash_without_a_terminal(capsys):
    run_fit(sg.OneDevice(), make_data(), epochs=1, progress=True)  # pytest captures: no TTY
    plain = io.StringIO()
    run_fit(sg.OneDevice(), make_data(), epochs=2, progress=Console(file=plain, width=120))
    assert plain.getvalue().count("epoch ") == 2 and "samples_per_second" in plain.getvalue()
    live = io.StringIO()
    run_fit(sg.OneDevice(precision="fp16", on_nonfinite="skip"), make_data(), epochs=1,
            progress=Console(file=live, force_terminal=True, width=160))
    assert "epoch 1/1" in live.getvalue()


def test_step_info_shows_loss_scale_and_staleness():
    text = step_info(0.5, 1000.0, 2.5, {"loss_scale": 1024.0,
                                                "staleness": {0: 2, 2: 2}}, True)
    assert "loss 0.5000" in text and "scale 1024" in text and "staleness 1.0" in text
    assert mean_staleness([1, 0, 3]) == pytest.approx(1.5)
    assert "scale" not in step_info(0.5, 1.0, 0.0, {"loss_scale": 1.0}, False)
