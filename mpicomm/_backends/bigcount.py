"""Collectives of more than 2**31 - 1 elements on the MPI backend.

MPI counts are C ints. mpi4py 4 calls the MPI-4 large-count ``_c`` functions where
the library has them, but Open MPI 5.0 rejects a count above INT_MAX with
MPI_ERR_ARG, so such arrays go in pieces of at most ``CHUNK`` elements, each an
ordinary collective made by the ``call`` the transport passes in. A large collective
with ``async_op=True`` runs to completion before returning its Work.
"""
from __future__ import annotations

import numpy as np

from .base import DoneWork

CHUNK = 2 ** 30


def pieces(n, per=1):
    """Pieces ``(lo, hi)`` of range(n) such that ``per`` pieces together stay within CHUNK."""
    step = max(1, CHUNK // per)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _done(result, fin, o, async_op, what):
    if fin is not None:
        result = fin(o)
    if not async_op:
        return result
    return DoneWork(result, what)


def all_reduce(call, xh, o, fin, async_op, what):
    """``call(a, b)`` all-reduces piece ``a`` into ``b`` (``b is a``: in place)."""
    xf = xh.reshape(-1)
    of = xf if o is xh else o.reshape(-1)
    for lo, hi in pieces(xf.size):
        a = xf[lo:hi]
        call(a, a if of is xf else of[lo:hi])
    return _done(o, fin, o, async_op, what)


def broadcast(call, h, post, async_op, x, what):
    """``call(a)`` broadcasts piece ``a`` in place."""
    hf = h.reshape(-1)
    for lo, hi in pieces(hf.size):
        call(hf[lo:hi])
    if post is not None:
        post()
    return x if not async_op else DoneWork(x, what)


def reduce(call, xh, o, fin, async_op, what):
    """``call(a, b)`` reduces piece ``a`` into ``b`` on the root (``b`` None elsewhere)."""
    xf = xh.reshape(-1)
    of = o.reshape(-1) if o is not None else None
    for lo, hi in pieces(xf.size):
        a = xf[lo:hi]
        call(a, of[lo:hi] if of is not None else None)
    return _done(o, fin if o is not None else None, o, async_op, what)


def all_gather(call, xh, o, n, fin, async_op, what):
    """``call(a)`` returns the all-gather of piece ``a`` (n pieces, flat)."""
    xf, o2 = xh.reshape(-1), o.reshape(n, -1)
    for lo, hi in pieces(xf.size, n):
        o2[:, lo:hi] = call(np.ascontiguousarray(xf[lo:hi])).reshape(n, hi - lo)
    return _done(o, fin, o, async_op, what)


def reduce_scatter(call, xh, o, n, fin, async_op, what):
    """``call(a)`` returns this rank's chunk of the reduce-scatter of ``a`` (n chunks, flat)."""
    x2, of = xh.reshape(n, -1), o.reshape(-1)
    for lo, hi in pieces(x2.shape[1], n):
        of[lo:hi] = call(np.ascontiguousarray(x2[:, lo:hi]).reshape(-1))
    return _done(o, fin, o, async_op, what)


def all_to_all(call, xh, o, n, fin, async_op, what):
    """``call(a)`` returns the all-to-all of ``a`` (n chunks, flat)."""
    x2, o2 = xh.reshape(n, -1), o.reshape(n, -1)
    for lo, hi in pieces(x2.shape[1], n):
        o2[:, lo:hi] = call(np.ascontiguousarray(x2[:, lo:hi]).reshape(-1)).reshape(n, hi - lo)
    return _done(o, fin, o, async_op, what)
