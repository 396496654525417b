"""Argument checks shared by every public constructor and function.

House rule: an error names the constraint, the value received and the fix. The same checks
(an int at least 1, a number in a range, one of a few strings) were written out by hand in
many modules, each with a slightly different wording and some with gaps (``True`` accepted
as the int 1, NaN passing a ``value < 0`` test). These helpers are the one version:

- ``bool`` is never accepted as an int or a number (``isinstance(True, int)`` is true in
  Python, and ``accumulation_steps=True`` is always a mistake);
- NaN is rejected by every range check (the comparisons are written so that NaN fails);
- the message reads ``"<name> must be <constraint>, got <value!r>. Fix: <fix>"``.

Each helper returns the value (``check_number`` as a ``float``), so that a constructor can
write ``self.period = check_int("period", period, minimum=1, fix="pass e.g. period=10")``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["check_int", "check_number", "check_optional_number", "check_choice", "check_bool",
           "describe_choices", "int_argument", "check_timeout", "MIN_TIMEOUT", "MAX_TIMEOUT"]

_T = TypeVar("_T")


def _fail(name: str, constraint: str, value: Any, fix: str | None) -> ValueError:
    message = f"{name} must be {constraint}, got {value!r}"
    if fix:
        message += f". Fix: {fix}"
    return ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              fix: str | None = None) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) within ``[minimum, maximum]`` (either
    bound may be omitted); ``ValueError`` otherwise, e.g. ``"period must be an int >= 1, got
    0. Fix: pass e.g. period=10"``."""
    if minimum is not None and maximum is not None:
        constraint = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        constraint = f"an int >= {minimum}"
    elif maximum is not None:
        constraint = f"an int <= {maximum}"
    else:
        constraint = "an int"
    if not _is_int(value) or (minimum is not None and value < minimum) \
            or (maximum is not None and value > maximum):
        raise _fail(name, constraint, value, fix)
    return int(value)


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, finite: bool = False,
                 fix: str | None = None) -> float:
    """``float(value)`` if ``value`` is an int or float (not a ``bool``, not NaN) in the
    interval from ``low`` to ``high`` (``*_open`` excludes the bound; an omitted bound is
    unbounded, so ``inf`` passes unless ``finite=True``); ``ValueError`` otherwise, e.g.
    ``"moving_rate must be a number in (0, 1], got 2"``."""
    return _check_number(name, value, low, high, low_open, high_open, finite, False, fix)


def check_optional_number(name: str, value: Any, *, low: float | None = None,
                          high: float | None = None, low_open: bool = False,
                          high_open: bool = False, finite: bool = False,
                          fix: str | None = None) -> float | None:
    """:func:`check_number` that also accepts ``None`` (returned as is): ``"clip_grad_norm
    must be None or a finite number > 0, got -1"``."""
    if value is None:
        return None
    return _check_number(name, value, low, high, low_open, high_open, finite, True, fix)


def _check_number(name: str, value: Any, low: float | None, high: float | None, low_open: bool,
                  high_open: bool, finite: bool, optional: bool, fix: str | None) -> float:
    kind = "a finite number" if finite else "a number"
    constraint = f"{kind} {_interval(low, high, low_open, high_open)}".rstrip()
    if optional:
        constraint = f"None or {constraint}"
    try:
        ok = _is_number(value) and not math.isnan(value)
        if ok and finite:
            ok = math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
    except OverflowError:  # an int beyond float range (a hostile JSON field, say)
        ok = False
    if not ok:
        raise _fail(name, constraint, value, fix)
    return float(value)


def describe_choices(choices: Iterable[Any]) -> str:
    """``'a', 'b' or 'c'`` (reprs, in the given order)."""
    items = [repr(c) for c in choices]
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} or {items[-1]}"


def check_choice(name: str, value: _T, choices: Iterable[Any], *, fix: str | None = None) -> _T:
    """``value`` if it is one of ``choices``; ``ValueError`` otherwise, e.g. ``"mode must be
    'sync' or 'async', got 'fast'"``. Unhashable values are refused, not raised as
    ``TypeError``."""
    options = list(choices)
    try:
        found = value in options
    except TypeError:
        found = False
    if not found:
        raise _fail(name, describe_choices(options), value, fix)
    return value


def check_bool(name: str, value: Any, *, fix: str | None = None) -> bool:
    """``value`` if it is ``True`` or ``False`` (not a truthy int or string: ``"false"`` is
    truthy); ``ValueError`` otherwise."""
    if not isinstance(value, bool):
        raise _fail(name, "True or False", value, fix)
    return value


def int_argument(*, minimum: int | None = None, maximum: int | None = None,
                 fix: str | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer flag checked like :func:`check_int`: argparse
    reports ``argument --nproc: must be >= 1, got 0. Fix: ...`` and exits with status 2."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        try:
            return check_int("", value, minimum=minimum, maximum=maximum, fix=fix)
        except ValueError as exc:
            # check_int says "<name> must be an int ...": the flag is argparse's to name, and
            # the value is an int already.
            raise argparse.ArgumentTypeError(
                str(exc).lstrip().replace("must be an int ", "must be ", 1)) from None

    parse.__name__ = "int"  # argparse names the type in "invalid int value" messages
    return parse


#: Bounds of every ``timeout`` (seconds): below a millisecond nothing can answer in time;
#: above ~11.6 days a deadline is no deadline (and ``inf`` overflows the clocks it is added to).
MIN_TIMEOUT = 1e-3
MAX_TIMEOUT = 1e6


def check_timeout(name: str, value: Any, *, fix: str | None = None) -> float:
    """``float(value)`` if it is a number of seconds in [:data:`MIN_TIMEOUT`,
    :data:`MAX_TIMEOUT`] (so never ``inf``, NaN, 0, negative or ``1e-300``); ``ValueError``
    otherwise."""
    return check_number(name, value, low=MIN_TIMEOUT, high=MAX_TIMEOUT, finite=True,
                        fix=fix or f"pass the seconds to wait, e.g. {name}=60")
