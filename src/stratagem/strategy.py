"""The ``Strategy`` base: the training-loop contract every strategy fulfils. A strategy
declares its parts (:meth:`Strategy.plan`); the base runs their hooks in the one order of
:class:`~stratagem.parts.Parts` and knows no strategy. A step: ``backward`` (step control:
accumulation, loss scaling) -> ``optimizer.step()`` -> the boundary (unscale, clip, the
non-finite verdict) -> the fault-tolerance layer's commit -> the parts' update -> the layer's
step end (the next quorum) -> step-end hooks."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .comm import Comm, startup_seconds
from .context import InputContext, ReplicaContext, enter_replica, enter_scope
from .data import DistributedLoader, Inputs, skip_first_batches
from .features import feature, register_feature
from .ft.layer import FaultTolerance
from .parts.base import Capability
from .parts.plan import Plan
from .parts.runner import Parts
from .precision import Autocast, Precision
from .prepared import (
    Prepared,
    PreparedModels,
    StrategyOptimizer,
    autocast_forward,
    default_device,
    eval_copy,
    uncompiled,
)
from .replica_ops import ReduceOp, ReplicaOps
from .step import StepControl
from .validation import check_int, check_timeout

__all__ = ["Strategy", "ReduceOp", "Prepared", "StrategyOptimizer", "StepEndHook",
           "register_feature"]

#: Called with the stepping optimizer at every step boundary (applied or skipped: agreed).
StepEndHook = Callable[[StrategyOptimizer], None]

class Strategy:
    """Base of every strategy. Built from keyword arguments only; a subclass declares its
    arguments and its parts (:meth:`plan`) and overrides no private method.

    Common arguments: ``precision`` ("fp32", "bf16", "fp16"), ``accumulation_steps`` (micro-
    batches per optimizer step on each worker; settable later) or ``global_accumulation_steps``
    (the same as a count over all workers), ``timeout`` (seconds before a silent peer becomes
    :class:`PeerTimeoutError`), ``startup_timeout`` (seconds joining waits for every rank to
    start; default the larger of ``timeout`` and 120), ``on_nonfinite`` ("raise" or "skip" when
    no loss scaler is in use), ``device`` (default: this worker's CUDA device, else the CPU),
    ``comm`` (an explicit :class:`~stratagem.comm.Comm`; by default the job of the environment),
    ``fault_tolerant`` / ``min_replicas`` / ``keep_global_batch`` (:mod:`stratagem.ft`).

    On failure: a collective whose peer dies or stalls raises ``PeerTimeoutError`` naming the
    peer within ``timeout`` (+ a few seconds of diagnosis); nothing waits forever.
    """

    #: Short name, also the one ``Strategy.from_name`` accepts.
    name = "strategy"

    def __init__(self, *, precision: str = "fp32", accumulation_steps: int | None = None,
                 global_accumulation_steps: int | None = None, timeout: float = 60.0,
                 on_nonfinite: str = "raise", device: torch.device | str | None = None,
                 comm: Comm | None = None, growth_interval: int = 2000,
                 init_scale: float = 2.0**16, fault_tolerant: bool | None = None,
                 min_replicas: int = 1, keep_global_batch: bool = False,
                 startup_timeout: float | None = None) -> None:
        StepControl.check_accumulation(accumulation_steps, global_accumulation_steps)
        check_timeout("timeout", timeout,
                      fix="pass the seconds a peer may stay silent, e.g. timeout=60")
        self.startup_timeout = startup_seconds(timeout, startup_timeout)
        self.device = torch.device(device) if device is not None else default_device()
        self.timeout = float(timeout)
        self.precision = Precision(precision, device_type=self.device.type,
                                   on_nonfinite=on_nonfinite, growth_interval=growth_interval,
                                   init_scale=init_scale)
        self.declared = self.plan()
        self.ft = FaultTolerance(type(self).__name__, self.declared,
                                 fault_tolerant=fault_tolerant, min_replicas=min_replicas,
                                 keep_global_batch=keep_global_batch, comm=comm)
        self.fault_tolerant, self.min_replicas = self.ft.enabled, min_replicas
        self.keep_global_batch = self.ft.keep_global_batch
        # Joined on first use, so that a strategy built only as configuration (the inner and
        # outer strategies of Hierarchical) never joins the job's process group itself.
        self._comm: Comm | None = comm
        self._parts: Parts | None = None
        self._prepared = PreparedModels()
        self.control = StepControl(
            self.precision, device=self.device, shares=lambda: self.ft.shares,
            loss_fraction=lambda: self.ft.live_fraction, set_grad_sync=self._set_grad_sync,
            grad_norm=self._grad_norm, agree=self.ft.agree,
            diagnose=lambda exc, what: self.comm.diagnose(exc, what),  # type: ignore[arg-type]
            replica_id=lambda: self.replica_id)
        self.replicas = ReplicaOps(lambda: self.comm, lambda: self.num_replicas_in_sync,
                                   self.device)
        self.inputs = Inputs(lambda: self.comm, self.device, self.ft.register_loader)
        self.ft.attach(self)
        if global_accumulation_steps is not None:
            self.global_accumulation_steps = global_accumulation_steps
        elif accumulation_steps is not None:
            self.accumulation_steps = accumulation_steps
        # Called at the end of every step (add_step_end_hook): preemption checkpoints.
        # An OrderedDict: RemovableHandle holds it by weak reference (a plain dict cannot be).
        self._step_end_hooks: OrderedDict[int, StepEndHook] = OrderedDict()

    # ------------------------------------------------------------------ the declaration
    def plan(self) -> Plan:
        """What this strategy is made of: its parts, in order (``Plan(GradientSync.spec(
        ...))``). Subclasses override this; it is read once, by the constructor, so a
        subclass sets its attributes before calling ``super().__init__``, which has set
        ``device``, ``timeout`` and ``precision`` by then. No parts by default (``OneDevice``)."""
        return Plan()

    def layer_plan(self) -> Plan:
        """The plan this strategy contributes as ``Hierarchical``'s inner or outer layer: its
        own :meth:`plan` unless it says otherwise."""
        return self.plan()

    @property
    def synchronous_step(self) -> bool:
        """Replicas take the same step decisions (the non-finite verdict is agreed)."""
        return self.declared.has(Capability.SYNCHRONOUS_STEP)

    @property
    def optimizer_state_is_local(self) -> bool:
        """True when each replica holds optimizer state of its own (LocalSGD, DiLoCo, EASGD):
        a checkpoint then saves one optimizer state per rank."""
        return self.declared.has(Capability.LOCAL_OPTIMIZER_STATE)

    @property
    def comm(self) -> Comm:
        """This strategy's communicator (the job's, unless ``comm=`` was given); joined on
        first use."""
        if self._comm is None:
            self._comm = self.ft.comm_from_env(timeout=self.timeout, device=self.device,
                                               startup_timeout=self.startup_timeout)
        return self._comm

    @property
    def parts(self) -> Parts:
        """The parts this strategy runs (built from :meth:`plan` on first use, over
        :attr:`comm`), with their hooks in the one order of :class:`~stratagem.parts.Parts`."""
        if self._parts is None:
            self.ft.check_comm(self.comm)
            parts = Parts(self.declared.build(self.comm))
            for part in parts:
                part.attach(self)
            self._parts = parts
        return self._parts

    @property
    def prepared_models(self) -> list[Prepared]:
        """The :class:`Prepared` record of every model prepared so far, in order."""
        return list(self._prepared)

    # ------------------------------------------------------------------ accumulation
    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each worker; settable between steps."""
        return self.control.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        self.control.accumulation_steps = value

    @property
    def global_accumulation_steps(self) -> int:
        """``accumulation_steps * num_replicas_in_sync``; setting it divides by the workers
        (a count not divisible raises ``ValueError`` naming both numbers)."""
        return self.control.accumulation_steps * self.num_replicas_in_sync

    @global_accumulation_steps.setter
    def global_accumulation_steps(self, value: int) -> None:
        self.control.set_global_accumulation(value, self.num_replicas_in_sync)

    @property
    def sync_gradients(self) -> bool:
        """True when the last ``backward`` completed an accumulated step (as Accelerate's)."""
        return self.control.sync_gradients

    # ------------------------------------------------------------------ identity
    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas synchronising now (under fault tolerance: the current quorum's)."""
        return self.comm.world_size * self.comm.replica_group_size

    @property
    def replica_id(self) -> int:
        return self.comm.rank * self.comm.replica_group_size + self.comm.replica_group_rank

    @property
    def is_chief(self) -> bool:
        return self.replica_id == 0

    @property
    def steps(self) -> int:
        """Optimizer steps applied on this replica (skipped ones not counted); restorable."""
        return self.control.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.control.steps = check_int("steps", value, minimum=0, fix="pass the saved step count")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self.replica_id}/{self.num_replicas_in_sync}, "
                f"precision={self.precision.precision!r})")

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Inside, ``sg.get_strategy()`` returns this strategy."""
        with enter_scope(self):
            yield self

    def autocast(self) -> Autocast:
        """Autocast for code outside the prepared model (a no-op under fp32); reusable."""
        return self.precision.autocast()

    # ------------------------------------------------------------------ prepare
    def prepare(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Check replicas agree, make them equal, wrap the model and optimizers through the
        parts. Returns ``model`` alone when no optimizer is given, else ``(model,
        *optimizers)``. ``ReplicaMismatchError`` names the first differing parameter."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare expects an nn.Module first, got {type(model).__name__}")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, StrategyOptimizer):
                raise TypeError(f"prepare expects torch optimizers after the model, got {type(opt).__name__}")
        module = uncompiled(model)  # names, checks and checkpoints: the module's own
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            if not self.declared.has(Capability.MATERIALIZES_META):
                raise ValueError(
                    f"the {type(module).__name__} given to prepare has tensors on the meta "
                    f"device (built under torch.device('meta')); {type(self).__name__} needs "
                    "the real values on every worker. Fix: build the model on the CPU, or use "
                    "sg.Sharded(), which materialises only each worker's shards")
            self.replicas.check_model(module)  # the values are made after sharding
        elif not self.ft.start(module):
            module.to(self.device)
            if not self.declared.has(Capability.STARTS_ALONE):
                self.replicas.check_model(module)
                with torch.no_grad():
                    state = list(module.parameters()) + list(module.buffers())
                    self.comm.broadcast_coalesced([t.data for t in state], src=0)
        wrapped = self.parts.wrap_model(model, module)
        if self.precision.dtype is not None:
            # On the user's module (inside DDP / compiled): every path to it runs in autocast.
            module.forward = autocast_forward(module, self.precision)  # type: ignore[method-assign]
        prepared = Prepared(wrapped, module, given=model, index=len(self._prepared))
        prepared.optimizers = [StrategyOptimizer(opt, prepared, self.control, self._step, self)
                               for opt in optimizers]
        self._prepared.append(prepared)
        self.parts.setup(prepared)
        self._set_grad_sync(self.control.micro + 1 >= self.control.micro_per_step, [prepared])
        self.ft.prepared()
        return wrapped if not optimizers else (wrapped, *prepared.optimizers)

    def eval_copy(self, prepared: Prepared) -> nn.Module:
        """A plain copy of the user's module (made once) for ``eval_model`` to fill in."""
        return eval_copy(prepared, self.parts, self.precision)

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` with accumulation and fp16 loss scaling; gradient
        communication failures become ``PeerTimeoutError``."""
        self.control.backward(loss, **kwargs)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the *unscaled* gradients of the *whole* accumulated step to a total norm of
        at most ``max_norm`` (global under Mirrored/Sharded; this worker's own where
        gradients stay local). Call it between ``backward`` and ``optimizer.step()``, on
        every micro-batch or only the last. Returns the pre-clip norm (filled at the
        boundary); a non-finite norm skips or raises like a non-finite gradient."""
        return self.control.clip(self._prepared.require(model, "clip_grad_norm_"),
                                 max_norm, norm_type)

    def _step(self, opt: StrategyOptimizer) -> None:
        nonfinite = self.control.boundary(opt, synchronous=self.synchronous_step)
        if nonfinite is None:
            return  # a micro-batch
        prepared = opt.prepared
        if not self.ft.commit():
            pass  # applied nowhere; the next quorum drops the lost replica
        elif nonfinite:
            self.control.skip(opt)
        else:
            self.parts.update(prepared, opt)
            self.control.applied()
            prepared.local_steps += 1
            self.parts.after_update(prepared)
        self.ft.step_end(prepared)
        # The step boundary is where a checkpoint is consistent (a skipped step is one too).
        for hook in list(self._step_end_hooks.values()):
            hook(opt)

    def _set_grad_sync(self, enabled: bool, prepared: Sequence[Prepared] | None = None) -> None:
        for p in self._prepared if prepared is None else prepared:
            self.parts.set_grad_sync(p, enabled)

    def _grad_norm(self, prepared: Prepared, grads: list[torch.Tensor],
                   norm_type: float) -> torch.Tensor:
        return self.parts.grad_norm(grads, norm_type, self.device)

    def add_step_end_hook(self, hook: StepEndHook) -> RemovableHandle:
        """Call ``hook(optimizer)`` at the end of every optimizer step that reached an
        accumulation boundary, applied or skipped, on every replica (where a checkpoint is
        resumable). In the order added; ``handle.remove()`` detaches one; a hook may run
        collectives. ``on_preemption`` is built on this."""
        handle = RemovableHandle(self._step_end_hooks)
        self._step_end_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------------ the model to keep
    def eval_model(self, model: nn.Module) -> nn.Module:
        """The consensus model as a module of the user's class (never a wrapper): the module
        itself for replicated strategies, else a copy holding the average / outer parameters
        / center / global model; autocast under bf16/fp16 like the prepared model. Call it
        on every replica (a collective for some). An unprepared model is returned as is."""
        prepared = self._find_prepared(model)
        return model if prepared is None else self.parts.eval_model(prepared, self.eval_copy)

    def finalize(self, model: nn.Module) -> None:
        """One last synchronisation, so the consensus includes every local step (each part's
        ``finalize``: LocalSGD/DiLoCo average, EASGD a last exchange, a parameter server
        flushes and pulls; per-step strategies set the buffers to rank 0's). A collective;
        training may continue, and calling it twice is harmless."""
        self.parts.finalize(self._prepared.require(model, "finalize"))

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module behind a prepared model (never DDP nor ``torch.compile``)."""
        prepared = self._find_prepared(model)
        return prepared.module if prepared is not None else uncompiled(model)

    # ------------------------------------------------------------------ the state protocol
    # What stratagem.checkpoint, .fit, .preemption and a user's own saver read and write.
    def find_prepared(self, model: nn.Module, *, exact: bool = False) -> Prepared | None:
        """The :class:`Prepared` record of ``model`` (as returned by ``prepare``, the user's
        module, or the object given to it), or None; unless ``exact``, ``torch.compile``
        wrappers applied after ``prepare`` are seen through."""
        return self._prepared.find(model, exact=exact)

    def _find_prepared(self, model: nn.Module) -> Prepared | None:
        return self._prepared.find(model)

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model to keep under the module's own names (the consensus; a sharded part's
        shards). A collective for some strategies; an unprepared module's ``state_dict``."""
        prepared = self.find_prepared(model)
        if prepared is None:
            return {k: v.detach() for k, v in model.state_dict().items()}
        return self.parts.saved_model(prepared)

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` into ``model`` on every replica and into the parts' copies of it
        (center, outer parameters, shards). A collective for some strategies."""
        prepared = self.find_prepared(model)
        if prepared is None:
            model.load_state_dict(state)
        else:
            self.parts.load_model(prepared, state)

    def strategy_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The parts' tensors besides the model (outer momentum, center...); {} if unprepared."""
        prepared = self.find_prepared(model)
        return {} if prepared is None else self.parts.extra_state(prepared)

    def load_strategy_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`strategy_state` returned (missing keys allowed)."""
        prepared = self.find_prepared(model)
        if prepared is not None:
            self.parts.load_extra_state(prepared, state)

    def local_steps(self, model: nn.Module) -> int:
        """Optimizer steps applied to ``model`` on this replica (the periodic phase)."""
        prepared = self.find_prepared(model)
        return 0 if prepared is None else prepared.local_steps

    def set_local_steps(self, model: nn.Module, steps: int) -> None:
        """Set the counter :meth:`local_steps` reads (a restore puts the schedule in phase)."""
        check_int("steps", steps, minimum=0, fix="pass the saved local step count")
        prepared = self.find_prepared(model)
        if prepared is not None:
            prepared.local_steps = steps

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This replica's optimizer state for a checkpoint (a collective for some parts)."""
        return self.parts.optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """Load what :meth:`optimizer_state` returned (into the shards for a parameter server)."""
        self.parts.load_optimizer_state(optimizer, state)

    def heal_state(self) -> dict[str, Any]:
        """Everything a replica joining a fault-tolerant job needs (see ``stratagem.ft``)."""
        return self.ft.heal_state()

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Load what :meth:`heal_state` of a live peer returned."""
        self.ft.load_heal_state(state)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``fn(*args, **kwargs)`` in replica context (``sg.get_replica_context()``)."""
        with enter_scope(self), enter_replica(ReplicaContext(self)):
            return fn(*args, **(kwargs or {}))

    def reduce(self, op: Any, value: Any) -> Any:
        """Reduce ``value`` (a tensor, a number, or a nested dict/list/tuple of them) across
        replicas; every replica gets the same result."""
        return self.replicas.reduce(op, value)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate ``value`` across replicas along ``axis`` (sizes there may differ)."""
        return self.replicas.gather(value, axis)

    def barrier(self) -> None:
        """Every replica waits for the others; one absent for ``timeout`` raises
        ``PeerTimeoutError`` naming it."""
        self.comm.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The chief runs the block first, the others after it left (Accelerate's
        ``main_process_first``); they wait at most ``timeout``."""
        if not self.is_chief:
            self.barrier()
        yield
        if self.is_chief:
            self.barrier()

    # ------------------------------------------------------------------ input
    def distribute_dataset(self, dataset: Any, global_batch_size: int, shuffle: bool = True,
                           seed: int = 0, drop_remainder: bool = False, **kwargs: Any) -> DistributedLoader:
        """This replica's share of each global batch; see :class:`DistributedLoader`.
        Sharded by the replicas' places in the job as launched."""
        return self.inputs.dataset(dataset, global_batch_size, shuffle=shuffle, seed=seed,
                                   drop_remainder=drop_remainder, **kwargs)

    def distribute_datasets_from_function(self, input_fn: Callable[[InputContext], Any]) -> Any:
        """Call ``input_fn(ctx)`` with this replica's ``InputContext`` and return its result."""
        return self.inputs.from_function(input_fn)

    def skip_first_batches(self, loader: Any, num_batches: int) -> Any:
        """``loader`` positioned to skip its first ``num_batches`` batches in its next
        iteration only (Accelerate's ``skip_first_batches``)."""
        return skip_first_batches(loader, num_batches)

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """Accelerate's ``with accelerator.accumulate(model):``: micro-batches are already
        counted by ``backward``; this checks that ``model`` was prepared here."""
        self._prepared.require(model, "accumulate")
        yield

    # ------------------------------------------------------------------ metrics, features
    def metrics(self) -> dict[str, Any]:
        """Counters for this replica."""
        extra = self.parts.metrics()  # parts fold traffic counted elsewhere first
        m: dict[str, Any] = {"steps": self.control.steps, "bytes_sent": self.comm.bytes_sent,
                             "bytes_received": self.comm.bytes_received,
                             "comm_seconds": self.comm.seconds,
                             "skipped_steps": self.control.skipped,
                             "loss_scale": self.precision.scale}
        m.update(extra)
        m.update(self.declared.metrics(self.comm))
        return m

    def save(self, path: str | os.PathLike[str], **state: Any) -> None:
        """Write a checkpoint atomically (a collective); see :func:`stratagem.checkpoint.save`."""
        feature("save")(self, path, **state)

    def restore(self, path: str | os.PathLike[str], **state: Any) -> dict[str, Any]:
        """Load a checkpoint into the given objects; see :func:`stratagem.checkpoint.restore`."""
        return feature("restore")(self, path, **state)  # type: ignore[no-any-return]

    def on_preemption(self, path: str | os.PathLike[str], **state: Any) -> Any:
        """On SIGTERM, save ``state`` at the next step boundary and exit with
        ``PREEMPTED_EXIT_CODE``; see :mod:`stratagem.preemption`."""
        return feature("on_preemption")(self, path, **state)

    def fit(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., Any],
            dataset: Any, *, epochs: int, global_batch_size: int, **kwargs: Any) -> dict[str, list[float]]:
        """Train with the methods a custom loop uses; see :func:`stratagem.fit.fit`."""
        return feature("fit")(self, model, optimizer, loss_fn, dataset,  # type: ignore[no-any-return]
                               epochs=epochs, global_batch_size=global_batch_size, **kwargs)

    def close(self) -> None:
        """Release background resources (heartbeat thread, parameter-server channels)."""
        if self._parts is not None:
            self._parts.close()
        if self._comm is not None:
            self._comm.close()
