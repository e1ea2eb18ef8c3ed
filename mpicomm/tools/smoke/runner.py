"""Runs one smoke case on this rank: each collective's call with the data of
expected.py, and its result checked against the closed form."""
from __future__ import annotations

import numpy as np

from .expected import compare, make_data, np_dtype, reduce_keys


class _Mismatch(Exception):
    """A result that is wrong in a way compare() does not describe."""


class Runner:
    """Runs cases on one rank; keeps this rank's failures."""

    def __init__(self, mc, xp, groups, breaks):
        self.mc = mc
        self.xp = xp                # numpy, or cupy on the NCCL backend
        self.groups = groups        # name -> (size, group rank or None, mpicomm group arg)
        self.breaks = breaks
        self.failures = []          # (case key, detail)
        self.checks = 0
        self.sync = (lambda: xp.cuda.get_current_stream().synchronize()) if xp is not np else None

    def dev(self, a):
        return a if self.xp is np else self.xp.asarray(a)

    def host(self, a):
        if a is None or self.xp is np:
            return a
        return self.xp.asnumpy(a)

    def run(self, c):
        n, grank, garg = self.groups[c.group]
        if grank is None:
            return  # not a member of this group
        try:
            got, exp = getattr(self, "_" + c.coll)(c, n, grank, garg)
        except _Mismatch as e:
            self.checks += 1
            self.failures.append((c.key(), str(e)))
            return
        except Exception as e:  # an error raised alike on every rank is a failure, not a crash
            from ...errors import MpicommError

            if not isinstance(e, MpicommError):
                raise
            self.failures.append((c.key(), f"raised {type(e).__name__}: {e}"))
            return
        if exp is None:
            return
        self.checks += 1
        if c.coll in self.breaks and grank == n - 1 and got is not None and np.size(got):
            got = np.array(got, copy=True)  # the checker's self-test: corrupt one element
            e0 = exp.ravel()[0]
            got.ravel()[0] = (not e0) if got.dtype == np.bool_ else (1 if e0 != 1 else 2)
        bad = compare(got, exp, np_dtype(c.dtype))
        if bad is not None:
            self.failures.append((c.key(), bad))

    def _call(self, fn, c, *args, **kw):
        r = fn(*args, async_op=c.mode == "async", **kw)
        if c.mode == "async":
            r = r.wait()
        return r

    # each returns (this rank's result on the host, the expectation) or (None, None)
    def _all_reduce(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        x = self.dev(make_data(c.op, dt, grank, c.count))
        if c.mode == "in-place":
            r = self.mc.all_reduce(x, c.op, out=x, group=g)
        else:
            r = self._call(self.mc.all_reduce, c, x, c.op, group=g)
        return self.host(r), reduce_keys(c.op, dt, range(n), c.count)

    def _reduce(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        root = n - 1
        x = self.dev(make_data(c.op, dt, grank, c.count))
        r = self._call(self.mc.reduce, c, x, c.op, root, group=g)
        if grank != root:
            if r is not None:
                raise _Mismatch(f"returned {type(r).__name__} on a non-root rank (expected None)")
            return None, None
        return self.host(r), reduce_keys(c.op, dt, range(n), c.count)

    def _reduce_scatter(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        x = np.concatenate([make_data(c.op, dt, grank + n * j, c.count) for j in range(n)])
        r = self._call(self.mc.reduce_scatter, c, self.dev(x), c.op, group=g)
        return self.host(r), reduce_keys(c.op, dt, [i + n * grank for i in range(n)], c.count)

    def _all_gather(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        x = self.dev(make_data(None, dt, grank, c.count))
        r = self._call(self.mc.all_gather, c, x, group=g)
        return self.host(r), np.concatenate([make_data(None, dt, i, c.count) for i in range(n)])

    def _all_to_all(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        x = np.concatenate([make_data(None, dt, grank + n * j, c.count) for j in range(n)])
        r = self._call(self.mc.all_to_all, c, self.dev(x), group=g)
        return self.host(r), np.concatenate([make_data(None, dt, i + n * grank, c.count)
                                             for i in range(n)])

    def _broadcast(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        root = n - 1
        x = self.dev(make_data(None, dt, grank, c.count))
        r = self._call(self.mc.broadcast, c, x, root, group=g)
        return self.host(r), make_data(None, dt, root, c.count)

    def _send_recv(self, c, n, grank, g):
        """A ring: rank r sends its data to r+1 and receives r-1's (even ranks send first)."""
        if n == 1:
            return None, None
        dt = np_dtype(c.dtype)
        dst, src = (grank + 1) % n, (grank - 1) % n
        x = self.dev(make_data(None, dt, grank, c.count))
        buf = self.dev(np.empty(c.count, dt))
        mc = self.mc
        a = c.mode == "async"
        # even ranks send first, odd ranks receive first, in both modes: on NCCL the calls
        # are queued on one stream in this order, and a ring where every rank sends first
        # would wait forever once a message no longer fits NCCL's buffers
        if grank % 2 == 0:
            ws = [mc.send(x, dst, group=g, async_op=a), mc.recv(buf, src, group=g, async_op=a)]
        else:
            ws = [mc.recv(buf, src, group=g, async_op=a), mc.send(x, dst, group=g, async_op=a)]
        if a:
            for w in ws:
                w.wait()
        if self.sync is not None:
            self.sync()
        return self.host(buf), make_data(None, dt, src, c.count)

    # per-rank sizes (zero-length ranks among them), gather, scatter, sendrecv, batch
    @staticmethod
    def _sizes(count, n):
        return [count * ((r + 1) % 3) // 2 for r in range(n)]

    def _all_gatherv(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        sz = self._sizes(c.count, n)
        x = self.dev(make_data(None, dt, grank, sz[grank]))
        r = self._call(self.mc.all_gather, c, x, group=g, sizes="auto" if c.mode == "sync" else sz)
        return self.host(r), np.concatenate([make_data(None, dt, i, sz[i]) for i in range(n)])

    def _all_to_allv(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        S = [[c.count * ((i + j) % 3) // 2 for j in range(n)] for i in range(n)]
        x = np.concatenate([make_data(None, dt, grank + n * j, S[grank][j]) for j in range(n)])
        outs = "auto" if c.mode == "sync" else [S[i][grank] for i in range(n)]
        r = self._call(self.mc.all_to_all, c, self.dev(x), group=g, in_splits=S[grank], out_splits=outs)
        return self.host(r), np.concatenate([make_data(None, dt, i + n * grank, S[i][grank]) for i in range(n)])

    def _reduce_scatterv(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        sz = self._sizes(c.count, n)
        x = np.concatenate([make_data(c.op, dt, grank + n * j, sz[j]) for j in range(n)])
        r = self._call(self.mc.reduce_scatter, c, self.dev(x), c.op, group=g, sizes=sz)
        return self.host(r), reduce_keys(c.op, dt, [i + n * grank for i in range(n)], sz[grank])

    def _gather(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        sz, root = self._sizes(c.count, n), n - 1
        x = self.dev(make_data(None, dt, grank, sz[grank]))
        r = self._call(self.mc.gather, c, x, root, group=g, sizes=sz)
        if grank != root:
            if r is not None:
                raise _Mismatch(f"returned {type(r).__name__} on a non-root rank (expected None)")
            return None, None
        return self.host(r), np.concatenate([make_data(None, dt, i, sz[i]) for i in range(n)])

    def _scatter(self, c, n, grank, g):
        dt = np_dtype(c.dtype)
        sz, root = self._sizes(c.count, n), 0
        x = self.dev(np.concatenate([make_data(None, dt, n + j, sz[j]) for j in range(n)])) if grank == root else None
        out = self.dev(np.empty(sz[grank], dt))
        r = self._call(self.mc.scatter, c, x, root, out=out, group=g, sizes=sz)
        return self.host(r), make_data(None, dt, n + grank, sz[grank])

    def _sendrecv(self, c, n, grank, g):
        """A ring where every rank sends first: sendrecv cannot deadlock."""
        dt = np_dtype(c.dtype)
        dst, src = (grank + 1) % n, (grank - 1) % n
        r = self._call(self.mc.sendrecv, c, self.dev(make_data(None, dt, grank, c.count)), dst, src=src, group=g)
        if self.sync is not None:
            self.sync()
        return self.host(r), make_data(None, dt, src, c.count)

    def _batch(self, c, n, grank, g):
        """A ring as one batch, every rank sending first, with an all_reduce in it."""
        dt = np_dtype(c.dtype)
        dst, src = (grank + 1) % n, (grank - 1) % n
        buf = self.dev(np.empty(c.count, dt))
        with self.mc.batch(g):
            self.mc.send(self.dev(make_data(None, dt, grank, c.count)), dst, group=g)
            self.mc.recv(buf, src, group=g)
            w = self.mc.all_gather(self.dev(make_data(None, dt, grank, 1)), group=g)
        if self.sync is not None:
            self.sync()
        got = np.concatenate([self.host(buf), self.host(w.wait())])
        return got, np.concatenate([make_data(None, dt, src, c.count)] + [make_data(None, dt, i, 1) for i in range(n)])

    def _barrier(self, c, n, grank, g):
        self._call(self.mc.barrier, c, group=g)
        return None, None
