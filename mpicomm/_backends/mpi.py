"""The MPI transport: NumPy (and any host array) over mpi4py; GPU arrays staged via the host.

Each collective has one ``_prepare_*`` method: it validates what the call's signature
decides and returns a :class:`Prepared` whose ``run(x, out)`` binds new arrays of that
signature. Large messages of a one-host group take the shared-memory strategy
(mpicomm._backends.shm) and arrays of more than 2**31 - 1 elements go in pieces
(mpicomm._backends.bigcount); both are chosen inside ``run`` from the message size.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._arrays import (check_out, check_writable, host_out, offsets, overlap_error, same_memory, to_host,
                      write_back)
from .._dtypes import of_numpy
from .._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, GATHER, REDUCE, REDUCE_SCATTER, RECV,
                    SCATTER, SENDRECV, ReduceOp, check_op_dtype, mpi_ops, nan_mpi_ops)
from ..errors import CollectiveMismatchError, CommunicationError, invalid
from . import bigcount
from .base import IN_PLACE, NEW, OUT, Backend, DoneWork, HostCall, Prepared, Work, role_of
from .shm import ShmPath

_F32 = np.dtype(np.float32)
_AVG = ReduceOp.AVG
_FILLS = "broadcast fills x in place"
MAX_COUNT = 2 ** 31 - 1  # MPI counts are C ints: larger arrays go in pieces (tests lower it)


class MPIWork(Work):
    __slots__ = ("_reqs", "_keep")

    def __init__(self, reqs, result, what, post=None, keep=None):
        super().__init__(result, what, post)
        self._reqs = reqs
        # mpi4py does not keep a nonblocking call's buffers alive: hold them (and any
        # temporary, e.g. the float32 copy of float16 data) until the Work is dropped
        self._keep = keep

    def _poll(self):
        return MPI.Request.Testall(self._reqs)


class _RecvWork(MPIWork):
    """An async recv or sendrecv (its receive the last request): polled with statuses, so
    that a message larger than ``out`` raises CollectiveMismatchError naming ``out``, its
    size and the size sent, instead of MPI's bare MPI_ERR_TRUNCATE."""

    __slots__ = ("_sts", "_fail", "_err")

    def __init__(self, reqs, result, what, post, keep, fail):
        super().__init__(reqs, result, what, post, keep)
        self._sts = [MPI.Status() for _ in reqs]
        self._fail = fail      # (MPI error, the receive's status) -> the error to raise
        self._err = None

    def _poll(self):
        if self._err is None:
            try:
                return MPI.Request.Testall(self._reqs, self._sts)
            except MPI.Exception as e:
                self._err = self._fail(e, self._sts[-1])
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


class MPIBackend(Backend):
    name = "mpi"

    def make_transport(self, mpi_comm):
        return MPITransport(mpi_comm)


def _plain_out(out, x, oshape, dtype):
    """True when ``out=`` is a NumPy array of the call's shape and dtype that MPI can write
    directly: C-contiguous, aligned, writable, sharing no memory with ``x``."""
    return (out.__class__ is np.ndarray and out.dtype is dtype and out.shape == oshape and out.flags.carray
            and not ((out.base is not None or x.base is not None) and np.may_share_memory(out, x)))


def _divisor(row, n):
    """n as a scalar of the row's NumPy type (float32 for the 16-bit floats, reduced in float32):
    dividing by it gives the same bits as dividing by the int n, without converting n each call."""
    if not (row.floating or row.complex):
        return n
    return (_F32.type if row.upcast else row.dtype.type)(n)


def _addr(a):
    """The address of a host array's first byte (mpi4py's buffer view: a tenth of the cost
    of __array_interface__ for contiguous arrays)."""
    try:
        return MPI.buffer(a).address
    except (BufferError, TypeError, ValueError):   # not contiguous: NumPy knows it
        return a.__array_interface__["data"][0]


def _host(x, arg="x"):
    """(contiguous host array, back): the call's input as MPI moves it."""
    if x.__class__ is np.ndarray and x.flags.c_contiguous:
        return x, None
    return to_host(x, arg)


class MPITransport:
    """Collectives of one group over an MPI communicator."""

    last_stream = None   # (the watchdog's GPU state: never set on MPI)
    last_what = None

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._mop = mpi_ops()
        self._fop = nan_mpi_ops()   # floating dtypes: MIN/MAX propagate NaN (np.minimum/np.maximum)
        self.shm = ShmPath(comm)   # the one-host shared-memory strategy (opened at first use)
        self._prepare = {ALL_REDUCE: self._prepare_all_reduce, ALL_GATHER: self._prepare_all_gather,
                         REDUCE_SCATTER: self._prepare_reduce_scatter, BROADCAST: self._prepare_broadcast,
                         REDUCE: self._prepare_reduce, ALL_TO_ALL: self._prepare_all_to_all}

    def prepare(self, code, x, out, arg, async_op, stream):
        return self._prepare[code](x, out, arg, async_op, stream)

    def close(self):
        self.shm.close()

    def abort(self):
        pass

    def group_start(self):
        pass

    def group_end(self):
        pass

    # ----------------------------------------------------------- shared steps
    def _ops(self, row):
        """ReduceOp -> MPI op for dtype row ``row``: on floats MIN/MAX propagate NaN."""
        return self._fop if row.floating or row.upcast else self._mop

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
        xh, back = _host(x)
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

    def _slot_gather(self, o, x):
        """x is exactly this rank's part of all_gather's output ``o`` (in place)."""
        return o.nbytes == self.size * x.nbytes and \
            _addr(x) == _addr(o) + self.rank * x.nbytes

    def _slot_scatter(self, o, x):
        """``o`` is exactly this rank's part of reduce_scatter's input ``x`` (in place)."""
        return x.nbytes == self.size * o.nbytes and \
            _addr(o) == _addr(x) + self.rank * o.nbytes

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

    # ----------------------------------------------------------- collectives
    def _prepare_all_reduce(self, x, out, op, async_op, stream):
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        check_op_dtype(op, row)
        self._check_role(x, out, xh, xh.shape, "all_reduce keeps the shape")
        comm, n, shm, shape, dtype = self.comm, self.size, self.shm, xh.shape, xh.dtype
        mop, dt, nbytes, size = self._ops(row)[op], row.mpi, xh.nbytes, xh.size
        role = role_of(x, out)
        avg, upcast = op is _AVG, row.upcast
        nd = _divisor(row, n)   # AVG's n as a NumPy scalar of the array's type (a cheaper divide)
        what = ("all_reduce", shape, dtype)
        plain = x.__class__ is np.ndarray and not upcast and size <= MAX_COUNT and not async_op

        if plain:
            # The common case written out: a NumPy input whose arrays need no copy. Anything
            # else this call's arrays bring (a copy, an error) is left to run_any.
            inplace = MPI.IN_PLACE

            def tail(x, o, sb, out):
                """A message that may take the shared-memory path (which needs C-contiguous arrays)."""
                if not x.flags.c_contiguous or not o.flags.carray:
                    return run_any(x, out)
                if shm.all_reduce(x, o, row, op) is not None:
                    return o
                comm.Allreduce(sb, [o, dt], mop)
                if avg:
                    np.divide(o, nd, out=o)
                return o

            # mpi4py refuses a non-contiguous buffer, and a read-only receive buffer, before
            # MPI starts (BufferError): for 1-d arrays, where contiguous is C-contiguous,
            # that is the check, and run_any then raises the error that names the argument.
            flat = len(shape) <= 1

            if role is NEW:
                def run(x, out):
                    if not flat and not x.flags.c_contiguous:
                        return run_any(x, out)
                    o = np.empty(shape, dtype)
                    if nbytes < shm.min_all_reduce:
                        try:
                            comm.Allreduce([x, dt], [o, dt], mop)
                        except BufferError:
                            return run_any(x, out)
                        if avg:
                            np.divide(o, nd, out=o)
                        return o
                    return tail(x, o, [x, dt], out)
            elif role is IN_PLACE:
                def run(x, out):
                    if not flat and not x.flags.carray:   # C-contiguous, aligned and writable
                        return run_any(x, out)
                    if nbytes < shm.min_all_reduce:
                        try:
                            comm.Allreduce(inplace, [x, dt], mop)
                        except BufferError:
                            return run_any(x, out)
                        if avg:
                            np.divide(x, nd, out=x)
                        return x
                    return tail(x, x, inplace, out)
            else:
                def run(x, out):
                    if out.__class__ is not np.ndarray or out.dtype is not dtype or out.shape != shape \
                            or (out.base is not None or x.base is not None) and np.may_share_memory(out, x) \
                            or not flat and (not out.flags.carray or not x.flags.c_contiguous):
                        return run_any(x, out)
                    if nbytes < shm.min_all_reduce:
                        try:
                            comm.Allreduce([x, dt], [out, dt], mop)
                        except BufferError:
                            return run_any(x, out)
                        if avg:
                            np.divide(out, nd, out=out)
                        return out
                    return tail(x, out, [x, dt], out)
        else:
            run = None

        def run_any(x, out):
            xh, o, fin = self._bind(x, out, role, shape, dtype)
            if not async_op and nbytes >= shm.min_all_reduce and shm.all_reduce(xh, o, row, op) is not None:
                return fin(o) if fin is not None else (out if role is OUT else o)
            if size > MAX_COUNT:
                return bigcount.all_reduce(lambda a, b: run_small(a, b, None, False), xh, o, fin, async_op, what)
            res = run_small(xh, o, fin)
            return out if role is OUT and fin is None and not async_op else res

        def run_small(xh, o, fin, async_op=async_op):
            if upcast:  # float16 / bfloat16: reduce in float32, MPI has no such ops
                t = xh.astype(_F32)
                sb, rb = MPI.IN_PLACE, [t, MPI.FLOAT]

                def post():
                    if avg:
                        t.__itruediv__(n)
                    o[...] = t
                    return fin(o) if fin is not None else None
            else:
                t = None
                sb, rb = (MPI.IN_PLACE if o is xh else [xh, dt]), [o, dt]
                if avg or fin is not None:
                    def post():
                        if avg:
                            np.divide(o, nd, out=o)
                        return fin(o) if fin is not None else None
                else:
                    post = None
            return self._start(lambda: comm.Allreduce(sb, rb, mop), lambda: comm.Iallreduce(sb, rb, mop),
                               async_op, o, post, (xh, o, t), what)

        return Prepared(ALL_REDUCE, x, out, op, async_op, stream, run or run_any)

    def _prepare_all_gather(self, x, out, _, async_op, stream):
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        n, comm, shm = self.size, self.comm, self.shm
        shape, dtype, dt = xh.shape, xh.dtype, row.mpi
        oshape = (n * shape[0],) + shape[1:] if xh.ndim else (n,)
        slot = self._slot_gather
        self._check_role(x, out, xh, oshape, f"all_gather gives axis 0 {n} times as long", slot)
        role = role_of(x, out)
        onbytes, osize = xh.nbytes * n, xh.size * n
        xoff = self.rank * xh.nbytes    # where x starts in out in the in-place form
        what = ("all_gather", shape, dtype)

        if x.__class__ is np.ndarray and role is not IN_PLACE and osize <= MAX_COUNT and not async_op:
            def run(x, out):  # a NumPy input, a new or a plain NumPy output (else run_any)
                if not x.flags.c_contiguous:
                    return run_any(x, out)
                if role is NEW:
                    o = np.empty(oshape, dtype)
                elif _plain_out(out, x, oshape, dtype):
                    o = out
                elif onbytes < shm.min_all_gather and out.__class__ is np.ndarray and out.dtype is dtype \
                        and out.shape == oshape and out.flags.carray and _addr(x) == _addr(out) + xoff:
                    comm.Allgather(MPI.IN_PLACE, [out, dt])   # in place: x is this rank's part of out
                    return out
                else:
                    return run_any(x, out)
                if onbytes < shm.min_all_gather or shm.all_gather(x, o) is None:
                    comm.Allgather([x, dt], [o, dt])
                return o
        else:
            run = None

        def run_any(x, out):
            xh, o, fin = self._bind(x, out, role, oshape, dtype, slot)
            if not async_op and onbytes >= shm.min_all_gather and shm.all_gather(xh, o) is not None:
                return fin(o) if fin is not None else (out if role is OUT else o)
            if osize > MAX_COUNT:
                return bigcount.all_gather(lambda a: self.all_gather_host(a), xh, o, n, fin, async_op, what)
            # in place: x is o itself (one rank) or this rank's part of o
            sb = MPI.IN_PLACE if o is xh or role is OUT and np.may_share_memory(o, xh) else [xh, dt]
            post = (lambda: fin(o)) if fin is not None else None
            res = self._start(lambda: comm.Allgather(sb, [o, dt]), lambda: comm.Iallgather(sb, [o, dt]),
                              async_op, o, post, (xh, o), what)
            return out if role is OUT and fin is None and not async_op else res

        return Prepared(ALL_GATHER, x, out, None, async_op, stream, run or run_any)

    def all_gather_host(self, a):
        """All-gather of a contiguous host array (the pieces of a large call)."""
        dt = of_numpy(a.dtype).mpi
        o = np.empty((self.size * a.size,), a.dtype)
        self.comm.Allgather([a, dt], [o, dt])
        return o

    def _prepare_reduce_scatter(self, x, out, op, async_op, stream):
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        check_op_dtype(op, row)
        n, comm, shm = self.size, self.comm, self.shm
        if xh.ndim == 0 or xh.shape[0] % n:
            raise invalid("x.shape", xh.shape, f"a first axis divisible by the group size {n} "
                          "(reduce_scatter splits axis 0 into one chunk per rank)")
        shape, dtype, dt, mop = xh.shape, xh.dtype, row.mpi, self._ops(row)[op]
        oshape = (shape[0] // n,) + shape[1:]
        slot = self._slot_scatter
        self._check_role(x, out, xh, oshape, f"reduce_scatter gives each rank 1/{n} of axis 0", slot)
        role = role_of(x, out)
        avg, upcast, nbytes, size = op is _AVG, row.upcast, xh.nbytes, xh.size
        nd = _divisor(row, n)
        ooff = self.rank * (nbytes // n)   # where out starts in x in the in-place form
        what = ("reduce_scatter", shape, dtype)

        if x.__class__ is np.ndarray and role is not IN_PLACE and not upcast and size <= MAX_COUNT and not async_op:
            def run(x, out):  # a NumPy input, a new or a plain NumPy output (else run_any)
                if not x.flags.c_contiguous:
                    return run_any(x, out)
                if role is NEW:
                    o = np.empty(oshape, dtype)
                elif _plain_out(out, x, oshape, dtype):
                    o = out
                elif nbytes < shm.min_reduce_scatter and out.__class__ is np.ndarray and out.dtype is dtype \
                        and out.shape == oshape and out.flags.carray and _addr(out) == _addr(x) + ooff:
                    # in place: out is this rank's part of x; MPI's send and receive buffers
                    # must not overlap, so the result goes through a temporary
                    t = np.empty(oshape, dtype)
                    comm.Reduce_scatter_block([x, dt], [t, dt], mop)
                    if avg:
                        np.divide(t, nd, out=t)
                    out[...] = t
                    return out
                else:
                    return run_any(x, out)
                if nbytes < shm.min_reduce_scatter or shm.reduce_scatter(x, o, row, op) is None:
                    comm.Reduce_scatter_block([x, dt], [o, dt], mop)
                    if avg:
                        np.divide(o, nd, out=o)
                return o
        else:
            run = None

        def run_any(x, out):
            xh, o, fin = self._bind(x, out, role, oshape, dtype, slot)
            # in place (out is this rank's part of x): MPI's in-place form keeps the result
            # elsewhere, so reduce into a temporary and copy it there
            part = role is OUT and o is not xh and np.may_share_memory(o, xh)
            if not async_op and not part and nbytes >= shm.min_reduce_scatter \
                    and shm.reduce_scatter(xh, o, row, op) is not None:
                return fin(o) if fin is not None else (out if role is OUT else o)
            if size > MAX_COUNT:
                return bigcount.reduce_scatter(lambda a: self.reduce_scatter_host(a, op), xh, o, n, fin,
                                               async_op, what)
            if upcast:
                t, r = xh.astype(_F32), np.empty(oshape, _F32)
                sb, rb = [t, MPI.FLOAT], [r, MPI.FLOAT]
            else:
                t, r = None, (np.empty(oshape, dtype) if part else o)
                sb, rb = (MPI.IN_PLACE if o is xh else [xh, dt]), [r, dt]
            if avg or upcast or part or fin is not None:
                def post():
                    if avg:
                        np.divide(r, n, out=r)
                    if r is not o:
                        o[...] = r
                    return fin(o) if fin is not None else None
            else:
                post = None
            res = self._start(lambda: comm.Reduce_scatter_block(sb, rb, mop),
                              lambda: comm.Ireduce_scatter_block(sb, rb, mop),
                              async_op, o, post, (xh, o, t, r), what)
            return out if role is OUT and fin is None and not async_op else res

        return Prepared(REDUCE_SCATTER, x, out, op, async_op, stream, run or run_any)

    def reduce_scatter_host(self, a, op):
        """Reduce-scatter of a contiguous host array (the pieces of a large call)."""
        row = of_numpy(a.dtype)
        o = np.empty((a.size // self.size,), a.dtype)
        self.comm.Reduce_scatter_block([a, row.mpi], [o, row.mpi], self._ops(row)[op])
        if op is _AVG:
            np.divide(o, self.size, out=o)
        return o

    def _prepare_broadcast(self, x, out, root, async_op, stream):
        root = self._root(root)
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        check_writable(x, "x", _FILLS)
        comm, shm, dt, nbytes, size = self.comm, self.shm, row.mpi, xh.nbytes, xh.size
        is_root = self.rank == root
        what = ("broadcast", xh.shape, xh.dtype)

        if x.__class__ is np.ndarray and not async_op and size <= MAX_COUNT:
            def run(x, out):
                if not x.flags.carray:   # C-contiguous, aligned and writable
                    return run_any(x, out)
                if nbytes < shm.min_broadcast or shm.broadcast(x, root) is None:
                    comm.Bcast([x, dt], root)
                return x
            reuse_run = run
        else:
            reuse_run = None

        def run_any(x, out):
            if x.__class__ is np.ndarray and x.flags.c_contiguous:
                h = x
                if not h.flags.writeable:
                    check_writable(x, "x", _FILLS)
            else:
                check_writable(x, "x", _FILLS)
                h, _ = to_host(x)
                if not h.flags.writeable:
                    h = h.copy()
            post = None if h is x else (lambda: None if is_root else write_back(x, h))
            if not async_op and nbytes >= shm.min_broadcast and shm.broadcast(h, root) is not None:
                if post is not None:
                    post()
                return x
            if size > MAX_COUNT:
                return bigcount.broadcast(lambda a: comm.Bcast([a, dt], root), h, post, async_op, x, what)
            b = [h, dt]
            return self._start(lambda: comm.Bcast(b, root), lambda: comm.Ibcast(b, root),
                               async_op, x, (lambda: (post(), None)[1]) if post else None, (h,), what)

        return Prepared(BROADCAST, x, out, root, async_op, stream, reuse_run or run_any)

    def _prepare_reduce(self, x, out, arg, async_op, stream):
        op, root = arg
        root = self._root(root)
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        check_op_dtype(op, row)
        self._check_role(x, out, xh, xh.shape, "reduce keeps the shape")  # alike on every rank
        comm, n, shape, dtype, dt, mop = self.comm, self.size, xh.shape, xh.dtype, row.mpi, self._ops(row)[op]
        is_root = self.rank == root
        role = role_of(x, out)
        avg, upcast, size = op is _AVG, row.upcast, xh.size
        what = ("reduce", shape, dtype)

        def run(x, out):
            if is_root:
                xh, o, fin = self._bind(x, out, role, shape, dtype)
            else:
                xh, _ = _host(x)
                o = fin = None
                if role is OUT:
                    host_out(out, shape, dtype, xh)   # the same checks as on the root
            if size > MAX_COUNT:
                return bigcount.reduce(lambda a, b: self.reduce_host(a, b, op, root), xh, o, fin, async_op, what)
            if upcast:
                t = xh.astype(_F32)
                r = np.empty(shape, _F32) if is_root else None
                sb, rb = [t, MPI.FLOAT], ([r, MPI.FLOAT] if is_root else None)
            else:
                t, r = None, o
                sb = MPI.IN_PLACE if is_root and o is xh else [xh, dt]
                rb = [o, dt] if is_root else None

            def post():
                if not is_root:
                    return None
                if avg:
                    np.divide(r, n, out=r)
                if r is not o:
                    o[...] = r
                return fin(o) if fin is not None else None

            res = self._start(lambda: comm.Reduce(sb, rb, mop, root), lambda: comm.Ireduce(sb, rb, mop, root),
                              async_op, o if is_root else None, post, (xh, o, t, r), what)
            if not async_op and is_root and role is OUT and fin is None:
                return out
            return res

        return Prepared(REDUCE, x, out, arg, async_op, stream, run)

    def reduce_host(self, a, o, op, root):
        row = of_numpy(a.dtype)
        sb = MPI.IN_PLACE if o is not None and np.shares_memory(a, o) else [a, row.mpi]
        self.comm.Reduce(sb, [o, row.mpi] if o is not None else None, self._ops(row)[op], root)
        if op is _AVG and o is not None:
            np.divide(o, self.size, out=o)

    def _prepare_all_to_all(self, x, out, _, async_op, stream):
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        n, comm = self.size, self.comm
        if xh.ndim == 0 or xh.shape[0] % n:
            raise invalid("x.shape", xh.shape, f"a first axis divisible by the group size {n} "
                          "(all_to_all sends chunk j of axis 0 to rank j)")
        shape, dtype, dt, size = xh.shape, xh.dtype, row.mpi, xh.size
        self._check_role(x, out, xh, shape, "all_to_all keeps the shape")
        role = role_of(x, out)
        what = ("all_to_all", shape, dtype)

        def run(x, out):
            xh, o, fin = self._bind(x, out, role, shape, dtype)
            if size > MAX_COUNT:
                return bigcount.all_to_all(lambda a: self.all_to_all_host(a), xh, o, n, fin, async_op, what)
            sb = MPI.IN_PLACE if o is xh else [xh, dt]
            post = (lambda: fin(o)) if fin is not None else None
            res = self._start(lambda: comm.Alltoall(sb, [o, dt]), lambda: comm.Ialltoall(sb, [o, dt]),
                              async_op, o, post, (xh, o), what)
            return out if role is OUT and fin is None and not async_op else res

        return Prepared(ALL_TO_ALL, x, out, None, async_op, stream, run)

    def all_to_all_host(self, a):
        dt = of_numpy(a.dtype).mpi
        o = np.empty_like(a)
        self.comm.Alltoall([a, dt], [o, dt])
        return o

    # ----------------------------------------------------------- per-rank sizes, gather, scatter
    # Calls whose arg is a Sized (base, sizes, out_sizes): the front (mpicomm._collectives) has
    # checked the sizes (a tuple of non-negative ints, one per rank) or exchanged them.
    _SIZED = {ALL_GATHER: "_prepare_all_gather_v", ALL_TO_ALL: "_prepare_all_to_all_v",
              REDUCE_SCATTER: "_prepare_reduce_scatter_v", GATHER: "_prepare_gather",
              SCATTER: "_prepare_scatter"}

    def prepare_sized(self, code, x, out, arg, async_op, stream):
        return getattr(self, self._SIZED[code])(x, out, arg, async_op, stream)

    @staticmethod
    def _layout(sizes, trail, what):
        """(counts, displacements, total) in elements of parts of ``sizes`` rows of ``trail``."""
        t = 1
        for d in trail:
            t *= int(d)
        counts = [s * t for s in sizes]
        displs, acc = offsets(counts), sum(counts)
        if acc > MAX_COUNT:
            raise invalid("sizes", f"{acc} elements in all", f"at most {MAX_COUNT} elements ({what} with "
                          "per-rank sizes does not go in pieces; split the call)")
        return counts, displs, acc

    def _slot_v(self, counts, displs, itemsize, out_is_part=False):
        """slot(o, x): x is exactly this rank's part of o (the in-place form of the v calls), or
        with ``out_is_part`` o exactly this rank's part of x (reduce_scatter's and scatter's)."""
        r = self.rank

        def slot(o, x):
            return x.nbytes == counts[r] * itemsize and _addr(x) == _addr(o) + displs[r] * itemsize
        return (lambda o, x: slot(x, o)) if out_is_part else slot

    def _axis0(self, xh, what, arg="x.shape"):
        if xh.ndim == 0:
            raise invalid(arg, (), f"an array with an axis 0 ({what} splits or joins along it)")

    def _finish_v(self, blocking, nonblocking, async_op, o, fin, keep, what, role, out):
        post = (lambda: fin(o)) if fin is not None else None
        res = self._start(blocking, nonblocking, async_op, o, post, keep, what)
        return out if role is OUT and fin is None and not async_op else res

    def _any_v(self, role, oshape, dtype, slot, async_op, what, calls):
        """The run for any x and out= of all_gather with sizes, gather's and scatter's root: bind x
        and out (host copies where needed), then ``calls(xh, o, part)`` gives the blocking and the
        nonblocking MPI call; ``part``: one is this rank's part of the other (MPI.IN_PLACE)."""
        def run_any(x, out):
            xh, o, fin = self._bind(x, out, role, oshape, dtype, slot)
            part = o is xh or (role is OUT and np.may_share_memory(o, xh))
            blocking, nonblocking = calls(xh, o, part)
            return self._finish_v(blocking, nonblocking, async_op, o, fin, (xh, o), what, role, out)
        return run_any

    @staticmethod
    def _fast_v(x, role, async_op, oshape, dtype, call, run_any, gives=True):
        """The run of a v call (or gather, scatter): ``call(x, o)`` straight to MPI for a contiguous
        NumPy x and a new or a plain NumPy out=, ``run_any`` for everything else. Where the call
        can never take that path (not NumPy, in place, async_op) it is ``run_any`` itself.
        ``gives=False``: this rank receives nothing (a gather's non-root): ``call(x, None)``, None."""
        if x.__class__ is not np.ndarray or role is IN_PLACE or async_op:
            return run_any
        if not gives:
            def run(x, out):
                if not x.flags.c_contiguous:
                    return run_any(x, out)
                call(x, None)
                return None
            return run

        def run(x, out):
            if not x.flags.c_contiguous:
                return run_any(x, out)
            if role is NEW:
                o = np.empty(oshape, dtype)
            elif _plain_out(out, x, oshape, dtype):
                o = out
            else:
                return run_any(x, out)
            call(x, o)
            return o
        return run

    def _prepare_all_gather_v(self, x, out, arg, async_op, stream):
        sizes = arg[1]
        xh, _ = _host(x)
        self._axis0(xh, "all_gather")
        row = of_numpy(xh.dtype)
        comm, rank, dt, dtype = self.comm, self.rank, row.mpi, xh.dtype
        if xh.shape[0] != sizes[rank]:
            raise invalid("x.shape", xh.shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
        trail = xh.shape[1:]
        counts, displs, total = self._layout(sizes, trail, "all_gather")
        oshape = (sum(sizes),) + trail
        slot = self._slot_v(counts, displs, dtype.itemsize)
        self._check_role(x, out, xh, oshape, "all_gather gives axis 0 the sum of sizes", slot)
        role = role_of(x, out)
        what = ("all_gather", xh.shape, dtype)

        def calls(xh, o, part):
            sb, rb = MPI.IN_PLACE if part else [xh, dt], [o, (counts, displs), dt]
            return (lambda: comm.Allgatherv(sb, rb)), (lambda: comm.Iallgatherv(sb, rb))

        run_any = self._any_v(role, oshape, dtype, slot, async_op, what, calls)
        run = self._fast_v(x, role, async_op, oshape, dtype,
                           lambda x, o: comm.Allgatherv([x, dt], [o, (counts, displs), dt]), run_any)
        return Prepared(ALL_GATHER, x, out, arg, async_op, stream, run)

    def _prepare_all_to_all_v(self, x, out, arg, async_op, stream):
        _, ins, outs = arg
        xh, _ = _host(x)
        self._axis0(xh, "all_to_all")
        row = of_numpy(xh.dtype)
        n, comm, dt, dtype = self.size, self.comm, row.mpi, xh.dtype
        d0, trail = xh.shape[0], xh.shape[1:]
        if ins is None:
            if d0 % n:
                raise invalid("x.shape", xh.shape, f"a first axis divisible by the group size {n}, or in_splits")
            ins = (d0 // n,) * n
        elif sum(ins) != d0:
            raise invalid("in_splits", list(ins), f"sizes that add up to x.shape[0] = {d0} (on rank {self.rank})")
        if outs is None:   # the output split evenly: out='s axis 0, else x's
            os_ = getattr(out, "shape", None) if out is not None and out is not x else None
            o0 = int(os_[0]) if os_ else d0
            if o0 % n:
                raise invalid("out.shape", (o0,) + trail, f"a first axis divisible by the group size {n}, "
                              "or out_splits (a list, or 'auto')")
            outs = (o0 // n,) * n
        sc, sd, _ = self._layout(ins, trail, "all_to_all")
        rc, rd, _ = self._layout(outs, trail, "all_to_all")
        oshape = (sum(outs),) + trail
        self._check_role(x, out, xh, oshape, "all_to_all gives axis 0 the sum of out_splits")
        role = role_of(x, out)
        what = ("all_to_all", xh.shape, dtype)

        def run_any(x, out):
            xh, o, fin = self._bind(x, out, role, oshape, dtype)
            if o is xh:   # in place: MPI's send and receive buffers must differ
                xh = xh.copy()
            sb, rb = [xh, (sc, sd), dt], [o, (rc, rd), dt]
            return self._finish_v(lambda: comm.Alltoallv(sb, rb), lambda: comm.Ialltoallv(sb, rb), async_op,
                                  o, fin, (xh, o), what, role, out)

        run = self._fast_v(x, role, async_op, oshape, dtype,
                           lambda x, o: comm.Alltoallv([x, (sc, sd), dt], [o, (rc, rd), dt]), run_any)
        return Prepared(ALL_TO_ALL, x, out, arg, async_op, stream, run)

    def _prepare_reduce_scatter_v(self, x, out, arg, async_op, stream):
        op, sizes, _ = arg
        xh, _ = _host(x)
        self._axis0(xh, "reduce_scatter")
        row = of_numpy(xh.dtype)
        check_op_dtype(op, row)
        n, rank, comm, dt, dtype, mop = self.size, self.rank, self.comm, row.mpi, xh.dtype, self._ops(row)[op]
        if sum(sizes) != xh.shape[0]:
            raise invalid("sizes", list(sizes), f"sizes that add up to x.shape[0] = {xh.shape[0]} "
                          "(reduce_scatter gives rank i sizes[i] rows of the reduced x)")
        trail = xh.shape[1:]
        counts, displs, _ = self._layout(sizes, trail, "reduce_scatter")
        oshape = (sizes[rank],) + trail
        slot = self._slot_v(counts, displs, dtype.itemsize, out_is_part=True)
        self._check_role(x, out, xh, oshape, "reduce_scatter gives rank i sizes[i] rows", slot)
        role = role_of(x, out)
        avg, upcast = op is _AVG, row.upcast
        what = ("reduce_scatter", xh.shape, dtype)

        def run(x, out):
            xh, o, fin = self._bind(x, out, role, oshape, dtype, slot)
            if upcast:
                t, r = xh.astype(_F32), np.empty(oshape, _F32)
                sb, rb = [t, MPI.FLOAT], [r, MPI.FLOAT]
            else:
                t = None
                r = np.empty(oshape, dtype) if np.may_share_memory(o, xh) else o
                sb, rb = [xh, dt], [r, dt]
            if avg or r is not o or fin is not None:
                def post():
                    if avg:
                        np.divide(r, n, out=r)
                    if r is not o:
                        o[...] = r
                    return fin(o) if fin is not None else None
            else:
                post = None
            res = self._start(lambda: comm.Reduce_scatter(sb, rb, counts, mop),
                              lambda: comm.Ireduce_scatter(sb, rb, counts, mop), async_op, o, post,
                              (xh, o, t, r), what)
            return out if role is OUT and fin is None and not async_op else res

        return Prepared(REDUCE_SCATTER, x, out, arg, async_op, stream, run)

    def _prepare_gather(self, x, out, arg, async_op, stream):
        root, sizes, _ = arg
        root = self._root(root)
        xh, _ = _host(x)
        row = of_numpy(xh.dtype)
        n, rank, comm, dt, dtype = self.size, self.rank, self.comm, row.mpi, xh.dtype
        is_root = rank == root
        if sizes is None:
            even = True
            sizes = (xh.shape[0] if xh.ndim else 1,) * n
        else:
            even = False
            self._axis0(xh, "gather")
            if xh.shape[0] != sizes[rank]:
                raise invalid("x.shape", xh.shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
        trail = xh.shape[1:]
        counts, displs, _ = self._layout(sizes, trail, "gather")
        oshape = (sum(sizes),) + trail
        slot = self._slot_v(counts, displs, dtype.itemsize)
        if is_root:
            self._check_role(x, out, xh, oshape, "gather gives the root axis 0 of all ranks' parts", slot)
        role = role_of(x, out)
        what = ("gather", xh.shape, dtype)

        if is_root:
            def calls(xh, o, part):
                sb = MPI.IN_PLACE if part else [xh, dt]
                if even:
                    rb = [o, dt]
                    return (lambda: comm.Gather(sb, rb, root)), (lambda: comm.Igather(sb, rb, root))
                rb = [o, (counts, displs), dt]
                return (lambda: comm.Gatherv(sb, rb, root)), (lambda: comm.Igatherv(sb, rb, root))

            run_any = self._any_v(role, oshape, dtype, slot, async_op, what, calls)
        else:
            def run_any(x, out):
                xh, _ = _host(x)
                sb = [xh, dt]
                return self._start(lambda: comm.Gather(sb, None, root) if even else comm.Gatherv(sb, None, root),
                                   lambda: comm.Igather(sb, None, root) if even else comm.Igatherv(sb, None, root),
                                   async_op, None, None, (xh,), what)

        if not is_root:
            call = (lambda x, o: comm.Gather([x, dt], None, root)) if even else \
                (lambda x, o: comm.Gatherv([x, dt], None, root))
        else:
            rspec = (counts, displs)
            call = (lambda x, o: comm.Gather([x, dt], [o, dt], root)) if even else \
                (lambda x, o: comm.Gatherv([x, dt], [o, rspec, dt], root))
        run = self._fast_v(x, role, async_op, oshape, dtype, call, run_any, gives=is_root)
        return Prepared(GATHER, x, out, arg, async_op, stream, run)

    def _prepare_scatter(self, x, out, arg, async_op, stream):
        root, sizes, _ = arg
        root = self._root(root)
        n, rank, comm = self.size, self.rank, self.comm
        is_root = rank == root
        if not is_root:   # the front made sure there is an out= (given, or made from the root's facts);
            # x is out there (not read)
            h, _ = to_host(out, "out")
            o, wb = host_out(out, h.shape, h.dtype, None, "out")
            self._axis0(o, "scatter", "out.shape")
            if sizes is not None and o.shape[0] != sizes[rank]:
                raise invalid("out.shape", o.shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
            dt, oshape, odtype = of_numpy(o.dtype, "out").mpi, o.shape, o.dtype
            what = ("scatter", oshape, odtype)
            even = sizes is None

            def run(x, out):
                if out.__class__ is np.ndarray and out.flags.carray and out.dtype is odtype \
                        and out.shape == oshape and not async_op:
                    comm.Scatter(None, [out, dt], root) if even else comm.Scatterv(None, [out, dt], root)
                    return out
                o, wb = host_out(out, oshape, odtype, None, "out")
                rb = [o, dt]
                post = (lambda: wb(o)) if wb is not None else None
                res = self._start(lambda: comm.Scatter(None, rb, root) if even else comm.Scatterv(None, rb, root),
                                  lambda: comm.Iscatter(None, rb, root) if even else comm.Iscatterv(None, rb, root),
                                  async_op, out, post, (o,), what)
                return res
            return Prepared(SCATTER, x, out, arg, async_op, stream, run)
        xh, _ = _host(x)
        self._axis0(xh, "scatter")
        row = of_numpy(xh.dtype)
        dt, dtype, d0, trail = row.mpi, xh.dtype, xh.shape[0], xh.shape[1:]
        even = sizes is None
        if even:
            if d0 % n:
                raise invalid("x.shape", xh.shape, f"a first axis divisible by the group size {n} on the root, "
                              "or sizes (scatter gives rank i part i of axis 0)")
            sizes = (d0 // n,) * n
        elif sum(sizes) != d0:
            raise invalid("sizes", list(sizes), f"sizes that add up to the root's x.shape[0] = {d0}")
        counts, displs, _ = self._layout(sizes, trail, "scatter")
        oshape = (sizes[rank],) + trail
        slot = self._slot_v(counts, displs, dtype.itemsize, out_is_part=True)
        self._check_role(x, out, xh, oshape, "scatter gives each rank its part of axis 0", slot)
        role = role_of(x, out)
        what = ("scatter", xh.shape, dtype)

        def calls(xh, o, part):
            rb = MPI.IN_PLACE if part else [o, dt]
            if even:
                sb = [xh, dt]
                return (lambda: comm.Scatter(sb, rb, root)), (lambda: comm.Iscatter(sb, rb, root))
            sb = [xh, (counts, displs), dt]
            return (lambda: comm.Scatterv(sb, rb, root)), (lambda: comm.Iscatterv(sb, rb, root))

        run_any = self._any_v(role, oshape, dtype, slot, async_op, what, calls)
        sspec = (counts, displs)
        call = (lambda x, o: comm.Scatter([x, dt], [o, dt], root)) if even else \
            (lambda x, o: comm.Scatterv([x, sspec, dt], [o, dt], root))
        run = self._fast_v(x, role, async_op, oshape, dtype, call, run_any)
        return Prepared(SCATTER, x, out, arg, async_op, stream, run)

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
            if src == dst == self.rank and out.nbytes < x.nbytes:   # (as below)
                raise _too_small(out, x.nbytes, src, tag, self.rank, "sendrecv: recv from")
            st = MPI.Status()
            try:
                comm.Sendrecv([x, of_numpy(x.dtype).mpi], dst, tag, [out, of_numpy(out.dtype, "out").mpi], src, tag,
                              st)
            except MPI.Exception as e:
                raise _recv_error(e, st, out, src, tag, self.rank, "sendrecv: recv from") from e
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
        if src == dst == self.rank and o.nbytes < h.nbytes:
            # with oneself the sizes are known here: checked before MPI, whose self path
            # (Open MPI 5's btl self) writes a message larger than out past out's end
            raise _too_small(o, h.nbytes, src, tag, self.rank, "sendrecv: recv from")
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
        if async_op:
            return _RecvWork([comm.Isend(sb, dst, tag), comm.Irecv(rb, src, tag)], res if res is not None else o,
                             what, post, (h, o), fail)
        st = MPI.Status()
        try:
            comm.Sendrecv(sb, dst, tag, rb, src, tag, st)
        except MPI.Exception as e:
            raise fail(e, st) from e
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
            if async_op:
                return _RecvWork([comm.Irecv(b, peer, tag)], x, ("recv", o.shape, o.dtype), post, (o,), fail)
            st = MPI.Status()
            try:
                comm.Recv(b, peer, tag, st)
            except MPI.Exception as e:
                raise fail(e, st) from e
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


__all__ = ["MPIBackend", "MPITransport", "MPIWork", "DoneWork", "MAX_COUNT"]
