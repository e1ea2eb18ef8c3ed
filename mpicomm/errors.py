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


class InputsExhaustedError(MpicommError, RuntimeError):
    """Inside ``DistributedDataParallel.join(throw_on_early_termination=True)`` a rank ran
    out of inputs: raised on every rank of the group (torch DDP raises RuntimeError)."""


class RefusedElsewhereError(CollectiveMismatchError, InvalidArgumentError):
    """Another rank of the group refused the call for an invalid argument (the message names
    the rank and its reason); this rank did not complete it either."""


_LONGEST = 200   # characters of a value's repr shown in a message


class TypeOf:
    """A value shown by its type in a message (``<list>``), where the value itself says less."""

    def __init__(self, x: object) -> None:
        t = type(x)
        self.name = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"

    def __repr__(self) -> str:
        return f"<{self.name}>"


def shown(value: object) -> str:
    """``repr(value)``, its middle cut out where it is long (a data set passed as a size)."""
    r = repr(value)
    if len(r) <= _LONGEST:
        return r
    return f"{r[:_LONGEST // 2]} ... {r[-_LONGEST // 4:]} ({type(value).__name__} of repr length {len(r)})"


def invalid(name: str, value: object, allowed: str, rank: int | None = None) -> InvalidArgumentError:
    """Build an :class:`InvalidArgumentError` naming argument, value and what is allowed."""
    where = f" (rank {rank})" if rank is not None else ""
    return InvalidArgumentError(f"invalid {name}={shown(value)}{where}: expected {allowed}")
