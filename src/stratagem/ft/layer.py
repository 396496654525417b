"""Fault tolerance as one layer, attached to a strategy at the step boundary.

The base ``Strategy`` calls this layer at fixed points and never asks whether the job is
fault tolerant: :meth:`FaultTolerance.comm_from_env` (the job's Comm: torchft's replicas
through :mod:`stratagem.ft.launch`, or a plain one), :meth:`~FaultTolerance.start` /
:meth:`~FaultTolerance.prepared` around ``prepare`` (the first quorum, where a new or
restarted replica heals), :meth:`~FaultTolerance.commit` before a step is applied (a plain
Comm always commits), :meth:`~FaultTolerance.step_end` after it (the quorum before a step
that communicates), and ``keep_global_batch`` (the shares of missing replicas handed to live
ones). Without fault tolerance every call is a no-op or the plain answer.

The heal: :meth:`~FaultTolerance.heal_state` is everything a joining replica needs to
continue exactly as a live one (models, optimizers, the parts' state, counters, loss scale,
loader positions), as a tree of tensors and JSON values that the heal transport
(:mod:`stratagem.ft.transport`) sends without pickle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..comm import Comm
from ..errors import ReplicaMismatchError
from ..parts.tensors import is_dtensor, local
from ..validation import check_bool, check_int
from .env import launched_fault_tolerant

if TYPE_CHECKING:
    from ..data import DistributedLoader
    from ..parts.plan import Plan
    from ..prepared import Prepared
    from ..strategy import Strategy

__all__ = ["FaultTolerance"]


class FaultTolerance:
    """The fault-tolerance layer of one strategy (a no-op layer when not fault tolerant).

    ``fault_tolerant=None`` follows the launcher (``stratagem run --fault-tolerant`` sets
    ``STRATAGEM_FT_LIGHTHOUSE``); an explicit value wins, and a strategy whose parts cannot
    run fault tolerant (:attr:`Plan.fault_tolerant`) says so when asked to.
    """

    def __init__(self, strategy_name: str, plan: Plan, *, fault_tolerant: bool | None,
                 min_replicas: int, keep_global_batch: bool, comm: Comm | None) -> None:
        if fault_tolerant is not None and not isinstance(fault_tolerant, bool):
            raise TypeError(f"fault_tolerant must be True, False or None (follow the launcher), "
                            f"got {fault_tolerant!r}")
        check_int("min_replicas", min_replicas, minimum=1,
                  fix="pass the fewest live replicas training may continue with, e.g. 2")
        self.strategy_name = strategy_name
        self.plan = plan
        self.min_replicas = min_replicas
        #: Set when the launcher asks for fault tolerance these parts lack: refused when the
        #: strategy joins the job (one built only as configuration, like Hierarchical's
        #: inner Sharded, never joins anything).
        self.refusal: str | None = None
        self.enabled = self._check(fault_tolerant, comm)
        self.keep_global_batch = self._check_keep_global_batch(keep_global_batch)
        #: keep_global_batch: the missing slots whose share of each global batch this replica
        #: trains on too, and the all-reduce divisor's correction (live / launched replicas).
        self.adopted: tuple[int, ...] = ()
        self.live_fraction = 1.0
        #: The loaders distribute_dataset made (a heal restores their positions) and
        #: positions received before a loader existed.
        self.loaders: list[DistributedLoader] = []
        self.healed_loaders: list[dict[str, int]] = []
        self.failed_steps = 0
        self._strategy: Strategy | None = None

    def _check(self, fault_tolerant: bool | None, comm: Comm | None) -> bool:
        if comm is not None:
            wanted = bool(fault_tolerant) or comm.fault_tolerant
        else:
            wanted = launched_fault_tolerant() if fault_tolerant is None else fault_tolerant
        if wanted and not self.plan.fault_tolerant:
            refusal = (
                f"{self.strategy_name} cannot run fault tolerant yet (fault_tolerant=True, or "
                f"launched with --fault-tolerant); supported: Mirrored, LocalSGD, DiLoCo, "
                "ElasticAveraging(mode='sync', rho=0), and Hierarchical (inner Mirrored or "
                "Sharded) on replica groups. Fix: use one of those, or launch without "
                "--fault-tolerant")
            if fault_tolerant is None and comm is None:
                self.refusal = refusal
                return False
            raise ValueError(refusal)
        return wanted

    def _check_keep_global_batch(self, keep: bool) -> bool:
        check_bool("keep_global_batch", keep)
        if keep and not self.enabled:
            raise ValueError(
                "keep_global_batch=True keeps the global batch constant while replicas of a "
                "fault-tolerant job are missing; this strategy is not fault tolerant "
                "(fault_tolerant=False and not launched with --fault-tolerant). Fix: pass "
                "fault_tolerant=True, or drop keep_global_batch")
        if keep and not self.plan.keeps_global_batch:
            raise ValueError(
                f"keep_global_batch=True needs a step that averages every replica's gradient "
                f"(Mirrored); {self.strategy_name} steps on local models, whose averages "
                "would weigh a replica that trains for a missing one like any other. Fix: use "
                "Mirrored, or drop keep_global_batch (a missing replica's share is skipped)")
        return keep

    # ------------------------------------------------------------------ joining the job
    def comm_from_env(self, *, timeout: float, device: torch.device,
                      startup_timeout: float | None = None) -> Comm:
        if self.refusal is not None:
            raise ValueError(self.refusal)
        if self.enabled:
            from .launch import comm_from_env  # torchft is an optional dependency

            return comm_from_env(timeout=timeout, device=device,
                                 min_replicas=self.min_replicas,
                                 startup_timeout=startup_timeout)
        return Comm.from_env(timeout=timeout, device=device, startup_timeout=startup_timeout)

    def check_comm(self, comm: Comm) -> None:
        """Refuse a plan of one process per replica on replica groups of several."""
        if comm.replica_group_size > 1 and not self.plan.replica_groups:
            raise ValueError(
                f"{self.strategy_name} runs one process per fault-tolerant replica, but this "
                f"job's replicas are groups of {comm.replica_group_size} processes "
                "(sg.launch(..., nnodes=K, fault_tolerant=True)). Fix: use sg.Hierarchical "
                "(sync inside a group, fault tolerant across groups), or launch one process "
                "per replica")

    def attach(self, strategy: Strategy) -> None:
        self._strategy = strategy

    @property
    def strategy(self) -> Strategy:
        assert self._strategy is not None, "FaultTolerance.attach was not called"
        return self._strategy

    def start(self, module: torch.nn.Module) -> bool:
        """At ``prepare``, before wrapping: True when this layer makes the replicas equal
        (the first quorum's heal, at :meth:`prepared`) instead of the start-up broadcast."""
        strategy = self.strategy
        comm = strategy.comm
        if not comm.fault_tolerant:
            return False
        if strategy.prepared_models:
            raise ValueError(
                "fault_tolerant=True supports one prepared model per strategy (a heal "
                "restores the state of every prepared model at once, at the first "
                "prepare). Fix: prepare one module holding both models, or train without "
                "fault tolerance")
        module.to(strategy.device)
        if comm.replica_group_size > 1:
            strategy.replicas.check_model(module, comm.group_comm)  # type: ignore[attr-defined]
        return True

    def prepared(self) -> None:
        """At the end of ``prepare``: the first quorum (a new or restarted replica heals
        here), then the group starts and the global batch is planned."""
        comm = self.strategy.comm
        if not comm.fault_tolerant:
            return
        comm.set_state_fns(self.heal_state, self.load_heal_state)  # type: ignore[attr-defined]
        comm.begin()
        comm.start_group()  # type: ignore[attr-defined]
        self.plan_global_batch()

    # ------------------------------------------------------------------ the step boundary
    def agree(self, nonfinite: bool) -> bool:
        """Every replica's verdict on a non-finite step (the replica group's processes first)."""
        strategy = self.strategy
        if strategy.num_replicas_in_sync <= 1:
            return nonfinite
        comm = strategy.comm
        flag = torch.tensor([1.0 if nonfinite else 0.0])
        if comm.replica_group_size > 1:
            comm.group_comm.all_reduce(flag, "max")  # type: ignore[attr-defined]
        return bool(comm.all_reduce(flag, "max").item() > 0)

    def commit(self) -> bool:
        """Collectives already run in this step (the gradient all-reduce, the non-finite
        vote) must have succeeded everywhere before their result is applied. A plain Comm
        always commits."""
        comm = self.strategy.comm
        committed = not comm.collectives_pending or comm.commit()
        if not committed:
            self.failed_steps += 1  # applied nowhere; the next quorum drops the lost replica
        return committed

    def step_end(self, prepared: Prepared) -> None:
        """Membership changes (and heals) happen here, between steps, before any replica
        computes the step that will communicate."""
        strategy = self.strategy
        if strategy.comm.fault_tolerant and self.next_step_syncs(prepared):
            strategy.comm.begin()
            self.plan_global_batch()

    def next_step_syncs(self, prepared: Prepared) -> bool:
        """Whether the next optimizer step of ``prepared`` runs a collective (its parts', or
        the non-finite vote): a fault-tolerant Comm forms its quorum before such a step."""
        strategy = self.strategy
        if strategy.synchronous_step and strategy.control.skips_agree:
            return True
        step = prepared.local_steps + 1
        return any(part.syncs_at(prepared, step) for part in strategy.parts)

    # ------------------------------------------------------------------ keep_global_batch
    @property
    def shares(self) -> int:
        """Shares of each global batch this replica trains on (its own and adopted ones)."""
        return 1 + len(self.adopted)

    def plan_global_batch(self) -> None:
        """keep_global_batch: after each quorum, give the missing slots' shares of the next
        global batches to the live replicas (missing slot ``m_j`` to the ``j % W``-th live
        replica by slot), so every sample is trained on. Each share is one more
        micro-batch, and each micro-batch's loss is divided by ``accumulation_steps * N / W``
        (N launched, W live): the all-reduce's mean over W replicas is then the mean over
        all N shares, the fault-free update."""
        if not self.keep_global_batch:
            return
        strategy = self.strategy
        comm = strategy.comm
        live = comm.live_slots()
        missing = sorted(set(range(comm.num_slots)) - set(live))
        mine = live.index(comm.slot) if comm.slot in live else 0
        adopted = tuple(missing[mine::len(live)]) if live else ()
        if strategy.control.accumulating():  # never mid-step: the next boundary takes it
            return
        self.adopted = adopted
        self.live_fraction = len(live) / comm.num_slots if live else 1.0
        for loader in self.loaders:
            loader.adopt(adopted)
        strategy.control.set_next_sync()

    def register_loader(self, loader: DistributedLoader) -> None:
        """A loader ``distribute_dataset`` made: it takes adopted shares, and a healed
        replica's loader resumes at its peers' position."""
        self.loaders.append(loader)
        loader.adopt(self.adopted)
        if len(self.loaders) <= len(self.healed_loaders):
            loader.fast_forward(self.healed_loaders[len(self.loaders) - 1])

    # ------------------------------------------------------------------ heal
    def heal_state(self) -> dict[str, Any]:
        """Everything a replica joining a fault-tolerant job needs to continue exactly as this
        one: the prepared model (this replica's own tensors, not a consensus), its optimizers,
        the parts' state (DiLoCo's outer parameters and momentum...), the step counters, the
        loss scale and the loaders' positions. Not a collective."""
        strategy = self.strategy
        models = []
        for prepared in strategy.prepared_models:
            # A sharded model (FSDP2 inside a replica group) sends this process's shards: a
            # heal goes from one group rank to the same group rank of another group.
            module = {k: local(v.detach()) for k, v in prepared.module.state_dict().items()}
            models.append({
                "module": module,
                "signature": [[k, list(v.shape), str(v.dtype)] for k, v in module.items()],
                "local_steps": prepared.local_steps,
                "optimizers": [_local_optimizer_state(opt.optimizer.state_dict())
                               for opt in prepared.optimizers],
                "parts": {part.name: part.heal_state(prepared) for part in strategy.parts},
            })
        control = strategy.control
        return {"steps": control.steps, "skipped": control.skipped,
                "precision": strategy.precision.state_dict(), "models": models,
                "loaders": [loader.state_dict() for loader in self.loaders]}

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Load what :meth:`heal_state` of a live peer returned; ``ReplicaMismatchError``
        naming the first difference when the peer's model is not this one (names, shapes,
        dtypes), before anything is changed."""
        strategy = self.strategy
        mine_models = strategy.prepared_models
        models = state.get("models", [])
        if len(models) != len(mine_models):
            raise ReplicaMismatchError(
                f"a live peer has {len(models)} prepared model(s), this replica "
                f"{len(mine_models)}. Fix: run the same script on every replica")
        for prepared, saved in zip(mine_models, models):
            mine = [[k, list(local(v).shape), str(v.dtype)]
                    for k, v in prepared.module.state_dict().items()]
            theirs = saved["signature"]
            if mine != theirs:
                first = next((f"{a} here, {b} on the peer" for a, b in zip(mine, theirs)
                              if a != b), f"{len(mine)} tensors here, {len(theirs)} on the peer")
                raise ReplicaMismatchError(
                    f"this replica's model differs from the live replicas' ({first}); a "
                    "replica joining a fault-tolerant job must build the same model. Fix: run "
                    "the same script and model configuration on every replica")
        with torch.no_grad():
            for prepared, saved in zip(mine_models, models):
                own = prepared.module.state_dict()
                for key, value in saved["module"].items():
                    local(own[key]).copy_(value)
                prepared.local_steps = int(saved["local_steps"])
                for opt, opt_state in zip(prepared.optimizers, saved["optimizers"]):
                    opt.optimizer.load_state_dict(_sharded_like_params(opt.optimizer,
                                                                       opt_state))
                for part in strategy.parts:
                    part.load_heal_state(prepared, saved["parts"].get(part.name, {}))
        strategy.control.steps = int(state["steps"])
        strategy.control.skipped = int(state["skipped"])
        strategy.precision.load_state_dict(state["precision"])
        self.healed_loaders = list(state.get("loaders", []))
        for loader, position in zip(self.loaders, self.healed_loaders):
            loader.fast_forward(position)


def _local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with each DTensor (the state of a sharded parameter)
    replaced by its local shard."""
    if not any(is_dtensor(v) for st in state.get("state", {}).values() for v in st.values()):
        return state
    out = dict(state)
    out["state"] = {i: {k: local(v) if torch.is_tensor(v) else v for k, v in st.items()}
                    for i, st in state["state"].items()}
    return out


def _sharded_like_params(optimizer: torch.optim.Optimizer, state: dict[str, Any]
                         ) -> dict[str, Any]:
    """``state`` (from :func:`_local_optimizer_state` of a peer with the same sharding) with
    each local shard of a sharded parameter's state made a DTensor again, sharded like the
    parameter (what the optimizer's step expects)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(is_dtensor(p) for p in params):
        return state
    from torch.distributed.tensor import DTensor

    out = dict(state)
    out["state"] = {}
    for i, st in state.get("state", {}).items():
        p = params[int(i)]
        if is_dtensor(p):
            shard = p.to_local().shape
            st = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
                  if torch.is_tensor(v) and v.dim() > 0 and v.shape == shard else v
                  for k, v in st.items()}
        out["state"][i] = st
    return out
