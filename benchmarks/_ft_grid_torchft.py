"""One worker of the hand-written torchft baseline of ``ft_grid.py`` (item 4c).

The same work as ``tests/ft_scripts/train_ft.py --data mnist --model mlp --strategy
mirrored``: ``stratagem.demo.MLP`` (seed 0) on MNIST-5k, SGD(lr 0.05, momentum 0.9), a global
batch of 60 split into 4 slots' shares by the same sampler (``DistributedLoader``, seed 1; the
batch of step ``s`` is global batch ``s``). torchft as its README and ``train_ddp.py`` use it:
one ``torchft.Manager`` per replica group (one process each), ``ProcessGroupGloo``, the
gradients averaged with ``manager.allreduce``, the optimizer stepped only if
``manager.should_commit()``; a restarted replica heals from a live peer at its first quorum
(model and optimizer state; its data position follows from the healed step, since torchft
does not carry one: its issue #58). ``--model gpt``: the work of ``train_ft.py --data charlm
--model gpt`` instead (the LM demo's character-level GPT, 2 layers, 64 wide, AdamW lr 3e-3,
64-character windows, the same 64 validation windows; ``acc.<slot>`` holds the validation
loss).

Heal transport: torchft's own ``HTTPTransport``, which **unpickles** what it receives
(``torch.load(weights_only=False)``): acceptable in this benchmark on loopback only, never in
stratagem. What listens is kept on 127.0.0.1: the HTTP server (torchft binds every
interface; rebound here), the manager server (torchft hard-codes ``[::]``; rebound as
stratagem does), the replica group's store. The Lighthouse is started by ``ft_grid.py``.

Settings equal to stratagem's fault-tolerant mode, so the comparison is of the mechanisms,
not of tuning: synchronous quorum, 100 ms heartbeats, the Lighthouse's 1 s join and heartbeat
timeouts (set in ``ft_grid.py``), ``init_sync=True``.

Environment: ``FTG_SLOT`` (0..3), ``FTG_LIGHTHOUSE`` (the Lighthouse's address). Writes the
files ``train_ft.py`` writes: ``OUT/pids.<slot>``, ``times.<slot>`` (committed steps only),
``progress.<slot>``, ``heal.<slot>``, ``acc.<slot>``, ``final.<slot>.safetensors``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

import torch
import torch.nn.functional as F
import torchft.checkpointing.http_transport as http_transport
from safetensors.torch import save_file
from torchft import Manager
from torchft.checkpointing.http_transport import HTTPTransport

from stratagem._rendezvous import bound_tcp_store
from stratagem.data import DistributedLoader
from stratagem.demo import MLP, load_mnist5k
from stratagem.demo_lm import GPT, GPTConfig, encode, load_corpus, split_corpus, windows
from stratagem.ft.comm import loopback_gloo_group, loopback_manager_server

HOST = "127.0.0.1"
NSLOTS = 4


class _LoopbackHTTPServer(ThreadingHTTPServer):
    """torchft's checkpoint server, on 127.0.0.1 instead of every interface."""

    address_family = socket.AF_INET

    def __init__(self, server_address: Any, handler: Any) -> None:
        super().__init__((HOST, 0), handler)


class LoopbackHTTPTransport(HTTPTransport):  # type: ignore[type-arg]
    def address(self) -> str:
        return f"http://{HOST}:{self._server.socket.getsockname()[1]}/checkpoint/"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    args = p.parse_args()
    slot = int(os.environ["FTG_SLOT"])
    out = args.out
    with open(os.path.join(out, f"pids.{slot}"), "a") as f:
        f.write(f"{os.getpid()}\n")

    torch.manual_seed(0)
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    if args.model == "gpt":
        tokens, held = split_corpus(encode(load_corpus()))
        train = windows(tokens, 64)
        test = tuple(t[:64] for t in windows(held, 64))
        model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    else:
        train, test = load_mnist5k()
        model = MLP(hidden=args.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_of(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        if args.model == "gpt":
            return model(xb, yb)[1]  # type: ignore[no-any-return]
        return F.cross_entropy(model(xb), yb)

    loader = DistributedLoader(train, 60, num_replicas=NSLOTS, replica_id=slot, seed=1)
    per_epoch = len(loader)
    cache: dict[int, list[Any]] = {}

    def batch(step: int) -> Any:
        epoch = step // per_epoch
        if epoch not in cache:
            cache.clear()
            loader.set_epoch(epoch)
            cache[epoch] = list(loader)
        return cache[epoch][step % per_epoch]

    healed: list[int] = []

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        tensors = list(sd["model"].values()) + [
            v for st in sd["optim"]["state"].values() for v in st.values()
            if isinstance(v, torch.Tensor)]
        healed.append(sum(t.numel() * t.element_size() for t in tensors))

    timeout = timedelta(seconds=args.timeout)
    store = bound_tcp_store(HOST, 0, timeout=timedelta(seconds=60))
    # torchft's group with its rendezvous store bound to loopback (torchft's own listens on
    # every interface): the one change this baseline makes to torchft's group.
    pg = loopback_gloo_group(timeout, HOST)
    http_transport._IPv6HTTPServer = _LoopbackHTTPServer  # type: ignore[misc]
    with loopback_manager_server(HOST):
        manager = Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=max(args.timeout, 10.0)), rank=0, world_size=1,
            store_addr=HOST, store_port=store.port, lighthouse_addr=os.environ["FTG_LIGHTHOUSE"],
            replica_id=f"slot{slot}", hostname=HOST,
            heartbeat_interval=timedelta(milliseconds=100),
            checkpoint_transport=LoopbackHTTPTransport(timeout=timeout, num_chunks=0),
            init_sync=True)
    heal_seconds = 0.0
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        n_heals = len(healed)
        opt.zero_grad()
        manager.start_quorum()
        if len(healed) != n_heals:
            heal_seconds += time.perf_counter() - t0
            with open(os.path.join(out, f"heal.{slot}"), "a") as f:
                f.write(f"{len(healed)} {healed[-1]} {heal_seconds:.6f} {time.time():.6f}\n")
        xb, yb = batch(manager.current_step())
        loss_of(xb, yb).backward()
        works = [manager.allreduce(q.grad) for q in model.parameters() if q.grad is not None]
        for w in works:
            w.wait()
        if manager.should_commit():
            opt.step()
            step = manager.current_step()
            with open(os.path.join(out, f"progress.{slot}"), "w") as f:
                f.write(str(step))
            with open(os.path.join(out, f"times.{slot}"), "a") as f:
                f.write(f"{step} {time.time():.6f}\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    with torch.no_grad():
        if args.model == "gpt":  # the validation loss (lower is better)
            acc = loss_of(test[0], test[1]).item()
        else:
            acc = (model(test[0]).argmax(1) == test[1]).float().mean().item()
    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()},  # tied
              os.path.join(out, f"final.{slot}.safetensors"))
    with open(os.path.join(out, f"acc.{slot}"), "w") as f:
        f.write(f"{acc}\n{manager.current_step()}\ntorchft heals={len(healed)}\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
