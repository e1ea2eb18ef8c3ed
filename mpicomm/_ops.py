"""Reduction operators, what each transport calls them, and the collective codes.

The one table of reduction ops: per :class:`ReduceOp`, the MPI op, the NCCL op (the
name of a ``cupy.cuda.nccl`` constant, with nccl.h's value where CuPy lacks it) and
the NumPy ufunc the shared-memory path reduces with. AVG travels as SUM on MPI and
is divided afterwards. The collective codes number the collectives for the progress
records and the debug descriptors.
"""
import enum
from typing import Any, NamedTuple

import numpy as np

from .errors import invalid


class ReduceOp(str, enum.Enum):
    """Reduction operators, equal to MindSpore's strings (``ReduceOp.SUM == "sum"``)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    def __str__(self):
        return self.value


#       op             MPI op   NCCL op (name, nccl.h value)  ufunc
_ROWS = ((ReduceOp.SUM, "SUM", ("NCCL_SUM", 0), np.add),
         (ReduceOp.PROD, "PROD", ("NCCL_PROD", 1), np.multiply),
         (ReduceOp.MIN, "MIN", ("NCCL_MIN", 3), np.minimum),
         (ReduceOp.MAX, "MAX", ("NCCL_MAX", 2), np.maximum),
         (ReduceOp.AVG, "SUM", ("NCCL_AVG", 4), np.add))

UFUNC = {op: uf for op, _, _, uf in _ROWS}

_BY_NAME = {}
for _op in ReduceOp:
    for _k in (_op, _op.value, _op.name, _op.value.upper()):
        _BY_NAME[_k] = _op
_BY_NAME["mean"] = ReduceOp.AVG

ALLOWED_OPS = "one of ReduceOp.SUM, PROD, MIN, MAX, AVG (or 'sum', 'prod', 'min', 'max', 'avg')"


def as_op(op):
    """Normalise ``op`` to a :class:`ReduceOp`; raise InvalidArgumentError if unknown."""
    try:
        return _BY_NAME[op]
    except (KeyError, TypeError):
        raise invalid("op", op, ALLOWED_OPS) from None


# bool, as torch.distributed reduces it (ProcessGroupNCCL: SUM -> MAX, PROD -> MIN on
# ncclUint8): SUM and MAX are logical OR, PROD and MIN logical AND. Its elements travel as
# uint8 bytes 0 and 1, whose MAX is OR and MIN is AND on every transport (MPI's UINT8_T,
# NCCL's ncclUint8, NumPy's maximum/minimum on the shared-memory path).
BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN,
            ReduceOp.MAX: ReduceOp.MAX}


def wire_op(op, row):
    """The op a transport runs for ``op`` (checked by check_op_dtype) on dtype row ``row``."""
    return BOOL_OPS[op] if row.boolean else op


def mpi_ops():
    """ReduceOp -> mpi4py op."""
    from mpi4py import MPI

    return {op: getattr(MPI, m) for op, m, _, _ in _ROWS}


def bool_ops(table):
    """``table`` (ReduceOp -> a transport's op) for bool rows: each op as wire_op runs it."""
    return {op: table[w] for op, w in BOOL_OPS.items()}


def _user_op(ufunc):
    """An MPI op that reduces with NumPy's ``ufunc`` in the datatype's own NumPy dtype."""
    from mpi4py import MPI
    from mpi4py.util.dtlib import to_numpy_dtype

    types = {}

    def fn(inbuf, inoutbuf, datatype):
        dt = types.get(datatype.handle)
        if dt is None:
            dt = types[datatype.handle] = to_numpy_dtype(datatype)
        b = np.frombuffer(inoutbuf, dt)
        with np.errstate(invalid="ignore", over="ignore"):   # a NaN operand, a wrap: not errors here
            ufunc(np.frombuffer(inbuf, dt), b, out=b)

    return MPI.Op.Create(fn, commute=True)


_TABLES = {}


def nan_mpi_ops():
    """ReduceOp -> mpi4py op for floating dtypes: MIN and MAX are np.minimum / np.maximum
    (a NaN in any rank's element makes that element NaN, as NumPy and the shared-memory path
    do; MPI's own MIN/MAX leave NaN to the implementation: Open MPI keeps or drops it by
    the order it combines the ranks in), the others MPI's own."""
    t = _TABLES.get("nan")
    if t is None:
        t = dict(mpi_ops())
        t[ReduceOp.MIN] = _user_op(np.minimum)
        t[ReduceOp.MAX] = _user_op(np.maximum)
        _TABLES["nan"] = t
    return t


def mpi_table(row):
    """ReduceOp -> mpi4py op for dtype row ``row`` (mpicomm._dtypes.DType), the one choice of
    every MPI reduction: floating dtypes nan_mpi_ops(); bool (moved as uint8) bool_ops, MAX for
    OR and MIN for AND; 8- and 16-bit integers SUM as np.add, wrapping around as NumPy's
    arithmetic (Open MPI's own SUM of them saturates wherever its AVX code runs, on all but the
    shortest messages: open-mpi/ompi#8045, closed as wontfix); the others MPI's own ops."""
    if row.floating or row.upcast:
        return nan_mpi_ops()
    key = "bool" if row.boolean else ("narrow" if row.itemsize <= 2 and not row.complex else "plain")
    t = _TABLES.get(key)
    if t is None:
        t = mpi_ops()
        if key == "bool":
            t = bool_ops(t)
        elif key == "narrow":
            t[ReduceOp.SUM] = _user_op(np.add)
        _TABLES[key] = t
    return t


def nccl_ops(nccl):
    """ReduceOp -> ncclRedOp_t, from CuPy's nccl module."""
    return {op: getattr(nccl, name, value) for op, _, (name, value), _ in _ROWS}


def check_op_dtype(op, row, nccl=False):
    """Raise if ``op`` is not defined for dtype row ``row`` (mpicomm._dtypes.DType), on
    the NCCL transport where ``nccl`` (GPU arrays), on MPI otherwise.

    AVG needs a floating or complex dtype (an integer mean would truncate silently);
    MIN and MAX have no meaning for complex numbers, and PROD of complex numbers is
    not element-wise over (real, imag) so the NCCL backend could not do it: complex
    dtypes allow SUM and AVG only, on both backends. bool allows SUM and MAX (logical
    OR), PROD and MIN (logical AND), as torch.distributed does; no AVG. NCCL has no
    16-bit integer type: int16 and uint16 GPU arrays move as bytes but are not reduced.
    """
    if nccl and not row.nccl_reduces:
        raise invalid("x.dtype", row.name, f"a dtype NCCL reduces for op={op.value}: NCCL has no 16-bit integer "
                      "reduction: cast to int32 (moving int16/uint16 GPU arrays works)")
    if row.boolean:
        if op is ReduceOp.AVG:
            raise invalid("op", op.value, "SUM or MAX (logical OR), PROD or MIN (logical AND) for dtype bool; "
                          "AVG needs a floating dtype (cast first)")
        return
    if op is ReduceOp.AVG and not (row.floating or row.complex):
        raise invalid("op", op.value, f"SUM, PROD, MIN or MAX for integer dtype {row.name}; "
                      "AVG needs a floating dtype (cast first, or reduce with SUM and divide)")
    if row.complex and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise invalid("op", op.value, f"SUM or AVG for complex dtype {row.name}")


# The collective codes (4 bits in the progress records).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
               "barrier", "send", "recv", "create_group", "destroy_group", "gather", "scatter", "sendrecv")
(ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, ALL_TO_ALL, BARRIER, SEND, RECV,
 CREATE_GROUP, DESTROY_GROUP, GATHER, SCATTER, SENDRECV) = range(1, len(COLLECTIVES) + 1)
assert len(COLLECTIVES) < 16
NAMES = dict(enumerate(COLLECTIVES, 1))


class Sized(NamedTuple):
    """The ``arg`` of a call with per-rank sizes.

    ``base`` is what the even call takes (the op, the root, or None); ``sizes`` the axis-0
    length of each rank's part (None: even parts), ``out_sizes`` all_to_all's received
    split sizes (None elsewhere). Compared by value, so a repeated call with the same
    sizes reuses its prepared call. ``value`` is the op's name, for the flight recorder.
    """

    base: Any
    sizes: Any
    out_sizes: Any = None

    @property
    def value(self):
        b = self[0]
        return getattr(b, "value", b)
