"""Fixtures for the parameter-server tests: in-process shards on 127.0.0.1, port 0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stratagem.ps.server import ShardServer, start_local_shards
from stratagem.ps.transport import PSClient


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests pass tokens explicitly; a token in the developer's environment must not leak in.
    monkeypatch.delenv("STRATAGEM_PS_TOKEN", raising=False)


@pytest.fixture
def shards() -> Iterator[tuple[list[ShardServer], list[str]]]:
    servers, addrs = start_local_shards(2)
    yield servers, addrs
    for s in servers:
        s.stop(0)


@pytest.fixture
def client(shards: tuple[list[ShardServer], list[str]]) -> Iterator[PSClient]:
    c = PSClient(shards[1], timeout=10.0)
    yield c
    c.close()
