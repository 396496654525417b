"""Worker side of the parameter-server runtime, the table: a model's tensors on the shards.

:class:`ShardedParameters` places a model's tensors on the shards of a
:class:`~stratagem.ps.transport.PSClient` (greedy by bytes, small tensors grouped, big ones
partitioned: the tf_cnn_benchmarks variable manager, see :mod:`stratagem.ps.placement`) and
offers the operations strategies need over that placement: Downpour SGD pushes and pulls
(Dean et al. 2012), synchronous aggregation as in TensorFlow's ``SyncReplicasOptimizer``,
sparse embedding rows, the asynchronous EASGD elastic exchange (Zhang, Choromanska,
LeCun 2015), and asynchronous DiLoCo's outer rounds (:meth:`ShardedParameters.contribute`,
:meth:`ShardedParameters.finish_round`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from stratagem.comm import bucketed
from stratagem.compression import KINDS, check_compression
from stratagem.errors import ParameterServerUnavailable, PeerTimeoutError, StratagemError
from stratagem.ps import optim as ps_optim
from stratagem.ps import shm, updates, wire
from stratagem.ps.addresses import is_on_this_host
from stratagem.ps.placement import Part, Partitioner, Placement, place, specs_of
from stratagem.ps.transport import PSClient, PSFuture, RemoteError, Request, refused_request
from stratagem.ps.wire import Entry, Message

__all__ = ["ShardedParameters", "PushOutcome", "PushFetch", "Contribution", "RoundEnd"]

log = logging.getLogger(__name__)

_STATUS_RANK = {"applied": 0, "accumulated": 1, "dropped": 2, "refused": 3}


class PushOutcome(NamedTuple):
    """What a shard did with one pushed gradient."""

    staleness: int  # shard version minus the version the gradient was computed on
    #: "applied", "accumulated" (sync, waiting for more replicas), "dropped" (stale) or
    #: "refused" (the step would have made the tensor non-finite; it kept its value)
    status: str
    version: int  # the tensor's version after the push

    @property
    def applied(self) -> bool:
        """The optimizer ran with this gradient (alone, or as part of a sync mean)."""
        return self.status == "applied"

    @property
    def accepted(self) -> bool:
        """Not dropped or refused: applied, or held for the sync mean of this version."""
        return self.status not in ("dropped", "refused")


class PushFetch(NamedTuple):
    """What :meth:`ShardedParameters.push_fetch_async` returns."""

    outcomes: dict[str, PushOutcome]  # per pushed tensor
    values: dict[str, torch.Tensor]  # per fetched tensor, after the push
    versions: dict[str, int]  # per fetched tensor, the version of ``values``


class Contribution(NamedTuple):
    """What the shards did with one replica's pseudo-gradients, per tensor part (its key):
    the status ("accumulated", "applied", "refused", "dropped"), the staleness it was merged
    with, and the part's version after it (the round it joined, unless it closed it)."""

    statuses: dict[str, str]
    staleness: dict[str, int]
    versions: dict[str, int]


class RoundEnd(NamedTuple):
    """The model after the rounds a replica contributed to: values and (lowest part's)
    version per tensor, the version of every part, whether this replica closed its round
    early (1: grace window or force, else 0), and the seconds waited."""

    values: dict[str, torch.Tensor]
    versions: dict[str, int]
    part_versions: dict[str, int]
    closed_early: int
    waited: float
    #: per part key, the lineage of the slot its value was read from (see
    #: :func:`stratagem.ps.rules.updates_since`)
    lineages: dict[str, int]


def _rows(t: torch.Tensor, p: Part) -> torch.Tensor:
    return t if p.num_parts == 1 else t[p.row_start:p.row_end]


def held_keys(health: Sequence[Mapping[str, Any]]) -> set[str]:
    """The tensor (part) keys the shards hold, from their ``health`` answers."""
    held: set[str] = set()
    for h in health:
        versions = h.get("versions")
        if isinstance(versions, dict):
            held.update(versions)
    return held


class ShardedParameters:
    """A model's named tensors living on parameter-server shards.

    ``params`` (ordered ``name -> tensor``) is placed on the client's shards (deterministic:
    every worker computes the same placement), then :meth:`register` creates the tensors on
    the shards, or returns the existing values if another worker registered first.

    ``mode``: ``"async"`` (Downpour: each gradient applied on arrival, optionally dropped when
    more than ``max_staleness`` versions old), ``"sync"`` (the mean of ``replicas_to_aggregate``
    gradients of the current version is applied; late ones are dropped) or ``"elastic"``
    (EASGD center variables, changed only by :meth:`elastic_exchange`).

    ``shared_memory`` (None: on unless ``STRATAGEM_PS_SHM=0``): a push+fetch to a shard on
    this machine (:func:`stratagem.ps.addresses.is_on_this_host`) in one call per shard goes
    through a shared-memory region (:mod:`stratagem.ps.shm`): only a small gRPC message per
    step, the tensors read and written in place. The region is set up on the first such call
    and covers that call's tensors; any other call, and any shard where it cannot be set up
    (another machine, an older shard, no ``memfd``), uses gRPC, with the same results.
    Memory: the region holds one copy of the pushed gradients and one of the fetched values,
    shared by the worker and the shard (the gRPC path holds as much in messages per call).

    Failure behaviour: as :class:`PSClient` (``ParameterServerUnavailable`` naming the shard);
    :meth:`wait_version` raises :class:`stratagem.errors.PeerTimeoutError` when the version is
    not reached in time. Tensors returned by pulls may share memory with the received message
    (no copy); they are private to the caller and safe to modify.
    """

    def __init__(self, client: PSClient, params: Mapping[str, torch.Tensor], *,
                 mode: str = "async", optimizer_spec: Mapping[str, Any] | None = None,
                 optimizer_specs: Mapping[str, Mapping[str, Any]] | None = None,
                 replicas_to_aggregate: int = 1, max_staleness: int | None = None,
                 partitioner: Partitioner | None = None, small_tensor_bytes: int = 65536,
                 placement: str = "greedy", shared_memory: bool | None = None) -> None:
        if mode not in ("async", "sync", "elastic", "outer"):
            raise ValueError(f"mode must be 'async', 'sync', 'elastic' or 'outer', got "
                             f"{mode!r}")
        if mode != "elastic" and optimizer_spec is None and not optimizer_specs:
            raise ValueError(f"mode {mode!r} needs optimizer_spec (e.g. "
                             "stratagem.ps.optim.optimizer_spec(torch_optimizer))")
        if not isinstance(replicas_to_aggregate, int) or replicas_to_aggregate < 1:
            raise ValueError(f"replicas_to_aggregate must be a positive integer, got "
                             f"{replicas_to_aggregate!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or
                                          max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an integer >= 0, got "
                             f"{max_staleness!r}")
        self.client, self.mode = client, mode
        self.replicas_to_aggregate, self.max_staleness = replicas_to_aggregate, max_staleness
        self._params = params
        self._shapes = {k: tuple(t.shape) for k, t in params.items()}
        self._dtypes = {k: t.dtype for k, t in params.items()}
        specs: dict[str, dict[str, Any] | None] = {}
        for name in params:
            s = (optimizer_specs or {}).get(name, optimizer_spec)
            if mode == "elastic":
                s = None
            elif s is not None:
                ps_optim.validate_spec(s)
                s = dict(s)
            specs[name] = s
        self._specs = specs
        self.placement: Placement = place(specs_of(params), client.num_shards,
                                          strategy=placement,
                                          small_tensor_bytes=small_tensor_bytes,
                                          partitioner=partitioner)
        self._parts = {name: self.placement.parts_of(name) for name in params}
        self._part_by_key = {p.key: p for p in self.placement.parts}
        self._versions: dict[str, int] = {}
        self._vlock = threading.Lock()
        if shared_memory is not None and not isinstance(shared_memory, bool):
            raise ValueError(f"shared_memory must be None, True or False, got "
                             f"{shared_memory!r}")
        use_shm = (shm.enabled() and shm.supported()) if shared_memory is None else (
            shared_memory and shm.supported())
        #: Per shard: whether to try a shared-memory region (once; see _shm_attach).
        self._shm_wanted = [use_shm and is_on_this_host(a) for a in client.addresses]
        self._shm_regions: dict[int, shm.WorkerRegion] = {}
        self._shm_lock = threading.Lock()

    # -- bookkeeping ----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def part_versions(self, *, refresh: bool = False) -> dict[str, int]:
        """The version of every part (by its key on the shards) of the values this worker last
        received; ``refresh``: pull the values first."""
        if refresh:
            self.pull()
        with self._vlock:
            return {p.key: self._versions.get(p.key, -1) for p in self.placement.parts}

    @property
    def versions(self) -> dict[str, int]:
        """Per tensor, the (lowest part's) version of the values this worker last received."""
        with self._vlock:
            return {n: min(self._versions.get(p.key, -1) for p in parts)
                    for n, parts in self._parts.items()}

    def stats(self) -> dict[str, float]:
        return self.client.stats()

    def _check(self, name: str) -> list[Part]:
        parts = self._parts.get(name)
        if parts is None:
            raise KeyError(f"{name!r} is not one of the sharded tensors; known: "
                           f"{self.names[:5]}{'...' if len(self._parts) > 5 else ''}")
        return parts

    def _by_shard(self, names: Sequence[str]) -> dict[int, list[Part]]:
        out: dict[int, list[Part]] = {}
        for n in names:
            for p in self._check(n):
                out.setdefault(p.shard, []).append(p)
        return out

    def _assemble(self, msgs: Sequence[Message], names: Sequence[str],
                  into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        with self._vlock:
            for m in msgs:
                for e in m.entries:
                    got[e.name] = e.tensor
                    if e.version is not None:
                        self._versions[e.name] = e.version
        out: dict[str, torch.Tensor] = {}
        for n in names:
            parts = self._parts[n]
            if into is not None and n in into:
                dst = into[n]
                with torch.no_grad():
                    for p in parts:
                        _rows(dst, p).copy_(got[p.key])
                out[n] = dst
            elif len(parts) == 1:
                out[n] = got[parts[0].key]
            else:
                out[n] = torch.cat([got[p.key] for p in parts])
        return out

    # -- operations -----------------------------------------------------------------------

    def _check_layout(self, health: Sequence[Mapping[str, Any]]) -> None:
        """Refuse a tensor that the shards already hold cut into other parts (another
        process registered it with another ``partitioner`` / ``bucket_cap_mb``): this table
        would read and update a copy of its own that no one else sees."""
        held = held_keys(health)
        for name in self.names:
            ours = {p.key for p in self._parts[name]}
            theirs = {k for k in held if k == name or k.startswith(name + "/part")}
            # A subset of ours is a registration in progress (parts on several shards).
            if theirs - ours:
                raise ValueError(
                    f"the parameter-server shards hold {name!r} as {len(theirs)} part(s) "
                    f"({', '.join(sorted(theirs)[:3])}{', ...' if len(theirs) > 3 else ''}), "
                    f"this process would use {len(ours)} ({', '.join(sorted(ours)[:3])}"
                    f"{', ...' if len(ours) > 3 else ''}). Fix: give every process of the job "
                    "the same partitioner, small_tensor_bytes and bucket_cap_mb")

    def register(self) -> dict[str, torch.Tensor]:
        """Create the tensors on the shards (first registration wins); returns current values.
        ``ValueError`` when the shards hold one of them cut into other parts."""
        self._check_layout(self.client.health())
        distinct: list[dict[str, Any]] = []
        reqs: list[Request] = []
        own: dict[str, torch.Tensor] = {}
        for shard, parts in sorted(self._by_shard(self.names).items()):
            metas, entries = [], []
            for p in parts:
                own[p.key] = _rows(self._params[p.name], p)
                spec = self._specs[p.name]
                idx = None
                if spec is not None:
                    if spec not in distinct:
                        distinct.append(spec)
                    idx = distinct.index(spec)
                metas.append({"mode": self.mode, "spec": idx,
                              "replicas_to_aggregate": self.replicas_to_aggregate})
                entries.append(Entry(p.key, _rows(self._params[p.name], p)))
            reqs.append((shard, "register", {"entries": metas, "specs": distinct}, entries))
        names = self.names

        def finish(msgs: list[Message]) -> dict[str, torch.Tensor]:
            # A shard answers with the tensors registered before; those this call created
            # hold our own values, at version 0 (a private copy, like a pull's).
            mine = [Entry(k, own[k].detach().clone(), 0) for m in msgs
                    for k in m.fields.get("created", []) if k in own]
            return self._assemble([*msgs, Message("register", {}, mine)], names)

        return self.client.submit(reqs, finish).result()

    def join(self, *, register: bool, timeout: float | None = None,
             poll: float = 0.05) -> dict[str, torch.Tensor]:
        """Start from the shards' values: :meth:`register` them (``register=True``, the chief's
        part) or wait until they are registered and pull them (everybody else), so every
        worker starts from the chief's initial values rather than whichever registered first.

        Raises :class:`stratagem.errors.PeerTimeoutError` if nothing is registered within
        ``timeout`` seconds (default: the client's timeout).
        """
        if register:
            return self.register()
        wait = self.client.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + wait
        # Wait on the shards' ``health`` (it lists the names they hold), not by pulling: a pull
        # of a name not yet registered is refused with NOT_FOUND and every refusal is logged
        # by the shard, which read like an error in every job's log.
        wanted = {shard: {p.key for p in parts}
                  for shard, parts in self._by_shard(self.names).items()}
        total = sum(map(len, wanted.values()))
        while True:
            remaining = deadline - time.monotonic()
            health = self.client.health(timeout=max(0.1, min(remaining, self.client.timeout)))
            self._check_layout(health)  # another cut never becomes ours: say so now
            missing = 0
            for shard, keys in wanted.items():
                held = health[shard].get("versions")
                missing += len(keys - set(held)) if isinstance(held, dict) else len(keys)
            if not missing:
                return self.pull()
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"the chief (replica 0) did not register the parameters on the "
                    f"parameter-server shards within timeout={wait:g} s ({missing} of {total} "
                    "tensor parts still missing); check that the chief started and reached "
                    "prepare(), or raise timeout=")
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    def pull_async(self, names: Sequence[str] | None = None, *,
                   into: Mapping[str, torch.Tensor] | None = None
                   ) -> PSFuture[dict[str, torch.Tensor]]:
        """Start pulling (e.g. next step's parameters while this step computes)."""
        names = self.names if names is None else list(names)
        reqs: list[Request] = [(s, "pull", {"names": [p.key for p in parts]}, ())
                               for s, parts in sorted(self._by_shard(names).items())]
        return self.client.submit(reqs, lambda ms: self._assemble(ms, names, into))

    def fetch_async(self, names: Sequence[str] | None = None
                    ) -> PSFuture[tuple[dict[str, torch.Tensor], dict[str, int]]]:
        """Start pulling ``names``; the result is ``(values, versions)`` with each tensor's
        (lowest part's) version, read from the same snapshot as its value."""
        names = self.names if names is None else list(names)
        reqs: list[Request] = [(s, "pull", {"names": [p.key for p in parts]}, ())
                               for s, parts in sorted(self._by_shard(names).items())]

        def finish(msgs: list[Message]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
            seen = {e.name: int(e.version or 0) for m in msgs for e in m.entries}
            values = self._assemble(msgs, names)
            return values, {n: min(seen[p.key] for p in self._parts[n]) for n in names}

        return self.client.submit(reqs, finish)

    def pull(self, names: Sequence[str] | None = None, *,
             into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Current values (copied into ``into[name]`` where given, e.g. the model's params)."""
        return self.pull_async(names, into=into).result()

    def _base(self, p: Part, base_versions: Mapping[str, int] | int | None) -> int:
        if isinstance(base_versions, int):
            return base_versions
        if base_versions is not None and p.name in base_versions:
            return int(base_versions[p.name])
        with self._vlock:
            v = self._versions.get(p.key)
        if v is None:
            raise ValueError(f"no base version for {p.name!r}: call register() or pull() first, "
                             "or pass base_versions")
        return v

    def push_async(self, grads: Mapping[str, torch.Tensor],
                   base_versions: Mapping[str, int] | int | None = None, *,
                   compress: str | None = None, max_staleness: int | None = None
                   ) -> PSFuture[dict[str, PushOutcome]]:
        """Start pushing gradients computed on ``base_versions`` (default: last pulled)."""
        return self.push_fetch_async(grads, base_versions, fetch=None, compress=compress,
                                     max_staleness=max_staleness).map(lambda r: r.outcomes)

    def push_fetch_async(self, grads: Mapping[str, torch.Tensor],
                         base_versions: Mapping[str, int] | int | None = None, *,
                         fetch: Sequence[str] | None, compress: str | None = None,
                         max_staleness: int | None = None,
                         max_request_bytes: int | None = None) -> PSFuture[PushFetch]:
        """Push gradients and fetch ``fetch`` (tensor names) in one round trip per shard:
        each shard applies the push, then answers with the values after it (a Downpour step).

        ``max_request_bytes``: split each shard's push into several concurrent calls of at
        most that many gradient bytes (whole parts; each call fetches the parts it pushes),
        so the values of one bucket stream back while the next is still going up.
        """
        if max_request_bytes is not None and (not isinstance(max_request_bytes, int)
                                              or max_request_bytes < 1):
            raise ValueError(f"max_request_bytes must be None or a positive int, got "
                             f"{max_request_bytes!r}")
        cdtype = KINDS[check_compression(compress, name="compress")]
        names = list(grads)
        fetch_names = [] if fetch is None else list(fetch)
        by_shard = self._by_shard(names)
        fetch_by_shard = self._by_shard(fetch_names)
        ms = self.max_staleness if max_staleness is None else max_staleness
        reqs: list[Request] = []
        order: list[list[Part]] = []
        hooks: list[_ShmCall | None] = []
        for shard in sorted(set(by_shard) | set(fetch_by_shard)):
            buckets = _buckets(by_shard.get(shard, []), max_request_bytes)
            fetch_keys: list[list[str]] = [[] for _ in buckets]
            where = {p.key: i for i, b in enumerate(buckets) for p in b}
            for p in fetch_by_shard.get(shard, []):
                fetch_keys[where.get(p.key, len(buckets) - 1)].append(p.key)
            for parts, keys in zip(buckets, fetch_keys, strict=True):
                items: list[tuple[Part, torch.Tensor, torch.dtype, int]] = []
                for p in parts:
                    g = grads[p.name]
                    if tuple(g.shape) != self._shapes[p.name]:
                        raise ValueError(f"gradient for {p.name!r} has shape "
                                         f"{tuple(g.shape)}, the parameter has "
                                         f"{self._shapes[p.name]}")
                    dtype = (cdtype if cdtype is not None and g.is_floating_point()
                             else g.dtype)
                    items.append((p, _rows(g, p), dtype, self._base(p, base_versions)))
                wanted = keys if fetch is not None else None
                call = (self._shm_call(shard, items, wanted, ms) if len(buckets) == 1
                        else None)
                if call is not None:
                    reqs.append((shard, "shm_push", call.fields, ()))
                else:
                    entries = [Entry(p.key, g if g.dtype == dtype else g.to(dtype), base)
                               for p, g, dtype, base in items]
                    fields: dict[str, Any] = {"max_staleness": ms}
                    if wanted is not None:
                        fields["fetch"] = wanted
                    reqs.append((shard, "push", fields, entries))
                hooks.append(call)
                order.append(parts)

        def finish(msgs: list[Message]) -> PushFetch:
            msgs = [m if call is None else call.message(m)
                    for m, call in zip(msgs, hooks, strict=True)]
            per_part: dict[str, list[PushOutcome]] = {}
            for parts, m in zip(order, msgs, strict=True):
                for p, r in zip(parts, m.fields["results"], strict=True):
                    per_part.setdefault(p.name, []).append(PushOutcome(*r))
            outcomes = {n: _combine(per_part[n]) for n in names}
            if fetch is None:
                return PushFetch(outcomes, {}, {})
            seen = {e.name: int(e.version or 0) for m in msgs for e in m.entries}
            values = self._assemble(msgs, fetch_names)
            versions = {n: min(seen[p.key] for p in self._parts[n]) for n in fetch_names}
            return PushFetch(outcomes, values, versions)

        after = [None if c is None else c.after for c in hooks] if any(hooks) else None
        direct = ([None if c is None or c.region.bell is None else c.direct for c in hooks]
                  if any(hooks) else None)
        return self.client.submit(reqs, finish, after=after, direct=direct)

    # -- same-host shared memory ----------------------------------------------------------

    def _shm_call(self, shard: int, items: Sequence[tuple[Part, torch.Tensor, torch.dtype, int]],
                  fetch: Sequence[str] | None, max_staleness: int | None) -> _ShmCall | None:
        """The push+fetch of one shard through its shared-memory region, the gradients
        written into it now (the caller may change them once we return); None where the gRPC
        path applies: shared memory off or unavailable for this shard, a tensor or dtype
        outside the region's layout, or the region busy with another call."""
        region = self._shm_regions.get(shard)
        if region is None:
            if not self._shm_wanted[shard]:
                return None
            with self._shm_lock:  # one region per shard, whichever thread comes first
                region = self._shm_regions.get(shard)
                if region is None and self._shm_wanted[shard]:
                    region = self._shm_attach(shard, items, fetch or ())
            if region is None:
                return None
        lay = region.layout
        if region.pid != os.getpid():  # a forked child: its parent's region, not its own
            return None
        if region.dead or any(p.key not in lay.grads or lay.grads[p.key].dtype != dtype
                              for p, _, dtype, _ in items) or any(
                k not in lay.values for k in fetch or ()):
            return None
        if not region.lock.acquire(blocking=False):
            return None
        try:
            if region.dead:
                region.lock.release()
                return None
            with torch.no_grad():
                for p, g, _, _ in items:
                    region.grads[p.key].copy_(g)  # casts as .to(dtype) does
        except BaseException:
            region.lock.release()
            raise
        fields: dict[str, Any] = {"region": region.region_id, "max_staleness": max_staleness,
                                  "push": [[p.key, base] for p, _, _, base in items]}
        if fetch is not None:
            fields["fetch"] = list(fetch)
        self.client.account(sum(lay.grads[p.key].nbytes for p, _, _, _ in items),
                            sum(lay.values[k].nbytes for k in fetch or ()))
        return _ShmCall(region, fields, list(fetch or ()), self.client.addresses[shard],
                        self.client.limits)

    def _shm_attach(self, shard: int, items: Sequence[tuple[Part, torch.Tensor, torch.dtype, int]],
                    fetch: Sequence[str]) -> shm.WorkerRegion | None:
        """Create this shard's region for the tensors of this call (pushed and fetched) and
        have the shard map it; None (and gRPC for this shard from now on) if either fails."""
        self._shm_wanted[shard] = False  # one try per shard, whatever happens
        declared: dict[str, torch.dtype] = {p.key: dtype for p, _, dtype, _ in items}
        for k in fetch:
            declared.setdefault(k, self._dtypes[self._part_by_key[k].name])
        if not declared or not all(d.is_floating_point for d in declared.values()):
            return None
        lay = shm.layout([(k, d, self._dtypes[self._part_by_key[k].name],
                           self._part_by_key[k].shape) for k, d in declared.items()])
        try:
            region = shm.WorkerRegion(lay)
        except (OSError, AttributeError, ValueError) as exc:
            log.info("parameter-server shared memory unavailable (%s); using gRPC", exc)
            return None
        bell: shm.Bell | None = None
        if shm.bell_enabled():
            try:
                bell = shm.Bell(region.nonce)
            except OSError as exc:
                log.info("parameter-server doorbell unavailable (%s); steps use gRPC", exc)
        fields: dict[str, Any] = {
            "pid": os.getpid(), "fd": region.fd, "size": lay.size, "nonce": region.nonce.hex(),
            "entries": [[k, wire.DTYPE_NAMES[d]] for k, d in declared.items()]}
        if bell is not None:
            fields["bell"] = bell.declare()
        try:
            reply = self.client.call(shard, "shm_attach", fields)
            rid = reply.fields.get("region")
            if not isinstance(rid, str):
                raise RemoteError("shm_attach answered no region id", code="DATA_LOSS",
                                  address=self.client.addresses[shard])
        except BaseException as exc:
            region.release()
            if bell is not None:
                bell.close()
            if not isinstance(exc, (StratagemError, ValueError)):
                raise
            log.info("parameter-server shard %s did not map a shared-memory region (%s); "
                     "using gRPC", self.client.addresses[shard], exc)
            return None
        finally:
            region.close_fd()
        if bell is not None:
            if reply.fields.get("bell") is True:
                bell.opened()
                region.bell = bell
            else:  # an older shard, or one that refused the pipes: gRPC carries the steps
                bell.close()
        region.region_id = rid
        if not self._shm_regions:
            self.client.on_close(self._shm_close)
        self._shm_regions[shard] = region
        return region

    def _shm_close(self) -> None:
        """Detach the regions (best effort, briefly: a dead shard must not hold up closing)
        and drop the mappings."""
        regions, self._shm_regions = self._shm_regions, {}
        # A call in flight finishes first (briefly): detaching under it would fail it.
        held = {s: r.lock.acquire(timeout=2.0) for s, r in regions.items()}
        for r in regions.values():
            r.dead = True  # no new call takes it
        reqs: list[Request] = [(s, "shm_detach", {"region": r.region_id}, ())
                               for s, r in sorted(regions.items())]
        try:
            if reqs:
                self.client.submit(reqs, lambda ms: None, timeout=2.0).result()
        except StratagemError:
            pass
        finally:
            for s, r in regions.items():
                if held[s]:
                    r.lock.release()
                r.release()

    @property
    def shared_memory_shards(self) -> list[int]:
        """The shards this table reaches through a shared-memory region (alive)."""
        return sorted(s for s, r in self._shm_regions.items() if not r.dead)

    def push(self, grads: Mapping[str, torch.Tensor],
             base_versions: Mapping[str, int] | int | None = None, *,
             compress: str | None = None, max_staleness: int | None = None
             ) -> dict[str, PushOutcome]:
        """Push gradients; returns per tensor the staleness and what the shard did."""
        return self.push_async(grads, base_versions, compress=compress,
                               max_staleness=max_staleness).result()

    def _row_parts(self, name: str, indices: torch.Tensor, every_part: bool = False
                   ) -> list[tuple[Part, torch.Tensor, torch.Tensor]]:
        parts = self._check(name)
        shape = self._shapes[name]
        if len(shape) < 1:
            raise ValueError(f"{name!r} is a scalar; rows need a tensor with dim >= 1")
        idx = torch.as_tensor(indices).to(torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= shape[0]):
            raise IndexError(f"row indices for {name!r} must be in [0, {shape[0]}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        out = []
        for p in parts:
            mask = (idx >= p.row_start) & (idx < p.row_end)
            if every_part or p.num_parts == 1 or bool(mask.any()):
                out.append((p, mask, idx[mask] - p.row_start))
        return out

    def pull_rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` of 2-D+ tensor ``name`` (e.g. the embeddings of a batch's tokens)."""
        return self.pull_rows_versioned(name, indices)[0]

    def pull_rows_versioned(self, name: str, indices: torch.Tensor
                            ) -> tuple[torch.Tensor, int]:
        """:meth:`pull_rows` plus the (lowest part's) version the rows were read at."""
        flat = torch.as_tensor(indices).to(torch.int64).reshape(-1)
        # Shards refuse repeated rows (a reply must not grow beyond the tensor): ask for each
        # row once and expand the repeats here.
        rows, inverse = torch.unique(flat, return_inverse=True)
        routed = self._row_parts(name, rows)
        reqs: list[Request] = [(p.shard, "pull_rows", {"name": p.key},
                                [Entry("indices", local)]) for p, _, local in routed]
        n = int(rows.numel())

        def finish(msgs: list[Message]) -> tuple[torch.Tensor, int]:
            version = min((int(m.entries[0].version or 0) for m in msgs), default=0)
            with self._vlock:
                for (p, _, _), m in zip(routed, msgs, strict=True):
                    self._versions[p.key] = int(m.entries[0].version or 0)
            if len(routed) == 1 and routed[0][0].num_parts == 1:
                out = msgs[0].entries[0].tensor
            else:
                out = torch.empty((n, *self._shapes[name][1:]), dtype=self._dtypes[name])
                for (_, mask, _), m in zip(routed, msgs, strict=True):
                    out[mask] = m.entries[0].tensor
            if n == flat.numel() and bool((rows == flat).all()):
                return out, version
            return out.index_select(0, inverse), version

        return self.client.submit(reqs, finish).result()

    def push_sparse(self, name: str, indices: torch.Tensor, values: torch.Tensor, *,
                    base_version: int | None = None, compress: str | None = None,
                    max_staleness: int | None = None) -> PushOutcome:
        """Push the gradient rows ``values`` of rows ``indices`` (duplicates are summed)."""
        return self.push_sparse_async(name, indices, values, base_version=base_version,
                                      compress=compress, max_staleness=max_staleness).result()

    def push_sparse_async(self, name: str, indices: torch.Tensor, values: torch.Tensor, *,
                          base_version: int | None = None, compress: str | None = None,
                          max_staleness: int | None = None) -> PSFuture[PushOutcome]:
        """Start :meth:`push_sparse`. In ``"sync"`` mode every part of a partitioned tensor
        gets a (possibly empty) push, so every part's version advances together."""
        cdtype = KINDS[check_compression(compress, name="compress")]
        routed = self._row_parts(name, indices, every_part=self.mode == "sync")
        values = values.reshape(-1, *self._shapes[name][1:])
        if cdtype is not None:
            values = values.to(cdtype)
        ms = self.max_staleness if max_staleness is None else max_staleness
        reqs: list[Request] = []
        for p, mask, local in routed:
            base = base_version if base_version is not None else self._base(p, None)
            reqs.append((p.shard, "push_sparse", {"name": p.key, "max_staleness": ms},
                         [Entry("indices", local), Entry("values", values[mask], base)]))
        return self.client.submit(
            reqs, lambda ms_: _combine([PushOutcome(*m.fields["results"][0]) for m in ms_]))

    def elastic_exchange(self, params: Mapping[str, torch.Tensor], moving_rate: float
                         ) -> dict[str, torch.Tensor]:
        """EASGD: per tensor ``d = x - center; center += moving_rate * d``; returns ``d``.

        The caller then applies ``x -= moving_rate * d`` to its local copy.
        """
        if not 0.0 < float(moving_rate) <= 1.0:
            raise ValueError(f"moving_rate must be in (0, 1], got {moving_rate!r}")
        names = list(params)
        reqs: list[Request] = [
            (s, "elastic", {"moving_rate": float(moving_rate)},
             [Entry(p.key, _rows(params[p.name].detach(), p)) for p in parts])
            for s, parts in sorted(self._by_shard(names).items())]
        return self.client.submit(reqs, lambda ms: self._assemble(ms, names)).result()

    def contribute(self, deltas: Mapping[str, torch.Tensor], base_versions: Mapping[str, int],
                   *, samples: float, compression: str | None = None,
                   lost: Mapping[str, torch.Tensor] | None = None) -> Contribution:
        """Asynchronous DiLoCo: send one replica's pseudo-gradients (``deltas``, computed on
        the model whose parts had the versions ``base_versions``, by part key (as
        :meth:`part_versions` returns them), covering ``samples``) to the rounds open on the shards
        (mode "outer"). ``compression``: None, "bf16"/"fp16" (a cast) or "int8"/"int4"
        (blockwise, each part quantized alone); with a quantized kind, ``lost[name]`` (fp32,
        the tensor's shape) receives what quantization dropped, for error feedback."""
        from stratagem.compression import ASYNC_OUTER_KINDS
        from stratagem.quantize import QUANT_KINDS

        check_compression(compression, name="compression", kinds=ASYNC_OUTER_KINDS)
        reqs: list[Request] = []
        order: list[list[Part]] = []
        for shard, parts in sorted(self._by_shard(list(deltas)).items()):
            entries: list[Entry] = []
            for p in parts:
                d = _rows(deltas[p.name].detach(), p)
                base = int(base_versions[p.key])
                if compression in QUANT_KINDS:
                    payload = updates.encode(d, compression)
                    if lost is not None:
                        back = updates.decode(payload, compression, d)
                        _rows(lost[p.name], p).copy_(d.float() - back)
                    entries.append(Entry(p.key, payload, base))
                else:
                    cdtype = KINDS[compression]
                    entries.append(Entry(p.key, d if cdtype is None else d.to(cdtype), base))
            reqs.append((shard, "contribute", {"samples": float(samples),
                                               "compression": compression}, entries))
            order.append(parts)

        def finish(msgs: list[Message]) -> Contribution:
            statuses: dict[str, str] = {}
            staleness: dict[str, int] = {}
            versions: dict[str, int] = {}
            for parts, m in zip(order, msgs, strict=True):
                for p, (stale, status, version) in zip(parts, m.fields["results"], strict=True):
                    statuses[p.key], staleness[p.key], versions[p.key] = status, stale, version
            return Contribution(statuses, staleness, versions)

        return self.client.submit(reqs, finish).result()

    def finish_round(self, joined: Contribution, *, grace: float | None, force: bool = False,
                     leaving: bool = False, timeout: float | None = None,
                     have: Mapping[str, tuple[int, int]] | None = None,
                     base: Mapping[str, torch.Tensor] | None = None,
                     down: str | None = None) -> RoundEnd:
        """Wait for the rounds ``joined`` left open to close (at most ``grace`` seconds, None:
        until ``timeout``), then close those still open (their grace window has passed on the
        shard's clock; ``force``: at once, without waiting) and fetch the newest values.
        Raises :class:`stratagem.errors.PeerTimeoutError` when a round is still open after
        ``timeout`` seconds (no grace window and too few contributions). ``leaving``: this
        was the replica's last pseudo-gradient; later rounds need one fewer.

        ``have`` (part key -> (version, lineage)), ``base`` (name -> the values held) and
        ``down`` (the slots' ``outer_download`` kind): a part whose shard still keeps the
        encoded updates since the version held comes back as them, applied here to ``base``
        (:mod:`stratagem.ps.updates`); the result is bitwise the shard's value."""
        wait = self.client.timeout if timeout is None else float(timeout)
        t0 = time.monotonic()
        deadline = t0 + wait
        open_keys = {k: v for k, v in joined.versions.items()
                     if joined.statuses[k] == "accumulated"}
        if open_keys and not force:
            limit = wait if grace is None else min(wait, float(grace))
            self._wait_keys({k: v + 1 for k, v in open_keys.items()}, limit)
        closed_early = 0
        while True:
            reqs: list[Request] = []
            order: list[list[str]] = []
            for shard, parts in sorted(self._by_shard(self.names).items()):
                keys = [p.key for p in parts]
                # -1 for a part whose round is not ours to close: only its value comes back.
                versions = {k: int(open_keys.get(k, -1)) for k in keys}
                fields: dict[str, Any] = {"versions": versions, "force": force,
                                          "leaving": leaving, "fetch": True}
                if have is not None and base is not None and down is not None:
                    fields["have"] = {k: [int(have[k][0]), int(have[k][1])]
                                      for k in keys if k in have}
                reqs.append((shard, "close_round", fields, ()))
                order.append(keys)
            leaving = False  # once per slot
            msgs = self.client.submit(reqs, lambda ms: ms).result()
            still: dict[str, int] = {}
            for keys, m in zip(order, msgs, strict=True):
                for k, (status, version) in zip(keys, m.fields["results"], strict=True):
                    if status in ("applied", "refused") and k in open_keys:
                        closed_early = 1
                    elif status == "open":
                        still[k] = version
            if not still:
                lineages = {k: int(v) for m in msgs
                            for k, v in (m.fields.get("lineage") or {}).items()
                            if isinstance(v, int)}
                msgs = [self._rebuilt(m, base, down) for m in msgs]
                values = self._assemble(msgs, self.names)
                seen = {e.name: int(e.version or 0) for m in msgs for e in m.entries}
                versions_by_name = {n: min(seen[p.key] for p in self._parts[n])
                                    for n in self.names}
                return RoundEnd(values, versions_by_name, seen, closed_early,
                                time.monotonic() - t0, lineages)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerTimeoutError(
                    f"an outer round on the parameter-server shards stayed open for "
                    f"{wait:g} s with fewer than min_contributions={self.replicas_to_aggregate} "
                    "pseudo-gradients and no grace window to close it; check for dead "
                    "replicas, lower min_contributions, or pass grace_window=")
            open_keys = still
            self._wait_keys({k: v + 1 for k, v in still.items()},
                            remaining if grace is None else min(remaining, 0.5))

    def _rebuilt(self, m: Message, base: Mapping[str, torch.Tensor] | None,
                 down: str | None) -> Message:
        """``m`` with each chain of encoded updates (``fields["updates"]``: key -> count, the
        entries in order) replaced by the value it rebuilds from ``base``; a chain that is
        not one (a count out of range, entries of another name, a payload of the wrong size)
        raises :class:`StratagemError` before anything is applied."""
        counts = m.fields.get("updates") or {}
        if not counts:
            return m
        if not isinstance(counts, dict) or base is None or down is None:
            raise StratagemError(f"a parameter-server shard sent encoded model updates "
                                 f"({counts!r}) that this replica did not ask for")
        entries: list[Entry] = []
        i, es = 0, m.entries
        while i < len(es):
            e = es[i]
            c = counts.get(e.name)
            if c is None:
                entries.append(e)
                i += 1
                continue
            part = self._part_by_key.get(e.name)
            if (part is None or not isinstance(c, int) or isinstance(c, bool)
                    or not 1 <= c <= updates.HISTORY or i + c > len(es)
                    or any(x.name != e.name for x in es[i:i + c])):
                raise StratagemError(f"a parameter-server shard sent a malformed chain of "
                                     f"encoded updates for {e.name!r} (count {c!r})")
            value = _rows(base[part.name].detach(), part).to("cpu")
            try:
                for x in es[i:i + c]:
                    value = updates.apply(value, x.tensor, down)
            except ValueError as exc:
                raise StratagemError(f"a parameter-server shard sent an encoded update for "
                                     f"{e.name!r} that is not one: {exc}") from None
            entries.append(Entry(e.name, value, es[i + c - 1].version))
            i += c
        return Message(m.op, m.fields, entries, m.nbytes)

    def leave_rounds(self) -> None:
        """Tell the shards this replica sends no more pseudo-gradients (it finished training):
        later rounds need one contribution fewer (at least 1)."""
        reqs: list[Request] = [(shard, "close_round", {
            "versions": {p.key: -1 for p in parts}, "leaving": True}, ())
            for shard, parts in sorted(self._by_shard(self.names).items())]
        self.client.submit(reqs, lambda ms: None).result()

    def _wait_keys(self, goal: Mapping[str, int], timeout: float) -> bool:
        """Wait until every part key reaches its version in ``goal``, at most ``timeout``
        seconds; whether they did (nothing fetched)."""
        by_shard: dict[int, list[str]] = {}
        for k in goal:
            by_shard.setdefault(self._part_by_key[k].shard, []).append(k)
        deadline = time.monotonic() + timeout
        while by_shard:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            shards = sorted(by_shard)
            reqs: list[Request] = [(s, "wait_version", {
                "timeout": remaining, "names": by_shard[s],
                "min_versions": {k: goal[k] for k in by_shard[s]}, "fetch": []}, ())
                for s in shards]
            msgs = self.client.submit(reqs, lambda ms: ms,
                                      timeout=remaining + self.client.timeout).result()
            for s, m in zip(shards, msgs, strict=True):
                if m.fields.get("reached"):
                    del by_shard[s]
        return True

    def wait_version(self, min_version: int, timeout: float | None = None, *,
                     names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Block until every tensor (of ``names``, default all) reaches ``min_version``;
        returns the values then.

        Raises :class:`stratagem.errors.PeerTimeoutError` after ``timeout`` seconds (default:
        the client's timeout) if it was not reached, e.g. because workers died.
        """
        names = self.names if names is None else list(names)
        values, _ = self.wait_for({n: int(min_version) for n in names}, timeout=timeout)
        return values

    def wait_for(self, targets: Mapping[str, int], *, fetch: Sequence[str] | None = None,
                 timeout: float | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Block until tensor ``name`` reaches version ``targets[name]`` for every name.

        Returns ``(values, versions)``: the values of ``fetch`` (default: every name in
        ``targets``) and the versions of every name in ``targets`` once reached. Raises
        :class:`stratagem.errors.PeerTimeoutError` after ``timeout`` seconds (default: the
        client's timeout) naming the shards that did not get there.
        """
        wait = self.client.timeout if timeout is None else float(timeout)
        names = list(targets)
        wanted = names if fetch is None else list(fetch)
        wanted_keys = {p.key for n in wanted for p in self._check(n)}
        goal = {p.key: int(targets[n]) for n in names for p in self._check(n)}
        pending = dict(sorted(self._by_shard(names).items()))
        got: list[Message] = []
        versions: dict[str, int] = {}
        deadline = time.monotonic() + wait
        # Shards bound each wait (and answer early when busy), so poll until our deadline.
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            shards = list(pending)
            reqs: list[Request] = []
            for s in shards:
                keys = [p.key for p in pending[s]]
                reqs.append((s, "wait_version", {
                    "timeout": remaining, "names": keys,
                    "min_versions": {k: goal[k] for k in keys},
                    "fetch": [k for k in keys if k in wanted_keys]}, ()))
            msgs = self.client.submit(reqs, lambda ms: ms,
                                      timeout=remaining + self.client.timeout).result()
            for s, m in zip(shards, msgs, strict=True):
                if m.fields.get("reached"):
                    got.append(m)
                    versions.update(m.fields.get("versions", {}))
                    del pending[s]
            if not pending:
                values = self._assemble(got, wanted)
                return values, {n: min(versions[p.key] for p in self._parts[n]) for n in names}
            if time.monotonic() >= deadline:
                break
        late = [self.client.addresses[s] for s in pending]
        lows = {k: v for m in msgs for k, v in m.fields.get("versions", {}).items()
                if v < goal.get(k, 0)}
        raise PeerTimeoutError(
            f"parameter-server shard(s) {late} did not reach version "
            f"{max(goal.values(), default=0)} within {wait:g} s (still at "
            f"{dict(list(lows.items())[:3])}): fewer than replicas_to_aggregate="
            f"{self.replicas_to_aggregate} workers pushed; check for dead workers or lower "
            "replicas_to_aggregate")

    def set_hyperparameters(self, names: Sequence[str] | None = None,
                            **hyperparams: Any) -> None:
        """Change optimizer hyperparameters on the shards (e.g. ``lr`` from a scheduler), for
        the tensors ``names`` (default: all)."""
        names = self.names if names is None else list(names)
        hyper = {k: ps_optim.jsonable(k, v) for k, v in hyperparams.items()}
        for name in names:
            spec = self._specs[name]
            if spec is not None:
                ps_optim.validate_spec({**spec, **hyper})
                spec.update(hyper)
        reqs: list[Request] = [(s, "set_hyperparams", {"hyperparams": hyper,
                                                       "names": [p.key for p in parts]}, ())
                               for s, parts in sorted(self._by_shard(names).items())]
        self.client.submit(reqs, lambda ms: None).result()

    def set_optimizer_specs(self, specs: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the optimizer specs of the tensors named in ``specs``, locally: they take
        effect with the next :meth:`set_state` (e.g. restoring an optimizer checkpoint whose
        hyperparameters differ from the registered ones). Use :meth:`set_hyperparameters` to
        change running shards directly."""
        checked: dict[str, dict[str, Any]] = {}
        for name, spec in specs.items():
            self._check(name)
            if self.mode == "elastic":
                raise ValueError(f"{name!r} is an elastic (EASGD center) tensor: it has no "
                                 "optimizer on the shards, so no spec to set")
            ps_optim.validate_spec(spec)
            checked[name] = dict(spec)
        self._specs.update(checked)

    def get_state(self) -> dict[str, Any]:
        """Everything needed to restore the shards, independent of the placement.

        ``{"params": {name: tensor}, "optimizer": {name: {state_key: tensor}},
        "versions": {name: int}}``; partitioned tensors are reassembled.
        """
        names = self.names
        reqs: list[Request] = [(s, "get_state", {"names": [p.key for p in parts]}, ())
                               for s, parts in sorted(self._by_shard(names).items())]
        msgs = self.client.submit(reqs, lambda ms: ms).result()
        params: dict[str, torch.Tensor] = {}
        opt: dict[str, dict[str, torch.Tensor]] = {}
        versions: dict[str, int] = {}
        by_key: dict[str, tuple[dict[str, Any], Message]] = {}
        for m in msgs:
            for meta in m.fields["slots"]:
                by_key[meta["name"]] = (meta, m)
        for n in names:
            parts = self._parts[n]
            metas = [by_key[p.key] for p in parts]
            vals = [m.entries[meta["param"]].tensor for meta, m in metas]
            params[n] = vals[0] if len(vals) == 1 else torch.cat(vals)
            versions[n] = min(meta["version"] for meta, _ in metas)
            state: dict[str, torch.Tensor] = {}
            meta0 = metas[0][0]
            for k in meta0["opt"]:
                pieces = [m.entries[meta["opt"][k]].tensor for meta, m in metas]
                rowwise = all(t.dim() == len(p.shape) and t.dim() > 0 and t.shape[0] == p.shape[0]
                              for t, p in zip(pieces, parts, strict=True))
                state[k] = torch.cat(pieces) if rowwise and len(pieces) > 1 else pieces[0]
            for k, v in meta0["scalars"].items():
                state[k] = torch.tensor(v)
            opt[n] = state
        return {"params": params, "optimizer": opt, "versions": versions}

    def set_state(self, state: Mapping[str, Any], *, if_newer: bool = False) -> None:
        """Restore :meth:`get_state` output (from any placement) onto the shards; with
        ``if_newer`` a part the shard holds at the same or a newer version is kept."""
        params = state["params"]
        opt = state.get("optimizer", {})
        versions = state.get("versions", {})
        missing = [n for n in self.names if n not in params]
        if missing:
            raise KeyError(f"state has no value for {missing[:3]}; it was saved from a "
                           "different model")
        reqs: list[Request] = []
        for shard, parts in sorted(self._by_shard(self.names).items()):
            metas: list[dict[str, Any]] = []
            entries: list[Entry] = []
            for p in parts:
                value = params[p.name]
                if tuple(value.shape) != self._shapes[p.name]:
                    raise ValueError(f"state[{p.name!r}] has shape {tuple(value.shape)}, the "
                                     f"parameter has {self._shapes[p.name]}")
                meta: dict[str, Any] = {
                    "name": p.key, "version": int(versions.get(p.name, 0)), "mode": self.mode,
                    "spec": self._specs[p.name], "param": len(entries),
                    "replicas_to_aggregate": self.replicas_to_aggregate, "opt": {}}
                entries.append(Entry(p.key, _rows(value.to(self._dtypes[p.name]), p)))
                for k, t in opt.get(p.name, {}).items():
                    rowwise = t.dim() == len(value.shape) and t.dim() > 0 and (
                        t.shape[0] == value.shape[0])
                    meta["opt"][k] = len(entries)
                    entries.append(Entry(f"{p.key}.{k}", _rows(t, p) if rowwise else t))
                metas.append(meta)
            reqs.append((shard, "set_state", {"slots": metas, "if_newer": if_newer}, entries))
        self.client.submit(reqs, lambda ms: None).result()
        with self._vlock:
            for n, parts in self._parts.items():
                for p in parts:
                    self._versions[p.key] = int(versions.get(n, 0))


def _buckets(parts: list[Part], max_bytes: int | None) -> list[list[Part]]:
    """``parts`` cut into calls of at most ``max_bytes`` (a bigger part alone); always at
    least one (possibly empty) run."""
    if max_bytes is None or len(parts) <= 1:
        return [parts]
    return bucketed(parts, max_bytes, lambda p: p.nbytes)


def _combine(outcomes: Sequence[PushOutcome]) -> PushOutcome:
    """One outcome for a partitioned tensor: the worst status, max staleness, min version."""
    status = max((o.status for o in outcomes), key=_STATUS_RANK.__getitem__)
    return PushOutcome(max(o.staleness for o in outcomes), status,
                       min(o.version for o in outcomes))


class _ShmCall:
    """One push+fetch through a shared-memory region: its small request's fields, what
    happens when the call is over (in the call thread: copy the fetched values out and free
    the region for the next call) and the reply turned into a push's reply."""

    __slots__ = ("region", "fields", "fetch", "address", "values", "limits")

    def __init__(self, region: shm.WorkerRegion, fields: dict[str, Any], fetch: list[str],
                 address: str, limits: wire.Limits) -> None:
        self.region, self.fields, self.fetch, self.address = region, fields, fetch, address
        self.values: dict[str, torch.Tensor] = {}
        self.limits = limits

    def direct(self, data: bytes, due: float) -> Message | None:
        """The call through the region's doorbell (:class:`stratagem.ps.shm.Bell`), its
        failures raised as the gRPC call's would be; None (gRPC takes it) for a message
        above the doorbell's bound (a model of very many tensors)."""
        bell = self.region.bell
        where = f"parameter-server shard {self.address}"
        if len(data) > shm.BELL_MAX_BYTES:
            return None
        try:
            if bell is None:
                raise shm.BellClosed("the doorbell is closed")
            reply = bell.call(data, due)
        except shm.BellTimeout:
            raise ParameterServerUnavailable(
                f"{where} did not answer 'shm_push' through its shared-memory doorbell in "
                "time; check that the shard process is running, or raise timeout=",
                address=self.address) from None
        except shm.BellClosed as exc:
            raise ParameterServerUnavailable(
                f"{where} closed the shared-memory doorbell ({exc}): the shard stopped, or "
                "dropped this worker's region; check the shard process", address=self.address
            ) from None
        try:
            msg = wire.decode(reply, self.limits)
        except wire.WireError as exc:
            raise RemoteError(f"{where} sent a malformed reply to 'shm_push': {exc}",
                              code="DATA_LOSS", address=self.address) from None
        if msg.op == "refused":
            status, detail = msg.fields.get("status"), msg.fields.get("detail")
            raise RemoteError(f"{where} refused 'shm_push': {str(status)[:40]}: "
                              f"{str(detail)[:2000]}", code=str(status)[:40],
                              address=self.address)
        return msg

    def after(self, reply: bytes | Message | None, error: BaseException | None) -> None:
        try:
            if reply is not None:
                self.values = {k: self.region.values[k].clone() for k in self.fetch}
            elif not refused_request(error):
                # A lost call (deadline, connection) may still be running on the shard, and a
                # FAILED_PRECONDITION says the shard lost the region: never use it again.
                self.region.dead = True
        finally:
            if self.region.dead:  # retired (or released meanwhile): its doorbell too
                self.region.close_bell()
            self.region.lock.release()

    def message(self, m: Message) -> Message:
        """The reply as a gRPC push's: the fetched values as entries with their versions."""
        versions = m.fields.get("versions")
        if not isinstance(versions, dict) or not all(
                isinstance(versions.get(k), int) for k in self.fetch):
            raise RemoteError(f"parameter-server shard {self.address} answered a shared-memory "
                              "push without the fetched versions", code="DATA_LOSS",
                              address=self.address)
        return Message(m.op, m.fields,
                       [Entry(k, self.values[k], versions[k]) for k in self.fetch], m.nbytes)
