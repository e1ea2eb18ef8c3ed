"""Collectives with per-rank sizes on the MPI transport: gather, scatter, and all_gather,
reduce_scatter and all_to_all with ``sizes``/``in_splits``/``out_splits`` (MPI's v calls).

The front (mpicomm._sizes) has checked the sizes (a tuple of non-negative ints, one per
rank) or exchanged them. Each collective's layout (counts and displacements of MPI's v
calls, the result's shape) is built by one small function (``gather_layout``, ...) when
the call is prepared; its run binds the arrays and makes the call.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from .._arrays import host_out, offsets, to_host
from .._dtypes import of_numpy
from .._ops import ALL_GATHER, ALL_TO_ALL, GATHER, REDUCE_SCATTER, SCATTER, ReduceOp, check_op_dtype
from ..errors import invalid
from .base import IN_PLACE, NEW, OUT, Prepared, role_of
from .mpi_common import F32, HostSteps, address, as_host, plain_out, reduced_post

_AVG = ReduceOp.AVG


class Layout(NamedTuple):
    """The parts of a v call: MPI's counts and displacements (in elements) of each rank's
    part in the array of all parts, and the shape of this rank's result."""

    counts: list
    displs: list
    oshape: tuple


def _parts(sizes, trail, what):
    """(counts, displacements) in elements of parts of ``sizes`` rows of ``trail``."""
    t = 1
    for d in trail:
        t *= int(d)
    counts = [s * t for s in sizes]
    displs, acc = offsets(counts), sum(counts)
    from .mpi import MAX_COUNT   # (read when the call is prepared: the tests lower it there)
    if acc > MAX_COUNT:
        raise invalid("sizes", f"{acc} elements in all", f"at most {MAX_COUNT} elements ({what} with "
                      "per-rank sizes does not go in pieces; split the call)")
    return counts, displs


def all_gather_layout(shape, sizes, rank):
    """all_gather with sizes: rank i gives sizes[i] rows; every rank gets all of them."""
    if shape[0] != sizes[rank]:
        raise invalid("x.shape", shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
    trail = shape[1:]
    return Layout(*_parts(sizes, trail, "all_gather"), (sum(sizes),) + trail)


def reduce_scatter_layout(shape, sizes, rank):
    """reduce_scatter with sizes: rank i gets sizes[i] rows of the reduced x."""
    if sum(sizes) != shape[0]:
        raise invalid("sizes", list(sizes), f"sizes that add up to x.shape[0] = {shape[0]} "
                      "(reduce_scatter gives rank i sizes[i] rows of the reduced x)")
    trail = shape[1:]
    return Layout(*_parts(sizes, trail, "reduce_scatter"), (sizes[rank],) + trail)


def gather_layout(shape, sizes, n, rank):
    """gather: rank i gives sizes[i] rows (None: each as many as this rank, an even gather)."""
    if sizes is None:
        sizes = (shape[0] if len(shape) else 1,) * n
    elif shape[0] != sizes[rank]:
        raise invalid("x.shape", shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
    trail = shape[1:]
    return Layout(*_parts(sizes, trail, "gather"), (sum(sizes),) + trail)


def scatter_layout(shape, sizes, n, rank):
    """scatter, on the root: rank i gets sizes[i] rows of x (None: n equal parts)."""
    d0, trail = shape[0], shape[1:]
    if sizes is None:
        if d0 % n:
            raise invalid("x.shape", shape, f"a first axis divisible by the group size {n} on the root, "
                          "or sizes (scatter gives rank i part i of axis 0)")
        sizes = (d0 // n,) * n
    elif sum(sizes) != d0:
        raise invalid("sizes", list(sizes), f"sizes that add up to the root's x.shape[0] = {d0}")
    return Layout(*_parts(sizes, trail, "scatter"), (sizes[rank],) + trail)


def _root_calls(comm, gather, even, counts, displs, dt, root):
    """gather's (``gather``) or scatter's MPI calls on the root, which holds the whole buffer
    (gather's out, scatter's x; laid out by counts and displs unless ``even``) and its own
    part. Returns (calls, call): ``calls(xh, o, part)`` the blocking and the nonblocking call
    for _any_v (the own part MPI.IN_PLACE where ``part``), ``call(x, o)`` the blocking call of
    _fast_v."""
    if gather:
        blocking, nonblocking = (comm.Gather, comm.Igather) if even else (comm.Gatherv, comm.Igatherv)
    else:
        blocking, nonblocking = (comm.Scatter, comm.Iscatter) if even else (comm.Scatterv, comm.Iscatterv)
    spec = (counts, displs)

    def whole(a):
        return [a, dt] if even else [a, spec, dt]

    def calls(xh, o, part):
        own = MPI.IN_PLACE if part else [xh if gather else o, dt]
        sb, rb = (own, whole(o)) if gather else (whole(xh), own)
        return (lambda: blocking(sb, rb, root)), (lambda: nonblocking(sb, rb, root))

    if even:
        def call(x, o):
            return blocking([x, dt], [o, dt], root)
    elif gather:
        def call(x, o):
            return blocking([x, dt], [o, spec, dt], root)
    else:
        def call(x, o):
            return blocking([x, spec, dt], [o, dt], root)
    return calls, call


def all_to_all_layouts(shape, ins, outs, oshape0, n, rank):
    """all_to_all with splits: (what this rank sends, what it receives). ``ins``/``outs`` None:
    even chunks of x's axis 0 / of out='s (``oshape0``: out='s shape where given, else None)."""
    d0, trail = shape[0], shape[1:]
    if ins is None:
        if d0 % n:
            raise invalid("x.shape", shape, f"a first axis divisible by the group size {n}, or in_splits")
        ins = (d0 // n,) * n
    elif sum(ins) != d0:
        raise invalid("in_splits", list(ins), f"sizes that add up to x.shape[0] = {d0} (on rank {rank})")
    if outs is None:   # the output split evenly: out='s axis 0, else x's
        o0 = int(oshape0[0]) if oshape0 else d0
        if o0 % n:
            raise invalid("out.shape", (o0,) + trail, f"a first axis divisible by the group size {n}, "
                          "or out_splits (a list, or 'auto')")
        outs = (o0 // n,) * n
    oshape = (sum(outs),) + trail
    return (Layout(*_parts(ins, trail, "all_to_all"), oshape), Layout(*_parts(outs, trail, "all_to_all"), oshape))


class SizedCalls(HostSteps):
    """The collectives with per-rank sizes of the MPI transport (see the module docstring)."""

    # Calls whose arg is a Sized (base, sizes, out_sizes): the front (mpicomm._sizes) has
    # checked the sizes (a tuple of non-negative ints, one per rank) or exchanged them.
    _SIZED = {ALL_GATHER: "_prepare_all_gather_v", ALL_TO_ALL: "_prepare_all_to_all_v",
              REDUCE_SCATTER: "_prepare_reduce_scatter_v", GATHER: "_prepare_gather",
              SCATTER: "_prepare_scatter"}

    def prepare_sized(self, code, x, out, arg, async_op, stream):
        return getattr(self, self._SIZED[code])(x, out, arg, async_op, stream)

    def _slot_v(self, counts, displs, itemsize, out_is_part=False):
        """slot(o, x): x is exactly this rank's part of o (the in-place form of the v calls), or
        with ``out_is_part`` o exactly this rank's part of x (reduce_scatter's and scatter's)."""
        r = self.rank

        def slot(o, x):
            return x.nbytes == counts[r] * itemsize and address(x) == address(o) + displs[r] * itemsize
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
            elif plain_out(out, x, oshape, dtype):
                o = out
            else:
                return run_any(x, out)
            call(x, o)
            return o
        return run

    def _prepare_all_gather_v(self, x, out, arg, async_op, stream):
        sizes = arg.sizes
        xh, _ = as_host(x)
        self._axis0(xh, "all_gather")
        row = of_numpy(xh.dtype)
        comm, dt, dtype = self.comm, row.mpi, xh.dtype
        counts, displs, oshape = all_gather_layout(xh.shape, sizes, self.rank)
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
        xh, _ = as_host(x)
        self._axis0(xh, "all_to_all")
        row = of_numpy(xh.dtype)
        comm, dt, dtype = self.comm, row.mpi, xh.dtype
        oshape0 = getattr(out, "shape", None) if out is not None and out is not x else None
        (sc, sd, oshape), (rc, rd, _) = all_to_all_layouts(xh.shape, ins, outs, oshape0, self.size, self.rank)
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
        xh, _ = as_host(x)
        self._axis0(xh, "reduce_scatter")
        row = of_numpy(xh.dtype)
        check_op_dtype(op, row)
        n, comm, dt, dtype, mop = self.size, self.comm, row.mpi, xh.dtype, self._ops(row)[op]
        counts, displs, oshape = reduce_scatter_layout(xh.shape, sizes, self.rank)
        part = self._slot_v(counts, displs, dtype.itemsize, out_is_part=True)
        onb = counts[self.rank] * dtype.itemsize

        def slot(o, x):   # out is this rank's part of x (NCCL's form) or its head (MPI's)
            return part(o, x) or (o.nbytes == onb and onb > 0 and address(o) == address(x))
        self._check_role(x, out, xh, oshape, "reduce_scatter gives rank i sizes[i] rows", slot)
        role = role_of(x, out)
        avg, upcast = op is _AVG, row.upcast
        what = ("reduce_scatter", xh.shape, dtype)

        def run(x, out):
            xh, o, fin = self._bind(x, out, role, oshape, dtype, slot)
            if upcast:
                t, r = xh.astype(F32), np.empty(oshape, F32)
                sb, rb = [t, MPI.FLOAT], [r, MPI.FLOAT]
            else:
                t = None
                r = np.empty(oshape, dtype) if np.may_share_memory(o, xh) else o
                sb, rb = [xh, dt], [r, dt]
            post = reduced_post(r, o, n, avg, fin)
            res = self._start(lambda: comm.Reduce_scatter(sb, rb, counts, mop),
                              lambda: comm.Ireduce_scatter(sb, rb, counts, mop), async_op, o, post,
                              (xh, o, t, r), what)
            return out if role is OUT and fin is None and not async_op else res

        return Prepared(REDUCE_SCATTER, x, out, arg, async_op, stream, run)

    def _prepare_gather(self, x, out, arg, async_op, stream):
        root, sizes, _ = arg
        root = self._root(root)
        xh, _ = as_host(x)
        row = of_numpy(xh.dtype)
        comm, dt, dtype = self.comm, row.mpi, xh.dtype
        is_root, even = self.rank == root, sizes is None
        if not even:
            self._axis0(xh, "gather")
        counts, displs, oshape = gather_layout(xh.shape, sizes, self.size, self.rank)
        slot = self._slot_v(counts, displs, dtype.itemsize)
        if is_root:
            self._check_role(x, out, xh, oshape, "gather gives the root axis 0 of all ranks' parts", slot)
        role = role_of(x, out)
        what = ("gather", xh.shape, dtype)

        if is_root:
            calls, call = _root_calls(comm, True, even, counts, displs, dt, root)
            run_any = self._any_v(role, oshape, dtype, slot, async_op, what, calls)
        else:
            def run_any(x, out):
                xh, _ = as_host(x)
                sb = [xh, dt]
                return self._start(lambda: comm.Gather(sb, None, root) if even else comm.Gatherv(sb, None, root),
                                   lambda: comm.Igather(sb, None, root) if even else comm.Igatherv(sb, None, root),
                                   async_op, None, None, (xh,), what)

            call = (lambda x, o: comm.Gather([x, dt], None, root)) if even else \
                (lambda x, o: comm.Gatherv([x, dt], None, root))
        run = self._fast_v(x, role, async_op, oshape, dtype, call, run_any, gives=is_root)
        return Prepared(GATHER, x, out, arg, async_op, stream, run)

    def _prepare_scatter(self, x, out, arg, async_op, stream):
        root, sizes, _ = arg
        root = self._root(root)
        if self.rank != root:
            return self._prepare_scatter_part(x, out, arg, async_op, stream, root)
        xh, _ = as_host(x)
        self._axis0(xh, "scatter")
        row = of_numpy(xh.dtype)
        comm, dt, dtype, even = self.comm, row.mpi, xh.dtype, sizes is None
        counts, displs, oshape = scatter_layout(xh.shape, sizes, self.size, self.rank)
        slot = self._slot_v(counts, displs, dtype.itemsize, out_is_part=True)
        self._check_role(x, out, xh, oshape, "scatter gives each rank its part of axis 0", slot)
        role = role_of(x, out)
        what = ("scatter", xh.shape, dtype)

        calls, call = _root_calls(comm, False, even, counts, displs, dt, root)
        run_any = self._any_v(role, oshape, dtype, slot, async_op, what, calls)
        run = self._fast_v(x, role, async_op, oshape, dtype, call, run_any)
        return Prepared(SCATTER, x, out, arg, async_op, stream, run)

    def _prepare_scatter_part(self, x, out, arg, async_op, stream, root):
        """scatter away from the root: the front made sure there is an out= (given, or made from
        the root's facts); x is out there (not read)."""
        sizes, rank, comm = arg.sizes, self.rank, self.comm
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
