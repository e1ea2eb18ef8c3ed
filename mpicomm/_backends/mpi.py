"""The MPI transport: NumPy (and any host array) over mpi4py; GPU arrays staged via the host.

Each collective has one ``_prepare_*`` method: it validates what the call's signature
decides and returns a :class:`Prepared` whose ``run(x, out)`` binds new arrays of that
signature. Large messages of a one-host group take the shared-memory strategy
(mpicomm._backends.shm) and arrays of more than 2**31 - 1 elements go in pieces
(mpicomm._backends.bigcount); both are chosen inside ``run`` from the message size.

This module holds the collectives of even parts; those with per-rank sizes (gather,
scatter, the v calls) are in mpi_sized, point to point in mpi_p2p, and the steps they
all share in mpi_common.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._arrays import check_writable, host_out, to_host, write_back
from .._dtypes import of_numpy
from .._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, REDUCE, REDUCE_SCATTER, ReduceOp,
                    check_op_dtype)
from ..errors import invalid
from . import bigcount
from .base import IN_PLACE, NEW, OUT, Backend, DoneWork, Prepared, role_of
from .mpi_common import F32, MPIWork, address, as_host, divisor, plain_out, reduced_post
from .mpi_p2p import PointToPoint
from .mpi_sized import SizedCalls
from .shm_path import ShmPath

_AVG = ReduceOp.AVG
_FILLS = "broadcast fills x in place"
MAX_COUNT = 2 ** 31 - 1  # MPI counts are C ints: larger arrays go in pieces (tests lower it)


class MPIBackend(Backend):
    name = "mpi"

    def make_transport(self, mpi_comm):
        return MPITransport(mpi_comm)


class MPITransport(SizedCalls, PointToPoint):
    """Collectives of one group over an MPI communicator."""

    last_stream = None   # (the watchdog's GPU state: never set on MPI)
    last_what = None

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
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

    def _slot_gather(self, o, x):
        """x is exactly this rank's part of all_gather's output ``o`` (in place)."""
        return o.nbytes == self.size * x.nbytes and \
            address(x) == address(o) + self.rank * x.nbytes

    def _slot_scatter(self, o, x):
        """``o`` is exactly one of the n chunks of reduce_scatter's input ``x``: its head (MPI's
        in-place form), this rank's chunk (NCCL's), or another. The same test on every rank
        (whatever the rank, an ``out=`` written alike is accepted alike or refused alike)."""
        nb = o.nbytes
        if not nb or x.nbytes != self.size * nb:
            return False
        d = address(o) - address(x)
        return 0 <= d < x.nbytes and d % nb == 0

    # ----------------------------------------------------------- collectives
    def _prepare_all_reduce(self, x, out, op, async_op, stream):
        xh, _ = as_host(x)
        row = of_numpy(xh.dtype)
        check_op_dtype(op, row)
        self._check_role(x, out, xh, xh.shape, "all_reduce keeps the shape")
        role = role_of(x, out)
        run = run_any = self._all_reduce_any(xh, row, op, role, async_op)
        if x.__class__ is np.ndarray and not row.upcast and xh.size <= MAX_COUNT and not async_op:
            run = self._all_reduce_plain(xh, row, op, role, run_any)
        return Prepared(ALL_REDUCE, x, out, op, async_op, stream, run)

    def _all_reduce_plain(self, xh, row, op, role, run_any):
        """The run of a NumPy input whose arrays need no copy, the common case written out.
        What differs between the roles (the output, MPI's send buffer, the check that the
        arrays can go to MPI as they are) is chosen here, once; anything else this call's
        arrays bring (a copy, an error) is left to ``run_any``."""
        comm, shm, shape, dtype, dt = self.comm, self.shm, xh.shape, xh.dtype, row.mpi
        mop, nbytes, avg = self._ops(row)[op], xh.nbytes, op is _AVG
        nd = divisor(row, self.size)   # AVG's n as a NumPy scalar of the array's type (a cheaper divide)
        inplace = MPI.IN_PLACE
        new, given = role is NEW, role is OUT
        # mpi4py refuses a non-contiguous buffer, and a read-only receive buffer, before MPI
        # starts (BufferError): for 1-d arrays, where contiguous is C-contiguous, that is the
        # check, and run_any then raises the error that names the argument.
        flat = len(shape) <= 1

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

        def run(x, out):
            if new:
                if not flat and not x.flags.c_contiguous:
                    return run_any(x, out)
                o, sb = np.empty(shape, dtype), [x, dt]
            elif given:
                if out.__class__ is not np.ndarray or out.dtype is not dtype or out.shape != shape \
                        or (out.base is not None or x.base is not None) and np.may_share_memory(out, x) \
                        or not flat and (not out.flags.carray or not x.flags.c_contiguous):
                    return run_any(x, out)
                o, sb = out, [x, dt]
            else:   # in place
                if not flat and not x.flags.carray:   # C-contiguous, aligned and writable
                    return run_any(x, out)
                o, sb = x, inplace
            if nbytes < shm.min_all_reduce:
                try:
                    comm.Allreduce(sb, [o, dt], mop)
                except BufferError:
                    return run_any(x, out)
                if avg:
                    np.divide(o, nd, out=o)
                return o
            return tail(x, o, sb, out)
        return run

    def _all_reduce_any(self, xh, row, op, role, async_op):
        """The run for any arrays of the signature: bound through host copies where needed; the
        shared-memory path, pieces for more than MAX_COUNT elements, the float32 round trip of
        the 16-bit floats, nonblocking calls."""
        comm, n, shm, shape, dtype = self.comm, self.size, self.shm, xh.shape, xh.dtype
        mop, dt, nbytes, size = self._ops(row)[op], row.mpi, xh.nbytes, xh.size
        avg, upcast = op is _AVG, row.upcast
        nd = divisor(row, n)
        what = ("all_reduce", shape, dtype)

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
                t = xh.astype(F32)
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
        return run_any

    def _prepare_all_gather(self, x, out, _, async_op, stream):
        xh, _ = as_host(x)
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
                elif plain_out(out, x, oshape, dtype):
                    o = out
                elif onbytes < shm.min_all_gather and out.__class__ is np.ndarray and out.dtype is dtype \
                        and out.shape == oshape and out.flags.carray and address(x) == address(out) + xoff:
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
        xh, _ = as_host(x)
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
        nd = divisor(row, n)
        inplace = MPI.IN_PLACE
        what = ("reduce_scatter", shape, dtype)

        if x.__class__ is np.ndarray and role is not IN_PLACE and not upcast and size <= MAX_COUNT and not async_op:
            def run(x, out):  # a NumPy input, a new or a plain NumPy output (else run_any)
                if not x.flags.c_contiguous:
                    return run_any(x, out)
                if role is NEW:
                    o = np.empty(oshape, dtype)
                elif plain_out(out, x, oshape, dtype):
                    o = out
                elif nbytes < shm.min_reduce_scatter and out.__class__ is np.ndarray and out.dtype is dtype \
                        and out.shape == oshape and out.flags.carray and slot(out, x):
                    if x.flags.writeable and address(out) == address(x):
                        # out is the head of x: MPI's in-place form, the result at x's start
                        comm.Reduce_scatter_block(inplace, [x, dt], mop)
                        if avg:
                            np.divide(out, nd, out=out)
                        return out
                    # out is another chunk of x: MPI's send and receive buffers must not
                    # overlap, so the result goes through a temporary
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
            # out is one of x's chunks: the head of x takes MPI's in-place form (the result
            # lands at x's start); another chunk gets the result through a temporary
            part = role is OUT and o is not xh and np.may_share_memory(o, xh)
            head = o is xh or part and not upcast and xh.flags.writeable and address(o) == address(xh)
            if not async_op and not part and nbytes >= shm.min_reduce_scatter \
                    and shm.reduce_scatter(xh, o, row, op) is not None:
                return fin(o) if fin is not None else (out if role is OUT else o)
            if size > MAX_COUNT:
                return bigcount.reduce_scatter(lambda a: self.reduce_scatter_host(a, op), xh, o, n, fin,
                                               async_op, what)
            if upcast:
                t, r = xh.astype(F32), np.empty(oshape, F32)
                sb, rb = [t, MPI.FLOAT], [r, MPI.FLOAT]
            else:
                t, r = None, (np.empty(oshape, dtype) if part and not head else o)
                sb, rb = (MPI.IN_PLACE if head else [xh, dt]), [xh if head else r, dt]
            post = reduced_post(r, o, n, avg, fin)   # (r is not o where upcast or part)
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
        xh, _ = as_host(x)
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
        xh, _ = as_host(x)
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
                xh, _ = as_host(x)
                o = fin = None
                if role is OUT:
                    host_out(out, shape, dtype, xh)   # the same checks as on the root
            if size > MAX_COUNT:
                return bigcount.reduce(lambda a, b: self.reduce_host(a, b, op, root), xh, o, fin, async_op, what)
            if upcast:
                t = xh.astype(F32)
                r = np.empty(shape, F32) if is_root else None
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
        xh, _ = as_host(x)
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


__all__ = ["MPIBackend", "MPITransport", "MPIWork", "DoneWork", "MAX_COUNT"]
