"""Ray Train: a stratagem training function inside ``ray.train.torch.TorchTrainer``.

A training function written for ``stratagem run`` runs under Ray unchanged: Ray Train starts
one worker per replica, sets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) and creates the default process group, which every
synchronous strategy built without ``comm=`` adopts (``sg.Mirrored()``, ``sg.DiLoCo()``,
``sg.LocalSGD()``, ...). Two helpers connect stratagem's checkpoints to Ray's::

    import stratagem.ray as sg_ray

    def train_fn(config):
        strategy = sg.Mirrored()
        model, optimizer = strategy.prepare(model, optimizer)
        extras = sg_ray.restore(strategy, model=model, optimizer=optimizer) or {}
        for step in range(extras.get("step", 0), steps):
            ...
            sg_ray.report(strategy, {"loss": loss.item()}, checkpoint=step % 50 == 0,
                          model=model, optimizer=optimizer, step=step + 1)

:func:`report` calls ``ray.train.report`` on every worker (Ray waits for all of them); with
``checkpoint=True`` it first writes a stratagem checkpoint (``strategy.save``: safetensors +
JSON, no pickle) into a fresh temporary folder, hands it to Ray as the chief's
``ray.train.Checkpoint`` and removes the folder once Ray has persisted it. :func:`restore`
loads ``ray.train.get_checkpoint()`` (the latest checkpoint, after Ray restarted the job or
with ``TorchTrainer(resume_from_checkpoint=...)``) through ``strategy.restore``; it returns
the extras saved with it, or None when Ray has none.

Fault tolerance: ``TorchTrainer(..., torch_config=sg_ray.FaultTolerantConfig(min_replicas=1))``
makes every Ray worker a replica of its own (a replica group of one process). When a worker
dies, Ray (2.60) replaces that worker alone; its replacement is healed live from a survivor
by stratagem's fault-tolerance layer and the survivors go on, never restarted. The quorum
service is stratagem's own, admitting only members that prove the job's secret (not
torchft's unauthenticated Lighthouse, which Ray's ``TorchftConfig`` starts on every
interface): it runs in an actor on the node of Ray Train's controller (the head, by default), bound to that node's address, and
its secret reaches the workers through Ray's own calls, each writing it to a private 0600
file (a Ray cluster runs any code its members send, so the secret is as safe as the cluster).
Without ``FaultTolerantConfig`` (the default ``TorchConfig``), a lost worker makes Ray restart
every worker (``RunConfig(failure_config=FailureConfig(max_failures=N))``), and the job goes
on from its last :func:`report`\\ ed checkpoint through :func:`restore`.

Ray's support for restarting one replica group (``has_replica_groups`` on a backend, added
with ``TorchftConfig`` in Ray 2.55/2.56) is not public API: every use of it is in this module
(:class:`FaultTolerantConfig`, ``_Backend``), and ``tests/test_ray.py`` checks the contract.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from typing import Any

try:
    import ray
    import ray.train
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend
except ImportError as exc:  # pragma: no cover - the extra is installed by make test
    raise ImportError(
        "stratagem.ray needs Ray Train: pip install 'stratagem[ray]' (ray[train]>=2.56)"
    ) from exc

__all__ = ["report", "restore", "FaultTolerantConfig", "CHECKPOINT_DIR"]

logger = logging.getLogger(__name__)

#: The folder inside a Ray checkpoint that holds the stratagem checkpoint.
CHECKPOINT_DIR = "stratagem"
#: Set in a Ray worker that replaces a failed one (``FaultTolerantConfig``): how many times
#: its replica has been replaced (read as a restart count by the fault-tolerance layer).
_LIFE_ENV = "TORCHELASTIC_RESTART_COUNT"
#: Set in a worker of a :class:`FaultTolerantConfig` run: the private folder of its secret.
_FT_DIR_ENV = "STRATAGEM_RAY_FT_DIR"
#: Seconds the backend waits for the quorum actor and for a worker's set-up (a
#: ``ray.exceptions.GetTimeoutError`` after that: Ray counts it as a failed start).
_SETUP_TIMEOUT = 120.0


def report(strategy: Any, metrics: dict[str, Any] | None = None, *, checkpoint: bool = False,
           **state: Any) -> None:
    """``ray.train.report(metrics)`` from this worker (call it on every worker: Ray waits for
    all). With ``checkpoint=True``, first ``strategy.save`` ``state`` (objects with
    ``state_dict()``, loaders, plain extras such as ``step=``) into a temporary folder and
    report it as the chief's checkpoint; a sharded strategy's state is gathered
    (``consolidate=True``), since Ray's workers need not share a file system.

    Ray Train takes one report per worker per poll of its controller
    (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default) and blocks the next until then:
    report every N steps, not every step. Under :class:`FaultTolerantConfig` the call is
    handed to a background thread instead (the newest report replaces one not yet taken),
    so that a replica never waits at Ray's barrier for one that is being replaced."""
    metrics = dict(metrics or {})
    if not checkpoint and state:
        raise ValueError(f"report() got state to save ({sorted(state)}) with "
                         "checkpoint=False. Fix: pass checkpoint=True, or drop the state")
    if checkpoint and not state:
        raise ValueError("report(checkpoint=True) with nothing to save. Fix: pass the objects, "
                         "e.g. model=model, optimizer=optimizer")
    folder = None
    if checkpoint:
        folder = tempfile.mkdtemp(prefix="stratagem-ray-ckpt-")
        try:
            strategy.save(os.path.join(folder, CHECKPOINT_DIR), consolidate=True, **state)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if not strategy.is_chief:
            shutil.rmtree(folder, ignore_errors=True)
            folder = None
    if os.environ.get(_FT_DIR_ENV):
        _Reporter.get().put(metrics, folder)
        return
    _send(metrics, folder)


def _send(metrics: dict[str, Any], folder: str | None) -> None:
    try:
        if folder is None:
            ray.train.report(metrics)
        else:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # ours: made above; Ray has copied it


class _Reporter:
    """One thread per worker that makes this worker's ``ray.train.report`` calls; holds at
    most one report not yet sent (the newest)."""

    _instance: _Reporter | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: tuple[dict[str, Any], str | None] | None = None
        threading.Thread(target=self._run, name="stratagem-ray-report", daemon=True).start()

    @classmethod
    def get(cls) -> _Reporter:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def put(self, metrics: dict[str, Any], folder: str | None) -> None:
        with self._cond:
            if self._pending is not None and self._pending[1] is not None:
                if folder is None:  # keep the checkpoint not yet sent, with the new metrics
                    folder = self._pending[1]
                else:
                    shutil.rmtree(self._pending[1], ignore_errors=True)
            self._pending = (metrics, folder)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None)
                assert self._pending is not None
                metrics, folder = self._pending
                self._pending = None
            try:
                _send(metrics, folder)
            except Exception as exc:  # noqa: BLE001 - a report lost, not the training
                logger.warning("stratagem.ray: ray.train.report failed (%s: %s); the next "
                               "report goes on", type(exc).__name__, exc)


def restore(strategy: Any, checkpoint: Any = None, **state: Any) -> dict[str, Any] | None:
    """Load Ray's latest checkpoint (``ray.train.get_checkpoint()``: Ray restarted the run, or
    it was started again under the same ``RunConfig(name=..., storage_path=...)``), or
    ``checkpoint`` (a ``ray.train.Checkpoint`` or its path: Ray Train 2's replacement for
    ``resume_from_checkpoint``), into ``state`` through ``strategy.restore`` (a collective:
    call it on every worker, after ``prepare``). Returns the extras saved with it, or None
    when there is no checkpoint. A worker that Ray started
    to replace a failed replica of a fault-tolerant job (:class:`FaultTolerantConfig`)
    returns None at once: it is healed live from a survivor instead."""
    if _replacement() and getattr(strategy, "fault_tolerant", False):
        return None
    ckpt = ray.train.get_checkpoint() if checkpoint is None else checkpoint
    if ckpt is not None and not isinstance(ckpt, ray.train.Checkpoint):
        ckpt = ray.train.Checkpoint(os.fspath(ckpt))
    if ckpt is None:
        return None
    with ckpt.as_directory() as folder:
        path = os.path.join(folder, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"Ray's checkpoint {ckpt.path} holds no stratagem checkpoint "
                             f"(no {CHECKPOINT_DIR}/ folder). Fix: report checkpoints with "
                             "stratagem.ray.report(..., checkpoint=True)")
        extras: dict[str, Any] = strategy.restore(path, **state)
    return extras


def _replacement() -> bool:
    with contextlib.suppress(ValueError):
        return int(os.environ.get(_LIFE_ENV, "0") or 0) > 0
    return False


# ---------------------------------------------------------------------- fault tolerance
class FaultTolerantConfig(TorchConfig):  # type: ignore[misc]
    """``TorchTrainer(torch_config=FaultTolerantConfig(min_replicas=K))``: each Ray worker is
    a fault-tolerant replica; a failed one is replaced alone by Ray and healed live (see the
    module docstring). ``min_replicas``: the fewest replicas training goes on with (a
    strategy's own ``min_replicas`` may raise it). ``timeout_s`` as for ``TorchConfig``.
    Give Ray room to restart: ``RunConfig(failure_config=FailureConfig(max_failures=N))``."""

    def __init__(self, min_replicas: int = 1, **kwargs: Any) -> None:
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) \
                or min_replicas < 1:
            raise ValueError(f"min_replicas must be an int >= 1, got {min_replicas!r}. Fix: "
                             "pass the fewest replicas training may go on with, e.g. 1")
        self.min_replicas = min_replicas
        super().__init__(**kwargs)

    @property
    def backend_cls(self) -> type:
        return _Backend


@ray.remote(num_cpus=0)
class _QuorumActor:
    """stratagem's authenticated quorum service, alive as long as the training run."""

    def __init__(self, num_slots: int, min_replicas: int) -> None:
        from ._rendezvous import is_loopback
        from .ft.launch import QuorumService, read_token_file

        host = ray.util.get_node_ip_address()
        self.service = QuorumService(num_slots=num_slots, min_replicas=min_replicas,
                                     host=host, allow_remote=not is_loopback(host))
        self.token = read_token_file(self.service.token_file)

    def info(self) -> tuple[str, bytes]:
        return self.service.address(), self.token

    def forget(self, slot: int) -> None:
        """Drop the ids replica ``slot`` was heard under: Ray has replaced it."""
        self.service.forget(self.service.replica_ids(slot))

    def stop(self) -> None:
        self.service.stop()


def _world_rank() -> int:
    return int(ray.train.get_context().get_world_rank())


def _join(address: str, token: bytes, num_slots: int, min_replicas: int,
          lives: dict[int, int]) -> None:
    """On a worker, before its training function: the variables a fault-tolerant launcher
    gives (:mod:`stratagem.ft.env`), the secret in a private 0600 file."""
    from .ft.launch import worker_env

    slot = _world_rank()
    folder = tempfile.mkdtemp(prefix="stratagem-ray-ft-")
    path = os.path.join(folder, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(token)
    old = os.environ.get(_FT_DIR_ENV)
    if old and os.path.basename(old).startswith("stratagem-ray-ft-"):
        shutil.rmtree(old, ignore_errors=True)  # ours, from an earlier start of this worker
    os.environ[_FT_DIR_ENV] = folder
    atexit.register(shutil.rmtree, folder, True)  # a worker Ray kills leaves it behind
    os.environ.update(worker_env(slot=slot, num_slots=num_slots, lighthouse=address,
                                 min_replicas=min_replicas, token_file=path,
                                 host=ray.util.get_node_ip_address()))
    os.environ[_LIFE_ENV] = str(lives.get(slot, 0))
    # Each replica is a process group of its own; torchrun's variables of Ray's group of
    # all workers would make a strategy adopt a group that cannot survive a member's loss.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        os.environ.pop(name, None)


def _leave() -> None:
    folder = os.environ.pop(_FT_DIR_ENV, "")
    if folder and os.path.basename(folder).startswith("stratagem-ray-ft-"):
        shutil.rmtree(folder, ignore_errors=True)


class _Backend(_TorchBackend):  # type: ignore[misc]
    """Ray's backend for :class:`FaultTolerantConfig`: one replica group per worker (Ray
    replaces a failed group alone), no process group across workers (the fault-tolerance
    layer forms its own per quorum), stratagem's quorum service in an actor."""

    #: Read by Ray's worker group: replace a failed replica group alone.
    has_replica_groups: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._actor: Any = None
        self._lives: dict[int, int] = {}

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        from ray.train.v2._internal.execution.worker_group import ReplicaGroup

        replacing = isinstance(worker_group, ReplicaGroup)
        if self._actor is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            num_slots = len(worker_group)
            self._actor = _QuorumActor.options(  # type: ignore[attr-defined]
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False),
            ).remote(num_slots, backend_config.min_replicas)
            self._num_slots = num_slots
        address, token = ray.get(self._actor.info.remote(), timeout=_SETUP_TIMEOUT)
        ranks = ray.get(worker_group.execute_async(_world_rank), timeout=_SETUP_TIMEOUT)
        if replacing:
            for slot in ranks:
                self._lives[slot] = self._lives.get(slot, 0) + 1
                ray.get(self._actor.forget.remote(slot), timeout=_SETUP_TIMEOUT)
        ray.get(worker_group.execute_async(_join, address, token, self._num_slots,
                                           backend_config.min_replicas,
                                           dict(self._lives)), timeout=_SETUP_TIMEOUT)

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        with contextlib.suppress(Exception):
            ray.get(worker_group.execute_async(_leave), timeout=30)
        from ray.train.v2._internal.execution.worker_group import ReplicaGroup

        if not isinstance(worker_group, ReplicaGroup) and self._actor is not None:
            with contextlib.suppress(Exception):
                ray.get(self._actor.stop.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(self._actor)
            self._actor = None
            self._lives = {}
