"""gRPC is imported with its receive tuning on, and the process environment is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from stratagem.ps import rpc

# Records GRPC_EXPERIMENTS as gRPC's extension module sees it when it is imported (gRPC reads
# the variable then), then imports the given module and reports what is left afterwards.
_PROBE = textwrap.dedent("""
    import importlib, importlib.abc, importlib.metadata, json, os, sys
    seen = []
    class Spy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "grpc._cython.cygrpc":
                seen.append(os.environ.get("GRPC_EXPERIMENTS"))
            return None
    sys.meta_path.insert(0, Spy())
    if sys.argv[3] != "-":  # pretend another grpcio release is installed
        real = importlib.metadata.version
        importlib.metadata.version = lambda d: sys.argv[3] if d == "grpcio" else real(d)
    if sys.argv[2] == "grpc-first":
        import grpc
    mod = importlib.import_module(sys.argv[1])
    from stratagem.ps import rpc
    print(json.dumps({"at_import": seen, "after": os.environ.get("GRPC_EXPERIMENTS"),
                      "tuned": rpc.TUNED}))
""")


def _probe(module: str, *, env_value: str | None = None, grpc_first: bool = False,
           release: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if env_value is not None:
        env["GRPC_EXPERIMENTS"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE, module,
                          "grpc-first" if grpc_first else "-", release or "-"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_grpc_sees_the_experiments_and_the_environment_is_restored() -> None:
    for module in ("stratagem.ps.transport", "stratagem.ps.server"):
        got = _probe(module, release="1.85.1")
        assert got == {"at_import": [rpc.EXPERIMENTS], "after": None, "tuned": True}, module


def test_the_installed_grpcio_is_tuned_when_its_release_was_tested() -> None:
    tested = rpc.is_tested_release(rpc.grpcio_release())
    expected = [rpc.EXPERIMENTS] if tested else [None]
    assert _probe("stratagem.ps.transport") == {
        "at_import": expected, "after": None, "tuned": tested}


def test_an_untested_grpcio_release_runs_with_grpcs_defaults() -> None:
    # gRPC logs an error line in every process for an experiment name it does not know: a
    # release outside the tested range is left alone, before it as after it.
    for release in ("1.59.3", "1.86.0", "2.0.0", "not-a-version"):
        assert _probe("stratagem.ps.transport", release=release) == {
            "at_import": [None], "after": None, "tuned": False}, release
    assert rpc.grpcio_release("1.60.0rc1") == (1, 60)
    assert rpc.grpcio_release("x") is None


def test_a_users_setting_wins_even_empty() -> None:
    assert _probe("stratagem.ps.transport", env_value="") == {
        "at_import": [""], "after": "", "tuned": False}
    assert _probe("stratagem.ps.transport", env_value="tcp_rcv_lowat") == {
        "at_import": ["tcp_rcv_lowat"], "after": "tcp_rcv_lowat", "tuned": False}


def test_grpc_imported_before_stratagem_is_left_as_it_is() -> None:
    assert _probe("stratagem.ps.transport", grpc_first=True) == {
        "at_import": [None], "after": None, "tuned": False}


def test_import_stratagem_does_not_import_grpc() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, stratagem, stratagem.cli; "
                          "print('grpc' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
