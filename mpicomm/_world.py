"""init/finalize, ranks and sizes, and named groups (MindSpore's signatures)."""
from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from . import _state, _timing
from ._backends import get_backend_class, names as backend_names
from ._backends.base import Work, complete_dropped, complete_pending
from ._dispatch import Dispatcher
from ._mpi import load as load_mpi
from ._ops import CREATE_GROUP, DESTROY_GROUP
from ._reliability import Reliability
from ._reliability.progress import ghash
from ._reliability.init_guard import InitGuard, StartGuard
from ._state import CTX, WORLD, WORLD_ALIASES, Context, Group, env_bool, env_float, get_group, require_init
from ._topology import CUPY_INSTALL, gpu_count, gpu_seen, local_comm, no_nccl_reason, shared_gpus
from .errors import BackendUnavailableError, InvalidArgumentError, invalid


def _pick_backend(backend: Any) -> str:
    if backend is None:
        env = os.environ.get("MPICOMM_BACKEND", "").strip()
        if env and env.lower() not in backend_names():
            raise invalid("MPICOMM_BACKEND", env, "one of " + ", ".join(repr(n) for n in backend_names())
                          + ", or unset (NCCL where CuPy sees a GPU, else MPI)")
        backend = env or None
    if backend is None:
        return "nccl" if gpu_count() > 0 else "mpi"
    if not isinstance(backend, str) or backend.lower() not in backend_names():
        if isinstance(backend, str) and backend.lower() == "mccl":   # MindSpore's CPU collectives
            raise invalid("backend", backend, "one of " + ", ".join(repr(n) for n in backend_names())
                          + " or None; MCCL is MindSpore's CPU collective library: mpicomm runs on CPUs "
                          "with 'mpi' (and on NVIDIA GPUs with 'nccl')")
        get_backend_class(backend)  # raises, listing the names (and what to use for "hccl")
    return backend.lower()


def init(backend: str | None = None, *, timeout: float | None = None, debug: bool | None = None,
         abort_on_exception: bool = True, check: bool | None = None, backend_name: str | None = None) -> None:
    """Initialise mpicomm: MPI, the world group and the backend.

    backend: "mpi", "nccl" or None (NCCL where CuPy sees a GPU, else MPI; the
        environment variable MPICOMM_BACKEND overrides None).
    timeout: seconds a collective may take before CollectiveTimeoutError (default
        MPICOMM_TIMEOUT, else 600); 0 disables the watchdog.
    debug: compare every collective's arguments across ranks first (MPICOMM_DEBUG=1).
    abort_on_exception: an uncaught exception on any rank aborts the whole job.
    check: the agreement check of every call's signature across ranks (default
        MPICOMM_CHECK, else on; docs/RELIABILITY.md says what it catches, what it costs
        and its limits).

    backend_name: MindSpore's keyword for ``backend`` (``init(backend_name="nccl")``): the
        same names, and the same refusal of "hccl" (Ascend) and "mccl" saying what to use.

    MPICOMM_TIMING sets the other waits of the reliability machinery (``field=seconds``
    entries separated by commas; docs/RELIABILITY.md, "Timing values"); a bad entry raises
    InvalidArgumentError on every rank.

    Under NCCL, selects GPU ``local_rank % device_count`` before creating the
    communicator. Calling init again with the same arguments does nothing; with
    different ones it raises InvalidArgumentError. Raises BackendUnavailableError
    when the backend cannot run here (on every rank alike).
    """
    if timeout is None:
        timeout = env_float("MPICOMM_TIMEOUT", _state.DEFAULT_TIMEOUT)
        if not timeout >= 0:   # (also NaN)
            raise invalid("MPICOMM_TIMEOUT", os.environ["MPICOMM_TIMEOUT"],
                          "a number of seconds >= 0 (0 disables the timeout)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0 or timeout != timeout:
        raise invalid("timeout", timeout, "a number of seconds >= 0 (0 disables the timeout)")
    if debug is None:
        debug = env_bool("MPICOMM_DEBUG", False)
    if check is None:
        check = env_bool("MPICOMM_CHECK", True)
    if not isinstance(check, bool):
        raise invalid("check", check, "True or False")
    if backend_name is not None:
        if backend is not None and backend != backend_name:
            raise invalid("backend_name", backend_name, f"the same as backend={backend!r}, or only one of the "
                          "two (backend_name is MindSpore's name for backend)")
        try:
            name = _pick_backend(backend_name)
        except InvalidArgumentError as e:   # named as the caller wrote it
            raise InvalidArgumentError(str(e).replace("invalid backend=", "invalid backend_name=", 1)) from None
    else:
        name = _pick_backend(backend)
    key = (name, float(timeout), bool(debug), bool(abort_on_exception), check)
    if CTX.initialized:
        if key == CTX.init_key:
            return
        names = ("backend", "timeout", "debug", "abort_on_exception", "check")
        raise invalid("init arguments", dict(zip(names, key)),
                      "the same arguments as the first call "
                      f"{dict(zip(names, CTX.init_key))} "
                      "(call finalize() first to change them)")
    _timing.apply_env()   # (a bad value is raised on every rank once the world exists)
    # MPI's start waits for every rank of the job, holding the GIL: watched from a helper
    # process (where mpi4py has started MPI already, at the program's own import, nothing is left to watch)
    mod = sys.modules.get("mpi4py.MPI")
    start = StartGuard(float(timeout)) if mod is None or not mod.Is_initialized() else None
    try:
        MPI = load_mpi()  # here, not at import: importing mpicomm must not start MPI
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
    finally:
        if start is not None:
            start.done()
    guard = InitGuard(float(timeout), MPI.COMM_WORLD.Get_rank())   # until the watchdog takes over
    auto = backend is None and backend_name is None and not os.environ.get("MPICOMM_BACKEND", "").strip()
    try:
        _init(MPI, name, timeout, debug, abort_on_exception, key, guard, check, auto)
    finally:
        guard.done()
    if name == "mpi" and backend is None and backend_name is None and CTX.local_rank == 0 \
            and not os.environ.get("MPICOMM_BACKEND", "").strip():
        _say_gpu_without_nccl()


def _say_gpu_without_nccl() -> None:
    """Each host's first rank, where the MPI backend was chosen for want of CuPy although
    the host has a GPU: say so once, with the install line (GPU arrays then go through host
    memory, an order of magnitude slower than NCCL)."""
    why = gpu_seen()
    if why is None:
        return
    import warnings

    warnings.warn(f"mpicomm: this host has a GPU ({why}) but {no_nccl_reason()}, so init() chose the MPI "
                  "backend: GPU arrays go through host memory, an order of magnitude slower than NCCL. "
                  f"For NCCL: {CUPY_INSTALL}. To keep MPI and not see this: init('mpi') or MPICOMM_BACKEND=mpi",
                  UserWarning, stacklevel=3)


def _init(MPI: Any, name: str, timeout: float, debug: bool, abort_on_exception: bool, key: tuple,
          guard: InitGuard, check: bool = True, auto: bool = False) -> None:
    world = MPI.COMM_WORLD.Dup()  # the library owns its communicator
    lcomm = local_comm(world)
    CTX.local_comm = lcomm
    CTX.local_rank = lcomm.Get_rank()
    CTX.local_size = lcomm.Get_size()
    lg, wg = lcomm.Get_group(), world.Get_group()
    CTX.local_world_ranks = tuple(MPI.Group.Translate_ranks(lg, list(range(CTX.local_size)), wg))
    lg.Free()
    wg.Free()
    CTX.timeout = float(timeout)
    CTX.debug = bool(debug)
    CTX.check = bool(check)
    CTX.abort_on_exception = bool(abort_on_exception)
    # every rank must pick the same backend, or the first collective would hang
    guard.set("agree")
    picks = world.allgather(name)
    if len(set(picks)) > 1:
        world.Free()
        lcomm.Free()
        raise InvalidArgumentError(
            "ranks chose different backends: " + ", ".join(f"rank {r}: {p}" for r, p in enumerate(picks))
            + "; set MPICOMM_BACKEND (or pass backend=) alike on every rank")
    err = None
    guard.set("backend")
    try:
        backend_obj = get_backend_class(name)(CTX.local_rank)
    except BackendUnavailableError as e:
        err = e
    guard.set("agree")
    errs = world.allgather(None if err is None else str(err))
    if any(errs):
        world.Free()
        lcomm.Free()
        if err is not None:
            raise err
        bad = [r for r, e in enumerate(errs) if e]
        raise BackendUnavailableError(f"backend {name!r} is unavailable on rank(s) {bad}: "
                                      f"{next(e for e in errs if e)}")
    if name == "nccl":   # NCCL refuses two ranks on one GPU: said here, on every rank alike
        guard.set("agree")
        whys = world.allgather(shared_gpus(lcomm, backend_obj.device_id, CTX.local_world_ranks))
        why = next((w for w in whys if w), None)
        if why is not None and not auto:
            world.Free()
            lcomm.Free()
            raise BackendUnavailableError(
                f"backend 'nccl' cannot run these ranks: {why}. Start at most one rank per GPU on each host "
                "(mpirun -n, or --map-by ppr:<GPUs>:node), give each rank its own GPU (CUDA_VISIBLE_DEVICES), "
                "or use the MPI backend: init('mpi') or MPICOMM_BACKEND=mpi")
        if why is not None:   # chosen by init() itself: MPI, said once per host
            name, backend_obj = "mpi", get_backend_class("mpi")(CTX.local_rank)
            if CTX.local_rank == 0:
                import warnings

                warnings.warn(f"mpicomm: {why}, so init() chose the MPI backend: GPU arrays go through host "
                              "memory. For NCCL start at most one rank per GPU on each host; to keep MPI and "
                              "not see this: init('mpi') or MPICOMM_BACKEND=mpi", UserWarning, stacklevel=3)
    CTX.backend_name = name
    CTX.backend = backend_obj
    CTX.device_id = backend_obj.device_id
    guard.set("transport")
    CTX.world = Group(WORLD, range(world.Get_size()), world.Get_rank(), world, backend_obj.make_transport(world))
    CTX.groups = {}
    guard.set("window")
    CTX.reliability = Reliability(CTX)
    _attach(CTX, CTX.world)
    Work.default_timeout = CTX.timeout or None
    CTX.init_key = key
    CTX.initialized = True
    CTX.reliability.start()
    _export_rank_variables(world.Get_rank(), world.Get_size(), CTX.local_rank, CTX.local_size)


# the rank variables other frameworks' launchers set, which their own classes read (Paddle's
# DistributedBatchSampler reads PADDLE_TRAINER_ID at construction: unset, every rank takes the
# whole data set). mpirun sets none of them (docs/PORTING.md)
RANK_VARIABLES = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 2, "LOCAL_WORLD_SIZE": 3,   # PyTorch, OneFlow
                  "RANK_ID": 0, "RANK_SIZE": 1,                                           # MindSpore
                  "PADDLE_TRAINER_ID": 0, "PADDLE_TRAINERS_NUM": 1, "PADDLE_RANK_IN_NODE": 2}   # Paddle


def _export_rank_variables(rank: int, size: int, local_rank: int, local_size: int) -> None:
    """Set RANK_VARIABLES in this process's environment to the world's values (a value
    inherited from the launch shell would name another rank)."""
    values = (rank, size, local_rank, local_size)
    os.environ.update({k: str(values[i]) for k, i in RANK_VARIABLES.items()})


def _attach(ctx: Context, g: Group) -> None:
    """Give group ``g`` its dispatcher (its progress row; in debug mode, the checked transport).
    A group still being created (no transport yet) gets its transport later (_connect)."""
    rel = ctx.reliability
    t = rel.wrap(g.transport, g) if g.transport is not None else None
    g.disp = Dispatcher(g, t, rel.progress.m, rel.row(g), rel.watchdog, rel=rel, check=ctx.check,
                        ring=rel.flight.new_ring())
    g.call = g.disp.call
    if g.mpi_comm is not None:
        rel.attach(g)


def finalize() -> None:
    """Release mpicomm's communicators (MPI itself is finalised at exit by mpi4py).

    Async work not yet completed (dropped Works, and async sends and receives still held
    unwaited) is completed first, each within its timeout; one that cannot complete raises
    (CollectiveTimeoutError naming the call and its peer) instead of being left behind."""
    if not CTX.initialized:
        return
    # dropped async work still writes into its buffers: finish it first (each Work is
    # watched by its own timeout, which names its peers); then the async sends and
    # receives still held but never waited for
    complete_dropped()
    complete_pending("finalize()")
    # no call follows on this rank: a peer waiting in one it did not reach says so at once
    # (freeing the communicators below waits for every rank)
    CTX.reliability.progress.mark_finalized()
    # watched by a timer (the watchdog stops below): a stage past the timeout is reported
    guard = InitGuard(CTX.timeout, CTX.world.rank, "finalize()", "free")
    try:
        CTX.reliability.close(free=True)
        for g in list(CTX.groups.values()) + [CTX.world]:
            if g.transport is not None:
                g.transport.close()
            if g.mpi_comm is not None:
                g.mpi_comm.Free()
        if CTX.local_comm is not None:
            CTX.local_comm.Free()
        if CTX.backend is not None:
            CTX.backend.close()
    finally:
        guard.done()
    CTX.reset()
    CTX.finalized = True


def release() -> None:
    """MindSpore's name for :func:`finalize` (``mindspore.communication.release()``): release
    mpicomm's communicators; ``init()`` may start it again."""
    finalize()


def is_initialized() -> bool:
    """True between init() and finalize()."""
    return CTX.initialized


def get_backend() -> str:
    """The backend in use: "mpi" or "nccl"."""
    return require_init("get_backend()").backend_name


def get_rank(group: str | None = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    return get_group(group, "get_rank()").rank


def get_group_size(group: str | None = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    return get_group(group, "get_group_size()").size


def _here(group: str | None, what: str) -> list[int]:
    """The group ranks of ``group``'s members on this host, in group rank order."""
    g = get_group(group, what)
    if g is CTX.world:
        return list(CTX.local_world_ranks)
    here = set(CTX.local_world_ranks)
    return [i for i, w in enumerate(g.ranks) if w in here]


def get_local_rank(group: str | None = None) -> int:
    """This process's rank among the ranks of ``group`` (default: the world) on its host,
    in group rank order (MindSpore's ``get_local_rank(group)``)."""
    if group is None:
        return require_init("get_local_rank()").local_rank
    return _here(group, "get_local_rank()").index(get_group(group).rank)


def get_local_size(group: str | None = None) -> int:
    """The number of ranks of ``group`` (default: the world) on this host."""
    if group is None:
        return require_init("get_local_size()").local_size
    return len(_here(group, "get_local_size()"))


def get_local_rank_size(group: str | None = None) -> int:
    """The number of ranks of ``group`` (default: the world) on this host (MindSpore's name
    for :func:`get_local_size`)."""
    if group is None:
        return require_init("get_local_rank_size()").local_size
    return len(_here(group, "get_local_rank_size()"))


def get_world_rank_from_group_rank(group: str | None, group_rank_id: int) -> int:
    """The world rank of rank ``group_rank_id`` of ``group``."""
    g = _any_group(group)
    if isinstance(group_rank_id, bool) or not isinstance(group_rank_id, int) \
            or not 0 <= group_rank_id < g.size:
        raise invalid("group_rank_id", group_rank_id, f"a rank of group {g.name!r} in 0..{g.size - 1}")
    return g.ranks[group_rank_id]


def get_group_rank_from_world_rank(world_rank_id: int, group: str | None) -> int:
    """The rank in ``group`` of world rank ``world_rank_id``."""
    g = _any_group(group)
    if world_rank_id not in g.ranks or isinstance(world_rank_id, bool):
        raise invalid("world_rank_id", world_rank_id, f"a world rank in group {g.name!r}: {list(g.ranks)}")
    return g.ranks.index(world_rank_id)


def get_process_group_ranks(group: str | None = None) -> list[int]:
    """The world ranks of ``group``'s members, in group rank order (MindSpore's
    ``get_process_group_ranks``; None or a world name: every rank)."""
    return list(_any_group(group).ranks)


def _any_group(group: str | None) -> Group:
    """A group by name, also on ranks that are not in it."""
    ctx = require_init("this call")
    if group is None or (group in WORLD_ALIASES and group not in ctx.groups):
        return ctx.world
    g = ctx.groups.get(group) if isinstance(group, str) else None
    if g is None:
        raise invalid("group", group, "the world or a group made by create_group (known: "
                      + (", ".join(sorted(ctx.groups)) or "none") + ")")
    return g


def create_group(group: str, rank_ids: Sequence[int]) -> None:
    """Create the named group ``group`` of world ranks ``rank_ids``.

    Either only the members call it (MindSpore's usage) or every rank does; group rank i
    is world rank ``rank_ids[i]``. The members create its communicator among themselves
    (MPI_Comm_create_group); a non-member that calls it only records the name (so that
    get_world_rank_from_group_rank and friends work there). The world's collectives are
    not involved, so members and non-members keep counting the world's calls alike.
    Creation is published as call 1 on the new group's progress row: a member that never
    comes is named by the watchdog. Raises InvalidArgumentError for an empty or duplicate
    name, a world alias, an empty list, duplicates or ranks out of range (on every rank
    that calls it with those arguments). Members that pass different names or rank lists
    do not meet: where a missing member waits in another group's call that needs this rank,
    the watchdog ends the job within seconds naming both calls; else it reports the creation
    as not completed at the timeout, naming the ranks.
    """
    ctx = require_init("create_group()")
    world = ctx.world
    n = world.size
    err = ids = None
    if not isinstance(group, str) or not group:
        err = invalid("group", group, "a non-empty string naming the new group")
    elif group in WORLD_ALIASES:
        err = invalid("group", group, f"a name other than the world's ({', '.join(sorted(WORLD_ALIASES))})")
    elif group in ctx.groups:
        err = invalid("group", group, "a name not in use (destroy_group it first)")
    else:
        try:
            ids = [int(r) for r in rank_ids]
            if any(isinstance(r, bool) or int(r) != r for r in rank_ids):
                raise TypeError
        except (TypeError, ValueError):
            ids = None
            err = invalid("rank_ids", rank_ids, f"a list of world ranks (ints in 0..{n - 1})")
        if ids is not None:
            if not ids:
                err = invalid("rank_ids", rank_ids, "a non-empty list of world ranks")
            elif len(set(ids)) != len(ids):
                dup = sorted({r for r in ids if ids.count(r) > 1})
                err = invalid("rank_ids", rank_ids, f"distinct world ranks (duplicated: {dup})")
            elif any(not 0 <= r < n for r in ids):
                bad = [r for r in ids if not 0 <= r < n]
                err = invalid("rank_ids", rank_ids, f"world ranks in 0..{n - 1} (out of range: {bad})")
    if err is not None:   # from the arguments alone: alike on every rank that passes them
        raise err
    assert ids is not None   # (no error: the rank list was read)
    if world.rank not in ids:
        g = ctx.groups[group] = Group(group, ids, None, None, None)
        ctx.reliability.name(g)
        return
    g = Group(group, ids, ids.index(world.rank), None, None)
    ctx.groups[group] = g
    _attach(ctx, g)
    try:
        g.disp.watched(CREATE_GROUP, lambda: _connect(ctx, g))
    except BaseException:
        ctx.groups.pop(group, None)
        ctx.reliability.forget(g)
        raise


def _connect(ctx: Context, g: Group) -> None:
    """Make member group ``g``'s communicator and transport, among its members only."""
    world = ctx.world
    ids = list(g.ranks)
    # the tag tells concurrent creations apart; members that disagree on the name meet no one
    # (the watchdog names them); the allgather is a cheap check of the ranks that did meet
    tag = ghash(g.name) & 0x7FFF
    sub = world.mpi_comm.Create_group(world.mpi_comm.Get_group().Incl(ids), tag)
    allv = sub.allgather(tuple(ids))
    if any(v != tuple(ids) for v in allv):
        sub.Free()
        raise invalid("create_group arguments", (g.name, ids),
                      "the same rank_ids on every member; got: "
                      + "; ".join(f"group rank {r}: {list(v)}" for r, v in enumerate(allv)))
    g.mpi_comm = sub
    g.transport = ctx.backend.make_transport(sub)
    g.disp.transport = ctx.reliability.wrap(g.transport, g)
    ctx.reliability.attach(g)


def destroy_group(group: str) -> None:
    """Destroy a group made by create_group: collective over its members (a barrier among
    them, watched like a collective); a non-member that calls it only forgets the name."""
    ctx = require_init("destroy_group()")
    if group in WORLD_ALIASES and group not in ctx.groups:
        raise invalid("group", group, "a group made by create_group (the world cannot be destroyed)")
    if not isinstance(group, str) or group not in ctx.groups:
        raise invalid("group", group, "a group made by create_group (known: "
                      + (", ".join(sorted(ctx.groups)) or "none") + ")")
    g = ctx.groups.pop(group)
    if g.mpi_comm is not None:
        g.disp.watched(DESTROY_GROUP, g.mpi_comm.Barrier)
    ctx.reliability.forget(g)
    if g.transport is not None:
        g.transport.close()
    if g.mpi_comm is not None:
        g.mpi_comm.Free()
