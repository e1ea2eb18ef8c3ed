"""Timing: a clock every rank runs alike, interleaved rounds, and nccl-tests' bandwidths."""
from __future__ import annotations

import itertools
import os
import time

import numpy as np

COLLS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
         "all_gatherv", "all_to_allv", "gather", "scatter", "sendrecv")
# per-rank sizes (all_gather(sizes=), all_to_all(in_splits=, out_splits=)), gather, scatter, sendrecv
VCOLLS = ("all_gatherv", "all_to_allv", "gather", "scatter", "sendrecv")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# size = n chunks of `count` (all_gatherv: n * count in all, split unevenly; all_to_allv:
# about count to each rank)
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all", "all_gatherv", "all_to_allv", "gather", "scatter")
MIB = 1 << 20


# MPICOMM_BENCH_TRIAL=1: a trial run that shows a command works, not what it measures (sizes
# up to 64 KiB, the first 16 tensors of the gradient set, one round, at most 3 iterations);
# the table's header says so. The test suite runs the documented commands this way.
TRIAL_ENV = "MPICOMM_BENCH_TRIAL"
TRIAL_MAX_BYTES = 64 * 1024
TRIAL_TENSORS = 16


def trial():
    """Whether this is a trial run (MPICOMM_BENCH_TRIAL set and not 0)."""
    return os.environ.get(TRIAL_ENV, "0") not in ("", "0")


def bus_factor(coll, n):
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth for ``n`` ranks."""
    if coll in ("all_reduce", "buckets"):
        return 2.0 * (n - 1) / n
    if coll == "sendrecv":   # each rank sends and receives size bytes
        return 1.0
    if coll in CHUNKED:
        return (n - 1) / n
    if coll in ROOTED:
        return 1.0
    raise ValueError(f"unknown collective {coll!r}")


def bandwidths(coll, size, seconds, n):
    """(algbw, busbw) in GB/s (1e9 bytes) of moving ``size`` bytes in ``seconds``."""
    if not seconds or seconds <= 0:
        return 0.0, 0.0
    alg = size / seconds / 1e9
    return alg, alg * bus_factor(coll, n)


def variant(coll, size, seconds, n, wrong=None):
    """One column of a row: time per call (us), algbw, busbw, wrong elements (None: unchecked)."""
    alg, bus = bandwidths(coll, size, seconds, n)
    return {"time_us": seconds * 1e6, "algbw": alg, "busbw": bus, "wrong": wrong}


class Clock:
    """Times callables the same way on every rank: barrier, N calls, (sync), max over ranks.

    ``comm`` is an mpi4py communicator of the bench's own, for barriers and maxima;
    ``sync`` waits for the device (a stream's synchronize) or is None on the host: on
    GPUs N calls are launched, the device waited for once, and the host time divided by N.
    """

    def __init__(self, comm, sync=None):
        from mpi4py import MPI

        self.comm = comm
        self.sync = sync
        self._in_place, self._max = MPI.IN_PLACE, MPI.MAX

    def _block(self, f, k):
        if self.sync is not None:
            self.sync()
        around = getattr(f, "around", None)   # set up / undo a variant's setting per block
        f = getattr(f, "fn", f)               # (the call itself, timed without a wrapper)
        if around is not None:
            around(True)
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in itertools.repeat(None, k):
            f()
        if self.sync is not None:
            self.sync()
        t = time.perf_counter() - t0
        if around is not None:
            around(False)
        return t

    def _max_over_ranks(self, a):
        self.comm.Allreduce(self._in_place, a, op=self._max)
        return a

    def warm(self, fns, w):
        """``w`` calls of each callable in ``fns`` (None: skipped)."""
        for f in fns:
            if f is not None and w:
                self._block(f, w)

    def probe(self, f, k):
        """Seconds per call of ``f`` (max over ranks), from ``k`` calls."""
        t = np.array([self._block(f, k) / max(k, 1)])
        return float(self._max_over_ranks(t)[0])

    def time(self, fns, iters, rounds, stat="mean"):
        """Seconds per call of each callable in ``fns`` (None: skipped, and None back).

        The iterations are split into ``rounds`` interleaved blocks whose order alternates
        (a, b, b, a, ...), so that noise hits every callable alike. Each block's time is the
        maximum over ranks; ``stat`` "mean" weighs blocks by their calls (nccl-tests'
        average), "median" and "min" take that statistic of the per-call block times
        (robust to bursts of noise from other processes on a shared machine).
        """
        live = [i for i, f in enumerate(fns) if f is not None]
        rounds = max(1, min(rounds, iters))
        per = np.zeros((rounds, len(fns)))
        ks = []
        done = 0
        for r in range(rounds):
            k = (iters - done) // (rounds - r)
            done += k
            ks.append(k)
            order = live if r % 2 == 0 else live[::-1]
            for i in order:
                per[r, i] = self._block(fns[i], k) / k
        self._max_over_ranks(per)
        if stat == "median":
            agg = np.median(per, axis=0)
        elif stat == "min":
            agg = per.min(axis=0)
        else:
            agg = (per * np.array(ks)[:, None]).sum(axis=0) / iters
        return [float(agg[i]) if fns[i] is not None else None for i in range(len(fns))]
