"""The outer step of DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023), driven by a real ``torch.optim`` optimizer, as torchft does.

Every ``period`` local steps the pseudo-gradient ``delta = theta_prev - mean_i(theta_i)`` is
all-reduced over the Comm and handed to the outer optimizer as the gradient of the outer
parameters ``theta_prev`` (``theta_prev.grad = delta; outer_optimizer.step()``); the result
becomes every worker's parameters. The default outer optimizer is SGD with Nesterov momentum
(lr 0.7, momentum 0.9, the paper's values): ``m = mu m + delta``, ``theta_prev -= lr (delta +
mu m)``. ``fragments > 1`` is streaming DiLoCo (Douillard et al., "Streaming DiLoCo", 2025):
contiguous groups of parameters synchronised on staggered steps; parameters outside the
fragment being synchronised have no gradient, so the outer optimizer leaves them (and their
state) untouched.

On slow links: ``compression="int8"|"int4"`` quantizes the pseudo-gradient
blockwise (:mod:`stratagem.quantize`; all-reduced by :meth:`Comm.all_reduce_quantized`, as
INTELLECT-1 does with int8, Jaghouar et al. 2024) with error feedback (Seide et al. 2014;
Karimireddy et al. 2019): each replica keeps what its quantizations dropped and adds it to the
next pseudo-gradient of the same parameters. ``sync_delay`` and ``alpha`` are Streaming
DiLoCo's overlap (Douillard et al., "Streaming DiLoCo with overlapping communication", 2025:
tau and alpha): the fragment's all-reduce runs in the background while ``sync_delay`` inner
steps compute, and the landed outer parameters are mixed with the local ones.
``compression="topk"`` (``"topk:DENSITY+intBITS"``) is SparseLoCo (Sarfi et al.,
"Communication Efficient LLM Pre-training with SparseLoCo", 2025): per chunk of 4096 values
only the largest entries of pseudo-gradient + residual are sent, at 2 bits, through
:meth:`Comm.all_reduce_topk`; the residual keeps everything not sent.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Comm, flatten, views
from ..compression import OUTER_KINDS, QUANTIZED_KINDS, check_compression, wire_dtype
from ..quantize import DEFAULT_BLOCK, check_block
from ..sparsify import TopK, is_topk, parse_topk
from .base import Capability, Part
from .tensors import (
    average_committed_,
    dtype_groups,
    gather_ranks,
    like,
    load_rank,
    local,
    synced_tensors,
)

if TYPE_CHECKING:
    from ..strategy import Prepared

__all__ = ["OuterStep", "OuterOptimizerFactory", "split_fragments", "MOMENTUM_KEY",
           "RESIDUAL_KEY"]

#: ``params -> optimizer``: builds the outer optimizer over the outer parameters.
OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

#: The checkpoint key of SGD's momentum buffer (the name DiLoCo checkpoints have always used).
MOMENTUM_KEY = "outer_momentum"
#: Checkpoint keys of the quantization residuals (per rank) and of an all-reduce in flight.
RESIDUAL_KEY = "residual"
_PENDING_KEY = "pending_outer"


def split_fragments(params: Sequence[torch.Tensor], fragments: int) -> list[list[int]]:
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


class _OuterState:
    """Per prepared model: the fragments, the outer parameters and the outer optimizer; with a
    quantized wire, this replica's error-feedback residuals; with ``sync_delay > 0``, the
    fragment whose outer all-reduce is in flight."""

    def __init__(self, names: list[str], params: list[torch.Tensor],
                 fragments: list[list[int]], factory: OuterOptimizerFactory,
                 quantized: bool) -> None:
        self.names = names
        self.originals = params  # the module's parameters (DTensors when sharded)
        self.params = [local(p) for p in params]  # what this process synchronises
        self.fragments = fragments
        with torch.no_grad():
            self.prev = [p.detach().clone() for p in self.params]
        optimizer = factory(self.prev)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must build a torch.optim.Optimizer from the outer "
                            f"parameters, got {type(optimizer).__name__}. Fix: pass e.g. "
                            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, "
                            "momentum=0.9, nesterov=True)")
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if owned != {id(p) for p in self.prev}:
            raise ValueError("outer_optimizer must optimize exactly the parameters it is given "
                             "(the outer copies), got an optimizer over other tensors. Fix: "
                             "build it from the list passed to the factory")
        self.optimizer = optimizer
        #: What quantization dropped from this replica's pseudo-gradients (fp32, unscaled,
        #: in sum units), added to the next ones: committed when the outer step is applied.
        self.residual: list[torch.Tensor] | None = (
            [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
            if quantized else None)
        self.flight: _Flight | None = None


#: One dtype group of a fragment: its parameter indices, the summed pseudo-gradient (flat) and
#: what this replica's part of it dropped (quantized wire only).
_Reduced = tuple[list[int], torch.Tensor, "torch.Tensor | None"]


class _Flight:
    """A fragment's outer all-reduce started ``sync_delay`` steps before it is applied."""

    def __init__(self, k: int, apply_phase: int,
                 future: concurrent.futures.Future[list[_Reduced]] | None,
                 results: list[_Reduced] | None = None) -> None:
        self.k = k
        self.apply_phase = apply_phase
        self.future = future
        self.results = results


class OuterStep(Part):
    """DiLoCo's outer step over ``comm`` (see the module docstring).

    ``outer_optimizer`` is a factory ``params -> torch.optim.Optimizer`` (default: SGD,
    ``lr=outer_lr``, Nesterov momentum ``outer_momentum``; plain SGD when it is 0).
    ``compression`` (a key of ``compression.OUTER_KINDS``) is the pseudo-gradient's form on the
    wire: None (its own dtype), "bf16"/"fp16" (a cast), or "int8"/"int4" (blockwise
    quantization, ``block`` values per fp32 scale, through :meth:`Comm.all_reduce_quantized`,
    with error feedback: what quantization dropped is kept per replica, added to the next
    pseudo-gradient of the same parameters, committed when the outer step is applied and
    checkpointed), or "topk" / "topk:DENSITY+intBITS" (SparseLoCo's top-k per 4096-value chunk
    at 2 bits, through :meth:`Comm.all_reduce_topk`, with the same error feedback, which then
    also keeps every entry not sent).

    ``sync_delay`` (the Streaming DiLoCo paper's tau) > 0: a fragment's pseudo-gradient is
    all-reduced on a background thread, over a sub-Comm of its own (split from ``comm`` at
    ``setup``), while the next ``sync_delay`` inner steps compute; then the outer optimizer
    steps and the fragment's local parameters become ``alpha * local + (1 - alpha) *
    outer`` (``alpha`` = 0: the outer parameters). ``sync_delay=0, alpha=0`` is the
    synchronous schedule. Floating-point buffers are averaged (synchronously) when fragment 0
    syncs. The consensus (checkpoint, ``eval_model``) is ``theta_prev`` — not a collective.

    Memory: two extra copies of the parameters with the default optimizer (``theta_prev`` and
    the momentum), one fp32 copy more for the residuals of a quantized or top-k wire, plus transient
    flat buffers the size of the fragment being synced (two while one is in flight).
    """

    name = "outer_step"
    replicated = False
    provides = frozenset({Capability.SYNCHRONOUS_STEP, Capability.TRANSACTIONS,
                          Capability.LOCAL_OPTIMIZER_STATE, Capability.OUTER})

    def __init__(self, comm: Comm, *, period: int, outer_optimizer: OuterOptimizerFactory,
                 fragments: int = 1, compression: str | None = None, sync_delay: int = 0,
                 alpha: float = 0.0, block: int = DEFAULT_BLOCK) -> None:
        super().__init__(comm)
        self.period = period
        self.fragments = fragments
        self.factory = outer_optimizer
        check_compression(compression, kinds=OUTER_KINDS)
        self.quantized: str | None = compression if compression in QUANTIZED_KINDS else None
        self.sparse: TopK | None = parse_topk(compression) if is_topk(compression) else None
        self.wire = None if self.quantized or self.sparse else wire_dtype(compression)
        self.block = check_block(block)
        self.offsets = [k * period // fragments for k in range(fragments)]
        gap = period // fragments
        if isinstance(sync_delay, bool) or not isinstance(sync_delay, int) \
                or not 0 <= sync_delay < gap:
            raise ValueError(
                f"sync_delay must be an int in [0, period // fragments) = [0, {gap}) so that a "
                f"fragment's outer all-reduce is applied before the next fragment's starts, "
                f"got sync_delay={sync_delay!r} (period={period}, fragments={fragments}). Fix: "
                "lower sync_delay, or raise period")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
                or not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha (the weight of the local parameters when an outer step "
                             f"lands) must be a number in [0, 1), got {alpha!r}. Fix: pass 0 "
                             "(take the outer parameters) or e.g. 0.5")
        self.sync_delay = sync_delay
        self.alpha = float(alpha)
        self.outer_steps = 0
        #: Seconds the training thread waited for outer all-reduces (all of a synchronous
        #: one; only the tail of an overlapped one that had not landed when due).
        self.wait_seconds = 0.0
        self._background: Comm | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._counted = (0, 0, 0.0)

    def setup(self, prepared: Prepared) -> None:
        names, params, _ = synced_tensors(prepared.module, buffers=False)
        if self.fragments > len(params):
            raise ValueError(f"fragments must be <= the number of parameter tensors "
                             f"({len(params)}), got fragments={self.fragments}. Fix: lower "
                             "fragments")
        if (self.quantized or self.sparse) and any(not p.is_floating_point() for p in params):
            raise TypeError("compression='int8'/'int4'/'topk' needs floating-point parameters. "
                            "Fix: pass compression=None")
        if self.sync_delay > 0 and self._background is None:
            try:
                self._background = self.comm.split([list(range(self.comm.world_size))],
                                                   name="outer_overlap")
            except NotImplementedError:
                raise ValueError(
                    "sync_delay > 0 needs a Comm that can split off a group for the background "
                    f"all-reduce; {type(self.comm).__name__} cannot (a Hierarchical outer "
                    "runs over a relay). Fix: pass sync_delay=0 here") from None
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sg-outer-overlap")
        prepared.state[self.name] = _OuterState(names, params,
                                                split_fragments(params, self.fragments),
                                                self.factory, self._feedback)

    @property
    def _feedback(self) -> bool:
        """Whether the wire keeps error-feedback residuals (quantized or top-k)."""
        return self.quantized is not None or self.sparse is not None

    def _state(self, prepared: Prepared) -> _OuterState:
        st: _OuterState = prepared.state[self.name]
        return st

    def syncs_at(self, prepared: Prepared, step: int) -> bool:
        return step % self.period in self.offsets

    def after_update(self, prepared: Prepared) -> None:
        phase = prepared.local_steps % self.period
        st = self._state(prepared)
        if st.flight is not None and (st.flight.apply_phase == phase or self.sync_delay == 0
                                      or st.flight.apply_phase >= self.period):
            self._land(st)  # (a flight restored under another schedule lands at once)
        for k, offset in enumerate(self.offsets):
            if offset == phase:
                buffers = ([b for b in prepared.module.buffers() if b.is_floating_point()]
                           if k == 0 else [])
                if self.sync_delay == 0:
                    self.step(st, k, buffers)  # buffers averaged in the same transaction
                else:
                    self._launch(st, k, (phase + self.sync_delay) % self.period)
                    average_committed_(self.comm, buffers)

    # ------------------------------------------------------------------ one outer step
    def _pseudo_gradients(self, st: _OuterState, k: int) -> list[tuple[list[int], torch.Tensor]]:
        """Fragment ``k``'s pseudo-gradient ``theta_prev - theta`` per dtype group (flat; fp32
        plus this replica's residual on a quantized wire)."""
        idx = st.fragments[k]
        out = []
        with torch.no_grad():
            for group in dtype_groups([st.params[i] for i in idx]):
                members = [idx[j] for j in group]
                params = [st.params[i] for i in members]
                delta = flatten([st.prev[i] for i in members]).sub_(flatten(params))
                if st.residual is not None:
                    delta = delta.float().add_(flatten([st.residual[i] for i in members]))
                out.append((members, delta))
        return out

    def _reduce(self, comm: Comm, groups: list[tuple[list[int], torch.Tensor]]
                ) -> list[_Reduced]:
        """Sum every group's pseudo-gradient over ``comm`` (may run on the background
        thread: touches nothing but its arguments)."""
        out: list[_Reduced] = []
        with torch.no_grad():
            for members, delta in groups:
                if self.sparse is not None:
                    lost = torch.empty_like(delta)
                    summed = comm.all_reduce_topk(delta, self.sparse, lost=lost)
                    out.append((members, summed, lost))
                    continue
                if self.quantized is not None:
                    lost = torch.empty_like(delta)
                    summed = comm.all_reduce_quantized(delta, self.quantized, block=self.block,
                                                       lost=lost)
                    out.append((members, summed, lost))
                    continue
                if self.wire is not None and delta.dtype != self.wire:
                    delta.copy_(comm.all_reduce(delta.to(self.wire)))
                else:
                    comm.all_reduce(delta)
                out.append((members, delta, None))
        return out

    def _apply(self, st: _OuterState, k: int, results: list[_Reduced]) -> None:
        """Step the outer optimizer on fragment ``k``'s summed pseudo-gradients, commit the
        residuals, and set the fragment's parameters (mixed with the local ones by alpha)."""
        world = self.comm.world_size
        idx = st.fragments[k]
        with torch.no_grad():
            for members, summed, lost in results:
                params = [st.params[i] for i in members]
                delta = summed
                if delta.dtype != params[0].dtype:
                    delta = delta.to(params[0].dtype)
                delta.div_(world)
                for i, d in zip(members, views(delta, params), strict=True):
                    st.prev[i].grad = d
                if lost is not None and st.residual is not None:
                    for i, e in zip(members, views(lost, params), strict=True):
                        st.residual[i].copy_(e)
        st.optimizer.step()
        with torch.no_grad():
            for i in idx:
                st.prev[i].grad = None
                if self.alpha == 0.0:
                    st.params[i].copy_(st.prev[i])
                else:
                    st.params[i].mul_(self.alpha).add_(st.prev[i], alpha=1.0 - self.alpha)
        self.outer_steps += 1

    def step(self, st: _OuterState, k: int, buffers: Sequence[torch.Tensor] = ()) -> None:
        """One synchronous outer step on fragment ``k``: all-reduce its pseudo-gradient, step
        the outer optimizer, set the workers' parameters to the result; ``buffers`` are
        averaged in the same transaction. Under a fault-tolerant Comm a failed all-reduce
        applies nothing (nor commits residuals): the workers keep their local parameters and
        the fragment's next outer step carries the whole drift since ``theta_prev``."""
        t0 = time.perf_counter()
        self.comm.begin()
        results = self._reduce(self.comm, self._pseudo_gradients(st, k))
        self.wait_seconds += time.perf_counter() - t0
        if not average_committed_(self.comm, list(buffers)):
            return
        self._apply(st, k, results)

    def _launch(self, st: _OuterState, k: int, apply_phase: int) -> None:
        assert self._pool is not None and self._background is not None
        groups = self._pseudo_gradients(st, k)
        future = self._pool.submit(self._reduce, self._background, groups)
        st.flight = _Flight(k, apply_phase, future)

    def _results(self, flight: _Flight) -> list[_Reduced]:
        """The flight's results, waiting for them (bounded: the collectives inside have the
        Comm's timeout; this bounds the thread as a whole)."""
        if flight.results is None:
            assert flight.future is not None
            t0 = time.perf_counter()
            try:
                flight.results = flight.future.result(timeout=4 * self.comm.timeout + 10.0)
            except concurrent.futures.TimeoutError:
                raise self.comm.diagnose(TimeoutError("the background outer all-reduce did "
                                                      "not finish"), "outer all_reduce") from None
            finally:
                self.wait_seconds += time.perf_counter() - t0
            self._count_background()
        return flight.results

    def _count_background(self) -> None:
        """Add the background sub-Comm's bytes and seconds to this part's Comm (where the
        strategy's metrics read them)."""
        bg = self._background
        if bg is None:
            return
        sent, received, seconds = self._counted
        self.comm.account(bg.bytes_sent - sent, bg.bytes_received - received,
                          bg.seconds - seconds)
        self._counted = (bg.bytes_sent, bg.bytes_received, bg.seconds)

    def _land(self, st: _OuterState) -> None:
        flight, st.flight = st.flight, None
        if flight is not None:
            self._apply(st, flight.k, self._results(flight))

    def finalize(self, prepared: Prepared) -> None:
        """Replace the outer parameters by the plain average of the workers' current
        parameters and set every worker to it (floating-point buffers are averaged too).

        An outer step with lr 1 and no momentum on the pending pseudo-gradient of every
        fragment: the consensus then includes every inner step, which an outer optimizer step
        would not (it extrapolates a pseudo-gradient of a period that may be incomplete). The
        outer optimizer's state is left as it is, so training may continue. Calling it twice
        changes nothing (the workers are equal)."""
        st = self._state(prepared)
        self._land(st)  # an all-reduce in flight is applied first
        average_committed_(self.comm, st.params)
        average_committed_(self.comm, [b for b in prepared.module.buffers()
                                       if b.is_floating_point()])
        with torch.no_grad():
            for p, q in zip(st.params, st.prev, strict=True):
                q.copy_(p)

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        outer = {id(p): like(p, q) for p, q in zip(st.originals, st.prev, strict=True)}
        return {k: outer.get(id(v), v) for k, v in state.items()}

    def loaded(self, prepared: Prepared) -> None:
        st = self._state(prepared)
        if st.flight is not None:  # the all-reduce of the pre-restore trajectory: let it end
            self._results(st.flight)
            st.flight = None
        with torch.no_grad():
            for p, q in zip(st.params, st.prev, strict=True):
                q.copy_(p)
            for e in st.residual or []:
                e.zero_()  # restored by load_extra_state when the checkpoint has them

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        st = self._state(prepared)
        out = gather_ranks(self.comm, st.names, st.params, "local")
        for n, q in zip(st.names, st.prev, strict=True):
            for key, value in st.optimizer.state.get(q, {}).items():
                if isinstance(value, torch.Tensor):
                    name = MOMENTUM_KEY if key == "momentum_buffer" else f"outer_{key}"
                    out[f"{name}/{n}"] = value
        residual = list(st.residual) if st.residual is not None else None
        if st.flight is not None:
            # An all-reduce in flight: saved as landed (its sum, and the residuals it will
            # commit), so a resume applies it on the same step as the uninterrupted run.
            flight = st.flight
            for members, summed, lost in self._results(flight):
                params = [st.params[i] for i in members]
                for i, v in zip(members, views(summed, params), strict=True):
                    out[f"{_PENDING_KEY}/{st.names[i]}"] = v.clone()
                if lost is not None and residual is not None:
                    for i, e in zip(members, views(lost, params), strict=True):
                        residual[i] = e
            out[f"{_PENDING_KEY}.meta"] = torch.tensor(
                [flight.k, flight.apply_phase, self.comm.world_size], dtype=torch.int64)
        if residual is not None:
            out.update(gather_ranks(self.comm, st.names, residual, RESIDUAL_KEY))
        return out

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st = self._state(prepared)
        outer = dict(zip(st.names, st.prev, strict=True))
        momentum = _uses_momentum(st.optimizer)
        with torch.no_grad():
            for key, saved in state.items():
                head, _, name = key.partition("/")
                q = outer.get(name)
                if q is None or not head.startswith("outer_") or (
                        saved.dim() > 0 and saved.shape != q.shape):
                    continue
                if head == MOMENTUM_KEY:
                    if momentum:
                        st.optimizer.state[q]["momentum_buffer"] = saved.clone()
                else:
                    st.optimizer.state[q][head[len("outer_"):]] = saved.clone()
        load_rank(state, "local", self.comm.rank, self.comm.world_size, st.names, st.params)
        if st.residual is not None:
            load_rank(state, RESIDUAL_KEY, self.comm.rank, self.comm.world_size, st.names,
                      st.residual)
        self._load_pending(st, state)

    def _load_pending(self, st: _OuterState, state: dict[str, torch.Tensor]) -> None:
        """Put back an outer all-reduce that was in flight at the save (as landed), when the
        checkpoint's world size and fragments match."""
        meta = state.get(f"{_PENDING_KEY}.meta")
        if meta is None or meta.numel() != 3:
            return
        k, apply_phase, world = (int(v) for v in meta.tolist())
        if world != self.comm.world_size or not 0 <= k < len(st.fragments):
            return
        idx = st.fragments[k]
        saved = [state.get(f"{_PENDING_KEY}/{st.names[i]}") for i in idx]
        if any(v is None or v.shape != st.params[i].shape for v, i in zip(saved, idx)):
            return
        results: list[_Reduced] = []
        for group in dtype_groups([st.params[i] for i in idx]):
            members = [idx[j] for j in group]
            dtype = torch.float32 if self._feedback else st.params[members[0]].dtype
            summed = flatten([state[f"{_PENDING_KEY}/{st.names[i]}"] for i in members])
            results.append((members, summed.to(dtype), None))
        st.flight = _Flight(k, apply_phase, None, results)

    def heal_state(self, prepared: Prepared) -> dict[str, Any]:
        st = self._state(prepared)
        out: dict[str, Any] = {
            "prev": {n: q.detach() for n, q in zip(st.names, st.prev, strict=True)},
            "optimizer": st.optimizer.state_dict(), "outer_steps": self.outer_steps}
        if st.residual is not None:  # the peer's error feedback: a healed replica continues it
            out["residual"] = {n: e for n, e in zip(st.names, st.residual, strict=True)}
        return out

    def load_heal_state(self, prepared: Prepared, state: dict[str, Any]) -> None:
        st = self._state(prepared)
        with torch.no_grad():
            for n, q in zip(st.names, st.prev, strict=True):
                q.copy_(state["prev"][n])
        st.optimizer.load_state_dict(state["optimizer"])
        self.outer_steps = int(state["outer_steps"])
        if st.residual is not None:
            saved = state.get("residual", {})
            with torch.no_grad():
                for n, e in zip(st.names, st.residual, strict=True):
                    if n in saved:
                        e.copy_(saved[n])
                    else:
                        e.zero_()

    def metrics(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "outer_wait_seconds": self.wait_seconds}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _uses_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return any(float(g.get("momentum", 0.0) or 0.0) > 0 for g in optimizer.param_groups)
