"""The exceptions mpicomm raises.

Every error mpicomm raises is a :class:`MpicommError`; the subclasses say which
kind of problem it is, and their messages name the argument, its value, what is
allowed, and the rank that raised.
"""
from __future__ import annotations


class MpicommError(Exception):
    """Base class of every error mpicomm raises."""


class NotInitializedError(MpicommError, RuntimeError):
    """A call that needs :func:`mpicomm.init` came before it (or after finalize)."""


class BackendUnavailableError(MpicommError, RuntimeError):
    """The requested backend cannot run here; the message says how to install it."""


class InvalidArgumentError(MpicommError, ValueError):
    """An argument is out of range, of the wrong type, shape or dtype."""


class CommunicationError(MpicommError, RuntimeError):
    """A collective failed; the message names the collective, the group and the rank."""


class CollectiveTimeoutError(CommunicationError, TimeoutError):
    """A collective did not complete within the timeout; names the missing ranks."""


class CollectiveMismatchError(CommunicationError):
    """Ranks called different collectives (or the same one with different arguments)."""


class RefusedElsewhereError(CollectiveMismatchError, InvalidArgumentError):
    """Another rank of the group refused the call for an invalid argument (the message names
    the rank and its reason); this rank did not complete it either."""


def invalid(name: str, value: object, allowed: str, rank: int | None = None) -> InvalidArgumentError:
    """Build an :class:`InvalidArgumentError` naming argument, value and what is allowed."""
    where = f" (rank {rank})" if rank is not None else ""
    return InvalidArgumentError(f"invalid {name}={value!r}{where}: expected {allowed}")
