"""A character-level GPT trained the way people train language models, under any strategy.

    python examples/gpt.py                                   # one process
    stratagem run --nproc 2 examples/gpt.py                  # two workers, Mirrored
    stratagem run --nproc 2 --strategy diloco --strategy-arg period=8 examples/gpt.py
    stratagem run --nproc 2 --strategy easgd --strategy-arg period=4 examples/gpt.py
    stratagem run --nproc 2 --num-ps 1 --strategy ps-sync examples/gpt.py
    python examples/gpt.py --resume                          # continue from out-gpt/ckpt
    python examples/gpt.py --tiny                            # a few seconds (smoke test)

The model (``stratagem.demo_lm.GPT``): causal self-attention blocks, the token embedding tied
to the output head, dropout. The loop: AdamW with two parameter groups (weight decay on
matrices only), linear warm-up then cosine learning rate written into every
``param_group["lr"]`` each iteration, gradient accumulation (``--accumulation-steps`` per
worker or ``--global-accumulation-steps`` over all workers), clipping with
``strategy.clip_grad_norm_`` (on the unscaled gradients of the whole accumulated step),
periodic evaluation of the consensus model (``strategy.eval_model``) on held-out text,
checkpoints with the model configuration as extras (``strategy.save`` / ``restore``;
``read_extras`` gives the configuration before the model exists), ``strategy.finalize`` at the
end so the kept model includes every local step, and a sample from the final model.

The text: about 2 MB of English that every Python installation carries (the Language
Reference topics behind ``help()``, license and IDLE texts, ``/usr/share/common-licenses``,
the standard library's docstrings; see ``stratagem.demo_lm``), or ``--text FILE``.

The strategy comes from ``sg.from_env(default="mirrored")``: ``stratagem run --strategy NAME``
switches it without touching the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import stratagem as sg
from stratagem.checkpoint import exists, read_extras
from stratagem.demo_lm import (
    GPT,
    GPTConfig,
    adamw_param_groups,
    decode,
    encode,
    evaluate_loss,
    load_corpus,
    lr_at,
    split_corpus,
    windows,
)

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8,
        "max_iters": 6, "eval_interval": 3, "eval_windows": 8, "warmup_iters": 2,
        "sample_chars": 64, "log_interval": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out-gpt", help="checkpoints go to OUT_DIR/ckpt")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT_DIR/ckpt (model shape read from its extras)")
    p.add_argument("--text", default=None, help="train on this UTF-8 file instead")
    p.add_argument("--tiny", action="store_true",
                   help=f"tiny settings for smoke tests: {TINY} (explicit flags still win)")
    g = p.add_argument_group("model")
    g.add_argument("--n-layer", type=int, default=4)
    g.add_argument("--n-head", type=int, default=4)
    g.add_argument("--n-embd", type=int, default=128)
    g.add_argument("--block-size", type=int, default=128)
    g.add_argument("--dropout", type=float, default=0.1)
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=32,
                   help="global batch per micro-step (sequences, split over the workers)")
    acc = g.add_mutually_exclusive_group()
    acc.add_argument("--accumulation-steps", type=int, default=None,
                     help="micro-batches per optimizer step on each worker (default 2)")
    acc.add_argument("--global-accumulation-steps", type=int, default=None,
                     help="micro-batches per optimizer step summed over the workers "
                          "(divided by the number of workers, like nanoGPT's)")
    g.add_argument("--max-iters", type=int, default=1000, help="optimizer steps")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--warmup-iters", type=int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta2", type=float, default=0.99)
    g.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    g.add_argument("--seed", type=int, default=1337)
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-windows", type=int, default=64,
                   help="windows of block-size tokens scored per split at each evaluation")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--sample-chars", type=int, default=300)
    g.add_argument("--prompt", default="The ")
    args = p.parse_args(argv)
    if args.tiny:
        defaults = {a.dest: a.default for a in p._actions}
        for key, value in TINY.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    for name in ("batch_size", "max_iters", "eval_interval", "eval_windows", "log_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def batches(loader: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's batches forever, epoch after epoch (a restored loader resumes where it
    stopped)."""
    epoch = loader.epoch
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv: list[str] | None = None, strategy: sg.Strategy | None = None) -> dict[str, Any]:
    """Train; returns the final losses, the sample and the checkpoint path. ``strategy``:
    use this one instead of ``sg.from_env`` (tests pass strategies over thread ranks)."""
    args = parse_args(argv)
    ckpt = Path(args.out_dir) / "ckpt"
    if strategy is None:
        strategy = sg.from_env(default="mirrored", precision=args.precision)
    # Settable after construction; the global count is divided by the number of workers.
    if args.global_accumulation_steps is not None:
        strategy.global_accumulation_steps = args.global_accumulation_steps
    else:
        strategy.accumulation_steps = args.accumulation_steps or 2
    chief = strategy.is_chief

    # The model's shape: from the checkpoint's extras when resuming, before the model exists.
    resuming = args.resume and exists(ckpt)
    if args.resume and not resuming and chief:
        print(f"--resume: no checkpoint at {ckpt} yet, starting from scratch", flush=True)
    if resuming:
        cfg = GPTConfig(**read_extras(ckpt)["model_args"])
    else:
        cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                        n_embd=args.n_embd, dropout=args.dropout)

    text = (Path(args.text).read_text(encoding="utf-8", errors="replace") if args.text
            else load_corpus())
    train_ids, val_ids = split_corpus(encode(text))
    X, Y = windows(train_ids, cfg.block_size)
    Xv, Yv = windows(val_ids, cfg.block_size)
    pick = torch.Generator().manual_seed(0)  # the same evaluation windows on every replica
    eval_train = torch.randperm(len(X), generator=pick)[: args.eval_windows]
    eval_val = torch.randperm(len(Xv), generator=pick)[: args.eval_windows]

    with strategy.scope():
        torch.manual_seed(args.seed)  # same initial model everywhere (prepare broadcasts too)
        model: Any = GPT(cfg)
        if args.compile:
            model = torch.compile(model)
        optimizer = torch.optim.AdamW(adamw_param_groups(model, args.weight_decay), lr=args.lr,
                                      betas=(0.9, args.beta2))
        model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset((X, Y), global_batch_size=args.batch_size,
                                         shuffle=True, seed=args.seed)
    it, best_val = 0, math.inf
    if resuming:
        extras = strategy.restore(ckpt, model=model, optimizer=optimizer, loader=loader)
        it, best_val = int(extras["step"]), float(extras["best_val_loss"])
    if chief:
        print(f"{type(strategy).__name__} on {strategy.num_replicas_in_sync} worker(s); "
              f"{strategy.unwrap(model).num_parameters():,} parameters; {len(text):,} "
              f"characters; accumulation {strategy.accumulation_steps} per worker "
              f"({strategy.global_accumulation_steps} in all); "
              f"{'resuming at step ' + str(it) if resuming else 'from scratch'}", flush=True)

    def evaluate() -> dict[str, float]:
        consensus = strategy.eval_model(model)  # on every replica: a collective for some
        return {"train": evaluate_loss(strategy, consensus, X[eval_train], Y[eval_train]),
                "val": evaluate_loss(strategy, consensus, Xv[eval_val], Yv[eval_val])}

    def save(step: int) -> None:
        strategy.save(ckpt, model=model, optimizer=optimizer, loader=loader, step=step,
                      model_args=dataclasses.asdict(cfg), best_val_loss=best_val)

    data = batches(loader)
    t_last = time.perf_counter()
    loss = torch.zeros(())
    while it < args.max_iters:
        lr = lr_at(it, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup_iters,
                   total=args.max_iters)
        for group in optimizer.param_groups:  # reaches every worker's (and PS shard's) optimizer
            group["lr"] = lr
        if it % args.eval_interval == 0 and it > 0:
            losses = evaluate()
            if chief:
                print(f"step {it}: train loss {losses['train']:.4f}, val loss "
                      f"{losses['val']:.4f}", flush=True)
            if losses["val"] < best_val:
                best_val = losses["val"]
                save(it)
        for _ in range(strategy.accumulation_steps):
            x, y = next(data)
            _, loss = model(x, y)
            strategy.backward(loss)  # divided by the accumulation count, scaled under fp16
        norm = (strategy.clip_grad_norm_(model, args.grad_clip) if args.grad_clip > 0
                else torch.zeros(()))
        optimizer.step()  # the strategy's synchronisation happens here
        optimizer.zero_grad(set_to_none=True)
        it += 1
        if it % args.log_interval == 0 and chief:
            now = time.perf_counter()
            print(f"iter {it}: loss {float(loss.detach()):.4f}, lr {lr:.2e}, grad norm {float(norm):.3f}, "
                  f"{(now - t_last) * 1000 / args.log_interval:.0f} ms/iter", flush=True)
            t_last = now

    strategy.finalize(model)  # the consensus now includes every local step
    losses = evaluate()
    best_val = min(best_val, losses["val"])
    save(it)
    if chief:
        print(f"final (step {it}): train loss {losses['train']:.4f}, val loss "
              f"{losses['val']:.4f}; checkpoint {ckpt}", flush=True)
    final = strategy.eval_model(model)  # every replica calls it; the chief samples
    sample = ""
    if chief:
        prompt = encode(args.prompt).view(1, -1)
        out = final.generate(prompt, args.sample_chars,
                             generator=torch.Generator().manual_seed(args.seed))
        sample = decode(out[0])
        print(f"--- sample ({args.sample_chars} characters) ---\n{sample}\n---", flush=True)
    strategy.close()
    return {"train_loss": losses["train"], "val_loss": losses["val"], "sample": sample,
            "steps": it, "checkpoint": str(ckpt)}


if __name__ == "__main__":
    main()
