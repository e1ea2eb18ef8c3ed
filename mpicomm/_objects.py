"""Collectives and point-to-point of Python objects, on the group's MPI communicator.

Each object is pickled once, with protocol 5: NumPy arrays (and anything else that
exports a ``PickleBuffer``) of 64 KiB or more stay out of the pickle and travel as
their own messages, straight from their memory; the receiver's arrays are views of
the received buffers. The transport is mpi4py's ``mpi4py.util.pkl5`` (messages of
any size: more than 2 GiB goes as one derived datatype), on the group's MPI
communicator, on either backend (GPU arrays inside an object are pickled as their
library pickles them, through the host).

Every call pickles before it communicates, and a rank whose object cannot be pickled
sends, in place of the object, a note of the error through the same messages, so
every rank that would otherwise wait raises the same InvalidArgumentError (a failed
unpickle, where a class is missing on the receiver, raises on that rank only).
The collective calls are published for the watchdog like any collective, and
send_object / recv_object like a blocking send / recv (through the dispatcher's
point_to_point): a call that never completes is reported after the timeout, naming the
peer.
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

from . import _ops
from ._backends.base import HostCall
from ._callspec import CallSpec
from ._ops import ALL_GATHER, BROADCAST, RECV, REDUCE, SEND
from ._sizes import early
from ._state import CTX, Group, get_group
from .errors import invalid

# smaller buffers go inside the pickle (one message is cheaper than two): pkl5's own threshold
_OOB_MIN = 256 << 10
_ERR = "mpicomm-pickle-error"
_CACHE: dict[int, Any] = {}   # id(group) -> (its MPI communicator, the pkl5 view of it)


def _pkl(g: Group) -> Any:
    c = _CACHE.get(id(g))
    if c is None or c[0] is not g.mpi_comm:
        from mpi4py.util import pkl5

        c = _CACHE[id(g)] = [g.mpi_comm, pkl5.Intracomm(g.mpi_comm), False]
    return c[1]


def _meet(g: Group) -> None:
    """Before the group's first gather, scatter or all_gather of objects: a barrier, inside
    the watched call. pkl5 makes its own duplicate of the communicator at its first such
    call (MPI_Comm_dup, which mpi4py runs holding the GIL): a rank that came late would
    hold the others there, where the watchdog thread cannot run to report it. The barrier
    releases the GIL while it waits; after it every rank is there and the dup is quick. It
    meets on the group's spare communicator, which no call of the program's can match (a
    peer's ``barrier()`` instead is then a disagreement the watchdog reports)."""
    c = _CACHE[id(g)]
    if not c[2]:
        rel = CTX.reliability
        (rel.meeting_comm(g) if rel is not None else g.mpi_comm).Barrier()
        c[2] = True


def _dump(obj: Any, rank: int, arg: str = "obj") -> tuple:
    """What a rank sends for ``obj``: ``(pickle, [out-of-band buffers])`` as PickleBuffers,
    or an error note ``(_ERR, rank, arg, message)`` when ``obj`` cannot be pickled."""
    bufs = []

    def oob(b: pickle.PickleBuffer) -> bool:
        if b.raw().nbytes < _OOB_MIN:
            return True              # in-band
        bufs.append(b)
        return False

    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=oob)
    except Exception as e:   # PicklingError, TypeError, AttributeError, ...: whatever pickle raises
        return (_ERR, rank, arg, f"{type(obj).__name__} object, which pickle refuses ({type(e).__name__}: {e})")
    return (pickle.PickleBuffer(data), bufs)


def _load(msg: Any) -> Any:
    data, bufs = msg
    return pickle.loads(data, buffers=bufs)


def _is_err(msg: Any) -> bool:
    return len(msg) == 4 and msg[0] == _ERR


def _raise(msgs: Sequence[Any]) -> None:
    """Raise, alike on every rank that has ``msgs``, for the first error note among them."""
    for m in msgs:
        if m is not None and _is_err(m):
            _, rank, arg, what = m
            raise invalid(arg, what, "a picklable object (pickle.dumps(obj, protocol=5) must work)", rank)


def _root(root: Any, g: Group) -> int:
    if isinstance(root, bool) or not isinstance(root, int) and not hasattr(root, "__index__"):
        raise invalid("root", root, f"a group rank in 0..{g.size - 1}")
    try:
        r = int(root.__index__())
    except Exception:
        raise invalid("root", root, f"a group rank in 0..{g.size - 1}") from None
    if not 0 <= r < g.size:
        raise invalid("root", root, f"a group rank in 0..{g.size - 1}")
    return r


_ROOTED: dict[tuple[int, int], CallSpec] = {}


def _rooted(g: Group, code: int, root: Any) -> tuple[int, CallSpec]:
    """``root`` checked as a group rank (a bad one is refused on every rank of the group:
    the members that passed do not wait in the call), and the spec every rank must agree
    on: the collective and its root (a root that differs between ranks is a disagreement,
    named by the agreement check, not a wait for the timeout)."""
    r = early(g, code, _root, root, g)
    spec = _ROOTED.get((code, r))
    if spec is None:
        spec = _ROOTED[(code, r)] = CallSpec(code, root=r)
    return r, spec


def _peer(peer: Any, g: Group, arg: str) -> int:
    if isinstance(peer, bool) or not hasattr(peer, "__index__") or not 0 <= int(peer.__index__()) < g.size:
        raise invalid(arg, peer, f"a group rank in 0..{g.size - 1}")
    peer = int(peer.__index__())
    if peer == g.rank:
        raise invalid(arg, peer, f"another rank of the group (0..{g.size - 1}, not this rank {g.rank}): "
                      "an object sent to oneself would never be received")
    return peer


def _tag(tag: Any) -> int:
    """``tag`` as an int in 0..32767, else InvalidArgumentError (on this rank, before any message)."""
    try:
        t = int(tag.__index__()) if not isinstance(tag, bool) else -1
    except Exception:
        t = -1
    if not 0 <= t <= 32767:
        raise invalid("tag", tag, "an int in 0..32767 (MPI's smallest guaranteed tag range; a tag is never "
                      "a wildcard, so -1 is not MPI's ANY_TAG)")
    return t


def _group(group: str | None) -> Group:
    g = CTX.world if group is None else None
    return g if g is not None else get_group(group)


def all_gather_object(obj: Any, group: str | None = None) -> list[Any]:
    """Every rank's ``obj``, as a list in group rank order, on every rank.

    Raises InvalidArgumentError on every rank when any rank's ``obj`` cannot be
    pickled (naming that rank).
    """
    g = _group(group)
    c = _pkl(g)
    msg = _dump(obj, g.rank)

    def run() -> Any:
        _meet(g)
        return c.allgather(msg)

    msgs = g.disp.watched(ALL_GATHER, run)
    _raise(msgs)
    return [_load(m) for m in msgs]


def all_gather_small(obj: Any, group: str | None = None) -> list[Any]:
    """Every rank's small ``obj`` (a few numbers or short strings), as a list in group rank
    order: mpi4py's pickled allgather on the group's communicator, watched like every
    collective. The cheap host exchange for the extensions' per-step agreements (the
    gathered embeddings' id counts: a few microseconds, where all_gather_object's
    out-of-band buffers and error notes cost a hundred). An object that cannot be pickled
    raises on its own rank only."""
    g = _group(group)
    return g.disp.watched(ALL_GATHER, lambda: g.mpi_comm.allgather(obj))


def broadcast_object(obj: Any = None, root: int = 0, group: str | None = None) -> Any:
    """Root's ``obj`` on every rank (the other ranks' ``obj`` is ignored).

    Raises InvalidArgumentError on every rank for a root out of range or when root's
    ``obj`` cannot be pickled.
    """
    g = _group(group)
    root, spec = _rooted(g, BROADCAST, root)
    c = _pkl(g)
    msg = _dump(obj, g.rank) if g.rank == root else None
    msg = g.disp.watched(BROADCAST, lambda: c.bcast(msg, root), spec=spec)
    _raise([msg])
    return _load(msg)


def gather_object(obj: Any, root: int = 0, group: str | None = None) -> list[Any] | None:
    """Every rank's ``obj`` as a list in group rank order on ``root``; None on the others.

    Raises InvalidArgumentError on every rank for a root out of range or when any
    rank's ``obj`` cannot be pickled (root tells the others, at the cost of one small
    broadcast after the gather).
    """
    g = _group(group)
    code = getattr(_ops, "GATHER", REDUCE)
    root, spec = _rooted(g, code, root)
    c = _pkl(g)
    msg = _dump(obj, g.rank)

    def run() -> Any:
        _meet(g)
        msgs = c.gather(msg, root)
        bad = None
        if msgs is not None:
            bad = next((m for m in msgs if _is_err(m)), None)
        return msgs, g.mpi_comm.bcast(bad, root)

    msgs, bad = g.disp.watched(code, run, spec=spec)
    _raise([bad])
    return [_load(m) for m in msgs] if msgs is not None else None


def scatter_object(objs: Sequence[Any] | None = None, root: int = 0, group: str | None = None) -> Any:
    """Root's ``objs[i]`` on group rank i (``objs`` is read on root only).

    Raises InvalidArgumentError on every rank for a root out of range, when root's
    ``objs`` is not a sequence of one object per rank, or when one of them cannot be
    pickled: root sends the note of the error in place of each rank's object.
    """
    g = _group(group)
    code = getattr(_ops, "SCATTER", BROADCAST)
    root, spec = _rooted(g, code, root)
    c = _pkl(g)
    msgs = None
    if g.rank == root:
        n = g.size
        if objs is None or isinstance(objs, (str, bytes, dict)) or not hasattr(objs, "__len__") \
                or not hasattr(objs, "__getitem__") or len(objs) != n:
            what = f"{type(objs).__name__} of length {len(objs)}" if objs is not None and hasattr(objs, "__len__") \
                else type(objs).__name__
            note = (_ERR, root, "objs", f"{what}, which is not a list of one object per rank")
            msgs = [note] * n
        else:
            msgs = []
            for i in range(n):
                m = _dump(objs[i], root, f"objs[{i}]")
                if _is_err(m):
                    msgs = [m] * n
                    break
                msgs.append(m)

    def run() -> Any:
        _meet(g)
        return c.scatter(msgs, root)

    msg = g.disp.watched(code, run, spec=spec)
    if _is_err(msg) and msg[2] == "objs":
        raise invalid("objs", msg[3], f"a list (or tuple) of {g.size} objects on root {root}, "
                      "one per group rank", msg[1])
    _raise([msg])
    return _load(msg)


def send_object(obj: Any, dst: int, group: str | None = None, tag: int = 0) -> None:
    """Send ``obj`` to group rank ``dst`` (matched by ``recv_object`` there, in order of
    (source, tag) with mpicomm's other object messages).

    An object that cannot be pickled sends a note of the error instead, so the matching
    ``recv_object`` raises too, and this rank raises InvalidArgumentError.
    """
    g = _group(group)
    dst = _peer(dst, g, "dst")
    tag = _tag(tag)
    msg = _dump(obj, g.rank)
    c = _pkl(g)
    g.disp.point_to_point(SEND, HostCall(lambda: c.send(msg, dst, tag), "object (send_object)"), dst, tag,
                          False, None)
    _raise([msg])


def recv_object(src: int, group: str | None = None, tag: int = 0) -> Any:
    """The object that group rank ``src`` sent with ``send_object`` (same tag)."""
    g = _group(group)
    src = _peer(src, g, "src")
    tag = _tag(tag)
    c = _pkl(g)
    msg = g.disp.point_to_point(RECV, HostCall(lambda: c.recv(None, src, tag), "object (recv_object)"), src, tag,
                                False, None)
    _raise([msg])
    return _load(msg)


__all__ = ["all_gather_object", "broadcast_object", "gather_object", "scatter_object",
           "send_object", "recv_object"]
