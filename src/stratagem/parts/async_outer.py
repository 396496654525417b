"""Asynchronous (decoupled) DiLoCo: replicas that never wait for slower ones.

Synchronous DiLoCo (:class:`~stratagem.parts.OuterStep`) all-reduces every replica's
pseudo-gradient at each outer step, so the slowest replica sets the pace and a failure stalls
everyone. Here the global model lives on parameter-server shards, as the center of
asynchronous EASGD does, and the outer step happens there, in *rounds*
(:mod:`stratagem.ps.rules`, mode "outer"):

- every ``period`` inner steps a replica sends its pseudo-gradient ``theta_base - theta``
  (``theta_base`` is the global model it last received, at version ``v``) with the number of
  inner steps it covers, in the background, and keeps training; a replica that has not sent
  for ``grace_window`` seconds sends what it has at its next step (a *partial*
  pseudo-gradient, covering fewer steps and weighted by them);
- the shard adds it to the open round with weight ``steps * s(staleness)``, ``staleness`` =
  the rounds closed since ``v`` and ``s`` the staleness rule (``"inverse"``: ``1 / (1 +
  staleness)``; ``"none"``: 1);
- a round closes when it holds ``min_contributions`` pseudo-gradients, or when a replica
  waiting for it finds its grace window (``grace_window`` seconds since its first
  contribution) over; its weighted sum divided by the larger of its steps and a full round's
  (replicas x period) is the gradient of one step of the outer optimizer (SGD with Nesterov
  momentum by default), on the shard, which keeps the optimizer's state;
- when the round a replica contributed to has closed, the replica moves onto the new global
  model, keeping the inner steps it took meanwhile: ``theta = theta_new + (theta -
  theta_sent)``. It waits only if that round is still open when its *next* pseudo-gradient is
  due (counted in ``outer_waits``), or, with ``land_within=k`` (DiLoCo's ``sync_delay``),
  ``k`` inner steps after sending: 0 waits for the round at once, so no inner step is taken
  on the model the pseudo-gradient was computed from (measured in
  ``benchmarks/results/decoupled.md``: the steps taken meanwhile and grafted on cost
  validation loss).

So with ``min_contributions`` below the number of replicas, a replica slower than the
``min_contributions`` fastest is never waited for: its pseudo-gradients join whichever round
is open, discounted by their staleness. With every replica equally fast and
``min_contributions`` = replicas, a round is exactly synchronous DiLoCo's outer step.

Why divide by a full round's steps, not by the round's own: every sample then moves the
global model by the same amount however rounds are grouped (a round of 3 of 4 replicas moves
it 3/4 as far as a synchronous step; the fourth pseudo-gradient comes in the next round), and
a lone pseudo-gradient closed by the grace window counts as one replica's share, not as the
whole round's.

Lineage: Liu et al., "Asynchronous Local-SGD Training for Language Modeling" (2024) on
staleness and outer momentum; DeepMind's Decoupled DiLoCo (2026) on rounds with a minimum
quorum and a grace window; Zhang et al., IJCAI 2016, on the staleness-aware rate.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import Comm
from ..compression import ASYNC_OUTER_KINDS, check_compression
from ..quantize import QUANT_KINDS
from .base import Capability, Part

# Synchronous DiLoCo's checkpoint keys: a checkpoint restores into either mode.
from .outer import MOMENTUM_KEY, RESIDUAL_KEY, OuterOptimizerFactory
from .tensors import gather_ranks, load_rank, synced_tensors

if TYPE_CHECKING:
    from ..ps.table import Contribution, RoundEnd, ShardedParameters
    from ..strategy import Prepared

__all__ = ["AsyncOuterStep", "ASYNC_KINDS"]

#: What an asynchronous pseudo-gradient may be sent as.
ASYNC_KINDS = ASYNC_OUTER_KINDS


class _Flight:
    """A pseudo-gradient sent in the background: its round's outcome, once it is known, and
    the replica's tensors when it was sent (to carry the steps taken since onto the new
    global model)."""

    def __init__(self, future: concurrent.futures.Future[tuple[Contribution, RoundEnd]],
                 sent: list[torch.Tensor], lost: dict[str, torch.Tensor] | None) -> None:
        self.future = future
        self.sent = sent
        self.lost = lost


class _State:
    """Per prepared model: the synchronised tensors, their names on the shards, the global
    model they started from and its versions, the error-feedback residuals, the flight."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], prefix: str,
                 quantized: bool) -> None:
        self.names = names
        self.tensors = tensors
        self.keys = [prefix + n for n in names]
        self.table: ShardedParameters | None = None
        self.base: list[torch.Tensor] = []
        self.base_versions: dict[str, int] = {}  # per part key on the shards
        #: per part key, the lineage of the shard slot ``base`` was read from in a round's
        #: fetch (empty after a pull: the next fetch brings the values themselves)
        self.base_lineage: dict[str, int] = {}
        self.residual: list[torch.Tensor] | None = (
            [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
            if quantized else None)
        self.since = 0  # inner steps since the last pseudo-gradient was sent
        self.sent_at = time.monotonic()  # when it was sent (or the replica started)
        self.flight: _Flight | None = None
        self.left = False  # told the shards it sends no more (finalize)
        self.eval_module: nn.Module | None = None


class AsyncOuterStep(Part):
    """Asynchronous DiLoCo over parameter-server shards at ``ps_addresses`` (see the module
    docstring and :class:`stratagem.DiLoCo`).

    ``outer_optimizer``: a factory ``params -> torch.optim.Optimizer`` whose class and
    hyperparameters are rebuilt on the shards (SGD, Adam, AdamW, RMSprop, Adagrad).
    ``min_contributions`` (None: replicas - 1, at least 1), ``grace_window`` (seconds, None:
    rounds close only when full), ``staleness`` ("inverse" or "none"), ``compression`` (None,
    "bf16", "fp16", "int8", "int4"; the quantized kinds keep error-feedback residuals per
    replica, checkpointed under synchronous DiLoCo's names), ``compress_download`` (with a
    ``compression``, the global model comes back in the same kind: the shards keep their model
    equal to the encoded round updates applied in turn, with error feedback of their own, and
    a replica a round or a few behind fetches those updates, not the model;
    :mod:`stratagem.ps.updates`), ``land_within`` (None: land when the round has closed, by
    the next pseudo-gradient at the latest; an int k: at most k inner steps after sending,
    waiting for the round if it is still open).

    On failure: a replica that dies loses only its pseudo-gradient in flight and the inner
    steps since the last one; a (re)started replica starts from the newest global model. A
    shard that is lost (unreachable, or restarted empty at its address) is seeded again by
    every replica with the newest global model it holds (``set_state(if_newer=True)``: the
    newest copy wins), so no round a live replica has received is lost; the outer optimizer's
    state (momentum) starts again from zero, and the pseudo-gradients of the open round are
    sent again. A shard still unreachable after ``timeout`` raises
    ``ParameterServerUnavailable`` naming it; a round still open after ``timeout`` (too few
    replicas and no grace window) raises ``PeerTimeoutError`` at the next pseudo-gradient.

    Memory: one copy of the model (the global model last received) and, while a
    pseudo-gradient is in flight, one more (the tensors as sent) plus the pseudo-gradient;
    the quantized kinds add an fp32 copy (the residuals).
    """

    name = "async_outer"
    replicated = False

    def __init__(self, comm: Comm, *, period: int, outer_optimizer: OuterOptimizerFactory,
                 compression: str | None, min_contributions: int | None,
                 grace_window: float | None, staleness: str, ps_addresses: Sequence[str],
                 timeout: float, compress_download: bool = True,
                 land_within: int | None = None) -> None:
        super().__init__(comm)
        from ..ps.link import PSLink

        self.period = period
        self.factory = outer_optimizer
        self.compression = check_compression(compression, kinds=ASYNC_KINDS)
        #: the kind the global model comes down in (None: the values themselves)
        self.down = self.compression if compress_download else None
        self.given_min_contributions = min_contributions
        self.grace_window = grace_window
        self.staleness = staleness
        self.timeout = float(timeout)
        self.land_within = land_within
        self.ps = PSLink(list(ps_addresses), comm=comm, timeout=timeout)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Counters (metrics()).
        self.sent = 0
        self.landed = 0
        self.waits = 0
        self.wait_seconds = 0.0
        self.closed_early = 0
        self.partial = 0  # pseudo-gradients sent at the grace window, before the period ended
        self.staleness_sum = 0
        self.max_staleness = 0
        self.recoveries = 0  # times this replica re-seeded a lost shard

    @classmethod
    def capabilities(cls, config: Mapping[str, Any]) -> frozenset[str]:
        # No collective at start-up or in a step: a (re)started replica joins alone.
        return frozenset({Capability.LOCAL_OPTIMIZER_STATE, Capability.STARTS_ALONE})

    @property
    def replicas(self) -> int:
        """The replicas of the job: the process group's, else (replicas launched without a
        shared group, ``comm=sg.Comm.single()``) the launcher's ``WORLD_SIZE``."""
        n = self.comm.world_size * self.comm.replica_group_size
        if n == 1:
            try:
                n = max(1, int(os.environ.get("WORLD_SIZE", "1")))
            except ValueError:
                n = 1
        return n

    @property
    def min_contributions(self) -> int:
        given = self.given_min_contributions
        return max(1, self.replicas - 1) if given is None else given

    def outer_spec(self) -> dict[str, Any]:
        """The outer optimizer as the shards rebuild it, with the round's rules."""
        from ..ps import optim as ps_optim

        probe = [torch.zeros(1, requires_grad=True)]
        optimizer = self.factory(probe)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must build a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}. Fix: pass e.g. outer_optimizer=lambda "
                            "ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)")
        try:
            spec = ps_optim.optimizer_spec(optimizer)
        except TypeError as exc:
            raise TypeError(f"DiLoCo(mode='async') runs the outer optimizer on the "
                            f"parameter-server shards: {exc}") from None
        spec[ps_optim.OUTER_GRACE] = self.grace_window
        spec[ps_optim.OUTER_STALENESS] = self.staleness
        spec[ps_optim.OUTER_ROUND] = float(self.replicas * self.period)
        spec[ps_optim.OUTER_DOWNLOAD] = self.down
        return spec

    # ------------------------------------------------------------------ setup
    def setup(self, prepared: Prepared) -> None:
        names, tensors, _ = synced_tensors(prepared.module, buffers=True)
        if self.compression in QUANT_KINDS and any(not t.is_floating_point() for t in tensors):
            raise TypeError("compression='int8'/'int4' needs floating-point parameters. Fix: "
                            "pass compression=None")
        index = prepared.index
        st = _State(names, tensors, "" if index == 0 else f"model{index}/",
                    self.compression in QUANT_KINDS)
        prepared.state[self.name] = st
        st.table = self.ps.table(self._named(st, st.tensors), mode="outer",
                                 optimizer_spec=self.outer_spec(),
                                 replicas_to_aggregate=self.min_contributions)
        # The chief registers the global model from its initial one; the others (and a
        # replica restarted later) start from the global model the shards hold.
        values = st.table.join(register=self.owner.is_chief, timeout=self.timeout)
        self.ps.fold_bytes()
        with torch.no_grad():
            for k, t in zip(st.keys, st.tensors, strict=True):
                t.copy_(values[k])
        st.base = [t.detach().clone() for t in st.tensors]
        st.base_versions = st.table.part_versions()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sg-async-outer")

    def _state(self, prepared: Prepared) -> _State:
        st: _State = prepared.state[self.name]
        return st

    @staticmethod
    def _named(st: _State, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: t.detach() for k, t in zip(st.keys, tensors, strict=True)}

    # ------------------------------------------------------------------ the step
    def after_update(self, prepared: Prepared) -> None:
        st = self._state(prepared)
        st.since += 1
        if st.flight is not None and (st.flight.future.done() or (
                self.land_within is not None and st.since >= self.land_within)):
            self._land(st, counted=True)  # waits (counted) only if the round is still open
        if prepared.local_steps % self.period == 0:
            self._send(st, force=False)
            if self.land_within == 0:
                self._land(st, counted=True)
        elif (self.grace_window is not None
              and time.monotonic() - st.sent_at >= self.grace_window):
            # A replica too slow to finish its period within a grace window sends what it
            # has (weighted by the fewer steps it covers) rather than a pseudo-gradient a
            # round or more stale later.
            self.partial += 1
            self._send(st, force=False)

    def _send(self, st: _State, *, force: bool, leaving: bool = False) -> None:
        """Send this replica's pseudo-gradient since the last one (landing the previous
        flight first, waiting for it if its round is still open)."""
        if st.flight is not None:
            self._land(st, counted=True)
        assert st.table is not None and self._pool is not None
        with torch.no_grad():
            deltas: dict[str, torch.Tensor] = {}
            for i, (k, t, b) in enumerate(zip(st.keys, st.tensors, st.base, strict=True)):
                d = b.float() - t.float() if st.residual is not None else b - t.detach()
                if st.residual is not None:
                    d.add_(st.residual[i])
                deltas[k] = d
            sent = [t.detach().clone() for t in st.tensors]
        lost = ({k: torch.empty_like(d) for k, d in deltas.items()}
                if st.residual is not None else None)
        have = ({k: (st.base_versions[k], lin) for k, lin in st.base_lineage.items()
                 if k in st.base_versions} if self.down is not None else None)
        future = self._pool.submit(self._round, st.table, deltas, dict(st.base_versions),
                                   st.since, lost, force, leaving, list(st.base), have)
        st.flight = _Flight(future, sent, lost)
        st.since = 0
        st.sent_at = time.monotonic()
        self.sent += 1

    def _round(self, table: ShardedParameters, deltas: dict[str, torch.Tensor],
               base_versions: dict[str, int], samples: int,
               lost: dict[str, torch.Tensor] | None, force: bool, leaving: bool,
               base: Sequence[torch.Tensor], have: dict[str, tuple[int, int]] | None
               ) -> tuple[Contribution, RoundEnd]:
        """On the background thread: contribute, then wait for the round (at most the grace
        window), close it if its window is over (``force``, the last one: at once, and later
        rounds need one pseudo-gradient fewer) and fetch the model."""
        from ..errors import ParameterServerUnavailable
        from ..ps.transport import RemoteError

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                joined = table.contribute(deltas, base_versions, samples=samples,
                                          compression=self.compression, lost=lost)
                end = table.finish_round(
                    joined, grace=self.grace_window, force=force, leaving=leaving,
                    timeout=self.timeout, have=have, down=self.down,
                    base=None if have is None else dict(zip(table.names, base, strict=True)))
                return joined, end
            except (ParameterServerUnavailable, RemoteError) as exc:
                lost_shard = (isinstance(exc, ParameterServerUnavailable)
                              or exc.code == "NOT_FOUND")
                if not lost_shard or time.monotonic() > deadline:
                    raise
            # A shard was lost (unreachable, or restarted empty): seed it again with the
            # newest global model this replica holds. Every replica does so; the newest copy
            # wins (if_newer), so no round a live replica has seen is lost. Then send again
            # (the new shard never saw this pseudo-gradient).
            time.sleep(0.2)
            with contextlib.suppress(ParameterServerUnavailable, RemoteError):
                self._reseed(table, base, base_versions)

    def _reseed(self, table: ShardedParameters, base: Sequence[torch.Tensor],
                base_versions: Mapping[str, int]) -> None:
        by_name: dict[str, int] = {}
        for p in table.placement.parts:
            v = int(base_versions.get(p.key, 0))
            by_name[p.name] = min(v, by_name.get(p.name, v))
        table.set_state({"params": dict(zip(table.names, base, strict=True)),
                         "versions": by_name}, if_newer=True)
        self.recoveries += 1

    def _land(self, st: _State, *, counted: bool = False) -> None:
        """Move onto the global model the flight's round produced, keeping the inner steps
        taken since it was sent: ``theta = theta_new + (theta - theta_sent)``."""
        flight = st.flight
        assert flight is not None
        if not flight.future.done():
            t0 = time.perf_counter()
            if counted:
                self.waits += 1
            try:
                joined, end = flight.future.result(timeout=self.timeout + 30.0)
            finally:
                self.wait_seconds += time.perf_counter() - t0
        else:
            joined, end = flight.future.result()
        st.flight = None
        self.ps.fold_bytes()
        with torch.no_grad():
            for i, (k, t, old) in enumerate(zip(st.keys, st.tensors, flight.sent,
                                                strict=True)):
                # The fetch is on the host; the parameter may be on an accelerator.
                new = end.values[k].to(device=t.device, dtype=t.dtype)
                t.add_(new - old)
                st.base[i] = new
                if st.residual is not None and flight.lost is not None:
                    st.residual[i].copy_(flight.lost[k])
        st.base_versions = dict(end.part_versions)
        st.base_lineage = dict(end.lineages)
        self.landed += 1
        self.closed_early += end.closed_early
        stale = [v for v in joined.staleness.values()]
        if stale:
            self.staleness_sum += max(stale)
            self.max_staleness = max(self.max_staleness, max(stale))

    def finalize(self, prepared: Prepared) -> None:
        """Send the pseudo-gradient of the inner steps since the last one (its round closed
        at once, so nothing this replica trained stays unmerged) and take the global model;
        then the replicas sharing this process group meet, so none reads or saves the model
        before the others' last pseudo-gradients have landed, and each takes the final global
        model. Later rounds need one pseudo-gradient fewer (this replica has left)."""
        st = self._state(prepared)
        if st.since > 0:
            self._send(st, force=True, leaving=not st.left)
            st.left = True
        if st.flight is not None:
            self._land(st)
        if not st.left:
            assert st.table is not None
            st.table.leave_rounds()
            st.left = True
        self.comm.barrier()
        if self.comm.world_size > 1:  # the others' last pseudo-gradients have landed since
            assert st.table is not None
            with torch.no_grad():
                for t, g in zip(st.tensors, self._global(st), strict=True):
                    t.copy_(g)
            st.base = [t.detach().clone() for t in st.tensors]
            st.base_versions = st.table.part_versions()
            st.base_lineage = {}

    # ------------------------------------------------------------------ the global model
    def _global(self, st: _State) -> list[torch.Tensor]:
        assert st.table is not None
        got = st.table.pull()
        self.ps.fold_bytes()
        return [got[k] for k in st.keys]

    def eval_model(self, prepared: Prepared) -> nn.Module:
        """A module of the user's class holding the global model, refreshed from the shards
        at each call. Not a collective."""
        st = self._state(prepared)
        if st.eval_module is None:
            st.eval_module = self.owner.eval_copy(prepared)
        by_name: dict[str, torch.Tensor] = dict(st.eval_module.named_parameters())
        by_name.update(st.eval_module.named_buffers())
        with torch.no_grad():
            for n, g in zip(st.names, self._global(st), strict=True):
                by_name[n].copy_(g)
        return st.eval_module

    def consensus(self, prepared: Prepared, state: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        if not self.owner.is_chief:  # only the chief's model tensors are written
            return state
        st = self._state(prepared)
        by_id = {id(t): g for t, g in zip(st.tensors, self._global(st), strict=True)}
        return {k: by_id.get(id(v), v) for k, v in state.items()}

    def loaded(self, prepared: Prepared) -> None:
        """After a restore: every replica starts from the restored model; the chief writes
        it to the shards (the outer optimizer's state follows in load_extra_state)."""
        st = self._state(prepared)
        if st.flight is not None:  # a pseudo-gradient of the pre-restore trajectory
            self._land(st)
        self._write_global(st, {})

    def _write_global(self, st: _State, opt: dict[str, dict[str, torch.Tensor]]) -> None:
        assert st.table is not None
        if self.owner.is_chief:
            st.table.set_state({"params": self._named(st, st.tensors), "optimizer": opt})
            self.ps.fold_bytes()
        self.comm.barrier()  # nobody sends against the old global model once restore returns
        with torch.no_grad():
            st.base = [t.detach().clone() for t in st.tensors]
            for e in st.residual or []:
                e.zero_()
        st.base_versions = st.table.part_versions(refresh=True)
        st.base_lineage = {}
        st.since = 0
        st.sent_at = time.monotonic()

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """The outer optimizer's state (read from the shards by the chief) under synchronous
        DiLoCo's names, and every replica's residuals (a collective of the process group)."""
        st = self._state(prepared)
        out: dict[str, torch.Tensor] = {}
        if st.residual is not None:
            out.update(gather_ranks(self.comm, st.names, st.residual, RESIDUAL_KEY))
        if self.owner.is_chief:
            assert st.table is not None
            saved = st.table.get_state()["optimizer"]
            self.ps.fold_bytes()
            for n, k in zip(st.names, st.keys, strict=True):
                for key, value in saved.get(k, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        name = MOMENTUM_KEY if key == "momentum_buffer" else f"outer_{key}"
                        out[f"{name}/{n}"] = value
        return out

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        st = self._state(prepared)
        by_name = dict(zip(st.names, st.keys, strict=True))
        shapes = {n: t.shape for n, t in zip(st.names, st.tensors, strict=True)}
        opt: dict[str, dict[str, torch.Tensor]] = {}
        for key, saved in state.items():
            head, _, n = key.partition("/")
            if n not in by_name or not head.startswith("outer_") or saved.shape != shapes[n]:
                continue
            slot_key = "momentum_buffer" if head == MOMENTUM_KEY else head[len("outer_"):]
            opt.setdefault(by_name[n], {})[slot_key] = saved
        if opt:
            self._write_global(st, opt)
        if st.residual is not None:
            load_rank(state, RESIDUAL_KEY, self.comm.rank, self.comm.world_size, st.names,
                      st.residual)

    def metrics(self) -> dict[str, Any]:
        self.ps.fold_bytes()
        return {"outer_sent": self.sent, "outer_landed": self.landed,
                "outer_waits": self.waits, "outer_wait_seconds": self.wait_seconds,
                "outer_closed_early": self.closed_early,
                "outer_partial": self.partial,
                "outer_mean_staleness": self.staleness_sum / max(1, self.landed),
                "outer_max_staleness": self.max_staleness,
                "outer_shard_recoveries": self.recoveries,
                "min_contributions": self.min_contributions, **self.ps.metrics()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.ps.close()

