"""Preemption: on SIGTERM, checkpoint at the next step boundary and exit with a known code.

Clusters announce a preemption (a spot instance reclaimed, a job rescheduled) with SIGTERM
and a grace period before SIGKILL. ``strategy.on_preemption(path, model=..., optimizer=...,
loader=...)`` installs a handler that only records the signal; the strategy checks the
record at the end of every optimizer step (the step boundary, where model, optimizer, loader
position and RNG are consistent), saves a checkpoint there with ``strategy.save`` and exits
with :data:`PREEMPTED_EXIT_CODE` (143 = 128 + SIGTERM, what a shell reports for a process
killed by SIGTERM, so schedulers treat it the same way).

Agreement: when the job has more than one replica the flag is all-reduced (max) at every
boundary, so every replica saves at the same step even if the signal reached them at
different instants (one 4-byte all-reduce per step, only while preemption handling is on).
``save`` is itself a collective, so this holds for every strategy sharing a process group;
workers run as single-process jobs (``comm=sg.Comm.single()``, async strategies) decide alone.

Slurm: inside a Slurm job the default signals are SIGTERM and SIGUSR1 (``sbatch
--signal=USR1@60`` warns a job 60 s before its time limit; ``scancel --signal=USR1`` does it
at once), and ``requeue=True`` puts the job back in the queue once the checkpoint is saved
(``scontrol requeue $SLURM_JOB_ID``, by rank 0 after every replica saved): the requeued job's
script restores from ``path`` and goes on from the same step, position in the epoch included.

A second signal while the first is being handled restores the default action and kills the
process at once. Handlers can only be installed from the main thread; elsewhere (ranks run as
threads in tests) call :meth:`PreemptionCheckpoint.trigger` instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .checkpoint import save
from .strategy import Strategy, register_feature
from .validation import check_int

__all__ = ["PREEMPTED_EXIT_CODE", "PreemptionCheckpoint", "on_preemption", "default_signals"]

#: Exit code of a worker that saved a checkpoint because it was preempted (128 + SIGTERM).
PREEMPTED_EXIT_CODE = 128 + int(signal.SIGTERM)
#: How long ``scontrol requeue`` may take before the requeue is given up (the checkpoint is
#: saved either way).
REQUEUE_TIMEOUT_SECONDS = 60.0


def default_signals(env: Any = None) -> tuple[int, ...]:
    """SIGTERM, and SIGUSR1 inside a Slurm job (``SLURM_JOB_ID``): the signal ``sbatch
    --signal=USR1@SECONDS`` sends before the time limit."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        return (int(signal.SIGTERM), int(signal.SIGUSR1))
    return (int(signal.SIGTERM),)


class PreemptionCheckpoint:
    """Save ``state`` to ``path`` at the first step boundary after a preemption signal.

    Built by :meth:`Strategy.on_preemption`. ``state`` is what ``strategy.save`` takes
    (``model=``, ``optimizer=``, ``loader=``, extras); an extra that is a zero-argument
    callable is called at save time (e.g. ``step=lambda: step``). With ``exit=True`` (the
    default) the process then raises ``SystemExit(exit_code)``; with ``exit=False`` the step
    returns normally and :attr:`saved` becomes True, for loops that want to stop themselves.
    The save happens inside ``optimizer.step()`` (its end is the step boundary): a loop that
    counts steps should count before calling it, or the saved count is one behind the model.

    On failure: if the save fails, ``CheckpointError`` propagates from ``optimizer.step()``
    on every replica and the previous checkpoint at ``path`` stays intact.
    """

    def __init__(self, strategy: Strategy, path: str | os.PathLike[str], *,
                 signals: Iterable[int] | None = None, exit: bool = True,
                 exit_code: int = PREEMPTED_EXIT_CODE, keep_last: int = 2,
                 requeue: bool = False, **state: Any) -> None:
        check_int("exit_code", exit_code, minimum=0, maximum=255,
                  fix=f"pass a process exit status, e.g. {PREEMPTED_EXIT_CODE}")
        if not isinstance(requeue, bool):
            raise TypeError(f"requeue must be True or False, got {requeue!r}")
        if requeue:
            if not os.environ.get("SLURM_JOB_ID"):
                raise ValueError("requeue=True puts a Slurm job back in its queue, but this "
                                 "process is not in a Slurm job (SLURM_JOB_ID is not set). "
                                 "Fix: drop requeue=, or run the script under sbatch")
            if shutil.which("scontrol") is None:
                raise ValueError("requeue=True needs Slurm's scontrol on PATH (to run "
                                 "`scontrol requeue $SLURM_JOB_ID`). Fix: add Slurm's bin "
                                 "directory to PATH, or drop requeue=")
        self.strategy = strategy
        self.path = path
        self.signals = tuple(default_signals() if signals is None else signals)
        self.requeue = requeue
        self.requeued = False
        self.exit = exit
        self.exit_code = exit_code
        self.keep_last = keep_last
        self.state = state
        self.saved = False
        self._requested = threading.Event()
        self._previous: dict[int, Any] = {}
        self._hook: RemovableHandle | None = None
        trigger = state.get("optimizer")
        self._trigger_opt: Any = trigger if isinstance(trigger, torch.optim.Optimizer) else None

    # ------------------------------------------------------------------ signals
    def install(self) -> bool:
        """Install the signal handlers; False (nothing installed) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous.clear()

    def attach(self) -> None:
        """Check for a requested preemption at the end of every step of the strategy (its
        step-end hook); idempotent."""
        if self._hook is None:
            self._hook = self.strategy.add_step_end_hook(self._at_step_boundary)

    def detach(self) -> None:
        """Stop checking at step ends and put the previous signal handlers back."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._requested.is_set():
            # Second signal: the user (or the scheduler) insists; die the default way now.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._requested.set()

    def trigger(self) -> None:
        """Request a preemption checkpoint as if the signal had arrived."""
        self._requested.set()

    @property
    def requested(self) -> bool:
        """Whether this replica received the signal (not yet agreed with the others)."""
        return self._requested.is_set()

    # ------------------------------------------------------------------ the boundary
    def _at_step_boundary(self, opt: Any) -> None:
        """The strategy's step-end hook (see :meth:`attach`)."""
        if self.saved:
            return
        if self._trigger_opt is not None and opt is not self._trigger_opt \
                and getattr(opt, "optimizer", None) is not self._trigger_opt:
            return  # several optimizers (GAN): the boundary is after the one given to us
        flag = self._requested.is_set()
        comm = self.strategy.comm
        if comm.world_size > 1:
            t = torch.tensor([1.0 if flag else 0.0])
            flag = bool(comm.all_reduce(t, "max").item() > 0)
        if not flag:
            return
        state = {k: (v() if _is_thunk(v) else v) for k, v in self.state.items()}
        save(self.strategy, self.path, keep_last=self.keep_last, **state)
        self.saved = True
        if self.requeue:
            if comm.world_size > 1:  # every replica has saved before the job is requeued
                comm.barrier()
            if comm.rank == 0:
                self.requeued = _requeue_slurm_job()
        if self.exit:
            self.uninstall()
            raise SystemExit(self.exit_code)


#: The handler ``on_preemption`` installed last, per strategy (a second call replaces it).
_ACTIVE: weakref.WeakKeyDictionary[Strategy, PreemptionCheckpoint] = weakref.WeakKeyDictionary()


def on_preemption(strategy: Strategy, path: str | os.PathLike[str],
                  **state: Any) -> PreemptionCheckpoint:
    """What ``strategy.on_preemption(path, **state)`` runs: replace the strategy's previous
    handler, install the signal handlers and attach the check to the strategy's step-end
    hook. Returns the handler."""
    previous = _ACTIVE.pop(strategy, None)
    if previous is not None:
        previous.detach()
    handler = PreemptionCheckpoint(strategy, path, **state)
    handler.install()
    handler.attach()
    _ACTIVE[strategy] = handler
    return handler


register_feature("on_preemption", on_preemption)


def _requeue_slurm_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID``: the job goes back to the queue (Slurm ends this
    run's processes); True once Slurm accepted it. A failure is a warning, not an error: the
    checkpoint is saved either way."""
    import warnings

    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              timeout=REQUEUE_TIMEOUT_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warnings.warn(f"preemption: the checkpoint is saved, but `scontrol requeue {job}` "
                      f"failed ({exc}); resubmit the job to resume", RuntimeWarning,
                      stacklevel=2)
        return False
    if done.returncode != 0:
        warnings.warn(f"preemption: the checkpoint is saved, but `scontrol requeue {job}` "
                      f"exited {done.returncode}: {done.stderr.strip()[:300]}; resubmit the job "
                      "to resume (a job submitted with --no-requeue cannot be requeued)",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def _is_thunk(value: Any) -> bool:
    return callable(value) and not isinstance(value, (torch.nn.Module, torch.optim.Optimizer,
                                                      torch.Tensor)) \
        and not hasattr(value, "state_dict")

