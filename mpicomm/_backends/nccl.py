"""The NCCL transport: GPU arrays over CuPy's NcclCommunicator, zero-copy.

CuPy arrays are used as they are; PyTorch CUDA tensors through their data pointer
(results come back as tensors, bfloat16 included); other ``__cuda_array_interface__``
or CUDA DLPack objects through ``cupy.asarray``/``cupy.from_dlpack`` (results as CuPy).
Host arrays on this backend take the MPI transport of the same group, so one script
can mix them. Work is enqueued on CuPy's current stream (PyTorch's for tensors) unless
``stream=`` is given; a returned result is ready for use on that stream.
"""
from __future__ import annotations

import time

import numpy as np

from .._arrays import is_gpu_array, is_torch
from .._dtypes import of_numpy, of_torch
from .._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, GATHER, NAMES, RECV, REDUCE, REDUCE_SCATTER,
                    SENDRECV, check_op_dtype, nccl_ops)
from .._topology import select_gpu
from ..errors import BackendUnavailableError, CommunicationError, invalid
from .base import IN_PLACE, NEW, OUT, Backend, Prepared, Work, role_of
from .capture import current_capturing, stream_capturing
from .mpi import MPITransport
from .tagged import TaggedP2P


def _import():
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or CUDA missing
        raise BackendUnavailableError(
            f"the NCCL backend needs CuPy with NCCL ({type(e).__name__}: {e}); install it with "
            "pip install 'mpicomm[cuda12]' (CUDA 13: 'mpicomm[cuda13]'; CuPy alone: pip install cupy-cuda12x), "
            "or use init(backend='mpi')") from None
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
            raise CommunicationError("the NCCL communicator was aborted (a collective timed out or a rank "
                                     "failed, and the job is being aborted: see the error above)")
        return fail


_ABORTED = _Aborted()


class NCCLWork(Work):
    __slots__ = ("_event", "_keep")

    def __init__(self, event, result, what, keep=None):
        super().__init__(result, what)
        self._event = event
        self._keep = keep

    def _poll(self):
        return self._event.done

    def _idle(self):
        time.sleep(5e-5)


def _not_captured(p, x):
    """Prepared call ``p`` on host array ``x`` (it runs at once over MPI), refused while the
    current stream is capturing a CUDA graph: a replay would not repeat it."""
    run = p.run

    def checked(x, out):
        if current_capturing():
            raise invalid("x", f"a host array ({type(x).__module__}.{type(x).__name__}) during a CUDA graph "
                          "capture", "a GPU array: a call on host arrays runs at once over MPI, and a replay of "
                          "the graph would not repeat it (make the call outside the capture, or on GPU arrays)")
        return run(x, out)
    p.run = checked
    return p


class NCCLBackend(Backend):
    name = "nccl"

    def __init__(self, local_rank):
        super().__init__(local_rank)
        cupy, _ = _import()
        err = None
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            n, err = 0, e
        if n == 0:
            raise BackendUnavailableError(
                "the NCCL backend needs a GPU, and CuPy sees none here" + (f" ({err})" if err else "")
                + "; use init(backend='mpi') or unset MPICOMM_BACKEND")
        self.device_id = select_gpu(local_rank)  # before any NCCL communicator exists

    def make_transport(self, mpi_comm):
        return NCCLTransport(mpi_comm, self.device_id)


def _prod(shape):
    r = 1
    for d in shape:
        r *= int(d)
    return r


def _nbytes(a, kind):
    return a.numel() * a.element_size() if kind == "torch" else a.nbytes


def _overlap(p, nb, q, mb):
    """True when [p, p+nb) and [q, q+mb) overlap, unless they are the same bytes (in place)."""
    return p < q + mb and q < p + nb and not (p == q and nb == mb)


def _torch_raw_stream():
    """A function device -> cudaStream_t of PyTorch's current stream (cheap, no Stream object).

    PyTorch's streams come from per-device pools that live as long as the process, so
    the handle stays valid for the watchdog without a reference."""
    import torch

    f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if f is not None:
        return f
    return lambda dev: torch.cuda.current_stream(dev).cuda_stream


class NCCLTransport:
    """Collectives of one group over an NCCL communicator (and MPI for host arrays)."""

    def __init__(self, mpi_comm, device_id):
        cupy, nccl = _import()
        self.cupy, self.nccl = cupy, nccl
        self.host = MPITransport(mpi_comm)
        self.tagged = TaggedP2P(self.host)   # tag != 0 on GPU arrays: staged, over MPI
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.device_id = device_id
        self._nop = nccl_ops(nccl)
        self._torch_stream = None
        local = nccl.get_unique_id()
        uid = mpi_comm.bcast(local if self.rank == 0 else None, root=0)
        with cupy.cuda.Device(device_id):
            self.comm = nccl.NcclCommunicator(self.size, as_uid(uid, local), self.rank)
        # What the watchdog reads: the stream of the last collective (an object, or a
        # PyTorch pool stream's handle) and its (name, shape, dtype).
        self.last_stream = None
        self.last_what = None
        self._prepare = {ALL_REDUCE: self._prepare_all_reduce, ALL_GATHER: self._prepare_all_gather,
                         REDUCE_SCATTER: self._prepare_reduce_scatter, BROADCAST: self._prepare_broadcast,
                         REDUCE: self._prepare_reduce, ALL_TO_ALL: self._prepare_all_to_all}

    def close(self):
        if self.comm is not None and self.comm is not _ABORTED:
            self.comm.destroy()
        self.comm = None
        self.tagged.close()
        self.host.close()

    def abort(self):
        """Abort the NCCL communicator (the watchdog, or an error aborting the job): a later
        call raises CommunicationError instead of waiting on a communicator that is gone."""
        c, self.comm = self.comm, _ABORTED
        if c is not None and c is not _ABORTED:
            c.abort()

    def group_start(self):
        self.nccl.groupStart()

    def group_end(self):
        self.nccl.groupEnd()

    def prepare(self, code, x, out, arg, async_op, stream):
        if x.__class__ is not self.cupy.ndarray and not is_gpu_array(x):
            return _not_captured(self.host.prepare(code, x, out, arg, async_op, stream), x)
        return self._prepare[code](x, out, arg, async_op, stream)

    # ----------------------------------------------------------- array families
    def _family(self, x, arg="x"):
        """(kind, dtype row, device array) of the first call's GPU input.

        kind is "cupy" (CuPy arrays), "torch" (CUDA tensors) or "other" (converted to
        CuPy each call)."""
        cupy = self.cupy
        if x.__class__ is cupy.ndarray:
            kind, a = "cupy", x
        elif is_torch(x):
            kind, a = "torch", x
        else:
            kind, a = "other", (cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x))
        dev = a.get_device() if kind == "torch" else a.data.device_id
        if dev != self.device_id:
            raise invalid(f"{arg}.device", f"cuda:{dev}", f"cuda:{self.device_id}, the GPU of this rank's "
                          "NCCL communicator")
        row = of_torch(a.dtype, arg) if kind == "torch" else of_numpy(a.dtype, arg)
        return kind, row, a

    def _binder(self, kind):
        """bind(x, arg) -> (device array, pointer) for this call's array: contiguous, on this GPU."""
        cupy, dev = self.cupy, self.device_id
        if kind == "cupy":
            fast = hasattr(cupy.empty(0), "_c_contiguous")   # CuPy's flag without a Flags object

            def bind(x, arg="x"):
                if not (x._c_contiguous if fast else x.flags.c_contiguous):
                    x = cupy.ascontiguousarray(x)
                if x.data.device_id != dev:
                    raise invalid(f"{arg}.device", f"cuda:{x.data.device_id}", f"cuda:{dev}, the GPU of this "
                                  "rank's NCCL communicator")
                return x, x.data.ptr
        elif kind == "torch":
            def bind(x, arg="x"):
                if not x.is_contiguous():
                    x = x.contiguous()
                if x.get_device() != dev:
                    raise invalid(f"{arg}.device", str(x.device), f"cuda:{dev}, the GPU of this rank's NCCL "
                                  "communicator")
                return x, x.data_ptr()
        else:
            def bind(x, arg="x"):
                a = cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x)
                return bind_cupy(a, arg)
            bind_cupy = self._binder("cupy")
        return bind

    def _empty(self, kind, like, shape):
        if kind == "torch":
            import torch

            dtype, device = like.dtype, like.device
            return lambda: torch.empty(shape, dtype=dtype, device=device)
        cupy, dtype = self.cupy, like.dtype
        return lambda: cupy.empty(shape, dtype)

    def _streamer(self, stream, kind):
        """A function () -> (cudaStream_t, what the watchdog keeps) for this call's stream."""
        if stream is None:
            if kind == "torch":
                if self._torch_stream is None:
                    self._torch_stream = _torch_raw_stream()
                raw, dev = self._torch_stream, self.device_id

                def cur():
                    p = raw(dev)
                    return p, p
                return cur
            get = self.cupy.cuda.get_current_stream

            def cur():
                st = get()
                return st.ptr, st
            return cur
        if isinstance(stream, int):
            return lambda: (stream, None)   # a bare handle: nothing keeps it alive, so not watched
        p = getattr(stream, "ptr", None)
        if p is None:
            p = getattr(stream, "cuda_stream", None)
        if p is None:
            raise invalid("stream", stream, "a cupy.cuda.Stream, a torch.cuda.Stream or a cudaStream_t (int)")
        return lambda: (p, stream)

    def _out_binder(self, kind, role, oshape, dtype, x0, what, code=None):
        """out(x, xa, xp, out) -> (output array, pointer, result) for this call."""
        bind = self._binder(kind)
        empty = self._empty(kind, x0, oshape)
        tshape = tuple(oshape)
        xnb = _nbytes(x0, kind)
        onb = xnb * self.size if code == ALL_GATHER else (xnb // self.size if code == REDUCE_SCATTER else xnb)
        rank = self.rank

        def slot(p, xp):
            """The collective's own in-place form: x is this rank's part of out (all_gather),
            or out this rank's part of x (reduce_scatter); NCCL does both in place."""
            if code == ALL_GATHER:
                return xp == p + rank * xnb
            if code == REDUCE_SCATTER:
                return p == xp + rank * onb
            return False

        if role is NEW:
            def out_of(x, xa, xp, out):
                o = empty()
                return o, (o.data.ptr if kind != "torch" else o.data_ptr()), o
        elif role is IN_PLACE:
            if tuple(x0.shape) != tshape:
                raise invalid("out", "x (in place)", f"an array of shape {tshape}: {what}")

            def out_of(x, xa, xp, out):
                if xa is not x:
                    raise invalid("out", "x, a non-contiguous array", "a contiguous array (the result is "
                                  "written into it in place)")
                return xa, xp, x
        else:
            def out_of(x, xa, xp, out):
                if not is_gpu_array(out):
                    raise invalid("out", type(out).__name__, "a GPU array on the NCCL backend (the input is one)")
                o, p = bind(out, "out")
                if o is not out:
                    raise invalid("out", "a non-contiguous array", "a C-contiguous array")
                if tuple(o.shape) != tshape:
                    raise invalid("out.shape", tuple(o.shape), f"shape {tshape}")
                if o.dtype != dtype:
                    raise invalid("out.dtype", str(o.dtype), f"dtype {dtype} (the input's)")
                if _overlap(p, _nbytes(o, kind), xp, _nbytes(xa, kind)) and not slot(p, xp):
                    raise invalid("out", "an array that overlaps x", "x itself or a view of exactly x's "
                                  "memory (in place), or an array that shares no memory with x")
                return o, p, out
        return out_of

    def _write_back(self, x, xa, xp, kind):
        if kind == "torch":
            if x.data_ptr() != xp:
                x.copy_(xa)
            return
        cupy = self.cupy
        v = x if kind == "cupy" else (cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x))
        if v.data.ptr != xp:
            v[...] = xa

    def _work(self, p, result, keep, what):
        ev = self.cupy.cuda.Event(block=False, disable_timing=True)
        self.cupy.cuda.runtime.eventRecord(ev.ptr, p)
        w = NCCLWork(ev, result, what, keep)
        if stream_capturing(p):   # captured in a CUDA graph: the replay's stream orders what
            w._done = True        # follows, and the host has nothing to wait for
        return w

    def _prepare_call(self, code, x, out, arg, async_op, stream, meth, extra, oshape_of, rule, count_div=1,
                      op=None):
        """Prepare one NCCL collective ``comm.<meth>(send, recv, count, type, *extra, stream)``.

        ``oshape_of(shape)`` gives the output shape (and validates the input's); the count
        is the input's elements (divided by ``count_div``: reduce_scatter counts the output).
        The run binds this call's arrays: a contiguous array on this GPU, the output (new,
        in place or ``out=``, checked), the stream; the common cases are written out for
        CuPy arrays and PyTorch tensors, anything else takes ``run_any``, which checks
        and converts step by step and raises the errors that name the argument.
        """
        kind, row, a = self._family(x)
        if op is not None:
            check_op_dtype(op, row)
        shape = tuple(a.shape)
        oshape = tuple(oshape_of(shape))
        bcast = code == BROADCAST
        role = role_of(x, out)
        if bcast:
            role = IN_PLACE   # broadcast: in place into x
        dtype, itemsize = a.dtype, (a.dtype.itemsize if kind != "torch" else a.element_size())
        nt = row.nccl
        count = (int(a.size) if kind != "torch" else a.numel()) * row.nccl_scale // count_div
        xnb = itemsize * (int(a.size) if kind != "torch" else a.numel())
        onb = itemsize * _prod(oshape)
        name = NAMES[code]
        what = (name, shape, dtype)
        bind = self._binder(kind)
        out_of = self._out_binder(kind, role, oshape, dtype, a, rule, code) if not bcast else None
        cur = self._streamer(stream, kind)
        transport, dev = self, self.device_id
        if role is OUT:
            out_of(x, *bind(x), out)  # check the first out= now (every rank checks its own alike)
        is_root = code != REDUCE or self.rank == arg[1]

        def run_any(x, out):
            xa, xp = bind(x)
            if bcast:
                o, op_, res = xa, xp, x
            else:
                o, op_, res = out_of(x, xa, xp, out)
            p, st = cur()
            getattr(transport.comm, meth)(xp, op_, count, nt, *extra, p)
            if bcast and xa is not x:   # broadcast filled a contiguous copy of x: write it back
                transport._write_back(x, xa, xp, kind)
            if st is not None:
                transport.last_stream, transport.last_what = st, what
            if not is_root:
                res = None
            if async_op:
                return transport._work(p, res, (xa, o), what)
            return res

        if async_op or kind == "other" or (kind == "cupy" and not hasattr(a, "_c_contiguous")):
            return Prepared(code, x, out, arg, async_op, stream, run_any)
        # The common cases written out (a Python call costs about as much as a check):
        # the NCCL call by collective, the stream, the overlap test inline.
        ocls, empty = x.__class__, self._empty(kind, a, oshape)
        k = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, REDUCE).index(code)
        e0, e1 = (tuple(extra) + (None, None))[:2]
        given = stream is not None
        p0, st0 = cur() if given else (None, None)
        # in place in NCCL's form: x at this offset in out (all_gather), out at this one in x
        # (reduce_scatter); 2**62 never matches a pointer difference of the other collectives
        sx = self.rank * xnb if code == ALL_GATHER else 1 << 62
        so = self.rank * onb if code == REDUCE_SCATTER else 1 << 62

        if kind == "cupy":
            get = self.cupy.cuda.get_current_stream

            def run(x, out):
                if not x._c_contiguous or x.data.device_id != dev:
                    return run_any(x, out)
                xp = x.data.ptr
                if role is NEW:
                    res = empty()
                    op_ = res.data.ptr
                elif role is IN_PLACE:
                    res, op_ = x, xp
                else:
                    if out.__class__ is not ocls or not out._c_contiguous or out.dtype != dtype \
                            or out.shape != oshape or out.data.device_id != dev:
                        return run_any(x, out)
                    op_ = out.data.ptr
                    if op_ < xp + xnb and xp < op_ + onb and not (op_ == xp and onb == xnb) \
                            and op_ + sx != xp and xp + so != op_:   # (the in-place forms: slot())
                        return run_any(x, out)
                    res = out
                if given:
                    p, st = p0, st0
                else:
                    st = get()
                    p = st.ptr
                c = transport.comm
                if k == 0:
                    c.allReduce(xp, op_, count, nt, e0, p)
                elif k == 1:
                    c.reduceScatter(xp, op_, count, nt, e0, p)
                elif k == 2:
                    c.allGather(xp, op_, count, nt, p)
                elif k == 3:
                    c.broadcast(xp, op_, count, nt, e0, p)
                else:
                    c.reduce(xp, op_, count, nt, e0, e1, p)
                transport.last_stream, transport.last_what = st, what
                return res if is_root else None
        else:  # torch
            raw = _torch_raw_stream()

            def run(x, out):
                if not x.is_contiguous() or x.get_device() != dev:
                    return run_any(x, out)
                xp = x.data_ptr()
                if role is NEW:
                    res = empty()
                    op_ = res.data_ptr()
                elif role is IN_PLACE:
                    res, op_ = x, xp
                else:
                    if out.__class__ is not ocls or out.dtype is not dtype or out.shape != oshape \
                            or not out.is_contiguous() or out.get_device() != dev:
                        return run_any(x, out)
                    op_ = out.data_ptr()
                    if op_ < xp + xnb and xp < op_ + onb and not (op_ == xp and onb == xnb) \
                            and op_ + sx != xp and xp + so != op_:   # (the in-place forms: slot())
                        return run_any(x, out)
                    res = out
                if given:
                    p, st = p0, st0
                else:
                    p = st = raw(dev)
                c = transport.comm
                if k == 0:
                    c.allReduce(xp, op_, count, nt, e0, p)
                elif k == 1:
                    c.reduceScatter(xp, op_, count, nt, e0, p)
                elif k == 2:
                    c.allGather(xp, op_, count, nt, p)
                elif k == 3:
                    c.broadcast(xp, op_, count, nt, e0, p)
                else:
                    c.reduce(xp, op_, count, nt, e0, e1, p)
                transport.last_stream, transport.last_what = st, what
                return res if is_root else None

        return Prepared(code, x, out, arg, async_op, stream, run)

    def _prepare_all_reduce(self, x, out, op, async_op, stream):
        return self._prepare_call(ALL_REDUCE, x, out, op, async_op, stream, "allReduce", (self._nop[op],),
                                  lambda s: s, "all_reduce keeps the shape", op=op)

    def _prepare_reduce_scatter(self, x, out, op, async_op, stream):
        n = self.size

        def oshape(s):
            if not s or s[0] % n:
                raise invalid("x.shape", s, f"a first axis divisible by the group size {n} "
                              "(reduce_scatter splits axis 0 into one chunk per rank)")
            return (s[0] // n,) + s[1:]
        return self._prepare_call(REDUCE_SCATTER, x, out, op, async_op, stream, "reduceScatter",
                                  (self._nop[op],), oshape, f"reduce_scatter gives each rank 1/{n} of axis 0",
                                  count_div=n, op=op)

    def _prepare_all_gather(self, x, out, _, async_op, stream):
        n = self.size
        return self._prepare_call(ALL_GATHER, x, out, None, async_op, stream, "allGather", (),
                                  lambda s: (n * s[0],) + s[1:] if s else (n,),
                                  f"all_gather gives axis 0 {n} times as long")

    def _prepare_broadcast(self, x, out, root, async_op, stream):
        root = self.host._root(root)
        return self._prepare_call(BROADCAST, x, None, root, async_op, stream, "broadcast", (root,),
                                  lambda s: s, "broadcast fills x in place")

    def _prepare_reduce(self, x, out, arg, async_op, stream):
        op, root = arg
        root = self.host._root(root)
        return self._prepare_call(REDUCE, x, out, (op, root), async_op, stream, "reduce", (self._nop[op], root),
                                  lambda s: s, "reduce keeps the shape", op=op)

    def _prepare_all_to_all(self, x, out, _, async_op, stream):
        kind, row, a = self._family(x)
        n = self.size
        shape = tuple(a.shape)
        if not shape or shape[0] % n:
            raise invalid("x.shape", shape, f"a first axis divisible by the group size {n} "
                          "(all_to_all sends chunk j of axis 0 to rank j)")
        role = role_of(x, out)
        bind = self._binder(kind)
        out_of = self._out_binder(kind, role, shape, a.dtype, a, "all_to_all keeps the shape")
        cur = self._streamer(stream, kind)
        nt = row.nccl
        count = (int(a.size) if kind != "torch" else a.numel()) * row.nccl_scale // n
        nbytes = count * (a.dtype.itemsize if kind != "torch" else a.element_size()) // row.nccl_scale
        what = ("all_to_all", shape, a.dtype)
        transport, nccl, empty = self, self.nccl, self._empty(kind, a, shape)
        if role is OUT:
            out_of(x, *bind(x), out)

        def run(x, out):
            xa, xp = bind(x)
            o, op_, res = out_of(x, xa, xp, out)
            if op_ == xp:   # in place: NCCL's send and receive buffers must differ; stage the input
                xa = empty()
                xa[...] = o if kind != "torch" else o
                xp = xa.data.ptr if kind != "torch" else xa.data_ptr()
            p, st = cur()
            c = transport.comm
            nccl.groupStart()
            try:
                for j in range(n):
                    c.send(xp + j * nbytes, count, nt, j, p)
                    c.recv(op_ + j * nbytes, count, nt, j, p)
            finally:
                nccl.groupEnd()
            if st is not None:
                transport.last_stream, transport.last_what = st, what
            if async_op:
                return transport._work(p, res, (xa, o), what)
            return res

        return Prepared(ALL_TO_ALL, x, out, None, async_op, stream, run)

    # ----------------------------------------------------------- per-rank sizes, gather, scatter
    # Calls whose arg is a Sized (base, sizes, out_sizes): grouped NCCL send/recv (one
    # ncclGroupStart/End), and for reduce_scatter one ncclReduce per rank in the group.
    _batch = None      # inside mpicomm.batch(): the (event, stream) of each Work, recorded at its end

    def prepare_sized(self, code, x, out, arg, async_op, stream):
        probe = x if x is not None else out
        if probe.__class__ is not self.cupy.ndarray and not is_gpu_array(probe):
            return _not_captured(self.host.prepare_sized(code, x, out, arg, async_op, stream), probe)
        return self._prepare_v(code, x, out, arg, async_op, stream)

    def _prepare_v(self, code, x, out, arg, async_op, stream):
        n, rank = self.size, self.rank
        base, sizes, outs = arg
        name = NAMES[code]
        kind, row, a = self._family(x if x is not None else out, "x" if x is not None else "out")
        shape, dtype = tuple(a.shape), a.dtype
        isz = dtype.itemsize if kind != "torch" else a.element_size()
        scale, nt = row.nccl_scale, row.nccl
        if not shape and not (code == GATHER and sizes is None):
            raise invalid("x.shape", (), f"an array with an axis 0 ({name} splits or joins along it)")
        trail = shape[1:]
        t = _prod(trail)

        def offsets(sz):
            r, acc = [], 0
            for s in sz:
                r.append(acc)
                acc += s
            return r

        sends, recvs, reduces = [], [], []   # (peer, offset in elements, elements)
        nop = None
        is_root = True
        if code == ALL_GATHER:
            if shape[0] != sizes[rank]:
                raise invalid("x.shape", shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
            offs = offsets(sizes)
            oshape = (sum(sizes),) + trail
            sends = [(j, 0, sizes[rank] * t) for j in range(n)]
            recvs = [(j, offs[j] * t, sizes[j] * t) for j in range(n)]
        elif code == ALL_TO_ALL:
            ins, outs_ = sizes, outs
            if ins is None:
                if shape[0] % n:
                    raise invalid("x.shape", shape, f"a first axis divisible by the group size {n}, or in_splits")
                ins = (shape[0] // n,) * n
            elif sum(ins) != shape[0]:
                raise invalid("in_splits", list(ins), f"sizes that add up to x.shape[0] = {shape[0]} (on rank {rank})")
            if outs_ is None:
                o0 = shape[0] if out is None or out is x else int(out.shape[0])
                if o0 % n:
                    raise invalid("out.shape", (o0,) + trail, f"a first axis divisible by the group size {n}, "
                                  "or out_splits (a list, or 'auto')")
                outs_ = (o0 // n,) * n
            so, ro = offsets(ins), offsets(outs_)
            oshape = (sum(outs_),) + trail
            sends = [(j, so[j] * t, ins[j] * t) for j in range(n)]
            recvs = [(j, ro[j] * t, outs_[j] * t) for j in range(n)]
        elif code == REDUCE_SCATTER:
            check_op_dtype(base, row)
            nop = self._nop[base]
            if sum(sizes) != shape[0]:
                raise invalid("sizes", list(sizes), f"sizes that add up to x.shape[0] = {shape[0]}")
            offs = offsets(sizes)
            oshape = (sizes[rank],) + trail
            reduces = [(j, offs[j] * t, sizes[j] * t) for j in range(n)]
        elif code == GATHER:
            root = self.host._root(base)
            is_root = rank == root
            if sizes is None:
                sizes = ((shape[0] if shape else 1),) * n
            elif shape[0] != sizes[rank]:
                raise invalid("x.shape", shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
            offs = offsets(sizes)
            oshape = (sum(sizes),) + trail
            sends = [(root, 0, sizes[rank] * t)]
            recvs = [(j, offs[j] * t, sizes[j] * t) for j in range(n)] if is_root else []
        else:   # SCATTER
            root = self.host._root(base)
            if rank == root:
                if sizes is None:
                    if shape[0] % n:
                        raise invalid("x.shape", shape, f"a first axis divisible by the group size {n} on the root, "
                                      "or sizes")
                    sizes = (shape[0] // n,) * n
                elif sum(sizes) != shape[0]:
                    raise invalid("sizes", list(sizes), f"sizes that add up to the root's x.shape[0] = {shape[0]}")
                offs = offsets(sizes)
                sends = [(j, offs[j] * t, sizes[j] * t) for j in range(n)]
                oshape = (sizes[rank],) + trail
            else:
                if sizes is not None and shape[0] != sizes[rank]:
                    raise invalid("out.shape", shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")
                oshape = shape
            recvs = [(root, 0, _prod(oshape))]
        role = role_of(x, out)
        bind = self._binder(kind)
        empty = self._empty(kind, a, oshape) if is_root else None
        cur = self._streamer(stream, kind)
        what = (name, shape, dtype)
        transport, nccl = self, self.nccl
        toshape = tuple(oshape)
        ptr = (lambda o: o.data_ptr()) if kind == "torch" else (lambda o: o.data.ptr)
        if role is IN_PLACE and toshape != shape:
            raise invalid("out", "x (in place)", f"an array of shape {toshape}: {name} gives that shape")

        def out_of(x, xa, xp, out):
            if out is None:
                o = empty()
                return o, ptr(o), o
            if out is x:
                return xa, xp, x
            if not is_gpu_array(out):
                raise invalid("out", type(out).__name__, "a GPU array on the NCCL backend (the input is one)")
            o, p = bind(out, "out")
            if o is not out:
                raise invalid("out", "a non-contiguous array", "a C-contiguous array")
            if tuple(o.shape) != toshape:
                raise invalid("out.shape", tuple(o.shape), f"shape {toshape}")
            if o.dtype != dtype:
                raise invalid("out.dtype", str(o.dtype), f"dtype {dtype} (the input's)")
            return o, p, out

        def run(x, out):
            if x is not None:
                xa, xp = bind(x)
            else:
                xa, xp = None, 0
            if is_root:
                o, op_, res = out_of(x, xa, xp, out)
                onb = _prod(toshape) * isz
                xnb = _prod(shape) * isz if x is not None else 0
                if x is not None and _overlap(op_, onb, xp, xnb) or (op_ == xp and x is not None and sends):
                    # out shares memory with x (in place, or x a part of out): NCCL needs distinct
                    # send and receive buffers, so send from a copy
                    xa = xa.clone() if kind == "torch" else xa.copy()
                    xp = ptr(xa)
            else:
                o, op_, res = None, 0, None
            p, st = cur()
            c = transport.comm
            nccl.groupStart()
            try:
                for j, off, cnt in sends:
                    if cnt:
                        c.send(xp + off * isz, cnt * scale, nt, j, p)
                for j, off, cnt in recvs:
                    if cnt:
                        c.recv(op_ + off * isz, cnt * scale, nt, j, p)
                for j, off, cnt in reduces:
                    if cnt:
                        c.reduce(xp + off * isz, op_, cnt * scale, nt, nop, j, p)
            finally:
                nccl.groupEnd()
            if st is not None:
                transport.last_stream, transport.last_what = st, what
            if async_op:
                return transport._work(p, res, (xa, o), what)
            return res

        return Prepared(code, x, out, arg, async_op, stream, run, reuse=x is not None)

    def sendrecv(self, x, dst, tag, async_op, stream, out, src):
        """Send ``x`` to ``dst`` and receive from ``src`` as one NCCL group (cannot deadlock)."""
        dst = self.host._root(dst, "dst")
        src = self.host._root(src, "src")
        if tag != 0:
            return self._tagged_sendrecv(x, dst, tag, async_op, stream, out, src)
        kind, row, a = self._family(x)
        bind = self._binder(kind)
        xa, xp = bind(x)
        if out is None:
            o = self._empty(kind, a, tuple(a.shape))()
            res = o
        else:
            okind, orow, _ = self._family(out, "out")
            o, _ = self._binder(okind)(out, "out")
            if o is not out:
                raise invalid("out", "a non-contiguous array", "a C-contiguous array")
            res = out
            row_o = orow
        op_ = o.data_ptr() if kind == "torch" else o.data.ptr
        if op_ == xp:   # the same buffer: send a copy
            xa = xa.clone() if kind == "torch" else xa.copy()
            xp = xa.data_ptr() if kind == "torch" else xa.data.ptr
        p, st = self._streamer(stream, kind)()
        scount = (int(xa.size) if kind != "torch" else xa.numel()) * row.nccl_scale
        ro = row if out is None else row_o
        rcount = (int(o.size) if not is_torch(o) else o.numel()) * ro.nccl_scale
        c = self.comm
        self.nccl.groupStart()
        try:
            c.send(xp, scount, row.nccl, dst, p)
            c.recv(op_, rcount, ro.nccl, src, p)
        finally:
            self.nccl.groupEnd()
        what = ("sendrecv", tuple(xa.shape), xa.dtype)
        if st is not None:
            self.last_stream, self.last_what = st, what
        return self._work(p, res, (xa, o), what) if async_op else res

    def batch_begin(self):
        """mpicomm.batch(): the GPU calls until batch_end are one NCCL group; host arrays take
        the MPI transport's batch."""
        self.host.batch_begin()
        self.nccl.groupStart()
        self._batch = []
        self._work = self._batch_work   # the Works' events are recorded after groupEnd

    def _batch_work(self, p, result, keep, what):
        w = NCCLTransport._work(self, p, result, keep, what)
        self._batch.append((w._event, p))
        return w

    def batch_end(self):
        evs, self._batch = self._batch, None
        del self._work
        try:
            self.nccl.groupEnd()
        finally:
            self.host.batch_end()
        for ev, p in evs:   # after the launch: the events now follow the group's work
            self.cupy.cuda.runtime.eventRecord(ev.ptr, p)

    # ----------------------------------------------------------- point to point, barrier
    def point_to_point(self, code, x, peer, tag, async_op, stream, recv=None):
        if not is_gpu_array(x):
            return self.host.point_to_point(code, x, peer, tag, async_op, stream, recv)
        if code == SENDRECV:
            return self.sendrecv(x, peer, tag, async_op, stream, *recv)
        if tag != 0:
            return self._tagged_p2p(code, x, peer, tag, async_op, stream)
        if peer == self.rank and self._batch is None:
            arg = "src" if code == RECV else "dst"
            raise invalid(arg, peer, f"another rank of the group (0..{self.size - 1}, not this rank {self.rank}): "
                          "on NCCL a send to oneself works inside mpicomm.batch() or with mpicomm.sendrecv")
        arg = "src" if code == RECV else "dst"
        peer = self.host._root(peer, arg)
        if peer == self.rank and not async_op:
            raise invalid(arg, peer, f"another rank of the group (0..{self.size - 1}, not this rank "
                          f"{self.rank}: a blocking call with oneself would never complete; use async_op=True)")
        kind, row, a = self._family(x, "out" if code == RECV else "x")
        xa, xp = self._binder(kind)(x, "out" if code == RECV else "x")
        if code == RECV and xa is not x:
            raise invalid("out", "a non-contiguous array", "a C-contiguous array")
        p, st = self._streamer(stream, kind)()
        count = (int(xa.size) if kind != "torch" else xa.numel()) * row.nccl_scale
        if code == RECV:
            self.comm.recv(xp, count, row.nccl, peer, p)
        else:
            self.comm.send(xp, count, row.nccl, peer, p)
        what = ("recv" if code == RECV else "send", tuple(xa.shape), xa.dtype)
        res = x if code == RECV else None
        return self._work(p, res, (xa,), what) if async_op else res

    # ----------------------------------------------------------- tagged point to point
    # tag != 0 on GPU arrays: staged through host memory and matched by MPI (mpicomm._backends.tagged
    # says why not over NCCL); the copies are on the call's stream.
    def _staged(self, x, arg, stream):
        """(device array, its pointer, dtype row, cudaStream_t) of GPU array ``x``, contiguous."""
        kind, row, _ = self._family(x, arg)
        xa, xp = self._binder(kind)(x, arg)
        p, _ = self._streamer(stream, kind)()
        return xa, xp, row, p

    def _to_host(self, x, stream):
        """A host copy of GPU array ``x``, taken after the work already on the call's stream."""
        xa, xp, row, p = self._staged(x, "x", stream)
        h = np.empty(tuple(xa.shape), row.dtype)
        rt = self.cupy.cuda.runtime
        if h.nbytes:
            rt.memcpyAsync(h.ctypes.data, xp, h.nbytes, rt.memcpyDeviceToHost, p)
        rt.streamSynchronize(p)
        return h

    def _lander(self, xp, p):
        """land(o): copy host array ``o`` into device memory at ``xp`` on stream ``p`` (work
        enqueued on ``p`` afterwards sees it; ``o`` may go once it returns)."""
        rt = self.cupy.cuda.runtime

        def land(o):
            if o.nbytes:
                rt.memcpyAsync(xp, o.ctypes.data, o.nbytes, rt.memcpyHostToDevice, p)
                rt.streamSynchronize(p)   # (o is pageable; the call returns with the data in place)
        return land

    def _tagged_p2p(self, code, x, peer, tag, async_op, stream):
        arg = "src" if code == RECV else "dst"
        peer = self.host._root(peer, arg)
        if peer == self.rank and not async_op:
            raise invalid(arg, peer, f"another rank of the group (0..{self.size - 1}, not this rank "
                          f"{self.rank}: a blocking {'recv from' if code == RECV else 'send to'} oneself "
                          "would never complete; use async_op=True)")
        if code != RECV:
            return self.tagged.send(self._to_host(x, stream), peer, tag, async_op)
        xa, xp, row, p = self._staged(x, "out", stream)
        if xa is not x:
            raise invalid("out", "a non-contiguous array", "a C-contiguous array")
        o = np.empty(tuple(xa.shape), row.dtype)
        return self.tagged.recv(o, peer, tag, async_op, self._lander(xp, p), x)

    def _tagged_sendrecv(self, x, dst, tag, async_op, stream, out, src):
        h = self._to_host(x, stream)
        if out is not None and not is_gpu_array(out):   # a host out=: received by MPI as it is
            return self.tagged.sendrecv(h, dst, tag, async_op, out, src, None, out)
        if out is None:
            kind, _, a = self._family(x)
            out = self._empty(kind, a, tuple(a.shape))()
        oa, op_, row, p = self._staged(out, "out", stream)
        if oa is not out:
            raise invalid("out", "a non-contiguous array", "a C-contiguous array")
        o = np.empty(tuple(oa.shape), row.dtype)
        return self.tagged.sendrecv(h, dst, tag, async_op, o, src, self._lander(op_, p), out)

    def barrier(self, async_op):
        return self.host.barrier(async_op)
