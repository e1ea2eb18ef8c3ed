"""Point to point on the MPI transport: send, recv and sendrecv (blocking, or a Work), and the barrier.

A receive takes a message of exactly ``out``'s size, as torch.distributed's recv: into an
``out`` smaller than the message sent it raises CollectiveMismatchError naming ``out``, its
size and the size sent, instead of MPI's bare MPI_ERR_TRUNCATE; a shorter message (which MPI
receives into the head of ``out`` without a word) raises the same error naming the sender,
the size received and out's, once the message has arrived (on the receiving rank).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._arrays import host_out, to_host
from .._dtypes import of_numpy
from .._ops import RECV, SENDRECV
from ..errors import CollectiveMismatchError, CommunicationError, invalid
from .base import HostCall
from .mpi_common import HostSteps, MPIWork


class _RecvWork(MPIWork):
    """An async recv or sendrecv (its receive the last request): polled with statuses, so
    that a message larger than ``out`` raises CollectiveMismatchError naming ``out``, its
    size and the size sent, instead of MPI's bare MPI_ERR_TRUNCATE, and a shorter one the
    same error naming the size received."""

    __slots__ = ("_sts", "_fail", "_short", "_err")

    def __init__(self, reqs, result, what, post, keep, fail, short):
        super().__init__(reqs, result, what, post, keep)
        self._sts = [MPI.Status() for _ in reqs]
        self._fail = fail      # (MPI error, the receive's status) -> the error to raise
        self._short = short    # the receive's status -> the error for a short message, or None
        self._err = None

    def _poll(self):
        if self._err is None:
            try:
                if not MPI.Request.Testall(self._reqs, self._sts):
                    return False
            except MPI.Exception as e:
                self._err = self._fail(e, self._sts[-1])
            else:
                self._err = self._short(self._sts[-1])
                if self._err is None:
                    return True
        raise self._err


def _recv_error(e, st, o, peer, tag, rank, call):
    """The error for MPI error ``e`` of a receive into host array ``o`` from group rank
    ``peer`` (``st``: the receive's status). A message larger than ``o`` (MPI_ERR_TRUNCATE)
    -> CollectiveMismatchError naming ``out``, its size and, where MPI tells (Open MPI
    does), the size sent; anything else -> CommunicationError."""
    try:
        code = e.Get_error_code()
        if MPI.Get_error_class(code) == MPI.ERR_IN_STATUS:   # Testall: the status holds it
            code = st.Get_error()
        truncated = MPI.Get_error_class(code) == MPI.ERR_TRUNCATE
    except Exception:
        truncated = False
    if not truncated:
        return CommunicationError(f"rank {rank}: {call} rank {peer} (tag {tag}) failed in MPI: {e}")
    try:
        sent = st.Get_count(MPI.BYTE)
    except Exception:
        sent = MPI.UNDEFINED
    return _too_small(o, sent if sent != MPI.UNDEFINED and sent > o.nbytes else None, peer, tag, rank, call)


def _self_error(o, sent, tag, rank):
    """sendrecv with oneself whose out is not the size of x: the error of the longer or the
    shorter message, raised before MPI."""
    call = "sendrecv: recv from"
    if o.nbytes < sent:
        return _too_small(o, sent, rank, tag, rank, call)
    return _short_error(sent, o, rank, tag, rank, call, wrote=False)


def _too_small(o, sent, peer, tag, rank, call):
    """CollectiveMismatchError: the message from ``peer`` (``sent`` bytes; None: unknown) is
    larger than ``out`` (host array ``o``)."""
    have = f"out (shape {tuple(o.shape)}, dtype {o.dtype}) holds {o.size} elements, {o.nbytes} bytes"
    if sent is not None:
        whole = f" = {sent // o.itemsize} {o.dtype} elements" if o.itemsize and sent % o.itemsize == 0 else ""
        what = f"rank {peer} sent {sent} bytes{whole}"
    else:
        what = f"rank {peer} sent more than that"
    return CollectiveMismatchError(
        f"rank {rank}: {call} rank {peer} (tag {tag}): the message is larger than out: {have}, and {what}. "
        "The calls disagree on the size (or dtype): give out= room for the whole message"
        + ("; out's contents are undefined" if peer != rank else ""))


def _short_error(got, o, peer, tag, rank, call, wrote=True):
    """CollectiveMismatchError where the message received into host array ``o`` from ``peer``
    (``got`` bytes: the receive status's count) was shorter than ``o``; None where it filled ``o``.
    ``wrote``: the message was received (into the head of ``o``), else refused before."""
    if got == o.nbytes or got == MPI.UNDEFINED:
        return None
    whole = f" = {got // o.itemsize} {o.dtype} elements" if o.itemsize and got % o.itemsize == 0 else ""
    return CollectiveMismatchError(
        f"rank {rank}: {call} rank {peer} (tag {tag}): the message is shorter than out: rank {peer} sent "
        f"{got} bytes{whole}, and out (shape {tuple(o.shape)}, dtype {o.dtype}) holds {o.size} elements, "
        f"{o.nbytes} bytes. A receive takes a message of exactly out's size (as torch.distributed.recv): "
        "the calls disagree on the size (or dtype)" + ("; only the head of out was written" if wrote else
                                                         "; out was not written"))


class PointToPoint(HostSteps):
    """send, recv, sendrecv and barrier of the MPI transport."""

    def sendrecv(self, x, dst, tag, async_op, out, src):
        """Send ``x`` to ``dst`` and receive ``out`` from ``src`` at once (MPI_Sendrecv): no
        ordering of the two can deadlock; a rank may exchange with itself."""
        dst = self._root(dst, "dst")
        src = self._root(src, "src")
        if type(tag) is not int or tag < 0:
            raise invalid("tag", tag, "a non-negative int")
        comm = self.comm
        if not async_op and x.__class__ is np.ndarray and out.__class__ is np.ndarray and x.flags.c_contiguous \
                and out.flags.carray and not ((out.base is not None or x.base is not None)
                                              and np.may_share_memory(out, x)) and out is not x:
            # NumPy in and out, apart: straight to MPI
            if src == dst == self.rank and out.nbytes != x.nbytes:   # (as below)
                raise _self_error(out, x.nbytes, tag, self.rank)
            st = MPI.Status()
            try:
                comm.Sendrecv([x, of_numpy(x.dtype).mpi], dst, tag, [out, of_numpy(out.dtype, "out").mpi], src, tag,
                              st)
            except MPI.Exception as e:
                raise _recv_error(e, st, out, src, tag, self.rank, "sendrecv: recv from") from e
            e = _short_error(st.Get_count(MPI.BYTE), out, src, tag, self.rank, "sendrecv: recv from")
            if e is not None:
                raise e
            return out
        h, back = to_host(x)
        if out is None:
            o, wb, res = np.empty(h.shape, h.dtype), None, None
        else:
            oh, _ = to_host(out, "out")
            o, wb = host_out(out, oh.shape, oh.dtype, None, "out")
            res = out
            if np.may_share_memory(o, h):   # MPI's buffers must differ: send a copy
                h = h.copy()
        if src == dst == self.rank and o.nbytes != h.nbytes:
            # with oneself the sizes are known here: checked before MPI, whose self path
            # (Open MPI 5's btl self) writes a message larger than out past out's end
            raise _self_error(o, h.nbytes, tag, self.rank)
        sb, rb = [h, of_numpy(h.dtype).mpi], [o, of_numpy(o.dtype, "out").mpi]

        def post():
            if wb is not None:
                wb(o)
            if res is None:
                return back(o) if back is not None else o
            return None
        what = ("sendrecv", h.shape, h.dtype)
        rank = self.rank

        def fail(e, st):
            return _recv_error(e, st, o, src, tag, rank, "sendrecv: recv from")

        def short(st):
            return _short_error(st.Get_count(MPI.BYTE), o, src, tag, rank, "sendrecv: recv from")
        if async_op:
            return _RecvWork([comm.Isend(sb, dst, tag), comm.Irecv(rb, src, tag)], res if res is not None else o,
                             what, post, (h, o), fail, short)
        st = MPI.Status()
        try:
            comm.Sendrecv(sb, dst, tag, rb, src, tag, st)
        except MPI.Exception as e:
            raise fail(e, st) from e
        e = short(st)
        if e is not None:
            raise e
        r = post()
        return r if r is not None else res

    def batch_begin(self):
        """Calls of an mpicomm.batch() are nonblocking requests, completed at its end."""

    def batch_end(self):
        pass

    # ----------------------------------------------------------- point to point, barrier
    def point_to_point(self, code, x, peer, tag, async_op, stream, recv=None):
        if x.__class__ is HostCall:   # send_object / recv_object: run as it is, published by the caller
            return x.fn()
        if code == SENDRECV:
            return self.sendrecv(x, peer, tag, async_op, *recv)
        arg = "src" if code == RECV else "dst"
        peer = self._root(peer, arg)
        if peer == self.rank and not async_op:
            raise invalid(arg, peer, f"another rank of the group (0..{self.size - 1}, not this rank "
                          f"{self.rank}: a blocking {'recv from' if code == RECV else 'send to'} oneself "
                          "would never complete; use async_op=True)")
        comm = self.comm
        if code == RECV:
            if isinstance(x, np.ndarray):
                o, wb = host_out(x, x.shape, x.dtype, None, "out")
            else:
                h, _ = to_host(x, "out")
                o, wb = host_out(x, h.shape, h.dtype, None, "out")
            b = [o, of_numpy(o.dtype, "out").mpi]
            post = (lambda: wb(o)) if wb is not None else None
            rank = self.rank

            def fail(e, st):   # a message larger than out: named, with the size sent
                return _recv_error(e, st, o, peer, tag, rank, "recv from")

            def short(st):     # a shorter one: named, with the size received
                return _short_error(st.Get_count(MPI.BYTE), o, peer, tag, rank, "recv from")
            if async_op:
                return _RecvWork([comm.Irecv(b, peer, tag)], x, ("recv", o.shape, o.dtype), post, (o,), fail, short)
            st = MPI.Status()
            try:
                comm.Recv(b, peer, tag, st)
            except MPI.Exception as e:
                raise fail(e, st) from e
            e = short(st)
            if e is not None:
                raise e
            if post is not None:
                r = post()
                if r is not None:
                    return r
            return x
        h, _ = to_host(x)
        b = [h, of_numpy(h.dtype).mpi]
        return self._start(lambda: comm.Send(b, peer, tag), lambda: comm.Isend(b, peer, tag),
                           async_op, None, None, (h,), ("send", h.shape, h.dtype))

    def barrier(self, async_op):
        return self._start(self.comm.Barrier, self.comm.Ibarrier, async_op, None, None, None,
                           ("barrier", (), None))
