"""A training script Slurm starts itself, one task per process (``srun python
slurm_train.py OUT ...``): sg.Mirrored() reads its rank and world from Slurm's variables.

Writes ``OUT/start.<rank>.<restart>`` (world, rank, step it starts from), ``OUT/progress``
(rank 0's last step) and, at the end, ``OUT/final.<rank>.safetensors`` and
``OUT/final.<rank>.json`` (steps, losses, Slurm's restart count). With ``--ckpt DIR`` it
restores DIR when it exists and saves there on SIGTERM / SIGUSR1 (``on_preemption``; with
``--requeue`` the job then requeues itself)."""

import argparse
import json
import os
import time

import safetensors.torch
import torch
import torch.nn.functional as F

import stratagem as sg

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=24)
p.add_argument("--ckpt", default=None)
p.add_argument("--requeue", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

s = sg.Mirrored(timeout=60)
rank, world = s.comm.rank, s.comm.world_size
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
torch.manual_seed(0)
with s.scope():
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = s.prepare(model, opt)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(256, 10, generator=g), torch.randint(0, 3, (256,), generator=g)
loader = s.distribute_dataset((X, Y), 32, seed=7)  # 8 steps per epoch
step, losses = 0, []
if args.ckpt:
    s.on_preemption(args.ckpt, model=model, optimizer=opt, loader=loader,
                    step=lambda: step, losses=lambda: list(losses), requeue=args.requeue)
    if sg.checkpoint.exists(args.ckpt):
        extras = s.restore(args.ckpt, model=model, optimizer=opt, loader=loader)
        step, losses = extras["step"], list(extras["losses"])
with open(os.path.join(args.out, f"start.{rank}.{restart}"), "w") as f:
    json.dump({"world": world, "rank": rank, "step": step, "pid": os.getpid()}, f)
done = False
for epoch in range(loader.epoch, 10**6):
    loader.set_epoch(epoch)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        s.backward(loss)
        # This step's bookkeeping before opt.step(): a preemption saves at the end of
        # opt.step() (the step boundary), and what the loop does after it would be lost.
        step += 1
        losses.append(float(s.reduce("mean", loss.detach())))
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(os.path.join(args.out, "progress.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(args.out, "progress.tmp"), os.path.join(args.out, "progress"))
        if args.sleep:
            time.sleep(args.sleep)
        if step >= args.steps:
            done = True
            break
    if done:
        break
safetensors.torch.save_file({k: v.contiguous() for k, v in s.unwrap(model).state_dict().items()},
                            os.path.join(args.out, f"final.{rank}.safetensors"))
with open(os.path.join(args.out, f"final.{rank}.json"), "w") as f:
    json.dump({"steps": step, "losses": losses, "restart": restart, "world": world}, f)
s.close()
