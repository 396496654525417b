"""``ParameterServerLink``: the part a parameter-server strategy is made of — this worker's
parameters kept on parameter-server shards, gradients pushed to them and parameters fetched
back.

Downpour SGD (Dean et al., "Large Scale Distributed Deep Networks", NeurIPS 2012) and
synchronous replicas with backup workers: the algorithms and their arguments are described
in :mod:`stratagem.strategies.parameter_server`; this part is their mechanism.

The part replaces the optimizer's step (:meth:`ParameterServerLink.apply_update`: the update
rule runs on the shards, :mod:`stratagem.ps.optim`), keeps the model to save and evaluate on
the shards (``saved_model``, ``eval_model``) and the optimizer state too (``optimizer_state``).
What each argument means, and the measurements behind the defaults, are in
:class:`stratagem.strategies.parameter_server.ParameterServer`'s docstring; transport,
placement and the shard side are :mod:`stratagem.ps`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import Comm
from ..compression import ErrorFeedback
from ..errors import PeerTimeoutError
from ..parts.base import Capability, Part
from ..parts.tensors import broadcast_buffers, gather_ranks, load_rank
from . import optim as ps_optim
from .addresses import all_on_this_host
from .link import PSLink
from .table import held_keys

if TYPE_CHECKING:
    from ..strategy import Prepared, StrategyOptimizer
    from .placement import Partitioner
    from .table import PushOutcome, ShardedParameters
    from .transport import PSFuture

__all__ = ["ParameterServerLink"]

#: At most this many push-fetch calls per step (bucket_cap_mb is raised for big models): each
#: is an HTTP/2 stream, and shards cap the streams of one connection.
_MAX_BUCKETS = 16
#: ``bucket_cap_mb="auto"`` with a shard on another machine: pipelined buckets of this size.
_REMOTE_BUCKET_CAP_MB = 0.125
#: A part's key on the shards: ``<tensor name>/part<i>of<n>``.
_PART = re.compile(r"/part\d+of(\d+)")
_UNRESOLVED = object()
#: Checkpoint key prefix of the workers' error-feedback residuals (``ps_ef_residual.rank{r}/``).
_EF_KEY = "ps_ef_residual"


@dataclass
class _OptState:
    """Per wrapped optimizer: its tensors on the shards and the schedule counters."""

    optimizer: torch.optim.Optimizer  # the user's (never stepped: its state stays empty)
    keys: list[str]  # shard names of the parameters it steps, in param-group order
    params: list[nn.Parameter]
    group_keys: list[list[str]]
    sent_specs: list[dict[str, Any]]  # last hyperparameters sent, per param group
    steps: int = 0
    acc: dict[str, torch.Tensor] = field(default_factory=dict)  # push_every accumulation
    acc_base: dict[str, int] = field(default_factory=dict)


@dataclass
class _Job:
    """What a push/fetch in flight returns: push outcomes, fetched values and versions."""

    outcomes: dict[str, PushOutcome]
    values: dict[str, torch.Tensor]
    versions: dict[str, int]


class _PSState:
    """Per prepared model: the shard table and what this worker knows about its tensors."""

    def __init__(self, table: ShardedParameters, by_key: dict[str, nn.Parameter],
                 sparse: set[str]) -> None:
        self.table = table
        self.by_key = by_key
        self.key_of = {id(p): k for k, p in by_key.items()}
        self.sparse = sparse  # keys of nn.Embedding(sparse=True) weights: rows on demand
        self.base: dict[str, int] = {}  # version of the values this worker holds, per key
        self.opts: dict[int, _OptState] = {}
        self.pending: concurrent.futures.Future[_Job] | None = None
        self.hooks: list[Any] = []
        self.rows_pulled: set[str] = set()  # sparse keys pulled since the last push
        self.bucket_bytes: int | None = None  # async push-fetch: bytes per call


class ParameterServerLink(Part):
    """This worker's side of parameter-server training over the shards at ``ps_addresses``
    (Downpour SGD in ``mode="async"``, ``SyncReplicasOptimizer`` in ``mode="sync"``; every
    argument as :class:`~stratagem.strategies.parameter_server.ParameterServer` takes it,
    already checked, with ``prefetch`` resolved to a bool and ``timeout`` the strategy's).

    ``comm`` is the strategy's: the shard traffic is counted in it, and it carries the few
    collectives (``finalize``, ``save``, ``restore``: barriers and the buffers' broadcast).
    ``replicas_to_aggregate`` None means every replica (``comm``'s world, counting each
    process of a replica group). The shard connection (:attr:`link`) is opened when the first
    model is set up.

    Capabilities: a worker starts alone (the chief registers the model, the others take its
    values from the shards: no start-up collective), and in sync mode the replicas agree on
    skipping a non-finite step (every worker must push for every version).
    """

    name = "ps"
    # The module holds the global model once the fetch in flight is installed: eval_model
    # (below) pulls it in place and returns the module, never a copy.
    replicated = True
    provides = frozenset({Capability.STARTS_ALONE})

    def __init__(self, comm: Comm, *, mode: str, ps_addresses: Sequence[str], timeout: float,
                 push_every: int = 1, fetch_every: int = 1, max_staleness: int | None = None,
                 replicas_to_aggregate: int | None = None,
                 partitioner: Partitioner | None = None, small_tensor_bytes: int = 65536,
                 compression: str | None = None, error_feedback: bool = False,
                 prefetch: bool = False, staleness_lr: bool = False,
                 bucket_cap_mb: float | str | None = "auto") -> None:
        super().__init__(comm)
        self.mode = mode
        self.ps_addresses = list(ps_addresses)
        self.timeout = float(timeout)
        self.push_every = push_every
        self.fetch_every = fetch_every
        self.max_staleness = max_staleness
        # What num_replicas_in_sync is: a fault-tolerant replica group counts each process.
        self.replicas_to_aggregate = (replicas_to_aggregate if replicas_to_aggregate is not None
                                      else comm.world_size * comm.replica_group_size)
        self.partitioner = partitioner
        self.small_tensor_bytes = small_tensor_bytes
        self.compression = compression
        self.prefetch = prefetch
        self.staleness_lr = staleness_lr
        self.bucket_cap_mb = bucket_cap_mb
        self._resolved_bucket_cap_mb: object = _UNRESOLVED
        self._feedback = ErrorFeedback(compression, deferred=True) \
            if error_feedback and compression is not None else None
        #: The shards (connected when the first model is set up).
        self.link = PSLink(self.ps_addresses, comm=comm, timeout=self.timeout)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._staleness: collections.Counter[int] = collections.Counter()
        self._dropped = 0
        self._pushes = 0
        self._nonfinite_pushes = 0
        self._sparse_rows_pulled = 0

    @classmethod
    def capabilities(cls, config: Mapping[str, Any]) -> frozenset[str]:
        # Sync: every worker must push for every version, so a skip is agreed by all.
        if config.get("mode") == "sync":
            return cls.provides | {Capability.SYNCHRONOUS_STEP}
        return cls.provides

    # ------------------------------------------------------------------ setup
    def setup(self, prepared: Prepared) -> None:
        """Put the model's tensors on the shards (the chief registers its values, the others
        wait for them and pull, so no start-up collective is needed) and install the forward
        pre-hooks: sparse embedding rows on demand, and the prefetch's install points."""
        index = prepared.index
        prefix = "" if index == 0 else f"model{index}/"
        names = prepared.param_names
        by_key: dict[str, nn.Parameter] = {}
        specs: dict[str, dict[str, Any]] = {}
        opt_states: dict[int, _OptState] = {}
        for opt in prepared.optimizers:
            keys: list[str] = []
            params: list[nn.Parameter] = []
            group_keys: list[list[str]] = []
            sent: list[dict[str, Any]] = []
            for gi, group in enumerate(opt.param_groups):
                spec = self._spec(opt.optimizer, gi)  # TypeError if unsupported
                gk: list[str] = []
                for p in group["params"]:
                    if id(p) not in names:
                        raise ValueError("the optimizer steps a tensor that is not a parameter "
                                         "of the prepared model. Fix: build the optimizer from "
                                         "model.parameters()")
                    if not p.is_floating_point():
                        continue
                    key = prefix + names[id(p)]
                    if key in by_key:
                        raise ValueError(f"parameter {names[id(p)]!r} is stepped by two "
                                         "optimizers or param groups; the shards run one "
                                         "optimizer per tensor. Fix: list it once")
                    by_key[key] = p
                    specs[key] = spec
                    keys.append(key)
                    params.append(p)
                    gk.append(key)
                group_keys.append(gk)
                sent.append(spec)
            opt_states[id(opt)] = _OptState(opt.optimizer, keys, params, group_keys, sent)
        sparse = {prefix + n + ".weight" for n, m in prepared.module.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
                  and prefix + n + ".weight" in by_key}
        partitioner = self.partitioner
        bucket = self._bucket_bytes(by_key, sparse)
        if partitioner is None:
            # One cut of the tensors per job: the shards' (the chief registered it) when they
            # hold them already, else this process's (_held_cut).
            partitioner = self._held_cut(by_key, wait=not self.owner.is_chief)
        if bucket is not None and partitioner is None:
            # Buckets are whole parts: cut the big tensors to the bucket size.
            from .placement import MaxSizePartitioner

            partitioner = MaxSizePartitioner(bucket, max_shards=_MAX_BUCKETS)
        table = self.link.table(
            {k: p.detach() for k, p in by_key.items()}, mode=self.mode,
            optimizer_specs=specs, replicas_to_aggregate=self.replicas_to_aggregate,
            max_staleness=self.max_staleness, partitioner=partitioner,
            small_tensor_bytes=self.small_tensor_bytes)
        st = _PSState(table, by_key, sparse)
        st.bucket_bytes = bucket
        st.opts = opt_states
        prepared.state[self.name] = st
        if by_key:
            # The chief registers its initial weights; the others wait for them and pull, so
            # a run does not depend on which worker registered first. A worker
            # (re)starting later gets the current values either way, and pushes nothing
            # before it has them.
            values = table.join(register=self.owner.is_chief, timeout=self.timeout)
            versions = table.versions
            with torch.no_grad():
                for k, p in by_key.items():
                    p.copy_(values[k])
                    st.base[k] = versions[k]
            self.link.fold_bytes()
        for n, m in prepared.module.named_modules():
            key = prefix + n + ".weight"
            if key in sparse:
                st.hooks.append(m.register_forward_pre_hook(self._rows_hook(st, key)))
        if self.prefetch:
            if self.mode == "sync":
                st.hooks.append(prepared.module.register_forward_pre_hook(
                    lambda module, args: self._install(st)))
            # ``model.state_dict()`` after the last step shows the last update, not the one
            # before (the fetch in flight is installed first).
            st.hooks.append(prepared.module.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: self._install(st)))

    def _state(self, prepared: Prepared) -> _PSState:
        st: _PSState = prepared.state[self.name]
        return st

    @property
    def resolved_bucket_cap_mb(self) -> float | None:
        """The ``bucket_cap_mb`` in force: the given value, or for ``"auto"`` None (one call
        per shard) when every shard is on this machine, else :data:`_REMOTE_BUCKET_CAP_MB`.
        Worked out once (it may resolve host names)."""
        if self._resolved_bucket_cap_mb is _UNRESOLVED:
            cap = self.bucket_cap_mb
            if cap == "auto":
                cap = None if all_on_this_host(self.ps_addresses) else _REMOTE_BUCKET_CAP_MB
            self._resolved_bucket_cap_mb = cap
        return self._resolved_bucket_cap_mb  # type: ignore[return-value]

    def _held_cut(self, by_key: dict[str, nn.Parameter], *, wait: bool) -> Any:
        """The cut of the model's tensors that the shards already hold, as a partitioner
        (None when they hold none of them: this process chooses). With ``bucket_cap_mb=
        "auto"`` a process next to the shard makes no buckets and one across the network
        does, and the buckets decide the cut: without this a reader next to the shard once
        registered its own uncut copy of tensors the remote workers had cut, and read that
        copy, which nobody trained. ``wait``: a non-chief first waits (up to ``timeout``)
        until the chief has registered every tensor."""
        deadline = time.monotonic() + self.timeout
        client = self.link.connect()
        while True:
            held = held_keys(client.health())
            parts: dict[str, int] = {}
            for name in by_key:
                cut = [k for k in held if k.startswith(name + "/part")]
                if name in held or cut:
                    m = _PART.fullmatch(cut[0][len(name):]) if cut else None
                    parts[name] = int(m.group(1)) if m else 1
            if len(parts) == len(by_key) or not wait or time.monotonic() >= deadline:
                break  # join() says what is missing, if anything
            time.sleep(0.05)
        if not parts:
            return None
        by_shape: dict[tuple[int, ...], int] = {}
        for name, n in parts.items():
            shape = tuple(by_key[name].shape)
            if by_shape.setdefault(shape, n) != n:
                return None  # no partitioner by shape says it: _check_layout names it
        return lambda shape, dtype: by_shape.get(tuple(shape), 1)

    def _bucket_bytes(self, by_key: dict[str, nn.Parameter], sparse: set[str]) -> int | None:
        """Async: the bytes per push-fetch call (``bucket_cap_mb``, raised so a step makes at
        most ``_MAX_BUCKETS`` calls); None for one call per shard."""
        cap_mb = self.resolved_bucket_cap_mb
        if self.mode != "async" or cap_mb is None:
            return None
        total = sum(p.numel() * p.element_size() for k, p in by_key.items()
                    if k not in sparse)
        cap = max(1, int(cap_mb * (1 << 20)))
        return max(cap, -(-total // _MAX_BUCKETS))

    def _rows_hook(self, st: _PSState, key: str) -> Any:
        """A forward pre-hook pulling the rows this batch looks up (sparse embeddings)."""
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                return
            rows = torch.unique(args[0].detach().reshape(-1).to(torch.int64).cpu())
            if rows.numel() == 0:
                return
            values, version = st.table.pull_rows_versioned(key, rows)
            weight = st.by_key[key]
            with torch.no_grad():
                weight.index_copy_(0, rows.to(weight.device),
                                   values.to(weight.device, weight.dtype))
            # The gradient pushed next was computed on rows of this version (the lowest seen
            # since the last push, when micro-batches accumulate).
            if key in st.rows_pulled:
                version = min(version, st.base[key])
            st.base[key] = version
            st.rows_pulled.add(key)
            self._sparse_rows_pulled += int(rows.numel())
        return hook

    # ------------------------------------------------------------------ the step
    def apply_update(self, prepared: Prepared, opt: StrategyOptimizer) -> bool:
        """The step is the shards': push this step's gradients (accumulated over
        ``push_every`` steps) and fetch the parameters (every ``fetch_every`` steps, or the
        next version in sync mode). The inner optimizer is never stepped (its state stays
        empty), so this returns True on every path, including a step with nothing to push."""
        st = self._state(prepared)
        ost = st.opts.get(id(opt))
        if ost is None or not ost.keys:
            return True
        # The versions these gradients were computed on, taken before installing the fetch
        # in flight (async prefetch; in sync mode the forward pre-hook installed it already).
        computed_on = {k: st.base[k] for k in ost.keys}
        self._install(st)
        ost.steps += 1
        grads = self._gradients(st, ost)
        push = ost.steps % self.push_every == 0
        fetch = self.mode == "sync" or ost.steps % self.fetch_every == 0
        if self.push_every == 1:
            bases = computed_on
        else:
            for k, g in grads.items():
                if k not in ost.acc:
                    ost.acc[k] = g.clone()
                    ost.acc_base[k] = computed_on[k]  # the oldest version in the sum
                elif g.is_sparse:
                    ost.acc[k] = ost.acc[k] + g
                else:
                    ost.acc[k].add_(g)
            grads, bases = ost.acc, ost.acc_base
            if push:
                ost.acc, ost.acc_base = {}, {}
        dense = [k for k in ost.keys if k not in st.sparse]
        # Async: the fetch rides on the push (one round trip per bucket, the values right
        # after this push); sync fetches with the wait for the next version instead.
        carried = dense if (fetch and self.mode == "async") else None
        push_futs: list[tuple[str | None, PSFuture[Any]]] = []
        if push:
            self._sync_hyperparameters(st, ost)
            push_futs = self._start_push(st, grads, bases, carried)
            st.rows_pulled.clear()
        if not push_futs and not fetch:
            return True
        if push_futs and carried is not None:
            fetch = False
        # Sync: wait for the version after the one this gradient was computed on. A gradient
        # that was dropped (a late backup worker) finds it already there.
        targets = {k: computed_on[k] + 1 for k in ost.keys} if self.mode == "sync" else {}
        job = (push_futs, dense if fetch else None, targets)
        if self.prefetch:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="stratagem-ps-prefetch")
            st.pending = self._executor.submit(self._run_job, st, *job)
            return True
        done: concurrent.futures.Future[_Job] = concurrent.futures.Future()
        done.set_result(self._run_job(st, *job))
        st.pending = done
        self._install(st)
        return True

    def _gradients(self, st: _PSState, ost: _OptState) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, p in zip(ost.keys, ost.params, strict=True):
            g = p.grad
            if g is None:
                if self.mode != "sync" or not p.requires_grad:
                    continue
                # Sync: every version needs a gradient from every worker for every tensor; an
                # unused parameter contributes zeros to the mean, as under DDP.
                g = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64),
                                            torch.zeros(0, *p.shape[1:]), p.shape) \
                    if k in st.sparse else torch.zeros_like(p)
            out[k] = g.detach()
        return out

    def _spec(self, optimizer: torch.optim.Optimizer, group: int) -> dict[str, Any]:
        """The spec the shards build ``optimizer``'s param group from (plus the strategy's
        shard-side switches)."""
        spec = ps_optim.optimizer_spec(optimizer, group)
        if self.staleness_lr:
            spec[ps_optim.STALENESS_LR] = True
        return spec

    def _sync_hyperparameters(self, st: _PSState, ost: _OptState) -> None:
        """Send hyperparameters changed on the worker (an LR scheduler) to the shards."""
        for gi, keys in enumerate(ost.group_keys):
            spec = self._spec(ost.optimizer, gi)
            if spec == ost.sent_specs[gi] or not keys:
                continue
            changed = {k: v for k, v in spec.items()
                       if k != "name" and ost.sent_specs[gi].get(k) != v}
            st.table.set_hyperparameters(keys, **changed)
            ost.sent_specs[gi] = spec

    def _start_push(self, st: _PSState, grads: dict[str, torch.Tensor],
                    bases: dict[str, int], fetch: list[str] | None
                    ) -> list[tuple[str | None, PSFuture[Any]]]:
        """Encode and send the push now (the gradients may change once we return); the
        dense push also fetches ``fetch`` when given."""
        dense: dict[str, torch.Tensor] = {}
        sparse: dict[str, torch.Tensor] = {}
        for k, g in grads.items():
            (sparse if g.is_sparse else dense)[k] = g
        if self.compression is not None:
            packed = self._compress(dense)
            if packed is None:  # fp16 overflow: never push a non-finite gradient
                self._nonfinite_pushes += 1
                self.owner.control.skipped += 1
                if self._feedback is not None:
                    self._feedback.discard()
                return []
            dense = packed
        futs: list[tuple[str | None, PSFuture[Any]]] = []
        if dense or fetch:
            futs.append((None, st.table.push_fetch_async(
                dense, {k: bases[k] for k in dense}, fetch=fetch,
                max_request_bytes=st.bucket_bytes if fetch else None)))
        for k, g in sparse.items():
            g = g.coalesce()
            futs.append((k, st.table.push_sparse_async(
                k, g.indices()[0], g.values(), base_version=bases[k],
                compress=self.compression)))
        if self._feedback is not None:
            self._feedback.commit()
        self._pushes += 1
        return futs

    def _compress(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        from ..compression import compress

        assert self.compression is not None
        out: dict[str, torch.Tensor] = {}
        for k, g in grads.items():
            if not g.is_floating_point():
                out[k] = g
                continue
            payload = (self._feedback.compress(k, g)[0] if self._feedback is not None
                       else compress(g, self.compression)[0])
            if not bool(torch.isfinite(payload).all()):
                return None
            out[k] = payload
        return out

    def _run_job(self, st: _PSState, push_futs: list[tuple[str | None, PSFuture[Any]]],
                 fetch: list[str] | None, targets: dict[str, int]) -> _Job:
        """Wait for the push, then fetch (async) or wait for the next version (sync). Runs
        on the prefetch thread or inline; every wait is bounded by the client's deadline."""
        outcomes: dict[str, PushOutcome] = {}
        values: dict[str, torch.Tensor] = {}
        versions: dict[str, int] = {}
        for name, fut in push_futs:
            got = fut.result()
            if name is None:
                outcomes.update(got.outcomes)
                values.update(got.values)
                versions.update(got.versions)
            else:
                outcomes[name] = got
        if self.mode == "sync" and targets:
            # A gradient that was dropped (a backup worker, late) does not make the version
            # advance by itself: wait for the version the others produce.
            try:
                values, versions = st.table.wait_for(targets, fetch=fetch or [],
                                                     timeout=self.timeout)
            except PeerTimeoutError as exc:
                raise self._name_missing_workers(exc) from exc
        elif fetch:
            values, versions = st.table.fetch_async(fetch).result()
        return _Job(outcomes, values, versions)

    def _name_missing_workers(self, exc: PeerTimeoutError) -> PeerTimeoutError:
        """The shards only know that too few gradients arrived; the workers' heartbeats (when
        they share a rendezvous store) tell which worker went silent."""
        ranks, how = self.comm.silent_peers() if self.comm.store is not None else ([], "")
        if not ranks:
            return exc
        return PeerTimeoutError(f"{exc}. Worker rank(s) {', '.join(map(str, ranks))} {how}.",
                                ranks=tuple(ranks))

    def _install(self, st: _PSState) -> None:
        """Finish the push/fetch in flight and copy the fetched values into the model."""
        fut, st.pending = st.pending, None
        if fut is None:
            return
        # The job's own calls are bounded by the deadline; this bound is a backstop.
        job = fut.result(timeout=3 * self.timeout + 10)
        if job.outcomes:
            # One count per push: its staleness is that of its stalest tensor.
            self._staleness[max(int(o.staleness) for o in job.outcomes.values())] += 1
            if any(not o.accepted for o in job.outcomes.values()):
                self._dropped += 1
        with torch.no_grad():
            for k, v in job.values.items():
                st.by_key[k].copy_(v)
        st.base.update(job.versions)
        self.link.fold_bytes()

    # ------------------------------------------------------------------ global model
    @property
    def global_version(self) -> int:
        """The highest version of the parameters this worker has received: in sync mode the
        number of global steps taken (``SyncReplicasOptimizer``'s global step). Reading it
        waits for the fetch in flight (prefetch) and installs it."""
        prepared_models = self.owner.prepared_models
        for p in prepared_models:
            self._install(self._state(p))
        return max((v for p in prepared_models for v in self._state(p).base.values()),
                   default=0)

    def _pull_all(self, st: _PSState) -> dict[str, torch.Tensor]:
        self._install(st)
        if not st.by_key:
            return {}
        values, versions = st.table.fetch_async().result()
        self.link.fold_bytes()
        return values

    def eval_model(self, prepared: Prepared) -> nn.Module:
        """The user's module (never a ``torch.compile`` wrapper) with the current global
        parameters pulled into it (sparse embedding rows are pulled by each forward anyway).
        Not a collective: call ``finalize`` first at the end of training so every worker's
        last push is included."""
        st = self._state(prepared)
        self._install(st)
        dense = [k for k in st.by_key if k not in st.sparse]
        if dense:
            values, versions = st.table.fetch_async(dense).result()
            with torch.no_grad():
                for k, v in values.items():
                    st.by_key[k].copy_(v)
            st.base.update(versions)
            self.link.fold_bytes()
        return prepared.module

    def finalize(self, prepared: Prepared) -> None:
        """Flush what this worker has not pushed yet (gradients accumulated for
        ``push_every > 1``), wait for every worker's last push to land (a barrier over the
        process group), then pull the global model into this worker, so that every worker,
        ``eval_model`` and ``save`` agree. Buffers (BatchNorm running statistics), which
        never go to the shards, are set to the chief's on every worker (one broadcast; what
        checkpoints hold). Training may continue; a second call only pulls again."""
        st = self._state(prepared)
        self._install(st)
        for ost in st.opts.values():
            if not ost.acc:
                continue
            grads, bases = ost.acc, ost.acc_base
            ost.acc, ost.acc_base = {}, {}
            self._sync_hyperparameters(st, ost)
            futs = self._start_push(st, grads, bases, None)
            st.rows_pulled.clear()
            done: concurrent.futures.Future[_Job] = concurrent.futures.Future()
            done.set_result(self._run_job(st, futs, None, {}))
            st.pending = done
            self._install(st)
        self.comm.barrier()
        self._refresh(st)
        broadcast_buffers(self.comm, prepared.module)

    def saved_model(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """The global model from the shards, under the module's own names (a collective:
        a barrier first), with the chief's buffers; only the chief pulls it."""
        st = self._state(prepared)
        # Save is a collective: every worker's last (asynchronous) push must have landed on
        # the shards before the chief reads the global model, or the checkpoint misses it.
        self._install(st)
        self.comm.barrier()
        if not self.owner.is_chief:
            # Only the chief's tensors are written; spare the shards a pull per worker.
            return {k: v.detach() for k, v in prepared.module.state_dict().items()}
        values = self._pull_all(st)
        by_id = {id(p): values[k] for k, p in st.by_key.items()}
        return {k: by_id.get(id(v), v).detach()
                for k, v in prepared.module.state_dict(keep_vars=True).items()}

    def load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> bool:
        """Load ``state`` into the module and (the chief) onto the shards, then every worker
        pulls it (a collective: a barrier after the chief wrote)."""
        st = self._state(prepared)
        self._install(st)
        if self._feedback is not None:
            self._feedback.reset()  # residuals of the pre-restore trajectory do not apply
        prepared.module.load_state_dict(state)
        if self.owner.is_chief and st.by_key:
            current = st.table.get_state()
            current["params"] = {k: p.detach() for k, p in st.by_key.items()}
            # A gradient computed before the restore counts as one version stale.
            current["versions"] = {k: v + 1 for k, v in current["versions"].items()}
            st.table.set_state(current)
        self.comm.barrier()  # nobody pulls before the chief wrote
        self._refresh(st)
        return True

    def _residuals(self, st: _PSState) -> tuple[list[str], list[torch.Tensor]]:
        """This worker's committed error-feedback residual per dense tensor it pushes (zeros
        where there is none yet), by table key."""
        assert self._feedback is not None
        names = [k for k, p in st.by_key.items() if k not in st.sparse]
        tensors = []
        for k in names:
            r = self._feedback.residual(k)
            p = st.by_key[k]
            tensors.append(r if r is not None and r.shape == p.shape else torch.zeros_like(p))
        return names, tensors

    def extra_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """With ``error_feedback``: every worker's residuals (what its compressed pushes have
        not delivered yet), per rank, so a resume with as many workers continues exactly
        (collective, as ``save`` is)."""
        out: dict[str, torch.Tensor] = {}
        if self._feedback is not None:
            st = self._state(prepared)
            self._install(st)
            names, tensors = self._residuals(st)
            out.update(gather_ranks(self.comm, names, tensors, _EF_KEY))
        return out

    def load_extra_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        """Seed this worker's residuals from the checkpoint when it was written by as many
        workers with ``error_feedback`` (else they start at zero, as before)."""
        if self._feedback is None:
            return
        st = self._state(prepared)
        names = [k for k in st.by_key if k not in st.sparse]
        fresh = [torch.zeros_like(st.by_key[k]) for k in names]
        if load_rank(state, _EF_KEY, self.comm.rank, self.comm.world_size, names, fresh):
            for k, t in zip(names, fresh, strict=True):
                self._feedback.seed(k, t)

    def _refresh(self, st: _PSState) -> None:
        if not st.by_key:
            return
        values, versions = st.table.fetch_async().result()
        with torch.no_grad():
            for k, v in values.items():
                st.by_key[k].copy_(v)
        st.base.update(versions)
        for ost in st.opts.values():
            ost.acc, ost.acc_base = {}, {}
        self.link.fold_bytes()

    def _find_opt(self, opt: torch.optim.Optimizer) -> tuple[_PSState, _OptState] | None:
        for prepared in self.owner.prepared_models:
            st = self._state(prepared)
            for o in prepared.optimizers:
                if o is opt or o.optimizer is opt:
                    return st, st.opts[id(o)]
        return None

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The shards' optimizer state in torch's ``state_dict`` format (indices in
        param-group order), so any strategy can load it; None (the optimizer's own
        ``state_dict``) for an optimizer this part does not step."""
        found = self._find_opt(opt)
        if found is None:
            return None
        sd = opt.state_dict()
        if not self.owner.is_chief:
            return sd  # only the chief's optimizer state is written
        st, ost = found
        self._install(st)
        shard = st.table.get_state()["optimizer"]
        self.link.fold_bytes()
        index = 0
        state: dict[int, dict[str, Any]] = {}
        keys_by_id = {id(p): k for k, p in zip(ost.keys, ost.params, strict=True)}
        for group in opt.param_groups:
            for p in group["params"]:
                k = keys_by_id.get(id(p))
                if k is not None and shard.get(k):
                    state[index] = dict(shard[k])
                index += 1
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
        """Load the hyperparameters into ``opt`` and its state onto the shards (the chief),
        then every worker pulls (a barrier first); False for an optimizer this part does not
        step (the base loads it as usual)."""
        found = self._find_opt(opt)
        if found is None:
            return False
        opt.load_state_dict(state)  # hyperparameters (and the state, moved to the shards)
        st, ost = found
        self._install(st)
        loaded = dict(opt.state)
        opt.state.clear()  # the worker keeps no optimizer state
        # ost.optimizer is the user's optimizer whether ``opt`` is it or its wrapper.
        if self.owner.is_chief:
            per_key = {ost.keys[i]: {k: v for k, v in loaded.get(p, {}).items()
                                     if isinstance(v, torch.Tensor)}
                       for i, p in enumerate(ost.params)}
            for gi, keys in enumerate(ost.group_keys):
                spec = self._spec(ost.optimizer, gi)
                ost.sent_specs[gi] = spec
                st.table.set_optimizer_specs(dict.fromkeys(keys, spec))
            current = st.table.get_state()
            current["optimizer"] = {**current["optimizer"], **per_key}
            current["versions"] = {k: v + 1 for k, v in current["versions"].items()}
            st.table.set_state(current)
        else:
            for gi in range(len(ost.group_keys)):
                ost.sent_specs[gi] = self._spec(ost.optimizer, gi)
        self.comm.barrier()
        self._refresh(st)
        return True

    # ------------------------------------------------------------------ misc
    def metrics(self) -> dict[str, Any]:
        # Shard traffic is counted by the client: fold it into the Comm before the strategy
        # reads its counters (bytes_sent etc. cover every byte this worker moved).
        self.link.fold_bytes()
        pushes = sum(self._staleness.values())
        out: dict[str, Any] = {
            "staleness": dict(sorted(self._staleness.items())),
            # The mean over this worker's pushes: what prefetch/overlap cost in freshness.
            "staleness_mean": (sum(k * n for k, n in self._staleness.items()) / pushes
                               if pushes else 0.0),
            "dropped_gradients": self._dropped,
            "pushes": self._pushes,
            "nonfinite_pushes_skipped": self._nonfinite_pushes,
            "sparse_rows_pulled": self._sparse_rows_pulled,
            **self.link.metrics(),
        }
        return out

    def close(self) -> None:
        """Finish what is in flight (bounded), remove the hooks, close the channels."""
        for prepared in self.strategy.prepared_models if self.strategy is not None else []:
            st = prepared.state.get(self.name)
            if st is None:
                continue
            try:
                self._install(st)
            except Exception:  # noqa: BLE001 - closing must not fail on a dead shard
                pass
            for h in st.hooks:
                h.remove()
            st.hooks = []
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self.link.close()
