"""``mpicomm-smoke``: check every collective on this cluster, the way a real job runs.

Run it under the launcher the job will use, e.g. ``mpirun -n 4 mpicomm-smoke`` (or
``mpirun -n 4 python -m mpicomm.tools.smoke``). It initialises mpicomm with the
backend ``init()`` picks (NCCL with CuPy arrays where a GPU is seen, else MPI with
NumPy; ``--backend`` or MPICOMM_BACKEND override), then runs every collective x op x
dtype over counts from 0 and 1 element, odd counts, up to tens of MiB per buffer, on
the world and on a sub-group, sync and async. Every rank checks its own result against
a closed-form expectation (exact for integers, within a tolerance for floats); the
failures are gathered on rank 0, which prints a table (collective, dtypes, ops, counts,
time, PASS/FAIL), the classic AllGather check (each rank's ``[[rank]]`` as float32,
gathered), and one line per failure naming collective, dtype, op, count, group, mode
and the world ranks that disagreed. Every rank exits 0 only if everything passed.

``--quick`` keeps to small counts (a few seconds at 4 ranks on a 2-core machine).

The sub-group is world ranks n-1, n-2, ..., 1 in that order (at 2 ranks: [1, 0]), so
group ranks differ from world ranks and, from 3 ranks on, rank 0 is not a member; at 1
rank the world is the only group.

Self-test of the checker: ``MPICOMM_SMOKE_BREAK=all_gather`` (any collective name, or
several, comma-separated) corrupts that collective's result on the last rank of each
group before it is checked; the smoke must then exit non-zero and name it.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

from ._common import exit_cleanly, load_mpi

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
               "send_recv", "barrier", "all_gatherv", "all_to_allv", "reduce_scatterv", "gather", "scatter",
               "sendrecv", "batch")
DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32",
          "float64", "complex64", "complex128")
OPS = ("sum", "prod", "min", "max", "avg")
REDUCING = ("all_reduce", "reduce_scatter", "reduce", "reduce_scatterv")
# the largest buffer is n chunks of the count for these
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all", "all_gatherv", "all_to_allv", "reduce_scatterv",
           "gather", "scatter")
# lcm(3, 5, 7, 11): every value pattern below repeats after this many elements
PERIOD = 1155
QUICK_COUNTS = (0, 1, 1001)
FULL_COUNTS = (0, 1, 2, 7, 127, 1001, 65537, (1 << 18) + 3)
BIG_BYTES = 24 << 20  # "tens of MiB": the largest buffer of the full run, per rank
# the dtypes that run at BIG_BYTES: each MPI transport path (native, float16/bfloat16 upcast,
# 8-byte, complex) once
BIG_DTYPES = ("int8", "float16", "bfloat16", "float32", "float64", "complex64")
# the calls with per-rank sizes, gather, scatter, sendrecv and batch move data as the calls
# above do: at the large count one 4-byte dtype, and float16 (reduced in float32 on MPI)
BIG_DTYPES_NEW = ("float16", "float32")
NEW = ("all_gatherv", "all_to_allv", "reduce_scatterv", "gather", "scatter", "sendrecv", "batch")
BREAK_ENV = "MPICOMM_SMOKE_BREAK"


# ---------------------------------------------------------------- closed-form data

def np_dtype(name):
    """The NumPy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        from .._dtypes import BFLOAT16

        if BFLOAT16 is None:
            raise ValueError("bfloat16 needs ml_dtypes")
        return BFLOAT16
    return np.dtype(name)


def _kind(dt):
    if dt.kind in "iu":
        return dt.kind
    if dt.kind == "c":
        return "c"
    return "f"  # float16/32/64 and ml_dtypes' bfloat16 (kind 'V')


def _exact_limit(dt):
    """Largest magnitude the dtype holds exactly as an integer."""
    if dt.kind in "iu":
        return min(np.iinfo(dt).max, 1 << 23)
    return {2: 256 if dt.kind == "V" else 2048, 4: 1 << 24, 8: 1 << 24, 16: 1 << 24}[dt.itemsize] \
        if dt.kind != "c" else 1 << 24


@functools.lru_cache(maxsize=4096)
def pattern(op, dt, key):
    """One period of the data with ``key`` (a rank, or rank + n*chunk) for ``op``.

    Integer-valued, in int64 (float64/complex128 for complex), small enough that every
    reduction is exact in ``dt``: SUM/AVG values -2..4 (1..7 unsigned), PROD values
    +-1 and +-2, MIN/MAX -5..5 (0..10 unsigned). ``op=None`` (data movement) encodes
    the key itself, so a chunk from the wrong rank or place never matches.
    """
    k = np.arange(PERIOD, dtype=np.int64)
    kind = _kind(dt)
    signed = kind != "u"
    if op in ("sum", "avg"):
        v = (key * 3 + k) % 7 + 1 - (3 if signed else 0)
    elif op == "prod":
        v = np.where((key + k) % 3 == 0, 2, 1)
        if signed:
            v = v * np.where((key + 2 * k) % 5 == 0, -1, 1)
    elif op in ("min", "max"):
        v = (key * 5 + k * 3) % 11 - (5 if signed else 0)
    else:  # data movement: the key, visibly
        lim = _exact_limit(dt)
        m = max(1, (2 * lim if signed else lim) // 8 - 1)
        v = k % 7 + 1 + 8 * (key % m) - (lim - 1 if signed else 0)
    if kind == "c":
        v = v + 1j * pattern(op, np.dtype("float64"), key + 1)
    v.flags.writeable = False  # cached: shared by every caller
    return v


def make_data(op, dt, key, count, shape=None):
    """``count`` elements of ``pattern(op, dt, key)`` as a NumPy array of dtype ``dt``."""
    base = pattern(op, dt, key).astype(dt)
    a = np.resize(base, count) if count else np.empty(0, dt)
    return a.reshape(shape) if shape is not None else a


def reduce_keys(op, dt, keys, count):
    """The exact result of reducing ``make_data(op, dt, key, count)`` over ``keys`` with ``op``."""
    r = _reduced_period(op, dt, tuple(keys))
    return np.resize(r, count) if count else np.empty(0, dt)


@functools.lru_cache(maxsize=1024)
def _reduced_period(op, dt, keys):
    stack = np.stack([pattern(op, dt, key) for key in keys])
    if op in ("sum", "avg"):
        r = stack.sum(axis=0)
        if op == "avg":
            r = r / len(keys)
    elif op == "prod":
        r = stack.prod(axis=0)
    elif op == "min":
        r = stack.min(axis=0)
    else:
        r = stack.max(axis=0)
    if dt.kind in "iu":
        r = r.astype(np.int64).astype(dt)  # wraps like the transport's integer arithmetic
    else:
        r = r.astype(dt)
    return r


def tolerance(dt):
    """rtol (= atol, values are O(1..1000)) for comparing a float result."""
    if dt.kind == "V" or _kind(dt) == "f" and dt.itemsize == 2:
        return 1e-2 if dt.kind == "V" else 2e-3
    if dt.itemsize <= 4 or dt == np.dtype("complex64"):
        return 1e-5
    return 1e-12


_CHUNK = 1 << 22  # elements compared at a time: bounded temporaries for GiB-sized results


def wrong_mask(got, exp, dt):
    """Boolean array: where ``got`` differs from ``exp`` (exactly for integers, else
    beyond :func:`tolerance`). Same shapes assumed."""
    if dt.kind in "iu":
        return got != exp
    wide = np.complex128 if dt.kind == "c" else np.float64
    g, e = got.astype(wide), exp.astype(wide)
    return ~(np.abs(g - e) <= tolerance(dt) * (1 + np.abs(e)))


def count_wrong(got, exp, dt):
    """(number of wrong elements, flat index of the first or None), in chunks."""
    g, e = np.asarray(got).reshape(-1), np.asarray(exp).reshape(-1)
    nbad, first = 0, None
    for i in range(0, e.size, _CHUNK):
        bad = wrong_mask(g[i:i + _CHUNK], e[i:i + _CHUNK], dt)
        k = int(np.count_nonzero(bad))
        if k and first is None:
            first = i + int(np.flatnonzero(bad)[0])
        nbad += k
    return nbad, first


def compare(got, exp, dt):
    """None if ``got`` matches ``exp``, else a short description of the first mismatch."""
    if got is None:
        return "no result (None)"
    got = np.asarray(got)
    if got.shape != exp.shape:
        return f"shape {got.shape}, expected {exp.shape}"
    if got.dtype != exp.dtype:
        return f"dtype {got.dtype}, expected {exp.dtype}"
    if exp.size == 0:
        return None
    nbad, i = count_wrong(got, exp, dt)
    if not nbad:
        return None
    return (f"{nbad} of {exp.size} element(s) wrong, first at [{i}]: got {got.ravel()[i]!r}, "
            f"expected {exp.ravel()[i]!r}")


# ---------------------------------------------------------------- the run

class Case:
    __slots__ = ("coll", "dtype", "op", "count", "group", "mode")

    def __init__(self, coll, dtype, op, count, group, mode):
        self.coll, self.dtype, self.op, self.count, self.group, self.mode = \
            coll, dtype, op, count, group, mode

    def key(self):
        return (self.coll, self.dtype, self.op or "-", self.count, self.group, self.mode)


def ops_for(dt):
    kind = _kind(dt)
    if kind == "c":
        return ("sum", "avg")
    if kind == "f":
        return OPS
    return ("sum", "prod", "min", "max")


def plan(dtypes, groups, quick, big_bytes=BIG_BYTES, n=1):
    """Every case of a run, in the same order on every rank.

    Every dtype and op runs at the small and medium counts (0 and 1 element, odd
    counts), sync and async, on every group, and all_reduce also in place. The full run
    adds one odd count of about ``big_bytes`` per rank (the largest buffer: ``n`` chunks
    of it for all_gather, reduce_scatter and all_to_all) for one dtype of each transport
    path (BIG_DTYPES; BIG_DTYPES_NEW for the calls of NEW), SUM and data movement, sync on
    every group and async on the first.
    """
    counts = QUICK_COUNTS if quick else FULL_COUNTS
    modes = ("sync", "async")
    cases = []
    for coll in COLLECTIVES:
        for gi, g in enumerate(groups):
            if coll == "barrier":
                for mode in modes:
                    cases.append(Case(coll, None, None, 0, g, mode))
                continue
            for name in dtypes:
                dt = np_dtype(name)
                ops = ops_for(dt) if coll in REDUCING else (None,)
                for op in ops:
                    for count in counts:
                        for mode in modes:
                            cases.append(Case(coll, name, op, count, g, mode))
                        if coll == "all_reduce":
                            cases.append(Case(coll, name, op, count, g, "in-place"))
                    if quick or name not in (BIG_DTYPES_NEW if coll in NEW else BIG_DTYPES) \
                            or op not in (None, "sum"):
                        continue
                    per = big_bytes // dt.itemsize
                    if coll in CHUNKED:
                        per //= max(n, 1)
                    for mode in (modes if gi == 0 else modes[:1]):
                        cases.append(Case(coll, name, op, per | 1, g, mode))  # odd, tens of MiB
    return cases


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
            from ..errors import MpicommError

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
            got.ravel()[0] = 1 if e0 != 1 else 2
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


# ---------------------------------------------------------------- reporting

def _counts_text(counts):
    cs = sorted(counts)
    return ", ".join(str(c) for c in cs) if len(cs) <= 3 else f"{cs[0]}..{cs[-1]} ({len(cs)})"


def summary_rows(cases, times, failures):
    """One row per collective: (collective, dtypes, ops, counts, cases, seconds, verdict)."""
    failed = {}
    for key, _detail, _rank in failures:
        failed.setdefault(key[0], set()).add(key)
    rows = []
    for coll in COLLECTIVES:
        cs = [c for c in cases if c.coll == coll]
        if not cs:
            continue
        dts = sorted({c.dtype for c in cs if c.dtype}, key=DTYPES.index)
        ops = [o for o in OPS if any(c.op == o for c in cs)]
        verdict = "PASS" if coll not in failed else f"FAIL ({len(failed[coll])} case(s))"
        rows.append((coll, f"{len(dts)} dtypes" if len(dts) > 3 else (",".join(dts) or "-"),
                     ",".join(ops) or "-", _counts_text({c.count for c in cs}) if dts else "-",
                     str(len(cs)), f"{times.get(coll, 0.0):.2f}", verdict))
    return rows


def format_table(rows):
    head = ("collective", "dtypes", "ops", "counts (elements)", "cases", "time (s)", "result")
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % x for x in w)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * x for x in w))]
                     + [fmt.format(*r) for r in rows])


def merge_failures(all_failures):
    """[(key, detail, world rank)] -> [(key, [ranks], {rank: detail})], in case order."""
    merged = {}
    for key, detail, rank in all_failures:
        ent = merged.setdefault(key, ({}))
        ent[rank] = detail
    return [(k, sorted(v), v) for k, v in merged.items()]


def failure_line(key, ranks, details):
    coll, dtype, op, count, group, mode = key
    first = details[ranks[0]]
    what = f"{coll}" + (f" dtype={dtype}" if dtype else "") + (f" op={op}" if op != "-" else "")
    return (f"FAIL {what} count={count} group={group} mode={mode}: rank(s) "
            f"{', '.join(map(str, ranks))} disagreed; rank {ranks[0]}: {first}")


# ---------------------------------------------------------------- main

def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-smoke",
        description="Check every collective x op x dtype on this job's ranks (run under mpirun).")
    p.add_argument("--quick", action="store_true", help="small counts only: a few seconds")
    p.add_argument("--backend", choices=("mpi", "nccl"), default=None,
                   help="backend to init (default: what mpicomm.init picks)")
    p.add_argument("--dtypes", default=None, help="comma-separated subset of " + ",".join(DTYPES))
    p.add_argument("--collectives", default=None, help="comma-separated subset of " + ",".join(COLLECTIVES))
    p.add_argument("--no-subgroup", action="store_true", help="test the world only")
    p.add_argument("-v", "--verbose", action="store_true", help="print every failure, not the first 20")
    return p


def _supported_dtypes(xp, names):
    """The dtypes this rank's array library can hold (bfloat16 needs a CuPy that knows it)."""
    ok = []
    for name in names:
        try:
            dt = np_dtype(name)
            if xp is not np:
                xp.asarray(np.zeros(1, dt))
        except Exception:
            continue
        ok.append(name)
    return ok


def main(argv=None):
    """Run the smoke test on every rank; return 0 if every check passed on every rank."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return exc.code
    dtypes = DTYPES if not args.dtypes else tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    colls = COLLECTIVES if not args.collectives else tuple(
        c.strip() for c in args.collectives.split(",") if c.strip())
    for d in dtypes:
        if d not in DTYPES:
            print(f"mpicomm-smoke: unknown dtype {d!r}; expected some of {', '.join(DTYPES)}", file=sys.stderr)
            return 2
    for c in colls:
        if c not in COLLECTIVES:
            print(f"mpicomm-smoke: unknown collective {c!r}; expected some of {', '.join(COLLECTIVES)}",
                  file=sys.stderr)
            return 2
    breaks = {b.strip() for b in os.environ.get(BREAK_ENV, "").split(",") if b.strip()}

    import mpicomm as mc

    MPI = load_mpi("mpicomm-smoke")
    if MPI is None:
        return 2
    t_start = time.perf_counter()
    mc.init(args.backend)
    comm = MPI.COMM_WORLD
    rank, n = mc.get_rank(), mc.get_group_size()
    backend = mc.get_backend()
    if backend == "nccl":
        import cupy as xp
    else:
        xp = np
    # every rank tests the same dtypes (agree first: a dtype skipped on one rank only would hang)
    mine = _supported_dtypes(xp, dtypes)
    common = [d for d in dtypes if all(d in s for s in comm.allgather(mine))]
    skipped = [d for d in dtypes if d not in common]

    groups = {"world": (n, rank, None)}
    if n > 1 and not args.no_subgroup:
        sub = list(range(n - 1, 0, -1)) if n > 2 else [1, 0]
        mc.create_group("smoke_sub", sub)
        groups["sub" + str(sub).replace(" ", "")] = (len(sub), sub.index(rank) if rank in sub else None,
                                                     "smoke_sub")
    all_cases = plan(common, list(groups), args.quick, n=n)
    cases = [c for c in all_cases if c.coll in colls]
    runner = Runner(mc, xp, groups, breaks)
    times = {}
    for c in cases:
        t0 = time.perf_counter()
        runner.run(c)
        times[c.coll] = times.get(c.coll, 0.0) + time.perf_counter() - t0

    # the classic check: each rank's [[rank]], gathered along axis 0
    x = xp.asarray(np.array([[rank]], np.float32))
    classic = runner.host(mc.all_gather(x))
    classic_ok = compare(classic, np.arange(n, dtype=np.float32).reshape(n, 1), np.dtype(np.float32))
    if "all_gather" in breaks and rank == n - 1:
        classic = classic.copy()
        classic[-1, 0] += 1
        classic_ok = "corrupted (" + BREAK_ENV + ")"
    mine_fail = [(k, d, rank) for k, d in runner.failures]
    if classic_ok is not None:
        mine_fail.append((("all_gather", "float32", "-", 1, "world", "classic [[rank]]"), classic_ok, rank))
    gathered = comm.gather((mine_fail, runner.checks), root=0)
    status = 0
    if rank == 0:
        failures = [f for fs, _ in gathered for f in fs]
        checks = sum(c for _, c in gathered)
        status = 1 if failures else 0
        lib = MPI.Get_library_version().replace("\0", "").split(",")[0].strip()
        gtext = "; ".join(f"{name}: {size} rank(s)" for name, (size, _, _) in groups.items())
        print(f"mpicomm-smoke: {n} rank(s), backend {backend}, {lib}; mpi4py "
              f"{__import__('mpi4py').__version__}; groups {gtext}"
              + ("; quick" if args.quick else ""))
        if skipped:
            print(f"skipped dtypes (not supported by this rank's array library on every rank): "
                  f"{', '.join(skipped)}")
        if breaks:
            print(f"{BREAK_ENV}={','.join(sorted(breaks))}: corrupting those results on purpose "
                  "(self-test of the checker)")
        print(format_table(summary_rows(cases, times, failures)))
        print("AllGather check: each rank's [[rank]] as float32, gathered:")
        print(classic)
        merged = merge_failures(failures)
        order = {c.key(): i for i, c in enumerate(cases)}  # report in the order the cases ran
        merged.sort(key=lambda m: order.get(m[0], len(order)))
        for coll in COLLECTIVES:  # one line per broken collective, then the first cases
            mc_ = [(k, r) for k, r, _ in merged if k[0] == coll]
            if mc_:
                ranks = sorted({x for _, r in mc_ for x in r})
                dts = sorted({k[1] for k, _ in mc_ if k[1]}, key=DTYPES.index)
                print(f"FAIL {coll}: {len(mc_)} failing case(s); dtypes {','.join(dts) or '-'}; counts "
                      f"{_counts_text({k[3] for k, _ in mc_})}; groups {','.join(sorted({k[4] for k, _ in mc_}))}; "
                      f"ranks that disagreed: {', '.join(map(str, ranks))}")
        limit = None if args.verbose else 10
        for key, ranks, details in merged[:limit]:
            print(failure_line(key, ranks, details))
        if limit is not None and len(merged) > limit:
            print(f"... and {len(merged) - limit} more failing case(s) (--verbose lists them)")
        wall = time.perf_counter() - t_start
        if failures:
            colls_bad = sorted({k[0] for k, _, _ in merged}, key=COLLECTIVES.index)
            print(f"FAIL: {len(merged)} failing case(s) in {', '.join(colls_bad)}; "
                  f"{checks} checks on {n} rank(s) in {wall:.1f} s")
        else:
            print(f"PASS: {checks} checks on {n} rank(s) in {wall:.1f} s")
        sys.stdout.flush()
    return comm.bcast(status, root=0)


if __name__ == "__main__":
    exit_cleanly(main())
