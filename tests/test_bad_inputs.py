"""The bad-input matrix: each fault raises the named exception with the constraint,
the value and the fix, within a bound, and nothing hangs. Cases already tested elsewhere are
only referenced here (see docs/reliability.md for the whole matrix and measured times):

- non-divisible global batch: test_data.py::test_non_divisible_global_batch_names_both_numbers
- dataset smaller than the replicas: test_data.py::test_dataset_smaller_than_replicas_raises_...
- mismatched models: test_core.py::test_mismatched_models_raise_naming_parameter_and_ranks,
  test_core.py::test_dtype_mismatch_is_named
- shape drift in reduce: test_core.py::test_reduce_shape_drift_raises_on_every_replica
- non-contiguous tensors in reduce (accepted): test_core.py::test_reduce_non_contiguous_tensor
- non-finite gradient without a scaler: test_precision.py::test_nonfinite_gradient_raises_...
- wrong token, oversize message, pickle payload, random bytes: ps/test_security.py
- unreachable / silent shard (client level): ps/test_faults.py
- zero or negative period, moving_rate outside (0, 1]: test_elastic_average.py and
  test_local_sgd.py ::test_invalid_arguments_name_the_value
- malicious checkpoint / safetensors header / pickle in a .pt: test_checkpoint.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import make_data, make_model

import stratagem as sg
from stratagem import cli
from stratagem.testing import run_ranks

pytestmark = pytest.mark.timeout(60)
SRC = str(Path(cli.__file__).resolve().parent.parent)


def test_empty_shard_is_refused_before_any_collective() -> None:
    # CPU time of this thread, not wall time: "refused at once, without work" must not depend
    # on how loaded the machine is.
    t0 = time.thread_time()
    with pytest.raises(ValueError, match="holds 10 samples, less than one global batch of 16.*"
                                         "drop_remainder=False"):
        sg.OneDevice().distribute_dataset(make_data(10), 16, drop_remainder=True)
    assert time.thread_time() - t0 < 0.5


def test_dtype_drift_in_reduce_raises_on_every_replica() -> None:
    def fn(comm):
        s = sg.Mirrored(comm=comm)
        value = torch.ones(3, dtype=torch.float32 if comm.rank == 0 else torch.float64)
        try:
            s.reduce("sum", value)
        except sg.ReplicaMismatchError as exc:
            return str(exc)
        return "no error"

    # Raised on every replica at once (~0.1 s), not after a rank hangs in a collective for the
    # 30 s comm timeout: the bound is the midpoint, far from both on a loaded machine.
    t0 = time.perf_counter()
    messages = run_ranks(fn, 2, comm_timeout=30.0)
    assert time.perf_counter() - t0 < 15
    for m in messages:
        assert "torch.float32" in m and "torch.float64" in m and "rank 1" in m and "Fix" in m


def test_failing_checkpoint_write_raises_everywhere_and_keeps_the_previous(tmp_path, monkeypatch
                                                                           ) -> None:
    import stratagem.checkpoint.storage as storage

    def fn(comm, fail):
        s = sg.Mirrored(comm=comm)
        model = s.prepare(make_model())
        if not fail:
            s.save(tmp_path / "ck", model=model, step=1)
            return "saved"
        try:
            s.save(tmp_path / "ck", model=model, step=2)
        except sg.CheckpointError as exc:
            return str(exc)
        return "no error"

    assert run_ranks(fn, 2, args=(False,)) == ["saved", "saved"]
    real = storage._fsync_write

    def disk_full(path: Path, data: bytes) -> str:
        if path.name == "rng.rank1.safetensors":
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(storage, "_fsync_write", disk_full)
    messages = run_ranks(fn, 2, args=(True,))
    assert "No space left" in messages[0] and "rank 0" in messages[1]
    monkeypatch.undo()
    s = sg.OneDevice()
    assert s.restore(tmp_path / "ck", model=s.prepare(make_model()))["step"] == 1


def test_unreachable_parameter_server_at_prepare() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: refused
    # prepare waits up to the timeout for shards that may start after the workers, then
    # raises: with 5 s of slack (load delays the wake-up, it cannot shorten the wait), far
    # below the test's 60 s guard that a wait without a deadline would meet.
    s = sg.ElasticAveraging(mode="async", moving_rate=0.5, ps_addresses=dead,
                            comm=sg.Comm.single(), timeout=2)
    t0 = time.perf_counter()
    with pytest.raises(sg.ParameterServerUnavailable, match=dead) as info:
        s.prepare(make_model())
    assert time.perf_counter() - t0 < 2 + 5
    # The message names the whole wait, not the last short attempt's deadline.
    assert "did not answer within 2 s of waiting" in str(info.value)
    assert info.value.address == dead
    s.close()


def test_parameter_server_port_in_use() -> None:
    from stratagem.ps.server import ShardServer

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{port}"):
            ShardServer("127.0.0.1", port).start()
        # Refused at the bind, not at the shard's 60 s start-up limit.
        assert time.perf_counter() - t0 < 10


def _stratagem(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "stratagem.cli", *args], env=env,
                          capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(120)
def test_launcher_port_in_use_and_unknown_strategy_name(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("import stratagem as sg\nsg.from_env()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = _stratagem("run", "--nproc", "1", "--master-port", str(port), str(script))
    assert r.returncode != 0 and "EADDRINUSE" in r.stderr and str(port) in r.stderr
    r = _stratagem("run", "--nproc", "1", "--strategy", "Nope", str(script))
    assert r.returncode != 0
    assert "unknown strategy 'Nope'; valid names:" in r.stderr, r.stderr[-2000:]
