"""A stratagem training loop inside Ray Train's ``TorchTrainer`` (needs ``stratagem[ray]``).

    python examples/ray_train.py                        # a local Ray of 2 CPUs, Mirrored, 2 workers
    python examples/ray_train.py --strategy diloco      # any synchronous strategy, unchanged
    python examples/ray_train.py --fault-tolerant       # a lost worker is replaced alone and healed
    RAY_ADDRESS=auto python examples/ray_train.py --workers 8   # on a running Ray cluster

The training function is the one ``stratagem run`` would run: Ray starts one worker per
replica and sets torchrun's variables, the strategy adopts Ray's process group.
``stratagem.ray.report`` hands metrics (and, every ``--ckpt-every`` steps, a stratagem
checkpoint: safetensors + JSON, no pickle) to ``ray.train.report``; ``stratagem.ray.restore``
resumes from Ray's latest checkpoint when Ray restarts the run (``--max-failures``) or it is
started again under the same ``--name`` and ``--storage``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F

import stratagem as sg


def train_func(config: dict) -> None:
    import stratagem.ray as sg_ray
    from stratagem.demo import MLP, load_mnist5k

    torch.set_num_threads(1)
    strategy = sg.from_name(config["strategy"])
    (X, y), (X_test, y_test) = load_mnist5k(0)
    torch.manual_seed(0)
    model = MLP(hidden=128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    loader = strategy.distribute_dataset((X, y), global_batch_size=64, seed=1)
    extras = sg_ray.restore(strategy, model=model, optimizer=optimizer, loader=loader) or {}
    steps = config["steps"]
    start_epoch = int(extras.get("epoch", 0))
    for epoch in range(start_epoch, config["epochs"]):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            strategy.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step = strategy.steps
            if step % config["ckpt_every"] == 0:  # every worker: save is a collective
                sg_ray.report(strategy, {"step": step, "loss": loss.item()}, checkpoint=True,
                              model=model, optimizer=optimizer, loader=loader, epoch=epoch)
            elif step % 10 == 0:  # Ray takes one report per worker per controller poll
                sg_ray.report(strategy, {"step": step, "loss": loss.item()})
            if steps and step >= steps:
                break
        if steps and strategy.steps >= steps:
            break
    strategy.finalize(model)
    with torch.no_grad():
        acc = (strategy.eval_model(model)(X_test).argmax(1) == y_test).float().mean().item()
    # The last report carries a checkpoint: Ray Train 2's Result.metrics are those of the
    # newest reported checkpoint.
    sg_ray.report(strategy, {"step": strategy.steps, "test_accuracy": acc,
                             "replicas": strategy.comm.world_size}, checkpoint=True,
                  model=model, optimizer=optimizer, loader=loader, epoch=loader.epoch)
    strategy.close()


def trainer(args: argparse.Namespace):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import stratagem.ray as sg_ray

    config = {"strategy": args.strategy, "epochs": args.epochs, "steps": args.steps,
              "ckpt_every": args.ckpt_every}
    return TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers,
                                     resources_per_worker={"CPU": 1}),
        torch_config=sg_ray.FaultTolerantConfig(min_replicas=1) if args.fault_tolerant
        else None,
        run_config=RunConfig(name=args.name, storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="mirrored",
                        help="a synchronous strategy's name (mirrored, diloco, local_sgd, ...)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps")
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--fault-tolerant", action="store_true")
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--name", default="stratagem-ray-example")
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(),
                                                          "stratagem-ray-results"))
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    if not os.environ.get("RAY_ADDRESS"):
        # A local Ray on loopback (read when ray is imported), no dashboard, no usage report.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not os.environ.get("RAY_ADDRESS"):
        ray.init(num_cpus=args.workers, include_dashboard=False, _node_ip_address="127.0.0.1")
    result = trainer(args).fit()
    print(f"metrics: {result.metrics}")
    print(f"checkpoint: {result.checkpoint}")


if __name__ == "__main__":
    main()
