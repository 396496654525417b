"""Local SGD and DiLoCo: workers train alone and meet every ``period`` steps.

``LocalSGD`` averages the parameters (and buffers) of all workers with one all-reduce every
``period`` local steps, and every step during a warm-up: Lin, Stich, Patel, Jaggi, "Don't use
large mini-batches, use local SGD" (ICLR 2020), which also motivates the warm-up
("post-local SGD").

``DiLoCo`` is the two-level form of Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models" (2023): each worker runs its own (inner) optimizer for ``period``
steps; the pseudo-gradient ``theta_prev - mean_i(theta_i)`` is all-reduced and an outer
Nesterov SGD step is applied to ``theta_prev``; the result becomes every worker's
parameters. ``fragments > 1`` is streaming DiLoCo (Douillard et al., "Streaming DiLoCo",
2025): the parameters are split into fragments synchronised on staggered steps, which spreads
the same bytes over the period instead of one burst.

Both move ``1/period`` of the bytes of an all-reduce per step (``Mirrored`` all-reduces the
gradients every step). The private helpers here (flat buffers grouped by dtype, per-rank
gathers for checkpoints) are shared with :mod:`stratagem.strategies.elastic_average`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm import Comm
from ..comm import flatten as _flatten
from ..comm import views as _views
from ..strategy import Prepared, Strategy

__all__ = ["LocalSGD", "DiLoCo"]

_PSEUDO_GRAD_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------- shared helpers
def _check_int(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}. Fix: {fix}")
    return value


def _synced_tensors(module: nn.Module, buffers: bool) -> tuple[list[str], list[torch.Tensor],
                                                                list[bool]]:
    """The module's unique parameters, then (if ``buffers``) its floating-point buffers, with
    their names and an is-parameter flag. Integer buffers (``num_batches_tracked``) are
    counters, not state to average: they stay local."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    is_param: list[bool] = []
    for n, p in module.named_parameters():
        names.append(n)
        tensors.append(p)
        is_param.append(True)
    if buffers:
        for n, b in module.named_buffers():
            if b.is_floating_point():
                names.append(n)
                tensors.append(b)
                is_param.append(False)
    return names, tensors, is_param


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device): one flat buffer / collective each."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def _average_(comm: Comm, tensors: Sequence[torch.Tensor]) -> None:
    """Replace every tensor by its mean over the replicas: one all-reduce per dtype."""
    if comm.world_size == 1 or not tensors:
        return
    with torch.no_grad():
        comm.all_reduce_coalesced(tensors)
        torch._foreach_div_(list(tensors), comm.world_size)


def _mean_copy(comm: Comm, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The replicas' mean of ``tensors`` as new tensors (the replicas are left untouched)."""
    out: list[torch.Tensor] = [t.detach().clone() for t in tensors]
    _average_(comm, out)
    return out


def _gather_ranks(comm: Comm, names: Sequence[str], tensors: Sequence[torch.Tensor],
                  prefix: str) -> dict[str, torch.Tensor]:
    """Every replica's ``tensors`` as ``{f"{prefix}.rank{r}/{name}": tensor}`` on every rank
    (collective: one all-gather per dtype). Used to checkpoint state only a worker holds."""
    out: dict[str, torch.Tensor] = {}
    for idx in _dtype_groups(tensors):
        group = [tensors[i] for i in idx]
        flat = _flatten(group)
        parts = comm.all_gather(flat) if comm.world_size > 1 else [flat]
        for r, part in enumerate(parts):
            for i, v in zip(idx, _views(part, group), strict=True):
                out[f"{prefix}.rank{r}/{names[i]}"] = v
    return out


def _load_rank(state: dict[str, torch.Tensor], prefix: str, rank: int, world_size: int,
               names: Sequence[str], tensors: Sequence[torch.Tensor]) -> bool:
    """Copy this rank's entries written by :func:`_gather_ranks` into ``tensors``; only when
    the checkpoint was written by as many ranks as there are now (else returns False and the
    caller keeps what ``_load_model`` set)."""
    ranks = {k.split("/", 1)[0] for k in state if k.startswith(f"{prefix}.rank")}
    if len(ranks) != world_size:
        return False
    keys = [f"{prefix}.rank{rank}/{n}" for n in names]
    if any(k not in state or state[k].shape != t.shape for k, t in zip(keys, tensors, strict=True)):
        return False
    with torch.no_grad():
        for k, t in zip(keys, tensors, strict=True):
            t.copy_(state[k])
    return True


# ---------------------------------------------------------------------- LocalSGD
class LocalSGD(Strategy):
    """Local SGD / periodic model averaging (Lin et al. 2020).

    Every worker steps its own optimizer on its own batches; after every ``period``-th local
    step (and after every step while ``local_step <= warmup_steps``) the parameters and
    floating-point buffers are replaced by their mean over the workers, through one all-reduce
    per dtype. With ``period=1`` and plain SGD this is exactly ``Mirrored`` (mean of
    ``x - lr * g_i`` is ``x - lr * mean(g_i)``). The optimizer state stays local to each worker
    (saved per rank). Steps skipped for non-finite gradients are agreed across workers, so
    every worker counts the same local steps.

    Arguments: ``period`` (int >= 1), ``warmup_steps`` (int >= 0), plus the common strategy
    arguments.

    On failure: a dead or stalled peer makes the averaging all-reduce fail within ``timeout``
    seconds and ``optimizer.step()`` raises ``PeerTimeoutError`` naming it; resume from the
    last checkpoint. Memory: no persistent extra copy of the parameters; the averaging uses one
    transient flat buffer (one copy) while it runs.
    """

    name = "local_sgd"
    _synchronous_step = True
    _local_optimizer_state = True

    def __init__(self, *, period: int = 8, warmup_steps: int = 0, **common: Any) -> None:
        self.period = _check_int("period", period, 1,
                                 "pass the number of local steps between averages, e.g. period=8")
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0,
                                       "pass 0 for no warm-up, or the number of initial steps "
                                       "to average after every step")
        super().__init__(**common)
        self._averages = 0

    def _tensors(self, prepared: Prepared) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors, _ = _synced_tensors(prepared.module, buffers=True)
        return names, tensors

    def _after_update(self, prepared: Prepared, opt: Any) -> None:
        step = prepared.local_steps
        if step <= self.warmup_steps or step % self.period == 0:
            _average_(self.comm, self._tensors(prepared)[1])
            self._averages += 1

    def eval_model(self, model: nn.Module) -> nn.Module:
        """A module of the user's class holding the workers' average (what the checkpoint
        keeps), not this worker's drifting model. A collective (one all-reduce): call it on
        every replica. Costs one more copy of the model, made on the first call."""
        prepared = self._find_prepared(model)
        if prepared is None:
            return model
        clone = self._eval_copy(prepared)
        with torch.no_grad():
            clone.load_state_dict(self._checkpoint_model(prepared))
        return clone

    def _finalize(self, prepared: Prepared) -> None:
        """Average the workers' parameters and buffers now (the average the next period would
        make), so every replica, ``eval_model`` and ``save`` hold the same model. The schedule
        is unchanged: training may continue."""
        _average_(self.comm, self._tensors(prepared)[1])
        self._averages += 1

    def _checkpoint_model(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        # Between averages the replicas differ: the model to keep is their mean (what the next
        # average would produce). Collective, like save itself.
        names, tensors = self._tensors(prepared)
        mean = dict(zip(map(id, tensors), _mean_copy(self.comm, tensors), strict=True))
        return {k: mean.get(id(v), v).detach()
                for k, v in prepared.module.state_dict(keep_vars=True).items()}

    def _strategy_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        names, tensors = self._tensors(prepared)
        return {**_gather_ranks(self.comm, names, tensors, "local")}

    def _load_strategy_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        names, tensors = self._tensors(prepared)
        _load_rank(state, "local", self.replica_id, self.num_replicas_in_sync, names, tensors)

    def _extra_metrics(self) -> dict[str, Any]:
        return {"averages": self._averages}


# ---------------------------------------------------------------------- DiLoCo
class _DiLoCoState:
    """Per prepared model: the fragments, the outer parameters and the outer momentum."""

    def __init__(self, names: list[str], params: list[torch.Tensor],
                 fragments: list[list[int]], momentum: bool) -> None:
        self.names = names
        self.params = params
        self.fragments = fragments
        with torch.no_grad():
            self.prev = [p.detach().clone() for p in params]
            self.momentum = [torch.zeros_like(p) for p in params] if momentum else None


def _split_fragments(params: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
    """Contiguous runs of parameter indices, each non-empty, with about equal numbers of
    elements (a tensor goes to the fragment its midpoint falls in)."""
    total = sum(p.numel() for p in params)
    out: list[list[int]] = [[] for _ in range(fragments)]
    k, seen = 0, 0
    for i, p in enumerate(params):
        if out[k] and k < fragments - 1 and (
                fragments - 1 - k >= len(params) - i  # the rest need every remaining tensor
                or (seen + p.numel() / 2) * fragments >= (k + 1) * total):
            k += 1
        out[k].append(i)
        seen += p.numel()
    return out


class DiLoCo(Strategy):
    """DiLoCo (Douillard et al. 2023): local inner optimization, outer Nesterov steps.

    Every worker steps the optimizer given to ``prepare`` (the inner optimizer, typically
    AdamW; its state stays local and is saved per rank) on its own batches. Every ``period``
    local steps the pseudo-gradient ``delta = theta_prev - mean_i(theta_i)`` is all-reduced
    (in bf16 with ``pseudo_grad_dtype="bf16"``: half the bytes), the outer optimizer (SGD with
    Nesterov momentum: ``m = outer_momentum * m + delta``,
    ``theta_prev -= outer_lr * (delta + outer_momentum * m)``) updates ``theta_prev``, and every
    worker's parameters are set to it. With ``outer_lr=1, outer_momentum=0`` this is exactly
    ``LocalSGD(period=period)``. Floating-point buffers are averaged when fragment 0 syncs.

    ``fragments > 1`` (streaming DiLoCo): the parameters are split into ``fragments``
    contiguous groups of about equal size; fragment ``k`` syncs when
    ``local_step % period == k * period // fragments``, so each is still synced once per
    period but the all-reduces are spread over it. The checkpointed model is the outer
    (consensus) parameters ``theta_prev``; the outer momentum and every worker's local
    parameters go in the strategy state, so a resume with the same workers is exact.

    Arguments: ``period`` (int >= 1), ``outer_lr`` (> 0), ``outer_momentum`` (in [0, 1)),
    ``fragments`` (int, 1 <= fragments <= period and <= the number of parameter tensors),
    ``pseudo_grad_dtype`` (None or "bf16"), plus the common strategy arguments.

    On failure: a dead or stalled peer makes the outer all-reduce fail within ``timeout``
    seconds and ``optimizer.step()`` raises ``PeerTimeoutError`` naming it; resume from the
    last checkpoint. Memory: two extra copies of the parameters (``theta_prev`` and the outer
    momentum; one when ``outer_momentum == 0``), plus a transient flat buffer the size of the
    fragment being synced.
    """

    name = "diloco"
    _synchronous_step = True
    _local_optimizer_state = True

    def __init__(self, *, period: int = 500, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, pseudo_grad_dtype: str | None = None,
                 **common: Any) -> None:
        self.period = _check_int("period", period, 1,
                                 "pass the number of inner steps between outer steps, e.g. 500")
        self.fragments = _check_int("fragments", fragments, 1,
                                    "pass 1 for plain DiLoCo, or k > 1 for streaming DiLoCo")
        if fragments > period:
            raise ValueError(f"fragments must be <= period so that fragments sync on distinct "
                             f"steps, got fragments={fragments} > period={period}. Fix: lower "
                             "fragments or raise period")
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or \
                not outer_lr > 0:
            raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}. Fix: pass e.g. "
                             "outer_lr=0.7 (the DiLoCo paper's value)")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) or \
                not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}. Fix: "
                             "pass e.g. outer_momentum=0.9, or 0 for plain outer SGD")
        if pseudo_grad_dtype not in _PSEUDO_GRAD_DTYPES:
            raise ValueError(f"pseudo_grad_dtype must be None or 'bf16', got "
                             f"{pseudo_grad_dtype!r}. Fix: pass None (full precision) or 'bf16'")
        super().__init__(**common)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.pseudo_grad_dtype = pseudo_grad_dtype
        self._offsets = [k * self.period // self.fragments for k in range(self.fragments)]
        self._outer_steps = 0

    def _setup(self, prepared: Prepared) -> None:
        names, params, _ = _synced_tensors(prepared.module, buffers=False)
        if self.fragments > len(params):
            raise ValueError(f"fragments must be <= the number of parameter tensors "
                             f"({len(params)}), got fragments={self.fragments}. Fix: lower "
                             "fragments")
        prepared.state["diloco"] = _DiLoCoState(names, params,
                                                _split_fragments(params, self.fragments),
                                                momentum=self.outer_momentum > 0)

    def _after_update(self, prepared: Prepared, opt: Any) -> None:
        phase = prepared.local_steps % self.period
        for k, offset in enumerate(self._offsets):
            if offset == phase:
                self._outer_step(prepared.state["diloco"], k)
                if k == 0:
                    _average_(self.comm, [b for b in prepared.module.buffers()
                                          if b.is_floating_point()])

    def _outer_step(self, st: _DiLoCoState, k: int) -> None:
        idx = st.fragments[k]
        wire = _PSEUDO_GRAD_DTYPES[self.pseudo_grad_dtype]
        mu, lr = self.outer_momentum, self.outer_lr
        with torch.no_grad():
            for group in _dtype_groups([st.params[i] for i in idx]):
                members = [idx[j] for j in group]
                params = [st.params[i] for i in members]
                delta = _flatten([st.prev[i] for i in members]).sub_(_flatten(params))
                if wire is not None and delta.dtype != wire:
                    sent = self.comm.all_reduce(delta.to(wire))
                    delta.copy_(sent)
                else:
                    self.comm.all_reduce(delta)
                delta.div_(self.num_replicas_in_sync)
                for i, d in zip(members, _views(delta, params), strict=True):
                    if st.momentum is not None:
                        m = st.momentum[i]
                        m.mul_(mu).add_(d)
                        d.add_(m, alpha=mu)  # Nesterov: step along delta + mu * m
                    st.prev[i].sub_(d, alpha=lr)
                    st.params[i].copy_(st.prev[i])
        self._outer_steps += 1

    def eval_model(self, model: nn.Module) -> nn.Module:
        """A module of the user's class holding the outer (consensus) parameters
        ``theta_prev`` — the model the checkpoint keeps — rather than this worker's drifting
        inner model. Not a collective. Costs one more copy of the model, made on the first
        call. After :meth:`finalize` it is the workers' average."""
        prepared = self._find_prepared(model)
        if prepared is None:
            return model
        outer = self._eval_copy(prepared)
        with torch.no_grad():
            outer.load_state_dict(self._checkpoint_model(prepared))
        return outer

    def _finalize(self, prepared: Prepared) -> None:
        """Replace the outer parameters by the plain average of the workers' current
        parameters and set every worker to it (floating-point buffers are averaged too).

        This is an outer step with ``outer_lr=1`` and no momentum on the pending
        pseudo-gradient of every fragment: the consensus then includes every inner step, which
        a regular Nesterov outer step would not (it extrapolates a pseudo-gradient of a
        period that may be incomplete). The outer momentum is left as it is, so training may
        continue: the next outer step starts from the average. Calling it twice changes
        nothing (the workers are equal)."""
        st: _DiLoCoState = prepared.state["diloco"]
        _average_(self.comm, st.params)
        _average_(self.comm, [b for b in prepared.module.buffers() if b.is_floating_point()])
        with torch.no_grad():
            for p, q in zip(st.params, st.prev, strict=True):
                q.copy_(p)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_model(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st: _DiLoCoState = prepared.state["diloco"]
        outer = {id(p): q for p, q in zip(st.params, st.prev, strict=True)}
        return {k: outer.get(id(v), v).detach()
                for k, v in prepared.module.state_dict(keep_vars=True).items()}

    def _load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        prepared.module.load_state_dict(state)
        st: _DiLoCoState = prepared.state["diloco"]
        with torch.no_grad():
            for p, q in zip(st.params, st.prev, strict=True):
                q.copy_(p)

    def _strategy_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st: _DiLoCoState = prepared.state["diloco"]
        out = _gather_ranks(self.comm, st.names, st.params, "local")
        if st.momentum is not None:
            out.update({f"outer_momentum/{n}": m
                        for n, m in zip(st.names, st.momentum, strict=True)})
        return out

    def _load_strategy_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st: _DiLoCoState = prepared.state["diloco"]
        if st.momentum is not None:
            with torch.no_grad():
                for n, m in zip(st.names, st.momentum, strict=True):
                    saved = state.get(f"outer_momentum/{n}")
                    if saved is not None and saved.shape == m.shape:
                        m.copy_(saved)
        _load_rank(state, "local", self.replica_id, self.num_replicas_in_sync, st.names,
                   st.params)

    def _extra_metrics(self) -> dict[str, Any]:
        return {"outer_steps": self._outer_steps}
