"""A training script for the real-process fault-tolerance tests (``stratagem run
--fault-tolerant``): MNIST-5k-like synthetic digits, an MLP, ``--strategy``; each worker
appends its PID to ``OUT/pids.<slot>`` at start and writes its final model and accuracy to
``OUT/final.<slot>.safetensors`` / ``OUT/acc.<slot>``; ``OUT/progress.<slot>`` holds the
last step (the test kills a worker once training is under way)."""

import argparse
import itertools
import os
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import stratagem as sg

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--strategy", default="mirrored")
p.add_argument("--steps", type=int, default=120)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--timeout", type=float, default=10.0)
p.add_argument("--width", type=int, default=64)
p.add_argument("--data", choices=["synthetic", "mnist"], default="synthetic",
               help="synthetic (tests): 3000 clustered 64-d points; mnist: MNIST-5k (benchmarks)")
args = p.parse_args()
slot = int(os.environ.get("STRATAGEM_FT_SLOT", os.environ.get("RANK", "0")))
with open(os.path.join(args.out, f"pids.{slot}"), "a") as f:
    f.write(f"{os.getpid()}\n")

if args.data == "mnist":
    from stratagem.demo import load_mnist5k

    train, test = load_mnist5k()
else:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 64, generator=g) * 1.5
    labels = torch.randint(0, 10, (3000,), generator=g)
    x = centers[labels] + torch.randn(3000, 64, generator=g) * 2.0
    train, test = (x[:2400], labels[:2400]), (x[2400:], labels[2400:])

t = args.timeout
make = {"mirrored": lambda: sg.Mirrored(timeout=t),
        "local_sgd": lambda: sg.LocalSGD(period=4, timeout=t),
        # Outer momentum 0.5, not the paper's 0.9: with period 4 (not 500) Nesterov 0.9
        # overshoots on MNIST-5k (0.59 test accuracy after 400 steps against 0.94 at 0.5,
        # 4 replicas as threads).
        "diloco": lambda: sg.DiLoCo(period=4, outer_lr=0.7, outer_momentum=0.5, timeout=t),
        "easgd": lambda: sg.ElasticAveraging(period=4, timeout=t)}[args.strategy]
strategy = make()
torch.manual_seed(slot)
model = nn.Sequential(nn.Linear(train[0].shape[1], args.width), nn.ReLU(),
                      nn.Linear(args.width, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, opt = strategy.prepare(model, opt)
loader = strategy.distribute_dataset(train, global_batch_size=60, seed=1)
for epoch in itertools.count():
    loader.set_epoch(epoch)
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
        with open(os.path.join(args.out, f"progress.{slot}"), "w") as f:
            f.write(str(strategy.steps))
        with open(os.path.join(args.out, f"times.{slot}"), "a") as f:
            f.write(f"{strategy.steps} {time.time():.6f}\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if strategy.steps >= args.steps:
            break
    if strategy.steps >= args.steps:
        break
strategy.finalize(model)
final = strategy.eval_model(model)
with torch.no_grad():
    acc = (final(test[0]).argmax(1) == test[1]).float().mean().item()
save_file({k: v.contiguous() for k, v in final.state_dict().items()},
          os.path.join(args.out, f"final.{slot}.safetensors"))
with open(os.path.join(args.out, f"acc.{slot}"), "w") as f:
    c = strategy.comm
    f.write(f"{acc}\n{strategy.steps}\n{type(c).__name__} world={c.world_size} "
            f"quorums={getattr(c, 'quorums', None)} heals={getattr(c, 'heals', None)} "
            f"failed={getattr(c, 'failed_steps', None)}\n")
