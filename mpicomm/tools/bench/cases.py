"""One (collective, size) case: its buffers, the mpicomm calls and raw calls, the result checks.

Only mpicomm's public API is called (``mpicomm.all_reduce(x, op, out)`` & co). A case
holds a pool of buffer pairs: one pair (the same arrays every call, as nccl-tests), or
with ``--fresh`` K pairs used in turn, so every call gets arrays other than the last
call's, as a training loop does. The raw baseline gets the same pool (its own copy when
``--array`` is not the raw library's family).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

from ..smoke import count_wrong, make_data, reduce_keys
from .timing import CHUNKED, REDUCING


def counts_for(coll, nbytes, itemsize, n):
    """(count column, bytes of the largest per-rank buffer) for a requested size, as
    nccl-tests: chunked collectives use n chunks of ``nbytes // (n * itemsize)``."""
    if coll in CHUNKED:
        c = nbytes // (n * itemsize)
        return c, c * n * itemsize
    c = nbytes // itemsize
    return c, c * itemsize


def rotate(calls):
    """One callable that makes the next call of ``calls`` each time (the one call itself
    when there is only one; None when any is None)."""
    if not calls or any(f is None for f in calls):
        return None
    if len(calls) == 1:
        return calls[0]
    nxt = itertools.cycle(calls).__next__

    def call():
        nxt()()

    return call


class Case:
    """Buffers and callables of one (collective, count): mpicomm and raw, out-of-place and
    in-place (attributes ``oop``, ``ip``, ``raw_oop``, ``raw_ip``; None where there is no
    such call). ``check_oop()``/``check_ip()`` run every pool entry once on fresh data and
    count the wrong elements.
    """

    def __init__(self, b, coll, count):
        mc, fam, n, rank, dt, op, root = b.mc, b.family, b.n, b.rank, b.dt, b.op, b.root
        c, pool = count, b.pool
        p = functools.partial
        self.b, self.coll, self.count = b, coll, c
        data_op = op if coll in REDUCING else None
        if coll in ("reduce_scatter", "all_to_all"):
            host_in = np.concatenate([make_data(data_op, dt, rank + n * j, c) for j in range(n)]) \
                if c else np.empty(0, dt)
        else:
            host_in = make_data(data_op, dt, rank, c)
        out_count = {"all_gather": n * c, "reduce_scatter": c, "all_to_all": n * c}.get(coll, c)
        self.host_in = host_in
        # In place (nccl-tests' form): all_gather's input is this rank's part of its output,
        # reduce_scatter's output is this rank's part of its input; all_to_all has none.
        ins = [fam.from_host(host_in) if coll != "broadcast" else None for _ in range(pool)]
        outs = [fam.zeros(out_count, dt) for _ in range(pool)]
        oops, ips = [], []
        part = slice(rank * c, (rank + 1) * c)
        for x, o in zip(ins, outs):
            oop = ip = None  # in place: on o, with out=o
            if coll == "all_reduce":
                oop, ip = p(mc.all_reduce, x, op, o), p(mc.all_reduce, o, op, o)
            elif coll == "all_gather":
                oop, ip = p(mc.all_gather, x, o), p(mc.all_gather, o[part], o)
            elif coll == "reduce_scatter":
                oop, ip = p(mc.reduce_scatter, x, op, o), p(mc.reduce_scatter, x, op, x[part])
            elif coll == "broadcast":
                ip = p(mc.broadcast, o, root)
            elif coll == "reduce":
                oop = p(mc.reduce, x, op, root, o)
                ip = p(mc.reduce, o, op, root, o)
            elif coll == "all_to_all":
                oop = p(mc.all_to_all, x, o)
            else:
                raise ValueError(f"unknown collective {coll!r}")
            oops.append(oop)
            ips.append(ip)
        self._oops, self._ips, self._ins, self._outs = oops, ips, ins, outs
        self.oop, self.ip = rotate(oops), rotate(ips)
        self.raw_oop = self.raw_ip = None
        if b.raw is not None:
            self._raw(b, ins, outs, host_in, out_count)
        if self.ip is None:
            self.raw_ip = None
        if self.oop is None:
            self.raw_oop = None

    def _raw(self, b, ins, outs, host_in, out_count):
        coll, raw, c = self.coll, b.raw, self.count
        if b.raw_family is not b.family:  # the raw library's own arrays, with the same data
            rf = b.raw_family
            ins = [rf.from_host(host_in) if x is not None else None for x in ins]
            outs = [rf.zeros(out_count, b.dt) for _ in outs]
        oops, ips = [], []
        for x, o in zip(ins, outs):
            if coll == "all_reduce":
                f, g = raw.all_reduce(x, o, c)
            elif coll == "all_gather":
                f, g = raw.all_gather(x, o, c)
            elif coll == "reduce_scatter":
                f, g = raw.reduce_scatter(x, o, c)
            elif coll == "broadcast":
                f, g = None, raw.broadcast(o, c)
            elif coll == "reduce":
                f, g = raw.reduce(x, o, c)
            else:
                f, g = raw.all_to_all(x, o, c), None
            oops.append(f)
            ips.append(g)
        self.raw_oop, self.raw_ip = rotate(oops), rotate(ips)

    def expect(self):
        """The exact result on this rank (NumPy)."""
        b, c, coll = self.b, self.count, self.coll
        n, rank, dt, op, root = b.n, b.rank, b.dt, b.op, b.root
        if coll in ("all_reduce", "reduce"):
            return reduce_keys(op, dt, range(n), c)
        if coll == "reduce_scatter":
            return reduce_keys(op, dt, [i + n * rank for i in range(n)], c)
        if coll == "broadcast":
            return make_data(None, dt, root, c)
        keys = range(n) if coll == "all_gather" else [i + n * rank for i in range(n)]
        return np.concatenate([make_data(None, dt, k, c) for k in keys]) if c else np.empty(0, dt)

    def _count_wrong(self, got):
        b = self.b
        if self.coll == "reduce" and b.rank != b.root:
            return 0
        exp = self.expect()
        got = np.asarray(b.family.to_host(got, b.dt)).reshape(-1)
        if got.shape != exp.shape or got.dtype != exp.dtype:
            return int(exp.size) or 1
        return count_wrong(got, exp, b.dt)[0]

    def check_oop(self):
        b, wrong = self.b, 0
        for f, x, o in zip(self._oops, self._ins, self._outs):
            b.family.copy_in(x, self.host_in)
            f()
            b.synchronize()
            wrong += self._count_wrong(o)
        return wrong

    def check_ip(self):
        b, wrong = self.b, 0
        part = slice(b.rank * self.count, (b.rank + 1) * self.count)
        for f, x, o in zip(self._ips, self._ins, self._outs):
            if self.coll == "all_gather":      # the input is this rank's part of o
                b.family.copy_in(o[part], self.host_in)
            elif self.coll == "reduce_scatter":  # the output is this rank's part of x
                b.family.copy_in(x, self.host_in)
                o = x[part]
            else:
                b.family.copy_in(o, self.host_in)
            f()
            b.synchronize()
            wrong += self._count_wrong(o)
        return wrong


# ---------------------------------------------------------------- per-rank sizes, gather, scatter, sendrecv

def uneven_counts(total, n):
    """``total`` elements split unevenly over n ranks: rank r's share grows with r+1."""
    w = n * (n + 1) // 2
    counts = [total * (r + 1) // w for r in range(n)]
    counts[-1] += total - sum(counts)
    return counts


def uneven_splits(c, n):
    """S[i][j]: elements rank i sends rank j, about c each: c/2, c or 3c/2 by (i + j) % 3."""
    return [[c + ((i + j) % 3 - 1) * (c // 2) for j in range(n)] for i in range(n)]


class CaseV(Case):
    """A case of the calls with per-rank sizes (all_gatherv, all_to_allv), gather, scatter
    and sendrecv: out of place only, mpicomm against raw mpi4py / raw grouped NCCL send/recv."""

    def __init__(self, b, coll, count):
        mc, fam, n, rank, dt, root = b.mc, b.family, b.n, b.rank, b.dt, b.root
        c, pool = count, b.pool
        p = functools.partial
        self.b, self.coll, self.count = b, coll, c
        kw = {}
        if coll == "all_gatherv":
            self.counts = uneven_counts(n * c, n)
            host_in = make_data(None, dt, rank, self.counts[rank])
            out_count = n * c
            kw = {"sizes": self.counts}
        elif coll == "all_to_allv":
            self.S = uneven_splits(c, n)
            host_in = np.concatenate([make_data(None, dt, rank + n * j, self.S[rank][j]) for j in range(n)]) \
                if c else np.empty(0, dt)
            out_count = sum(self.S[i][rank] for i in range(n))
            kw = {"in_splits": self.S[rank], "out_splits": [self.S[i][rank] for i in range(n)]}
        elif coll == "gather":
            host_in = make_data(None, dt, rank, c)
            out_count = n * c if rank == root else 0
        elif coll == "scatter":
            host_in = np.concatenate([make_data(None, dt, n + j, c) for j in range(n)]) if rank == root and c \
                else np.empty(n * c if rank == root else 0, dt)
            out_count = c
        elif coll == "sendrecv":
            host_in = make_data(None, dt, rank, c)
            out_count = c
        else:
            raise ValueError(f"unknown collective {coll!r}")
        self.host_in = host_in
        ins = [fam.from_host(host_in) for _ in range(pool)]
        outs = [fam.zeros(out_count, dt) for _ in range(pool)]
        oops = []
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        for x, o in zip(ins, outs):
            if coll == "all_gatherv":
                oops.append(p(mc.all_gather, x, o, **kw))
            elif coll == "all_to_allv":
                oops.append(p(mc.all_to_all, x, o, **kw))
            elif coll == "gather":
                oops.append(p(mc.gather, x, root, o if rank == root else None))
            elif coll == "scatter":
                oops.append(p(mc.scatter, x if rank == root else None, root, o))
            else:
                oops.append(p(mc.sendrecv, x, nxt, o, prv))
        self._oops, self._ips, self._ins, self._outs = oops, [None] * pool, ins, outs
        self.oop, self.ip = rotate(oops), None
        self.raw_oop = self.raw_ip = None
        if b.raw is not None:
            if b.raw_family is not b.family:
                rf = b.raw_family
                ins = [rf.from_host(host_in) for _ in ins]
                outs = [rf.zeros(out_count, dt) for _ in outs]
            raw = b.raw
            fs = []
            for x, o in zip(ins, outs):
                if coll == "all_gatherv":
                    fs.append(raw.all_gatherv(x, o, self.counts))
                elif coll == "all_to_allv":
                    fs.append(raw.all_to_allv(x, o, self.S[rank], [self.S[i][rank] for i in range(n)]))
                elif coll == "gather":
                    fs.append(raw.gather(x, o, c))
                elif coll == "scatter":
                    fs.append(raw.scatter(x, o, c))
                else:
                    fs.append(raw.sendrecv(x, o, nxt, prv))
            self.raw_oop = rotate(fs)

    def expect(self):
        b, c, coll = self.b, self.count, self.coll
        n, rank, dt = b.n, b.rank, b.dt
        if coll == "all_gatherv":
            return np.concatenate([make_data(None, dt, r, self.counts[r]) for r in range(n)]) if c else np.empty(0, dt)
        if coll == "all_to_allv":
            parts = [make_data(None, dt, i + n * rank, self.S[i][rank]) for i in range(n)]
            return np.concatenate(parts) if c else np.empty(0, dt)
        if coll == "gather":
            return np.concatenate([make_data(None, dt, r, c) for r in range(n)]) if c else np.empty(0, dt)
        if coll == "scatter":
            return make_data(None, dt, n + rank, c)
        return make_data(None, dt, (rank - 1) % n, c)

    def _count_wrong(self, got):
        b = self.b
        if self.coll == "gather" and b.rank != b.root:
            return 0
        return super()._count_wrong(got)

    def check_ip(self):
        return 0
