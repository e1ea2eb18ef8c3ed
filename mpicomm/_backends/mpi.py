"""The MPI backend: NumPy (and any host array) over mpi4py; GPU arrays staged via the host."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._arrays import _TABLE, dtype_info, host_out, to_host
from ..errors import invalid
from .._ops import ReduceOp, check_op_dtype
from . import bigcount as _bigcount, shm as _shm
from .base import NO_REPLAY, NO_WEAK, REPLAY_MAX, Backend, Replay, WeakReplay, Work

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX, ReduceOp.AVG: MPI.SUM}
_F32 = np.dtype(np.float32)
_MAX_COUNT = 2 ** 31 - 1  # MPI counts are C ints: larger arrays go in pieces (_bigcount)


class MPIWork(Work):
    __slots__ = ("_reqs", "_post", "_keep")

    def __init__(self, reqs, result, post, what, keep=None):
        super().__init__(result, what)
        self._reqs = reqs
        self._post = post
        # mpi4py does not keep a nonblocking collective's buffers alive: hold them (and any
        # temporary, e.g. the float32 copy of float16 data) until the Work is dropped
        self._keep = keep

    def _poll(self):
        return MPI.Request.Testall(self._reqs)

    def _finish(self):
        if self._post is not None:
            r = self._post()
            if r is not None:
                self._result = r


class MPIBackend(Backend):
    name = "mpi"

    def make_comm(self, mpi_comm):
        return MPIComm(mpi_comm)


class MPIComm:
    """Collectives of one group over an MPI communicator."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._opcache = {}
        self._hot = {}  # (dtype, op) -> (MPI datatype, MPI op): pairs all_reduce has validated
        # the last plain blocking call of each collective, repeated without checks (base.Replay)
        self._r_all_reduce = self._r_all_gather = self._r_reduce_scatter = self._r_broadcast = NO_REPLAY
        self._w_all_gather = self._w_broadcast = NO_WEAK  # the same for large arrays, weakly held
        self.shm = None  # optional single-host shared-memory fast path (mpicomm.backends.shm)
        _shm.configure(self)  # self.shm_min_<collective>: bytes from which it is tried

    def close(self):
        self._r_all_reduce = self._r_all_gather = self._r_reduce_scatter = self._r_broadcast = NO_REPLAY
        self._w_all_gather = self._w_broadcast = NO_WEAK
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    # ----------------------------------------------------------- helpers
    def _mpi_op(self, op, info):
        key = (op, info)
        m = self._opcache.get(key)
        if m is None:
            check_op_dtype(op, info.name, info.floating, info.complex)
            m = self._opcache[key] = _MPI_OPS[op]
        return m

    def _root(self, root, arg="root"):
        if type(root) is not int or not 0 <= root < self.size:
            if isinstance(root, (int, np.integer)) and not isinstance(root, bool) and 0 <= root < self.size:
                return int(root)
            raise invalid(arg, root, f"a group rank in 0..{self.size - 1}")
        return root

    def _out(self, x, out, shape):
        """(host out array, writeback or None)."""
        if out is None:
            return np.empty(shape, x.dtype), None
        return host_out(out, shape, x.dtype)

    def _run(self, start, block, result, post, async_op, what):
        if async_op:
            return MPIWork([start()], result, post, what, start)
        block()
        if post is not None:
            r = post()
            if r is not None:
                return r
        return result

    # ----------------------------------------------------------- collectives
    # Each collective writes its repeat path (base.Replay) out in full: a shared helper
    # would add a Python call, about a tenth of what the path costs.
    def all_reduce(self, x, op, out, async_op, stream=None):
        r = self._r_all_reduce  # the same arrays as the last plain call: repeat it
        if x is r.x and out is r.out and op is r.op and not async_op and x.dtype is r.dtype \
                and x.shape == r.shape:
            if out is None:
                o = np.empty(r.shape, r.dtype)
                self.comm.Allreduce(r.a, [o, r.c], r.d)
                return o
            self.comm.Allreduce(r.a, r.b, r.d)
            return out
        # The hot path: a NumPy array whose (dtype, op) an earlier call validated, needing
        # no conversion, no post-processing and neither the shared-memory nor the
        # large-count path. It repeats none of the checks below.
        if type(x) is np.ndarray and not async_op:
            f = self._hot.get((x.dtype, op))
            if f is not None and x.nbytes < self.shm_min_all_reduce and x.size <= _MAX_COUNT \
                    and x.flags.c_contiguous:
                if out is None:
                    o = np.empty(x.shape, x.dtype)
                elif out is x or (type(out) is np.ndarray and out.shape == x.shape
                                  and out.dtype == x.dtype and out.flags.carray):
                    o = out
                else:
                    o = None
                if o is not None:
                    sb = MPI.IN_PLACE if o is x else [x, f[0]]
                    rb = [o, f[0]]
                    self.comm.Allreduce(sb, rb, f[1])
                    if x.nbytes <= REPLAY_MAX:
                        self._r_all_reduce = Replay(x, out, op, sb, rb if out is not None else None, f[0], f[1])
                    return o
        if type(x) is np.ndarray and x.flags.c_contiguous:
            back = None
        else:
            x, back = to_host(x)
        info = _TABLE.get(x.dtype) or dtype_info(x.dtype)
        mop = self._mpi_op(op, info)
        comm = self.comm
        if out is None:
            o, wb = np.empty(x.shape, x.dtype), None
        elif out is x:
            o, wb = x, None
        else:  # (the usual NumPy out= of a validated call took the hot path above)
            o, wb = host_out(out, x.shape, x.dtype)
        if not async_op and x.nbytes >= self.shm_min_all_reduce:
            r = _shm.all_reduce(self, x, o, info, op, _post(o, wb, back))
            if r is not None:
                return r
        if x.size > _MAX_COUNT:
            return _bigcount.all_reduce(self, x, op, o, wb, back, async_op)
        n = self.size
        if info.upcast:  # float16 / bfloat16: reduce in float32, MPI has no such ops
            t = x.astype(_F32)
            sb, rb = MPI.IN_PLACE, [t, MPI.FLOAT]

            def post():
                if op is ReduceOp.AVG:
                    t.__itruediv__(n)
                o[...] = t
                return _finish(o, wb, back)
        else:
            dt = info.mpi
            sb = MPI.IN_PLACE if o is x else [x, dt]
            rb = [o, dt]
            if op is not ReduceOp.AVG:
                self._hot[(info.dtype, op)] = (dt, mop)
            if op is ReduceOp.AVG or wb is not None or back is not None:
                def post():
                    if op is ReduceOp.AVG:
                        np.divide(o, n, out=o)
                    return _finish(o, wb, back)
            else:
                post = None
        if async_op:
            return MPIWork([comm.Iallreduce(sb, rb, mop)], o, post, ("all_reduce", x.shape, x.dtype), (sb, rb))
        comm.Allreduce(sb, rb, mop)
        if post is not None:
            return post()
        return o

    def all_gather(self, x, out, async_op, stream=None):
        r = self._r_all_gather
        if x is r.x and out is r.out and not async_op and x.dtype is r.dtype and x.shape == r.shape:
            if out is None:
                o = np.empty(r.e, r.dtype)
                self.comm.Allgather(r.a, [o, r.c])
                return o
            self.comm.Allgather(r.a, r.b)
            return out
        w = self._w_all_gather
        if out is not None and w.x() is x and w.out() is out and not async_op and x.dtype is w.dtype \
                and x.shape == w.shape:
            self.comm.Allgather([x, w.c, w.dt], [out, w.dt])
            return out
        x0 = x
        x, back = to_host(x)
        info = _TABLE.get(x.dtype) or dtype_info(x.dtype)
        n = self.size
        shape = (n * x.shape[0],) + x.shape[1:] if x.ndim else (n,)
        o, wb = self._out(x, out, shape)
        if not async_op and o.nbytes >= self.shm_min_all_gather:
            r = _shm.all_gather(self, x, o, _post(o, wb, back))
            if r is not None:
                return r
        if o.size > _MAX_COUNT:
            return _bigcount.all_gather(self, x, o, wb, back, async_op)
        sb, rb = [x, x.size, info.mpi], [o, info.mpi]
        post = (lambda: _finish(o, wb, back)) if (wb or back) else None
        if not async_op and post is None and x is x0:
            self.comm.Allgather(sb, rb)
            if o.nbytes <= REPLAY_MAX:
                self._r_all_gather = Replay(x, out, None, sb, rb if out is not None else None, info.mpi, None, shape)
            elif out is o:
                self._w_all_gather = WeakReplay(x, out, None, x.size, info.mpi)
            return o
        return self._run(lambda: self.comm.Iallgather(sb, rb), lambda: self.comm.Allgather(sb, rb),
                         o, post, async_op, ("all_gather", x.shape, x.dtype))

    def reduce_scatter(self, x, op, out, async_op, stream=None):
        r = self._r_reduce_scatter
        if x is r.x and out is r.out and op is r.op and not async_op and x.dtype is r.dtype \
                and x.shape == r.shape:
            if out is None:
                o = np.empty(r.e, r.dtype)
                self.comm.Reduce_scatter_block(r.a, [o, r.c], r.d)
                return o
            self.comm.Reduce_scatter_block(r.a, r.b, r.d)
            return out
        x0 = x
        x, back = to_host(x)
        info = _TABLE.get(x.dtype) or dtype_info(x.dtype)
        mop = self._mpi_op(op, info)
        n = self.size
        if x.ndim == 0 or x.shape[0] % n:
            raise invalid("x.shape", x.shape, f"a first axis divisible by the group size {n} "
                          "(reduce_scatter splits axis 0 into one chunk per rank)")
        shape = (x.shape[0] // n,) + x.shape[1:]
        o, wb = self._out(x, out, shape)
        if not async_op and x.nbytes >= self.shm_min_reduce_scatter:
            r = _shm.reduce_scatter(self, x, o, info, op, _post(o, wb, back))
            if r is not None:
                return r
        if x.size > _MAX_COUNT:
            return _bigcount.reduce_scatter(self, x, op, o, wb, back, async_op)
        if info.upcast:
            t = x.astype(_F32)
            r = np.empty(shape, _F32)
            sb, rb = [t, MPI.FLOAT], [r, MPI.FLOAT]
        else:
            r = o
            sb, rb = [x, info.mpi], [o, info.mpi]
            if not async_op and op is not ReduceOp.AVG and x is x0 and wb is None and x.nbytes <= REPLAY_MAX:
                self.comm.Reduce_scatter_block(sb, rb, mop)
                self._r_reduce_scatter = Replay(x, out, op, sb, rb if out is not None else None, info.mpi,
                                                mop, shape)
                return o

        def post():
            if op is ReduceOp.AVG:
                np.divide(r, n, out=r)
            if r is not o:
                o[...] = r
            return _finish(o, wb, back)

        return self._run(lambda: self.comm.Ireduce_scatter_block(sb, rb, mop),
                         lambda: self.comm.Reduce_scatter_block(sb, rb, mop),
                         o, post, async_op, ("reduce_scatter", x.shape, x.dtype))

    def broadcast(self, x, root, async_op, stream=None):
        r = self._r_broadcast
        if x is r.x and root is r.op and not async_op and x.dtype is r.dtype and x.shape == r.shape:
            self.comm.Bcast(r.a, root)
            return x
        w = self._w_broadcast
        if w.x() is x and root is w.op and not async_op and x.dtype is w.dtype and x.shape == w.shape:
            self.comm.Bcast([x, w.dt], root)
            return x
        root = self._root(root)
        if type(x) is np.ndarray:
            if not x.flags.c_contiguous:
                raise invalid("x", f"non-contiguous array (shape {x.shape}, strides {x.strides})",
                              "a C-contiguous array (broadcast fills x in place)")
            if not x.flags.writeable:
                raise invalid("x", "read-only array", "a writable array (broadcast fills x in place)")
            h, wb = x, None
        else:
            h, back = to_host(x)
            h, wb = host_out(x, h.shape, h.dtype, "x") if back else (h, None)
            if back and self.rank == root:
                h[...] = to_host(x)[0]
        info = _TABLE.get(h.dtype) or dtype_info(h.dtype)
        post = (lambda: wb(h)) if wb is not None else None
        if not async_op and h.nbytes >= self.shm_min_broadcast:
            r = _shm.broadcast(self, h, root, x, post)
            if r is not None:
                return r
        if h.size > _MAX_COUNT:
            return _bigcount.broadcast(self, h, root, x, post, async_op)
        b = [h, info.mpi]
        if post is None and not async_op and h is x:
            self.comm.Bcast(b, root)
            if x.nbytes <= REPLAY_MAX:
                self._r_broadcast = Replay(x, None, root, b)
            else:
                self._w_broadcast = WeakReplay(x, None, root, None, info.mpi)
            return x
        return self._run(lambda: self.comm.Ibcast(b, root), lambda: self.comm.Bcast(b, root),
                         x, post, async_op, ("broadcast", h.shape, h.dtype))

    def reduce(self, x, op, root, out, async_op, stream=None):
        root = self._root(root)
        x, back = to_host(x)
        info = _TABLE.get(x.dtype) or dtype_info(x.dtype)
        mop = self._mpi_op(op, info)
        n = self.size
        is_root = self.rank == root
        if is_root:
            o, wb = self._out(x, out, x.shape)
        else:
            o, wb = None, None
            if out is not None:  # validate alike on every rank
                host_out(out, x.shape, x.dtype)
        if x.size > _MAX_COUNT:
            return _bigcount.reduce(self, x, op, root, o, wb, back, async_op)
        if info.upcast:
            t = x.astype(_F32)
            r = np.empty(x.shape, _F32) if is_root else None
            sb, rb = [t, MPI.FLOAT], ([r, MPI.FLOAT] if is_root else None)
        else:
            r = o
            sb, rb = [x, info.mpi], ([o, info.mpi] if is_root else None)

        def post():
            if not is_root:
                return None
            if op is ReduceOp.AVG:
                np.divide(r, n, out=r)
            if r is not o:
                o[...] = r
            return _finish(o, wb, back)

        w = self._run(lambda: self.comm.Ireduce(sb, rb, mop, root),
                      lambda: self.comm.Reduce(sb, rb, mop, root),
                      o, post, async_op, ("reduce", x.shape, x.dtype))
        return w

    def all_to_all(self, x, out, async_op, stream=None):
        x, back = to_host(x)
        info = _TABLE.get(x.dtype) or dtype_info(x.dtype)
        n = self.size
        if x.ndim == 0 or x.shape[0] % n:
            raise invalid("x.shape", x.shape, f"a first axis divisible by the group size {n} "
                          "(all_to_all sends chunk j of axis 0 to rank j)")
        o, wb = self._out(x, out, x.shape)
        if x.size > _MAX_COUNT:
            return _bigcount.all_to_all(self, x, o, wb, back, async_op)
        sb, rb = [x, info.mpi], [o, info.mpi]
        post = (lambda: _finish(o, wb, back)) if (wb or back) else None
        return self._run(lambda: self.comm.Ialltoall(sb, rb), lambda: self.comm.Alltoall(sb, rb),
                         o, post, async_op, ("all_to_all", x.shape, x.dtype))

    def send(self, x, dst, tag, async_op, stream=None):
        dst = self._peer(dst, "dst")
        x, _ = to_host(x)
        info = _TABLE.get(x.dtype) or dtype_info(x.dtype)
        b = [x, info.mpi]
        return self._run(lambda: self.comm.Isend(b, dst, tag), lambda: self.comm.Send(b, dst, tag),
                         None, None, async_op, ("send", x.shape, x.dtype))

    def recv(self, out, src, tag, async_op, stream=None):
        src = self._peer(src, "src")
        if type(out) is np.ndarray:
            o, wb = host_out(out, out.shape, out.dtype)
        else:
            h, _ = to_host(out, "out")
            o, wb = host_out(out, h.shape, h.dtype)
        info = _TABLE.get(o.dtype) or dtype_info(o.dtype, "out")
        b = [o, info.mpi]
        post = (lambda: wb(o)) if wb is not None else None
        return self._run(lambda: self.comm.Irecv(b, src, tag), lambda: self.comm.Recv(b, src, tag),
                         out, post, async_op, ("recv", o.shape, o.dtype))

    def barrier(self, async_op=False):
        return self._run(self.comm.Ibarrier, self.comm.Barrier, None, None, async_op,
                         ("barrier", (), None))

    def _peer(self, r, arg):
        r = self._root(r, arg)
        if r == self.rank:
            raise invalid(arg, r, f"another rank of the group (0..{self.size - 1}, not this rank "
                          f"{self.rank}: a blocking send to oneself would never complete)")
        return r


def _post(o, wb, back):
    """The post-step of a shared-memory collective: the write-back, if any."""
    return (lambda: _finish(o, wb, back)) if (wb is not None or back is not None) else None


def _finish(o, wb, back):
    if wb is not None:
        return wb(o)
    if back is not None:
        return back(o)
    return o
