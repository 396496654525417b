"""The Kubeflow TrainJob manifest in docs/guide.md ("On a cluster"), run as written: its
command and args on two local "nodes" (one process each, as two pods would run it), with the
PET_* variables the torch-distributed runtime sets from the manifest's numNodes and
numProcPerNode. The job must form one world of numNodes x numProcPerNode replicas."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).parents[1]
MARK = "<!-- trainjob-manifest -->"


def _manifest() -> dict:
    text = (ROOT / "docs" / "guide.md").read_text()
    assert MARK in text, "docs/guide.md lost its TrainJob manifest"
    block = text.split(MARK, 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_guides_trainjob_runs_as_written() -> None:
    job = _manifest()
    assert job["kind"] == "TrainJob" and job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    nodes, nproc = int(trainer["numNodes"]), int(trainer["numProcPerNode"])
    command = list(trainer["command"]) + list(trainer.get("args", []))
    assert command[0] == "stratagem"
    argv = [sys.executable, "-m", "stratagem.cli", *command[1:]]  # the console script
    port = _free_port()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PET_", "SLURM_", "SKYPILOT_"))
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    procs = []
    for rank in range(nodes):
        env = {**base, "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
               "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
               "PET_MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=200)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
        assert "from the environment:" in text and "Kubeflow (PET_*)" in text, text[-2000:]
    assert f"({nodes * nproc} replica(s), Mirrored)" in outputs[0], outputs[0][-2000:]
