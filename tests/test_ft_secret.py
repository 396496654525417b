"""Fault tolerance never runs unauthenticated by accident: with no job secret available (plain
torchrun, srun, a Ray worker, or a launcher's variables without the secret) a
``fault_tolerant=True`` strategy refuses to start and names what provides one."""

from __future__ import annotations

import pytest

import stratagem as sg
from stratagem.ft.env import LIGHTHOUSE_ENV, SLOT_ENV, SLOTS_ENV, TOKEN_FILE_ENV

pytest.importorskip("torchft")

#: What plain torchrun (or srun with a wrapper exporting them) gives a worker.
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999"}


@pytest.fixture
def clean_env(monkeypatch):
    for key in (LIGHTHOUSE_ENV, SLOT_ENV, SLOTS_ENV, TOKEN_FILE_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_plain_torchrun_with_fault_tolerant_true_is_refused_naming_the_launcher(clean_env):
    strategy = sg.Mirrored(fault_tolerant=True)
    with pytest.raises(RuntimeError, match=rf"needs a fault-tolerant launcher.*{LIGHTHOUSE_ENV}"
                                           r".*stratagem run --fault-tolerant"):
        _ = strategy.comm


def test_launcher_variables_without_the_secret_are_refused_naming_the_variable(clean_env):
    # Someone set the launcher's variables by hand (a cluster script), but not the secret:
    # nothing is contacted, the refusal names the variable and the flag.
    clean_env.setenv(LIGHTHOUSE_ENV, "127.0.0.1:1")
    clean_env.setenv(SLOT_ENV, "0")
    clean_env.setenv(SLOTS_ENV, "2")
    for value in (None, ""):
        if value is None:
            clean_env.delenv(TOKEN_FILE_ENV, raising=False)
        else:
            clean_env.setenv(TOKEN_FILE_ENV, value)
        strategy = sg.Mirrored(fault_tolerant=True)
        with pytest.raises(RuntimeError, match=rf"no job secret: {TOKEN_FILE_ENV} is not set.*"
                                               r"never runs unauthenticated.*--ft-token-file"):
            _ = strategy.comm


def test_an_unreadable_or_loose_secret_is_refused(clean_env, tmp_path):
    clean_env.setenv(LIGHTHOUSE_ENV, "127.0.0.1:1")
    clean_env.setenv(SLOT_ENV, "0")
    clean_env.setenv(SLOTS_ENV, "2")
    loose = tmp_path / "token"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    clean_env.setenv(TOKEN_FILE_ENV, str(loose))
    with pytest.raises(ValueError, match="readable by others"):
        _ = sg.Mirrored(fault_tolerant=True).comm
    clean_env.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises((ValueError, OSError), match="missing"):
        _ = sg.Mirrored(fault_tolerant=True).comm
