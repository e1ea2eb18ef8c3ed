"""Debug mode (``init(debug=True)``): compare every collective's arguments across the group.

Before each collective the ranks of the group allgather a fixed 16-integer descriptor
(collective, op, dtype, shape, root, group, sequence number) over a side communicator;
any difference raises :class:`CollectiveMismatchError` on every rank, with a per-rank
table. The check runs inside the published call, so a rank missing from the
comparison shows as pending to the watchdog.
"""
from __future__ import annotations

import zlib

import numpy as np

from .._ops import ALL_REDUCE, BARRIER, BROADCAST, NAMES, REDUCE, REDUCE_SCATTER, ReduceOp
from ..errors import CollectiveMismatchError, CommunicationError
from .progress import ghash
from .._dtypes import SUPPORTED

_DTYPES = SUPPORTED.split(", ") + ["bool", "int16", "uint16"]
_DTCODE = {n: i + 1 for i, n in enumerate(_DTYPES)}
_OPS = {op: i + 1 for i, op in enumerate(ReduceOp)}
_OPNAMES = {v: k.value for k, v in _OPS.items()}


class Checked:
    """A transport wrapper: ``prepare`` first compares the call across the group, and the
    prepared calls are never reused (so every call is compared)."""

    def __init__(self, transport, group, side, fired=lambda: False):
        self.inner = transport
        self.group = group
        self.side = side         # a dup of the group's MPI communicator, for the descriptors
        self.fired = fired       # () -> True once the watchdog is aborting the job

    def __getattr__(self, name):  # barrier, point_to_point, abort, close, last_stream, ...
        return getattr(self.inner, name)

    def prepare(self, code, x, out, arg, async_op, stream):
        g = self.group
        if self.fired():
            raise CommunicationError(f"{NAMES[code]} on group {g.name!r}: the job is being aborted "
                                     "after a collective timed out (see the CollectiveTimeoutError above)")
        op, root = _op_root(code, arg)
        check(self.side, g, code, x, op, root, g.disp.seq)  # this call's, set by the dispatcher
        p = self.inner.prepare(code, x, out, arg, async_op, stream)
        p.cls = None
        return p

    def barrier(self, async_op):
        g = self.group
        check(self.side, g, BARRIER, None, None, None, g.disp.seq)
        return self.inner.barrier(async_op)

    def close(self):
        self.side.Free()


def _op_root(code, arg):
    if code in (ALL_REDUCE, REDUCE_SCATTER):
        return arg, None
    if code == BROADCAST:
        return None, arg
    if code == REDUCE:
        return arg
    return None, None


def check(side, g, code, x, op, root, seq):
    """Allgather this call's descriptor over the group; raise on every rank if any differ."""
    from mpi4py import MPI

    d = descriptor(code, x, op, root, g, seq)
    allv = np.empty((g.size, 16), np.int64)
    side.Allgather([d, MPI.INT64_T], [allv, MPI.INT64_T])
    if (allv != allv[0]).any():
        raise CollectiveMismatchError(mismatch_table(g, allv))


def _shape_dtype(x):
    if x is None:
        return None, None
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        try:
            a = np.asarray(memoryview(x))
            shape, dtype = a.shape, a.dtype
        except Exception:
            return None, type(x).__name__
    return tuple(int(s) for s in shape), str(dtype).replace("torch.", "")


def descriptor(code, x, op, root, g, seq):
    shape, dtype = _shape_dtype(x)
    d = np.full(16, -1, np.int64)
    d[0] = code
    d[1] = _OPS.get(op, 0) if op is not None else 0
    d[2] = (_DTCODE.get(dtype) or (zlib.crc32(dtype.encode()) | (1 << 40))) if dtype else 0
    if shape is not None:
        d[3] = len(shape)
        if len(shape) <= 8:
            d[4:4 + len(shape)] = shape
        else:
            d[4:11] = shape[:7]
            d[11] = zlib.crc32(repr(shape[7:]).encode())
    d[12] = root if root is not None and isinstance(root, (int, np.integer)) else -1
    d[13] = ghash(g.name)
    d[14] = seq
    d[15] = 0
    return d


def _fmt(d):
    name = NAMES.get(int(d[0]), f"collective#{int(d[0])}")
    parts = [f"{name} sequence {int(d[14])}"]
    if d[1]:
        parts.append(f"op={_OPNAMES.get(int(d[1]), int(d[1]))}")
    if d[2]:
        c = int(d[2])
        parts.append(f"dtype={_DTYPES[c - 1] if 0 < c <= len(_DTYPES) else f'#{c}'}")
    if d[3] >= 0:
        nd = int(d[3])
        shape = tuple(int(s) for s in d[4:4 + min(nd, 8)]) if nd <= 8 else "(...)"
        parts.append(f"shape={shape}")
    if d[12] >= 0:
        parts.append(f"root={int(d[12])}")
    return " ".join(parts)


def mismatch_table(g, allv):
    fields = {"collective": [0], "op": [1], "dtype": [2], "shape": list(range(3, 12)), "root": [12],
              "sequence number": [14]}
    diff = [k for k, idx in fields.items() if (allv[:, idx] != allv[0, idx]).any()]
    rows = "\n".join(f"  rank {r} (world rank {g.ranks[r]}): {_fmt(allv[r])}" for r in range(len(allv)))
    return (f"ranks of group {g.name!r} called different collectives or the same one with different "
            f"arguments (differs in: {', '.join(diff)}):\n{rows}\n"
            "  every rank must call the same collectives in the same order, with the same "
            "op, dtype, shape and root")
