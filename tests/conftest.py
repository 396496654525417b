import os

import pytest
import torch

# Ranks run as threads: keep torch's own intra-op pool small on a 2-core machine.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
