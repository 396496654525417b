"""A small GAN on a 2-D mixture of 8 Gaussians (on a ring): two models, two optimizers, both
prepared by the strategy.

    python examples/gan.py
    stratagem run --nproc 2 examples/gan.py --steps 1500

What it shows: ``strategy.prepare`` called once per model, ``strategy.backward`` /
``optimizer.step()`` alternating between the discriminator and the generator, and evaluation
on every replica with ``strategy.reduce``. The score is the share of generated points within
3 standard deviations of a mode, and how many of the 8 modes they cover (mode collapse shows
as few modes).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

MODES = 8
RADIUS = 2.0
STD = 0.05


def centers() -> torch.Tensor:
    angles = torch.arange(MODES, dtype=torch.float32) * (2 * math.pi / MODES)
    return RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)


def sample_mixture(n: int, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, MODES, (n,), generator=gen)
    return centers()[idx] + STD * torch.randn(n, 2, generator=gen)


def mlp(d_in: int, d_out: int, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, d_out))


def score(points: torch.Tensor) -> tuple[int, int, int]:
    """(points near a mode, points, modes covered) for this replica's points."""
    dist = torch.cdist(points, centers())
    nearest = dist.min(dim=1)
    good = nearest.values < 3 * STD
    covered = torch.zeros(MODES)
    covered[nearest.indices[good]] = 1.0
    return int(good.sum()), len(points), int(covered.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--latent", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    strategy = sg.from_env(default="mirrored")
    torch.manual_seed(args.seed)
    with strategy.scope():
        generator, discriminator = mlp(args.latent, 2), mlp(2, 1)
        opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        generator, opt_g = strategy.prepare(generator, opt_g)
        discriminator, opt_d = strategy.prepare(discriminator, opt_d)

    real = sample_mixture(20_000, torch.Generator().manual_seed(args.seed))
    loader = strategy.distribute_dataset((real,), args.global_batch_size, shuffle=True,
                                         seed=args.seed, drop_remainder=True)
    # Each replica draws its own noise: a per-replica generator, seeded reproducibly.
    noise = torch.Generator().manual_seed(args.seed * 1000 + strategy.replica_id)
    step, epoch = 0, 0
    while step < args.steps:
        loader.set_epoch(epoch)
        for (x_real,) in loader:
            b = x_real.shape[0]
            z = torch.randn(b, args.latent, generator=noise).to(strategy.device)
            # Discriminator: one forward over real and fake together (one DDP forward per
            # backward), the fake made without building the generator's graph.
            with torch.no_grad():
                x_fake = generator(z)
            logits = discriminator(torch.cat([x_real, x_fake]))
            labels = torch.cat([torch.ones(b, 1), torch.zeros(b, 1)]).to(logits.device)
            loss_d = F.binary_cross_entropy_with_logits(logits, labels)
            strategy.backward(loss_d)
            opt_d.step()
            opt_d.zero_grad()
            # Generator: non-saturating loss. The backward also fills the discriminator's
            # gradients; they are cleared before its next step, never applied.
            z = torch.randn(b, args.latent, generator=noise).to(strategy.device)
            loss_g = F.binary_cross_entropy_with_logits(discriminator(generator(z)),
                                                        torch.ones(b, 1, device=strategy.device))
            strategy.backward(loss_g)
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
            step += 1
            if step >= args.steps:
                break
            if step % 500 == 0:
                losses = strategy.reduce("mean", {"d": loss_d, "g": loss_g})
                if strategy.is_chief:
                    print(f"step {step}: loss_d {float(losses['d']):.3f} "
                          f"loss_g {float(losses['g']):.3f}", flush=True)
        epoch += 1

    # Periodic strategies: fold the last local steps into the consensus generator, then score it.
    strategy.finalize(generator)
    strategy.finalize(discriminator)
    g = strategy.eval_model(generator)
    with torch.no_grad():
        z = torch.randn(2000, args.latent, generator=noise).to(strategy.device)
        good, count, _ = score(g(z).cpu())
        # Modes covered by the union of all replicas' samples (they share the generator).
        points = strategy.gather(g(z).cpu())
    totals = strategy.reduce("sum", {"good": good, "count": count})
    _, _, modes = score(points)
    if strategy.is_chief:
        print(f"after {step} steps on {strategy.num_replicas_in_sync} replica(s): "
              f"{totals['good'] / totals['count']:.1%} of samples within 3 std of a mode, "
              f"{modes}/{MODES} modes covered", flush=True)
    strategy.close()


if __name__ == "__main__":
    main()
