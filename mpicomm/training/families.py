"""Array families: what the reducer and the fused calls need from NumPy, CuPy and PyTorch.

``NUMPY``, ``CUPY`` and ``TORCH`` offer one set of operations (spec, zeros, empty, view,
copy, scale, pack, copy_out; and for the GPU families new_stream, side_waits_current,
current_waits_side, on), so that code over buckets is written once. ``_family`` tells
which family an array belongs to; ``_key_plan`` gives each array's spec and its bucketing
key (family, dtype, device).
"""
from __future__ import annotations

import numpy as np

from .._dtypes import BFLOAT16
from ..errors import TypeOf, invalid
from .copy_kernel import _multi_copy
from .streams import _CupyOn


class _Numpy:
    name = "numpy"
    gpu = False

    @staticmethod
    def spec(a):
        return tuple(a.shape), a.dtype, "cpu", a.nbytes

    @staticmethod
    def dtype_name(dt):
        return str(dt)

    @staticmethod
    def half(which):
        return np.dtype(np.float16) if which == "fp16" else BFLOAT16

    f32 = np.dtype(np.float32)

    @staticmethod
    def zeros(n, dtype, device):
        return np.zeros(n, dtype)

    @staticmethod
    def empty(n, dtype, device):
        return np.empty(n, dtype)

    @staticmethod
    def view(flat, off, n, shape):
        return flat[off:off + n].reshape(shape)

    @staticmethod
    def copy(dst, src):
        np.copyto(dst, src, casting="unsafe")

    @staticmethod
    def scale(dst, src, n):
        np.divide(src, n, out=dst, casting="unsafe")

    @staticmethod
    def clone(a):
        return a.copy()

    @staticmethod
    def pack(flat, arrays):
        """Copy ``arrays`` one after the other into ``flat`` (one call, not one per array)."""
        np.concatenate([a.reshape(-1) for a in arrays], out=flat)

    @classmethod
    def copy_out(cls, dsts, srcs):
        """dsts[k][...] = srcs[k] for every k (the same shapes and dtypes)."""
        for d, v in zip(dsts, srcs):
            cls.copy(d, v)


class _CudaNames(dict):
    def __missing__(self, i):
        v = self[i] = f"cuda:{i}"
        return v


_CUDA_NAMES = _CudaNames()  # device id -> "cuda:N", made once (spec() runs once per gradient per step)


class _Cupy(_Numpy):
    name = "cupy"
    gpu = True

    @staticmethod
    def lib():
        """CuPy (imported at the first use)."""
        import cupy

        return cupy

    @staticmethod
    def spec(a):
        return a.shape, a.dtype, _CUDA_NAMES[a.data.device_id], a.nbytes

    @staticmethod
    def half(which):
        if which == "bf16":
            raise invalid("compression", "bf16", "'fp16' or None for CuPy arrays (CuPy has no bfloat16 "
                          "dtype; use PyTorch tensors for bf16 compression)")
        return np.dtype(np.float16)

    @classmethod
    def zeros(cls, n, dtype, device):
        cp = cls.lib()
        with cp.cuda.Device(int(device.split(":")[1])):
            return cp.zeros(n, dtype)

    @classmethod
    def empty(cls, n, dtype, device):
        cp = cls.lib()
        dev = int(device.split(":")[1])
        if cp.cuda.runtime.getDevice() == dev:
            return cp.empty(n, dtype)
        with cp.cuda.Device(dev):
            return cp.empty(n, dtype)

    @classmethod
    def copy(cls, dst, src):
        cls.lib().copyto(dst, src, casting="unsafe")

    @classmethod
    def pack(cls, flat, arrays):
        """One kernel launch for the whole bucket (a table of pointers; see _multi_copy)."""
        if all(a.flags.c_contiguous for a in arrays):
            base = flat.data.ptr
            src = [a.data.ptr for a in arrays]
            nb = [a.nbytes for a in arrays]
            _multi_copy(cls.lib(), src, base, nb, gather=True)
        else:
            cls.lib().concatenate([a.reshape(-1) for a in arrays], out=flat)

    @classmethod
    def copy_out(cls, dsts, srcs):
        """dsts[k][...] = srcs[k]: one kernel launch when every dst is C-contiguous."""
        cp = cls.lib()
        if all(d.flags.c_contiguous and d.dtype == v.dtype for d, v in zip(dsts, srcs)):
            _multi_copy(cp, [d.data.ptr for d in dsts], [v.data.ptr for v in srcs], [v.nbytes for v in srcs],
                        gather=False)
            return
        for d, v in zip(dsts, srcs):
            cls.copy(d, v)

    @classmethod
    def scale(cls, dst, src, n):
        cls.lib().divide(src, n, out=dst, casting="unsafe")

    @classmethod
    def new_stream(cls, device):
        cp = cls.lib()
        with cp.cuda.Device(int(device.split(":")[1])):
            return cp.cuda.Stream(non_blocking=True)

    @classmethod
    def side_waits_current(cls, side):
        side.wait_event(cls.lib().cuda.get_current_stream().record())

    @classmethod
    def current_waits_side(cls, side):
        cls.lib().cuda.get_current_stream().wait_event(side.record())

    @classmethod
    def on(cls, side):
        return _CupyOn(cls.lib(), side)


class _Torch:
    name = "torch"

    @staticmethod
    def lib():
        """PyTorch (imported at the first use)."""
        import torch

        return torch

    @staticmethod
    def spec(a):
        return tuple(a.shape), a.dtype, str(a.device), a.numel() * a.element_size()

    @staticmethod
    def dtype_name(dt):
        return str(dt).replace("torch.", "")

    @classmethod
    def half(cls, which):
        t = cls.lib()
        return t.float16 if which == "fp16" else t.bfloat16

    @property
    def f32(self):
        return self.lib().float32

    @classmethod
    def zeros(cls, n, dtype, device):
        return cls.lib().zeros(n, dtype=dtype, device=device)

    @classmethod
    def empty(cls, n, dtype, device):
        return cls.lib().empty(n, dtype=dtype, device=device)

    @staticmethod
    def view(flat, off, n, shape):
        return flat[off:off + n].view(shape)

    @classmethod
    def copy(cls, dst, src):
        with cls.lib().no_grad():  # parameters are leaves that require grad
            dst.copy_(src)

    @classmethod
    def scale(cls, dst, src, n):
        t = cls.lib()
        with t.no_grad():
            if dst is src:
                dst.div_(n)
            else:
                t.div(src, n, out=dst)

    @staticmethod
    def clone(a):
        return a.detach().clone()

    @classmethod
    def pack(cls, flat, arrays):
        t = cls.lib()
        with t.no_grad():
            t.cat([a.detach().reshape(-1) for a in arrays], out=flat)

    @classmethod
    def views(cls, flat, like):
        """Views of ``flat`` shaped like the tensors ``like``, made in one C++ call."""
        f = getattr(cls.lib()._C._nn, "unflatten_dense_tensors", None)
        if f is not None:
            return list(f(flat, like))
        out, off = [], 0
        for t in like:
            out.append(flat[off:off + t.numel()].view(t.shape))
            off += t.numel()
        return out

    @classmethod
    def copy_out(cls, dsts, srcs):
        t = cls.lib()
        with t.no_grad():
            fe = getattr(t, "_foreach_copy_", None)  # one multi-tensor kernel (PyTorch >= 2.2)
            if fe is not None:
                fe(list(dsts), list(srcs))
            else:
                for d, v in zip(dsts, srcs):
                    d.copy_(v)

    @classmethod
    def new_stream(cls, device):
        return cls.lib().cuda.Stream(device=device)

    @classmethod
    def side_waits_current(cls, side):
        side.wait_stream(cls.lib().cuda.current_stream(side.device))

    @classmethod
    def current_waits_side(cls, side):
        cls.lib().cuda.current_stream(side.device).wait_stream(side)

    @classmethod
    def on(cls, side):
        return cls.lib().cuda.stream(side)


NUMPY, CUPY, TORCH = _Numpy(), _Cupy(), _Torch()


def _contiguous(a):
    """Whether an array's elements are one C-ordered run (NumPy, CuPy or PyTorch)."""
    f = getattr(a, "is_contiguous", None)
    return f() if f is not None else a.flags.c_contiguous


def _family(x, arg):
    if isinstance(x, np.ndarray):
        return NUMPY
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return CUPY
    if mod.startswith("torch") and hasattr(x, "data_ptr"):
        return TORCH
    raise invalid(arg, TypeOf(x), "a NumPy array, a CuPy array or a PyTorch tensor")


def _is_gpu(fam, device):
    return fam is not NUMPY and device != "cpu"


def _as_list(xs, arg):
    if isinstance(xs, dict):
        return list(xs.values())
    if isinstance(xs, (list, tuple)):
        return list(xs)
    raise invalid(arg, TypeOf(xs), "a list or tuple of arrays (or a dict of them)")


def _key_plan(arrays, arg):
    """[(family, shape, dtype, device, nbytes)] and the bucketing key of each array."""
    specs, keys = [], []
    for i, a in enumerate(arrays):
        fam = _family(a, f"{arg}[{i}]")
        shape, dt, dev, nb = fam.spec(a)
        specs.append((fam, shape, dt, dev, nb))
        keys.append((fam.name, fam.dtype_name(dt), dev))
    return specs, keys
