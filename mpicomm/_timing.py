"""Every timing value of the reliability machinery, in one object: :data:`TIMING`.

Each field is a number of seconds that some part of mpicomm waits for (its comment says
which); none of them decides how a disagreement ends: the steps of that protocol wait for
each other's words, bounded only by the timeout (mpicomm._dispatch_checks). The timeout
itself (``init(timeout=...)``, MPICOMM_TIMEOUT) is not one of them. The modules read ``TIMING.field`` where they wait, never a copy taken at import, so a change to
the object takes effect at the next wait: tests set fields on it (``monkeypatch.setattr``),
and :func:`mpicomm.init` sets those that MPICOMM_TIMING names, for example
``MPICOMM_TIMING="refusal_wait=6,leave_wait=20"`` (docs/RELIABILITY.md, "Timing values").
A bad value is raised by init() on every rank (mpicomm._reliability, ``_from_env``).

This module imports nothing of mpicomm but its errors: the transports (mpicomm._backends)
read it too.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from .errors import InvalidArgumentError

ENV = "MPICOMM_TIMING"


@dataclass(slots=True)
class Timing:
    """Seconds; see the module docstring."""

    # --- the watchdog (mpicomm._reliability.watchdog)
    watch_every: float = 0.25    # between the watchdog's wakes (timeout / 10 where that is less)
    wait_check: float = 1.0      # a waiting call, before the watchdog compares every member's signature of it
    exit_check: float = 2.0      # a waiting call (blocking, or a Work's wait), before it looks whether a peer left its script
    refusal_wait: float = 3.0    # a call waiting on a refused peer (or a standstill), before the watchdog ends the job
    grace: float = 2.0           # between printing a report and aborting the job, so that the other ranks print theirs
    read_wait: float = 2.0       # a read of a peer's progress window, before the peer is called unknown
    dump_wait: float = 5.0       # the flight record's writing, before the report goes on without it
    stop_wait: float = 5.0       # finalize(), for the watchdog thread to end
    # --- the comparison of calls across hosts (mpicomm._reliability.cross_host)
    xhost_every: float = 0.25    # between two rounds of the comparison
    xhost_period: float = 1.0    # a difference across hosts, before it is told to the members
    xhost_describe: float = 15.0  # such a difference, at most, for the other host's description of its call
    xhost_give_up: float = 5.0   # a read of the other host's rows, before it is abandoned
    xhost_ahead: float = 0.5     # of calls at the teller's present pace (16 calls at least): how far ahead the
    #                              call lies after which every member raises a difference told across hosts
    untimed_wait: float = 6.0    # with the timeout off (no watchdog to publish a waiting member's description or
    #                              end the job): how long a rank that reports or refuses a disagreement waits for a
    #                              member's word (mpicomm._dispatch_checks; with a timeout, the timeout bounds it)
    spec_wait: float = 2.0       # the watchdog's report of a call that cannot complete, for the descriptions of
    #                              the members whose calls differ (a member not described in time: "another call")
    # --- leaving
    leave_wait: float = 12.0     # a rank leaving its script, for its peers to leave too (with a non-zero status:
    #                              then it ends the job itself); above exit_check + 2 * grace, so they can report it
    term_wait: float = 3.0       # init()'s helper that watches MPI's start, between SIGTERM and SIGKILL of the rank
    destroy_wait: float = 10.0   # finalize(), for ncclCommDestroy (NCCL waits for CUDA graphs that captured calls)
    close_wait: float = 5.0      # closing a group's tagged GPU send/recv, for sends MPI has not completed


TIMING = Timing()

# the field that must be above 0
_POSITIVE = frozenset({"watch_every"})


def names() -> list[str]:
    """The fields of :class:`Timing`, in order."""
    return [f.name for f in fields(Timing)]


def _allowed() -> str:
    return ("comma-separated field=seconds entries, each value a finite number of seconds >= 0 "
            "(watch_every > 0); the fields: " + ", ".join(names()))


def parse(text: str, rank: int | None = None) -> dict[str, float]:
    """The fields an MPICOMM_TIMING value ``text`` sets. Raises InvalidArgumentError naming
    the variable, its value, the bad entry, ``rank`` and what is allowed."""
    known = set(names())
    out: dict[str, float] = {}

    def bad(entry, why):
        where = f" (rank {rank})" if rank is not None else ""
        return InvalidArgumentError(f"invalid {ENV}={text!r}{where}: the entry {entry!r} {why}; expected "
                                    + _allowed())

    for entry in text.split(","):
        if not entry.strip():
            continue
        name, eq, value = entry.partition("=")
        name = name.strip()
        if not eq:
            raise bad(entry.strip(), "is not field=seconds")
        if name not in known:
            raise bad(entry.strip(), f"names no field ({name!r})")
        if name in out:
            raise bad(entry.strip(), f"sets {name} a second time")
        try:
            v = float(value)
        except ValueError:
            raise bad(entry.strip(), f"is no number of seconds ({value.strip()!r})") from None
        if not math.isfinite(v):
            raise bad(entry.strip(), f"is no finite number of seconds ({value.strip()!r})")
        if v < 0:
            raise bad(entry.strip(), f"is below 0 ({value.strip()!r})")
        if v == 0 and name in _POSITIVE:
            raise bad(entry.strip(), f"is 0 ({name} must be above 0: the watchdog would never pause)")
        out[name] = v
    return out


def from_env(rank: int | None = None) -> dict[str, float]:
    """The fields MPICOMM_TIMING sets (none where it is unset or empty); raises as :func:`parse`."""
    return parse(os.environ.get(ENV, ""), rank)


def apply_env() -> None:
    """Set the fields MPICOMM_TIMING names on :data:`TIMING` (the others keep their values).
    A bad value changes nothing here: init() raises it on every rank once the world exists."""
    try:
        values = from_env()
    except InvalidArgumentError:
        return
    for name, v in values.items():
        setattr(TIMING, name, v)


__all__ = ["ENV", "TIMING", "Timing", "apply_env", "from_env", "names", "parse"]
