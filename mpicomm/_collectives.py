"""The collectives: one function each, one signature across backends.

Each takes ``group=None`` (the world) and ``async_op=False``; with ``async_op=True``
it returns a :class:`mpicomm.Work` whose ``wait()`` returns the result. Results are
out-of-place by default (a new array of the input's type); ``out=`` writes into a
given array and ``out=x`` works in place. ``root``, ``dst`` and ``src`` are ranks of
the group. GPU arrays take ``stream=`` (default: CuPy's current stream, PyTorch's for
tensors). Each function finds the group and hands the call to its dispatcher
(mpicomm._dispatch), which validates a new signature once and reuses it after.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Literal, Sequence, cast

import numpy as np

from ._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, GATHER, NAMES, RECV, REDUCE, REDUCE_SCATTER,
                   SCATTER, SEND, SENDRECV, ReduceOp, Sized, as_op)
from ._backends.base import Work, track
from ._state import CTX, get_group
from ._typing import ArrayLike, Stream
from .errors import CollectiveMismatchError, invalid

# These functions are the first step of every call: the group look-up is written out
# (CTX.world for the default group) rather than called.


def all_reduce(x: ArrayLike, op: ReduceOp | str = ReduceOp.SUM, out: ArrayLike | None = None,
               group: str | None = None, async_op: bool = False, stream: Stream | None = None) -> Any:
    """Reduce ``x`` element-wise over the group; every rank gets the result.

    Raises InvalidArgumentError for an unknown op, AVG on integers, MIN/MAX/PROD on
    complex, an unsupported dtype, or an ``out`` of the wrong shape/dtype/layout.
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if op.__class__ is not ReduceOp:
        op = _early(g, ALL_REDUCE, as_op, op)
    return g.call(ALL_REDUCE, x, out, op, async_op, stream)


def all_gather(x: ArrayLike, out: ArrayLike | None = None, group: str | None = None, async_op: bool = False,
               stream: Stream | None = None, sizes: Sequence[int] | str | None = None) -> Any:
    """Concatenate every rank's ``x`` along axis 0: shape (d0, ...) -> (n*d0, ...).

    sizes: each rank's axis-0 length (a sequence of ints, one per rank) when they differ,
    or ``"auto"`` to exchange them first (which also checks that every rank calls with the
    same dtype and trailing shape); the result is (sum(sizes), ...).
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if sizes is not None:
        return g.call(ALL_GATHER, x, out, _early(g, ALL_GATHER, _sized, g, ALL_GATHER, x, None, sizes),
                      async_op, stream)
    return g.call(ALL_GATHER, x, out, None, async_op, stream)


def reduce_scatter(x: ArrayLike, op: ReduceOp | str = ReduceOp.SUM, out: ArrayLike | None = None,
                   group: str | None = None, async_op: bool = False, stream: Stream | None = None,
                   sizes: Sequence[int] | None = None) -> Any:
    """Reduce over the group and give rank i chunk i of axis 0: (d0, ...) -> (d0/n, ...).

    sizes: the axis-0 length of each rank's chunk (a sequence of ints adding up to d0) when
    they differ: rank i gets (sizes[i], ...). Raises InvalidArgumentError when axis 0 does
    not divide by the group size (without sizes) or the sizes do not add up to it.
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if op.__class__ is not ReduceOp:
        op = _early(g, REDUCE_SCATTER, as_op, op)
    if sizes is not None:
        if isinstance(sizes, str):
            _early(g, REDUCE_SCATTER, _raise, invalid(
                "sizes", sizes, f"a sequence of {g.size} non-negative ints (reduce_scatter's "
                "sizes are the same on every rank, so there is nothing to exchange)"))
        return g.call(REDUCE_SCATTER, x, out, _early(g, REDUCE_SCATTER, _sized, g, REDUCE_SCATTER, x, op, sizes),
                      async_op, stream)
    return g.call(REDUCE_SCATTER, x, out, op, async_op, stream)


def broadcast(x: ArrayLike, root: int = 0, group: str | None = None, async_op: bool = False,
              stream: Stream | None = None) -> Any:
    """Fill ``x`` on every rank with root's ``x``, in place; returns ``x``."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.call(BROADCAST, x, None, root, async_op, stream)


def reduce(x: ArrayLike, op: ReduceOp | str = ReduceOp.SUM, root: int = 0, out: ArrayLike | None = None,
           group: str | None = None, async_op: bool = False, stream: Stream | None = None) -> Any:
    """Reduce ``x`` over the group onto ``root``; returns the result on root, None elsewhere."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if op.__class__ is not ReduceOp:
        op = _early(g, REDUCE, as_op, op)
    return g.call(REDUCE, x, out, (op, root), async_op, stream)


def all_to_all(x: ArrayLike, out: ArrayLike | None = None, group: str | None = None, async_op: bool = False,
               stream: Stream | None = None, in_splits: Sequence[int] | None = None,
               out_splits: Sequence[int] | str | None = None) -> Any:
    """Split axis 0 into n chunks; chunk j goes to rank j, and chunk i of the result came from rank i.

    in_splits: the axis-0 length of each chunk sent (one int per rank, adding up to x's
    axis 0; None: n equal chunks). out_splits: the length received from each rank (None:
    n equal chunks of ``out``'s axis 0, else of x's; ``"auto"``: exchanged first, which also
    checks that every rank calls with the same dtype and trailing shape). The result is
    (sum(out_splits), ...).
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if in_splits is not None or out_splits is not None:
        return g.call(ALL_TO_ALL, x, out, _early(g, ALL_TO_ALL, _splits, g, x, in_splits, out_splits),
                      async_op, stream)
    return g.call(ALL_TO_ALL, x, out, None, async_op, stream)


def send(x: ArrayLike, dst: int, group: str | None = None, tag: int = 0, async_op: bool = False,
         stream: Stream | None = None) -> Work | None:
    """Send ``x`` to rank ``dst`` of the group (matched by a ``recv`` there).

    tag: an int in 0..MPI's TAG_UB; anything else raises InvalidArgumentError here, before
    anything is sent."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if tag.__class__ is not int or not 0 <= tag <= 32767:   # (above 32767: checked against TAG_UB)
        tag = _check_tag(tag)
    d = g.disp
    if d.batch is not None:
        return d.batch_p2p(SEND, x, dst, tag, stream)
    if async_op:
        return track(d.point_to_point(SEND, x, dst, tag, async_op, stream))
    return d.point_to_point(SEND, x, dst, tag, async_op, stream)


def recv(out: ArrayLike, src: int, group: str | None = None, tag: int = 0, async_op: bool = False,
         stream: Stream | None = None) -> Any:
    """Receive into ``out`` from rank ``src`` of the group; returns ``out``.

    Raises CollectiveMismatchError (on this rank) when the message sent is larger than
    ``out``, naming ``out``, its size and the size sent. There is no wildcard tag."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if tag.__class__ is not int or not 0 <= tag <= 32767:
        tag = _check_tag(tag)
    d = g.disp
    if d.batch is not None:
        return d.batch_p2p(RECV, out, src, tag, stream)
    if async_op:
        return track(d.point_to_point(RECV, out, src, tag, async_op, stream))
    return d.point_to_point(RECV, out, src, tag, async_op, stream)


def sendrecv(x: ArrayLike, dst: int, out: ArrayLike | None = None, src: int | None = None,
             group: str | None = None, tag: int = 0, async_op: bool = False, stream: Stream | None = None) -> Any:
    """Send ``x`` to rank ``dst`` and receive from rank ``src`` (default: ``dst``) at once.

    The two cannot deadlock whatever the order the ranks call in (MPI_Sendrecv; one NCCL
    group of a send and a recv); ``dst`` and ``src`` may be this rank. Receives into
    ``out`` (None: a new array of x's shape and dtype) and returns it. ``tag``: as for
    send/recv (GPU arrays with a tag other than 0 travel through host memory over MPI).
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if tag.__class__ is not int or not 0 <= tag <= 32767:
        tag = _check_tag(tag)
    d = g.disp
    if src is None:
        src = dst
    if d.batch is not None:
        return d.batch_p2p(SENDRECV, x, dst, tag, stream, (out, src))
    if async_op:
        return track(d.point_to_point(SENDRECV, x, dst, tag, async_op, stream, (out, src)))
    return d.point_to_point(SENDRECV, x, dst, tag, async_op, stream, (out, src))


def gather(x: ArrayLike, root: int = 0, out: ArrayLike | None = None, sizes: Sequence[int] | str | None = None,
           group: str | None = None, async_op: bool = False, stream: Stream | None = None) -> Any:
    """Concatenate every rank's ``x`` along axis 0 on ``root``; returns None elsewhere.

    sizes: each rank's axis-0 length when they differ (a sequence of ints, or ``"auto"`` to
    exchange them and check the call's signature); the root's result is (sum(sizes), ...).
    ``out=`` on the root receives it (``x`` may be the root's part of ``out``: in place).
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.call(GATHER, x, out, _early(g, GATHER, _sized, g, GATHER, x, root, sizes), async_op, stream)


def scatter(x: ArrayLike | None, root: int = 0, out: ArrayLike | None = None,
            sizes: Sequence[int] | str | None = None, group: str | None = None, async_op: bool = False,
            stream: Stream | None = None) -> Any:
    """Split the root's ``x`` along axis 0 and give rank i part i; returns this rank's part.

    sizes: the axis-0 length of each part (a sequence of ints adding up to the root's axis
    0; None: n equal parts). Only the root's ``x`` is read. The other ranks say what they
    receive with ``out=`` (an array of their part's shape and the root's dtype, like MPI's
    receive buffer and torch's output tensor), or every rank passes ``sizes="auto"``: the
    root's dtype and trailing shape are exchanged first (n equal parts), and ``x`` may be None
    away from the root.
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    root = _early(g, SCATTER, _root_of, g, root)
    arg = _early(g, SCATTER, _sized, g, SCATTER, x if g.rank == root else out, root, sizes)
    if g.rank != root:
        if out is None:
            if arg[2] is None:
                _early(g, SCATTER, _raise, invalid("out", None, f"an array of this rank's part of the root's x (its shape and dtype) "
                              f"on every rank but the root {root}, or sizes='auto' on every rank (rank {g.rank})"))
            out = arg[2]     # made from the root's facts, exchanged
        # x is not read here: out stands in for it, so a repeated call reuses its prepared call
        x = out
    if arg.__class__ is not Sized or arg[2] is not None:
        arg = Sized((root, arg[1], None))
    return g.call(SCATTER, x, out, arg, async_op, stream)


def barrier(group: str | None = None, async_op: bool = False) -> Work | None:
    """Block until every rank of the group has reached the barrier."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.disp.barrier(async_op)


class batch:
    """``with mpicomm.batch(group=None):`` starts the group's sends, receives and collectives
    issued inside the block together and completes them at its end.

    On NCCL they are one group (ncclGroupStart/End), on MPI nonblocking requests; calls
    inside return a :class:`Work` (complete once the block has ended), so any order of
    sends and receives works, a send to oneself included. Batches do not nest per group.
    """

    __slots__ = ("group", "works", "_g")

    def __init__(self, group: str | None = None) -> None:
        self.group = group
        self.works: list[Work] | None = None     # after the block: the Works of its calls, in order
        self._g: Any = None

    def __enter__(self) -> batch:
        g = get_group(self.group)
        g.disp.batch_begin()
        self._g = g
        return self

    def __exit__(self, et: Any, e: Any, tb: Any) -> Literal[False]:
        g, self._g = self._g, None
        # after an error in the block the calls are launched but not waited for (a peer may
        # never match them); their Works complete at the next collective
        self.works = g.disp.batch_end(wait=et is None)
        return False


class P2POp:
    """One send or receive for :func:`batch_isend_irecv` (torch.distributed's P2POp).

    op: :func:`mpicomm.send` or :func:`mpicomm.recv` (or ``"send"`` / ``"recv"``).
    """

    __slots__ = ("op", "array", "peer", "group", "tag")

    def __init__(self, op: Callable[..., Any] | str, array: ArrayLike, peer: int, group: str | None = None,
                 tag: int = 0) -> None:
        if op is send or op == "send" or op == "isend":
            op = "send"
        elif op is recv or op == "recv" or op == "irecv":
            op = "recv"
        else:
            raise invalid("op", op, "mpicomm.send or mpicomm.recv (or 'send' / 'recv')")
        if tag.__class__ is not int or not 0 <= tag <= 32767:
            tag = _check_tag(tag)
        self.op, self.array, self.peer, self.group, self.tag = op, array, peer, group, tag

    def __repr__(self):
        return f"P2POp({self.op}, peer={self.peer}, group={self.group!r}, tag={self.tag})"


def batch_isend_irecv(ops: list[P2POp] | tuple[P2POp, ...]) -> list[Work]:
    """Start a list of :class:`P2POp` as one batch; returns their Works (complete on return)."""
    ops = list(ops) if isinstance(ops, (list, tuple)) else ops
    if not isinstance(ops, list) or not ops or not all(isinstance(o, P2POp) for o in ops):
        raise invalid("ops", ops, "a non-empty list of mpicomm.P2POp")
    group = ops[0].group
    if any(o.group != group for o in ops):
        raise invalid("ops", [o.group for o in ops], "P2POps of one group (batch_isend_irecv runs one group's batch)")
    with batch(group):
        works = [send(o.array, o.peer, group, o.tag) if o.op == "send" else recv(o.array, o.peer, group, o.tag)
                 for o in ops]
    return cast("list[Work]", works)   # (inside a batch, send and recv return a Work)


_TAG_UB: list[int] = []   # MPI's TAG_UB, the largest tag (at least 32767), once looked up


def _tag_ub():
    """MPI's largest tag (the TAG_UB attribute of the world); None before init."""
    if not _TAG_UB:
        if not CTX.initialized:   # (importing mpi4py.MPI here would start MPI)
            return None
        from mpi4py import MPI

        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        _TAG_UB.append(int(ub) if ub is not None else 32767)
    return _TAG_UB[0]


def _check_tag(tag):
    """``tag`` as an int in 0..TAG_UB, else InvalidArgumentError naming it, on the calling rank
    before anything is sent. mpicomm has no wildcard: -1 is refused, never MPI's ANY_TAG.
    (Before init, where TAG_UB is unknown, only the type and sign are checked.)"""
    ub = _tag_ub()
    ok = not isinstance(tag, bool) and hasattr(tag, "__index__")
    if ok:
        try:
            t = int(tag.__index__())
        except Exception:
            ok = False
        else:
            ok = 0 <= t and (ub is None or t <= ub)
    if not ok:
        allowed = f"0..{ub} (0 to MPI's TAG_UB)" if ub is not None else "0..MPI's TAG_UB"
        raise invalid("tag", tag, f"an int in {allowed}; a tag is never a wildcard, so -1 is not MPI's ANY_TAG")
    return t


# ---------------------------------------------------------------- per-rank sizes

def _raise(e):
    raise e


def _early(g, code, fn, *args):
    """``fn(*args)``, a check of collective ``code``'s arguments before the group's
    dispatcher sees the call; when it raises, the refusal is published as the group's next
    call (mpicomm._reliability.agreement), so that members whose arguments passed do not
    wait in it, then raised."""
    try:
        return fn(*args)
    except Exception as e:
        d = g.disp
        if d is not None and d.check and g.size > 1:
            d.refuse_early(code, e)   # raises e
        raise


def _root_of(g, root):
    if isinstance(root, (int, np.integer)) and not isinstance(root, bool) and 0 <= root < g.size:
        return int(root)
    raise invalid("root", root, f"a group rank in 0..{g.size - 1}")


_CHECKED: set[Any] = set()   # (group size, sizes, their types) found valid: a repeated call skips the checks


def _check_sizes(g, sizes, arg="sizes"):
    """``sizes`` as a tuple of ints, one non-negative int per rank of the group."""
    n = g.size
    if sizes.__class__ is list or sizes.__class__ is tuple:
        t = tuple(sizes)
        try:   # the types too: True == 1 and 1.0 == 1, but neither is a size
            if (n, t, tuple(map(type, t))) in _CHECKED:
                return t
        except TypeError:   # an unhashable entry: refused below
            pass
    try:
        t = tuple(sizes)
    except TypeError:
        t = None
    if t is None or len(t) != n or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                           and v >= 0 for v in t):
        raise invalid(arg, sizes, f"'auto' or a sequence of {n} non-negative ints (one axis-0 length per "
                      f"rank of group {g.name!r})")
    kinds = tuple(map(type, t))
    if all(k is int for k in kinds):   # plain ints: what a hit returns as it is
        if len(_CHECKED) > 1024:
            _CHECKED.clear()
        _CHECKED.add((n, t, kinds))
    return tuple(int(v) for v in t)


def _sized(g, code, x, base, sizes):
    """The Sized arg of a call: explicit sizes checked here; 'auto' (and every call in debug
    mode) exchanged with each rank's call signature."""
    if code in (GATHER, SCATTER):
        base = _root_of(g, base)
    auto = isinstance(sizes, str)
    if auto and sizes != "auto":
        raise invalid("sizes", sizes, f"'auto' or a sequence of {g.size} non-negative ints")
    if not auto and sizes is not None:
        sizes = _check_sizes(g, sizes)
    if not auto and not CTX.debug:
        return Sized((base, sizes, None))
    allv = _exchange(g, code, x, base, sizes)
    if code == SCATTER:
        return _scatter_facts(g, allv, base, sizes, auto)
    if auto:
        own = allv[:, _OWN]
        if (own < 0).any():
            bad = [r for r in range(g.size) if own[r] < 0]
            raise invalid("x", "a 0-d array (no axis 0)", f"an array with an axis 0 on every rank "
                          f"({NAMES[code]} with sizes='auto'; ranks {bad} gave none)")
        sizes = tuple(int(v) for v in own)
    return Sized((base, sizes, None))


def _splits(g, x, in_splits, out_splits):
    """all_to_all's Sized arg (None, in_splits, out_splits)."""
    n = g.size
    if in_splits is not None:
        in_splits = _check_sizes(g, in_splits, "in_splits")
    auto = isinstance(out_splits, str)
    if auto and out_splits != "auto":
        raise invalid("out_splits", out_splits, f"'auto' or a sequence of {n} non-negative ints")
    if not auto and out_splits is not None:
        out_splits = _check_sizes(g, out_splits, "out_splits")
    if not auto and not CTX.debug:
        return Sized((None, in_splits, out_splits))
    ins = in_splits
    if ins is None:
        d0 = _facts(x)[0]
        ins = (d0[0] // n,) * n if d0 and d0[0] % n == 0 else (-1,) * n
    allv = _exchange(g, ALL_TO_ALL, x, None, None, ins)   # in_splits differ between ranks
    got = allv[:, _HDR + g.rank]
    if auto:
        if (allv[:, _HDR:] < 0).any():
            bad = sorted({r for r in range(n) if (allv[r, _HDR:] < 0).any()})
            raise invalid("x.shape", "an axis 0 that does not divide by the group size", f"in_splits, or an "
                          f"axis 0 divisible by {n} on every rank (all_to_all; ranks {bad} gave neither)")
        out_splits = tuple(int(v) for v in got)
    return Sized((None, in_splits, out_splits))


# the exchanged descriptor: collective, dtype, array kind, ndim, trailing shape (6 dims, or a
# hash), op or root, own axis-0 length, a hash of the explicit sizes; then any per-rank values
_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32", "float64",
           "complex64", "complex128", "bool", "int16", "uint16")
_KINDS = ("a host array", "a CuPy/GPU array", "a PyTorch CPU tensor", "a PyTorch CUDA tensor")
_OPS = tuple(ReduceOp)
_OWN, _SZ, _HDR = 11, 12, 13


def _facts(x):
    """(shape, dtype name, kind index) of an array, or (None, None, -1) for None."""
    if x is None:
        return None, None, -1
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        kind = 3 if x.is_cuda else 2
    elif mod == "cupy" or hasattr(x, "__cuda_array_interface__"):
        kind = 1
    else:
        kind = 0
    if shape is None or dtype is None:
        try:
            a = np.asarray(memoryview(x))
            shape, dtype = a.shape, a.dtype
        except TypeError:
            raise invalid("x", type(x).__name__, "an array (NumPy, CuPy, PyTorch, or the buffer protocol)") from None
    return tuple(int(s) for s in shape), str(dtype).replace("torch.", ""), kind


def _exchange(g, code, x, base, sizes, extra=()):
    """Allgather each rank's call descriptor; raise CollectiveMismatchError on every rank where
    the collective, dtype, trailing shape, op/root or explicit sizes differ. Returns the table."""
    from mpi4py import MPI

    shape, dtype, kind = _facts(x)
    v = np.full(_HDR + len(extra), -1, np.int64)
    v[0] = code
    if dtype is not None:
        v[1] = _DTYPES.index(dtype) if dtype in _DTYPES else zlib.crc32(dtype.encode()) | 1 << 40
        v[2] = kind
        v[3] = len(shape)
        trail = shape[1:]
        if len(trail) <= 6:
            v[4:4 + len(trail)] = trail
        else:
            v[4] = zlib.crc32(repr(trail).encode()) | 1 << 40
        v[_OWN] = shape[0] if shape else -1
    if base is not None:
        v[10] = _OPS.index(base) if isinstance(base, ReduceOp) else base
    v[_SZ] = zlib.crc32(repr(sizes).encode()) if sizes is not None else -1
    v[_HDR:] = extra
    allv = np.empty((g.size, len(v)), np.int64)
    g.disp.watched(code, lambda: g.mpi_comm.Allgather([v, MPI.INT64_T], [allv, MPI.INT64_T]))
    # scatter: only the root's x is known; ranks without an out= give no dtype (-1: any)
    known = allv[:, 1] != -1
    fields = {"collective": [0], "dtype": [1], "trailing shape": list(range(3, 10)), "op or root": [10],
              "sizes": [_SZ]}
    diff = []
    for name, idx in fields.items():
        rows = allv[:, idx] if name in ("collective", "op or root", "sizes") else allv[known][:, idx]
        if len(rows) and (rows != rows[0]).any():
            diff.append(name)
    if diff:
        lines = "\n".join(f"  rank {r} (world rank {g.ranks[r]}): {_describe(allv[r])}" for r in range(g.size))
        raise CollectiveMismatchError(
            f"{NAMES[code]} with per-rank sizes on group {g.name!r}: the ranks' calls differ in "
            f"{', '.join(diff)}:\n{lines}\n  every rank must make the same call (same collective, dtype, "
            "trailing shape, op or root, and sizes)")
    return allv


def _describe(d):
    parts = [NAMES.get(int(d[0]), f"collective#{int(d[0])}")]
    if d[1] != -1:
        c = int(d[1])
        parts.append(f"dtype={_DTYPES[c] if 0 <= c < len(_DTYPES) else '#%d' % c}")
        nd = int(d[3])
        if nd >= 1 and nd - 1 <= 6:
            parts.append(f"trailing shape={tuple(int(s) for s in d[4:4 + nd - 1])}")
        elif nd == 0:
            parts.append("shape=()")
    if d[10] != -1:
        parts.append(f"op/root={int(d[10])}" if int(d[0]) not in (REDUCE_SCATTER,) else
                     f"op={_OPS[int(d[10])].value}")
    if d[_SZ] != -1:
        parts.append("sizes given")
    return " ".join(parts)


def _scatter_facts(g, allv, root, sizes, auto):
    """(root, sizes, out made from the root's facts or None) after scatter's exchange."""
    r = allv[root]
    if r[1] == -1 or r[3] < 1:
        raise invalid("x", "no array with an axis 0 on the root", f"the array to scatter on the root {root}")
    if not auto:
        missing = [q for q in range(g.size) if q != root and allv[q, 1] == -1]
        if missing:   # every rank knows it here: all raise, none waits in the scatter
            raise invalid("out", None, f"an array of its part of the root's x on every rank but the root {root}, "
                          f"or sizes='auto' on every rank (ranks {missing} gave no out=)")
        return (root, sizes, None)
    n, d0 = g.size, int(r[_OWN])
    if d0 % n:
        raise invalid("x.shape", f"axis 0 of {d0} on the root", f"a first axis divisible by the group size {n} "
                      "(scatter with sizes='auto' gives each rank an equal part; pass sizes for unequal ones)")
    c = int(r[1])
    if not 0 <= c < len(_DTYPES) or r[3] - 1 > 6:
        raise invalid("x", "the root's array", "a dtype and shape scatter can describe to the other ranks")
    shape = (d0 // n,) + tuple(int(s) for s in r[4:4 + int(r[3]) - 1])
    return (root, None, _alloc(int(r[2]), shape, _DTYPES[c]) if g.rank != root else None)


def _alloc(kind, shape, dtype):
    """A new array of ``kind`` (_KINDS) for scatter's received part on a non-root rank."""
    if kind in (2, 3):
        import torch

        dev = f"cuda:{CTX.device_id}" if kind == 3 and CTX.device_id is not None else ("cuda" if kind == 3 else "cpu")
        return torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    if kind == 1:
        import cupy

        return cupy.empty(shape, dtype)
    from ._dtypes import BFLOAT16

    return np.empty(shape, BFLOAT16 if dtype == "bfloat16" else dtype)


# ---------------------------------------------------------------- MindSpore-style ops

class _Op:
    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class AllReduce(_Op):
    """``AllReduce(op=ReduceOp.SUM, group=None)(x)`` runs :func:`all_reduce`."""

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, group: str | None = None) -> None:
        self.op = as_op(op)
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        return all_reduce(x, self.op, group=self.group)


class AllGather(_Op):
    """``AllGather(group=None)(x)`` runs :func:`all_gather`."""

    def __init__(self, group: str | None = None) -> None:
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        return all_gather(x, group=self.group)


class ReduceScatter(_Op):
    """``ReduceScatter(op=ReduceOp.SUM, group=None)(x)`` runs :func:`reduce_scatter`."""

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, group: str | None = None) -> None:
        self.op = as_op(op)
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        return reduce_scatter(x, self.op, group=self.group)


class Broadcast(_Op):
    """``Broadcast(root=0, group=None)(x)``: broadcasts ``x`` in place, or each array of a
    tuple/list (as MindSpore's Broadcast does), returning what it was given."""

    def __init__(self, root: int = 0, group: str | None = None) -> None:
        self.root = root
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        if isinstance(x, (tuple, list)):
            return type(x)(broadcast(a, self.root, group=self.group) for a in x)
        return broadcast(x, self.root, group=self.group)


class AlltoAll(_Op):
    """``AlltoAll(group=None)(x)`` runs :func:`all_to_all` (splits and joins axis 0).

    MindSpore's form ``AlltoAll(split_count, split_dim, concat_dim, group=None)(x)`` splits
    x into ``split_count`` (the group size) equal parts along ``split_dim``, sends part j to
    rank j, and concatenates the parts received (rank i's first) along ``concat_dim``.
    """

    def __init__(self, split_count: int | str | None = None, split_dim: int = 0, concat_dim: int = 0,
                 group: str | None = None) -> None:
        if isinstance(split_count, str) and group is None:   # AlltoAll("group name"): the old form
            split_count, group = None, split_count
        if split_count is not None and (not isinstance(split_count, (int, np.integer))
                                        or isinstance(split_count, bool) or split_count < 1):
            raise invalid("split_count", split_count, "a positive int: the group size")
        for name, v in (("split_dim", split_dim), ("concat_dim", concat_dim)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise invalid(name, v, "an int (an axis of x)")
        self.split_count = split_count
        self.split_dim = int(split_dim)
        self.concat_dim = int(concat_dim)
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        if self.split_count is None or (self.split_dim == 0 and self.concat_dim == 0):
            if self.split_count is not None:
                _check_split_count(self.split_count, self.group)
            return all_to_all(x, group=self.group)
        n = _check_split_count(self.split_count, self.group)
        xp = _ArrayNS(x)
        nd = len(x.shape)
        sd, cd = self.split_dim, self.concat_dim
        for name, d in (("split_dim", sd), ("concat_dim", cd)):
            if not -nd <= d < nd:
                raise invalid(name, d, f"an axis of x, in {-nd}..{nd - 1} (x has shape {tuple(x.shape)})")
        sd, cd = sd % nd, cd % nd
        if x.shape[sd] % n:
            raise invalid("x.shape", tuple(x.shape), f"axis split_dim={sd} divisible by split_count={n}")
        # part j along split_dim becomes block j of axis 0, sent to rank j
        y = all_to_all(xp.contiguous(xp.moveaxis(x, sd, 0)), group=self.group)
        k = x.shape[sd] // n
        parts = [xp.moveaxis(y[j * k:(j + 1) * k], 0, sd) for j in range(n)]
        return xp.concat(parts, cd)


def _check_split_count(split_count, group):
    n = get_group(group).size
    if split_count != n:
        raise invalid("split_count", split_count, f"the group size {n} (MindSpore's AlltoAll sends one part "
                      "to each rank)")
    return n


class _ArrayNS:
    """moveaxis / concatenate / contiguous for NumPy, CuPy and PyTorch arrays."""

    def __init__(self, x):
        mod = type(x).__module__.split(".")[0]
        if mod == "torch":
            import torch

            self.moveaxis, self.contiguous = torch.movedim, (lambda a: a.contiguous())
            self.concat = lambda parts, d: torch.cat(parts, d)
        else:
            xp = np
            if mod == "cupy":
                import cupy as xp
            self.moveaxis, self.contiguous = xp.moveaxis, xp.ascontiguousarray
            self.concat = lambda parts, d: xp.concatenate(parts, d)


class AllGatherV(_Op):
    """MindSpore's ``AllGatherV(group=None)(x, output_split_sizes)``: all_gather of 1-D arrays
    whose lengths differ; ``output_split_sizes`` is every rank's length (or ``"auto"``)."""

    def __init__(self, group: str | None = None) -> None:
        self.group = group

    def __call__(self, x: ArrayLike, output_split_sizes: Sequence[int] | str) -> Any:
        return all_gather(x, group=self.group, sizes=output_split_sizes)


class ReduceScatterV(_Op):
    """MindSpore's ``ReduceScatterV(op=ReduceOp.SUM, group=None)(x, input_split_sizes)``:
    reduce_scatter where rank i gets ``input_split_sizes[i]`` elements of axis 0."""

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, group: str | None = None) -> None:
        self.op = as_op(op)
        self.group = group

    def __call__(self, x: ArrayLike, input_split_sizes: Sequence[int]) -> Any:
        return reduce_scatter(x, self.op, group=self.group, sizes=input_split_sizes)
