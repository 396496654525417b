"""EASGD / EAMSGD as one part: the elastic exchange with a center (replicated, or on
parameter-server shards), EAMSGD's Nesterov momentum around the worker's optimizer, and the
penalty form. Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD",
NeurIPS 2015 (arXiv:1412.6651); the equations are in :mod:`stratagem.strategies.
elastic_average`.

Roles it plays in the step (``stratagem.parts.base``): ``before_update`` (the penalty form:
``rho * (x - center)`` added to the gradients, and on an exchange step the center moved at
the point where the gradients were taken), ``apply_update`` (EAMSGD: the optimizer's update
``u`` with ``m = momentum * m + u``, the parameters moved by ``u + momentum * m``),
``after_update`` (the exchange every ``period`` steps), ``finalize`` (a last exchange),
``consensus`` / ``eval_model`` (the center), checkpoints and heals (local models, momentum,
the center). :class:`~stratagem.parts.ElasticExchange` is the plain synchronous exchange
alone, ``Hierarchical``'s outer layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import Comm
from ..comm import flatten as _flatten
from ..comm import views as _views
from .base import Capability, Part
from .elastic import (
    center_state,
    default_moving_rate,
    elastic_exchange_,
    load_center,
    make_center,
)
from .tensors import dtype_groups, gather_ranks, load_rank, synced_tensors

if TYPE_CHECKING:
    from ..ps.table import ShardedParameters
    from ..strategy import Prepared, StrategyOptimizer

__all__ = ["ElasticAveragingPart"]


class _ElasticState:
    """Per prepared model: the synchronised tensors and the center (or its shard table)."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], is_param: list[bool],
                 key_prefix: str) -> None:
        self.names = names
        self.tensors = tensors
        self.is_param = is_param
        self.keys = [key_prefix + n for n in names]  # names on the parameter-server shards
        self.groups = dtype_groups(tensors)
        # sync: one flat center buffer per dtype group, ``center[i]`` views into it.
        self.center_flats: list[torch.Tensor] = []
        self.center: list[torch.Tensor] = []
        # async: the shard table and, when rho > 0, the last known center (params only).
        self.table: ShardedParameters | None = None
        self.center_copy: list[torch.Tensor | None] = []
        self.momentum: dict[int, torch.Tensor] = {}  # id(param) -> EAMSGD buffer
        self.eval_module: nn.Module | None = None
        # The local step count at the last exchange: finalize exchanges only when local
        # steps were taken since (so a second finalize is a no-op).
        self.exchanged_at = 0


class ElasticAveragingPart(Part):
    """EASGD / EAMSGD over ``comm`` (sync: the center replicated, one all-reduce per round)
    or parameter-server shards at ``ps_addresses`` (async). See
    :class:`stratagem.ElasticAveraging` for the arguments and what happens on failure."""

    name = "easgd"
    replicated = False

    def __init__(self, comm: Comm, *, period: int, moving_rate: float | None, beta: float,
                 rho: float, momentum: float, mode: str, average_buffers: bool,
                 wait_for_all: bool, ps_addresses: Sequence[str], timeout: float) -> None:
        super().__init__(comm)
        from ..ps.link import PSLink

        self.period, self.beta, self.rho, self.momentum = period, beta, rho, momentum
        self.mode, self.average_buffers, self.wait_for_all = mode, average_buffers, wait_for_all
        self._moving_rate = moving_rate
        # Async: the shards holding the center (connected when the first model is prepared).
        self.ps = PSLink(list(ps_addresses), comm=comm, timeout=timeout)
        self.exchanges = 0

    @classmethod
    def capabilities(cls, config: Mapping[str, Any]) -> frozenset[str]:
        caps = {Capability.LOCAL_OPTIMIZER_STATE}
        if config["mode"] == "sync":
            # Every worker counts the same local steps (a skipped step on one would shift its
            # exchange schedule), so the skip decision is agreed.
            caps.add(Capability.SYNCHRONOUS_STEP)
            if config["rho"] == 0:
                # The exchange is one transaction of a fault-tolerant Comm; the penalty form
                # exchanges inside the optimizer step.
                caps.add(Capability.TRANSACTIONS)
        else:
            # No collective at start-up: every worker starts from the center registered on
            # the shards (first registration wins), so a restarted worker rejoins alone.
            caps.add(Capability.STARTS_ALONE)
        return frozenset(caps)

    @property
    def moving_rate(self) -> float:
        if self._moving_rate is None:
            # Fault tolerant: the workers the job was launched with, not the quorum of the
            # moment, so a replica restarted later computes the same rate as its peers.
            comm = self.comm
            workers = (comm.num_slots if comm.fault_tolerant
                       else comm.world_size * comm.replica_group_size)
            self._moving_rate = default_moving_rate(self.beta, self.period, workers)
        return self._moving_rate

    # ------------------------------------------------------------------ setup
    def setup(self, prepared: Prepared) -> None:
        names, tensors, is_param = synced_tensors(prepared.module, self.average_buffers)
        index = prepared.index
        st = _ElasticState(names, tensors, is_param, "" if index == 0 else f"model{index}/")
        prepared.state[self.name] = st
        if self.momentum > 0:
            st.momentum = {id(p): torch.zeros_like(p) for p in prepared.module.parameters()}
            for opt in prepared.optimizers:
                inner = opt.optimizer
                plain_sgd = type(inner) is torch.optim.SGD and all(
                    g.get("momentum", 0) == 0 for g in inner.param_groups)
                if not plain_sgd:
                    # Measured (benchmarks/convergence.py): momentum 0.9 on top of Adam's update
                    # stalled at ~84% on MNIST-5k where EASGD reached 93%.
                    warnings.warn(
                        f"EAMSGD (momentum={self.momentum}) adds Nesterov momentum on top of "
                        f"{type(inner).__name__}'s update, which already has momentum; this "
                        "multiplies the effective step. The paper's EAMSGD uses plain SGD: use "
                        "torch.optim.SGD without momentum, or momentum=0 (EASGD) with this "
                        "optimizer.", RuntimeWarning, stacklevel=4)
        if self.mode == "sync":
            # The center starts at the (broadcast) model.
            st.center_flats, st.center = make_center(tensors, st.groups)
            return
        st.table = self.ps.table(self._named(st), mode="elastic")
        # The chief registers the center from its initial model, the others wait for it and
        # pull; a worker (re)starting later gets the current center either way.
        owner = self.owner
        center = st.table.join(register=owner.is_chief, timeout=owner.timeout)
        self.ps.fold_bytes()
        with torch.no_grad():
            for k, t in zip(st.keys, st.tensors, strict=True):
                t.copy_(center[k])
        st.center_copy = [t.detach().clone() if (p and self.rho > 0) else None
                          for t, p in zip(st.tensors, st.is_param, strict=True)]
        if self.wait_for_all:
            self.comm.barrier()

    def _state(self, prepared: Prepared) -> _ElasticState:
        st: _ElasticState = prepared.state[self.name]
        return st

    @staticmethod
    def _named(st: _ElasticState) -> dict[str, torch.Tensor]:
        """The synchronised tensors under their names on the shards."""
        return {k: t.detach() for k, t in zip(st.keys, st.tensors, strict=True)}

    # ------------------------------------------------------------------ the step
    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        # Fault tolerant: the quorum (and a heal) comes before an exchange step.
        return self.mode == "sync" and step % self.period == 0

    def before_update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        if self.rho > 0:
            self._penalty_form(prepared, self._state(prepared), opt)

    def apply_update(self, prepared: Prepared, opt: StrategyOptimizer) -> bool:
        if self.momentum <= 0:
            return False  # the optimizer's own step
        st = self._state(prepared)
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
        opt.optimizer.step()
        delta = self.momentum
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                m = st.momentum.get(id(p))
                if m is None:  # a parameter added to the optimizer after prepare
                    m = st.momentum[id(p)] = torch.zeros_like(p)
                b.sub_(p)  # b = -u, the optimizer's own update negated
                m.mul_(delta).sub_(b)  # m = momentum * m + u
                p.add_(m, alpha=delta)  # x = x_before + u + momentum * m (Nesterov)
        return True

    def after_update(self, prepared: Prepared) -> None:
        if self.rho > 0 or prepared.local_steps % self.period != 0:
            return  # the penalty form exchanged before the step
        st = self._state(prepared)
        self._exchange(st, pull_params=True)
        st.exchanged_at = prepared.local_steps

    def _exchange(self, st: _ElasticState, *, pull_params: bool) -> None:
        """One elastic exchange: ``x~ += moving_rate * sum_i d_i`` and, for the buffers and
        (``pull_params``) the parameters, ``x_i -= moving_rate * d_i``. Without
        ``pull_params`` (the penalty form, where the gradient pulls) the center copy kept for
        the penalty is updated instead."""
        a = self.moving_rate
        with torch.no_grad():
            if self.mode == "sync":
                # One transaction: under fault tolerance a failed exchange changes nothing.
                if not elastic_exchange_(self.comm, st.tensors, st.groups, st.center_flats,
                                         [pull_params or not p for p in st.is_param], a):
                    return
            else:
                assert st.table is not None
                d_by_key = st.table.elastic_exchange(self._named(st), a)
                self.ps.fold_bytes()
                for i, (k, t) in enumerate(zip(st.keys, st.tensors, strict=True)):
                    d = d_by_key[k]
                    c = st.center_copy[i] if st.center_copy else None
                    if pull_params or not st.is_param[i]:
                        t.sub_(d, alpha=a)
                    elif c is not None:
                        c.copy_(t).sub_(d, alpha=1.0 - a)  # the center after: x - (1 - a) d
        self.exchanges += 1

    def finalize(self, prepared: Prepared) -> None:
        """A last elastic exchange when local steps were taken since the previous one, so the
        center has absorbed every local step (the workers are pulled, not made equal to it).
        Sync: a collective on which every worker agrees (same local steps). Async: each
        worker exchanges alone, then the workers sharing the process group meet at a barrier,
        so none reads or saves the center before the others' last exchanges have landed."""
        st = self._state(prepared)
        if prepared.local_steps != st.exchanged_at:
            self._exchange(st, pull_params=self.rho <= 0)
            st.exchanged_at = prepared.local_steps
        if self.mode == "async":
            self.comm.barrier()

    def _penalty_form(self, prepared: Prepared, st: _ElasticState, opt: StrategyOptimizer
                      ) -> None:
        """rho > 0: add ``rho * (x - center)`` to the gradients; on an exchange step, move the
        center by ``moving_rate * sum_i (x_i - center)`` with ``x_i`` the point where the
        gradients were taken (the paper's Eq. 5-6)."""
        exchange = (prepared.local_steps + 1) % self.period == 0
        stepped = {id(p) for g in opt.param_groups for p in g["params"]}
        a = self.moving_rate
        with torch.no_grad():
            if self.mode == "sync":
                for idx, center in zip(st.groups, st.center_flats, strict=True):
                    group = [st.tensors[i] for i in idx]
                    d = _flatten(group).sub_(center)
                    for i, t, v in zip(idx, group, _views(d, group), strict=True):
                        if st.is_param[i]:
                            self._add_penalty(t, v, stepped)
                        elif exchange:
                            t.sub_(v, alpha=a)
                    if exchange:
                        self.comm.all_reduce(d)
                        center.add_(d, alpha=a)
                        st.exchanged_at = prepared.local_steps
            else:
                assert st.table is not None
                if exchange:
                    d_by_key = st.table.elastic_exchange(self._named(st), a)
                    self.ps.fold_bytes()
                    st.exchanged_at = prepared.local_steps
                for i, (k, t) in enumerate(zip(st.keys, st.tensors, strict=True)):
                    c = st.center_copy[i]
                    if exchange:
                        d = d_by_key[k]
                        if c is None:
                            t.sub_(d, alpha=a)  # a buffer: the plain exchange
                        else:
                            c.copy_(t).sub_(d, alpha=1.0 - a)  # center after: x - (1 - a) d
                            self._add_penalty(t, d, stepped)
                    elif c is not None:
                        self._add_penalty(t, t - c, stepped)
        if exchange:
            self.exchanges += 1

    def _add_penalty(self, p: torch.Tensor, d: torch.Tensor, stepped: set[int]) -> None:
        if id(p) not in stepped or not p.requires_grad:
            return
        if p.grad is None:
            p.grad = d.mul(self.rho).reshape(p.shape)
        else:
            p.grad.add_(d.view_as(p.grad), alpha=self.rho)

    # ------------------------------------------------------------------ the center
    def _center_values(self, st: _ElasticState) -> list[torch.Tensor]:
        if self.mode == "sync":
            return st.center
        assert st.table is not None
        got = st.table.pull()
        self.ps.fold_bytes()
        return [got[k] for k in st.keys]

    def eval_model(self, prepared: Prepared) -> nn.Module:
        """A module of the user's class holding the center (built once; in sync mode it
        shares the center's storage, in async mode it is refreshed from the shards at each
        call). Buffers not averaged are this worker's own. Not a collective."""
        st = self._state(prepared)
        if st.eval_module is None:
            center = dict(zip(st.names, self._center_values(st), strict=True))
            local_buffers = dict(prepared.module.named_buffers())
            clone = self.owner.eval_copy(prepared)
            for n, p in clone.named_parameters():
                # Sync: a view of the center (no copy, always current). Async: pulled values.
                p.data = center[n]
            for n, b in clone.named_buffers():
                b.data = center[n] if n in center else local_buffers[n]
            st.eval_module = clone
        elif self.mode == "async":
            center_values = self._center_values(st)
            by_name: dict[str, torch.Tensor] = dict(st.eval_module.named_parameters())
            by_name.update(st.eval_module.named_buffers())
            with torch.no_grad():
                for n, c in zip(st.names, center_values, strict=True):
                    by_name[n].copy_(c)
        return st.eval_module

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        if self.mode == "async" and not self.owner.is_chief:
            # Only the chief's model tensors are written; spare the shards a pull per worker.
            return state
        st = self._state(prepared)
        center = {id(t): c for t, c in zip(st.tensors, self._center_values(st), strict=True)}
        return {k: center.get(id(v), v) for k, v in state.items()}

    def loaded(self, prepared: Prepared) -> None:
        st = self._state(prepared)
        with torch.no_grad():
            if self.mode == "sync":
                for t, c in zip(st.tensors, st.center, strict=True):
                    c.copy_(t)
                return
            for t, copy_ in zip(st.tensors, st.center_copy, strict=True):
                if copy_ is not None:
                    copy_.copy_(t)
        assert st.table is not None
        if self.owner.is_chief:
            st.table.set_state({"params": self._named(st)})
            self.ps.fold_bytes()
        # Nobody exchanges against the old center once restore returns.
        self.comm.barrier()

    # ------------------------------------------------------------------ checkpoints, heals
    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        out = gather_ranks(self.comm, st.names, st.tensors, "local")
        if st.momentum:
            named = [(n, p) for n, p in prepared.module.named_parameters()
                     if id(p) in st.momentum]
            out.update(gather_ranks(self.comm, [n for n, _ in named],
                                    [st.momentum[id(p)] for _, p in named], "momentum"))
        return out

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st = self._state(prepared)
        owner = self.owner
        rank, world = owner.replica_id, owner.num_replicas_in_sync
        load_rank(state, "local", rank, world, st.names, st.tensors)
        if st.momentum:
            named = [(n, p) for n, p in prepared.module.named_parameters()
                     if id(p) in st.momentum]
            load_rank(state, "momentum", rank, world, [n for n, _ in named],
                      [st.momentum[id(p)] for _, p in named])

    def heal_state(self, prepared: Prepared) -> dict[str, Any]:
        """Sync mode under fault tolerance: the center, EAMSGD's momentum, the exchange
        schedule and the moving rate in force (a joiner then continues as its peer)."""
        st = self._state(prepared)
        momentum = {n: st.momentum[id(p)] for n, p in prepared.module.named_parameters()
                    if id(p) in st.momentum}
        return {"center": center_state(st.names, st.center), "momentum": momentum,
                "exchanged_at": st.exchanged_at, "exchanges": self.exchanges,
                "moving_rate": self.moving_rate}

    def load_heal_state(self, prepared: Prepared, state: dict[str, Any]) -> None:
        st = self._state(prepared)
        load_center(st.names, st.center, state["center"])
        with torch.no_grad():
            for n, p in prepared.module.named_parameters():
                if id(p) in st.momentum:
                    st.momentum[id(p)].copy_(state["momentum"][n])
        st.exchanged_at = int(state["exchanged_at"])
        self.exchanges = int(state["exchanges"])
        self._moving_rate = float(state["moving_rate"])

    def metrics(self) -> dict[str, Any]:
        self.ps.fold_bytes()
        return {"exchanges": self.exchanges, "moving_rate": self.moving_rate,
                **self.ps.metrics()}

    def close(self) -> None:
        self.ps.close()
