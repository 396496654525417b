"""Local SGD and DiLoCo: workers train alone and meet every ``period`` steps.

``LocalSGD`` averages the parameters (and buffers) of all workers with one all-reduce every
``period`` local steps, and every step during a warm-up: Lin, Stich, Patel, Jaggi, "Don't use
large mini-batches, use local SGD" (ICLR 2020), which also motivates the warm-up
("post-local SGD"). One part: :class:`~stratagem.parts.ParameterAveraging`.

``DiLoCo`` is the two-level form of Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models" (2023): each worker runs its own (inner) optimizer for ``period``
steps; the pseudo-gradient ``theta_prev - mean_i(theta_i)`` is all-reduced and an outer
optimizer step (Nesterov SGD by default, any ``torch.optim`` optimizer) is applied to
``theta_prev``; the result becomes every worker's parameters. ``fragments > 1`` is streaming
DiLoCo (Douillard et al., "Streaming DiLoCo", 2025). One part:
:class:`~stratagem.parts.OuterStep`.

Both move ``1/period`` of the bytes of an all-reduce per step (``Mirrored`` all-reduces the
gradients every step).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..compression import OUTER_KINDS, check_compression
from ..parts import OuterStep, ParameterAveraging, Plan
from ..parts.async_outer import ASYNC_KINDS, AsyncOuterStep
from ..parts.outer import OuterOptimizerFactory
from ..ps.addresses import shard_addresses
from ..ps.optim import STALENESS_RULES
from ..strategy import Strategy
from ..validation import check_choice, check_int, check_number, check_optional_number

__all__ = ["LocalSGD", "DiLoCo"]


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

    Arguments: ``period`` (int >= 1), ``warmup_steps`` (int >= 0), ``compression`` (None,
    "bf16", "fp16", "int8", "int4" or "topk[:DENSITY+intBITS]"), plus the common
    strategy arguments.

    ``compression``: what crosses the wire at an average. The parameters themselves are not
    compressible (a 16-bit or 4-bit copy of the weights would lose the model), so a compressed
    average sends each worker's *change since the last average*, ``theta_last - theta_i``, and
    the new parameters are ``theta_last - mean_i(theta_last - theta_i)``: the same average,
    computed as DiLoCo's outer step with outer SGD ``lr=1, momentum=0`` (one
    :class:`~stratagem.parts.OuterStep`, so the quantized all-reduce, its error feedback and
    checkpointed residuals are DiLoCo's). It keeps ``theta_last`` (one copy of the parameters;
    two with "int8"/"int4", whose fp32 residuals are the other). Between averages
    ``eval_model`` and checkpoints hold ``theta_last``, as under DiLoCo (uncompressed: the
    mean of the local models); ``finalize`` averages first, so a final model is the average
    either way. ``warmup_steps`` needs ``compression=None`` (warm-up averages every step,
    where compression saves nothing worth its error).

    Warm-up: local steps hurt most early in training, at a high learning rate (Lin et al.
    start local SGD after the first decay, "post-local SGD"). A short run that is all early
    training wants ``warmup_steps`` of about its first epoch: the ImageNet-script port
    (``examples/imagenet_ddp``, 48 steps at lr 0.1, 2 workers, ``period=4``) lost 1.1 points on
    average over 6 seeds against the original (up to 4.2 on one; 3.4 after the first epoch)
    with ``warmup_steps=0``, and matched it (-0.03) with ``warmup_steps=24``.

    On failure: a dead or stalled peer makes the averaging all-reduce fail within ``timeout``
    seconds and ``optimizer.step()`` raises ``PeerTimeoutError`` naming it; resume from the
    last checkpoint. Memory: no persistent extra copy of the parameters; the averaging uses one
    transient flat buffer (one copy) while it runs.
    """

    name = "local_sgd"

    def __init__(self, *, period: int = 8, warmup_steps: int = 0,
                 compression: str | None = None, **common: Any) -> None:
        self.period = check_int(
            "period", period, minimum=1,
            fix="pass the number of local steps between averages, e.g. period=8")
        self.warmup_steps = check_int(
            "warmup_steps", warmup_steps, minimum=0,
            fix="pass 0 for no warm-up, or the number of initial steps to average after every "
                "step")
        self.compression = check_compression(compression, kinds=OUTER_KINDS)
        if compression is not None and warmup_steps:
            raise ValueError(f"LocalSGD(compression={compression!r}) averages changes since the "
                             f"last average and has no warm-up, got warmup_steps={warmup_steps}. "
                             "Fix: pass warmup_steps=0, or compression=None")
        super().__init__(**common)

    def plan(self) -> Plan:
        if self.compression is None:
            return Plan(ParameterAveraging.spec(period=self.period,
                                                warmup_steps=self.warmup_steps))
        # The average as an outer SGD step of lr 1 on the change since the last average (see
        # the class docstring): theta_last - 1 * mean_i(theta_last - theta_i).
        return Plan(OuterStep.spec(period=self.period, compression=self.compression,
                                   outer_optimizer=_average_as_outer_step))


def _average_as_outer_step(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0, momentum=0.0)


# ---------------------------------------------------------------------- DiLoCo
class DiLoCo(Strategy):
    """DiLoCo (Douillard et al. 2023): local inner optimization, outer Nesterov steps.

    Every worker steps the optimizer given to ``prepare`` (the inner optimizer, typically
    AdamW; its state stays local and is saved per rank) on its own batches. Every ``period``
    local steps the pseudo-gradient ``delta = theta_prev - mean_i(theta_i)`` is all-reduced
    (in bf16 with ``compression="bf16"``: half the bytes), the outer optimizer — a real
    ``torch.optim`` optimizer, by default SGD with Nesterov momentum: ``m = outer_momentum * m
    + delta``, ``theta_prev -= outer_lr * (delta + outer_momentum * m)`` — updates
    ``theta_prev`` (its gradient is ``delta``), and every worker's parameters are set to it. With ``outer_lr=1, outer_momentum=0`` this is exactly
    ``LocalSGD(period=period)``. Floating-point buffers are averaged when fragment 0 syncs.

    ``fragments > 1`` (streaming DiLoCo): the parameters are split into ``fragments``
    contiguous groups of about equal size; fragment ``k`` syncs when
    ``local_step % period == k * period // fragments``, so each is still synced once per
    period but the all-reduces are spread over it. The checkpointed model is the outer
    (consensus) parameters ``theta_prev``; the outer momentum and every worker's local
    parameters go in the strategy state, so a resume with the same workers is exact.

    Arguments: ``period`` (int >= 1), ``outer_lr`` (> 0), ``outer_momentum`` (in [0, 1)),
    ``outer_optimizer`` (a factory ``params -> torch.optim.Optimizer`` replacing the default
    SGD; then ``outer_lr``/``outer_momentum`` are not used), ``fragments`` (int, 1 <= fragments
    <= period and <= the number of parameter tensors), ``compression`` (None, "bf16" or
    "fp16": the pseudo-gradient's dtype on the wire; "int8" or "int4": blockwise quantization,
    one fp32 scale per 128 values, all-reduced by ``Comm.all_reduce_quantized`` so every
    replica decodes the same bytes, with error feedback whose residuals are checkpointed;
    "topk" = "topk:0.02+int2": SparseLoCo's top-k per 4096-value chunk at 2 bits, through
    ``Comm.all_reduce_topk``, the entries not sent kept in the same residuals;
    ``pseudo_grad_dtype`` is its old, deprecated name), ``sync_delay`` (Streaming DiLoCo's
    tau, an int in ``[0, period // fragments)``: a fragment's outer all-reduce runs in the
    background for that many inner steps before it is applied; 0 or None = synchronous),
    ``alpha``
    (in [0, 1): when an outer step lands, a fragment's parameters become ``alpha * local +
    (1 - alpha) * outer``; 0 = the outer parameters), plus the common strategy arguments.
    Douillard et al., "Streaming DiLoCo with overlapping communication" (2025) use
    ``fragments`` > 1, a small ``sync_delay``, ``alpha`` 0.5 and 4-bit pseudo-gradients.

    ``mode="async"`` (asynchronous, decoupled DiLoCo; :mod:`stratagem.parts.async_outer`):
    the global model lives on parameter-server shards (``ps_addresses``, else
    ``STRATAGEM_PS_ADDRS``; ``sg.launch(..., num_ps=1)`` / ``stratagem run --num-ps 1`` start
    them), every replica sends its pseudo-gradient every ``period`` inner steps in the
    background and keeps training, and the outer optimizer steps on the shards once a round
    holds ``min_contributions`` pseudo-gradients (default: replicas - 1, at least 1) or a
    waiting replica finds the round's ``grace_window`` (seconds since its first
    pseudo-gradient; None: only full rounds) over. Each pseudo-gradient is weighted by the
    inner steps it covers times ``1 / (1 + staleness)`` (``staleness="inverse"``; ``"none"``:
    no correction), staleness being the rounds closed since the model it was computed on. A
    replica moves onto the new global model when its round closes, keeping the steps taken
    meanwhile; it waits only when that round is still open at its next pseudo-gradient, or,
    with ``sync_delay=k`` (an int in ``[0, period)``), ``k`` inner steps after sending: 0
    waits for the round at once (no inner step on the old model; a round still needs only
    ``min_contributions``, so nobody waits for the slower replicas).
    ``compression``: None, "bf16", "fp16", "int8", "int4" (with error feedback), both ways:
    with ``compress_download`` (default) the global model comes back as the rounds' updates
    in the same kind (the shards keep error feedback of their own, and their model is
    exactly what the replicas rebuild), a replica more than a few rounds behind fetches the
    model; not ``fragments``, ``alpha`` or "topk". Each replica starts alone (a
    restarted one from the newest global model): failures are survived by restarting the
    dead replica (``max_restarts``), not by ``fault_tolerant=True``, which is refused.
    Checkpoints hold the global model and the outer optimizer's state under synchronous
    DiLoCo's names, so either mode restores the other's.

    On failure: a dead or stalled peer makes the outer all-reduce fail within ``timeout``
    seconds and ``optimizer.step()`` raises ``PeerTimeoutError`` naming it; resume from the
    last checkpoint. Memory: two extra copies of the parameters with the default outer optimizer
    (``theta_prev`` and the outer momentum; one when ``outer_momentum == 0``), plus a transient flat buffer the size of the
    fragment being synced.
    """

    name = "diloco"

    def __init__(self, *, period: int = 500, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 outer_optimizer: OuterOptimizerFactory | None = None, fragments: int = 1,
                 compression: str | None = None, pseudo_grad_dtype: str | None = None,
                 sync_delay: int | None = None, alpha: float = 0.0, mode: str = "sync",
                 min_contributions: int | None = None, grace_window: float | None = 30.0,
                 staleness: str = "inverse", ps_addresses: str | Sequence[str] | None = None,
                 compress_download: bool = True, **common: Any) -> None:
        check_choice("mode", mode, ("sync", "async"),
                     fix="pass mode='sync' (all-reduce every period) or mode='async' (the "
                         "global model on parameter-server shards, no replica waits)")
        self.mode = mode
        self.ps_addresses: list[str] = []
        if mode == "async":
            _check_async_arguments(fragments, compression, alpha, common)
            if min_contributions is not None:
                check_int("min_contributions", min_contributions, minimum=1,
                          fix="pass the pseudo-gradients a round needs, e.g. replicas - 1")
            check_optional_number("grace_window", grace_window, low=0.0, high=86400.0,
                                  fix="pass seconds, e.g. grace_window=30, or None for rounds "
                                      "that close only when full")
            check_choice("staleness", staleness, STALENESS_RULES,
                         fix="pass 'inverse' (weight 1 / (1 + staleness)) or 'none'")
            if not isinstance(compress_download, bool):
                raise TypeError(f"compress_download must be True or False, got "
                                f"{compress_download!r}")
            self.ps_addresses = shard_addresses(ps_addresses, who="DiLoCo(mode='async')")
        else:
            for key, value, default in (("min_contributions", min_contributions, None),
                                        ("grace_window", grace_window, 30.0),
                                        ("staleness", staleness, "inverse"),
                                        ("ps_addresses", ps_addresses, None),
                                        ("compress_download", compress_download, True)):
                if value != default:
                    raise ValueError(f"{key} only applies to mode='async', got {key}="
                                     f"{value!r} with mode='sync'. Fix: drop {key}, or pass "
                                     "mode='async'")
        self.min_contributions = min_contributions
        self.grace_window = None if grace_window is None else float(grace_window)
        self.staleness = staleness
        self.compress_download = compress_download
        self.period = check_int(
            "period", period, minimum=1,
            fix="pass the number of inner steps between outer steps, e.g. 500")
        self.fragments = check_int(
            "fragments", fragments, minimum=1,
            fix="pass 1 for plain DiLoCo, or k > 1 for streaming DiLoCo")
        if fragments > period:
            raise ValueError(f"fragments must be <= period so that fragments sync on distinct "
                             f"steps, got fragments={fragments} > period={period}. Fix: lower "
                             "fragments or raise period")
        check_number("outer_lr", outer_lr, low=0.0, low_open=True,
                     fix="pass e.g. outer_lr=0.7 (the DiLoCo paper's value)")
        check_number("outer_momentum", outer_momentum, low=0.0, high=1.0, high_open=True,
                     fix="pass e.g. outer_momentum=0.9, or 0 for plain outer SGD")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError(f"outer_optimizer must be a factory params -> torch.optim."
                            f"Optimizer, got {type(outer_optimizer).__name__}. Fix: pass e.g. "
                            "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, "
                            "momentum=0.9, nesterov=True)")
        if pseudo_grad_dtype is not None:
            if compression is not None and compression != pseudo_grad_dtype:
                raise ValueError(f"pass compression= only (pseudo_grad_dtype is its old name), "
                                 f"got compression={compression!r} and pseudo_grad_dtype="
                                 f"{pseudo_grad_dtype!r}. Fix: drop pseudo_grad_dtype")
            warnings.warn("DiLoCo(pseudo_grad_dtype=...) is deprecated: pass compression=... "
                          "(one keyword for every strategy's wire compression)",
                          DeprecationWarning, stacklevel=2)
            compression = pseudo_grad_dtype
        check_compression(compression, kinds=OUTER_KINDS)
        #: async: None = land when the round closes, by the next pseudo-gradient at the latest
        self.async_sync_delay: int | None = None
        if sync_delay is not None:
            check_int("sync_delay", sync_delay, minimum=0,
                      fix="pass 0 for synchronous outer steps, or a few inner steps to overlap")
        if mode == "async":
            if sync_delay is not None and sync_delay >= period:
                raise ValueError(f"sync_delay must be < period = {period} with mode='async' "
                                 f"(a pseudo-gradient lands before the next one is due), got "
                                 f"sync_delay={sync_delay}. Fix: lower sync_delay, or pass "
                                 "None (land whenever the round closes)")
            self.async_sync_delay = sync_delay
            sync_delay = 0
        elif sync_delay is None:
            sync_delay = 0
        self.sync_delay = sync_delay
        if sync_delay >= period // fragments:
            raise ValueError(f"sync_delay must be < period // fragments = {period // fragments} "
                             f"so that a fragment's outer all-reduce is applied before the next "
                             f"fragment's starts, got sync_delay={sync_delay} (period={period}, "
                             f"fragments={fragments}). Fix: lower sync_delay, or raise period")
        self.alpha = check_number("alpha", alpha, low=0.0, high=1.0, high_open=True,
                                  fix="pass 0 (take the outer parameters) or e.g. 0.5 (the "
                                      "Streaming DiLoCo paper's mix)")
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.outer_optimizer = outer_optimizer
        self.compression = compression
        super().__init__(**common)

    @property
    def pseudo_grad_dtype(self) -> str | None:
        """Deprecated name of :attr:`compression`."""
        return self.compression

    def default_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """SGD with ``outer_lr`` and Nesterov ``outer_momentum`` (plain SGD at 0)."""
        mu = self.outer_momentum
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=mu, nesterov=mu > 0)

    def plan(self) -> Plan:
        factory = self.outer_optimizer or self.default_outer_optimizer
        if self.mode == "async":
            return Plan(AsyncOuterStep.spec(
                period=self.period, outer_optimizer=factory, compression=self.compression,
                min_contributions=self.min_contributions, grace_window=self.grace_window,
                staleness=self.staleness, ps_addresses=self.ps_addresses,
                timeout=self.timeout, compress_download=self.compress_download,
                land_within=self.async_sync_delay))
        return Plan(OuterStep.spec(period=self.period, outer_optimizer=factory,
                                   fragments=self.fragments, compression=self.compression,
                                   sync_delay=self.sync_delay, alpha=self.alpha))


def _check_async_arguments(fragments: int, compression: str | None, alpha: float,
                           common: dict[str, Any]) -> None:
    """Refuse what asynchronous DiLoCo does not do, naming the fix."""
    for key, value, default in (("fragments", fragments, 1), ("alpha", alpha, 0.0)):
        if value != default:
            raise ValueError(f"DiLoCo(mode='async') sends whole-model pseudo-gradients, "
                             f"got {key}={value!r}. Fix: drop {key} (streaming DiLoCo is "
                             "mode='sync')")
    if compression not in ASYNC_KINDS:
        raise ValueError(f"DiLoCo(mode='async') takes compression in {list(ASYNC_KINDS)}, "
                         f"got {compression!r}. Fix: pass one of those ('topk' is "
                         "mode='sync' only)")
    if common.get("fault_tolerant"):
        raise ValueError("DiLoCo(mode='async') is fault tolerant by construction: a dead "
                         "replica costs only its own work and a restarted one starts from "
                         "the newest global model; got fault_tolerant=True, which needs "
                         "synchronous collectives. Fix: drop fault_tolerant and restart "
                         "failed replicas (stratagem run --max-restarts N, "
                         "sg.launch(max_restarts=N))")
