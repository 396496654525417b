"""A strategy's arguments checked before any worker starts.

``stratagem run --strategy NAME --strategy-arg k=v`` and ``sg.launch`` with
``STRATAGEM_STRATEGY`` in the workers' environment used to start every worker, each of which
then died on the same ``TypeError: ... got an unexpected keyword argument 'perod'`` inside
torchrun's noise. Here the arguments are checked once, in the launching process:

- the names (``sg.from_name`` checks them, :mod:`stratagem._argnames`): every key must be an
  argument of the strategy; an unknown one is a ``TypeError`` naming it, the nearest valid
  name (difflib) and the strategy's arguments, in one line.
- :func:`check_strategy`: the strategy is built once from the arguments, as each worker
  will build it, so a bad value or type raises the constructor's own ``ValueError`` /
  ``TypeError``. It is built over a :class:`ConfigComm` — a world size and nothing else — so
  no process group is created, no store contacted and no shard connected (strategies join
  their ``Comm`` lazily and connect to shards when a model is prepared); parameter-server
  shards that the launcher will start are stood in for by placeholder addresses.

The command line turns the exception into one line and exits 2 (:func:`cli_problem`);
``sg.launch`` raises it in the caller (:func:`check_launch_env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._argnames import cli_line, one_line
from .comm import Comm

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["check_strategy", "check_launch_env", "cli_problem", "ConfigComm", "one_line"]

#: Placeholder shard address while checking: nothing ever connects to it.
_PLACEHOLDER_SHARD = "127.0.0.1:1"


class ConfigComm(Comm):
    """A ``Comm`` that states a world size and nothing else, to build a strategy as
    configuration: no process group, no store, no heartbeat. Never run a collective on it
    (it has no group; one would act as a world of one)."""

    def __init__(self, world_size: int, local_world_size: int | None = None) -> None:
        super().__init__(None, 0, 1, heartbeat=False)
        self.world_size = world_size
        self.local_world_size = world_size if local_world_size is None else local_world_size


@contextlib.contextmanager
def _shard_placeholders(count: int) -> Iterator[None]:
    """``STRATAGEM_PS_ADDRS`` as the launcher will set it, while a strategy is built here
    before its shards exist (set only when it is not set already)."""
    if count <= 0 or os.environ.get("STRATAGEM_PS_ADDRS"):
        yield
        return
    os.environ["STRATAGEM_PS_ADDRS"] = ",".join([_PLACEHOLDER_SHARD] * count)
    try:
        yield
    finally:
        os.environ.pop("STRATAGEM_PS_ADDRS", None)


def check_strategy(name: str, kwargs: Mapping[str, Any], *, world_size: int,
                   local_world_size: int | None = None, num_ps: int = 0) -> None:
    """Build strategy ``name`` from ``kwargs`` as each of ``world_size`` workers will, without
    joining anything; raises what the workers would raise (``ValueError`` for an unknown name
    or a bad value, ``TypeError`` for an unknown key or a wrong type). ``num_ps``: shards the
    launcher will start (their addresses do not exist yet)."""
    from .registry import from_name

    if "comm" in kwargs:
        raise TypeError(f"comm= cannot come from the command line or the environment (got "
                        f"{kwargs['comm']!r}); each worker joins the job's process group "
                        "itself. Fix: drop it")
    lws = local_world_size if local_world_size and world_size % local_world_size == 0 \
        else world_size
    strategy: Strategy | None = None
    with _shard_placeholders(num_ps), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the workers warn, once each, where it matters
        try:
            strategy = from_name(name, **kwargs, comm=ConfigComm(world_size, lws))
        finally:
            if strategy is not None:
                with contextlib.suppress(Exception):
                    strategy.close()


def cli_problem(name: str, kwargs: Mapping[str, Any], *, world_size: int,
                local_world_size: int | None = None, num_ps: int = 0) -> str | None:
    """:func:`check_strategy` for ``stratagem run``: None, or the one-line problem. (The
    names were checked before, without torch: :func:`stratagem.registry.cli_name_problem`.)"""
    try:
        check_strategy(name, kwargs, world_size=world_size, local_world_size=local_world_size,
                       num_ps=num_ps)
    except (TypeError, ValueError) as e:
        return cli_line(kwargs, e)
    return None


def check_launch_env(env: Mapping[str, str], *, world_size: int,
                     local_world_size: int | None = None, num_ps: int = 0) -> None:
    """For ``sg.launch``: when ``env`` (the workers' environment) names a strategy in
    ``STRATAGEM_STRATEGY`` (arguments: JSON in ``STRATAGEM_STRATEGY_ARGS``), check it as
    :func:`check_strategy` does, raising in the caller before any worker starts."""
    name = env.get("STRATAGEM_STRATEGY")
    if not name:
        return
    raw = env.get("STRATAGEM_STRATEGY_ARGS", "{}")
    try:
        kwargs = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"STRATAGEM_STRATEGY_ARGS must be a JSON object, got {raw!r}") from exc
    if not isinstance(kwargs, dict):
        raise ValueError(f"STRATAGEM_STRATEGY_ARGS must be a JSON object, got {raw!r}")
    check_strategy(name, kwargs, world_size=world_size, local_world_size=local_world_size,
                   num_ps=num_ps)
