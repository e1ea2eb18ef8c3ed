"""The NCCL transport: GPU arrays over CuPy's NcclCommunicator, zero-copy.

CuPy arrays are used as they are; PyTorch CUDA tensors through their data pointer
(results come back as tensors, bfloat16 included); other ``__cuda_array_interface__``
or CUDA DLPack objects through ``cupy.asarray``/``cupy.from_dlpack`` (results as CuPy).
Host arrays on this backend take the MPI transport of the same group, so one script
can mix them. Work is enqueued on CuPy's current stream (PyTorch's for tensors) unless
``stream=`` is given; a returned result is ready for use on that stream.
"""
from __future__ import annotations

import gc
import sys
import threading
import time

from .._arrays import is_gpu_array, is_torch
from .._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, GATHER, NAMES, RECV, REDUCE, REDUCE_SCATTER,
                    SCATTER, SENDRECV, ReduceOp, check_op_dtype, nccl_ops, wire_op)
from .._timing import TIMING
from .._topology import select_gpu
from .. import _native
from ..errors import BackendUnavailableError, CommunicationError, invalid
from .base import IN_PLACE, NEW, OUT, Backend, Prepared, Work, role_of
from .gpu_arrays import _C_CONTIGUOUS, GPUArrays, cupy_stream_ptr, given_out, nbytes, overlap, prod
from .nccl_layouts import LAYOUTS
from .nccl_tagged import StagedTags
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
            "pip install '.[cuda12]' in mpicomm's source tree (CUDA 13: '.[cuda13]'; CuPy alone: pip install cupy-cuda12x), "
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


# finalize() gives ncclCommDestroy TIMING.destroy_wait s. NCCL waits in it until every CUDA
# graph that captured a call of the communicator has been destroyed (the graph holds the
# communicator's resources): a graph still referenced at finalize() would make it wait forever.


def _destroy(comm, rank, device):
    """Destroy NCCL communicator ``comm`` (in a thread on ``device()``, a context manager)
    within ``TIMING.destroy_wait`` s, else say why and go on."""
    gc.collect()   # graphs nobody references any more go first
    done = []

    def destroy():
        try:
            with device():
                comm.destroy()
        finally:
            done.append(True)
    t = threading.Thread(target=destroy, name="mpicomm-nccl-destroy", daemon=True)
    t.start()
    t.join(TIMING.destroy_wait)
    if not done:
        print(f"mpicomm: rank {rank}: finalize() could not destroy the NCCL communicator within "
              f"{TIMING.destroy_wait:g} s: NCCL waits until every CUDA graph that captured one of its calls is "
              "destroyed. Delete such graphs (del graph) before finalize(); the communicator is left to "
              "the process's exit.", file=sys.stderr, flush=True)


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


class NCCLTransport(GPUArrays, StagedTags):
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
        if self.size == 1:   # the mean over one rank is its sum: NCCL 2.28's ncclAvg on a one-rank
            # communicator leaves the last elements of a message of 512 KiB or more unwritten
            # where the count is not a multiple of 4 (ncclSum does not; measured on an H200)
            self._nop[ReduceOp.AVG] = self._nop[ReduceOp.SUM]
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
        c, self.comm = self.comm, None
        if c is not None and c is not _ABORTED:
            _destroy(c, self.rank, lambda: self.cupy.cuda.Device(self.device_id))
        self.tagged.close()
        self.host.close()

    def fresh_host(self, mpi_comm):
        """Host arrays' MPI transport over ``mpi_comm``: the group's fresh communicator after a
        disagreement (what the failed call left pending stays in the old one). The NCCL
        communicator stays: NCCL has no way to make a fresh one but a whole new init."""
        old, oldt = self.host, self.tagged
        self.host = MPITransport(mpi_comm)
        self.tagged = TaggedP2P(self.host)
        oldt.close()
        old.close()

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

    def _work(self, p, result, keep, what):
        ev = self.cupy.cuda.Event(block=False, disable_timing=True)
        self.cupy.cuda.runtime.eventRecord(ev.ptr, p)
        w = NCCLWork(ev, result, what, keep)
        if self._batch is not None:   # in a batch: recorded again after the group's launch
            self._batch.append((ev, p))
        if stream_capturing(p):   # captured in a CUDA graph: the replay's stream orders what
            w._done = True        # follows, and the host has nothing to wait for
        return w

    def _prepare_call(self, code, x, out, arg, async_op, stream, meth, extra, oshape_of, rule, count_div=1,
                      op=None):
        """Prepare one NCCL collective ``comm.<meth>(send, recv, count, type, *extra, stream)``.

        ``oshape_of(shape)`` gives the output shape (and validates the input's); the count
        is the input's elements (divided by ``count_div``: reduce_scatter counts the output).
        ``run`` binds this call's arrays through the array kind's accessors (mpicomm.
        _backends.gpu_arrays): a contiguous array on this GPU, the output (new, in place or
        ``out=``, checked), the stream; anything it does not take as it comes (a
        non-contiguous array, an ``out=`` that differs from the first call's, another
        kind, an async call) goes to ``run_any``, which checks and converts step by step and
        raises the errors that name the argument.
        """
        kind, row, a = self._family(x)
        if op is not None:   # a reduction: NCCL's op (bool: SUM/MAX -> MAX, PROD/MIN -> MIN) goes first
            check_op_dtype(op, row, nccl=True)
            extra = (self._nop[wire_op(op, row)], *extra)
        shape = tuple(a.shape)
        oshape = tuple(oshape_of(shape))
        bcast = code == BROADCAST
        role = IN_PLACE if bcast else role_of(x, out)   # broadcast: in place into x
        dtype, itemsize = a.dtype, (a.dtype.itemsize if kind != "torch" else a.element_size())
        nt = row.nccl
        count = (int(a.size) if kind != "torch" else a.numel()) * row.nccl_scale // count_div
        xnb = itemsize * (int(a.size) if kind != "torch" else a.numel())
        onb = itemsize * prod(oshape)
        what = (NAMES[code], shape, dtype)
        bind = self._binder(kind)
        out_of = self._out_binder(kind, role, oshape, dtype, a, rule, code) if not bcast else None
        cur = self._streamer(stream, kind)
        if role is OUT:
            out_of(x, *bind(x), out)  # check the first out= now (every rank checks its own alike)
        is_root = code != REDUCE or self.rank == arg[1]
        run_any = self._run_any(bind, out_of, cur, meth, (count, nt, *extra), kind, what, is_root, async_op,
                                self._on_stream(stream, kind))
        if async_op or kind == "other":
            return Prepared(code, x, out, arg, async_op, stream, run_any)
        return Prepared(code, x, out, arg, async_op, stream,
                        self._run(code, x, a, kind, role, oshape, dtype, xnb, onb, count, nt, extra, stream, meth,
                                  is_root, what, run_any))

    def _run_any(self, bind, out_of, cur, meth, args, kind, what, is_root, async_op, on):
        """A collective's run that checks and converts its arrays step by step (out_of None:
        broadcast, in place into x, written back when x is not contiguous)."""
        transport = self

        def run_any(x, out):
            with on():   # (a contiguous copy of x on the call's stream)
                xa, xp = bind(x)
            if out_of is None:
                o, op_, res = xa, xp, x
            else:
                o, op_, res = out_of(x, xa, xp, out)
            p, st = cur()
            getattr(transport.comm, meth)(xp, op_, *args, p)
            if out_of is None and xa is not x:   # broadcast filled a contiguous copy of x: write it back
                with on():
                    transport._write_back(x, xa, xp, kind)
            elif out_of is not None and o is not res and res is out:   # the result staged apart from
                with on():                                             # x (out= one of x's chunks)
                    transport._write_back(out, o, op_, kind)
            if st is not None:
                transport.last_stream, transport.last_what = st, what
            if not is_root:
                res = None
            if async_op:
                return transport._work(p, res, (xa, o), what)
            return res
        return run_any

    def _run(self, code, x, a, kind, role, oshape, dtype, xnb, onb, count, nt, extra, stream, meth, is_root, what,
             run_any):
        """The run of a blocking collective on CuPy arrays or PyTorch tensors: the arrays
        bound through the kind's accessors, the library call bound here; anything else
        (a non-contiguous array, an out= unlike the first call's, an aborted comm) takes
        ``run_any``."""
        transport = self
        cur = self._streamer(stream, kind)
        k = self.kind(kind)
        ptr, contiguous, device, dev = k.ptr, k.contiguous, k.device, self.device_id
        ocls, empty = x.__class__, self._empty(kind, a, oshape)
        comm = self.comm
        lib = getattr(comm, meth)   # the library call, bound now (an aborted comm goes to run_any)
        e0, e1 = (tuple(extra) + (None, None))[:2]
        given = stream is not None
        p0, st0 = cur() if given else (None, None)
        get, sptr = k.current_stream, k.stream_ptr
        # in place in NCCL's form: x at this offset in out (all_gather), out at this one in x
        # (reduce_scatter); 2**62 never matches a pointer difference of the other collectives
        sx = self.rank * xnb if code == ALL_GATHER else 1 << 62
        so = self.rank * onb if code == REDUCE_SCATTER else 1 << 62

        def run(x, out):
            if not contiguous(x) or device(x) != dev or transport.comm is not comm:
                return run_any(x, out)
            xp = ptr(x)
            if role is NEW:
                res = empty()
                op_ = ptr(res)
            elif role is IN_PLACE:
                res, op_ = x, xp
            else:
                if out.__class__ is not ocls or (out.dtype is not dtype and out.dtype != dtype) \
                        or out.shape != oshape or not contiguous(out) or device(out) != dev:
                    return run_any(x, out)
                op_ = ptr(out)
                if op_ < xp + xnb and xp < op_ + onb and not (op_ == xp and onb == xnb) \
                        and op_ + sx != xp and xp + so != op_:   # (the in-place forms: slot())
                    return run_any(x, out)
                res = out
            if given:
                p, st = p0, st0
            else:
                st = get()
                p = sptr(st)
            if e1 is not None:     # reduce: op, root
                lib(xp, op_, count, nt, e0, e1, p)
            elif e0 is not None:   # all_reduce, reduce_scatter: op; broadcast: root
                lib(xp, op_, count, nt, e0, p)
            else:                  # all_gather
                lib(xp, op_, count, nt, p)
            transport.last_stream, transport.last_what = st, what
            return res if is_root else None
        if _native.callpath is not None:   # the same run, compiled (mpicomm/_native)
            return _native.callpath.NcclRun(
                transport=self, comm=comm, lib=lib, run_any=run_any, contiguous=contiguous, device=device, ptr=ptr,
                empty=empty, get=get, sptr=sptr, p0=p0, st0=st0, count=count, nt=nt, e0=e0, e1=e1, ocls=ocls,
                dtype=dtype, oshape=oshape, what=what, dev=dev, role=0 if role is NEW else (1 if role is IN_PLACE else 2),
                is_root=is_root, xnb=xnb, onb=onb, sx=sx, so=so, cupy=kind == "cupy" and k.name == "cupy"
                and k.contiguous == _C_CONTIGUOUS, stream_ptr=cupy_stream_ptr() if kind == "cupy" else None)
        return run

    def _prepare_all_reduce(self, x, out, op, async_op, stream):
        return self._prepare_call(ALL_REDUCE, x, out, op, async_op, stream, "allReduce", (),
                                  lambda s: s, "all_reduce keeps the shape", op=op)

    def _prepare_reduce_scatter(self, x, out, op, async_op, stream):
        n = self.size

        def oshape(s):
            if not s or s[0] % n:
                raise invalid("x.shape", s, f"a first axis divisible by the group size {n} "
                              "(reduce_scatter splits axis 0 into one chunk per rank)")
            return (s[0] // n,) + s[1:]
        return self._prepare_call(REDUCE_SCATTER, x, out, op, async_op, stream, "reduceScatter",
                                  (), oshape, f"reduce_scatter gives each rank 1/{n} of axis 0",
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
        return self._prepare_call(REDUCE, x, out, (op, root), async_op, stream, "reduce", (root,),
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
        on, ptr = self._on_stream(stream, kind), self._ptr(kind)
        if role is OUT:
            out_of(x, *bind(x), out)

        def run(x, out):
            with on():
                xa, xp = bind(x)
                o, op_, res = out_of(x, xa, xp, out)
                if op_ == xp:   # in place: NCCL's send and receive buffers must differ; stage the input
                    xa = empty()
                    xa[...] = o
                    xp = ptr(xa)
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
        """A call with per-rank sizes (mpicomm._backends.nccl_layouts): grouped sends and
        receives, or one reduce per rank, from the layout of this rank's parts."""
        base, sizes, outs = arg
        name = NAMES[code]
        kind, row, a = self._family(x if x is not None else out, "x" if x is not None else "out")
        shape, dtype = tuple(a.shape), a.dtype
        isz = dtype.itemsize if kind != "torch" else a.element_size()
        if not shape and not (code == GATHER and sizes is None):
            raise invalid("x.shape", (), f"an array with an axis 0 ({name} splits or joins along it)")
        nop = None
        if code == REDUCE_SCATTER:
            check_op_dtype(base, row, nccl=True)
            nop = self._nop[wire_op(base, row)]
        root = self.host._root(base) if code in (GATHER, SCATTER) else None
        o0 = int(out.shape[0]) if code == ALL_TO_ALL and out is not None and out is not x else None
        lay = LAYOUTS[code](shape, self.rank, self.size, root, sizes, outs, o0)
        toshape, is_root = lay.oshape, lay.is_root
        role = role_of(x, out)
        if role is IN_PLACE and toshape != shape:
            raise invalid("out", "x (in place)", f"an array of shape {toshape}: {name} gives that shape")
        out_of = self._v_out_binder(kind, toshape, dtype, a) if is_root else None
        bind, cur, ptr = self._binder(kind), self._streamer(stream, kind), self._ptr(kind)
        on = self._on_stream(stream, kind)
        what = (name, shape, dtype)
        transport, nccl, scale, nt = self, self.nccl, row.nccl_scale, row.nccl
        sends, recvs, reduces = lay.sends, lay.recvs, lay.reduces
        onb, xnb = prod(toshape) * isz, prod(shape) * isz

        def run(x, out):
            with on():
                xa, xp = bind(x) if x is not None else (None, 0)
                if is_root:
                    o, op_, res = out_of(x, xa, xp, out)
                    if x is not None and (overlap(op_, onb, xp, xnb) or (op_ == xp and sends)):
                        # out shares memory with x (in place, or x a part of out): NCCL needs
                        # distinct send and receive buffers, so send from a copy
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

    def _ptr(self, kind):
        return self.kind("torch" if kind == "torch" else "cupy").ptr

    def _v_out_binder(self, kind, toshape, dtype, like):
        """out(x, xa, xp, out) -> (output array, pointer, result) of a call with per-rank sizes."""
        bind, empty, ptr = self._binder(kind), self._empty(kind, like, toshape), self._ptr(kind)

        def out_of(x, xa, xp, out):
            if out is None:
                o = empty()
                return o, ptr(o), o
            if out is x:
                return xa, xp, x
            return (*given_out(bind, out, toshape, dtype), out)
        return out_of

    def sendrecv(self, x, dst, tag, async_op, stream, out, src):
        """Send ``x`` to ``dst`` and receive from ``src`` as one NCCL group (cannot deadlock)."""
        dst = self.host._root(dst, "dst")
        src = self.host._root(src, "src")
        if tag != 0:
            return self._tagged_sendrecv(x, dst, tag, async_op, stream, out, src)
        kind, row, a = self._family(x)
        bind, ptr = self._binder(kind), self._ptr(kind)
        with self._on_stream(stream, kind)():   # (any copy on the call's stream)
            xa, xp = bind(x)
            if out is None:
                o = self._empty(kind, a, tuple(a.shape))()
                res, op_, row_o = o, ptr(o), row
            else:
                okind, row_o, _ = self._family(out, "out")
                o, op_ = self._binder(okind)(out, "out")
                if o is not out:
                    raise invalid("out", "a non-contiguous array", "a C-contiguous array")
                res = out
            if op_ == xp or overlap(op_, nbytes(o, "torch" if is_torch(o) else "cupy"), xp, nbytes(xa, kind)):
                xa = xa.clone() if kind == "torch" else xa.copy()   # out shares memory with x: send a copy
                xp = ptr(xa)
        p, st = self._streamer(stream, kind)()
        scount = (int(xa.size) if kind != "torch" else xa.numel()) * row.nccl_scale
        ro = row_o
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
        self._batch = []   # (event, stream) of each Work made until batch_end: _work records them

    def batch_end(self):
        evs, self._batch = self._batch, None
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

    def barrier(self, async_op):
        return self.host.barrier(async_op)
