"""Exceptions raised by stratagem.

Every error a user can hit names the constraint, the value received and the fix.
"""

from __future__ import annotations

__all__ = [
    "StratagemError",
    "ReplicaMismatchError",
    "WorkerError",
    "PeerTimeoutError",
    "ParameterServerUnavailable",
    "CheckpointError",
]


class StratagemError(Exception):
    """Base class of every stratagem error."""


class ReplicaMismatchError(StratagemError):
    """Replicas built different models (names, shapes or dtypes), or passed different
    structures to a collective."""


class WorkerError(StratagemError):
    """A launched worker raised or exited non-zero; names the rank and carries its traceback."""

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None,
                 traceback_text: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback_text = traceback_text


class PeerTimeoutError(StratagemError):
    """A peer was silent for longer than the strategy's ``timeout``; names the peer(s)."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class ParameterServerUnavailable(StratagemError):
    """A parameter-server shard did not answer within its deadline; names the address."""

    def __init__(self, message: str, *, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address


class CheckpointError(StratagemError):
    """A checkpoint is missing, corrupt, incomplete or holds something we refuse to load."""
