"""ParameterServer under real process failures: a SIGKILLed worker leaves the shard and the
other workers running and a restarted worker starts from the current parameters; a dead shard
surfaces as ParameterServerUnavailable naming its address within the deadline."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import make_data, make_model

from stratagem.comm import Comm
from stratagem.errors import ParameterServerUnavailable
from stratagem.launcher import PSShards, child_pythonpath, start_ps_shards
from stratagem.ps.client import PSClient
from stratagem.strategies.parameter_server import ParameterServer

TESTS = str(Path(__file__).resolve().parent)

# One async worker as its own process, with no process group shared with the others (async
# training needs no collective): argv = index, steps, out file, progress file, step delay.
WORKER = textwrap.dedent("""
    import json, sys, time
    import torch, torch.nn.functional as F
    sys.path.insert(0, {tests!r})
    from helpers import make_data, make_model
    from stratagem.comm import Comm
    from stratagem.strategies.parameter_server import ParameterServer

    index, steps, out, progress, delay = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                          sys.argv[4], float(sys.argv[5]))
    torch.manual_seed(index)
    s = ParameterServer(mode="async", comm=Comm.single(), timeout=20)
    with s.scope():
        model = make_model(seed=100 + index)  # the shards' values win over this init
        model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    start = {{k: v.detach().clone().tolist() for k, v in model.state_dict().items()}}
    start_version = s.global_version
    x, y = make_data(seed=index + 1)
    losses = []
    for step in range(steps):
        i = (step * 32) % 640
        loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        s.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        with open(progress, "w") as f:
            f.write(str(step + 1))
        time.sleep(delay)
    m = s.metrics()
    s.close()
    with open(out, "w") as f:
        json.dump({{"start": start, "start_version": start_version, "losses": losses,
                    "staleness": {{str(k): v for k, v in m["staleness"].items()}},
                    "pushes": m["pushes"]}}, f)
""")


def _spawn(script: Path, args: list[str], shards: PSShards) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "STRATAGEM_PS_TOKEN"):
        env.pop(k, None)
    env.update(shards.env())  # addresses and the job's token file
    env["PYTHONPATH"] = child_pythonpath(env)
    return subprocess.Popen([sys.executable, str(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out.decode(errors="replace")


def _shard_state(shards: PSShards) -> tuple[dict[str, torch.Tensor], int]:
    from stratagem.ps.client import ShardedParameters

    with PSClient(shards.addresses, token=shards.token, timeout=10) as client:
        table = ShardedParameters(client, dict(make_model().named_parameters()), mode="elastic")
        values = table.pull()
        return values, min(table.versions.values())


@pytest.mark.timeout(180)
def test_killed_worker_leaves_shard_and_others_running_and_restart_pulls_first(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=TESTS))
    with start_ps_shards(1) as shards:
        addrs = shards.addresses
        procs = []
        for i in range(3):
            # Worker 1 is slow so it is surely still training when it is killed.
            delay = "0.2" if i == 1 else "0.01"
            procs.append(_spawn(script, [str(i), "60", str(tmp_path / f"out{i}.json"),
                                         str(tmp_path / f"progress{i}"), delay], shards))
        progress = tmp_path / "progress1"
        deadline = time.monotonic() + 90
        while not (progress.exists() and progress.read_text().strip() not in ("", "1", "2")):
            assert procs[1].poll() is None, _wait(procs[1], 10)
            assert time.monotonic() < deadline, "worker 1 never got going"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        assert procs[1].wait(10) == -signal.SIGKILL
        for i in (0, 2):
            out = _wait(procs[i], 120)
            assert procs[i].returncode == 0, out
        assert all(p.poll() is None for p in shards.procs)
        survivors = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in (0, 2)]
        assert all(len(r["losses"]) == 60 and r["pushes"] == 60 for r in survivors)
        assert all(sum(r["losses"][-10:]) < sum(r["losses"][:10]) for r in survivors)

        # Restart worker 1 with the shard quiescent: it must hold the shard's current values
        # (and version) before its first push, which is therefore not stale.
        values, version = _shard_state(shards)
        assert version >= 120
        restart = _spawn(script, ["1", "3", str(tmp_path / "out1b.json"),
                                  str(tmp_path / "progress1b"), "0"], shards)
        out = _wait(restart, 120)
        assert restart.returncode == 0, out
        again = json.loads((tmp_path / "out1b.json").read_text())
        assert again["start_version"] == version
        for k, v in values.items():
            torch.testing.assert_close(torch.tensor(again["start"][k]), v, atol=0, rtol=0)
        # Its first push was computed on those values (later ones are one fetch behind:
        # prefetch), so nothing it pushed was stale beyond that.
        assert again["staleness"].get("0", 0) >= 1 and set(again["staleness"]) <= {"0", "1"}
        with PSClient(addrs, token=shards.token, timeout=10) as client:
            assert client.health()[0]["ok"]


@pytest.mark.timeout(60)
def test_dead_shard_raises_naming_its_address_within_the_deadline(monkeypatch):
    with start_ps_shards(1) as shards:
        addr = shards.addresses[0]
        for k, v in shards.env().items():  # addresses and the job's token file
            monkeypatch.setenv(k, v)
        s = ParameterServer(mode="async", ps_addresses=shards.addresses, comm=Comm.single(),
                            timeout=2.0)
        with s.scope():
            model = make_model()
            model, opt = s.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = make_data()

        def step(i: int) -> None:
            s.backward(F.cross_entropy(model(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8]))
            opt.step()
            opt.zero_grad()

        for i in range(3):
            step(i)
        os.kill(shards.procs[0].pid, signal.SIGKILL)
        shards.procs[0].wait(10)
        t0 = time.monotonic()
        with pytest.raises(ParameterServerUnavailable, match=re.escape(addr)) as info:
            for i in range(3, 10):  # with prefetch the error surfaces at the next install
                step(i)
        assert time.monotonic() - t0 < 2.0 + 1.5
        assert info.value.address == addr
        s.close()
