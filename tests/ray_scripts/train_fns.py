"""Training functions the Ray Train tests (``tests/test_ray.py``) run inside
``ray.train.torch.TorchTrainer``: a training function written for ``stratagem run``,
checkpointing through :mod:`stratagem.ray`.

``train(config)``: ``config`` holds ``strategy`` ("mirrored", "diloco", "local_sgd"),
``out`` (a folder on this machine), ``resume`` (a checkpoint's path, else Ray's latest), ``steps`` (stop once ``strategy.steps`` reaches it, or
the number in ``OUT/stop`` when that file exists), ``ckpt_every`` (report a checkpoint every K
steps; 0: never), ``report_every`` (report metrics every K steps, 5 by default: Ray takes
one report per controller poll), ``step_sleep`` (seconds per step) and ``deadline`` (seconds: fail rather
than train forever). Each worker, by its Ray world rank ``r``, appends its PID and its Ray node
id and the time to ``OUT/pids.r``, the step it starts from (after a restore) to ``OUT/start.r``, writes its
step to ``OUT/progress.r`` and, at the end, its model to ``OUT/final.r.safetensors`` and
``OUT/result.r.json`` (steps, world size, heals, the loss of every step it trained).
"""

from __future__ import annotations

import json
import os
import time

import ray.train
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import stratagem as sg
import stratagem.ray as sg_ray


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 32, generator=g) * 1.5
    labels = torch.randint(0, 10, (1200,), generator=g)
    return centers[labels] + torch.randn(1200, 32, generator=g) * 2.0, labels


def _target(out: str, steps: int) -> int:
    try:
        with open(os.path.join(out, "stop")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return steps


def train(config: dict) -> None:
    out, rank = config["out"], ray.train.get_context().get_world_rank()
    torch.set_num_threads(1)
    with open(os.path.join(out, f"pids.{rank}"), "a") as f:
        f.write(f"{os.getpid()} {ray.get_runtime_context().get_node_id()} {time.time():.3f}\n")
    name = config["strategy"]
    strategy = {"mirrored": lambda: sg.Mirrored(timeout=20),
                "diloco": lambda: sg.DiLoCo(period=3, outer_lr=0.7, outer_momentum=0.5,
                                            timeout=20),
                "local_sgd": lambda: sg.LocalSGD(period=3, timeout=20)}[name]()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = strategy.prepare(model, opt)
    loader = strategy.distribute_dataset(_data(), global_batch_size=40, seed=1)
    sg_ray.restore(strategy, config.get("resume"), model=model, optimizer=opt, loader=loader)
    with open(os.path.join(out, f"start.{rank}"), "a") as f:
        f.write(f"{strategy.steps}\n")
    with open(os.path.join(out, f"times.{rank}"), "a") as f:
        f.write(f"start {strategy.steps} {time.time():.3f}\n")
    losses: dict[int, float] = {}
    end = time.monotonic() + config.get("deadline", 240)
    every = config.get("ckpt_every", 0)
    while strategy.steps < _target(out, config["steps"]):
        loader.set_epoch(loader.epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            step = strategy.steps
            losses[step] = loss.item()
            with open(os.path.join(out, f"times.{rank}"), "a") as f:
                f.write(f"step {step} {time.time():.3f}\n")
            with open(os.path.join(out, f"progress.{rank}"), "w") as f:
                f.write(str(step))
            save = bool(every) and step % every == 0
            if save or step % config.get("report_every", 5) == 0:
                sg_ray.report(strategy, {"step": step, "loss": losses[step]}, checkpoint=save,
                              **({"model": model, "optimizer": opt, "loader": loader}
                                 if save else {}))
            if config.get("step_sleep"):
                time.sleep(config["step_sleep"])
            if time.monotonic() > end:
                raise TimeoutError(f"rank {rank} still training at step {step} after "
                                   f"{config.get('deadline', 240)} s")
            if strategy.steps >= _target(out, config["steps"]):
                break
    strategy.finalize(model)
    final = strategy.eval_model(model)
    save_file({k: v.contiguous().clone() for k, v in final.state_dict().items()},
              os.path.join(out, f"final.{rank}.safetensors"))
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump({"steps": strategy.steps, "world_size": strategy.comm.world_size,
                   "heals": getattr(strategy.comm, "heals", 0), "pid": os.getpid(),
                   "comm": type(strategy.comm).__name__, "losses": losses}, f)
    strategy.close()
