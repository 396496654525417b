"""Errors before launch, once: a strategy's arguments are checked by name in
``sg.from_name`` and built once, without joining anything, before ``stratagem run`` or
``sg.launch`` start a worker; a job whose workers all raise prints the exception once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import stratagem as sg
from stratagem import _worker
from stratagem._argcheck import ConfigComm, check_launch_env, check_strategy, cli_problem
from stratagem._argnames import accepted_arguments, class_arguments, source_arguments
from stratagem.registry import STRATEGIES, check_argument_names_early, strategy_class

SRC = str(Path(sg.__file__).resolve().parent.parent)

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------- by name, in process


def test_unknown_argument_names_the_nearest_and_every_valid_one():
    with pytest.raises(TypeError) as info:
        sg.from_name("localsgd", perod=4, comm=sg.Comm.single())
    text = str(info.value)
    assert "\n" not in text
    assert "LocalSGD (local_sgd) has no argument 'perod'; did you mean period?" in text
    assert "Valid arguments: period, warmup_steps, compression, precision," in text
    # No close name: no guess, still the list.
    with pytest.raises(TypeError, match=r"has no argument 'xyzzy'\. Valid arguments: period"):
        sg.from_name("local_sgd", xyzzy=1)
    # A preset row checks against its class (eamsgd is ElasticAveraging).
    with pytest.raises(TypeError, match="ElasticAveraging \\(eamsgd\\) has no argument "
                                        "'momentun'; did you mean momentum?"):
        sg.from_name("eamsgd", momentun=0.5)


def test_bad_values_raise_the_strategys_own_error():
    with pytest.raises(ValueError, match="period must be an int >= 1, got 0"):
        sg.from_name("local_sgd", period=0, comm=sg.Comm.single())
    with pytest.raises(ValueError, match="period must be an int >= 1, got 'abc'"):
        sg.from_name("local_sgd", period="abc", comm=sg.Comm.single())


def test_hierarchical_prefixed_arguments_are_checked_against_the_named_strategy():
    with pytest.raises(TypeError, match="Hierarchical \\(hierarchical\\) with outer='diloco' "
                                        "has no argument 'outer_perod'; did you mean "
                                        "outer_period?"):
        sg.from_name("hierarchical", outer_perod=4)
    with pytest.raises(TypeError, match="outer='local_sgd' has no argument 'outer_warmup'; "
                                        "did you mean outer_warmup_steps?"):
        sg.from_name("hierarchical", outer="localsgd", outer_warmup=4)
    with pytest.raises(TypeError, match="Hierarchical \\(hierarchical\\) has no argument "
                                        "'perod'"):
        sg.from_name("hierarchical", perod=4)
    strategy = sg.from_name("hierarchical", outer_period=4, inner_bucket_cap_mb=1,
                            comm=sg.Comm.single())
    assert strategy.outer.period == 4


def test_accepted_arguments_walk_up_while_kwargs_are_passed_on():
    names = accepted_arguments(sg.Mirrored)
    assert names[0] == "bucket_cap_mb" and {"precision", "timeout", "comm"} <= set(names)
    assert "inner" in accepted_arguments(sg.Hierarchical)


# ----------------------------------------------------------------- built before launch


def test_check_builds_without_joining_a_process_group(monkeypatch):
    # The launching process's environment could even describe a job: nothing joins it.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    started = time.monotonic()
    for name in ("mirrored", "local_sgd", "diloco", "easgd", "hierarchical"):
        check_strategy(name, {}, world_size=2)
    assert not dist.is_initialized() and time.monotonic() - started < 5


def test_check_uses_the_jobs_world_size():
    # EASGD's default moving rate beta / (period * workers) depends on the worker count.
    check_strategy("easgd", {"beta": 1.5, "period": 1}, world_size=2)
    with pytest.raises(ValueError, match=r"= 1\.5 / \(1 \* 1\) = 1\.5 is above 1"):
        check_strategy("easgd", {"beta": 1.5, "period": 1}, world_size=1)
    comm = ConfigComm(4, 2)
    assert (comm.world_size, comm.local_world_size, comm.group) == (4, 2, None)


def test_check_stands_in_for_shards_the_launcher_will_start(monkeypatch):
    monkeypatch.delenv("STRATAGEM_PS_ADDRS", raising=False)
    check_strategy("ps-async", {"max_staleness": 2}, world_size=2, num_ps=1)
    assert "STRATAGEM_PS_ADDRS" not in os.environ
    with pytest.raises(ValueError, match="STRATAGEM_PS_ADDRS=''"):
        check_strategy("ps-async", {}, world_size=2)  # no shards anywhere: say so now
    assert cli_problem("ps-sync", {"max_staleness": 2}, world_size=2, num_ps=1) == (
        "--strategy/--strategy-arg: ValueError: max_staleness applies to mode='async' (sync "
        "mode drops every late gradient), got max_staleness=2. Fix: drop it")
    with pytest.raises(TypeError, match="comm= cannot come from the command line"):
        check_strategy("mirrored", {"comm": "x"}, world_size=2)


def test_launch_raises_before_starting_any_worker(tmp_path):
    env = {"STRATAGEM_STRATEGY": "localsgd", "STRATAGEM_STRATEGY_ARGS": '{"perod": 4}'}
    with pytest.raises(TypeError, match="did you mean period"):
        check_launch_env(env, world_size=2)
    started = time.monotonic()
    with pytest.raises(TypeError, match="has no argument 'perod'; did you mean period"):
        sg.launch(_touch, nprocs=2, args=(str(tmp_path),), env=env)
    assert time.monotonic() - started < 5 and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="STRATAGEM_STRATEGY_ARGS must be a JSON object"):
        check_launch_env({"STRATAGEM_STRATEGY": "mirrored", "STRATAGEM_STRATEGY_ARGS": "[1]"},
                         world_size=2)
    check_launch_env({}, world_size=2)  # no strategy named: nothing to check


def _touch(directory: str) -> None:  # pragma: no cover - must never run
    Path(directory, str(os.getpid())).touch()


def _stratagem(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": SRC}
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "stratagem.cli", *args], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=110)
    return r, time.monotonic() - started


def test_run_misspelt_strategy_arg_exits_2_at_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("open('started', 'w').close()\n")
    r, seconds = _stratagem("run", "--nproc", "2", "--strategy", "localsgd", "--strategy-arg",
                            "perod=4", str(script), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("stratagem run: error: --strategy/--strategy-arg: TypeError: "
                               "LocalSGD (local_sgd) has no argument 'perod'; did you mean "
                               "period? Valid arguments: period, ")
    assert not (tmp_path / "started").exists()  # no worker ever started
    # The bound is < 3 s (measured: ~0.2-0.3 s, the names are read from the strategy's
    # source before torch is imported); the bound here leaves room for a loaded machine.
    assert seconds < 30, seconds


def test_run_refuses_a_misspelt_argument_before_importing_torch(tmp_path):
    # What makes the refusal fast: torch (~2 s to import) is never loaded on this path.
    code = ("import sys\nfrom stratagem.cli import main\n"
            "rc = main(['run', '--nproc', '2', '--strategy', 'localsgd', '--strategy-arg', "
            "'perod=4', 'train.py'])\n"
            "print(rc, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC},
                       cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert "did you mean period?" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("entry", STRATEGIES, ids=lambda e: e.name)
def test_names_read_from_source_match_the_imported_class(entry):
    """The check before torch reads signatures from source: it must see what the class
    accepts (names, order, Hierarchical's prefixes and their default strategies)."""
    assert source_arguments(entry.module, entry.cls) == \
        class_arguments(strategy_class(entry.name))


def test_source_arguments_give_up_on_what_they_cannot_read(tmp_path, monkeypatch):
    # A base class from outside (not a plain name in this package) or a missing module:
    # None, and the caller imports the class instead.
    (tmp_path / "odd_strategy.py").write_text(
        "import collections\n"
        "class Odd(collections.OrderedDict):\n"
        "    def __init__(self, *, a=1, **kw):\n        super().__init__(**kw)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert source_arguments("odd_strategy", "Odd") is None
    assert source_arguments("no_such_module_here", "X") is None
    assert source_arguments("odd_strategy", "Missing") is None
    # The early check says what from_name says (presets, Hierarchical's routed keys).
    with pytest.raises(TypeError, match="Hierarchical \\(hierarchical\\) with outer='diloco' "
                                        "has no argument 'outer_perod'; did you mean "
                                        "outer_period?"):
        check_argument_names_early("hierarchical", {"outer_perod": 4})
    with pytest.raises(TypeError, match="ElasticAveraging \\(eamsgd\\) has no argument "
                                        "'momentun'; did you mean momentum?"):
        check_argument_names_early("eamsgd", {"momentun": 0.5})
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        check_argument_names_early("nope", {})


# ----------------------------------------------------------------- failures printed once


def test_worker_runs_the_script_as_python_would(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    probe = """
import json, os, sys
import helper_mod  # found next to the script, as with `python script.py`
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "torch": "torch" in sys.modules, "value": helper_mod.VALUE,
                  "pkgdir": any(p.rstrip("/").endswith("src/stratagem") for p in sys.path)}))
"""
    (tmp_path / "probe.py").write_text(probe)
    (tmp_path / "pkg" / "probe.py").write_text(probe)
    env = {k: v for k, v in os.environ.items() if k != _worker.ERROR_DIR_ENV}
    env["PYTHONPATH"] = str(tmp_path)  # for -m pkg.probe; not stratagem's src
    out = subprocess.run([sys.executable, _worker.WORKER_FILE, str(tmp_path / "probe.py"), "a",
                          "--b"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"name": "__main__", "argv": [str(tmp_path / "probe.py"), "a", "--b"],
                   "path0": str(tmp_path.resolve()), "torch": False, "value": 7,
                   "pkgdir": False}
    out = subprocess.run([sys.executable, _worker.WORKER_FILE, "-m", "pkg.probe", "x"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["name"] == "__main__" and got["argv"][1:] == ["x"] and not got["torch"]


def test_worker_records_an_exception_instead_of_printing_it(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("def f():\n    raise ValueError('bad\\nthing')\nf()\n")
    errors = tmp_path / "errors"
    errors.mkdir()
    env = {**os.environ, _worker.ERROR_DIR_ENV: str(errors), "RANK": "3",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    out = subprocess.run([sys.executable, _worker.WORKER_FILE, str(script)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1 and out.stderr == ""
    (record,) = _worker.read_records(str(errors))
    assert (record["rank"], record["attempt"], record["type"]) == (3, 1, "ValueError")
    assert record["message"] == "bad\nthing"
    assert record["traceback"].startswith("Traceback (most recent call last):\n  File \""
                                          + str(script))
    assert "runpy" not in record["traceback"] and "_worker.py" not in record["traceback"]
    # SystemExit passes through untouched; without the directory the traceback is printed.
    script.write_text("import sys\nsys.exit(5)\n")
    out = subprocess.run([sys.executable, _worker.WORKER_FILE, str(script)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 5
    script.write_text("raise KeyError('k')\n")
    del env[_worker.ERROR_DIR_ENV]
    out = subprocess.run([sys.executable, _worker.WORKER_FILE, str(script)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1 and out.stderr.rstrip().endswith("KeyError: 'k'")


def test_read_records_skips_what_is_not_a_record(tmp_path):
    (tmp_path / "attempt0.rank0.json").write_text("[1, 2]")
    (tmp_path / "attempt0.rank1.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"rank": 0}))
    os.symlink("/etc/hostname", tmp_path / "attempt0.rank2.json")
    (tmp_path / "attempt0.rank3.json").write_text(json.dumps(
        {"rank": 3, "attempt": 0, "type": "E", "message": "m", "traceback": "t"}))
    assert [r["rank"] for r in _worker.read_records(str(tmp_path))] == [3]
    assert _worker.read_records(str(tmp_path / "missing")) == []


def _rec(rank: int, message: str, attempt: int = 0, kind: str = "RuntimeError"):
    return {"rank": rank, "attempt": attempt, "type": kind, "message": message,
            "traceback": f"Traceback (most recent call last):\n  rank {rank}\n{kind}: {message}\n"}


def test_summarize_groups_by_exception():
    same = _worker.summarize([_rec(1, "boom"), _rec(0, "boom")], world_size=2,
                             exit_codes={0: 1})
    assert same.splitlines() == [
        "stratagem run: all 2 workers (ranks 0, 1) failed with RuntimeError: boom",
        "traceback of rank 0:", "Traceback (most recent call last):", "  rank 0",
        "RuntimeError: boom"]
    mixed = _worker.summarize([_rec(0, "a"), _rec(2, "b", kind="ValueError"), _rec(3, "a")],
                              world_size=4, exit_codes={0: 1, 1: -15})
    assert "stratagem run: ranks 0, 3 failed with RuntimeError: a" in mixed
    assert "stratagem run: rank 2 failed with ValueError: b" in mixed
    assert ("stratagem run: rank 1 was killed by SIGTERM (stopped by torchrun after the "
            "failure above)") in mixed
    assert mixed.count("traceback of rank") == 2
    silent = _worker.summarize([], exit_codes={0: -9, 1: -9})
    assert silent == ("stratagem run: ranks 0, 1 were killed by SIGKILL without raising an "
                      "exception (killed, out of memory, or os._exit)")
    restarted = _worker.summarize([_rec(0, "flaky"), _rec(1, "again", attempt=1)],
                                  world_size=2)
    assert restarted.splitlines()[0] == ("stratagem run: attempt 0 failed (rank 0: "
                                         "RuntimeError: flaky); the job was restarted")
    assert "stratagem run: rank 1 failed with RuntimeError: again" in restarted
    assert _worker.summarize([]) == ""


def test_wrap_torchrun_argv():
    argv = ["--nproc-per-node", "2", "train.py", "--lr", "1"]
    assert _worker.wrap_torchrun_argv(argv, 2, False) == [
        "--nproc-per-node", "2", _worker.WORKER_FILE, "train.py", "--lr", "1"]
    argv = ["--nproc-per-node", "2", "--module", "pkg.train", "-m"]
    assert _worker.wrap_torchrun_argv(argv, 3, True) == [
        "--nproc-per-node", "2", _worker.WORKER_FILE, "-m", "pkg.train", "-m"]


@pytest.mark.timeout(150)
def test_run_prints_a_shared_exception_once(tmp_path):
    # Both workers meet (a file each, at most 60 s) before they raise: torchrun stops the
    # others as soon as it sees one failure, so a rank that started later would be killed
    # before reaching its own raise, and the job would not be "all workers failed".
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, pathlib, time\n"
        "here = pathlib.Path(__file__).parent\n"
        "(here / f\"up.{os.environ['RANK']}\").touch()\n"
        "deadline = time.monotonic() + 60\n"
        "while len(list(here.glob('up.*'))) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "def load():\n    raise RuntimeError('no data here')\nload()\n")
    r, _ = _stratagem("run", "--nproc", "2", str(script), cwd=tmp_path)
    assert r.returncode == 1
    err = r.stderr
    assert err.count("RuntimeError: no data here") == 2, err  # the head line + the traceback
    assert err.count("Traceback (most recent call last)") == 1, err
    assert ("stratagem run: all 2 workers (ranks 0, 1) failed with RuntimeError: no data here"
            in err), err
    assert "ChildFailedError" not in err and "torch/distributed" not in err, err
