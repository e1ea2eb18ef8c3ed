"""The one dtype table: what each transport calls every dtype mpicomm accepts.

One row per dtype: its NumPy name (bfloat16 from ml_dtypes on the CPU), whether it is
floating or complex, whether MPI must reduce it in float32 (MPI has no float16 or
bfloat16 reductions), the MPI datatype that moves it, the NCCL type (the name of a
``cupy.cuda.nccl`` constant, with nccl.h's value where an older CuPy lacks it), how
many NCCL elements one element is (complex travels as two floats) and whether NCCL
can reduce it. The PyTorch dtype of each row is the one of the same name.

bool travels as uint8 (NumPy's bool is one byte, 0 or 1) on both transports and is
reduced as torch.distributed does: SUM and MAX are logical OR (MAX of 0/1 bytes), PROD
and MIN logical AND (MIN); AVG is refused (mpicomm._ops.wire_op, check_op_dtype).
int16 and uint16 are MPI's INT16_T/UINT16_T; NCCL has no 16-bit integer type, so on
GPU arrays they move as two bytes each and NCCL reductions of them are refused.
"""
from __future__ import annotations

import numpy as np

from .errors import invalid

try:  # bfloat16 on the CPU
    import ml_dtypes as _ml_dtypes

    BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

#        name          floating complex upcast MPI datatype        NCCL type (name, nccl.h value)  scale  NCCL reduces
_ROWS = (("int8",        False, False, False, "INT8_T",            ("NCCL_INT8", 0), 1, True),
         ("uint8",       False, False, False, "UINT8_T",           ("NCCL_UINT8", 1), 1, True),
         ("int16",       False, False, False, "INT16_T",           ("NCCL_INT8", 0), 2, False),
         ("uint16",      False, False, False, "UINT16_T",          ("NCCL_UINT8", 1), 2, False),
         ("int32",       False, False, False, "INT32_T",           ("NCCL_INT32", 2), 1, True),
         ("uint32",      False, False, False, "UINT32_T",          ("NCCL_UINT32", 3), 1, True),
         ("int64",       False, False, False, "INT64_T",           ("NCCL_INT64", 4), 1, True),
         ("uint64",      False, False, False, "UINT64_T",          ("NCCL_UINT64", 5), 1, True),
         ("float16",     True,  False, True,  "UINT16_T",          ("NCCL_FLOAT16", 6), 1, True),
         ("bfloat16",    True,  False, True,  "UINT16_T",          ("NCCL_BFLOAT16", 9), 1, True),
         ("float32",     True,  False, False, "FLOAT",             ("NCCL_FLOAT32", 7), 1, True),
         ("float64",     True,  False, False, "DOUBLE",            ("NCCL_FLOAT64", 8), 1, True),
         ("complex64",   False, True,  False, "C_FLOAT_COMPLEX",   ("NCCL_FLOAT32", 7), 2, True),
         ("complex128",  False, True,  False, "C_DOUBLE_COMPLEX",  ("NCCL_FLOAT64", 8), 2, True),
         ("bool",        False, False, False, "UINT8_T",           ("NCCL_UINT8", 1), 1, True))

SUPPORTED = ", ".join(r[0] for r in _ROWS)

FLOAT_NAMES = tuple(r[0] for r in _ROWS if r[1] or r[2])   # floating and complex


def dtype_of(name):
    """The NumPy dtype named ``name`` (a row's name; bfloat16 from ml_dtypes)."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


class DType:
    """One row of the table."""

    __slots__ = ("name", "dtype", "floating", "complex", "upcast", "mpi", "nccl", "nccl_scale", "nccl_reduces",
                 "boolean", "itemsize")

    def __init__(self, name, dtype, floating, complex_, upcast, mpi, nccl, nccl_scale, nccl_reduces=True):
        self.name = name
        self.dtype = dtype            # the NumPy dtype
        self.itemsize = dtype.itemsize
        self.floating = floating
        self.complex = complex_
        self.upcast = upcast          # reduced in float32 on the MPI backend
        self.mpi = mpi                # mpi4py datatype that moves it
        self.nccl = nccl              # ncclDataType_t
        self.nccl_scale = nccl_scale  # NCCL elements per element
        self.nccl_reduces = nccl_reduces  # NCCL has a reduction of it (not int16/uint16)
        self.boolean = dtype.kind == "b"  # reduced as logical OR/AND (mpicomm._ops.wire_op)

    def __repr__(self):
        return f"DType({self.name})"


_BY_NUMPY: dict = {}   # NumPy dtype -> DType
_BY_NAME: dict = {}    # name -> DType
_BY_TORCH: dict = {}   # torch.dtype -> DType (filled when the first tensor is seen)


def _build():
    from mpi4py import MPI
    try:
        from cupy.cuda import nccl as _nccl
    except Exception:  # no CuPy: the NCCL column is never used
        _nccl = None
    for name, fl, cx, up, mpi, (nc_name, nc_val), scale, reduces in _ROWS:
        dt = BFLOAT16 if name == "bfloat16" else np.dtype(name)
        if dt is None:  # pragma: no cover
            continue
        row = DType(name, dt, fl, cx, up, getattr(MPI, mpi), getattr(_nccl, nc_name, nc_val), scale,
                   reduces)
        _BY_NUMPY[dt] = row
        _BY_NAME[name] = row


def of_numpy(dtype, arg="x"):
    """The row of NumPy dtype ``dtype``; InvalidArgumentError naming what is supported."""
    row = _BY_NUMPY.get(dtype)
    if row is not None:
        return row
    if not _BY_NUMPY:
        _build()
        return of_numpy(dtype, arg)
    name = getattr(dtype, "name", str(dtype))
    dt = np.dtype(dtype) if not isinstance(dtype, np.dtype) else dtype
    if dt.byteorder not in ("=", "|") and dt.newbyteorder("=") in _BY_NUMPY:  # the other byte order
        native = dt.newbyteorder("=")
        order = "big" if dt.byteorder == ">" else "little"
        raise invalid(f"{arg}.dtype", f"{order}-endian {native.name} ({dt.str})",
                      f"this machine's byte order: convert with x.astype('{native.str}')")
    if name == "bfloat16" and BFLOAT16 is not None:  # a bfloat16 of another library
        return _BY_NUMPY[BFLOAT16]
    raise invalid(f"{arg}.dtype", str(name), f"one of {SUPPORTED}")


def of_name(name):
    if not _BY_NAME:
        _build()
    return _BY_NAME[name]


def of_torch(dtype, arg="x"):
    """The row of PyTorch dtype ``dtype`` (the row of the same name)."""
    row = _BY_TORCH.get(dtype)
    if row is None:
        if not _BY_NAME:
            _build()
        row = _BY_NAME.get(str(dtype).replace("torch.", ""))
        if row is None:
            raise invalid(f"{arg}.dtype", str(dtype), f"one of {SUPPORTED}")
        _BY_TORCH[dtype] = row
    return row
