"""``stratagem bench`` over a checkout of three tiny benchmarks: the full run's record,
written after every benchmark, and a run done in parts (``--stop-after``, ``--resume``),
which adds to that record only while the code is the one it records.

The checkout is a new git repository in ``tmp_path`` holding the real
``benchmarks/_common.py`` (the one writer of results) and scripts that print, optionally
fail, and exit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem import bench

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = '''"""Benchmark {name}: a test double."""
import os, sys
if __name__ == "__main__":
    print("ran {name}", sys.argv[1:])
    sys.exit(int(os.environ.get("FAIL_{name}", "0")))
'''


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, timeout=30).stdout


def _commit(repo: Path, message: str) -> None:
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "_common.py", repo / "benchmarks" / "_common.py")
    for name in ("alpha", "beta", "gamma"):
        (repo / "benchmarks" / f"{name}.py").write_text(SCRIPT.format(name=name))
    (repo / "benchmarks" / "results" / ".keep").write_text("")
    (repo / "README.md").write_text("prose\n")
    _git(repo, "init", "-q")
    _commit(repo, "three benchmarks")
    return repo


def _bench(repo: Path, *argv: str) -> int:
    return bench.main(["--dir", str(repo / "benchmarks"), *argv])


def _record(repo: Path) -> dict:
    data = json.loads((repo / "benchmarks" / "results" / "bench.json").read_text())
    assert data["name"] == "bench" and data["commit"]
    return data


def test_a_full_run_records_every_benchmark_and_its_duration(checkout: Path) -> None:
    assert _bench(checkout) == 0
    data = _record(checkout)
    rec = data["results"]
    assert [r["benchmark"] for r in rec["benchmarks"]] == ["alpha", "beta", "gamma"]
    assert all(r["exit_code"] == 0 and r["commit"] for r in rec["benchmarks"])
    assert rec["complete"] and rec["succeeded"] and len(rec["parts"]) == 1
    assert rec["total_s"] == pytest.approx(sum(r["seconds"] for r in rec["benchmarks"]), abs=0.2)
    assert data["duration_s"] == rec["total_s"]
    assert rec["code_commit"] == _git(checkout, "log", "-1", "--format=%h").strip()
    assert data["dirty"] is False  # the run's own results are not uncommitted code
    md = (checkout / "benchmarks" / "results" / "bench.md").read_text()
    assert "(complete, every benchmark exited 0)" in md and "| gamma | ok |" in md


def test_a_run_in_parts_adds_up_to_one_record(checkout: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # A minute of 1e-6 has passed after the first benchmark: the run stops there.
    assert _bench(checkout, "--stop-after", "0.000001") == 0
    assert "not run yet (beta, gamma); continue with: stratagem bench --resume" in \
        capsys.readouterr().out
    rec = _record(checkout)["results"]
    assert [r["benchmark"] for r in rec["benchmarks"]] == ["alpha"] and not rec["complete"]
    md = (checkout / "benchmarks" / "results" / "bench.md").read_text()
    assert "partial: 1 of 3 benchmarks" in md and "Not run yet: beta, gamma" in md
    # Results and prose committed in between do not change the code the record is of.
    (checkout / "README.md").write_text("the figures of alpha\n")
    _commit(checkout, "alpha's result")
    assert _bench(checkout, "--resume", "gamma") == 0
    assert _bench(checkout, "--resume") == 0
    rec = _record(checkout)["results"]
    assert [r["benchmark"] for r in rec["benchmarks"]] == ["alpha", "beta", "gamma"]
    assert [p["benchmarks"] for p in rec["parts"]] == [["alpha"], ["gamma"], ["beta"]]
    assert rec["complete"] and rec["succeeded"]
    assert rec["total_s"] == pytest.approx(sum(r["seconds"] for r in rec["benchmarks"]), abs=0.2)
    capsys.readouterr()
    assert _bench(checkout, "--resume") == 0
    assert "nothing to resume" in capsys.readouterr().out


def test_a_failure_is_recorded_and_named_benchmarks_run_again(
        checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_beta", "3")
    assert _bench(checkout) == 1
    rec = _record(checkout)["results"]
    assert [r["exit_code"] for r in rec["benchmarks"]] == [0, 3, 0]
    assert rec["complete"] and not rec["succeeded"]
    assert "with failures" in (checkout / "benchmarks" / "results" / "bench.md").read_text()
    monkeypatch.delenv("FAIL_beta")
    assert _bench(checkout, "--resume", "beta") == 0
    rec = _record(checkout)["results"]
    assert [r["exit_code"] for r in rec["benchmarks"]] == [0, 0, 0] and rec["succeeded"]


def test_a_benchmark_that_cannot_run_here_is_skipped_not_failed(
        checkout: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("_c", ROOT / "benchmarks" / "_common.py")
    assert spec and spec.loader
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert common.SKIPPED == bench._SKIPPED == 77  # one convention on both sides
    monkeypatch.setenv("FAIL_gamma", "77")
    assert _bench(checkout) == 0
    assert "gamma: skipped: it cannot run on this machine" in capsys.readouterr().out
    rec = _record(checkout)["results"]
    assert rec["complete"] and rec["succeeded"] and rec["skipped"] == ["gamma"]
    md = (checkout / "benchmarks" / "results" / "bench.md").read_text()
    assert "exited 0, 1 skipped as unable to run here (gamma)" in md and "| gamma | skipped |" in md


def test_resume_refuses_other_code_and_other_arguments(
        checkout: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench(checkout, "--stop-after", "0.000001", "--", "--seeds", "1") == 0
    first = _git(checkout, "log", "-1", "--format=%h").strip()
    capsys.readouterr()
    assert _bench(checkout, "--resume", "--", "--seeds", "2") == 2
    err = capsys.readouterr().err
    assert "benchmark arguments ['--seeds', '1']" in err and "['--seeds', '2']" in err
    # An uncommitted change to a benchmark: no record can say which code ran.
    (checkout / "benchmarks" / "beta.py").write_text(SCRIPT.format(name="beta") + "# new\n")
    assert _bench(checkout, "--resume", "--", "--seeds", "1") == 2
    assert "uncommitted changes" in capsys.readouterr().err
    _commit(checkout, "beta changed")
    assert _bench(checkout, "--resume", "--", "--seeds", "1") == 2
    err = capsys.readouterr().err
    assert f"the code at {first}" in err and "Fix: run without --resume" in err
    assert [r["benchmark"] for r in _record(checkout)["results"]["benchmarks"]] == ["alpha"]


def test_resume_refuses_a_record_it_did_not_write(checkout: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = checkout / "benchmarks" / "results" / "bench.json"
    path.write_text('{"name": "bench", "commit": "x", "results": {"benchmarks": [1]}}')
    assert _bench(checkout, "--resume") == 2
    assert "not written by a resumable" in capsys.readouterr().err
    path.write_text("x" * (bench._MAX_RECORD_BYTES + 1))
    assert _bench(checkout, "--resume") == 2
    assert "more than a record's" in capsys.readouterr().err
    assert _bench(checkout, "--resume", "--quick") == 2
    assert _bench(checkout, "--stop-after", "0") == 2


def test_the_cli_passes_resume_on(checkout: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "stratagem", "bench", "--dir",
                           str(checkout / "benchmarks"), "--stop-after", "0.000001"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ran alpha" in done.stdout and "ran beta" not in done.stdout
