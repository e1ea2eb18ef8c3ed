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

from ._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, RECV, REDUCE, REDUCE_SCATTER, SEND, ReduceOp,
                   as_op)
from ._state import CTX, get_group

# These functions are the first step of every call: the group look-up is written out
# (CTX.world for the default group) rather than called.


def all_reduce(x, op=ReduceOp.SUM, out=None, group=None, async_op=False, stream=None):
    """Reduce ``x`` element-wise over the group; every rank gets the result.

    Raises InvalidArgumentError for an unknown op, AVG on integers, MIN/MAX/PROD on
    complex, an unsupported dtype, or an ``out`` of the wrong shape/dtype/layout.
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if op.__class__ is not ReduceOp:
        op = as_op(op)
    return g.call(ALL_REDUCE, x, out, op, async_op, stream)


def all_gather(x, out=None, group=None, async_op=False, stream=None):
    """Concatenate every rank's ``x`` along axis 0: shape (d0, ...) -> (n*d0, ...)."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.call(ALL_GATHER, x, out, None, async_op, stream)


def reduce_scatter(x, op=ReduceOp.SUM, out=None, group=None, async_op=False, stream=None):
    """Reduce over the group and give rank i chunk i of axis 0: (d0, ...) -> (d0/n, ...).

    Raises InvalidArgumentError when axis 0 does not divide by the group size.
    """
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if op.__class__ is not ReduceOp:
        op = as_op(op)
    return g.call(REDUCE_SCATTER, x, out, op, async_op, stream)


def broadcast(x, root=0, group=None, async_op=False, stream=None):
    """Fill ``x`` on every rank with root's ``x``, in place; returns ``x``."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.call(BROADCAST, x, None, root, async_op, stream)


def reduce(x, op=ReduceOp.SUM, root=0, out=None, group=None, async_op=False, stream=None):
    """Reduce ``x`` over the group onto ``root``; returns the result on root, None elsewhere."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    if op.__class__ is not ReduceOp:
        op = as_op(op)
    return g.call(REDUCE, x, out, (op, root), async_op, stream)


def all_to_all(x, out=None, group=None, async_op=False, stream=None):
    """Split axis 0 into n chunks; chunk j goes to rank j, and chunk i of the result came from rank i."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.call(ALL_TO_ALL, x, out, None, async_op, stream)


def send(x, dst, group=None, tag=0, async_op=False, stream=None):
    """Send ``x`` to rank ``dst`` of the group (matched by a ``recv`` there)."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.disp.point_to_point(SEND, x, dst, tag, async_op, stream)


def recv(out, src, group=None, tag=0, async_op=False, stream=None):
    """Receive into ``out`` from rank ``src`` of the group; returns ``out``."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.disp.point_to_point(RECV, out, src, tag, async_op, stream)


def barrier(group=None, async_op=False):
    """Block until every rank of the group has reached the barrier."""
    g = CTX.world if group is None else None
    if g is None:
        g = get_group(group)
    return g.disp.barrier(async_op)


# ---------------------------------------------------------------- MindSpore-style ops

class _Op:
    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class AllReduce(_Op):
    """``AllReduce(op=ReduceOp.SUM, group=None)(x)`` runs :func:`all_reduce`."""

    def __init__(self, op=ReduceOp.SUM, group=None):
        self.op = as_op(op)
        self.group = group

    def __call__(self, x):
        return all_reduce(x, self.op, group=self.group)


class AllGather(_Op):
    """``AllGather(group=None)(x)`` runs :func:`all_gather`."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, x):
        return all_gather(x, group=self.group)


class ReduceScatter(_Op):
    """``ReduceScatter(op=ReduceOp.SUM, group=None)(x)`` runs :func:`reduce_scatter`."""

    def __init__(self, op=ReduceOp.SUM, group=None):
        self.op = as_op(op)
        self.group = group

    def __call__(self, x):
        return reduce_scatter(x, self.op, group=self.group)


class Broadcast(_Op):
    """``Broadcast(root=0, group=None)(x)``: broadcasts ``x`` in place, or each array of a
    tuple/list (as MindSpore's Broadcast does), returning what it was given."""

    def __init__(self, root=0, group=None):
        self.root = root
        self.group = group

    def __call__(self, x):
        if isinstance(x, (tuple, list)):
            return type(x)(broadcast(a, self.root, group=self.group) for a in x)
        return broadcast(x, self.root, group=self.group)


class AlltoAll(_Op):
    """``AlltoAll(group=None)(x)`` runs :func:`all_to_all`."""

    def __init__(self, group=None):
        self.group = group

    def __call__(self, x):
        return all_to_all(x, group=self.group)
