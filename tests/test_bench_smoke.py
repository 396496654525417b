"""Every benchmark's ``--smoke``: a few steps on loopback, end to end, as a process.

Each script must exit 0 and write one well-formed ledger entry (``NAME.json`` + ``NAME.md``:
commit, date, command, versions, host, duration, its payload under ``results``) into a new
temporary folder — under this test's ``TMPDIR`` — and never touch ``benchmarks/results/``.
``gpu.py`` without CUDA prints ``skipped: no CUDA`` and exits 0 instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size)
            for p in directory.iterdir() if p.is_file()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke(name, tmp_path):
    before = _snapshot(BENCHMARKS / "results")
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path)  # the smoke's temporary output folder lands here
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} --smoke exited {done.returncode}:\n{out[-4000:]}"
    assert _snapshot(BENCHMARKS / "results") == before, f"{name} --smoke changed results/"
    if name == "gpu" and "skipped: no CUDA" in done.stdout:
        return
    wrote = re.findall(r"^wrote (\S+\.json) and (\S+\.md)$", done.stdout, re.MULTILINE)
    assert len(wrote) == 1, f"{name}: expected one 'wrote NAME.json and NAME.md':\n{out[-3000:]}"
    js, md = Path(wrote[0][0]), Path(wrote[0][1])
    assert js.resolve().is_relative_to(tmp_path.resolve()), js
    assert md.is_file() and md.read_text().strip()
    data = json.loads(js.read_text())
    assert data["name"] == js.stem
    commit = data["commit"]
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit), commit
    assert isinstance(data["dirty"], bool)
    assert "--smoke" in data["command"]
    assert set(data["versions"]) == {"python", "torch", "torchft", "grpcio"}
    assert data["versions"]["torch"]
    assert set(data["host"]) == {"cores", "cpu", "gpu"} and data["host"]["cores"] >= 1
    assert data["duration_s"] >= 0
    assert data["results"]
    assert commit in md.read_text()
