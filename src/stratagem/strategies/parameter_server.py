"""Parameter-server training: Downpour SGD (async) and synchronous replicas with backups (sync).

Dean et al., "Large Scale Distributed Deep Networks", NeurIPS 2012 (Downpour SGD): the
parameters live on parameter-server shards, each worker computes gradients on its copy,
pushes them (every ``push_every`` steps, accumulated in between) and fetches fresh parameters
(every ``fetch_every`` steps); the shards apply each gradient as it arrives, whatever version
of the parameters it was computed on. ``max_staleness`` drops gradients computed on
parameters more than that many versions old (TensorFlow's ``DropStaleGradientOptimizer``).

``mode="sync"`` is TensorFlow's ``SyncReplicasOptimizer``: each version of the parameters is
the previous one updated with the mean of ``replicas_to_aggregate`` gradients computed on it;
with more workers than that the extra ones are *backup workers* whose late gradients are
dropped, so a straggler does not slow the step down.

The optimizer given to ``prepare`` is rebuilt on the shards from its class and hyperparameters
(:mod:`stratagem.ps.optim`): the update rule runs where the parameters live and the worker holds
parameters and gradients only. Transport, placement and the shard side are
:mod:`stratagem.ps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ..compression import COMPRESSIONS
from ..parts.plan import Plan
from ..ps.addresses import shard_addresses
from ..ps.part import ParameterServerLink
from ..strategy import Strategy
from ..validation import check_int

if TYPE_CHECKING:
    from ..ps.placement import Partitioner

__all__ = ["ParameterServer"]

_MODES = ("async", "sync")
#: The base's default ``timeout`` (the part needs it when the plan is declared, which the base
#: does before it sets ``self.timeout``).
class ParameterServer(Strategy):
    """Parameters on parameter-server shards; workers push gradients and pull parameters.

    Arguments (keyword only):

    - ``mode``: ``"async"`` (Downpour SGD) or ``"sync"`` (``SyncReplicasOptimizer``).
    - ``push_every`` / ``fetch_every`` (async, int >= 1): push the gradients accumulated
      (summed, Downpour's "accrued gradients") over that many optimizer steps / fetch the
      parameters every that many steps. Sync mode needs both at 1.
    - ``max_staleness`` (async, int >= 0 or None): the shards drop a gradient computed on
      parameters more than that many versions old (counted in ``metrics()``).
    - ``replicas_to_aggregate`` (sync, default: ``num_replicas_in_sync``): gradients averaged
      per version; with fewer than the workers, the late ones are dropped (backup workers).
    - ``partitioner``, ``small_tensor_bytes``: placement on the shards
      (:mod:`stratagem.ps.placement`): big tensors split along dim 0, small ones grouped.
    - ``compression`` (None, ``"fp16"``, ``"bf16"``): gradients are pushed in 16 bits (half
      the bytes); ``error_feedback=True`` keeps what the cast lost and adds it to the next push
      (:mod:`stratagem.compression`); each worker's residuals are in its checkpoints and come
      back on a restore with as many workers (else they start at zero). An fp16 overflow is never pushed: that push is skipped and
      counted in ``nonfinite_pushes_skipped``.
    - ``prefetch`` (None, True, False; default None = ``False`` in async mode, ``True`` in
      sync mode): overlap the fetch with the next step's compute (see below).
    - ``bucket_cap_mb`` (async; a number of MB, None, or ``"auto"``, the default): the
      push-fetch of a step is cut into concurrent calls of about that many MB (big tensors are
      split into parts of that size on the shards unless a ``partitioner`` is given), so the
      new values of one bucket stream down while the next bucket's gradient streams up (full
      duplex); raised so a step makes at most 16 calls. None: one call per shard. ``"auto"``
      picks by link when the model is prepared: None when every shard address is on this
      machine (loopback, or an address of one of its interfaces: there the pipelining only
      adds calls, 0.37-0.53x a bare gRPC echo's throughput against 0.69-0.77x for one call per
      shard), else 0.125 (slow links: 0.73-0.81x Mirrored's time to target at 20 Mbit/s). An
      explicit value always wins; ``resolved_bucket_cap_mb`` tells which one applies. Results
      are unchanged either way (tested equal). How big tensors are cut on the shards is
      decided once per job, by the first registration (the chief's): a later process uses
      the shards' cut whatever its own buckets (an explicit ``partitioner`` that cuts
      otherwise is refused by name).
    - Shards on this machine are reached through shared memory when a step makes one
      push-fetch call per shard (the ``"auto"`` default there): the tensors are read and
      written in place by the shard, and each step's small message goes through a pair of
      pipes to a shard thread serving only that worker (a "doorbell": two thread wake-ups
      per step instead of gRPC's ~8) (:mod:`stratagem.ps.shm`; ``STRATAGEM_PS_SHM=0`` turns
      the path off, ``STRATAGEM_PS_BELL=0`` keeps the small message on gRPC). Same results;
      any shard where it cannot be set up is reached over gRPC as before.
    - ``staleness_lr`` (async, bool, default False): the shards apply a gradient of
      staleness ``s`` with ``lr / max(1, s)`` (Zhang et al., "Staleness-aware Async-SGD for
      Distributed Deep Learning", IJCAI 2016).
    - ``ps_addresses``: ``"host:port,host:port"`` or a list; default ``STRATAGEM_PS_ADDRS``
      (set by ``stratagem run --num-ps K`` and ``sg.launch(..., num_ps=K)``).
    - Common arguments (``precision``, ``accumulation_steps``, ``timeout``...) as every strategy.

    The optimizer given to ``prepare`` must be SGD, Adam, AdamW, RMSprop or Adagrad (else
    ``TypeError``); each param group keeps its hyperparameters, and a change of them on the
    worker (an LR scheduler) is sent to the shards at the next push. Its local state stays
    empty: ``strategy.save`` reads the optimizer state from the shards and writes it in
    torch's ``state_dict`` format, so checkpoints move between strategies and shard counts.
    Parameters no optimizer steps, and buffers (BatchNorm statistics), stay local to each
    worker; checkpoints hold the chief's buffers, and ``finalize`` sets every worker's to them.

    A worker starting or restarting registers the model (the first registration wins) and
    starts from the values on the shards, without waiting for any other worker. Async mode
    uses no collective while training, so workers may also be launched as separate processes
    (``comm=sg.Comm.single()``). Sync mode agrees on skipping a non-finite step through the
    process group, so its workers must share one; in async mode each worker decides alone and
    a non-finite gradient is never pushed.

    Staleness: ``metrics()["staleness"]`` is the histogram over this worker's pushes of the
    versions applied on the shard between the values a gradient was computed on and its push
    (0 = fresh), ``metrics()["staleness_mean"]`` its mean. With N async workers it is about
    N - 1 without prefetch.

    Prefetch (async: opt-in; sync: the default). Async: right after the push, the next
    parameters are pulled in the background while the next forward/backward computes, and
    installed at the next optimizer step; the next forward therefore uses the parameters
    installed at the *previous* step, all of them from one fetch (never a mix), i.e. every
    gradient is one fetch older (delayed SGD, as tf_cnn_benchmarks' staged variables). The
    gradient's base version is recorded at install, so ``staleness`` and ``max_staleness``
    count honestly. It is off by default because it trades quality for speed: with 4 workers
    on MNIST-5k the mean staleness went from ~3.5 to ~7 and the steps to 93% from ~110 to
    ~300, for no shorter step (``git show 9e4f1fb:benchmarks/results/convergence_ps.md``).
    Sync: the wait for the new version runs in the background and is installed before the
    next forward (a forward pre-hook) — the forward always uses the new version, so results
    equal ``prefetch=False``;
    the user's code between ``optimizer.step()`` and the next forward overlaps the wait, and
    reading the parameters there shows the previous version (and a ``PeerTimeoutError`` of
    that wait surfaces in the next forward). ``model.state_dict()``, ``eval_model``,
    ``global_version``, ``save`` and ``restore`` install what is in flight first. In async
    mode the fetch rides on the push: one round trip per bucket (``bucket_cap_mb``), in which
    the shard applies that bucket's gradient and answers with its values after it, so every
    value installed includes this worker's own last push.

    Backup workers (sync, ``replicas_to_aggregate`` < workers): stop on ``global_version``
    (the global step), not on a local step count — a worker whose gradient is the only one of
    the last version would wait for peers that stopped and raise ``PeerTimeoutError``.

    Sparse embeddings: the weight of an ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(
    sparse=True)`` is pushed as the touched rows only and its rows are pulled on demand,
    just before each forward of that module (a forward pre-hook); fetches skip it.

    ``eval_model(model)`` pulls the current global parameters into ``model`` and returns it.

    On failure: an unreachable or silent shard raises ``ParameterServerUnavailable`` naming
    its address within ``timeout`` seconds; in sync mode a version not reached within
    ``timeout`` (fewer than ``replicas_to_aggregate`` workers pushing) raises
    ``PeerTimeoutError``. A worker dying affects no other worker in async mode (the shards keep
    serving), and in sync mode only when fewer than ``replicas_to_aggregate`` remain.

    Memory: the worker holds its parameters and gradients (no optimizer state), plus one
    gradient copy with ``push_every > 1`` (the accumulation), one with ``error_feedback``,
    and, while a fetch is in flight, the received message (one copy of the fetched
    parameters). A shard holds its slice and the optimizer's state for it.
    """

    name = "ps"

    def __init__(self, *, mode: str = "async", push_every: int = 1, fetch_every: int = 1,
                 max_staleness: int | None = None, replicas_to_aggregate: int | None = None,
                 partitioner: Partitioner | None = None, small_tensor_bytes: int = 65536,
                 compression: str | None = None, error_feedback: bool = False,
                 prefetch: bool | None = None, staleness_lr: bool = False,
                 bucket_cap_mb: float | str | None = "auto",
                 ps_addresses: str | Sequence[str] | None = None,
                 **common: Any) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}. Fix: pass "
                             "mode='async' (Downpour SGD) or mode='sync' (aggregated steps)")
        push_every = _check_count("push_every", push_every)
        fetch_every = _check_count("fetch_every", fetch_every)
        if mode == "sync" and (push_every != 1 or fetch_every != 1):
            raise ValueError(f"mode='sync' pushes and fetches every step, got push_every="
                             f"{push_every}, fetch_every={fetch_every}. Fix: drop them, or use "
                             "mode='async'")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(
                max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got "
                             f"{max_staleness!r}. Fix: pass e.g. max_staleness=4")
        if max_staleness is not None and mode == "sync":
            raise ValueError(f"max_staleness applies to mode='async' (sync mode drops every "
                             f"late gradient), got max_staleness={max_staleness!r}. Fix: drop "
                             "it")
        if replicas_to_aggregate is not None:
            replicas_to_aggregate = _check_count("replicas_to_aggregate", replicas_to_aggregate)
            if mode != "sync":
                raise ValueError(f"replicas_to_aggregate applies to mode='sync', got "
                                 f"replicas_to_aggregate={replicas_to_aggregate} with "
                                 f"mode={mode!r}. Fix: drop it or pass mode='sync'")
        small_tensor_bytes = _check_count("small_tensor_bytes", small_tensor_bytes)
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(f"compression must be None, 'fp16' or 'bf16', got "
                             f"{compression!r}. Fix: pass one of those")
        if error_feedback and compression is None:
            raise ValueError("error_feedback=True needs a lossy compression, got "
                             "compression=None. Fix: pass compression='fp16' or 'bf16', or drop "
                             "error_feedback")
        if prefetch is not None and not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be None, True or False, got {prefetch!r}")
        if prefetch is None:
            # Measured (docs/guide.md, "Prefetch"): async prefetch makes every gradient one
            # fetch staler, which cost ~2x the steps; sync prefetch changes no result.
            prefetch = mode == "sync"
        if bucket_cap_mb is not None and bucket_cap_mb != "auto" and (
                isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                or not 0 < bucket_cap_mb < 1 << 20):
            raise ValueError(f"bucket_cap_mb must be None, 'auto' or a positive number of MB, "
                             f"got {bucket_cap_mb!r}. Fix: pass e.g. bucket_cap_mb=0.125, None "
                             "for one call per shard, or 'auto' (by where the shards are)")
        if not isinstance(staleness_lr, bool):
            raise ValueError(f"staleness_lr must be True or False, got {staleness_lr!r}")
        if staleness_lr and mode == "sync":
            raise ValueError("staleness_lr=True applies to mode='async' (sync mode applies "
                             "only fresh gradients), got it with mode='sync'. Fix: drop "
                             "staleness_lr")
        self.ps_addresses = shard_addresses(ps_addresses, who="ParameterServer")
        self.mode = mode
        self.push_every = push_every
        self.fetch_every = fetch_every
        self.max_staleness = max_staleness
        # None: every replica (resolved by the part over the Comm; see replicas_to_aggregate).
        self.given_replicas_to_aggregate = replicas_to_aggregate
        self.partitioner = partitioner
        self.small_tensor_bytes = small_tensor_bytes
        self.compression = compression
        self.error_feedback = error_feedback
        self.prefetch = prefetch
        self.bucket_cap_mb = bucket_cap_mb
        self.staleness_lr = staleness_lr
        # plan() runs inside super().__init__, before it sets self.timeout.
        super().__init__(**common)

    def plan(self) -> Plan:
        """One part: this worker's link to the shards (:class:`~stratagem.ps.part.
        ParameterServerLink`), which applies every step there."""
        return Plan(ParameterServerLink.spec(
            mode=self.mode, ps_addresses=self.ps_addresses, timeout=self.timeout,
            push_every=self.push_every, fetch_every=self.fetch_every,
            max_staleness=self.max_staleness, replicas_to_aggregate=self.given_replicas_to_aggregate,
            partitioner=self.partitioner, small_tensor_bytes=self.small_tensor_bytes,
            compression=self.compression, error_feedback=self.error_feedback,
            prefetch=self.prefetch, staleness_lr=self.staleness_lr,
            bucket_cap_mb=self.bucket_cap_mb))

    @property
    def replicas_to_aggregate(self) -> int:
        """Gradients averaged per version in sync mode: the given value, else
        ``num_replicas_in_sync``."""
        return _link(self).replicas_to_aggregate

    @property
    def resolved_bucket_cap_mb(self) -> float | None:
        """The ``bucket_cap_mb`` in force: the given value, or for ``"auto"`` None (one call
        per shard) when every shard is on this machine, else 0.125. Worked out once (it may
        resolve host names)."""
        return _link(self).resolved_bucket_cap_mb

    @property
    def global_version(self) -> int:
        """The highest version of the parameters this worker has received: in sync mode the
        number of global steps taken (``SyncReplicasOptimizer``'s global step). Workers with
        backup workers should stop on it rather than on a local step count. Reading it waits
        for the fetch in flight (prefetch) and installs it."""
        return _link(self).global_version


def _link(strategy: ParameterServer) -> ParameterServerLink:
    return cast(ParameterServerLink, strategy.parts[0])


def _check_count(name: str, value: Any) -> int:
    return check_int(name, value, minimum=1, fix=f"pass e.g. {name}=1")
