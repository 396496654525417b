"""Elastic averaging SGD (EASGD) and elastic averaging momentum SGD (EAMSGD).

Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD", NeurIPS 2015
(arXiv:1412.6651). Every worker trains its own copy ``x_i`` of the model; a *center*
variable ``x~`` is linked to the workers by an elastic force. Every ``period`` local steps
each worker exchanges with the center::

    d_i = x_i - x~;    x_i -= moving_rate * d_i;    x~ += moving_rate * d_i

(the paper's Algorithm 1 with ``alpha = moving_rate`` and ``tau = period``). In ``"sync"`` mode
the center is replicated on every worker and all exchanges of a round are applied together
(``x~ += moving_rate * sum_i d_i``, one all-reduce of the ``d_i``); in ``"async"`` mode it lives
on parameter-server shards and each exchange is applied there atomically (per shard) as it
arrives, so workers never wait for each other. ``momentum > 0`` gives EAMSGD (Algorithm 2:
Nesterov momentum on the local update); ``rho > 0`` gives the penalty form of the paper's
Eq. 5-6, in which the elastic force on a worker is added to its gradient.

The consensus model, and the one checkpointed and evaluated, is the center.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import Comm
from ..comm import flatten as _flatten
from ..comm import views as _views
from ..parts import ElasticExchange, Part
from ..parts.elastic import elastic_exchange_, load_center, make_center
from ..parts.tensors import dtype_groups as _dtype_groups
from ..parts.tensors import gather_ranks as _gather_ranks
from ..parts.tensors import load_rank as _load_rank
from ..parts.tensors import synced_tensors as _synced_tensors
from ..ps.addresses import shard_addresses
from ..ps.link import PSLink
from ..strategy import Prepared, Strategy, StrategyOptimizer
from ..validation import check_bool, check_choice, check_int, check_number, check_optional_number

if TYPE_CHECKING:
    from ..ps.table import ShardedParameters

__all__ = ["ElasticAveraging"]

_MODES = ("sync", "async")


class _ElasticState:
    """Per prepared model: the synchronised tensors and the center (or its shard table)."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], is_param: list[bool],
                 key_prefix: str) -> None:
        self.names = names
        self.tensors = tensors
        self.is_param = is_param
        self.keys = [key_prefix + n for n in names]  # names on the parameter-server shards
        self.groups = _dtype_groups(tensors)
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


class ElasticAveraging(Strategy):
    """EASGD / EAMSGD (Zhang, Choromanska, LeCun 2015): local models pulled towards a center.

    Arguments:

    - ``period`` (int >= 1): local steps between two elastic exchanges.
    - ``moving_rate`` (in (0, 1]): the elastic rate ``alpha``; default
      ``beta / (period * num_workers)`` (the paper's ``beta = p * alpha`` per round, spread over
      ``period``). ``num_workers`` is the size of this job's process group: workers launched
      without a shared group (async, one process each) should pass ``moving_rate``.
    - ``beta`` (> 0): see ``moving_rate``.
    - ``rho`` (>= 0): with ``rho > 0`` the elastic force on the worker is applied through its
      gradient: before every local step ``rho * (x - center_copy)`` is added to the gradient of
      every parameter the optimizer steps, ``center_copy`` being the center as last seen by this
      worker (exact in sync mode). The exchange then happens *before* the local step, measures
      ``d`` at the point where the gradient was taken, and moves only the center (and the
      buffers, which have no gradient): the worker is not pulled twice. This is the paper's
      Eq. 5-6; with ``period=1`` and ``rho = moving_rate / lr`` it is exactly the update whose
      stability region the paper derives.
    - ``momentum`` (in [0, 1)): EAMSGD. The optimizer given to ``prepare`` computes the local
      update ``u`` (``-lr * g`` for plain SGD); around it the strategy keeps a buffer
      ``m = momentum * m + u`` and moves the parameters by ``u + momentum * m``: with plain SGD
      (no momentum of its own) this is exactly ``torch.optim.SGD(nesterov=True)``, i.e. the
      paper's Nesterov local update. With another optimizer (Adam, SGD with momentum...) the
      same Nesterov momentum is applied to that optimizer's update; parameters without a
      gradient in a step are not moved.
    - ``mode``: ``"sync"`` (center replicated, one all-reduce per round) or ``"async"`` (center
      on parameter-server shards found in ``ps_addresses``, else ``STRATAGEM_PS_ADDRS``).
    - ``average_buffers``: floating-point buffers (BatchNorm statistics) follow the same elastic
      exchange as the parameters; with False each worker keeps its own and the center module
      uses this worker's.
    - ``wait_for_all`` (async): wait for every worker of the process group before the first
      step (a start barrier). By default workers never wait for each other.
    - ``ps_addresses`` (async): ``"host:port,host:port"`` or a list of them.

    Any ``torch.optim`` optimizer works; its state stays local to each worker (saved per rank).
    A worker that starts or restarts in async mode registers the model on the shards (the
    first registration wins) and starts from the current center, so it rejoins without
    blocking anyone. Note: ``prepare`` itself (the core) checks and broadcasts the model over
    the process group, so workers sharing a group still meet once there.

    The center is what ``eval_model`` returns (a module sharing the center's storage in sync
    mode; refreshed from the shards at each call in async mode) and what ``save`` writes as
    ``model.safetensors``; every worker's local model (and EAMSGD buffer) goes in the strategy
    state, so resuming with the same workers is exact. ``restore`` sets the center and every
    local model to the saved model (async: the chief writes the center to the shards).

    On failure: sync mode, a dead or stalled peer makes the exchange all-reduce fail within
    ``timeout`` seconds and ``optimizer.step()`` raises ``PeerTimeoutError`` naming it (resume
    from the last checkpoint). Async mode, an unreachable shard raises
    ``ParameterServerUnavailable`` naming its address within ``timeout``; other workers are not
    affected by a worker dying, and a restarted worker rejoins from the center.

    Memory (copies of the parameters per worker): sync, one (the center) plus one transient
    flat buffer during an exchange; async, none (one for ``center_copy`` when ``rho > 0``, one
    for the center module once ``eval_model`` is called); EAMSGD adds one (the momentum) and a
    transient one during each step.
    """

    name = "easgd"
    _hierarchy_roles = ("outer",)
    _local_optimizer_state = True

    def __init__(self, *, period: int = 10, moving_rate: float | None = None, beta: float = 0.9,
                 rho: float = 0.0, momentum: float = 0.0, mode: str = "sync",
                 average_buffers: bool = True, wait_for_all: bool = False,
                 ps_addresses: str | Sequence[str] | None = None, **common: Any) -> None:
        self.period = check_int("period", period, minimum=1,
                                fix="pass the number of local steps between elastic exchanges, "
                                    "e.g. period=10")
        check_optional_number("moving_rate", moving_rate, low=0.0, high=1.0, low_open=True,
                              fix="pass e.g. moving_rate=0.05, or omit it for "
                                  "beta / (period * num_workers)")
        check_number("beta", beta, low=0.0, low_open=True,
                     fix="pass e.g. beta=0.9 (the paper's value)")
        check_number("rho", rho, low=0.0,
                     fix="pass 0 (no elastic penalty in the gradient) or e.g. "
                         "rho=moving_rate / lr")
        check_number("momentum", momentum, low=0.0, high=1.0, high_open=True,
                     fix="pass 0 (EASGD) or e.g. momentum=0.9 (EAMSGD)")
        check_choice("mode", mode, _MODES,
                     fix="pass mode='sync' (center replicated) or mode='async' (center on "
                         "parameter-server shards)")
        check_bool("average_buffers", average_buffers)
        check_bool("wait_for_all", wait_for_all)
        addresses: list[str] = []
        if mode == "async":
            addresses = shard_addresses(ps_addresses, who="ElasticAveraging(mode='async')")
        elif ps_addresses is not None:
            raise ValueError(f"ps_addresses only applies to mode='async', got ps_addresses="
                             f"{ps_addresses!r} with mode={mode!r}. Fix: drop ps_addresses or "
                             "pass mode='async'")
        # Fault tolerance (issue 22): the synchronous exchange is one transaction of the
        # fault-tolerant Comm; the penalty form exchanges inside the optimizer step, and async
        # mode's center lives on parameter-server shards (which survive workers already).
        self._fault_tolerance = mode == "sync" and rho == 0
        super().__init__(**common)
        self._moving_rate = None if moving_rate is None else float(moving_rate)
        self.beta = float(beta)
        if self._comm is not None:
            _ = self.moving_rate  # an explicit comm: check the default rate now
        self.rho = float(rho)
        self.momentum = float(momentum)
        self.mode = mode
        self.average_buffers = average_buffers
        self.wait_for_all = wait_for_all
        self.ps_addresses = addresses
        # Async: the shards holding the center (connected when the first model is prepared).
        self._ps = PSLink(addresses, comm=self.comm, timeout=self.timeout)
        # Sync mode: every worker must count the same local steps (a skipped step on one
        # worker would shift its exchange schedule), so the skip decision is agreed.
        self._synchronous_step = mode == "sync"
        self._exchanges = 0

    @property
    def moving_rate(self) -> float:
        """The elastic rate ``alpha``: as given, else ``beta / (period * num_workers)``
        (computed on first use, when the number of workers is known)."""
        if self._moving_rate is None:
            # Fault tolerant: the workers the job was launched with, not the quorum of the
            # moment, so a replica restarted later computes the same rate as its peers.
            workers = (self.comm.num_slots if self.comm.fault_tolerant
                       else self.num_replicas_in_sync)
            self._moving_rate = self._default_moving_rate(workers)
        return self._moving_rate

    def _default_moving_rate(self, workers: int) -> float:
        rate = self.beta / (self.period * workers)
        if rate > 1.0:
            raise ValueError(
                f"the default moving_rate = beta / (period * num_workers) = {self.beta:g} / "
                f"({self.period} * {workers}) = {rate:g} is above 1. Fix: lower beta, or "
                "pass moving_rate in (0, 1]")
        return rate

    def _hierarchy_parts(self, comm: Comm) -> list[Part]:
        """As Hierarchical's outer strategy: the synchronous elastic exchange among nodes
        (only the plain form: the penalty form and EAMSGD change the local update, which the
        inner strategy owns). On its own, ElasticAveraging runs its hooks directly (the
        penalty form and EAMSGD act inside the optimizer step; async mode talks to the
        shards), sharing the exchange itself (``elastic_exchange_``) with this part."""
        if self.mode != "sync" or self.rho > 0 or self.momentum > 0:
            raise ValueError(
                f"as an outer strategy, ElasticAveraging must be mode='sync', rho=0, "
                f"momentum=0, got mode={self.mode!r}, rho={self.rho}, momentum="
                f"{self.momentum}. Fix: ElasticAveraging(mode='sync') without rho/momentum")
        rate = self._moving_rate if self._moving_rate is not None else \
            self._default_moving_rate(comm.world_size)
        return [ElasticExchange(comm, period=self.period, moving_rate=rate,
                                average_buffers=self.average_buffers)]

    # ------------------------------------------------------------------ setup
    def _initial_sync(self, model: nn.Module) -> None:
        if self.mode == "sync":
            super()._initial_sync(model)
        # Async: no collective, so a (re)starting worker never waits for the others; every
        # worker starts from the center registered on the shards (first registration wins).

    def _setup(self, prepared: Prepared) -> None:
        names, tensors, is_param = _synced_tensors(prepared.module, self.average_buffers)
        index = len(self._prepared) - 1
        st = _ElasticState(names, tensors, is_param, "" if index == 0 else f"model{index}/")
        prepared.state["easgd"] = st
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
        self._setup_async(st)

    def _setup_async(self, st: _ElasticState) -> None:
        st.table = self._ps.table(self._named(st), mode="elastic")
        # The chief registers the center from its initial model, the others wait for it and
        # pull (issue 11); a worker (re)starting later gets the current center either way.
        center = st.table.join(register=self.is_chief, timeout=self.timeout)
        self._ps.fold_bytes()
        with torch.no_grad():
            for k, t in zip(st.keys, st.tensors, strict=True):
                t.copy_(center[k])
        st.center_copy = [t.detach().clone() if (p and self.rho > 0) else None
                          for t, p in zip(st.tensors, st.is_param, strict=True)]
        if self.wait_for_all:
            self.comm.barrier()

    @staticmethod
    def _named(st: _ElasticState) -> dict[str, torch.Tensor]:
        """The synchronised tensors under their names on the shards."""
        return {k: t.detach() for k, t in zip(st.keys, st.tensors, strict=True)}

    def _flush_counters(self) -> None:
        self._ps.fold_bytes()

    # ------------------------------------------------------------------ the step
    def _apply_update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        st: _ElasticState = prepared.state["easgd"]
        if self.rho > 0:
            self._penalty_form(prepared, st, opt)
        if self.momentum <= 0:
            super()._apply_update(prepared, opt)
            return
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
        super()._apply_update(prepared, opt)
        delta = self.momentum
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                m = st.momentum.get(id(p))
                if m is None:  # a parameter added to the optimizer after prepare
                    m = st.momentum[id(p)] = torch.zeros_like(p)
                b.sub_(p)  # b = -u, the optimizer's own update negated
                m.mul_(delta).sub_(b)  # m = momentum * m + u
                p.add_(m, alpha=delta)  # x = x_before + u + momentum * m (Nesterov)

    def _next_step_syncs(self, prepared: Prepared) -> bool:
        # Fault tolerant: the quorum (and a heal) comes before an exchange step.
        return super()._next_step_syncs(prepared) or (
            self.mode == "sync" and (prepared.local_steps + 1) % self.period == 0)

    def _after_update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        if self.rho > 0 or prepared.local_steps % self.period != 0:
            return  # the penalty form exchanged before the step, in _apply_update
        st: _ElasticState = prepared.state["easgd"]
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
                self._ps.fold_bytes()
                for i, (k, t) in enumerate(zip(st.keys, st.tensors, strict=True)):
                    d = d_by_key[k]
                    c = st.center_copy[i] if st.center_copy else None
                    if pull_params or not st.is_param[i]:
                        t.sub_(d, alpha=a)
                    elif c is not None:
                        c.copy_(t).sub_(d, alpha=1.0 - a)  # the center after: x - (1 - a) d
        self._exchanges += 1

    def _finalize(self, prepared: Prepared) -> None:
        """A last elastic exchange when local steps were taken since the previous one, so the
        center (the consensus that ``eval_model`` and ``save`` return) has absorbed every local
        step, as the next scheduled exchange would have. The workers are pulled as in any
        exchange; they do not become equal to the center (EASGD never makes them equal).
        Sync mode: a collective, and every worker counts the same local steps, so all agree
        on whether to exchange. Async mode: each worker exchanges with the shards alone, then
        the workers sharing this strategy's process group (if any) meet at a barrier, so no
        worker reads or saves the center before the others' last exchanges have landed.
        Training may continue; a second call exchanges nothing."""
        st: _ElasticState = prepared.state["easgd"]
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
                    self._ps.fold_bytes()
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
            self._exchanges += 1

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
        self._ps.fold_bytes()
        return [got[k] for k in st.keys]

    def eval_model(self, model: nn.Module) -> nn.Module:
        """A module of the user's class holding the center (built once; in sync mode it
        shares the center's storage, in async mode it is refreshed from the shards at each
        call). Buffers not averaged are this worker's own. Not a collective."""
        prepared = self._find_prepared(model)
        if prepared is None:
            return model
        st: _ElasticState = prepared.state["easgd"]
        if st.eval_module is None:
            st.eval_module = self._center_module(prepared.module, st)
        elif self.mode == "async":
            center = self._center_values(st)
            by_name: dict[str, torch.Tensor] = dict(st.eval_module.named_parameters())
            by_name.update(st.eval_module.named_buffers())
            with torch.no_grad():
                for n, c in zip(st.names, center, strict=True):
                    by_name[n].copy_(c)
        return st.eval_module

    def _center_module(self, module: nn.Module, st: _ElasticState) -> nn.Module:
        center = dict(zip(st.names, self._center_values(st), strict=True))
        local_buffers = dict(module.named_buffers())
        prepared = self._find_prepared(module)
        assert prepared is not None
        clone = self._eval_copy(prepared)
        for n, p in clone.named_parameters():
            # Sync: a view of the center (no copy, always current). Async: the pulled values.
            p.data = center[n]
        for n, b in clone.named_buffers():
            b.data = center[n] if n in center else local_buffers[n]
        return clone

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_model(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st: _ElasticState = prepared.state["easgd"]
        if self.mode == "async" and not self.is_chief:
            # Only the chief's model tensors are written; spare the shards a pull per worker.
            return {k: v.detach() for k, v in prepared.module.state_dict().items()}
        center = {id(t): c for t, c in zip(st.tensors, self._center_values(st), strict=True)}
        return {k: center.get(id(v), v).detach()
                for k, v in prepared.module.state_dict(keep_vars=True).items()}

    def _load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        prepared.module.load_state_dict(state)
        st: _ElasticState = prepared.state["easgd"]
        with torch.no_grad():
            if self.mode == "sync":
                for t, c in zip(st.tensors, st.center, strict=True):
                    c.copy_(t)
                return
            for t, copy_ in zip(st.tensors, st.center_copy, strict=True):
                if copy_ is not None:
                    copy_.copy_(t)
        assert st.table is not None
        if self.is_chief:
            st.table.set_state({"params": self._named(st)})
            self._ps.fold_bytes()
        # Nobody exchanges against the old center once restore returns.
        self.comm.barrier()

    def _strategy_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st: _ElasticState = prepared.state["easgd"]
        out = _gather_ranks(self.comm, st.names, st.tensors, "local")
        if st.momentum:
            names = [n for n, p in prepared.module.named_parameters() if id(p) in st.momentum]
            bufs = [st.momentum[id(p)] for p in prepared.module.parameters()
                    if id(p) in st.momentum]
            out.update(_gather_ranks(self.comm, names, bufs, "momentum"))
        return out

    def _heal_extra(self, prepared: Prepared) -> dict[str, Any]:
        """Sync mode under fault tolerance: the center, EAMSGD's momentum, the exchange
        schedule and the moving rate in force (a joiner then continues as its peer)."""
        st: _ElasticState = prepared.state["easgd"]
        momentum = {n: st.momentum[id(p)] for n, p in prepared.module.named_parameters()
                    if id(p) in st.momentum}
        return {"center": {n: c.detach() for n, c in zip(st.names, st.center, strict=True)},
                "momentum": momentum, "exchanged_at": st.exchanged_at,
                "exchanges": self._exchanges, "moving_rate": self.moving_rate}

    def _load_heal_extra(self, prepared: Prepared, state: dict[str, Any]) -> None:
        st: _ElasticState = prepared.state["easgd"]
        load_center(st.names, st.center, state["center"])
        with torch.no_grad():
            for n, p in prepared.module.named_parameters():
                if id(p) in st.momentum:
                    st.momentum[id(p)].copy_(state["momentum"][n])
        st.exchanged_at = int(state["exchanged_at"])
        self._exchanges = int(state["exchanges"])
        self._moving_rate = float(state["moving_rate"])

    def _load_strategy_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st: _ElasticState = prepared.state["easgd"]
        rank, world = self.replica_id, self.num_replicas_in_sync
        _load_rank(state, "local", rank, world, st.names, st.tensors)
        if st.momentum:
            named = [(n, p) for n, p in prepared.module.named_parameters()
                     if id(p) in st.momentum]
            _load_rank(state, "momentum", rank, world, [n for n, _ in named],
                       [st.momentum[id(p)] for _, p in named])

    # ------------------------------------------------------------------ misc
    def _extra_metrics(self) -> dict[str, Any]:
        return {"exchanges": self._exchanges, "moving_rate": self.moving_rate,
                **self._ps.metrics()}

    def close(self) -> None:
        self._ps.close()
        super().close()
