"""Debug mode (``init(debug=True)``): compare every collective's arguments across the group.

Before each collective the ranks of the group allgather a fixed 16-integer descriptor over
a side communicator: the call's CallSpec words (mpicomm._callspec: collective, dtype, element
count, op, root, trailing shape, sizes; the agreement check's vocabulary), with the full shape,
the group and the sequence number on top. Any difference raises
:class:`CollectiveMismatchError` on every rank, with a per-rank table. The check runs inside
the published call, so a rank missing from the comparison shows as pending to the watchdog.
"""
from __future__ import annotations

import zlib

import numpy as np

from .._callspec import GPU, SPEC_WORDS, PeerSpec, plain_spec, spec_of
from .._ops import BARRIER, NAMES
from ..errors import CollectiveMismatchError, CommunicationError
from .progress import ghash

N = 16            # words in a descriptor
_GHASH, _SEQ, _NDIM, _DIMS = SPEC_WORDS, SPEC_WORDS + 1, SPEC_WORDS + 2, SPEC_WORDS + 3
_DIMS_MAX = N - _DIMS   # dimensions carried in full; a longer shape: the first ones and a hash


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
        check(self.side, g, code, x, out, arg, g.disp.seq)  # this call's, set by the dispatcher
        p = self.inner.prepare(code, x, out, arg, async_op, stream)
        p.cls = None
        return p

    def barrier(self, async_op):
        g = self.group
        check(self.side, g, BARRIER, None, None, None, g.disp.seq)
        return self.inner.barrier(async_op)

    def close(self):
        self.side.Free()


def check(side, g, code, x, out, arg, seq):
    """Allgather this call's descriptor over the group; raise on every rank if any differ."""
    from mpi4py import MPI

    d = descriptor(code, x, out, arg, g, seq)
    allv = np.empty((g.size, N), np.int64)
    side.Allgather([d, MPI.INT64_T], [allv, MPI.INT64_T])
    if (allv != allv[0]).any():
        raise CollectiveMismatchError(mismatch_table(g, allv))


def _as_array(x):
    """``x``, or a NumPy view of a buffer without shape and dtype (bytes, array.array)."""
    if x is None or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    try:
        return np.asarray(memoryview(x))
    except Exception:
        return None


def descriptor(code, x, out, arg, g, seq):
    """The 16 words every rank compares: CallSpec words, group, sequence number, shape."""
    a = _as_array(x)
    spec = plain_spec(code) if a is None else spec_of(code, a, out, arg, g.size, g.rank)
    d = np.zeros(N, np.int64)
    d[:SPEC_WORDS] = spec.words()
    d[_GHASH] = ghash(g.name)
    d[_SEQ] = seq
    if a is None:
        d[_NDIM] = -1
        return d
    shape = tuple(int(s) for s in a.shape)
    d[_NDIM] = len(shape)
    if len(shape) <= _DIMS_MAX:
        d[_DIMS:_DIMS + len(shape)] = shape
    else:
        d[_DIMS:N - 1] = shape[:_DIMS_MAX - 1]
        d[N - 1] = zlib.crc32(repr(shape[_DIMS_MAX - 1:]).encode())
    return d


def _fmt(d):
    sp = PeerSpec(d[:SPEC_WORDS])
    parts = [f"{sp.name} sequence {int(d[_SEQ])}"]
    if sp.op is not None:
        parts.append(f"op={sp.op.value}")
    if d[1]:
        parts.append(f"dtype={sp.dtype or f'#{int(d[1])}'}")
    nd = int(d[_NDIM])
    if nd >= 0:
        shape = tuple(int(s) for s in d[_DIMS:_DIMS + nd]) if nd <= _DIMS_MAX else "(...)"
        parts.append(f"shape={shape}")
    if sp.root is not None:
        parts.append(f"root={sp.root}")
    if sp.gpu:
        parts.append("GPU arrays")
    return " ".join(parts)


# the fields a table names, by the words that carry them
_FIELDS = {"collective": lambda v: v[:, 0] & 0xFF, "GPU or host arrays": lambda v: v[:, 0] & GPU,
           "op": lambda v: v[:, 3], "dtype": lambda v: v[:, 1],
           "shape": lambda v: v[:, [2, 5] + list(range(_NDIM, N))], "root": lambda v: v[:, 4],
           "sizes": lambda v: v[:, 6], "sequence number": lambda v: v[:, _SEQ]}


def mismatch_table(g, allv):
    diff = [k for k, f in _FIELDS.items() if (f(allv) != f(allv)[0]).any()]
    rows = "\n".join(f"  rank {r} (world rank {g.ranks[r]}): {_fmt(allv[r])}" for r in range(len(allv)))
    return (f"ranks of group {g.name!r} called different collectives or the same one with different "
            f"arguments (differs in: {', '.join(diff)}):\n{rows}\n"
            "  every rank must call the same collectives in the same order, with the same "
            "op, dtype, shape and root")
