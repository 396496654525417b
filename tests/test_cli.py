"""The ``stratagem`` CLI: argument handling in-process, ``run`` / ``ps`` as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem import cli

SRC = str(Path(cli.__file__).resolve().parent.parent)

ALLREDUCE_SCRIPT = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
line = json.dumps({"rank": dist.get_rank(), "sum": t.item(), "argv": sys.argv[1:],
                  "strategy": os.environ.get("STRATAGEM_STRATEGY"),
                  "strategy_args": os.environ.get("STRATAGEM_STRATEGY_ARGS"),
                  "ps": os.environ.get("STRATAGEM_PS_ADDRS")})
os.write(1, (line + "\\n").encode())  # one write: the ranks share stdout and must not interleave
dist.destroy_process_group()
"""

FAILING_SCRIPT = """
import os
if os.environ["RANK"] == "1":
    raise ValueError("script failed on purpose")
"""

HANGING_SCRIPT = """
import os, sys, time
open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(600)
"""


def _stratagem(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "stratagem.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


# ----------------------------------------------------------------- in-process


def test_python_dash_m_stratagem_is_the_command() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "stratagem", "run", "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: stratagem run" in r.stdout, r.stderr


def test_torchrun_command_single_and_multi_node() -> None:
    parser = cli.build_parser()
    single = cli.torchrun_command(parser.parse_args(
        ["run", "--nproc", "2", "--max-restarts", "1", "train.py", "--lr", "0.1"]))
    # Single node: torchrun with a loopback-only agent store.
    assert single[1:5] == ["-m", "stratagem._torchrun", "--nproc-per-node", "2"]
    assert single[-3:] == ["train.py", "--lr", "0.1"]
    i = single.index("--master-port")
    assert int(single[i + 1]) > 0 and "--standalone" not in single
    assert single[single.index("--nnodes") + 1] == "1"
    assert single[single.index("--max-restarts") + 1] == "1"
    multi = cli.torchrun_command(parser.parse_args(
        ["run", "--nproc", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
         "--master-port", "29500", "-m", "pkg.train"]))
    assert multi[3:] == ["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                         "--master-addr", "10.0.0.1", "--master-port", "29500", "--module",
                         "pkg.train"]


def test_strategy_args_are_typed() -> None:
    assert cli.parse_strategy_args(["period=4", "lr=0.5", "mode=sync", "nesterov=True",
                                    "max_staleness=none", "name=a=b"]) == {
        "period": 4, "lr": 0.5, "mode": "sync", "nesterov": True, "max_staleness": None,
        "name": "a=b"}
    with pytest.raises(ValueError, match=r"key=value.*got 'period'.*period=4"):
        cli.parse_strategy_args(["period"])


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", "--nproc", "0", "train.py"], ["frobnicate"], [],
                 ["run", "--nproc", "2", "--nnodes", "3:2", "train.py"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2, argv
    err = capsys.readouterr().err
    assert "--nproc: must be >= 1, got 0" in err and "--nproc 2" in err
    assert "invalid choice: 'frobnicate'" in err
    assert cli.main(["run", "--nproc", "1", "--strategy-arg", "period=4", "x.py"]) == 2
    assert "--strategy-arg needs --strategy NAME" in capsys.readouterr().err
    assert cli.main(["ps", "--port", "0", "--tls-cert", "c.pem"]) == 2
    assert "needs both --tls-cert and --tls-key" in capsys.readouterr().err


def test_missing_module_subcommand_explains_and_exits_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._delegate("demo", "stratagem._no_such_module")(["--quick"]) == 2
    assert "stratagem demo: cannot import stratagem._no_such_module" in capsys.readouterr().err
    called: list[list[str]] = []

    @cli.subcommand("_echo", "test-only", passthrough=True)
    def _echo(argv: list[str]) -> int:
        called.append(argv)
        return 0

    try:
        assert cli.main(["_echo", "--help", "x"]) == 0 and called == [["--help", "x"]]
    finally:
        del cli._COMMANDS["_echo"]


# ----------------------------------------------------------------- real processes


@pytest.mark.timeout(90)
def test_run_two_workers_with_strategy_env(tmp_path: Path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_SCRIPT)
    r = _stratagem("run", "--nproc", "2", "--strategy", "LocalSGD", "--strategy-arg", "period=4",
                   "--strategy-arg", "warmup_steps=0", "--strategy-arg", "precision=bf16",
                   str(script), "hello", "--flag")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert sorted(x["rank"] for x in lines) == [0, 1], r.stdout
    for x in lines:
        assert x["sum"] == 3.0 and x["argv"] == ["hello", "--flag"]
        assert x["strategy"] == "LocalSGD" and x["ps"] is None
        assert json.loads(x["strategy_args"]) == {"period": 4, "warmup_steps": 0,
                                                  "precision": "bf16"}


@pytest.mark.timeout(90)
def test_run_propagates_a_failing_script(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    r = _stratagem("run", "--nproc", "2", str(script))
    assert r.returncode != 0
    assert "script failed on purpose" in r.stderr


@pytest.mark.timeout(90)
def test_sigterm_is_forwarded_and_leaves_no_orphans(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANGING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "stratagem.cli", "run", "--nproc", "2",
                             str(script), str(tmp_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                (tmp_path / f"pid{r}").exists() for r in range(2)):
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=45)
        assert code != 0 and time.monotonic() - t0 < 40
        assert not any(_alive(p) for p in pids), pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.timeout(90)
def test_run_with_ps_shards_and_ps_subcommand(tmp_path: Path) -> None:
    pytest.importorskip("stratagem.ps.server",
                        reason="stratagem.ps.server (the shard process) is not written yet")
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_SCRIPT)
    r = _stratagem("run", "--nproc", "1", "--num-ps", "2", str(script))
    assert r.returncode == 0, r.stderr
    (line,) = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(line["ps"].split(",")) == 2

    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "stratagem.cli", "ps", "--host", "127.0.0.1",
                             "--port", "0", "--port-file", str(port_file)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert int(port_file.read_text()) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
