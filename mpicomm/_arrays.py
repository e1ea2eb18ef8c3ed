"""Any array -> what a transport needs (buffer, count, dtype, device); the dtype tables.

Host arrays (NumPy, anything with the buffer protocol or CPU DLPack) go to MPI;
GPU arrays (CuPy, ``__cuda_array_interface__``, CUDA DLPack: PyTorch, JAX) go to
NCCL zero-copy, or are staged through the host on the MPI backend.

Non-contiguous *input* is copied to a contiguous array (one extra copy, documented);
an ``out=`` array must be C-contiguous, writable, of the right shape and dtype, or
the call raises :class:`InvalidArgumentError` naming what is wrong.
"""
from __future__ import annotations

import numpy as np

from .errors import invalid

try:  # bfloat16 on the CPU
    import ml_dtypes as _ml_dtypes

    BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

SUPPORTED = ("int8, uint8, int32, uint32, int64, uint64, float16, bfloat16, float32, "
             "float64, complex64, complex128")


class DtypeInfo:
    """What a transport needs to know about one dtype."""

    __slots__ = ("dtype", "name", "floating", "complex", "upcast", "mpi", "nccl", "nccl_scale")

    def __init__(self, dtype, floating, complex_, upcast, mpi, nccl, nccl_scale=1):
        self.dtype = dtype
        self.name = str(dtype)
        self.floating = floating
        self.complex = complex_
        self.upcast = upcast        # reduce in float32 on the MPI backend (MPI has no fp16/bf16 ops)
        self.mpi = mpi              # MPI datatype for transport and reduction
        self.nccl = nccl            # ncclDataType_t
        self.nccl_scale = nccl_scale  # complex travels as 2 floats


# ncclDataType_t values (nccl.h, stable since NCCL 2.10)
_NCCL = dict(int8=0, uint8=1, int32=2, uint32=3, int64=4, uint64=5, float16=6, float32=7,
             float64=8, bfloat16=9)

_TABLE: dict = {}


def _build_table():
    from mpi4py import MPI

    rows = [
        ("int8", False, False, False, MPI.INT8_T, _NCCL["int8"]),
        ("uint8", False, False, False, MPI.UINT8_T, _NCCL["uint8"]),
        ("int32", False, False, False, MPI.INT32_T, _NCCL["int32"]),
        ("uint32", False, False, False, MPI.UINT32_T, _NCCL["uint32"]),
        ("int64", False, False, False, MPI.INT64_T, _NCCL["int64"]),
        ("uint64", False, False, False, MPI.UINT64_T, _NCCL["uint64"]),
        ("float16", True, False, True, MPI.UINT16_T, _NCCL["float16"]),
        ("float32", True, False, False, MPI.FLOAT, _NCCL["float32"]),
        ("float64", True, False, False, MPI.DOUBLE, _NCCL["float64"]),
    ]
    for name, fl, cx, up, mpi, nc in rows:
        dt = np.dtype(name)
        _TABLE[dt] = DtypeInfo(dt, fl, cx, up, mpi, nc)
    _TABLE[np.dtype("complex64")] = DtypeInfo(np.dtype("complex64"), False, True, False,
                                              MPI.C_FLOAT_COMPLEX, _NCCL["float32"], 2)
    _TABLE[np.dtype("complex128")] = DtypeInfo(np.dtype("complex128"), False, True, False,
                                               MPI.C_DOUBLE_COMPLEX, _NCCL["float64"], 2)
    if BFLOAT16 is not None:
        _TABLE[BFLOAT16] = DtypeInfo(BFLOAT16, True, False, True, MPI.UINT16_T, _NCCL["bfloat16"])


def dtype_info(dtype, arg="x"):
    """The :class:`DtypeInfo` of ``dtype``; InvalidArgumentError for unsupported dtypes."""
    info = _TABLE.get(dtype)
    if info is None:
        if not _TABLE:
            _build_table()
            return dtype_info(dtype, arg)
        name = getattr(dtype, "name", dtype)
        if str(name) == "bfloat16":  # a bfloat16 from another library: normalise via ml_dtypes
            info = _TABLE.get(BFLOAT16)
            if info is not None:
                return info
        raise invalid(f"{arg}.dtype", str(name), f"one of {SUPPORTED}")
    return info


# ---------------------------------------------------------------- host side

def _is_gpu(x):
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return True
    if hasattr(x, "__cuda_array_interface__"):
        return True
    if mod.startswith("torch"):
        return bool(getattr(x, "is_cuda", False))
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        except Exception:
            return False
    return False


def is_gpu_array(x):
    """True for arrays that live on a GPU (CuPy, CUDA torch tensors, CAI, CUDA DLPack)."""
    return type(x) is not np.ndarray and _is_gpu(x)


def to_host(x, arg="x"):
    """Return ``(ndarray, back)``: a contiguous host view or copy of ``x``, and a function
    that turns a host result into the caller's array type (None for NumPy)."""
    if type(x) is np.ndarray:
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return x, None
    if _is_gpu(x):
        import cupy

        g = cupy.asarray(x) if not type(x).__module__.startswith("torch") else cupy.from_dlpack(x)
        return cupy.asnumpy(g), _back_like(x, gpu=True)
    if isinstance(x, np.ndarray):  # subclass
        return np.ascontiguousarray(x), None
    mod = type(x).__module__
    if hasattr(x, "__dlpack__"):
        try:
            a = np.from_dlpack(x)
        except Exception as e:
            raise invalid(arg, type(x).__name__, f"a host array (DLPack export failed: {e})") from None
        return np.ascontiguousarray(a), (_back_like(x, gpu=False) if mod.startswith("torch") else None)
    try:
        a = np.asarray(memoryview(x))
    except TypeError:
        raise invalid(arg, type(x).__name__, "a NumPy array, an object with the buffer protocol or "
                      "DLPack, or a GPU array (CuPy, PyTorch CUDA tensor) on the NCCL backend") from None
    return np.ascontiguousarray(a), None


def _back_like(x, gpu):
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if gpu:
            dev = x.device
            return lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev) if a is not None else None
        return lambda a: torch.from_numpy(a) if a is not None else None
    if gpu:
        import cupy

        return lambda a: cupy.asarray(a) if a is not None else None
    return None


def check_out(out, shape, dtype, arg="out"):
    """Validate a NumPy ``out`` array: shape, dtype, C-contiguous, writable."""
    if out.shape != shape:
        raise invalid(f"{arg}.shape", out.shape, f"shape {shape}")
    if out.dtype != dtype:
        raise invalid(f"{arg}.dtype", str(out.dtype), f"dtype {dtype} (the input's)")
    if not out.flags.c_contiguous:
        raise invalid(arg, f"non-contiguous array (shape {out.shape}, strides {out.strides})",
                      "a C-contiguous array (use np.ascontiguousarray or omit out=)")
    if not out.flags.writeable:
        raise invalid(arg, "read-only array", "a writable array")
    return out


def host_out(out, shape, dtype, arg="out"):
    """Return ``(ndarray, writeback)`` for a user ``out`` of any host/GPU type.

    ``writeback(result)`` copies the host result into ``out`` when ``out`` is not a
    NumPy array (a GPU array on the MPI backend), and returns ``out``.
    """
    if type(out) is np.ndarray:
        return check_out(out, shape, dtype, arg), None
    if _is_gpu(out):
        import cupy

        g = cupy.asarray(out) if not type(out).__module__.startswith("torch") else cupy.from_dlpack(out)
        if tuple(g.shape) != tuple(shape):
            raise invalid(f"{arg}.shape", tuple(g.shape), f"shape {shape}")
        if g.dtype != dtype:
            raise invalid(f"{arg}.dtype", str(g.dtype), f"dtype {dtype} (the input's)")
        if not g.flags.c_contiguous:
            raise invalid(arg, "non-contiguous GPU array", "a C-contiguous array")
        tmp = np.empty(shape, dtype)

        def writeback(res):
            g.set(res)
            return out

        return tmp, writeback
    if isinstance(out, np.ndarray):
        return check_out(out, shape, dtype, arg), None
    try:
        a = np.from_dlpack(out) if hasattr(out, "__dlpack__") else np.asarray(memoryview(out))
    except Exception:
        raise invalid(arg, type(out).__name__, "a writable NumPy array or CPU tensor") from None
    check_out(a, shape, dtype, arg)
    return a, (lambda res: out)
