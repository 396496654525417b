"""Actor-learner reinforcement learning on a parameter server (IMPALA-style, with REINFORCE).

    python examples/rl_actor_learner.py                      # 1 learner + 2 actors + 1 PS shard
    python examples/rl_actor_learner.py --actors 3 --rounds 200
    stratagem run --nproc 3 --num-ps 1 examples/rl_actor_learner.py   # the same under torchrun

Roles: rank 0 is the learner, every other rank an actor, each in its own process. The policy's
weights live on the parameter-server shard(s) (``STRATAGEM_PS_ADDRS``). Actors pull the latest
weights, play a batch of episodes with them and send the experience to the learner
(``torch.distributed`` point-to-point, any actor first). The learner computes the REINFORCE
gradient on each batch it receives and pushes it to the shards, where Adam is applied; the
next pull by an actor sees the new policy. Actors never wait for one another, and the learner
reports the *policy lag*: how many updates old the weights behind a batch were.

The environment, written inline (no gym): a contextual bandit. Each episode shows a context
``x`` in R^4; the policy picks one of 4 arms; the reward is 1 for the best arm of a hidden
linear teacher (``argmax(W x)``), else 0. A uniform policy scores 0.25, a perfect one 1.0.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stratagem as sg
from stratagem.ps.optim import optimizer_spec
from stratagem.ps.table import ShardedParameters
from stratagem.ps.transport import PSClient

CONTEXT, ARMS = 4, 4
LEARNER = 0


class Bandit:
    """The contextual bandit; every process builds the same hidden teacher from ``seed``."""

    def __init__(self, seed: int, rng: torch.Generator) -> None:
        self.teacher = torch.randn(CONTEXT, ARMS, generator=torch.Generator().manual_seed(seed))
        self.rng = rng

    def contexts(self, n: int) -> torch.Tensor:
        return torch.randn(n, CONTEXT, generator=self.rng)

    def rewards(self, x: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (actions == (x @ self.teacher).argmax(dim=1)).float()


def make_policy(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(CONTEXT, ARMS)


def connect(policy: nn.Module, lr: float, timeout: float) -> ShardedParameters:
    """The policy's tensors on the shards; the first process to register sets their values."""
    addresses = os.environ.get("STRATAGEM_PS_ADDRS", "")
    if not addresses:
        raise RuntimeError("STRATAGEM_PS_ADDRS is not set: run this script directly (it launches "
                           "its shards) or with `stratagem run --nproc N --num-ps 1`")
    client = PSClient(addresses.split(","), timeout=timeout)
    client.wait_ready(timeout=timeout)
    # The spec tells the shards which update rule to run: the learner's Adam.
    spec = optimizer_spec(torch.optim.Adam(policy.parameters(), lr=lr))
    table = ShardedParameters(client, dict(policy.named_parameters()), mode="async",
                              optimizer_spec=spec)
    table.register()
    return table


def actor(cfg: dict[str, Any], rank: int, policy: nn.Module, table: ShardedParameters) -> dict:
    env = Bandit(cfg["seed"], torch.Generator().manual_seed(cfg["seed"] * 1000 + rank))
    params = dict(policy.named_parameters())
    mean_rewards = []
    for _ in range(cfg["rounds"]):
        table.pull(into=params)                       # the freshest policy
        version = min(table.versions.values())
        with torch.no_grad():
            x = env.contexts(cfg["episodes"])
            actions = torch.distributions.Categorical(logits=policy(x)).sample()
            r = env.rewards(x, actions)
        # One fixed-shape message: rows of (context, action, reward), then a header row.
        batch = torch.cat([x, actions[:, None].float(), r[:, None]], dim=1)
        header = torch.zeros(1, CONTEXT + 2)
        header[0, 0] = version
        dist.send(torch.cat([batch, header]), dst=LEARNER)
        mean_rewards.append(float(r.mean()))
    return {"role": "actor", "rank": rank, "first_reward": mean_rewards[0],
            "last_reward": sum(mean_rewards[-5:]) / len(mean_rewards[-5:])}


def learner(cfg: dict[str, Any], policy: nn.Module, table: ShardedParameters,
            num_actors: int) -> dict:
    params = dict(policy.named_parameters())
    baseline = 1.0 / ARMS  # running mean reward: lowers the variance of REINFORCE
    lags = []
    message = torch.empty(cfg["episodes"] + 1, CONTEXT + 2)
    for _ in range(cfg["rounds"] * num_actors):  # every actor sends exactly `rounds` batches
        dist.recv(message, src=None)              # from whichever actor is ready first
        batch, header = message[:-1], message[-1]
        x, actions, r = batch[:, :CONTEXT], batch[:, CONTEXT].long(), batch[:, CONTEXT + 1]
        table.pull(into=params)
        lags.append(min(table.versions.values()) - int(header[0]))
        logp = torch.log_softmax(policy(x), dim=1).gather(1, actions[:, None]).squeeze(1)
        loss = -((r - baseline) * logp).mean()
        policy.zero_grad()
        loss.backward()
        table.push({n: p.grad for n, p in params.items()})  # the shard applies Adam
        baseline = 0.9 * baseline + 0.1 * float(r.mean())
    table.pull(into=params)
    env = Bandit(cfg["seed"], torch.Generator().manual_seed(12345))
    with torch.no_grad():
        x = env.contexts(2000)
        greedy = float(env.rewards(x, policy(x).argmax(dim=1)).mean())
    return {"role": "learner", "updates": len(lags), "greedy_reward": greedy,
            "mean_policy_lag": sum(lags) / len(lags), "max_policy_lag": max(lags)}


def worker(cfg: dict[str, Any]) -> dict:
    """One process of the job: the learner on rank 0, an actor elsewhere."""
    torch.set_num_threads(1)
    # Joins the job's process group (the launcher's environment), used for the experience.
    comm = sg.Comm.from_env(timeout=cfg["timeout"])
    if comm.world_size < 2:
        raise RuntimeError(f"need a learner and at least one actor, got {comm.world_size} "
                           "process(es); use --actors >= 1 or `stratagem run --nproc >= 2`")
    policy = make_policy(cfg["seed"])
    table = connect(policy, cfg["lr"], cfg["timeout"])
    try:
        if comm.rank == LEARNER:
            return learner(cfg, policy, table, comm.world_size - 1)
        return actor(cfg, comm.rank, policy, table)
    finally:
        table.client.close()
        comm.close()


def report(results: list[dict]) -> None:
    lead = results[0]
    print(f"learner: {lead['updates']} updates, greedy policy reward {lead['greedy_reward']:.3f} "
          f"(uniform 0.25), policy lag mean {lead['mean_policy_lag']:.2f} / max "
          f"{lead['max_policy_lag']} updates", flush=True)
    for r in results[1:]:
        print(f"actor {r['rank']}: mean reward {r['first_reward']:.3f} (first round) -> "
              f"{r['last_reward']:.3f} (last 5 rounds)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=150, help="batches each actor sends")
    parser.add_argument("--episodes", type=int, default=64, help="episodes per batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds before a silent peer or shard is an error")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = {"rounds": args.rounds, "episodes": args.episodes, "lr": args.lr,
           "timeout": args.timeout, "seed": args.seed}
    t0 = time.perf_counter()
    if "RANK" in os.environ:  # already launched (stratagem run / torchrun): be one process
        result = worker(cfg)
        if result["role"] == "learner":
            report([result])
        return
    if args.actors < 1:
        parser.error(f"--actors must be >= 1, got {args.actors}")
    results = sg.launch(worker, nprocs=1 + args.actors, num_ps=1, args=(cfg,),
                        timeout=max(120.0, 10 * args.timeout))
    report(results)
    print(f"job time {time.perf_counter() - t0:.1f} s (incl. process start-up)")


if __name__ == "__main__":
    main()
