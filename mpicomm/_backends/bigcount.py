"""Collectives of more than 2**31 - 1 elements on the MPI backend.

MPI counts are C ints. mpi4py 4 calls the MPI-4 large-count ``_c`` functions where
the library has them, but Open MPI 5.0 rejects a count above INT_MAX with
MPI_ERR_ARG, so mpicomm splits such arrays into pieces of at most ``CHUNK``
elements and runs the ordinary collective on each (arrays of more than 2 GiB but
fewer than 2**31 elements need nothing: the byte count is never an int). A large
collective with ``async_op=True`` runs to completion before returning its Work.
The backend dispatches here when ``x.size > mpi._MAX_COUNT`` (tests lower it).
"""
from __future__ import annotations

import numpy as np

CHUNK = 2 ** 30


def _chunks(n, per=1):
    """Pieces of range(n) such that ``per`` pieces together stay within MPI's count."""
    from . import mpi

    step = max(1, min(CHUNK, mpi._MAX_COUNT) // per)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _done(c, result, async_op, what):
    if not async_op:
        return result
    from .mpi import MPIWork

    return MPIWork([], result, None, what)


def all_reduce(c, x, op, o, wb, back, async_op):
    from .mpi import _finish

    xf, of = x.reshape(-1), o.reshape(-1)
    for lo, hi in _chunks(xf.size):
        xs = xf[lo:hi]
        c.all_reduce(xs, op, xs if o is x else of[lo:hi], False)
    return _done(c, _finish(o, wb, back), async_op, ("all_reduce", x.shape, x.dtype))


def broadcast(c, h, root, x, post, async_op):
    hf = h.reshape(-1)
    for lo, hi in _chunks(hf.size):
        c.broadcast(hf[lo:hi], root, False)
    if post is not None:
        post()
    return _done(c, x, async_op, ("broadcast", h.shape, h.dtype))


def reduce(c, x, op, root, o, wb, back, async_op):
    from .mpi import _finish

    xf = x.reshape(-1)
    of = o.reshape(-1) if o is not None else None
    for lo, hi in _chunks(xf.size):
        c.reduce(xf[lo:hi], op, root, of[lo:hi] if of is not None else None, False)
    res = _finish(o, wb, back) if o is not None else None
    return _done(c, res, async_op, ("reduce", x.shape, x.dtype))


def all_gather(c, x, o, wb, back, async_op):
    from .mpi import _finish

    n = c.size
    xf, o2 = x.reshape(-1), o.reshape(n, -1)
    for lo, hi in _chunks(xf.size, n):
        part = c.all_gather(xf[lo:hi], None, False)
        o2[:, lo:hi] = part.reshape(n, hi - lo)
    return _done(c, _finish(o, wb, back), async_op, ("all_gather", x.shape, x.dtype))


def reduce_scatter(c, x, op, o, wb, back, async_op):
    from .mpi import _finish

    n = c.size
    x2, of = x.reshape(n, -1), o.reshape(-1)
    for lo, hi in _chunks(x2.shape[1], n):
        part = c.reduce_scatter(np.ascontiguousarray(x2[:, lo:hi]).reshape(-1), op, None, False)
        of[lo:hi] = part
    return _done(c, _finish(o, wb, back), async_op, ("reduce_scatter", x.shape, x.dtype))


def all_to_all(c, x, o, wb, back, async_op):
    from .mpi import _finish

    n = c.size
    x2, o2 = x.reshape(n, -1), o.reshape(n, -1)
    for lo, hi in _chunks(x2.shape[1], n):
        part = c.all_to_all(np.ascontiguousarray(x2[:, lo:hi]).reshape(-1), None, False)
        o2[:, lo:hi] = part.reshape(n, hi - lo)
    return _done(c, _finish(o, wb, back), async_op, ("all_to_all", x.shape, x.dtype))
