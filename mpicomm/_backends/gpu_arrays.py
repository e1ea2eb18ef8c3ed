"""How the NCCL transport reads GPU arrays: one table of accessors per array kind.

An :class:`ArrayKind` says, for one family of GPU arrays, how to get an array's data
pointer, whether it is C-contiguous, which GPU it is on, how to make a new one and
which stream is current. The kinds are ``"cupy"`` (CuPy arrays) and ``"torch"`` (PyTorch
CUDA tensors); anything else with ``__cuda_array_interface__`` or CUDA DLPack is
``"other"``, converted to CuPy on every call. The accessors are C-level callables
(``operator.attrgetter``, PyTorch's method descriptors, ``functools.partial``), so the
transport's one ``run`` per collective costs no more than code written out per kind.

:class:`GPUArrays` is the part of the NCCL transport that binds a call's arrays (it needs
the transport's ``cupy``, ``device_id``, ``rank`` and ``size``): the first call's family,
``bind`` (a contiguous array on this GPU and its pointer), the output of a call (new, in
place or ``out=``, checked), the write-back of an in-place result, and the stream.
"""
from __future__ import annotations

import contextlib
import functools
import operator

from .._arrays import is_gpu_array, is_torch
from .._dtypes import of_numpy, of_torch
from .._ops import ALL_GATHER, REDUCE_SCATTER
from ..errors import TypeOf, invalid
from .base import IN_PLACE, NEW


class ArrayKind:
    """The accessors of one family of GPU arrays (see the module docstring)."""

    __slots__ = ("name", "ptr", "contiguous", "device", "current_stream", "stream_ptr", "empty", "copy")

    def __init__(self, name, ptr, contiguous, device, current_stream, stream_ptr, empty, copy):
        self.name = name
        self.ptr = ptr                          # array -> its data pointer (int)
        self.contiguous = contiguous            # array -> True when C-contiguous
        self.device = device                    # array -> its GPU's index
        self.current_stream = current_stream    # () -> what the watchdog keeps of the current stream
        self.stream_ptr = stream_ptr            # that -> its cudaStream_t (int)
        self.empty = empty                      # (shape, like) -> () -> a new array like ``like``
        self.copy = copy                        # array -> a contiguous copy


_C_CONTIGUOUS = operator.attrgetter("_c_contiguous")   # CuPy's flag without a Flags object


def cupy_kind(cupy, device_id):
    fast = hasattr(cupy.empty(0), "_c_contiguous")
    return ArrayKind(
        "cupy", operator.attrgetter("data.ptr"),
        _C_CONTIGUOUS if fast else (lambda a: a.flags.c_contiguous),
        operator.attrgetter("data.device_id"), cupy.cuda.get_current_stream, operator.attrgetter("ptr"),
        lambda shape, like: functools.partial(cupy.empty, shape, like.dtype), operator.methodcaller("copy"))


def cupy_stream_ptr():
    """CuPy's C function that gives the current stream's handle (a capsule its Cython module
    exports), or None: the compiled call path reads the handle with it and calls
    ``get_current_stream()`` only when the stream changed."""
    try:
        from cupy_backends.cuda import stream
    except Exception:
        return None
    return getattr(stream, "__pyx_capi__", {}).get("get_current_stream_ptr")


def torch_kind(device_id):
    import torch

    raw = torch_raw_stream()
    return ArrayKind(
        "torch", torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.get_device,
        functools.partial(raw, device_id), int,   # PyTorch's pool streams live as long as the process
        lambda shape, like: functools.partial(torch.empty, shape, dtype=like.dtype, device=like.device),
        torch.Tensor.clone)


def torch_raw_stream():
    """A function device -> cudaStream_t of PyTorch's current stream (cheap, no Stream object)."""
    import torch

    f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if f is not None:
        return f
    return lambda dev: torch.cuda.current_stream(dev).cuda_stream


def prod(shape):
    r = 1
    for d in shape:
        r *= int(d)
    return r


def nbytes(a, kind):
    return a.numel() * a.element_size() if kind == "torch" else a.nbytes


def overlap(p, nb, q, mb):
    """True when [p, p+nb) and [q, q+mb) overlap, unless they are the same bytes (in place)."""
    return p < q + mb and q < p + nb and not (p == q and nb == mb)


def given_out(bind, out, shape, dtype):
    """(out, its pointer) for a given ``out=``: a C-contiguous GPU array of ``shape`` and
    ``dtype`` on this GPU (``bind``), else InvalidArgumentError naming what differs."""
    if not is_gpu_array(out):
        raise invalid("out", TypeOf(out), "a GPU array on the NCCL backend (the input is one)")
    o, p = bind(out, "out")
    if o is not out:
        raise invalid("out", "a non-contiguous array", "a C-contiguous array")
    if tuple(o.shape) != shape:
        raise invalid("out.shape", tuple(o.shape), f"shape {shape}")
    if o.dtype != dtype:
        raise invalid("out.dtype", str(o.dtype), f"dtype {dtype} (the input's)")
    return o, p


class GPUArrays:
    """The NCCL transport's binding of a call's GPU arrays (a mixin: no state of its own
    but the accessor tables, made on first use)."""

    _kinds = None

    def kind(self, name):
        """The :class:`ArrayKind` ``name`` ("cupy" or "torch"; "other" arrays bind as CuPy)."""
        if self._kinds is None:
            self._kinds = {}
        k = self._kinds.get(name)
        if k is None:
            k = self._kinds[name] = (torch_kind(self.device_id) if name == "torch"
                                     else cupy_kind(self.cupy, self.device_id))
        return k

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
        if kind == "other":
            bind_cupy = self._binder("cupy")

            def bind(x, arg="x"):
                a = cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x)
                return bind_cupy(a, arg)
            return bind
        k = self.kind(kind)
        contiguous, device, ptr = k.contiguous, k.device, k.ptr
        contiguous_copy = cupy.ascontiguousarray if kind == "cupy" else operator.methodcaller("contiguous")

        def bind(x, arg="x"):
            if not contiguous(x):
                x = contiguous_copy(x)
            d = device(x)
            if d != dev:
                raise invalid(f"{arg}.device", f"cuda:{d}", f"cuda:{dev}, the GPU of this rank's NCCL communicator")
            return x, ptr(x)
        return bind

    def _empty(self, kind, like, shape):
        """() -> a new array of ``shape`` with ``like``'s dtype (and device) on this GPU."""
        return self.kind("torch" if kind == "torch" else "cupy").empty(shape, like)

    def _streamer(self, stream, kind):
        """A function () -> (cudaStream_t, what the watchdog keeps) for this call's stream."""
        if stream is None:
            k = self.kind("torch" if kind == "torch" else "cupy")
            get, ptr = k.current_stream, k.stream_ptr

            def cur():
                st = get()
                return ptr(st), st
            return cur
        if isinstance(stream, int):
            return lambda: (stream, None)   # a bare handle: nothing keeps it alive, so not watched
        p = getattr(stream, "ptr", None)
        if p is None:
            p = getattr(stream, "cuda_stream", None)
        if p is None:
            raise invalid("stream", stream, "a cupy.cuda.Stream, a torch.cuda.Stream or a cudaStream_t (int)")
        return lambda: (p, stream)

    def _on_stream(self, stream, kind):
        """() -> a context manager that makes the call's ``stream=`` current while the
        transport copies (a contiguous copy of the input, a staging copy, broadcast's
        write-back), so that they are ordered with the library call on that stream; a no-op
        where the call runs on the current stream (``stream`` None)."""
        if stream is None:
            return contextlib.nullcontext
        p = self._streamer(stream, kind)()[0]
        if kind == "torch":
            import torch

            dev = torch.device("cuda", self.device_id)
            return lambda: torch.cuda.stream(torch.cuda.ExternalStream(p, device=dev))
        cupy, dev = self.cupy, self.device_id
        return lambda: cupy.cuda.ExternalStream(p, dev)

    def _out_binder(self, kind, role, oshape, dtype, x0, what, code=None):
        """out(x, xa, xp, out) -> (output array, pointer, result) for this call."""
        bind = self._binder(kind)
        empty = self._empty(kind, x0, oshape)
        ptr = self.kind("torch" if kind == "torch" else "cupy").ptr
        tshape = tuple(oshape)
        xnb = nbytes(x0, kind)
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
                return o, ptr(o), o
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
                o, p = given_out(bind, out, tshape, dtype)
                if overlap(p, nbytes(o, kind), xp, nbytes(xa, kind)) and not slot(p, xp):
                    if code == REDUCE_SCATTER and onb and 0 <= p - xp < xnb and (p - xp) % onb == 0:
                        # out is another of x's chunks (its head: MPI's in-place form): the
                        # result goes through a new array, copied into out after the call
                        t = empty()
                        return t, ptr(t), out
                    raise invalid("out", "an array that overlaps x", "x itself or a view of exactly x's "
                                  "memory (in place), or an array that shares no memory with x")
                return o, p, out
        return out_of

    def _write_back(self, x, xa, xp, kind):
        """Copy the result in contiguous ``xa`` (at ``xp``) into ``x`` when ``x`` is not it."""
        if kind == "torch":
            if x.data_ptr() != xp:
                x.copy_(xa)
            return
        cupy = self.cupy
        v = x if kind == "cupy" else (cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x))
        if v.data.ptr != xp:
            v[...] = xa
