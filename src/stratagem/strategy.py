"""The ``Strategy`` base: the training-loop contract every strategy fulfils.

How a step flows: ``strategy.backward(loss)`` (divide by ``accumulation_steps``, scale for
fp16) -> [``clip_grad_norm_``: at the boundary, unscale + clip now; before it, a request] ->
wrapped ``optimizer.step()`` -> ``Strategy._step`` (accumulation boundary, unscale, a pending
clip, non-finite decision, agreed across replicas for synchronous strategies) ->
``_apply_update`` (the inner optimizer step, or a push/pull for parameter servers) ->
``_after_update`` (the strategy's synchronisation: nothing, an elastic exchange, an average,
an outer step). ``finalize`` (``_finalize``) is the last synchronisation of the periodic
strategies; ``eval_model`` returns the consensus as a module of the user's class. Strategies
override those hooks and nothing else; the core never asks which strategy it is running.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .comm import Comm
from .context import InputContext, ReplicaContext, enter_replica, enter_scope
from .data import DistributedLoader, skip_first_batches
from .errors import ReplicaMismatchError
from .parts.base import Part
from .parts.tensors import is_dtensor, local
from .precision import Autocast, Precision
from .validation import check_bool, check_int, check_number, check_timeout

__all__ = ["Strategy", "ReduceOp", "Prepared", "StrategyOptimizer", "StepEndHook",
           "register_feature"]

#: Called at the end of every optimizer step that reached an accumulation boundary (applied
#: or skipped: every replica agreed on it), with the stepping optimizer.
StepEndHook = Callable[["StrategyOptimizer"], None]

# ---------------------------------------------------------------------- features
# Strategy.save / restore / fit / on_preemption are conveniences over modules that are built
# on Strategy's public state protocol (stratagem.checkpoint, stratagem.fit,
# stratagem.preemption). Those modules import Strategy, so Strategy cannot import them
# without an import cycle. Instead each registers its entry point here when it is imported,
# and _feature imports the module on the first call that needs it.
_FEATURES: dict[str, Callable[..., Any]] = {}
_FEATURE_MODULES = {"save": "stratagem.checkpoint", "restore": "stratagem.checkpoint",
                    "fit": "stratagem.fit", "on_preemption": "stratagem.preemption"}


def register_feature(name: str, implementation: Callable[..., Any]) -> None:
    """Plug in what ``Strategy.<name>`` runs: ``implementation(strategy, *args, **kwargs)``.
    ``name`` is one of ``save``, ``restore``, ``fit``, ``on_preemption``; registering again
    replaces the previous implementation (a test double, an alternative format)."""
    if name not in _FEATURE_MODULES:
        raise ValueError(f"unknown feature {name!r}; features: {sorted(_FEATURE_MODULES)}")
    _FEATURES[name] = implementation


def _feature(name: str) -> Callable[..., Any]:
    if name not in _FEATURES:
        # ``import stratagem`` no longer imports torch, nor these modules: the first call
        # imports the one that implements ``name`` (it registers itself).
        import importlib

        importlib.import_module(_FEATURE_MODULES[name])
    try:
        return _FEATURES[name]
    except KeyError:
        raise RuntimeError(f"Strategy.{name} is implemented by {_FEATURE_MODULES[name]}, which "
                           "did not register it. Fix: call stratagem.strategy.register_feature("
                           f"{name!r}, implementation)") from None


class ReduceOp(str, Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


def _normalize_op(op: Any) -> str:
    value = op.value if isinstance(op, ReduceOp) else str(op).lower()
    if value not in ("sum", "mean", "max", "min"):
        raise ValueError(f"reduce op must be one of sum, mean, max, min (or sg.ReduceOp), got {op!r}")
    return value


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def _uncompiled(module: nn.Module) -> nn.Module:
    """The module behind ``torch.compile``'s ``OptimizedModule`` wrappers (``_orig_mod``)."""
    while type(module).__name__ == "OptimizedModule":
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        module = inner
    return module


@dataclass
class _ClipRequest:
    """A ``clip_grad_norm_`` call waiting for the accumulation boundary. ``norm`` is the
    tensor returned to the caller, filled in place when the norm is computed."""

    max_norm: float
    norm_type: float
    norm: torch.Tensor


class Prepared:
    """What ``prepare`` made of one model: the wrapped model, the bare module (names as the
    user defined them; the module behind ``torch.compile``), the wrapped optimizers, and a
    dict the strategy may keep state in. ``given`` is the object passed to ``prepare`` (a
    ``torch.compile`` wrapper, or the module itself)."""

    def __init__(self, model: nn.Module, module: nn.Module, given: nn.Module | None = None) -> None:
        self.model = model
        self.module = module
        self.given = given if given is not None else module
        self.optimizers: list[StrategyOptimizer] = []
        self.state: dict[str, Any] = {}
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        self.local_steps = 0


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare`` returns: ``step()`` runs the strategy's step; ``zero_grad()``
    is skipped between the micro-batches of one accumulated step. Everything else (param
    groups, state, LR schedulers) is the wrapped optimizer's."""

    def __init__(self, strategy: Strategy, optimizer: torch.optim.Optimizer, prepared: Prepared) -> None:
        # Deliberately not calling Optimizer.__init__: the param groups and state are shared
        # with the wrapped optimizer, not copied.
        self._strategy = strategy
        self.optimizer = optimizer
        self._prepared = prepared
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def strategy(self) -> Strategy:
        """The strategy that prepared this optimizer."""
        return self._strategy

    @property
    def prepared(self) -> Prepared:
        """The ``Prepared`` record of the model this optimizer trains."""
        return self._prepared

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise TypeError("a closure is not supported by strategy optimizers: call "
                            "strategy.backward(loss) then optimizer.step()")
        return self._strategy._step(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._strategy._accumulating():
            return
        self._strategy._end_accumulation()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({type(self._strategy).__name__}, {self.optimizer!r})"


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, torch.distributed.DistError):
        return True
    text = str(exc)
    return any(k in text for k in ("Gloo", "gloo", "Connection closed", "Connection reset",
                                   "Timed out", "NCCL", "Broken pipe"))


class Strategy:
    """Base of every strategy. Built from keyword arguments only.

    Common arguments: ``precision`` ("fp32", "bf16", "fp16"), ``accumulation_steps`` (micro-
    batches per optimizer step on each worker; settable later) or ``global_accumulation_steps``
    (the same as a count over all workers: divided by ``num_replicas_in_sync``), ``timeout`` (seconds before a silent peer becomes :class:`PeerTimeoutError`),
    ``on_nonfinite`` ("raise" or "skip" when no loss scaler is in use), ``device`` (chosen at
    run time when omitted: this worker's CUDA device, else the CPU), ``comm`` (an explicit
    :class:`~stratagem.comm.Comm`; by default the job described by the environment).

    On failure: a collective whose peer dies or stalls raises ``PeerTimeoutError`` naming the
    peer within ``timeout`` (+ a few seconds of diagnosis); nothing waits forever.
    """

    #: True when the step is synchronous across replicas: the skip decision is all-reduced.
    _synchronous_step = False
    #: True when each worker holds optimizer state of its own (saved per rank).
    _local_optimizer_state = False
    #: Short name, also the one ``Strategy.from_name`` accepts.
    name = "strategy"
    #: Where ``Hierarchical`` accepts this strategy: "inner" (synchronises the processes of a
    #: node every step), "outer" (synchronises across nodes, from its parts).
    _hierarchy_roles: tuple[str, ...] = ()
    #: As an inner strategy: True when every process of the group holds the whole, identical
    #: model after each step (so one copy per node needs to cross nodes); False for sharded
    #: models (each process holds its shard, synchronised with its peers on other nodes).
    _replicates_model = True
    #: True when ``prepare`` accepts a model built on the meta device and materialises it
    #: (``Sharded``: only each worker's shards).
    _materializes_meta = False

    def __init__(
        self,
        *,
        precision: str = "fp32",
        accumulation_steps: int | None = None,
        global_accumulation_steps: int | None = None,
        timeout: float = 60.0,
        on_nonfinite: str = "raise",
        device: torch.device | str | None = None,
        comm: Comm | None = None,
        growth_interval: int = 2000,
        init_scale: float = 2.0**16,
        fault_tolerant: bool | None = None,
        min_replicas: int = 1,
        keep_global_batch: bool = False,
    ) -> None:
        if accumulation_steps is not None and global_accumulation_steps is not None:
            raise ValueError(
                f"pass accumulation_steps (per worker) or global_accumulation_steps (over all "
                f"workers), not both; got accumulation_steps={accumulation_steps!r} and "
                f"global_accumulation_steps={global_accumulation_steps!r}. Fix: drop one")
        if accumulation_steps is not None:
            check_int("accumulation_steps", accumulation_steps, minimum=1,
                         fix="pass the number of micro-batches per optimizer step, e.g. 4")
        if global_accumulation_steps is not None:
            check_int("global_accumulation_steps", global_accumulation_steps, minimum=1,
                         fix="pass the number of micro-batches per optimizer step summed over all "
                         "workers, e.g. 8")
        check_timeout("timeout", timeout,
                      fix="pass the seconds a peer may stay silent, e.g. timeout=60")
        self.fault_tolerant, self.min_replicas = self._check_fault_tolerance(
            fault_tolerant, min_replicas, comm)
        self.keep_global_batch = self._check_keep_global_batch(keep_global_batch)
        #: keep_global_batch: the missing slots whose share of each global batch this replica
        #: trains on too, and the all-reduce divisor's correction (live / launched replicas).
        self._adopted: tuple[int, ...] = ()
        self._live_fraction = 1.0
        self.device = torch.device(device) if device is not None else _default_device()
        self.timeout = float(timeout)
        self._prepared: list[Prepared] = []
        self._micro = 0
        self._boundary_done = False
        self._accumulation_steps = 1
        self.precision = Precision(precision, device_type=self.device.type,
                                   on_nonfinite=on_nonfinite, growth_interval=growth_interval,
                                   init_scale=init_scale)
        # Joined on first use, so that a strategy built only as configuration (the inner and
        # outer strategies of Hierarchical) never joins the job's process group itself.
        self._comm: Comm | None = comm
        self._parts: list[Part] | None = None
        if global_accumulation_steps is not None:
            self.global_accumulation_steps = global_accumulation_steps
        elif accumulation_steps is not None:
            self.accumulation_steps = accumulation_steps
        self._steps = 0
        self._skipped = 0
        # clip_grad_norm_ bookkeeping for the current accumulation boundary (see _step):
        # parameters whose gradients are already unscaled/checked, pending clip requests and
        # the non-finite verdicts of clips done before optimizer.step().
        self._unscaled: set[int] = set()
        self._clip_requests: dict[int, _ClipRequest] = {}
        self._clip_nonfinite: dict[int, bool] = {}
        # Called at the end of every step (add_step_end_hook): preemption checkpoints.
        # An OrderedDict: RemovableHandle holds it by weak reference (a plain dict cannot be).
        self._step_end_hooks: OrderedDict[int, StepEndHook] = OrderedDict()
        # Fault tolerance: the loaders distribute_dataset made (a heal restores their
        # positions) and positions received before a loader existed.
        self._loaders: list[DistributedLoader] = []
        self._healed_loaders: list[dict[str, int]] = []
        self._failed_steps = 0

    def _comm_from_env(self) -> Comm:
        if self._ft_refusal is not None:
            raise ValueError(self._ft_refusal)
        if self.fault_tolerant:
            from .ft.launch import comm_from_env  # torchft is an optional dependency

            return comm_from_env(timeout=self.timeout, device=self.device,
                                 min_replicas=self.min_replicas)
        return Comm.from_env(timeout=self.timeout, device=self.device)

    #: True for the strategies that run on fault-tolerant replica groups of several
    #: processes (``Hierarchical``: a node is a replica group).
    _replica_groups = False

    #: True for the strategies that run under ``fault_tolerant=True`` (their parts commit
    #: their collectives through the Comm's transactions).
    _fault_tolerance = False

    def _check_fault_tolerance(self, fault_tolerant: bool | None, min_replicas: int,
                               comm: Comm | None) -> tuple[bool, int]:
        """``fault_tolerant=None`` follows the launcher (``stratagem run --fault-tolerant``
        sets ``STRATAGEM_FT_LIGHTHOUSE``); an explicit value wins, and a strategy that cannot
        run fault tolerant says so when asked to."""
        from .ft.env import launched_fault_tolerant

        if fault_tolerant is not None and not isinstance(fault_tolerant, bool):
            raise TypeError(f"fault_tolerant must be True, False or None (follow the launcher), "
                            f"got {fault_tolerant!r}")
        check_int("min_replicas", min_replicas, minimum=1,
                  fix="pass the fewest live replicas training may continue with, e.g. 2")
        if comm is not None:
            wanted = bool(fault_tolerant) or comm.fault_tolerant
        else:
            wanted = launched_fault_tolerant() if fault_tolerant is None else fault_tolerant
        #: Set when the launcher asks for fault tolerance this strategy lacks: refused when
        #: it joins the job (a strategy built only as configuration, like Hierarchical's
        #: inner Sharded, never joins anything).
        self._ft_refusal: str | None = None
        if wanted and not self._fault_tolerance:
            refusal = (
                f"{type(self).__name__} cannot run fault tolerant yet (fault_tolerant=True, or "
                f"launched with --fault-tolerant); supported: Mirrored, LocalSGD, DiLoCo, "
                "ElasticAveraging(mode='sync', rho=0), and Hierarchical (inner Mirrored or "
                "Sharded) on replica groups. Fix: use one of those, or launch without "
                "--fault-tolerant")
            if fault_tolerant is None and comm is None:
                self._ft_refusal = refusal
                return False, min_replicas
            raise ValueError(refusal)
        return wanted, min_replicas

    #: True for the strategies whose step is a mean of every replica's gradient (Mirrored),
    #: where ``keep_global_batch`` gives exactly the fault-free update.
    _keeps_global_batch = False

    def _check_keep_global_batch(self, keep: bool) -> bool:
        check_bool("keep_global_batch", keep)
        if keep and not self.fault_tolerant:
            raise ValueError(
                "keep_global_batch=True keeps the global batch constant while replicas of a "
                "fault-tolerant job are missing; this strategy is not fault tolerant "
                "(fault_tolerant=False and not launched with --fault-tolerant). Fix: pass "
                "fault_tolerant=True, or drop keep_global_batch")
        if keep and not self._keeps_global_batch:
            raise ValueError(
                f"keep_global_batch=True needs a step that averages every replica's gradient "
                f"(Mirrored); {type(self).__name__} steps on local models, whose averages "
                "would weigh a replica that trains for a missing one like any other. Fix: use "
                "Mirrored, or drop keep_global_batch (a missing replica's share is skipped)")
        return keep

    def _plan_global_batch(self) -> None:
        """keep_global_batch: after each quorum, give the missing slots' shares of the next
        global batches to the live replicas (missing slot ``m_j`` to the ``j % W``-th live
        replica by slot), so every sample is trained on. Each share is one more
        micro-batch, and each micro-batch's loss is divided by ``accumulation_steps * N / W``
        (N launched, W live): the all-reduce's mean over W replicas is then the mean over
        all N shares, the fault-free update."""
        if not self.keep_global_batch:
            return
        comm = self.comm
        live = comm.live_slots()
        missing = sorted(set(range(comm.num_slots)) - set(live))
        mine = live.index(comm.slot) if comm.slot in live else 0
        adopted = tuple(missing[mine::len(live)]) if live else ()
        if self._accumulating():  # never mid-step: the next boundary takes it
            return
        self._adopted = adopted
        self._live_fraction = len(live) / comm.num_slots if live else 1.0
        for loader in self._loaders:
            loader.adopt(adopted)
        self._set_next_sync()

    @property
    def _micro_per_step(self) -> int:
        """Micro-batches this replica runs per optimizer step (its own and adopted shares)."""
        return self._accumulation_steps * (1 + len(self._adopted))

    @property
    def comm(self) -> Comm:
        """This strategy's communicator (the job's, from the environment, unless ``comm=``
        was given); joined on first use."""
        if self._comm is None:
            self._comm = self._comm_from_env()
        return self._comm

    # ------------------------------------------------------------------ parts
    def _build_parts(self, comm: Comm) -> list[Part]:
        """The synchronisation parts this strategy is made of, over ``comm``, in the order
        their hooks run (see :mod:`stratagem.parts`). Strategies override this; ``Hierarchical``
        calls its inner and outer strategies' ``_build_parts`` with a node's Comm and a Comm
        across nodes."""
        return []

    def _hierarchy_parts(self, comm: Comm) -> list[Part]:
        """The parts this strategy contributes as ``Hierarchical``'s inner or outer strategy,
        over ``comm`` (a node's Comm, or one across nodes): its own parts by default."""
        return self._build_parts(comm)

    @property
    def parts(self) -> list[Part]:
        """The parts this strategy runs (built on first use over :attr:`comm`)."""
        if self._parts is None:
            if self.comm.replica_group_size > 1 and not self._replica_groups:
                raise ValueError(
                    f"{type(self).__name__} runs one process per fault-tolerant replica, but "
                    f"this job's replicas are groups of {self.comm.replica_group_size} "
                    "processes (sg.launch(..., nnodes=K, fault_tolerant=True)). Fix: use "
                    "sg.Hierarchical (sync inside a group, fault tolerant across groups), or "
                    "launch one process per replica")
            parts = self._build_parts(self.comm)
            for part in parts:
                part.attach(self)
            self._parts = parts
        return self._parts

    # ------------------------------------------------------------------ accumulation
    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each worker. Settable between optimizer steps
        (not in the middle of an accumulated step)."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        check_int("accumulation_steps", value, minimum=1,
                     fix="pass the number of micro-batches per optimizer step, e.g. 4")
        if self._accumulating():
            raise RuntimeError(
                f"cannot change accumulation_steps from {self._accumulation_steps} to {value} "
                f"in the middle of an accumulated step ({self._micro} of "
                f"{self._accumulation_steps} micro-batches done). Fix: set it after "
                "optimizer.step() and optimizer.zero_grad() of the last micro-batch")
        self._accumulation_steps = value
        self._set_next_sync()

    @property
    def global_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step summed over the workers: ``accumulation_steps *
        num_replicas_in_sync``. Setting it divides by the number of workers (a count not
        divisible raises ``ValueError`` naming both numbers)."""
        return self._accumulation_steps * self.num_replicas_in_sync

    @global_accumulation_steps.setter
    def global_accumulation_steps(self, value: int) -> None:
        check_int("global_accumulation_steps", value, minimum=1,
                     fix="pass the number of micro-batches per optimizer step summed over all "
                     "workers, e.g. 8")
        workers = self.num_replicas_in_sync
        if value % workers:
            raise ValueError(
                f"global_accumulation_steps={value} is not divisible by the {workers} workers "
                f"(num_replicas_in_sync), so workers cannot share it equally. Fix: pass a "
                f"multiple of {workers} (e.g. {max(workers, value - value % workers)}), or "
                "accumulation_steps= per worker")
        self.accumulation_steps = value // workers

    # ------------------------------------------------------------------ identity
    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas synchronising now (under ``fault_tolerant=True``: the current quorum,
        which changes when replicas leave or join)."""
        # A fault-tolerant replica group (a node of Hierarchical) counts each process.
        return self.comm.world_size * self.comm.replica_group_size

    @property
    def replica_id(self) -> int:
        return self.comm.rank * self.comm.replica_group_size + self.comm.replica_group_rank

    @property
    def is_chief(self) -> bool:
        return self.replica_id == 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self.replica_id}/{self.num_replicas_in_sync}, "
                f"precision={self.precision.precision!r})")

    # ------------------------------------------------------------------ scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Inside, ``sg.get_strategy()`` returns this strategy."""
        with enter_scope(self):
            yield self

    def autocast(self) -> Autocast:
        """Autocast for code outside the prepared model (a no-op under fp32). The returned
        object is reusable: ``ctx = strategy.autocast()`` may be entered many times, nested,
        or used as a decorator, like ``torch.autocast``."""
        return self.precision.autocast()

    # ------------------------------------------------------------------ prepare
    def prepare(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Check replicas agree, broadcast rank 0's state, wrap the model and optimizers.

        Returns ``model`` alone when no optimizer is given, else ``(model, *optimizers)``.
        Raises ``ReplicaMismatchError`` naming the first differing parameter and the ranks.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare expects an nn.Module first, got {type(model).__name__}")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, StrategyOptimizer):
                raise TypeError(f"prepare expects torch optimizers after the model, got {type(opt).__name__}")
        # torch.compile: the strategy works on the module behind the compiled wrapper (its own
        # parameter names for checks, placement and checkpoints); the forward path keeps the
        # compiled wrapper.
        module = _uncompiled(model)
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            if not self._materializes_meta:
                raise ValueError(
                    f"the {type(module).__name__} given to prepare has tensors on the meta "
                    f"device (built under torch.device('meta')); {type(self).__name__} needs "
                    "the real values on every worker. Fix: build the model on the CPU, or use "
                    "sg.Sharded(), which materialises only each worker's shards")
            self._check_replicas(module)  # the values are made after sharding (Sharded)
        elif self.comm.fault_tolerant:
            # The replicas are made equal by the first quorum, at the end of prepare: a heal
            # from a live peer (which also checks the model's names, shapes and dtypes).
            if self._prepared:
                raise ValueError(
                    "fault_tolerant=True supports one prepared model per strategy (a heal "
                    "restores the state of every prepared model at once, at the first "
                    "prepare). Fix: prepare one module holding both models, or train without "
                    "fault tolerance")
            module.to(self.device)
            if self.comm.replica_group_size > 1:
                self._check_replicas(module, self.comm.group_comm)  # type: ignore[attr-defined]
        else:
            module.to(self.device)
            self._initial_sync(module)
        wrapped = self._wrap_model(model)
        if self.precision.dtype is not None:
            # On the user's module (inside DDP / the compiled wrapper), so that every path to
            # its forward runs in autocast, and copies of it can be re-bound (_eval_copy).
            module.forward = self._autocast_forward(module)  # type: ignore[method-assign]
        prepared = Prepared(wrapped, module, given=model)
        prepared.optimizers = [StrategyOptimizer(self, opt, prepared) for opt in optimizers]
        self._prepared.append(prepared)
        self._setup(prepared)
        self._set_grad_sync(prepared, self._micro + 1 >= self._micro_per_step)
        if self.comm.fault_tolerant:
            self.comm.set_state_fns(self.heal_state,  # type: ignore[attr-defined]
                                    self.load_heal_state)
            self.comm.begin()  # the first quorum: a new or restarted replica heals here
            self.comm.start_group()  # type: ignore[attr-defined]
            self._plan_global_batch()
        if not optimizers:
            return wrapped
        return (wrapped, *prepared.optimizers)

    def _autocast_forward(self, module: nn.Module) -> Callable[..., Any]:
        """``module.forward`` run in autocast. Plain ``torch.autocast`` (not :class:`Autocast`)
        so that ``torch.compile`` traces it without a graph break."""
        forward = module.forward
        device_type, dtype = self.precision.device_type, self.precision.dtype

        def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, dtype=dtype):
                return forward(*args, **kwargs)

        forward_in_autocast._stratagem_autocast = True  # type: ignore[attr-defined]
        return forward_in_autocast

    def _eval_copy(self, prepared: Prepared) -> nn.Module:
        """A copy of the user's module for ``eval_model`` (made once, then reused): the
        user's class, gradients off, its forward its own (a deep copy would keep the
        autocast wrapper bound to the *original* module, i.e. evaluate the local model), run
        in autocast like the prepared model under bf16/fp16. The caller fills in the values."""
        clone: nn.Module | None = prepared.state.get("_eval_copy")
        if clone is not None:
            return clone
        clone = next((m for m in (part.eval_module(prepared) for part in self.parts)
                      if m is not None), None) or copy.deepcopy(prepared.module)
        if getattr(clone.__dict__.get("forward"), "_stratagem_autocast", False):
            del clone.__dict__["forward"]
        clone.requires_grad_(False)
        for p in clone.parameters():
            p.grad = None
        if self.precision.dtype is not None:
            clone.forward = self._autocast_forward(clone)  # type: ignore[method-assign]
        prepared.state["_eval_copy"] = clone
        return clone

    def _check_replicas(self, model: nn.Module, comm: Comm | None = None) -> None:
        entries = [[f"param:{n}", list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
        entries += [[f"buffer:{n}", list(b.shape), str(b.dtype)] for n, b in model.named_buffers()]
        self._agree(entries, "the model", comm)

    def _agree(self, signature: Any, what: str, comm: Comm | None = None) -> None:
        """Raise ``ReplicaMismatchError`` on every rank (of ``comm``; by default the
        strategy's) unless all pass an equal ``signature`` (JSON-able). One 32-byte
        all-gather when they agree."""
        if (self.num_replicas_in_sync if comm is None else comm.world_size) == 1:
            return
        comm = self.comm if comm is None else comm
        text = json.dumps(signature, separators=(",", ":"))
        if comm.all_equal(text.encode()):
            return
        sigs = [json.loads(b.decode()) for b in comm.all_gather_bytes(text.encode())]
        raise ReplicaMismatchError(_describe_mismatch(sigs, what))

    # ------------------------------------------------------------------ hooks (override)
    def _initial_sync(self, model: nn.Module) -> None:
        """Make replicas start equal: check they built the same model, broadcast rank 0's
        parameters and buffers. Both are collectives; asynchronous strategies, whose workers
        must not wait for each other (a restarted worker rejoins a running job), override this
        and start from the shared state (the center, the global model) instead."""
        self._check_replicas(model)
        with torch.no_grad():
            state = list(model.parameters()) + list(model.buffers())
            self.comm.broadcast_coalesced([t.data for t in state], src=0)

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        bare = _uncompiled(module)
        for part in self.parts:
            module = part.wrap_model(module, bare)
        return module

    def _setup(self, prepared: Prepared) -> None:
        """Called once per prepared model, after rank 0's state was broadcast."""
        for part in self.parts:
            part.setup(prepared)

    def _set_grad_sync(self, prepared: Prepared, enabled: bool) -> None:
        """Whether the next forward/backward should communicate gradients (accumulation)."""
        for part in self.parts:
            part.set_grad_sync(prepared, enabled)

    def _apply_update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        opt.optimizer.step()

    def _after_update(self, prepared: Prepared, opt: StrategyOptimizer) -> None:
        """The strategy's synchronisation after a real (non-skipped) optimizer step: each
        part's, in order."""
        for part in self.parts:
            part.after_update(prepared)

    def _checkpoint_model(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """The model users should keep, under the module's own names (collective): the
        module's state with each part's consensus values."""
        state = prepared.module.state_dict(keep_vars=True)
        # Outermost part first: it picks the values to keep (the outer parameters, an
        # average); an inner part then turns them into whole tensors (a sharded inner part
        # gathers its shards).
        for part in reversed(self.parts):
            state = part.consensus(prepared, state)
        return {k: v.detach() for k, v in state.items()}

    def _load_model(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        """Load a checkpointed model into every replica (collective)."""
        if not any(part.load_model(prepared, state) for part in self.parts):
            prepared.module.load_state_dict(state)
        for part in self.parts:
            part.loaded(prepared)

    def _strategy_state(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """Extra per-strategy tensors to checkpoint (center, outer momentum...)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.parts:
            out.update(part.extra_state(prepared))
        return out

    def _load_strategy_state(self, prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
        """Restore what ``_strategy_state`` returned (keys may be missing: another strategy
        wrote the checkpoint)."""
        for part in self.parts:
            part.load_extra_state(prepared, state)

    def _optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """This replica's optimizer state for a checkpoint (a parameter-server strategy reads
        it from the shards)."""
        return opt.state_dict()

    def _load_optimizer_state(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        opt.load_state_dict(state)

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The model to evaluate and keep: always a module of the user's class (never a DDP
        or ``torch.compile`` wrapper) holding the consensus model — the replica's own module
        for replicated strategies (OneDevice, Mirrored), the average (LocalSGD), the outer
        parameters (DiLoCo), the center (EASGD), the global model (parameter servers). Under
        bf16/fp16 its forward runs in autocast, like the prepared model's. Call it on every
        replica: for some strategies it is a collective (LocalSGD averages). A model that was
        not prepared by this strategy is returned unchanged."""
        prepared = self._find_prepared(model)
        if prepared is None:
            return model
        if all(part.replicated for part in self.parts):
            return prepared.module
        copy_ = self._eval_copy(prepared)
        with torch.no_grad():
            copy_.load_state_dict(self._checkpoint_model(prepared))
        return copy_

    def finalize(self, model: nn.Module) -> None:
        """One last synchronisation, so that the consensus model (``eval_model``, ``save``)
        includes every local step taken since the last periodic synchronisation.

        A collective: call it on every replica, at the end of training (``fit`` does). For
        strategies that synchronise every step it only sets the buffers (BatchNorm
        statistics) to rank 0's (Mirrored, Sharded; nothing under OneDevice). Training may
        continue afterwards, and calling it twice is harmless. What it does per strategy is in
        the strategy's ``_finalize`` docstring (LocalSGD / DiLoCo: the workers' parameters are
        averaged and become the consensus; EASGD: a last elastic exchange; parameter server:
        the pending push is flushed and the global model pulled)."""
        prepared = self._require_prepared(model, "finalize")
        self._finalize(prepared)

    def _finalize(self, prepared: Prepared) -> None:
        """Each part's last synchronisation, in order (see :meth:`finalize`)."""
        for part in self.parts:
            part.finalize(prepared)

    def _require_prepared(self, model: nn.Module, what: str) -> Prepared:
        prepared = self._find_prepared(model)
        if prepared is None:
            raise ValueError(f"{what} needs a model prepared by this strategy, got a "
                             f"{type(model).__name__} it did not prepare. Fix: pass the model "
                             "that strategy.prepare(model, optimizer) returned")
        return prepared

    def _grad_norm(self, prepared: Prepared, grads: list[torch.Tensor],
                   norm_type: float) -> torch.Tensor:
        """The total ``norm_type``-norm of the model's gradients, as the optimizer step will
        see them. This replica's gradients: after DDP's all-reduce they are the global ones
        (Mirrored); strategies whose gradients stay local (LocalSGD, DiLoCo, EASGD, parameter
        servers, which clip before the push) clip their own. A strategy whose gradients are
        sharded across replicas overrides this to reduce the norm."""
        for part in self.parts:
            norm = part.grad_norm(grads, norm_type)
            if norm is not None:
                return norm
        dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        if not dense:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(dense, norm_type=norm_type).float()

    def _flush_counters(self) -> None:
        """Fold traffic counted outside ``comm`` (parameter-server clients) into it, before
        ``metrics()`` reads it."""

    def _extra_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.metrics())
        return out

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm_(self, model: nn.Module, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the model's gradients to a total ``norm_type``-norm of at most ``max_norm``,
        the way ``torch.nn.utils.clip_grad_norm_`` does, but on the *unscaled* gradients of
        the *whole* accumulated step, whatever the loop shape.

        Call it between ``strategy.backward(loss)`` and ``optimizer.step()``, either on every
        micro-batch or only on the last one of an accumulated step: both give the same
        result. At the accumulation boundary (after the last micro-batch's backward) the
        gradients are unscaled (fp16), checked and clipped right away; on an earlier
        micro-batch the request is recorded and applied inside ``optimizer.step()`` at the
        boundary — partial sums are never clipped. Under Mirrored the norm is that of the
        all-reduced (global) gradient; under LocalSGD, DiLoCo, EASGD and the parameter
        servers it is this worker's own gradient (clipped before the local step / the push).

        Returns the pre-clip total norm as a 0-dim float32 tensor. Called at the boundary it
        holds the norm on return; called on an earlier micro-batch it is the tensor the step
        will fill in place (NaN until then: read it after ``optimizer.step()``). A
        non-finite norm is treated like a non-finite gradient: the step is skipped (fp16 or
        ``on_nonfinite="skip"``, agreed across replicas for synchronous strategies) or
        ``FloatingPointError`` is raised; the gradients are then left unclipped.
        """
        check_number("max_norm", max_norm, low=0, low_open=True, finite=True,
                     fix="pass e.g. max_norm=1.0")
        check_number("norm_type", norm_type, low=0, low_open=True,
                     fix="pass 2.0 (Euclidean) or float('inf')")
        prepared = self._require_prepared(model, "clip_grad_norm_")
        request = self._clip_requests.get(id(prepared))
        if request is None:
            request = _ClipRequest(float(max_norm), float(norm_type),
                                   torch.full((), math.nan, device=self.device))
            self._clip_requests[id(prepared)] = request
        else:  # the last call of the accumulated step wins
            request.max_norm, request.norm_type = float(max_norm), float(norm_type)
        if self._micro == 0 and not self._boundary_done and self.precision.uses_scaler:
            raise RuntimeError(
                "clip_grad_norm_ without strategy.backward(loss): precision='fp16' scales the "
                "loss there. Replace loss.backward() with strategy.backward(loss).")
        at_boundary = not self._boundary_done and (
            self._micro == 0 or self._micro >= self._micro_per_step)
        if at_boundary:
            del self._clip_requests[id(prepared)]
            self._clip_now(prepared, request)
        return request.norm

    def _unscale(self, params: Iterable[torch.Tensor]) -> bool:
        """Unscale (fp16) and check the gradients of ``params`` not yet handled at this
        boundary; True when one is inf/nan."""
        todo: list[torch.Tensor] = []
        for p in params:
            if p.grad is not None and id(p) not in self._unscaled:
                self._unscaled.add(id(p))
                todo.append(p.grad)
        return self.precision.unscale_and_check(todo)

    def _clip_now(self, prepared: Prepared, request: _ClipRequest) -> None:
        params = [p for p in prepared.module.parameters() if p.grad is not None]
        nonfinite = self._unscale(params)
        grads = [p.grad for p in params if p.grad is not None]
        norm = self._grad_norm(prepared, grads, request.norm_type)
        nonfinite = nonfinite or not bool(torch.isfinite(norm))
        with torch.no_grad():
            request.norm.copy_(norm)
            if not nonfinite and grads:
                coef = (request.max_norm / (norm + 1e-6)).clamp(max=1.0)
                dense = [g for g in grads if not g.is_sparse]
                if dense:
                    torch._foreach_mul_(dense, coef.to(dense[0].device))
                for g in grads:
                    if g.is_sparse:
                        g.mul_(coef.to(g.device))
        key = id(prepared)
        self._clip_nonfinite[key] = self._clip_nonfinite.get(key, False) or nonfinite

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with accumulation (divide by ``accumulation_steps``) and fp16
        loss scaling; gradient communication failures become ``PeerTimeoutError``."""
        if self._boundary_done:
            self._end_accumulation()
        if self._live_fraction != 1.0:  # keep_global_batch with replicas missing
            loss = loss / (self.accumulation_steps / self._live_fraction)
        elif self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        loss = self.precision.scale_loss(loss)
        try:
            loss.backward(**kwargs)
        except RuntimeError as exc:
            if _is_comm_error(exc):
                raise self.comm.diagnose(exc, "gradient all-reduce in backward") from exc
            raise
        self._micro += 1
        self._set_next_sync()

    def _set_next_sync(self) -> None:
        sync = (self._micro + 1) >= self._micro_per_step
        for prepared in self._prepared:
            self._set_grad_sync(prepared, sync)

    def _accumulating(self) -> bool:
        return 0 < self._micro < self._micro_per_step and not self._boundary_done

    def _end_accumulation(self) -> None:
        if self._boundary_done:
            self._micro = 0
            self._boundary_done = False
            self._unscaled.clear()
            self._clip_nonfinite.clear()
            self._set_next_sync()

    def _step(self, opt: StrategyOptimizer) -> None:
        if self._micro == 0 and not self._boundary_done:
            if self.precision.uses_scaler:
                raise RuntimeError(
                    "optimizer.step() without strategy.backward(loss): precision='fp16' scales "
                    "the loss there. Replace loss.backward() with strategy.backward(loss).")
            self._micro = self._micro_per_step  # the user called loss.backward() directly
        if self._micro < self._micro_per_step:
            return  # a micro-batch: gradients keep accumulating, nothing is communicated
        self._boundary_done = True
        prepared = opt._prepared
        params = [p for g in opt.param_groups for p in g["params"]]
        if not self._unscaled and not self._clip_requests:
            # No clipping at this boundary: no per-parameter bookkeeping on the hot path.
            nonfinite = self.precision.unscale_and_check(
                [p.grad for p in params if p.grad is not None])
        else:
            nonfinite = self._unscale(params)
            request = self._clip_requests.pop(id(prepared), None)
            if request is not None:  # recorded on an earlier micro-batch: the boundary is now
                self._clip_now(prepared, request)
            nonfinite = self._clip_nonfinite.pop(id(prepared), False) or nonfinite
            # Another optimizer stepping at this boundary unscales its own parameters.
            self._unscaled.difference_update(id(p) for p in params)
        checks_agree = self.precision.uses_scaler or self.precision.on_nonfinite == "skip"
        if self._synchronous_step and checks_agree and self.num_replicas_in_sync > 1:
            flag = torch.tensor([1.0 if nonfinite else 0.0])
            if self.comm.replica_group_size > 1:  # the replica group's processes first
                self.comm.group_comm.all_reduce(flag, "max")  # type: ignore[attr-defined]
            nonfinite = bool(self.comm.all_reduce(flag, "max").item() > 0)
        # Fault tolerance: collectives already run in this step (the gradient all-reduce, the
        # non-finite vote) must have succeeded everywhere before their result is applied.
        # A plain Comm always commits.
        committed = not self.comm.collectives_pending or self.comm.commit()
        if not committed:
            self._failed_steps += 1  # applied nowhere; the next quorum drops the lost replica
        elif nonfinite:
            if not self.precision.uses_scaler and self.precision.on_nonfinite == "raise":
                raise FloatingPointError(self._describe_nonfinite(opt))
            self.precision.update(True)
            self._skipped += 1
        else:
            self._apply_update(prepared, opt)
            self.precision.update(False)
            prepared.local_steps += 1
            self._steps += 1
            self._after_update(prepared, opt)
        if self.comm.fault_tolerant and self._next_step_syncs(prepared):
            # Membership changes (and heals) happen here, between steps, before any replica
            # computes the step that will communicate.
            self.comm.begin()
            self._plan_global_batch()
        # The step boundary is where a checkpoint is consistent (a skipped step is a
        # boundary too: every replica agreed to skip it); preemption hooks in here.
        for hook in list(self._step_end_hooks.values()):
            hook(opt)

    def _next_step_syncs(self, prepared: Prepared) -> bool:
        """Whether the next optimizer step of ``prepared`` runs a collective (its parts', or
        the non-finite vote): a fault-tolerant Comm forms its quorum before such a step."""
        checks_agree = self.precision.uses_scaler or self.precision.on_nonfinite == "skip"
        if self._synchronous_step and checks_agree:
            return True
        step = prepared.local_steps + 1
        return any(part.syncs_at(prepared, step) for part in self.parts)

    def add_step_end_hook(self, hook: StepEndHook) -> RemovableHandle:
        """Call ``hook(optimizer)`` at the end of every optimizer step that reached an
        accumulation boundary, applied or skipped, on every replica (the point where model,
        optimizer, loader position and RNG are consistent, so a checkpoint taken there is
        resumable). Hooks run in the order added; ``handle.remove()`` detaches one. A hook may
        run collectives: every replica reaches the boundary of the same step.
        ``on_preemption`` is built on this."""
        handle = RemovableHandle(self._step_end_hooks)
        self._step_end_hooks[handle.id] = hook
        return handle

    def _describe_nonfinite(self, opt: StrategyOptimizer) -> str:
        names = opt._prepared.param_names
        bad = [names.get(id(p), "?") for g in opt.param_groups for p in g["params"]
               if p.grad is not None and not bool(
                   torch.isfinite(p.grad._values() if p.grad.is_sparse else p.grad).all())]
        return (f"non-finite gradient at step {self._steps + 1} on replica {self.replica_id} "
                f"in parameter(s) {', '.join(bad[:5]) or '?'} (or a gradient norm beyond "
                "float32). Fix: lower the learning rate, or clip the gradients with "
                "strategy.clip_grad_norm_(model, max_norm) between strategy.backward(loss) and "
                "optimizer.step() (fit(..., clip_grad_norm=1.0)); or pass on_nonfinite='skip' "
                "to skip such steps, or precision='fp16' for dynamic loss scaling.")

    # ------------------------------------------------------------------ replica functions
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``fn(*args, **kwargs)`` in replica context (``sg.get_replica_context()``)."""
        with enter_scope(self), enter_replica(ReplicaContext(self)):
            return fn(*args, **(kwargs or {}))

    def reduce(self, op: Any, value: Any) -> Any:
        """Reduce ``value`` across replicas: a tensor, a Python number, or a nested
        dict/list/tuple of them. Every replica gets the same result."""
        op = _normalize_op(op)
        leaves, rebuild = _flatten(value)
        tensors: list[torch.Tensor] = []
        kinds: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                kinds.append(("tensor", t.device, t.dtype))
                if op == "mean" and not t.is_floating_point():
                    t = t.to(torch.get_default_dtype())
                tensors.append(t.to("cpu" if self.device.type == "cpu" else self.device).reshape(-1).clone())
            elif isinstance(leaf, (bool, int, float)):
                kinds.append(("number", type(leaf)))
                is_int = isinstance(leaf, int) and op != "mean"
                tensors.append(torch.tensor([leaf], dtype=torch.int64 if is_int else torch.float64))
            else:
                raise TypeError(f"reduce handles tensors, numbers and nested dict/list/tuple; "
                                f"got {type(leaf).__name__}")
        if self.num_replicas_in_sync > 1:
            self._agree([[str(t.dtype), t.numel()] for t in tensors] + [_shape_sig(leaves)],
                        f"reduce({op!r}) values")
            self.comm.all_reduce_coalesced(tensors, "sum" if op == "mean" else op)
            if op == "mean":
                for t in tensors:
                    t.div_(self.num_replicas_in_sync)
        out: list[Any] = []
        for leaf, kind, t in zip(leaves, kinds, tensors):
            if kind[0] == "tensor":
                out.append(t.reshape(leaf.shape).to(kind[1]))
            else:
                v = t.item()
                out.append(kind[1](v) if (kind[1] is int and op != "mean") else float(v))
        return rebuild(out)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate ``value`` (tensors, numbers, nested) across replicas along ``axis``;
        sizes along ``axis`` may differ between replicas."""
        leaves, rebuild = _flatten(value)
        out = []
        for leaf in leaves:
            t = leaf.detach() if isinstance(leaf, torch.Tensor) else torch.tensor([leaf])
            if t.dim() == 0:
                t = t.reshape(1)
            out.append(self._gather_tensor(t, axis))
        return rebuild(out)

    def _gather_tensor(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        if self.num_replicas_in_sync == 1:
            return t.clone()
        axis = axis % t.dim()
        moved = t.movedim(axis, 0).contiguous()
        rest = list(moved.shape[1:])
        self._agree([str(t.dtype), rest, t.dim()], f"gather(axis={axis}) values")
        device = moved.device
        sizes = [int(s.item()) for s in self.comm.all_gather(torch.tensor([moved.shape[0]]))]
        padded = torch.zeros([max(sizes)] + rest, dtype=moved.dtype)
        padded[: moved.shape[0]] = moved.cpu()
        parts = self.comm.all_gather(padded)
        result = torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)
        return result.movedim(0, axis).to(device)

    # ------------------------------------------------------------------ input
    def distribute_dataset(self, dataset: Any, global_batch_size: int, shuffle: bool = True,
                           seed: int = 0, drop_remainder: bool = False, **kwargs: Any) -> DistributedLoader:
        """This replica's share of each global batch; see :class:`DistributedLoader`."""
        # Sharded by the replicas' fixed places in the job as launched (under fault tolerance
        # a missing replica's share is skipped, never handed to another), and registered so a
        # healed replica resumes at its peers' position.
        comm = self.comm
        loader = DistributedLoader(dataset, global_batch_size, num_replicas=comm.num_slots,
                                   replica_id=comm.slot, shuffle=shuffle, seed=seed,
                                   drop_remainder=drop_remainder, device=self.device, **kwargs)
        self._loaders.append(loader)
        loader.adopt(self._adopted)
        healed = self._healed_loaders
        if len(self._loaders) <= len(healed):
            loader.fast_forward(healed[len(self._loaders) - 1])
        return loader

    def distribute_datasets_from_function(self, input_fn: Callable[[InputContext], Any]) -> Any:
        """Call ``input_fn(ctx)`` with this replica's ``InputContext`` and return its result."""
        ctx = InputContext(num_input_pipelines=self.comm.num_slots,
                           input_pipeline_id=self.comm.slot,
                           num_replicas_in_sync=self.comm.num_slots)
        return input_fn(ctx)

    # ------------------------------------------------------------------ porting helpers
    # Counterparts of idioms that scripts written for Accelerate / Lightning Fabric use
    # (issue 23; see the "Coming from DDP / Accelerate / Lightning Fabric / torchft" table in
    # docs/guide.md). Each is a thin view of a mechanism the strategy already has.
    def skip_first_batches(self, loader: Any, num_batches: int) -> Any:
        """``loader`` positioned to skip its first ``num_batches`` batches in its next
        iteration only (a resume in the middle of an epoch; Accelerate's
        ``skip_first_batches``). A :class:`DistributedLoader` is positioned in place and
        returned (no batch is loaded to be thrown away; later epochs start at 0); another
        iterable is wrapped so that its next iteration drops the first ``num_batches``."""
        return skip_first_batches(loader, num_batches)

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """Accelerate's ``with accelerator.accumulate(model):`` around one micro-batch
        (forward, ``strategy.backward``, ``optimizer.step()``, ``optimizer.zero_grad()``).

        Stratagem already counts micro-batches in ``strategy.backward``: gradients are not
        communicated, ``optimizer.step()`` applies nothing and ``zero_grad()`` keeps the
        gradients until the ``accumulation_steps``-th micro-batch, with or without this
        context. It checks that ``model`` was prepared by this strategy and marks the block;
        step an LR scheduler only when :attr:`sync_gradients` is True (an update was
        applied), as Accelerate's prepared scheduler does."""
        self._require_prepared(model, "accumulate")
        yield

    @property
    def sync_gradients(self) -> bool:
        """True when the last ``strategy.backward`` completed an accumulated step (gradients
        communicated; the next ``optimizer.step()`` applies an update), and until the next
        micro-batch; Accelerate's ``accelerator.sync_gradients``."""
        return self._micro == 0 or self._micro >= self._micro_per_step or self._boundary_done

    def barrier(self) -> None:
        """Every replica waits here for the others (Accelerate's ``wait_for_everyone``,
        ``dist.barrier``); a peer absent for ``timeout`` seconds raises
        ``PeerTimeoutError`` naming it."""
        self.comm.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The chief (replica 0) runs the block first, the other replicas after it has left
        the block (a download, a cache build, a tokenizer's files; Accelerate's
        ``main_process_first``). The others wait at most ``timeout`` seconds (the strategy's):
        a chief that takes longer, or raises in the block, makes them raise
        ``PeerTimeoutError`` naming rank 0. Fix for a long block: build the strategy with a
        larger ``timeout``."""
        if not self.is_chief:
            self.barrier()
        yield
        if self.is_chief:
            self.barrier()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        """Counters for this replica."""
        self._flush_counters()
        m: dict[str, Any] = {
            "steps": self._steps,
            "bytes_sent": self.comm.bytes_sent,
            "bytes_received": self.comm.bytes_received,
            "comm_seconds": self.comm.seconds,
            "skipped_steps": self._skipped,
            "loss_scale": self.precision.scale,
        }
        m.update(self._extra_metrics())
        return m

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike[str], **state: Any) -> None:
        """Write a checkpoint directory atomically (collective: call on every replica); see
        :func:`stratagem.checkpoint.save`."""
        _feature("save")(self, path, **state)

    def restore(self, path: str | os.PathLike[str], **state: Any) -> dict[str, Any]:
        """Load a checkpoint into the given objects; returns the remaining saved state; see
        :func:`stratagem.checkpoint.restore`."""
        return _feature("restore")(self, path, **state)  # type: ignore[no-any-return]

    def on_preemption(self, path: str | os.PathLike[str], **state: Any) -> Any:
        """Issue 6: on SIGTERM, save ``state`` to ``path`` at the next step boundary (agreed
        across replicas) and exit with ``stratagem.preemption.PREEMPTED_EXIT_CODE``; returns
        the :class:`~stratagem.preemption.PreemptionCheckpoint` (see that module). A second
        call replaces the first handler."""
        return _feature("on_preemption")(self, path, **state)

    # ------------------------------------------------------------------ state protocol
    # What code outside the strategy (stratagem.checkpoint, stratagem.fit, stratagem.
    # preemption, a user's own saver) reads and writes. Each method calls the private hook a
    # strategy overrides (_checkpoint_model, _load_model, _strategy_state, ...); the hooks
    # keep their names and signatures. Lightning's Strategy.get_optimizer_state /
    # load_model_state_dict are the model.
    def find_prepared(self, model: nn.Module, *, exact: bool = False) -> Prepared | None:
        """The :class:`Prepared` record of ``model`` (the wrapped model ``prepare`` returned,
        the user's module, or the object passed to ``prepare``), or None when this strategy
        did not prepare it. Unless ``exact``, ``torch.compile`` wrappers applied after
        ``prepare`` are seen through (a checkpoint of a model compiled later still saves the
        strategy's consensus model)."""
        for _ in range(8):
            prepared = self._find_prepared(model)
            inner = getattr(model, "_orig_mod", None)
            if prepared is not None or exact or not isinstance(inner, nn.Module):
                return prepared
            model = inner
        return None

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model to keep, under the module's own parameter names: the consensus for
        strategies with local steps (the average, the outer or center parameters, the global
        model of a parameter server). A collective for some strategies: call it on every
        replica. A module this strategy did not prepare gives its own ``state_dict``."""
        prepared = self.find_prepared(model)
        if prepared is None:
            return {k: v.detach() for k, v in model.state_dict().items()}
        return self._checkpoint_model(prepared)

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` (names as :meth:`model_state` gives them) into ``model`` on every
        replica, and into the strategy's own copies of it (center, outer parameters, shards).
        A collective for some strategies. A module this strategy did not prepare is loaded
        with ``load_state_dict``."""
        prepared = self.find_prepared(model)
        if prepared is None:
            model.load_state_dict(state)
        else:
            self._load_model(prepared, state)

    def strategy_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Tensors the strategy keeps for ``model`` besides the model itself (DiLoCo's outer
        momentum, EASGD's center, ...), to checkpoint next to it; empty for an unprepared
        model."""
        prepared = self.find_prepared(model)
        return {} if prepared is None else self._strategy_state(prepared)

    def load_strategy_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`strategy_state` returned; missing keys are allowed (another
        strategy wrote the checkpoint). Ignored for an unprepared model."""
        prepared = self.find_prepared(model)
        if prepared is not None:
            self._load_strategy_state(prepared, state)

    def local_steps(self, model: nn.Module) -> int:
        """Optimizer steps applied to ``model`` on this replica (the phase of periodic
        synchronisations, kept across a resume); 0 for an unprepared model."""
        prepared = self.find_prepared(model)
        return 0 if prepared is None else prepared.local_steps

    def set_local_steps(self, model: nn.Module, steps: int) -> None:
        """Set the counter :meth:`local_steps` reads (a restore puts the schedule back in
        phase). Ignored for an unprepared model."""
        check_int("steps", steps, minimum=0, fix="pass the saved local step count")
        prepared = self.find_prepared(model)
        if prepared is not None:
            prepared.local_steps = steps

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This replica's optimizer state for a checkpoint (a parameter-server strategy reads
        it from the shards, so this can be a collective)."""
        return self._optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """Load what :meth:`optimizer_state` returned (into the shards for a parameter
        server)."""
        self._load_optimizer_state(optimizer, state)

    @property
    def optimizer_state_is_local(self) -> bool:
        """True when each replica holds optimizer state of its own (LocalSGD, DiLoCo, EASGD):
        a checkpoint then saves one optimizer state per rank."""
        return bool(self._local_optimizer_state)

    @property
    def steps(self) -> int:
        """Optimizer steps applied so far on this replica (skipped steps not counted); set by
        a restore."""
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._steps = check_int("steps", value, minimum=0, fix="pass the saved step count")

    # ------------------------------------------------------------------ heal (fault tolerance)
    def heal_state(self) -> dict[str, Any]:
        """Everything a replica joining a fault-tolerant job needs to continue exactly as this
        one: the prepared model (this replica's own tensors, not a consensus), its optimizers,
        the parts' state (DiLoCo's outer parameters and momentum...), the step counters, the
        loss scale and the loaders' positions. A tree of tensors and JSON values (the heal
        transport sends it without pickle). Not a collective."""
        models = []
        for prepared in self._prepared:
            # A sharded model (FSDP2 inside a replica group) sends this process's shards: a
            # heal goes from one group rank to the same group rank of another group.
            module = {k: local(v.detach()) for k, v in prepared.module.state_dict().items()}
            models.append({
                "module": module,
                "signature": [[k, list(v.shape), str(v.dtype)] for k, v in module.items()],
                "local_steps": prepared.local_steps,
                "optimizers": [_local_optimizer_state(opt.optimizer.state_dict())
                               for opt in prepared.optimizers],
                "parts": {part.name: part.heal_state(prepared) for part in self.parts},
                "strategy": self._heal_extra(prepared),
            })
        return {"steps": self._steps, "skipped": self._skipped,
                "precision": self.precision.state_dict(), "models": models,
                "loaders": [loader.state_dict() for loader in self._loaders]}

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Load what :meth:`heal_state` of a live peer returned; ``ReplicaMismatchError``
        naming the first difference when the peer's model is not this one (names, shapes,
        dtypes), before anything is changed."""
        models = state.get("models", [])
        if len(models) != len(self._prepared):
            raise ReplicaMismatchError(
                f"a live peer has {len(models)} prepared model(s), this replica "
                f"{len(self._prepared)}. Fix: run the same script on every replica")
        for prepared, saved in zip(self._prepared, models):
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
            for prepared, saved in zip(self._prepared, models):
                own = prepared.module.state_dict()
                for key, value in saved["module"].items():
                    local(own[key]).copy_(value)
                prepared.local_steps = int(saved["local_steps"])
                for opt, opt_state in zip(prepared.optimizers, saved["optimizers"]):
                    opt.optimizer.load_state_dict(_sharded_like_params(opt.optimizer,
                                                                       opt_state))
                for part in self.parts:
                    part.load_heal_state(prepared, saved["parts"].get(part.name, {}))
                self._load_heal_extra(prepared, saved.get("strategy", {}))
        self._steps = int(state["steps"])
        self._skipped = int(state["skipped"])
        self.precision.load_state_dict(state["precision"])
        self._healed_loaders = list(state.get("loaders", []))
        for loader, position in zip(self._loaders, self._healed_loaders):
            loader.fast_forward(position)

    def _heal_extra(self, prepared: Prepared) -> dict[str, Any]:
        """State a strategy keeps outside its parts that a joining replica needs (a tree of
        tensors and JSON values; not a collective). None by default."""
        return {}

    def _load_heal_extra(self, prepared: Prepared, state: dict[str, Any]) -> None:
        """Load what a live peer's :meth:`_heal_extra` returned."""

    def _find_prepared(self, model: nn.Module) -> Prepared | None:
        for p in self._prepared:
            if model is p.model or model is p.module or model is p.given:
                return p
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module behind a prepared model: never a DDP wrapper nor a
        ``torch.compile`` wrapper (``_orig_mod``), so its ``state_dict`` has the module's own
        names. An unprepared model is returned with ``torch.compile`` wrappers removed."""
        prepared = self._find_prepared(model)
        return prepared.module if prepared is not None else _uncompiled(model)

    # ------------------------------------------------------------------ fit
    def fit(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Any],
            dataset: Any, *, epochs: int, global_batch_size: int, **kwargs: Any) -> dict[str, list[float]]:
        """Train with the same methods a custom loop uses; returns a history dict; see
        :func:`stratagem.fit.fit`."""
        return _feature("fit")(self, model, optimizer, loss_fn, dataset,  # type: ignore[no-any-return]
                               epochs=epochs, global_batch_size=global_batch_size, **kwargs)

    def close(self) -> None:
        """Release background resources (heartbeat thread, parameter-server channels)."""
        for part in self._parts or []:
            part.close()
        if self._comm is not None:
            self._comm.close()


# ---------------------------------------------------------------------- helpers
def _flatten(value: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Leaves of a nested dict/list/tuple and a function rebuilding it from new leaves."""
    if isinstance(value, dict):
        keys = list(value.keys())
        parts = [_flatten(value[k]) for k in keys]
        leaves = [leaf for p in parts for leaf in p[0]]

        def rebuild_dict(new: list[Any]) -> Any:
            out, i = {}, 0
            for k, (sub, rb) in zip(keys, parts):
                out[k] = rb(new[i:i + len(sub)])
                i += len(sub)
            return type(value)(out) if type(value) is not dict else out
        return leaves, rebuild_dict
    if isinstance(value, (list, tuple)):
        parts = [_flatten(v) for v in value]
        leaves = [leaf for p in parts for leaf in p[0]]

        def rebuild_seq(new: list[Any]) -> Any:
            items, i = [], 0
            for sub, rb in parts:
                items.append(rb(new[i:i + len(sub)]))
                i += len(sub)
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*items)
            return type(value)(items)
        return leaves, rebuild_seq
    return [value], lambda new: new[0]


def _shape_sig(leaves: list[Any]) -> list[Any]:
    return [list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves]


def _describe_mismatch(sigs: list[Any], what: str) -> str:
    ref = sigs[0]
    for rank, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        if isinstance(ref, list) and isinstance(sig, list):
            for i, (a, b) in enumerate(zip(ref, sig)):
                if a != b:
                    return (f"replicas disagree on {what}: entry {i} is {a} on rank 0 but {b} on "
                            f"rank {rank}. Fix: build the same model / pass the same structure "
                            "on every replica (same code, same config).")
            return (f"replicas disagree on {what}: rank 0 has {len(ref)} entries, rank {rank} has "
                    f"{len(sig)} (first extra: {(ref if len(ref) > len(sig) else sig)[min(len(ref), len(sig))]}). "
                    "Fix: build the same model / pass the same structure on every replica.")
        return f"replicas disagree on {what}: rank 0 has {ref}, rank {rank} has {sig}"
    return f"replicas disagree on {what}"


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
