"""What the MPI transport's collectives share: the Work of a nonblocking call, host views of
arrays, and the steps of every prepared call (:class:`HostSteps`: check and bind ``out=``,
start the MPI call blocking or not).

MPI moves host memory: GPU arrays and PyTorch tensors are staged through host copies
(mpicomm._arrays), and a result written into a copy is written back by ``finish``.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._arrays import check_out, check_writable, host_out, overlap_error, same_memory, to_host, write_back
from .._ops import mpi_table
from ..errors import invalid
from .base import IN_PLACE, NEW, Work

F32 = np.dtype(np.float32)   # the 16-bit floats are reduced in float32


class MPIWork(Work):
    __slots__ = ("_reqs", "_keep")

    def __init__(self, reqs, result, what, post=None, keep=None):
        super().__init__(result, what, post)
        self._reqs = reqs
        # mpi4py does not keep a nonblocking call's buffers alive: hold them (and any
        # temporary, e.g. the float32 copy of float16 data) until the Work is dropped
        self._keep = keep

    def _poll(self):
        r = self._reqs
        # (one request: Test raises its own error class, e.g. MPI_ERR_TRUNCATE for calls that
        # differ, where Testall says only MPI_ERR_IN_STATUS)
        return r[0].Test() if len(r) == 1 else MPI.Request.Testall(r)


def plain_out(out, x, oshape, dtype):
    """True when ``out=`` is a NumPy array of the call's shape and dtype that MPI can write
    directly: C-contiguous, aligned, writable, sharing no memory with ``x``."""
    return (out.__class__ is np.ndarray and out.dtype is dtype and out.shape == oshape and out.flags.carray
            and not ((out.base is not None or x.base is not None) and np.may_share_memory(out, x)))


def divisor(row, n):
    """n as a scalar of the row's NumPy type (float32 for the 16-bit floats, reduced in float32):
    dividing by it gives the same bits as dividing by the int n, without converting n each call."""
    if not (row.floating or row.complex):
        return n
    return (F32.type if row.upcast else row.dtype.type)(n)


def reduced_post(r, o, n, avg, fin):
    """The post-step of a reduction into ``r`` for the output ``o``: AVG's divide by ``n``, the
    copy out of a temporary ``r`` (float32 for float16/bfloat16, or apart from an x that ``o``
    overlaps), then ``fin`` (the write-back into a non-NumPy out=); None where there is none."""
    if not (avg or r is not o or fin is not None):
        return None

    def post():
        if avg:
            np.divide(r, n, out=r)
        if r is not o:
            o[...] = r
        return fin(o) if fin is not None else None
    return post


def address(a):
    """The address of a host array's first byte (mpi4py's buffer view: a tenth of the cost
    of __array_interface__ for contiguous arrays)."""
    try:
        return MPI.buffer(a).address
    except (BufferError, TypeError, ValueError):   # not contiguous: NumPy knows it
        return a.__array_interface__["data"][0]


def as_host(x, arg="x"):
    """(contiguous host array, back): the call's input as MPI moves it."""
    if x.__class__ is np.ndarray and x.flags.c_contiguous:
        return x, None
    return to_host(x, arg)


class HostSteps:
    """The steps every prepared call of the MPI transport takes; a transport sets ``comm``,
    ``rank`` and ``size``."""

    @staticmethod
    def _ops(row):
        """ReduceOp -> MPI op for dtype row ``row`` (mpicomm._ops.mpi_table)."""
        return mpi_table(row)

    def _root(self, root, arg="root"):
        if type(root) is not int or not 0 <= root < self.size:
            if isinstance(root, (int, np.integer)) and not isinstance(root, bool) and 0 <= root < self.size:
                return int(root)
            raise invalid(arg, root, f"a group rank in 0..{self.size - 1}")
        return root

    @staticmethod
    def _check_role(x, out, xh, oshape, what, slot=None):
        """Validate the first call's ``out=`` (the run checks each later one)."""
        if out is None:
            return
        if out is x:
            if tuple(xh.shape) != tuple(oshape):
                raise invalid("out", "x (in place)", f"an array of shape {oshape}: {what}")
            check_writable(x, "out")
            return
        o, _ = host_out(out, oshape, xh.dtype)
        if np.may_share_memory(o, xh) and not same_memory(o, xh) and not (slot and slot(o, xh)):
            raise overlap_error()

    @staticmethod
    def _bind(x, out, role, oshape, dtype, slot=None):
        """(host input, host output, finish): this call's arrays as MPI moves them.

        ``finish(o)`` turns the host output into the result the caller gets (None: ``o``).
        ``slot(o, x)`` tells whether an ``out=`` that overlaps ``x`` is the collective's own
        in-place form (x is this rank's part of out, or out this rank's part of x).
        """
        xh, back = as_host(x)
        if role is NEW:
            return xh, np.empty(oshape, dtype), back
        if role is IN_PLACE:
            if xh is x:
                if not x.flags.writeable:
                    raise invalid("out", "x, a read-only array", "a writable array (the result is written into it)")
                return xh, xh, None
            check_writable(x, "out")
            if not xh.flags.writeable:
                xh = xh.copy()
            return xh, xh, (lambda o: write_back(x, o))
        if out.__class__ is np.ndarray:
            o, wb = check_out(out, oshape, dtype), None
        else:
            o, wb = host_out(out, oshape, dtype)
        if np.may_share_memory(o, xh):
            if slot is not None and slot(o, xh):   # the collective's in-place form
                return xh, o, wb
            if not same_memory(o, xh):
                raise overlap_error()
            if wb is None:
                return o, o, None          # out is a view of exactly x's memory: in place
            xh = xh.copy()
        return xh, o, wb

    def _start(self, blocking, nonblocking, async_op, result, post, keep, what):
        """Run the transport call, then the post-step; or start it and return a Work."""
        if async_op:
            return MPIWork([nonblocking()], result, what, post, keep)
        blocking()
        if post is not None:
            r = post()
            if r is not None:
                return r
        return result
