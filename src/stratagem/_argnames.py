"""A strategy's keyword arguments by name: which ones a class accepts, and a one-line
``TypeError`` for one it does not, with the nearest valid name (issue 23; ``sg.from_name``
runs :func:`check_names`, and so does ``stratagem run`` before starting any worker, through
:mod:`stratagem._argcheck`). Reads signatures only: nothing is built."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["accepted_arguments", "check_names"]


def accepted_arguments(cls: type[Any]) -> list[str]:
    """The keyword arguments ``cls(...)`` accepts, its own first: the parameters of each
    ``__init__`` up the class hierarchy while the one below passes ``**kwargs`` on."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]  # without self
        for p in params:
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in names:
                names.append(p.name)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _default_of(cls: type[Any], name: str) -> Any:
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and name in inspect.signature(init).parameters:
            return inspect.signature(init).parameters[name].default
    return None


def _unknown(label: str, key: str, valid: list[str]) -> TypeError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "."
    return TypeError(f"{label} has no argument {key!r}{hint} Valid arguments: "
                     f"{', '.join(valid)}")


def check_names(name: str, cls: type[Any], kwargs: Mapping[str, Any], *,
                resolve: Callable[[str], tuple[str, type[Any]]]) -> None:
    """``TypeError`` (one line) for the first key of ``kwargs`` that ``cls`` does not accept,
    naming it, the nearest valid name and every valid one. A class that routes prefixed keys
    to strategies it builds by name (``Hierarchical``'s ``outer_period=``) declares the
    prefixes in ``_argument_prefixes``; those keys are checked against that strategy, found
    with ``resolve(name) -> (registry name, class)``."""
    label = f"{cls.__name__} ({name})" if name != cls.__name__ else cls.__name__
    valid = accepted_arguments(cls)
    prefixes: tuple[str, ...] = tuple(getattr(cls, "_argument_prefixes", ()))
    for key in kwargs:
        if key in valid:
            continue
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            raise _unknown(label, key, valid)
        role = prefix[:-1]
        spec = kwargs.get(role, _default_of(cls, role))
        if not isinstance(spec, str):
            continue  # an instance: the class refuses prefixed arguments itself
        sub_name, sub = resolve(spec)
        sub_valid = accepted_arguments(sub)
        if key[len(prefix):] not in sub_valid:
            routed = [prefix + k for k in sub_valid]
            raise _unknown(f"{label} with {role}={sub_name!r}", key, routed)
