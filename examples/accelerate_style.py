"""A loop written the Accelerate way, on stratagem.

The shape of Accelerate's ``examples/complete_nlp_example.py`` (prepare, gradient
accumulation, clipping, a warm-up/decay LR schedule, metrics gathered over every process,
checkpoints every N steps, resume in the middle of an epoch), on local data: MNIST-5k with an
MLP instead of GLUE/MRPC with BERT. Each Accelerate idiom has its stratagem counterpart on the
line that uses it (``accelerator.X`` -> ``strategy.Y``); docs/guide.md has the whole table.

    python examples/accelerate_style.py                                    # one process
    stratagem run --nproc 2 examples/accelerate_style.py                   # Mirrored
    stratagem run --nproc 2 --strategy local_sgd --strategy-arg period=4 examples/accelerate_style.py
    python examples/accelerate_style.py --checkpointing-steps 20 --stop-after 40 --output-dir out
    python examples/accelerate_style.py --resume-from-checkpoint out/step_40 --output-dir out
"""

from __future__ import annotations

import argparse
import math
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import stratagem as sg
from stratagem.demo import load_mnist5k

_INIT_LOCK = threading.Lock()
def build_model(seed: int) -> nn.Module:
    # Fixed initial weights that do not depend on (or disturb) the global RNG: tests run the
    # ranks as threads sharing it. prepare() also broadcasts rank 0's weights.
    with _INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def linear_schedule_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                                num_training_steps: int) -> LambdaLR:
    """transformers' ``get_linear_schedule_with_warmup`` (``get_scheduler("linear", ...)``):
    a LambdaLR, so its state is plain numbers (saved as JSON next to the checkpoint)."""
    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return LambdaLR(optimizer, factor)


def training_function(args: argparse.Namespace, strategy: sg.Strategy | None = None
                      ) -> dict[str, Any]:
    # accelerator = Accelerator(gradient_accumulation_steps=...)
    strategy = strategy or sg.from_env("mirrored")
    strategy.accumulation_steps = args.gradient_accumulation_steps
    # with accelerator.main_process_first(): datasets = load / tokenize (the chief caches)
    with strategy.main_process_first():
        (x_train, y_train), (x_eval, y_eval) = load_mnist5k(0)
    x_train, y_train = x_train[: args.limit], y_train[: args.limit]
    # The batch size of Accelerate's loaders is per process; stratagem takes the global one.
    micro = args.batch_size * strategy.num_replicas_in_sync
    train_loader = strategy.distribute_dataset((x_train, y_train), micro, shuffle=True,
                                               seed=args.seed)
    eval_loader = strategy.distribute_dataset((x_eval, y_eval), micro, shuffle=False)

    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # model, optimizer, ... = accelerator.prepare(model, optimizer, ...)
    model, optimizer = strategy.prepare(model, optimizer)
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    lr_scheduler = linear_schedule_with_warmup(optimizer, num_warmup_steps=updates_per_epoch // 2,
                                               num_training_steps=updates_per_epoch * args.num_epochs)

    overall_step, starting_epoch, resume_step = 0, 0, 0
    if args.resume_from_checkpoint:
        # accelerator.load_state(path): model, optimizer, scheduler (here its JSON state)
        extras = strategy.restore(args.resume_from_checkpoint, model=model, optimizer=optimizer)
        lr_scheduler.load_state_dict(extras["lr_scheduler"])
        overall_step = int(extras["step"])
        starting_epoch, resume_step = divmod(overall_step, len(train_loader))

    accuracy = 0.0
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        train_loader.set_epoch(epoch)
        active_loader = train_loader
        if epoch == starting_epoch and resume_step:
            # accelerator.skip_first_batches(train_dataloader, resume_step)
            active_loader = strategy.skip_first_batches(train_loader, resume_step)
        for x, y in active_loader:
            # with accelerator.accumulate(model):
            with strategy.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                strategy.backward(loss)                       # accelerator.backward(loss)
                if strategy.sync_gradients:                   # accelerator.sync_gradients
                    strategy.clip_grad_norm_(model, 1.0)      # accelerator.clip_grad_norm_
                optimizer.step()
                if strategy.sync_gradients:                   # the prepared scheduler's rule
                    lr_scheduler.step()
                optimizer.zero_grad()
            overall_step += 1
            if args.checkpointing_steps and overall_step % args.checkpointing_steps == 0:
                # accelerator.save_state(output_dir): a collective, the chief writes
                strategy.save(os.path.join(args.output_dir, f"step_{overall_step}"),
                              model=model, optimizer=optimizer, step=overall_step,
                              lr_scheduler=lr_scheduler.state_dict())
            if args.stop_after and overall_step >= args.stop_after:
                return {"stopped_at": overall_step}

        # Evaluation: the consensus model (LocalSGD's average, ...), every sample once.
        eval_model = strategy.eval_model(model)                # accelerator.unwrap_model
        eval_model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in eval_loader:
                preds = eval_model(x).argmax(dim=-1)
                # accelerator.gather_for_metrics((preds, y)): stratagem's loaders never pad
                # with duplicates, so a plain gather is exact.
                preds, refs = strategy.gather((preds, y))
                correct += int((preds == refs).sum())
                total += len(refs)
        accuracy = 100.0 * correct / total
        strategy.barrier()                                     # accelerator.wait_for_everyone()
        if strategy.is_chief:                                  # accelerator.print / is_main_process
            print(f"epoch {epoch}: accuracy {accuracy:.2f} ({total} samples), "
                  f"lr {lr_scheduler.get_last_lr()[0]:.2e}")

    # accelerator.unwrap_model(model) + save_model: a plain module of the user's class
    strategy.finalize(model)
    strategy.save(os.path.join(args.output_dir, "final"), model=model, optimizer=optimizer,
                  step=overall_step, lr_scheduler=lr_scheduler.state_dict())
    plain = strategy.unwrap(model)
    return {"accuracy": accuracy, "step": overall_step, "lr": lr_scheduler.get_last_lr()[0],
            "model_class": type(plain).__name__}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process, as Accelerate")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--limit", type=int, default=4000, help="training digits to use")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="accelerate_style_out")
    parser.add_argument("--checkpointing-steps", type=int, default=0,
                        help="save every N batches (a multiple of the accumulation steps)")
    parser.add_argument("--resume-from-checkpoint", default=None)
    parser.add_argument("--stop-after", type=int, default=0,
                        help="stop after N batches (simulates a crash, for the resume test)")
    args = parser.parse_args(argv)
    if args.checkpointing_steps % args.gradient_accumulation_steps:
        parser.error(f"--checkpointing-steps={args.checkpointing_steps} must be a multiple of "
                     f"--gradient-accumulation-steps={args.gradient_accumulation_steps}: a "
                     "checkpoint in the middle of an accumulated step cannot resume it")
    return args


def main(argv: list[str] | None = None, strategy: sg.Strategy | None = None) -> dict[str, Any]:
    return training_function(parse_args(argv), strategy)


if __name__ == "__main__":
    main()
