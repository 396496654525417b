"""Scope stack, replica context and input context (the tf.distribute vocabulary).

The scope stack is thread-local so that tests can run several ranks as threads in one
process, each with its own strategy.

This module is a leaf of the package's import graph: every other module may read the scope,
so it imports none of them. The strategy used outside any scope (``OneDevice``) is supplied by
the registry, which knows the strategies, through :func:`set_default_strategy_factory`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["get_strategy", "get_replica_context", "has_strategy", "InputContext", "ReplicaContext",
           "enter_scope", "enter_replica", "set_default_strategy_factory"]

_local = threading.local()
_T = TypeVar("_T")
_default_factory: Callable[[], Strategy] | None = None


def set_default_strategy_factory(factory: Callable[[], Strategy] | None) -> None:
    """Set what builds the per-thread default strategy that ``get_strategy()`` returns outside
    any scope (the registry sets a single-process ``OneDevice``). Threads that already built
    their default keep it."""
    global _default_factory
    _default_factory = factory


def _thread_stack(name: str) -> list[Any]:
    """This thread's stack ``name`` (created empty on first use)."""
    stack: list[Any] | None = getattr(_local, name, None)
    if stack is None:
        stack = []
        setattr(_local, name, stack)
    return stack


@contextmanager
def _pushed(name: str, item: _T) -> Iterator[_T]:
    stack = _thread_stack(name)
    stack.append(item)
    try:
        yield item
    finally:
        popped = stack.pop()
        assert popped is item, f"{name} must be exited in reverse order"


def _stack() -> list[Strategy]:
    return _thread_stack("strategies")


def enter_scope(strategy: Strategy) -> contextlib.AbstractContextManager[Strategy]:
    """Make ``strategy`` the current one (``get_strategy()``) in this thread until exit. What
    ``strategy.scope()`` does; scopes nest and must be exited in reverse order."""
    return _pushed("strategies", strategy)


def has_strategy() -> bool:
    """True inside a ``strategy.scope()``."""
    return bool(_stack())


def get_strategy() -> Strategy:
    """The strategy of the innermost ``scope()``; outside any scope, a per-thread default
    ``OneDevice`` strategy (every collective is the identity)."""
    stack = _stack()
    if stack:
        return stack[-1]
    default = getattr(_local, "default", None)
    if default is None:
        if _default_factory is None:
            raise RuntimeError("no strategy scope is active and no default strategy is "
                               "registered. Fix: import stratagem (its registry supplies the "
                               "default), or call get_strategy() inside strategy.scope()")
        default = _default_factory()
        _local.default = default
    return default


class ReplicaContext:
    """What ``fn`` sees inside ``strategy.run(fn)``: its replica id and in-replica collectives."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._strategy.replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    def all_reduce(self, op: Any, value: Any) -> Any:
        """Reduce ``value`` (tensor, number or nested dict/list/tuple) across replicas."""
        return self._strategy.reduce(op, value)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate ``value`` across replicas along ``axis``."""
        return self._strategy.gather(value, axis=axis)


def enter_replica(ctx: ReplicaContext) -> contextlib.AbstractContextManager[ReplicaContext]:
    """Make ``ctx`` what ``get_replica_context()`` returns in this thread until exit (what
    ``strategy.run`` does)."""
    return _pushed("replicas", ctx)


def get_replica_context() -> ReplicaContext:
    """The replica context of the enclosing ``strategy.run``; outside ``run`` (the usual case
    in PyTorch, where every process is one replica) the current strategy's own replica."""
    stack: list[ReplicaContext] = _thread_stack("replicas")
    if stack:
        return stack[-1]
    return ReplicaContext(get_strategy())


@dataclass(frozen=True)
class InputContext:
    """Passed to the ``input_fn`` of ``distribute_datasets_from_function``."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``; raises ``ValueError`` when not divisible."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"num_replicas_in_sync={self.num_replicas_in_sync}; use a multiple of "
                f"{self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync
