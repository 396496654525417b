"""Elastic averaging SGD (EASGD) and elastic averaging momentum SGD (EAMSGD).

Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD", NeurIPS 2015
(arXiv:1412.6651). Every worker trains its own copy ``x_i`` of the model; a *center*
variable ``x~`` is linked to the workers by an elastic force. Every ``period`` local steps
each worker exchanges with the center::

    d_i = x_i - x~;    x_i -= moving_rate * d_i;    x~ += moving_rate * d_i

(the paper's Algorithm 1 with ``alpha = moving_rate`` and ``tau = period``). In ``"sync"`` mode
the center is replicated on every worker and all exchanges of a round are applied together
(``x~ += moving_rate * sum_i d_i``, one all-reduce of the ``d_i``); in ``"async"`` mode it lives
on parameter-server shards and each exchange is applied there atomically (per shard) as it
arrives, so workers never wait for each other. ``momentum > 0`` gives EAMSGD (Algorithm 2:
Nesterov momentum on the local update); ``rho > 0`` gives the penalty form of the paper's
Eq. 5-6, in which the elastic force on a worker is added to its gradient.

The consensus model, and the one checkpointed and evaluated, is the center.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..parts import ElasticAveragingPart, ElasticExchange, Plan
from ..parts.elastic import default_moving_rate
from ..ps.addresses import shard_addresses
from ..strategy import Strategy
from ..validation import check_bool, check_choice, check_int, check_number, check_optional_number

__all__ = ["ElasticAveraging"]

_MODES = ("sync", "async")


class ElasticAveraging(Strategy):
    """EASGD / EAMSGD (Zhang, Choromanska, LeCun 2015): local models pulled towards a center.

    Arguments:

    - ``period`` (int >= 1): local steps between two elastic exchanges.
    - ``moving_rate`` (in (0, 1]): the elastic rate ``alpha``; default
      ``beta / (period * num_workers)`` (the paper's ``beta = p * alpha`` per round, spread over
      ``period``). ``num_workers`` is the size of this job's process group: workers launched
      without a shared group (async, one process each) should pass ``moving_rate``.
    - ``beta`` (> 0): see ``moving_rate``.
    - ``rho`` (>= 0): with ``rho > 0`` the elastic force on the worker is applied through its
      gradient: before every local step ``rho * (x - center_copy)`` is added to the gradient of
      every parameter the optimizer steps, ``center_copy`` being the center as last seen by this
      worker (exact in sync mode). The exchange then happens *before* the local step, measures
      ``d`` at the point where the gradient was taken, and moves only the center (and the
      buffers, which have no gradient): the worker is not pulled twice. This is the paper's
      Eq. 5-6; with ``period=1`` and ``rho = moving_rate / lr`` it is exactly the update whose
      stability region the paper derives.
    - ``momentum`` (in [0, 1)): EAMSGD. The optimizer given to ``prepare`` computes the local
      update ``u`` (``-lr * g`` for plain SGD); around it the strategy keeps a buffer
      ``m = momentum * m + u`` and moves the parameters by ``u + momentum * m``: with plain SGD
      (no momentum of its own) this is exactly ``torch.optim.SGD(nesterov=True)``, i.e. the
      paper's Nesterov local update. With another optimizer (Adam, SGD with momentum...) the
      same Nesterov momentum is applied to that optimizer's update; parameters without a
      gradient in a step are not moved.
    - ``mode``: ``"sync"`` (center replicated, one all-reduce per round) or ``"async"`` (center
      on parameter-server shards found in ``ps_addresses``, else ``STRATAGEM_PS_ADDRS``).
    - ``average_buffers``: floating-point buffers (BatchNorm statistics) follow the same elastic
      exchange as the parameters; with False each worker keeps its own and the center module
      uses this worker's.
    - ``wait_for_all`` (async): wait for every worker of the process group before the first
      step (a start barrier). By default workers never wait for each other.
    - ``ps_addresses`` (async): ``"host:port,host:port"`` or a list of them.

    Any ``torch.optim`` optimizer works; its state stays local to each worker (saved per rank).
    A worker that starts or restarts in async mode registers the model on the shards (the
    first registration wins) and starts from the current center, so it rejoins without
    blocking anyone. Note: ``prepare`` itself (the core) checks and broadcasts the model over
    the process group, so workers sharing a group still meet once there.

    The center is what ``eval_model`` returns (a module sharing the center's storage in sync
    mode; refreshed from the shards at each call in async mode) and what ``save`` writes as
    ``model.safetensors``; every worker's local model (and EAMSGD buffer) goes in the strategy
    state, so resuming with the same workers is exact. ``restore`` sets the center and every
    local model to the saved model (async: the chief writes the center to the shards).

    On failure: sync mode, a dead or stalled peer makes the exchange all-reduce fail within
    ``timeout`` seconds and ``optimizer.step()`` raises ``PeerTimeoutError`` naming it (resume
    from the last checkpoint). Async mode, an unreachable shard raises
    ``ParameterServerUnavailable`` naming its address within ``timeout``; other workers are not
    affected by a worker dying, and a restarted worker rejoins from the center.

    Memory (copies of the parameters per worker): sync, one (the center) plus one transient
    flat buffer during an exchange; async, none (one for ``center_copy`` when ``rho > 0``, one
    for the center module once ``eval_model`` is called); EAMSGD adds one (the momentum) and a
    transient one during each step.
    """

    name = "easgd"

    def __init__(self, *, period: int = 10, moving_rate: float | None = None, beta: float = 0.9,
                 rho: float = 0.0, momentum: float = 0.0, mode: str = "sync",
                 average_buffers: bool = True, wait_for_all: bool = False,
                 ps_addresses: str | Sequence[str] | None = None, **common: Any) -> None:
        self.period = check_int("period", period, minimum=1,
                                fix="pass the number of local steps between elastic exchanges, "
                                    "e.g. period=10")
        check_optional_number("moving_rate", moving_rate, low=0.0, high=1.0, low_open=True,
                              fix="pass e.g. moving_rate=0.05, or omit it for "
                                  "beta / (period * num_workers)")
        check_number("beta", beta, low=0.0, low_open=True,
                     fix="pass e.g. beta=0.9 (the paper's value)")
        check_number("rho", rho, low=0.0,
                     fix="pass 0 (no elastic penalty in the gradient) or e.g. "
                         "rho=moving_rate / lr")
        check_number("momentum", momentum, low=0.0, high=1.0, high_open=True,
                     fix="pass 0 (EASGD) or e.g. momentum=0.9 (EAMSGD)")
        check_choice("mode", mode, _MODES,
                     fix="pass mode='sync' (center replicated) or mode='async' (center on "
                         "parameter-server shards)")
        check_bool("average_buffers", average_buffers)
        check_bool("wait_for_all", wait_for_all)
        addresses: list[str] = []
        if mode == "async":
            addresses = shard_addresses(ps_addresses, who="ElasticAveraging(mode='async')")
        elif ps_addresses is not None:
            raise ValueError(f"ps_addresses only applies to mode='async', got ps_addresses="
                             f"{ps_addresses!r} with mode={mode!r}. Fix: drop ps_addresses or "
                             "pass mode='async'")
        self.period, self.beta, self.rho, self.momentum = period, float(beta), float(rho), \
            float(momentum)
        self.mode = mode
        self.average_buffers = average_buffers
        self.wait_for_all = wait_for_all
        self.ps_addresses = addresses
        self.given_moving_rate = None if moving_rate is None else float(moving_rate)
        if common.get("comm") is not None and moving_rate is None:
            comm = common["comm"]  # an explicit comm: check the default rate now
            default_moving_rate(self.beta, period, comm.num_slots if comm.fault_tolerant
                                else comm.world_size * comm.replica_group_size)
        super().__init__(**common)

    def plan(self) -> Plan:
        """One :class:`~stratagem.parts.ElasticAveragingPart`: the exchange (sync or async),
        EAMSGD's momentum and the penalty form act inside the step."""
        return Plan(ElasticAveragingPart.spec(
            period=self.period, moving_rate=self.given_moving_rate, beta=self.beta, rho=self.rho,
            momentum=self.momentum, mode=self.mode, average_buffers=self.average_buffers,
            wait_for_all=self.wait_for_all, ps_addresses=self.ps_addresses,
            timeout=self.timeout))

    def layer_plan(self) -> Plan:
        """As ``Hierarchical``'s outer strategy: the synchronous elastic exchange among nodes
        (only the plain form: the penalty form and EAMSGD change the local update, which the
        inner strategy owns)."""
        if self.mode != "sync" or self.rho > 0 or self.momentum > 0:
            raise ValueError(
                f"as an outer strategy, ElasticAveraging must be mode='sync', rho=0, "
                f"momentum=0, got mode={self.mode!r}, rho={self.rho}, momentum="
                f"{self.momentum}. Fix: ElasticAveraging(mode='sync') without rho/momentum")
        return Plan(ElasticExchange.spec(period=self.period, moving_rate=self.given_moving_rate,
                                         beta=self.beta, average_buffers=self.average_buffers))

    @property
    def moving_rate(self) -> float:
        """The elastic rate ``alpha``: as given, else ``beta / (period * num_workers)``
        (computed on first use, when the number of workers is known)."""
        part = self.parts[0]
        assert isinstance(part, ElasticAveragingPart)
        return part.moving_rate
