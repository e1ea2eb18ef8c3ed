"""The one process-wide context: backend, world and named groups, settings."""
from __future__ import annotations

import os
from typing import Any

from .errors import NotInitializedError, invalid

WORLD = "world"
# MindSpore's names of the world group, accepted everywhere a group name is.
WORLD_ALIASES = frozenset({WORLD, "nccl_world_group", "hccl_world_group", "mpi_world_group"})

DEFAULT_TIMEOUT = 600.0  # seconds; MPICOMM_TIMEOUT overrides, init(timeout=) wins


class Group:
    """A named set of world ranks with its own MPI communicator, transport and dispatcher."""

    __slots__ = ("name", "ranks", "rank", "size", "mpi_comm", "transport", "disp", "call",
                 "__weakref__")
    disp: Any
    call: Any

    def __init__(self, name, ranks, rank, mpi_comm, transport):
        self.name = name
        self.ranks = tuple(ranks)      # world rank of each group rank
        self.rank = rank               # this process's rank in the group
        self.size = len(ranks)
        self.mpi_comm = mpi_comm       # an mpicomm-owned MPI communicator (never the user's)
        self.transport = transport     # the backend's transport (None on ranks outside the group)
        self.disp = None               # its Dispatcher (mpicomm._dispatch)
        # what every collective of the group calls: disp.call, or disp.batch_call while an
        # mpicomm.batch() block is open (the group's one entry point, set by the mode)
        self.call = None

    def __repr__(self):
        return f"Group({self.name!r}, ranks={list(self.ranks)})"


class Context:
    """The settings and objects of the initialised library (reset by finalize). ``world``,
    ``backend`` and ``reliability`` are None before init and set by it: the calls that read
    them check ``initialized`` first."""

    initialized: bool
    init_key: Any                # init's arguments, compared by a repeated init
    backend_name: str | None
    backend: Any                 # the Backend
    world: Any                   # the world Group
    groups: dict[str, Group]
    local_comm: Any              # the MPI communicator of this host's ranks
    local_rank: int
    local_size: int
    local_world_ranks: tuple     # the world ranks on this host, by local rank
    timeout: float | None
    debug: bool
    check: bool
    abort_on_exception: bool
    device_id: int | None
    reliability: Any             # mpicomm._reliability.Reliability

    def __init__(self) -> None:
        self.finalized = False       # finalize() has run (kept by reset: for the message of a later call)
        self.reset()

    def reset(self) -> None:
        self.initialized = False
        self.init_key = None
        self.backend_name = None
        self.backend = None
        self.world = None            # Group
        self.groups = {}             # name -> Group
        self.local_comm = None
        self.local_rank = 0
        self.local_size = 1
        self.local_world_ranks = (0,)
        self.timeout = DEFAULT_TIMEOUT
        self.debug = False
        self.check = True
        self.abort_on_exception = True
        self.device_id = None
        self.reliability = None      # progress, watchdog, debug check (mpicomm._reliability)


CTX = Context()


def require_init(what="this call"):
    if not CTX.initialized:
        if CTX.finalized:
            raise NotInitializedError(f"{what} came after mpicomm.finalize(), which ended mpicomm's "
                                      "communication: call mpicomm.init() again first to go on")
        raise NotInitializedError(
            f"{what} needs mpicomm.init() first (call mpicomm.init() once at the start of the "
            "script, after launching it with mpirun)")
    return CTX


def get_group(group, what="a collective"):
    """The :class:`Group` named ``group`` (None or a world alias: the world)."""
    ctx = CTX
    if not ctx.initialized:
        require_init(what)
    if group is None:
        return ctx.world
    g = ctx.groups.get(group)
    if g is None:
        if group in WORLD_ALIASES:
            return ctx.world
        if not isinstance(group, str):
            raise invalid("group", group, "a group name (str) made by create_group, or None for the world")
        known = ", ".join(sorted(ctx.groups)) or "none"
        raise invalid("group", group, f"the world or a group made by create_group (groups on "
                      f"rank {ctx.world.rank}: {known})")
    if g.transport is None:
        raise invalid("group", group, f"a group this rank belongs to (world rank {ctx.world.rank} "
                      f"is not in {list(g.ranks)})")
    return g


_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")


def env_bool(name, default):
    """A yes/no environment variable: 1/on/true/yes or 0/off/false/no (any case), else an error."""
    v = os.environ.get(name, "").strip().lower()
    if v == "":
        return default
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise invalid(name, os.environ[name], "1, on, true or yes; 0, off, false or no")


def env_float(name, default):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        raise invalid(name, v, "a number of seconds") from None
