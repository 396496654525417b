import os

import pytest
import torch

# Ranks run as threads: keep torch's own intra-op pool small on a 2-core machine.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torchft's Rust servers log every quorum at INFO unless RUST_LOG says otherwise, and read it
# once, at torchft's first import (which a test module may do before stratagem sets it).
os.environ.setdefault("RUST_LOG", "warn")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shards():
    """Two in-process parameter-server shards; yields their addresses (tests/ps has its own
    fixture of the same name, yielding the servers too)."""
    from stratagem.ps.server import start_local_shards

    servers, addrs = start_local_shards(2)
    yield addrs
    for s in servers:
        s.stop(0)
