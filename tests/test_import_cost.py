"""Start-up cost: importing stratagem must not import ``torch.distributed.tensor``.

That module (DTensor, with sympy behind it) costs ~0.9 s per process, while only
``sg.Sharded`` (FSDP2) ever makes a DTensor. The library asks
:func:`stratagem.parts.tensors.dtensor_class` instead, which answers from ``sys.modules``;
these tests keep an eager import from coming back silently, and check that a DTensor made
after stratagem was imported is still seen. (A process that builds a torch optimizer still
imports it, from torch itself: ``Optimizer.add_param_group`` imports ``torch._dynamo``,
which imports FSDP. What is saved is the start-up of the processes that build none: CLI
calls, the ``stratagem run`` supervisor.)
"""

from __future__ import annotations

import subprocess
import sys

import torch

_HEAVY = ("torch.distributed.tensor", "torch.distributed.fsdp")

# One fresh interpreter (this test process has long imported everything). First the
# imports every process pays, then a DTensor made only afterwards: the helper must see it.
_CODE = f"""
import sys
import stratagem as sg
import stratagem.cli, stratagem.ps.server, stratagem.launcher
import stratagem.checkpoint.sharded, stratagem.strategies.sharded
sg.Sharded  # the lazy export: the class is usable without FSDP loaded yet
loaded = [m for m in {_HEAVY!r} if m in sys.modules]
assert not loaded, f"importing stratagem imported {{loaded}}"

from stratagem.parts.tensors import dtensor_class, is_dtensor, like, local
import torch
assert dtensor_class() is None and not is_dtensor(torch.ones(2))

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    dt = DTensor.from_local(torch.arange(4.0), DeviceMesh("cpu", [0]), [Shard(0)])
    assert dtensor_class() is DTensor and is_dtensor(dt) and not is_dtensor(dt.to_local())
    assert not isinstance(local(dt), DTensor) and torch.equal(local(dt), torch.arange(4.0))
    again = like(dt, torch.zeros(4))
    assert isinstance(again, DTensor) and again.placements == dt.placements
    assert stratagem.checkpoint.sharded.is_sharded({{"w": [dt]}})
    assert not stratagem.checkpoint.sharded.is_sharded({{"w": [torch.ones(1)]}})
finally:
    dist.destroy_process_group()
print("ok")
"""


def test_import_stratagem_leaves_dtensor_unimported():
    done = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_is_dtensor_on_plain_tensors_in_a_process_that_has_dtensor():
    from torch.distributed.tensor import DTensor

    from stratagem.parts.tensors import dtensor_class, is_dtensor, like, local

    t = torch.ones(3)
    assert dtensor_class() is DTensor
    assert not is_dtensor(t) and not is_dtensor(None) and not is_dtensor(torch.nn.Parameter(t))
    assert local(t) is t and like(t, t * 2).equal(t * 2)
