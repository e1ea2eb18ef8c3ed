"""The NCCL backend: GPU arrays over CuPy's NcclCommunicator, zero-copy.

CuPy arrays are used as they are; PyTorch CUDA tensors through their data pointer
(results come back as tensors, bfloat16 included); other ``__cuda_array_interface__``
or CUDA DLPack objects through ``cupy.asarray``/``cupy.from_dlpack`` (results as CuPy).
Host arrays on this backend take the MPI path of the same group, so one script can
mix them. Work is enqueued on CuPy's current stream (PyTorch's for tensors) unless
``stream=`` is given; a returned result is ready for use on that stream.
"""
from __future__ import annotations

import time

import numpy as np

from .._arrays import _TABLE, BFLOAT16, dtype_info, is_gpu_array
from ..errors import BackendUnavailableError, invalid
from .._ops import ReduceOp, check_op_dtype
from .base import NO_REPLAY, REPLAY_MAX, Backend, Replay, Work
from .mpi import MPIComm

_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}


def _import():
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or CUDA missing
        raise BackendUnavailableError(
            f"the NCCL backend needs CuPy with NCCL ({type(e).__name__}: {e}); install it with "
            "pip install 'mpicomm[cuda12]' (or [cuda13]), or use init(backend='mpi')") from None
    return cupy, nccl


def as_uid(uid, like):
    """Convert a broadcast NCCL unique id to the form this CuPy uses (bytes, or a tuple of ints)."""
    if isinstance(like, (bytes, bytearray)):
        if isinstance(uid, (bytes, bytearray)):
            return bytes(uid)
        return bytes((int(v) & 0xFF) for v in uid)
    if isinstance(uid, (bytes, bytearray)):
        return tuple(v - 256 if v > 127 else v for v in uid)
    return tuple(uid)


class _Aborted:
    """Stands for an aborted NCCL communicator: every call on it raises CommunicationError."""

    def __getattr__(self, name):
        def fail(*args, **kw):
            from ..errors import CommunicationError

            raise CommunicationError("the NCCL communicator was aborted (a collective timed out or a rank "
                                     "failed, and the job is being aborted: see the error above)")
        return fail


_ABORTED = _Aborted()


class NCCLWork(Work):
    __slots__ = ("_event", "_post")

    def __init__(self, event, result, post, what):
        super().__init__(result, what)
        self._event = event
        self._post = post

    def _poll(self):
        return self._event.done

    def _idle(self):
        time.sleep(5e-5)

    def _finish(self):
        if self._post is not None:
            r = self._post()
            if r is not None:
                self._result = r


class NCCLBackend(Backend):
    name = "nccl"

    def __init__(self, ctx):
        super().__init__(ctx)
        cupy, _ = _import()
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            n = 0
            err = e
        if n == 0:
            raise BackendUnavailableError(
                "the NCCL backend needs a GPU, and CuPy sees none here"
                + (f" ({err})" if 'err' in locals() else "")
                + "; use init(backend='mpi') or unset MPICOMM_BACKEND")
        from .._topology import select_gpu

        ctx.device_id = select_gpu(ctx.local_rank)  # before any NCCL communicator exists

    def make_comm(self, mpi_comm):
        return NCCLComm(mpi_comm, self.ctx.device_id)


class _Torch:
    """PyTorch tensors through their data pointer, without CuPy in between."""

    _dtypes = None

    @classmethod
    def info(cls, t, arg):
        if cls._dtypes is None:
            import torch

            cls._dtypes = {getattr(torch, n): dtype_info(np.dtype(n)) for n in (
                "int8", "uint8", "int32", "int64", "float16", "float32", "float64",
                "complex64", "complex128")}
            if BFLOAT16 is not None:
                cls._dtypes[torch.bfloat16] = dtype_info(BFLOAT16)
        i = cls._dtypes.get(t.dtype)
        if i is None:
            raise invalid(f"{arg}.dtype", str(t.dtype), "a dtype NCCL can reduce (int8, uint8, int32, "
                          "int64, float16, bfloat16, float32, float64, complex64, complex128)")
        return i


class NCCLComm:
    """Collectives of one group over an NCCL communicator (and MPI for host arrays)."""

    def __init__(self, mpi_comm, device_id):
        cupy, nccl = _import()
        self.cupy = cupy
        self._ndarray = cupy.ndarray
        self._empty_cp = cupy.empty
        self._cur = cupy.cuda.get_current_stream
        self._fastops = {}  # (dtype, op or None) -> (ncclDataType, ncclRedOp, count scale), once validated
        # CuPy's readonly flag attribute; without it, the general path validates every call
        self._hot = hasattr(cupy.empty(0), "_c_contiguous")
        self.nccl = nccl
        self.host = MPIComm(mpi_comm)
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.device_id = device_id
        local = nccl.get_unique_id()
        uid = mpi_comm.bcast(local if self.rank == 0 else None, root=0)
        with cupy.cuda.Device(device_id):
            self.comm = nccl.NcclCommunicator(self.size, as_uid(uid, local), self.rank)
        self._opcache = {}
        # the last plain blocking call of each collective on CuPy arrays, repeated without checks
        self._r_all_reduce = self._r_all_gather = self._r_reduce_scatter = self._r_broadcast = NO_REPLAY
        # the stream object and input of the last collective, for the watchdog
        # (mpicomm._reliability): it records an event on that stream once the call is made, and
        # names the input's shape if the event never completes. The reference keeps the CUDA
        # stream alive; the watchdog drops the input's reference once the event has completed.
        self.last_stream = None
        self.last_x = None

    def _forget(self):
        self._r_all_reduce = self._r_all_gather = self._r_reduce_scatter = self._r_broadcast = NO_REPLAY

    def close(self):
        self._forget()
        if self.comm is not None and self.comm is not _ABORTED:
            self.comm.destroy()
        self.comm = None
        self.host.close()

    def abort(self):
        """Abort the NCCL communicator (the watchdog, or an error aborting the job): a later
        call raises CommunicationError instead of waiting on a communicator that is gone."""
        self._forget()
        c, self.comm = self.comm, _ABORTED
        if c is not None and c is not _ABORTED:
            c.abort()

    # ----------------------------------------------------------- helpers
    def _dev(self, x, arg="x"):
        """(cupy array or torch tensor, info, kind) for a GPU array; contiguous."""
        cupy = self.cupy
        if type(x) is cupy.ndarray:
            if x.data.device_id == self.device_id and x.flags.c_contiguous:  # the hot path
                return x, _TABLE.get(x.dtype) or dtype_info(x.dtype, arg), "cupy"
            a = x
            kind = "cupy"
        elif type(x).__module__.startswith("torch"):
            if not x.is_contiguous():
                x = x.contiguous()
            if x.device.index != self.device_id:
                raise invalid(f"{arg}.device", str(x.device), f"cuda:{self.device_id}, the GPU of this "
                              "rank's NCCL communicator")
            return x, _Torch.info(x, arg), "torch"
        elif hasattr(x, "__cuda_array_interface__"):
            a, kind = cupy.asarray(x), "cupy"
        else:
            a, kind = cupy.from_dlpack(x), "cupy"
        if not a.flags.c_contiguous:
            a = cupy.ascontiguousarray(a)
        if a.device.id != self.device_id:
            raise invalid(f"{arg}.device", f"cuda:{a.device.id}", f"cuda:{self.device_id}, the GPU of "
                          "this rank's NCCL communicator")
        return a, dtype_info(a.dtype, arg), kind

    @staticmethod
    def _ptr(a, kind):
        return a.data.ptr if kind == "cupy" else a.data_ptr()

    def _empty(self, like, kind, shape):
        if kind == "cupy":
            return self.cupy.empty(shape, like.dtype)
        import torch

        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _out(self, x, kind, out, shape, arg="out"):
        if out is None:
            return self._empty(x, kind, shape)
        if out is x:
            return x
        o, _, okind = self._dev(out, arg) if is_gpu_array(out) else (None, None, None)
        if o is None:
            raise invalid(arg, type(out).__name__, "a GPU array on the NCCL backend (the input is one)")
        if tuple(o.shape) != tuple(shape):
            raise invalid(f"{arg}.shape", tuple(o.shape), f"shape {tuple(shape)}")
        if o.dtype != x.dtype:
            raise invalid(f"{arg}.dtype", str(o.dtype), f"dtype {x.dtype} (the input's)")
        if okind == "torch" and o is not out:
            raise invalid(arg, "non-contiguous tensor", "a contiguous tensor")
        if okind == "cupy" and o is not out and type(out) is self.cupy.ndarray:
            raise invalid(arg, f"non-contiguous array (shape {out.shape}, strides {out.strides})",
                          "a C-contiguous array")
        return o

    def _stream(self, stream, kind):
        """(cudaStream_t, the stream object or None): ``stream=`` or the current stream.

        A stream given as a bare handle (int) comes back with None: nothing keeps it alive,
        so the watchdog does not record events on it (mpicomm._reliability).
        """
        if stream is None:
            if kind == "torch":
                import torch

                st = torch.cuda.current_stream()
                return st.cuda_stream, st
            st = self.cupy.cuda.get_current_stream()
            return st.ptr, st
        if isinstance(stream, int):
            return stream, None
        p = getattr(stream, "ptr", None)
        if p is None:
            p = getattr(stream, "cuda_stream", None)
        if p is None:
            raise invalid("stream", stream, "a cupy.cuda.Stream, a torch.cuda.Stream or a cudaStream_t (int)")
        return p, stream

    def _op(self, op, info):
        key = (op, info)
        c = self._opcache.get(key)
        if c is None:
            check_op_dtype(op, info.name, info.floating, info.complex)
            c = self._opcache[key] = _NCCL_OPS[op]
            self._fastops[(info.dtype, op)] = (info.nccl, c, info.nccl_scale)
        return c

    # The hot path: a contiguous CuPy array on this GPU whose (dtype, op) was validated by
    # an earlier call, no stream= and no async: no validation work is repeated.
    def _fast(self, x, op, stream, async_op):
        if type(x) is self._ndarray and self._hot and stream is None and not async_op \
                and x._c_contiguous and x.data.device_id == self.device_id:
            return self._fastops.get((x.dtype, op))
        return None

    def _fast_out(self, x, out, shape):
        if out is None:
            return self._empty_cp(shape, x.dtype)
        if out is x:
            return x
        if type(out) is self._ndarray and out._c_contiguous and out.dtype == x.dtype \
                and out.shape == shape and out.data.device_id == self.device_id:
            return out
        return None

    def _count(self, a, info):
        return (a.size if hasattr(a, "size") and not callable(a.size) else a.numel()) * info.nccl_scale

    def _done(self, st, x, result, async_op, s, what, post=None):
        if st is not None:  # (None: a bare stream handle, or send/recv, which are not watched)
            self.last_stream = st
            self.last_x = x
        if async_op:
            what = what if what[1] is not None else (what[0], tuple(result.shape), result.dtype)
            ev = self.cupy.cuda.Event(block=False, disable_timing=True)
            self.cupy.cuda.runtime.eventRecord(ev.ptr, s)
            return NCCLWork(ev, result, post, what)
        if post is not None:
            return post()
        return result

    def _check_comm(self):
        if self.comm is None or self.comm is _ABORTED:
            from ..errors import CommunicationError

            raise CommunicationError("the NCCL communicator was aborted or closed")

    # ----------------------------------------------------------- collectives
    # Each collective writes its repeat path (base.Replay) out in full: a shared helper
    # would add a Python call, about a tenth of what the path costs.
    def all_reduce(self, x, op, out, async_op, stream=None):
        r = self._r_all_reduce  # the same CuPy arrays as the last plain call: repeat it
        if x is r.x and out is r.out and op is r.op and stream is None and not async_op \
                and x.dtype is r.dtype and x.shape == r.shape:
            st = self._cur()
            s = st.ptr
            if out is None:
                out = self._empty_cp(r.shape, r.dtype)
                self.comm.allReduce(r.a, out.data.ptr, r.c, r.d, r.e, s)
            else:
                self.comm.allReduce(r.a, r.b, r.c, r.d, r.e, s)
            self.last_stream = st
            self.last_x = x
            return out
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.all_reduce(x, op, out, async_op, stream)
        f = self._fast(x, op, stream, async_op)
        if f is not None:
            o = self._fast_out(x, out, x.shape)
            if o is not None:
                st = self._cur()
                s = st.ptr
                p, n = x.data.ptr, x.size * f[2]
                self.comm.allReduce(p, o.data.ptr, n, f[0], f[1], s)
                self.last_stream = st
                self.last_x = x
                if x.nbytes <= REPLAY_MAX:
                    self._r_all_reduce = Replay(x, out, op, p, o.data.ptr, n, f[0], f[1])
                return o
        a, info, kind = self._dev(x)
        nop = self._op(op, info)
        o = self._out(a, kind, out, a.shape)
        s, st = self._stream(stream, kind)
        self.comm.allReduce(self._ptr(a, kind), self._ptr(o, kind), self._count(a, info), info.nccl, nop, s)
        return self._done(st, a, o, async_op, s, ("all_reduce", None))

    def all_gather(self, x, out, async_op, stream=None):
        r = self._r_all_gather
        if x is r.x and out is r.out and stream is None and not async_op \
                and x.dtype is r.dtype and x.shape == r.shape:
            st = self._cur()
            s = st.ptr
            if out is None:
                out = self._empty_cp(r.e, r.dtype)
                self.comm.allGather(r.a, out.data.ptr, r.c, r.d, s)
            else:
                self.comm.allGather(r.a, r.b, r.c, r.d, s)
            self.last_stream = st
            self.last_x = x
            return out
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.all_gather(x, out, async_op, stream)
        f = self._fast(x, None, stream, async_op)
        if f is not None and x.ndim:
            shape = (self.size * x.shape[0],) + x.shape[1:]
            o = self._fast_out(x, out, shape)
            if o is not None:
                st = self._cur()
                s = st.ptr
                p, n = x.data.ptr, x.size * f[2]
                self.comm.allGather(p, o.data.ptr, n, f[0], s)
                self.last_stream = st
                self.last_x = x
                if o.nbytes <= REPLAY_MAX:
                    self._r_all_gather = Replay(x, out, None, p, o.data.ptr, n, f[0], shape)
                return o
        a, info, kind = self._dev(x)
        self._fastops.setdefault((info.dtype, None), (info.nccl, None, info.nccl_scale))
        shape = (self.size * a.shape[0],) + tuple(a.shape[1:]) if a.ndim else (self.size,)
        o = self._out(a, kind, out, shape)
        s, st = self._stream(stream, kind)
        self.comm.allGather(self._ptr(a, kind), self._ptr(o, kind), self._count(a, info), info.nccl, s)
        return self._done(st, a, o, async_op, s, ("all_gather", tuple(a.shape), a.dtype) if async_op else None)

    def reduce_scatter(self, x, op, out, async_op, stream=None):
        r = self._r_reduce_scatter
        if x is r.x and out is r.out and op is r.op and stream is None and not async_op \
                and x.dtype is r.dtype and x.shape == r.shape:
            st = self._cur()
            s = st.ptr
            if out is None:
                out = self._empty_cp(r.f, r.dtype)
                self.comm.reduceScatter(r.a, out.data.ptr, r.c, r.d, r.e, s)
            else:
                self.comm.reduceScatter(r.a, r.b, r.c, r.d, r.e, s)
            self.last_stream = st
            self.last_x = x
            return out
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.reduce_scatter(x, op, out, async_op, stream)
        f = self._fast(x, op, stream, async_op)
        if f is not None and x.ndim and x.shape[0] % self.size == 0:
            shape = (x.shape[0] // self.size,) + x.shape[1:]
            o = self._fast_out(x, out, shape)
            if o is not None and o is not x:
                st = self._cur()
                s = st.ptr
                p, n = x.data.ptr, o.size * f[2]
                self.comm.reduceScatter(p, o.data.ptr, n, f[0], f[1], s)
                self.last_stream = st
                self.last_x = x
                if x.nbytes <= REPLAY_MAX:
                    self._r_reduce_scatter = Replay(x, out, op, p, o.data.ptr, n, f[0], f[1], shape)
                return o
        a, info, kind = self._dev(x)
        nop = self._op(op, info)
        n = self.size
        if a.ndim == 0 or a.shape[0] % n:
            raise invalid("x.shape", tuple(a.shape), f"a first axis divisible by the group size {n} "
                          "(reduce_scatter splits axis 0 into one chunk per rank)")
        shape = (a.shape[0] // n,) + tuple(a.shape[1:])
        o = self._out(a, kind, out, shape)
        s, st = self._stream(stream, kind)
        self.comm.reduceScatter(self._ptr(a, kind), self._ptr(o, kind), self._count(o, info),
                                info.nccl, nop, s)
        return self._done(st, a, o, async_op, s, ("reduce_scatter", tuple(a.shape), a.dtype) if async_op else None)

    def broadcast(self, x, root, async_op, stream=None):
        r = self._r_broadcast
        if x is r.x and root is r.op and stream is None and not async_op \
                and x.dtype is r.dtype and x.shape == r.shape:
            st = self._cur()
            s = st.ptr
            self.comm.broadcast(r.a, r.a, r.c, r.d, root, s)
            self.last_stream = st
            self.last_x = x
            return x
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.broadcast(x, root, async_op, stream)
        f = self._fast(x, None, stream, async_op)
        if f is not None and type(root) is int and 0 <= root < self.size:
            st = self._cur()
            s = st.ptr
            p, n = x.data.ptr, x.size * f[2]
            self.comm.broadcast(p, p, n, f[0], root, s)
            self.last_stream = st
            self.last_x = x
            if x.nbytes <= REPLAY_MAX:
                self._r_broadcast = Replay(x, None, root, p, None, n, f[0])
            return x
        root = self.host._root(root)
        a, info, kind = self._dev(x)
        self._fastops.setdefault((info.dtype, None), (info.nccl, None, info.nccl_scale))
        if a is not x and kind == "cupy" and type(x) is self.cupy.ndarray:
            raise invalid("x", f"non-contiguous array (shape {x.shape}, strides {x.strides})",
                          "a C-contiguous array (broadcast fills x in place)")
        s, st = self._stream(stream, kind)
        p = self._ptr(a, kind)
        self.comm.broadcast(p, p, self._count(a, info), info.nccl, root, s)
        return self._done(st, a, x, async_op, s, ("broadcast", tuple(a.shape), a.dtype) if async_op else None)

    def reduce(self, x, op, root, out, async_op, stream=None):
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.reduce(x, op, root, out, async_op, stream)
        root = self.host._root(root)
        a, info, kind = self._dev(x)
        nop = self._op(op, info)
        o = self._out(a, kind, out, a.shape)
        s, st = self._stream(stream, kind)
        self.comm.reduce(self._ptr(a, kind), self._ptr(o, kind), self._count(a, info), info.nccl, nop,
                         root, s)
        return self._done(st, a, o if self.rank == root else None, async_op, s, ("reduce", tuple(a.shape), a.dtype))

    def all_to_all(self, x, out, async_op, stream=None):
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.all_to_all(x, out, async_op, stream)
        a, info, kind = self._dev(x)
        n = self.size
        if a.ndim == 0 or a.shape[0] % n:
            raise invalid("x.shape", tuple(a.shape), f"a first axis divisible by the group size {n} "
                          "(all_to_all sends chunk j of axis 0 to rank j)")
        o = self._out(a, kind, out, a.shape)
        if o is a:
            raise invalid("out", "x (in place)", "a different array: all_to_all cannot run in place on NCCL")
        s, st = self._stream(stream, kind)
        cnt = self._count(a, info) // n
        nbytes = cnt * a.dtype.itemsize // info.nccl_scale if hasattr(a.dtype, "itemsize") \
            else cnt * a.element_size() // info.nccl_scale
        sp, rp = self._ptr(a, kind), self._ptr(o, kind)
        nccl = self.nccl
        nccl.groupStart()
        try:
            for j in range(n):
                self.comm.send(sp + j * nbytes, cnt, info.nccl, j, s)
                self.comm.recv(rp + j * nbytes, cnt, info.nccl, j, s)
        finally:
            nccl.groupEnd()
        return self._done(st, a, o, async_op, s, ("all_to_all", tuple(a.shape), a.dtype))

    def send(self, x, dst, tag, async_op, stream=None):
        if type(x) is not self._ndarray and not is_gpu_array(x):
            return self.host.send(x, dst, tag, async_op, stream)
        dst = self.host._peer(dst, "dst")
        a, info, kind = self._dev(x)
        s, st = self._stream(stream, kind)
        self.comm.send(self._ptr(a, kind), self._count(a, info), info.nccl, dst, s)
        return self._done(None, a, None, async_op, s, ("send", tuple(a.shape), a.dtype))

    def recv(self, out, src, tag, async_op, stream=None):
        if not is_gpu_array(out):
            return self.host.recv(out, src, tag, async_op, stream)
        src = self.host._peer(src, "src")
        a, info, kind = self._dev(out, "out")
        if a is not out and kind == "cupy":
            raise invalid("out", "non-contiguous array", "a C-contiguous array")
        s, st = self._stream(stream, kind)
        self.comm.recv(self._ptr(a, kind), self._count(a, info), info.nccl, src, s)
        return self._done(None, a, out, async_op, s, ("recv", tuple(a.shape), a.dtype))

    def barrier(self, async_op=False):
        return self.host.barrier(async_op)
