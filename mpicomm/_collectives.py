"""The collectives: one function each, one signature across backends.

Each takes ``group=None`` (the world) and ``async_op=False``; with ``async_op=True``
it returns a :class:`mpicomm.Work` whose ``wait()`` returns the result. Results are
out-of-place by default (a new array of the input's type); ``out=`` writes into a
given array and ``out=x`` works in place. ``root``, ``dst`` and ``src`` are ranks of
the group. GPU arrays take ``stream=`` (default: CuPy's current stream, PyTorch's for
tensors). Each function finds the group and hands the call to its dispatcher
(mpicomm._dispatch), which validates a new signature once and reuses it after.
The checks made before the dispatcher (per-rank sizes among them) are in mpicomm._sizes;
the MindSpore-style operator classes in mpicomm._operators.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Sequence, cast

from ._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, GATHER, RECV, REDUCE, REDUCE_SCATTER,
                   SCATTER, SEND, SENDRECV, ReduceOp, Sized, as_op)
from ._backends.base import Work, track
from ._state import CTX, get_group
from ._typing import ArrayLike, Stream
from ._sizes import ScatterFacts, early, raise_, root_of, sized, splits
from .errors import invalid

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
        op = early(g, ALL_REDUCE, as_op, op)
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
        return g.call(ALL_GATHER, x, out, early(g, ALL_GATHER, sized, g, ALL_GATHER, x, None, sizes),
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
        op = early(g, REDUCE_SCATTER, as_op, op)
    if sizes is not None:
        if isinstance(sizes, str):
            early(g, REDUCE_SCATTER, raise_, invalid(
                "sizes", sizes, f"a sequence of {g.size} non-negative ints (reduce_scatter's "
                "sizes are the same on every rank, so there is nothing to exchange)"))
        return g.call(REDUCE_SCATTER, x, out, early(g, REDUCE_SCATTER, sized, g, REDUCE_SCATTER, x, op, sizes),
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
        op = early(g, REDUCE, as_op, op)
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
        return g.call(ALL_TO_ALL, x, out, early(g, ALL_TO_ALL, splits, g, x, out, in_splits, out_splits),
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

    The message must fill ``out`` exactly (as torch.distributed.recv): one larger or
    shorter raises CollectiveMismatchError on this rank, naming the sender, the size sent
    and out's. There is no wildcard tag."""
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
    return g.call(GATHER, x, out, early(g, GATHER, sized, g, GATHER, x, root, sizes), async_op, stream)


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
    root = early(g, SCATTER, root_of, g, root)
    arg = early(g, SCATTER, sized, g, SCATTER, x if g.rank == root else out, root, sizes)
    made = arg.out if arg.__class__ is ScatterFacts else None   # out made from the root's facts
    if g.rank != root:
        if out is None:
            if made is None:
                early(g, SCATTER, raise_, invalid("out", None, f"an array of this rank's part of the root's x (its shape and dtype) "
                              f"on every rank but the root {root}, or sizes='auto' on every rank (rank {g.rank})"))
            out = made       # made from the root's facts, exchanged
        # x is not read here: out stands in for it, so a repeated call reuses its prepared call
        x = out
    if arg.__class__ is not Sized:
        arg = Sized(root, arg.sizes)
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

    ``coalesce=True`` only launches the block's calls together: each call returns what it
    returns outside a batch (its result, or a Work with ``async_op=True``), and nothing is
    waited for at the end. On NCCL the calls are one group, enqueued on their streams when
    the block ends, so their results are ready on those streams after the block (as for
    any NCCL call, nothing to wait for on the host); on MPI each call runs as it comes.
    This is the grouping of torch.distributed's coalescing manager and of Horovod's grouped
    allreduce (mpicomm's gradient reducer launches its buckets this way). Coalesced blocks
    nest, and a batch may be opened inside one.
    """

    __slots__ = ("group", "works", "coalesce", "_g")

    def __init__(self, group: str | None = None, coalesce: bool = False) -> None:
        if coalesce is not True and coalesce is not False:
            raise invalid("coalesce", coalesce, "True or False")
        self.group = group
        self.coalesce = coalesce
        self.works: list[Work] | None = None     # after the block: the Works of its calls, in order
        self._g: Any = None

    def __enter__(self) -> batch:
        g = get_group(self.group)
        if self.coalesce:
            g.disp.coalesce_begin()
        else:
            g.disp.batch_begin()
        self._g = g
        return self

    def __exit__(self, et: Any, e: Any, tb: Any) -> Literal[False]:
        g, self._g = self._g, None
        if self.coalesce:
            g.disp.coalesce_end()
            return False
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

    def __repr__(self) -> str:
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


def _tag_ub() -> int | None:
    """MPI's largest tag (the TAG_UB attribute of the world); None before init."""
    if not _TAG_UB:
        if not CTX.initialized:   # (importing mpi4py.MPI here would start MPI)
            return None
        from mpi4py import MPI

        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        _TAG_UB.append(int(ub) if ub is not None else 32767)
    return _TAG_UB[0]


def _check_tag(tag: Any) -> int:
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


def _compile_common_cases() -> None:
    """The functions above whose common case (the world group, an op given as a ReduceOp, no
    per-rank sizes) the compiled call path reads (mpicomm/_native): the same call made in C,
    and anything else through the Python function, which stays the documented one."""
    from . import _native

    cp = _native.callpath
    if cp is None:
        return
    common = {"group": "group", "async_op": "async_op", "stream": "stream"}
    spec = {
        all_reduce: dict(code=ALL_REDUCE, x="x", out="out", arg="op", op="op", none=()),
        all_gather: dict(code=ALL_GATHER, x="x", out="out", arg=None, op=None, none=("sizes",)),
        reduce_scatter: dict(code=REDUCE_SCATTER, x="x", out="out", arg="op", op="op", none=("sizes",)),
        broadcast: dict(code=BROADCAST, x="x", out=None, arg="root", op=None, none=()),
    }
    g = globals()
    for fn, kw in spec.items():
        g[fn.__name__] = cp.Public(fn, kw.pop("code"), CTX, ReduceOp, **kw, **common)


_compile_common_cases()
