"""``mpicomm-bench``: an nccl-tests style benchmark of mpicomm's collectives.

Run under mpirun, e.g. ``mpirun -n 2 mpicomm-bench -b 8 -e 1G -f 2 --compare``. Flags
follow nccl-tests: ``-b``/``-e`` the smallest and largest size in bytes (K/M/G
suffixes, powers of 1024), ``-f`` the step factor (or ``-i`` a step in bytes), ``-n``
iterations (0: enough for about ``--target-time`` seconds per size), ``-w`` warm-up
iterations, ``-c`` check results (0/1), ``-d`` dtype, ``-o`` reduction op, ``-r``
root, ``--coll`` the collective.

The table has nccl-tests' columns (size, count, type, redop, root, then time, algbw,
busbw and #wrong, out-of-place and in-place), with its bus-bandwidth factors: all_reduce
2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1. Times
are per call, averaged over the iterations and the maximum over ranks. ``size`` is one
rank's largest buffer (the gathered output of all_gather, the input of reduce_scatter),
``count`` the elements per rank of nccl-tests' parameter count. As nccl-tests does,
mpicomm gets preallocated ``out=`` arrays. Where mpicomm has no such form (broadcast
is in place only; in-place all_gather/reduce_scatter/reduce exist only on NCCL; no
in-place all_to_all) the columns say N/A.

``--compare`` also times the raw library in the same run, on its own communicator and
the same buffers, interleaved with mpicomm per size (mpicomm, raw, raw, mpicomm, ... in
rounds, so machine noise hits both): mpi4py ``Comm.Allreduce`` & co on the MPI backend,
CuPy ``NcclCommunicator`` calls on NCCL. It adds, per variant, raw's time, the ratio
mpicomm busbw / raw busbw (1.00: as fast as raw) and the time mpicomm adds per call.
On GPUs, N calls are launched and the stream synchronized once, then the host time is
divided by N.

``--coll buckets`` times the ResNet-50 gradient set (``resnet50_grad_shapes.txt`` from
``$MPICOMM_SHARED_DATA``, else ``../shared/data`` next to the repository, or
``--shapes FILE``): one in-place all_reduce per tensor, DistributedGradReducer with its
default buckets, and one flat buffer. ``--json FILE`` writes every row; ``--plot
FILE.png`` draws busbw against size (mpicomm and raw) with matplotlib.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import platform
import re
import socket
import sys
import time

import numpy as np

COLLS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "buckets")
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all")  # size = n chunks of `count`
# nccl-tests' type names, and the names -d accepts for each dtype
TYPE_NAMES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
              "uint64": "uint64", "float16": "half", "bfloat16": "bfloat16", "float32": "float",
              "float64": "double", "complex64": "complex64", "complex128": "complex128"}
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                 "double": "float64", "fp64": "float64", "bf16": "bfloat16", "char": "int8",
                 "int": "int32", "uint": "uint32"}
OPS = ("sum", "prod", "min", "max", "avg")
SHAPES_FILE = "resnet50_grad_shapes.txt"
MIB = 1 << 20


# ---------------------------------------------------------------- pure helpers (unit-tested)

def parse_size(text):
    """Bytes from "8", "64K", "1M", "1G", "512KiB", "2MB" (K/M/G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: expected a number of bytes with an optional "
                         "K, M or G suffix (e.g. 8, 64K, 1M, 1G)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    v = float(m.group(1)) * mult
    if v != int(v):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(v)


def size_steps(minbytes, maxbytes, factor=2.0, step=None):
    """The sizes from ``minbytes`` to ``maxbytes``: times ``factor``, or plus ``step`` bytes."""
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"invalid size range -b {minbytes} -e {maxbytes}: need 0 <= -b <= -e")
    if step is None and factor <= 1:
        raise ValueError(f"invalid step factor -f {factor}: need > 1 (or give -i STEP)")
    if step is not None and step <= 0:
        raise ValueError(f"invalid step -i {step}: need > 0")
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(int(s))
        if step is not None:
            s += step
        else:
            nxt = s * factor if s else 1
            s = int(nxt) if int(nxt) > s else s + 1
    return out


def bus_factor(coll, n):
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth for ``n`` ranks."""
    if coll in ("all_reduce", "buckets"):
        return 2.0 * (n - 1) / n
    if coll in CHUNKED:
        return (n - 1) / n
    if coll in ROOTED:
        return 1.0
    raise ValueError(f"unknown collective {coll!r}")


def counts_for(coll, nbytes, itemsize, n):
    """(count column, bytes of the largest per-rank buffer) for a requested size, as
    nccl-tests: chunked collectives use n chunks of ``nbytes // (n * itemsize)``."""
    if coll in CHUNKED:
        c = nbytes // (n * itemsize)
        return c, c * n * itemsize
    c = nbytes // itemsize
    return c, c * itemsize


def bandwidths(coll, size, seconds, n):
    """(algbw, busbw) in GB/s (1e9 bytes) of moving ``size`` bytes in ``seconds``."""
    if not seconds or seconds <= 0:
        return 0.0, 0.0
    alg = size / seconds / 1e9
    return alg, alg * bus_factor(coll, n)


def fmt_time(us):
    """nccl-tests' time format: 2 decimals below 100 us, 1 below 10 ms, none above."""
    if us is None:
        return "N/A"
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def header(compare=False):
    """The column header lines, nccl-tests' plus the --compare columns."""
    h1 = "#" + " " * 62 + "out-of-place" + " " * 23 + "in-place"
    h2 = "#       size         count      type   redop    root     time   algbw   busbw #wrong" \
         "     time   algbw   busbw #wrong"
    h3 = "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       " \
         "     (us)  (GB/s)  (GB/s)       "
    if compare:
        h1 += " " * 17 + "raw out-of-place" + " " * 14 + "raw in-place"
        h2 += "  raw time  ratio  +us/call  raw time  ratio  +us/call"
        h3 += "      (us)                       (us)                 "
    return [h1, h2, h3]


def _variant_cols(v):
    if v is None:
        return "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
    wrong = "N/A" if v.get("wrong") is None else str(v["wrong"])
    return "  %7s  %6.2f  %6.2f  %5s" % (fmt_time(v["time_us"]), v["algbw"], v["busbw"], wrong)


def _compare_cols(v, raw):
    if v is None or raw is None:
        return "  %8s  %5s  %8s" % ("N/A", "N/A", "N/A")
    ratio = raw["time_us"] / v["time_us"] if v["time_us"] > 0 else float("nan")
    return "  %8s  %5.2f  %+8.2f" % (fmt_time(raw["time_us"]).strip(), ratio, v["time_us"] - raw["time_us"])


def format_row(row, compare=False):
    """One table line: nccl-tests' columns, then raw time, ratio and added us per variant."""
    s = "%12d  %12d  %8s  %6s  %6d" % (row["size"], row["count"], row["type"], row["redop"], row["root"])
    s += _variant_cols(row.get("oop")) + _variant_cols(row.get("ip"))
    if compare:
        s += _compare_cols(row.get("oop"), row.get("raw_oop")) + _compare_cols(row.get("ip"), row.get("raw_ip"))
    return s


def variant(coll, size, seconds, n, wrong=None):
    alg, bus = bandwidths(coll, size, seconds, n)
    return {"time_us": seconds * 1e6, "algbw": alg, "busbw": bus, "wrong": wrong}


def ratio(row, which="oop"):
    """mpicomm busbw / raw busbw for a row (raw time / mpicomm time), or None."""
    v, raw = row.get(which), row.get("raw_" + which)
    if not v or not raw or v["time_us"] <= 0:
        return None
    return raw["time_us"] / v["time_us"]


def primary(row):
    """The variant a row is summarised by: out-of-place, else in-place (broadcast)."""
    return "oop" if row.get("oop") else "ip"


def summary_lines(rows, compare):
    """The lines after the table: wrong values, average busbw, and the compare verdicts."""
    wrong = sum((r.get(k) or {}).get("wrong") or 0 for r in rows for k in ("oop", "ip"))
    checked = any((r.get(k) or {}).get("wrong") is not None for r in rows for k in ("oop", "ip"))
    out = [f"# Out of bounds values : {wrong} {'OK' if not wrong else 'FAILED'}"
           + ("" if checked else " (not checked: -c 0)")]
    bws = [r[primary(r)]["busbw"] for r in rows if r.get(primary(r))]
    if bws:
        out.append(f"# Avg bus bandwidth    : {sum(bws) / len(bws):g} ")
    if compare:
        big = [(r["size"], ratio(r, primary(r))) for r in rows if r["size"] >= MIB]
        big = [(s, q) for s, q in big if q is not None]
        if big:
            worst = min(big, key=lambda t: t[1])
            out.append(f"# mpicomm/raw busbw at >= 1 MiB: min {worst[1]:.3f} (at {worst[0]} B), "
                       f"median {float(np.median([q for _, q in big])):.3f}")
        small = [r for r in rows if r.get(primary(r)) and r.get("raw_" + primary(r))]
        if small:
            r0 = small[0]
            p = primary(r0)
            out.append(f"# added per call at {r0['size']} B: "
                       f"{r0[p]['time_us'] - r0['raw_' + p]['time_us']:+.2f} us "
                       f"(mpicomm {r0[p]['time_us']:.2f} us, raw {r0['raw_' + p]['time_us']:.2f} us)")
    return out


def find_shapes_file(explicit=None):
    """The ResNet-50 gradient shapes file: ``explicit``, $MPICOMM_GRAD_SHAPES (the file),
    $MPICOMM_SHARED_DATA (its folder), then ../shared/data relative to the repository
    root (and to the working directory)."""
    if explicit:
        return explicit
    cands = []
    f = os.environ.get("MPICOMM_GRAD_SHAPES")  # the file itself, as scripts/bench_buckets.py takes it
    if f:
        cands.append(f)
    env = os.environ.get("MPICOMM_SHARED_DATA")
    if env:
        cands.append(os.path.join(env, SHAPES_FILE))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cands += [os.path.join(repo, "..", "shared", "data", SHAPES_FILE),
              os.path.join(os.getcwd(), "..", "shared", "data", SHAPES_FILE)]
    for c in cands:
        if os.path.isfile(c):
            return os.path.normpath(c)
    raise FileNotFoundError(f"{SHAPES_FILE} not found (looked in: {', '.join(map(os.path.normpath, cands))}); "
                            "set MPICOMM_SHARED_DATA to its folder or pass --shapes FILE")


def read_shapes(path):
    """Shapes, one per line as ``64x3x7x7`` (blank lines and # comments skipped)."""
    shapes = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            line = line.split("#")[0].strip()
            if not line:
                continue
            try:
                shapes.append(tuple(int(d) for d in re.split(r"[x,\s]+", line) if d))
            except ValueError:
                raise ValueError(f"{path}:{ln}: invalid shape {line!r} (expected e.g. 64x3x7x7)") from None
    return shapes


def plot(rows, path, title, buckets=False):
    """Draw busbw against size (mpicomm and raw, log-2 size axis) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if buckets:
        names = [r["mode"] for r in rows]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, [r["busbw"] for r in rows], 0.4, label="mpicomm")
        ax.bar(xs + 0.2, [(r.get("raw") or {}).get("busbw", 0.0) for r in rows], 0.4, label="raw")
        ax.set_xticks(xs, names)
        ax.set_ylabel("bus bandwidth (GB/s)")
    else:
        for which, style in (("oop", "-"), ("ip", "--")):
            for src, marker, label in (("", "o", "mpicomm"), ("raw_", "x", "raw")):
                pts = [(r["size"], r[src + which]["busbw"]) for r in rows
                       if r.get(src + which) and r["size"] > 0]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker,
                            label=f"{label} {'out-of-place' if which == 'oop' else 'in-place'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- timing

class Clock:
    """Times callables the same way on every rank: barrier, N calls, (stream sync), max over ranks."""

    def __init__(self, comm, sync=None):
        self.comm = comm        # an mpi4py communicator for barriers and the max
        self.sync = sync        # stream.synchronize on GPUs, None on the host

    def _block(self, f, k):
        if self.sync is not None:
            self.sync()
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in itertools.repeat(None, k):
            f()
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - t0

    def warm(self, fns, w):
        for f in fns:
            if f is not None and w:
                self._block(f, w)

    def probe(self, f, k):
        """Seconds per call of ``f`` (max over ranks), from ``k`` calls."""
        t = np.array([self._block(f, k) / max(k, 1)])
        self.comm.Allreduce(MPI_IN_PLACE(), t, op=_mpi_max())
        return float(t[0])

    def time(self, fns, iters, rounds, stat="mean"):
        """Seconds per call of each callable in ``fns`` (None: skipped).

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
        self.comm.Allreduce(MPI_IN_PLACE(), per, op=_mpi_max())
        if stat == "median":
            agg = np.median(per, axis=0)
        elif stat == "min":
            agg = per.min(axis=0)
        else:
            agg = (per * np.array(ks)[:, None]).sum(axis=0) / iters
        return [float(agg[i]) if fns[i] is not None else None for i in range(len(fns))]


def MPI_IN_PLACE():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX


# ---------------------------------------------------------------- the collectives, both ways

class Setup:
    """Buffers and callables of one (collective, size): mpicomm and raw, out-of-place and in-place.

    ``fill()`` writes the check data; ``check_oop()``/``check_ip()`` count wrong elements.
    """

    def __init__(self, b, coll, count):
        from ..smoke import make_data, reduce_keys

        self.b = b
        mc, xp, n, rank, dt, op, root = b.mc, b.xp, b.n, b.rank, b.dt, b.op, b.root
        c = count
        self.oop = self.ip = self.raw_oop = self.raw_ip = None
        dev = b.dev
        data_op = op if coll in REDUCING else None
        if coll in ("reduce_scatter", "all_to_all"):
            host_in = np.concatenate([make_data(data_op, dt, rank + n * j, c) for j in range(n)]) \
                if c else np.empty(0, dt)
        else:
            host_in = make_data(data_op, dt, rank, c)
        out_count = {"all_gather": n * c, "reduce_scatter": c, "all_to_all": n * c}.get(coll, c)
        send = dev(host_in)
        recv = dev(np.zeros(out_count, dt))
        self.send, self.recv, self.host_in = send, recv, host_in
        mop = b.mpi_op
        raw = b.raw
        nccl = b.backend == "nccl"
        p = functools.partial
        item = dt.itemsize
        if coll == "all_reduce":
            self.oop = p(mc.all_reduce, send, op, recv)
            self.ip = p(mc.all_reduce, recv, op, recv)
            self.expect = lambda: reduce_keys(op, dt, range(n), c)
            self.ip_buf, self.ip_in = recv, host_in
            if raw is not None:
                self.raw_oop, self.raw_ip = raw.all_reduce(send, recv, c)
        elif coll == "all_gather":
            self.oop = p(mc.all_gather, send, recv)
            view = recv[rank * c:(rank + 1) * c]
            if nccl:
                self.ip = p(mc.all_gather, view, recv)
            self.expect = lambda: np.concatenate([make_data(None, dt, i, c) for i in range(n)]) \
                if c else np.empty(0, dt)
            self.ip_buf, self.ip_in, self.ip_view = recv, host_in, view
            if raw is not None:
                self.raw_oop, self.raw_ip = raw.all_gather(send, recv, c, rank * c * item)
        elif coll == "reduce_scatter":
            self.oop = p(mc.reduce_scatter, send, op, recv)
            view = send[rank * c:(rank + 1) * c]
            if nccl:
                self.ip = p(mc.reduce_scatter, send, op, view)
            self.expect = lambda: reduce_keys(op, dt, [i + n * rank for i in range(n)], c)
            self.ip_buf, self.ip_in, self.ip_view = send, host_in, view
            if raw is not None:
                self.raw_oop, self.raw_ip = raw.reduce_scatter(send, recv, c, rank * c * item)
        elif coll == "broadcast":
            self.ip = p(mc.broadcast, recv, root)
            self.expect = lambda: make_data(None, dt, root, c)
            self.ip_buf, self.ip_in = recv, host_in
            if raw is not None:
                self.raw_ip = raw.broadcast(recv, c)
        elif coll == "reduce":
            self.oop = p(mc.reduce, send, op, root, recv)
            if nccl:
                self.ip = p(mc.reduce, recv, op, root, recv)
            self.expect = lambda: reduce_keys(op, dt, range(n), c)
            self.ip_buf, self.ip_in = recv, host_in
            if raw is not None:
                self.raw_oop, self.raw_ip = raw.reduce(send, recv, c)
        elif coll == "all_to_all":
            self.oop = p(mc.all_to_all, send, recv)
            self.expect = lambda: np.concatenate([make_data(None, dt, i + n * rank, c) for i in range(n)]) \
                if c else np.empty(0, dt)
            if raw is not None:
                self.raw_oop, self.raw_ip = raw.all_to_all(send, recv, c), None
        self.coll = coll
        if not self.ip:
            self.raw_ip = None
        if not self.oop:
            self.raw_oop = None

    def _count_wrong(self, got):
        from ..smoke import count_wrong

        b = self.b
        if self.coll == "reduce" and b.rank != b.root:
            return 0
        exp = self.expect()
        got = np.asarray(b.host(got))
        if got.shape != exp.shape or got.dtype != exp.dtype:
            return int(exp.size) or 1
        return count_wrong(got, exp, b.dt)[0]

    def check_oop(self):
        b = self.b
        b.copy_in(self.send, self.host_in)
        self.oop()
        b.synchronize()
        return self._count_wrong(self.recv)

    def check_ip(self):
        b = self.b
        # in-place all_gather: this rank's input is its own slice of the output
        b.copy_in(self.ip_view if self.coll == "all_gather" else self.ip_buf, self.ip_in)
        self.ip()
        b.synchronize()
        if self.coll == "reduce_scatter":
            return self._count_wrong(self.ip_view)
        return self._count_wrong(self.ip_buf)


class RawMPI:
    """The same collectives with mpi4py on its own communicator, as a user would write them."""

    def __init__(self, comm, dt, op, root, n):
        from mpi4py import MPI

        from ..._arrays import dtype_info

        self.MPI = MPI
        self.comm = comm
        info = dtype_info(dt)
        self.typed = info.upcast   # float16/bfloat16: MPI cannot infer these; give UINT16 explicitly
        self.mpitype = info.mpi
        self.reduce_ok = not info.upcast  # MPI has no float16/bfloat16 reductions
        self.mop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX, "avg": MPI.SUM}[op]
        self.avg = op == "avg"
        self.root = root
        self.n = n

    def _b(self, a):
        return [a, self.mpitype] if self.typed else a

    def all_reduce(self, send, recv, c):
        if not self.reduce_ok:
            return None, None
        comm, mop, IN_PLACE = self.comm, self.mop, self.MPI.IN_PLACE
        if self.avg:
            n = self.n

            def oop():
                comm.Allreduce(send, recv, mop)
                np.divide(recv, n, out=recv)

            def ip():
                comm.Allreduce(IN_PLACE, recv, mop)
                np.divide(recv, n, out=recv)

            return oop, ip
        return functools.partial(comm.Allreduce, send, recv, mop), \
            functools.partial(comm.Allreduce, IN_PLACE, recv, mop)

    def all_gather(self, send, recv, c, offset):
        return functools.partial(self.comm.Allgather, self._b(send), self._b(recv)), \
            functools.partial(self.comm.Allgather, self.MPI.IN_PLACE, self._b(recv))

    def reduce_scatter(self, send, recv, c, offset):
        if not self.reduce_ok:
            return None, None
        return functools.partial(self.comm.Reduce_scatter_block, send, recv, self.mop), None

    def broadcast(self, buf, c):
        return functools.partial(self.comm.Bcast, self._b(buf), self.root)

    def reduce(self, send, recv, c):
        if not self.reduce_ok:
            return None, None
        return functools.partial(self.comm.Reduce, send, recv, self.mop, self.root), None

    def all_to_all(self, send, recv, c):
        return functools.partial(self.comm.Alltoall, self._b(send), self._b(recv))


class RawNCCL:
    """The same collectives as direct CuPy ``NcclCommunicator`` calls on a communicator of its own."""

    def __init__(self, mpi_comm, dt, op, root, n, rank, device_id, stream_ptr):
        import cupy
        from cupy.cuda import nccl

        from ..._arrays import dtype_info

        uid = nccl.get_unique_id() if rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        with cupy.cuda.Device(device_id):
            self.comm = nccl.NcclCommunicator(n, uid, rank)
        self.nccl = nccl
        info = dtype_info(dt)
        self.dt, self.scale, self.item = info.nccl, info.nccl_scale, dt.itemsize
        self.op = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}[op]
        self.root, self.n, self.s = root, n, stream_ptr

    def close(self):
        self.comm.destroy()

    def all_reduce(self, send, recv, c):
        cm, p = self.comm, functools.partial
        sp, rp, cnt = send.data.ptr, recv.data.ptr, c * self.scale
        return p(cm.allReduce, sp, rp, cnt, self.dt, self.op, self.s), \
            p(cm.allReduce, rp, rp, cnt, self.dt, self.op, self.s)

    def all_gather(self, send, recv, c, offset):
        cm, p = self.comm, functools.partial
        rp, cnt = recv.data.ptr, c * self.scale
        return p(cm.allGather, send.data.ptr, rp, cnt, self.dt, self.s), \
            p(cm.allGather, rp + offset, rp, cnt, self.dt, self.s)

    def reduce_scatter(self, send, recv, c, offset):
        cm, p = self.comm, functools.partial
        sp, cnt = send.data.ptr, c * self.scale
        return p(cm.reduceScatter, sp, recv.data.ptr, cnt, self.dt, self.op, self.s), \
            p(cm.reduceScatter, sp, sp + offset, cnt, self.dt, self.op, self.s)

    def broadcast(self, buf, c):
        bp = buf.data.ptr
        return functools.partial(self.comm.broadcast, bp, bp, c * self.scale, self.dt, self.root, self.s)

    def reduce(self, send, recv, c):
        cm, p = self.comm, functools.partial
        rp, cnt = recv.data.ptr, c * self.scale
        return p(cm.reduce, send.data.ptr, rp, cnt, self.dt, self.op, self.root, self.s), \
            p(cm.reduce, rp, rp, cnt, self.dt, self.op, self.root, self.s)

    def all_to_all(self, send, recv, c):
        cm, nccl, n, dt, s = self.comm, self.nccl, self.n, self.dt, self.s
        cnt = c * self.scale
        nb = c * self.item
        sp, rp = send.data.ptr, recv.data.ptr

        def a2a():
            nccl.groupStart()
            for j in range(n):
                cm.send(sp + j * nb, cnt, dt, j, s)
                cm.recv(rp + j * nb, cnt, dt, j, s)
            nccl.groupEnd()

        return a2a


class Bench:
    """The state shared by every size of a run."""

    def __init__(self, args):
        import mpicomm as mc
        from mpi4py import MPI

        from ..smoke import np_dtype

        mc.init(args.backend)
        self.mc = mc
        self.args = args
        self.backend = mc.get_backend()
        self.n, self.rank = mc.get_group_size(), mc.get_rank()
        self.comm = MPI.COMM_WORLD.Dup()   # for the bench's own barriers, maxima and raw MPI
        self.dt = np_dtype(args.dtype)
        self.op = args.op
        self.root = args.root
        self.mpi_op = None
        self.stream = None
        self.raw = None
        if self.backend == "nccl":
            import cupy

            from ..._state import CTX

            self.xp = cupy
            cupy.cuda.Device(CTX.device_id).use()
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.stream.use()  # mpicomm enqueues on the current stream: the same one as raw
            self.clock = Clock(self.comm, self.stream.synchronize)
            if args.compare:
                self.raw = RawNCCL(self.comm, self.dt, self.op, self.root, self.n, self.rank,
                                   CTX.device_id, self.stream.ptr)
        else:
            self.xp = np
            self.clock = Clock(self.comm, None)
            if args.compare:
                self.raw = RawMPI(self.comm, self.dt, self.op, self.root, self.n)

    def dev(self, a):
        return a if self.xp is np else self.xp.asarray(a)

    def host(self, a):
        return a if self.xp is np else self.xp.asnumpy(a)

    def copy_in(self, dst, host):
        if self.xp is np:
            np.copyto(dst, host)
        else:
            dst.set(host)

    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()

    def iters_for(self, f):
        """-n, or with -n 0 enough calls for --target-time seconds (agreed over ranks)."""
        a = self.args
        if a.iters > 0:
            return a.iters
        per = self.clock.probe(f, max(a.warmup, 1))
        return int(min(max(a.target_time / max(per, 1e-9), 5), 200000))

    def close(self):
        if self.raw is not None and hasattr(self.raw, "close"):
            self.raw.close()
        self.comm.Free()

    def versions(self):
        from mpi4py import MPI

        v = {"mpicomm": self.mc.__version__, "mpi4py": __import__("mpi4py").__version__,
             "mpi": MPI.Get_library_version().replace("\0", "").split(",")[0].strip(),
             "numpy": np.__version__, "python": platform.python_version()}
        if self.backend == "nccl":
            import cupy

            v["cupy"] = cupy.__version__
            try:
                c = cupy.cuda.nccl.get_version()
                v["nccl"] = f"{c // 10000}.{c % 10000 // 100}.{c % 100}" if c >= 10000 else str(c)
            except Exception:
                pass
            try:
                v["gpu"] = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
            except Exception:
                pass
        return v


def run_sizes(b, sizes, progress):
    """Time every size; returns the rows (on every rank)."""
    a = b.args
    rows = []
    n = b.n
    t_start = time.perf_counter()
    for i, req in enumerate(sizes):
        count, size = counts_for(a.coll, req, b.dt.itemsize, n)
        st = Setup(b, a.coll, count)
        fns = [st.oop, st.raw_oop, st.ip, st.raw_ip]
        b.clock.warm(fns, a.warmup)
        iters = b.iters_for(st.oop or st.ip)
        t_oop, t_roop, t_ip, t_rip = b.clock.time(fns, iters, a.rounds, a.stat)
        row = {"coll": a.coll, "size": size, "count": count, "type": TYPE_NAMES[str(b.dt)],
               "redop": a.op if a.coll in REDUCING else "none", "root": b.root if a.coll in ROOTED else -1,
               "iters": iters}
        for key, t, f, chk in (("oop", t_oop, st.oop, st.check_oop), ("ip", t_ip, st.ip, st.check_ip)):
            if f is None:
                row[key] = None
                continue
            wrong = None
            if a.check:
                w = np.array([chk()], dtype=np.int64)
                b.comm.Allreduce(MPI_IN_PLACE(), w)
                wrong = int(w[0])
            row[key] = variant(a.coll, size, t, n, wrong)
        row["raw_oop"] = variant(a.coll, size, t_roop, n) if t_roop is not None else None
        row["raw_ip"] = variant(a.coll, size, t_rip, n) if t_rip is not None else None
        for k in ("raw_oop", "raw_ip"):
            if row[k] is not None:
                del row[k]["wrong"]
        rows.append(row)
        if b.rank == 0:
            print(format_row(row, a.compare), flush=True)
            if progress:
                print(f"[mpicomm-bench] {a.coll} {i + 1}/{len(sizes)}: {size} B x {iters} iters, "
                      f"{time.perf_counter() - t_start:.1f} s so far", file=sys.stderr, flush=True)
        del st
    return rows


def run_buckets(b, progress):
    """Time the ResNet-50 gradient set per tensor, with default buckets and as one buffer."""
    from ..smoke import make_data

    a = b.args
    mc, n = b.mc, b.n
    path = find_shapes_file(a.shapes)
    shapes = read_shapes(path)
    f32 = np.dtype(np.float32)
    sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes)
    nbytes = total * 4
    grads = [b.dev(make_data("sum", f32, b.rank + i, c).reshape(s)) for i, (s, c) in enumerate(zip(shapes, sizes))]
    flat = b.dev(make_data("sum", f32, b.rank, total))
    SUM = mc.ReduceOp.SUM

    def per_tensor():
        ar = mc.all_reduce
        for g in grads:
            ar(g, SUM, g)

    raw_per = raw_flat = None
    if b.raw is not None:
        if b.backend == "nccl":
            r = b.raw
            ptrs = [(g.data.ptr, g.size) for g in grads]
            fp = flat.data.ptr

            def raw_per():
                for p_, c_ in ptrs:
                    r.comm.allReduce(p_, p_, c_, r.dt, 0, r.s)

            raw_flat = functools.partial(r.comm.allReduce, fp, fp, total, r.dt, 0, r.s)
        else:
            from mpi4py import MPI

            comm = b.raw.comm

            def raw_per():
                for g in grads:
                    comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM)

            raw_flat = functools.partial(comm.Allreduce, MPI.IN_PLACE, flat, MPI.SUM)

    modes = [("per-tensor", len(shapes), per_tensor, raw_per)]
    note = None
    try:
        Reducer = mc.DistributedGradReducer
    except (AttributeError, ImportError) as e:
        Reducer = None
        note = f"DistributedGradReducer not available ({type(e).__name__}: {e}): buckets row skipped"
    if Reducer is not None:
        red = Reducer(grads, mean=False)
        nb = len(red.buckets) if hasattr(red, "buckets") and not callable(red.buckets) else \
            (len(red.buckets()) if hasattr(red, "buckets") else None)
        modes.append(("buckets reducer(grads)", nb, functools.partial(red, grads), None))  # MindSpore's usage
        modes.append(("buckets reduce_(grads)", nb, functools.partial(red.reduce_, grads), None))
        if hasattr(red, "grad_views"):
            views = red.grad_views()
            modes.append(("buckets (grad_views)", nb, functools.partial(red.reduce_, views), None))
            if getattr(red, "group_launch", False) and b.backend == "nccl":
                red1 = Reducer(grads, mean=False)  # the same buckets issued one by one, not in an NCCL group
                red1.group_launch = False
                modes.append(("buckets (one by one)", nb, functools.partial(red1.reduce_, red1.grad_views()), None))
            if hasattr(red, "mark_ready"):
                order = list(range(len(grads)))[::-1]  # the order backward produces gradients

                def overlapped(red=red, order=order):
                    for i in order:
                        red.mark_ready(i)
                    red.wait()

                modes.append(("buckets (mark_ready)", nb, overlapped, None))
    modes.append(("one buffer", 1, functools.partial(mc.all_reduce, flat, SUM, flat), raw_flat))
    rows = []
    if b.rank == 0:
        print(f"# ResNet-50 gradients: {len(shapes)} float32 tensors, {nbytes} bytes ({path})")
        if note:
            print("# " + note)
        h = "#                 mode   calls        bytes   time (ms)   algbw   busbw"
        if a.compare:
            h += "   raw (ms)  ratio"
        print(h, flush=True)
    for mode, calls, f, raw in modes:
        b.clock.warm([f, raw], max(a.warmup, 1))
        iters = a.iters if a.iters > 0 else max(3, int(a.target_time / max(b.clock.probe(f, 1), 1e-9)))
        t, tr = b.clock.time([f, raw], iters, a.rounds, a.stat)
        alg, bus = bandwidths("all_reduce", nbytes, t, n)
        row = {"coll": "buckets", "mode": mode, "calls": calls, "size": nbytes, "iters": iters,
               "time_us": t * 1e6, "algbw": alg, "busbw": bus, "raw": None}
        if tr is not None:
            ra, rb = bandwidths("all_reduce", nbytes, tr, n)
            row["raw"] = {"time_us": tr * 1e6, "algbw": ra, "busbw": rb}
        rows.append(row)
        if b.rank == 0:
            s = "%22s  %6s  %11d  %10.3f  %6.2f  %6.2f" % (mode, calls if calls is not None else "?", nbytes,
                                                          t * 1e3, alg, bus)
            if a.compare:
                s += ("  %9.3f  %5.2f" % (tr * 1e3, tr / t)) if tr is not None else "  %9s  %5s" % ("N/A", "N/A")
            print(s, flush=True)
            if progress:
                print(f"[mpicomm-bench] buckets: {mode} done ({iters} iters)", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- main

def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-bench",
        description="nccl-tests style benchmark of mpicomm's collectives (run under mpirun).")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size in bytes (K/M/G suffixes; default 8)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest size in bytes (default 32M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor between steps (default 2)")
    p.add_argument("-i", "--stepbytes", default=None, help="size increment instead of -f")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed iterations per size (default 20; 0: about --target-time s per size)")
    p.add_argument("-w", "--warmup", "--warmup_iters", dest="warmup", type=int, default=5,
                   help="warm-up iterations (default 5)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check results (default 1)")
    p.add_argument("-d", "--datatype", dest="dtype", default="float32",
                   help="dtype: float32 (float), float16 (half), bfloat16, float64 (double), int8, uint8, "
                        "int32, uint32, int64, uint64, complex64, complex128")
    p.add_argument("-o", "--op", default="sum", help="reduction: sum, prod, min, max, avg")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)")
    p.add_argument("--coll", default="all_reduce", choices=COLLS, help="the collective (default all_reduce)")
    p.add_argument("--backend", choices=("mpi", "nccl"), default=None, help="default: what mpicomm.init picks")
    p.add_argument("--compare", action="store_true", help="also time raw mpi4py / raw CuPy NCCL")
    p.add_argument("--rounds", type=int, default=4,
                   help="interleaved rounds the iterations are split into (default 4)")
    p.add_argument("--stat", choices=("mean", "median", "min"), default="mean",
                   help="per-call time from the rounds: mean (nccl-tests' average, default), median or min "
                        "of the rounds (robust to noise from other processes)")
    p.add_argument("--target-time", type=float, default=0.25, help="seconds per size and variant with -n 0")
    p.add_argument("--shapes", default=None, help=f"gradient shapes for --coll buckets (default {SHAPES_FILE})")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row to FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw busbw against size into FILE.png")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def _validate(args):
    d = DTYPE_ALIASES.get(args.dtype.lower(), args.dtype.lower())
    if d not in TYPE_NAMES:
        raise ValueError(f"invalid -d {args.dtype!r}: expected one of {', '.join(TYPE_NAMES)} "
                         f"(or {', '.join(DTYPE_ALIASES)})")
    args.dtype = d
    op = args.op.lower()
    if op not in OPS:
        raise ValueError(f"invalid -o {args.op!r}: expected one of {', '.join(OPS)}")
    args.op = op
    if args.coll in REDUCING:
        from ..smoke import np_dtype, ops_for

        allowed = ops_for(np_dtype(d))
        if op not in allowed:
            raise ValueError(f"invalid -o {op!r} for -d {d}: expected one of {', '.join(allowed)}")
    if args.iters < 0 or args.warmup < 0 or args.rounds < 1:
        raise ValueError("invalid -n/-w/--rounds: need -n >= 0, -w >= 0, --rounds >= 1")
    args.min_b = parse_size(args.minbytes)
    args.max_b = parse_size(args.maxbytes)
    step = parse_size(args.stepbytes) if args.stepbytes is not None else None
    args.sizes = size_steps(args.min_b, args.max_b, args.stepfactor, step)


def main(argv=None):
    """Run the benchmark on every rank; rank 0 prints the table. Returns 1 if a check failed."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return exc.code
    try:
        _validate(args)
    except ValueError as e:
        print(f"mpicomm-bench: {e}", file=sys.stderr)
        return 2
    # repeated in-place sums overflow to inf by design (as in nccl-tests): no warnings
    np.seterr(all="ignore")
    b = Bench(args)
    n = b.n
    if not 0 <= args.root < n:
        if b.rank == 0:
            print(f"mpicomm-bench: invalid -r {args.root}: expected a rank in 0..{n - 1}", file=sys.stderr)
        b.close()
        return 2
    progress = not args.quiet
    infos = b.comm.gather((socket.gethostname(), os.getpid(), getattr(__import__("mpicomm")._state.CTX,
                                                                      "device_id", None)), root=0)
    meta = {"coll": args.coll, "backend": b.backend, "nranks": n, "dtype": args.dtype, "op": args.op,
            "root": args.root, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
            "stat": args.stat,
            "check": args.check, "compare": args.compare,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpus": os.cpu_count(), "argv": sys.argv[1:] if argv is None else list(argv),
            "versions": b.versions()}
    if b.rank == 0:
        v = meta["versions"]
        print(f"# mpicomm-bench {args.coll}: {n} rank(s), backend {b.backend}, dtype {args.dtype}, "
              f"op {args.op}, iters {args.iters or 'auto'}, warmup {args.warmup}, check {args.check}, "
              f"{args.stat} of {args.rounds} interleaved rounds"
              + (", --compare (raw " + ("CuPy NCCL" if b.backend == "nccl" else "mpi4py") + ")"
                 if args.compare else ""))
        print("# " + ", ".join(f"{k} {val}" for k, val in v.items()))
        print("#")
        for r, (host, pid, dev) in enumerate(infos):
            print(f"#  Rank {r:2d} Pid {pid:7d} on {host:>12s}" + (f" device {dev}" if dev is not None else ""))
        print("#", flush=True)
    status = 0
    if args.coll == "buckets":
        try:  # the same files on every rank of a job: every rank fails alike, none hangs
            find_shapes_file(args.shapes)
        except FileNotFoundError as e:
            if b.rank == 0:
                print(f"mpicomm-bench: {e}", file=sys.stderr)
            b.close()
            return 2
        rows = run_buckets(b, progress)
    else:
        if b.rank == 0:
            print("\n".join(header(args.compare)), flush=True)
        rows = run_sizes(b, args.sizes, progress)
        if b.rank == 0:
            for line in summary_lines(rows, args.compare):
                print(line)
            print(flush=True)
        wrong = sum((r.get(k) or {}).get("wrong") or 0 for r in rows for k in ("oop", "ip"))
        status = 1 if wrong else 0
    if b.rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        if args.plot:
            title = (f"mpicomm {args.coll}, {n} ranks, {b.backend}, {args.dtype}"
                     + (f" {args.op}" if args.coll in REDUCING else ""))
            plot(rows, args.plot, title, buckets=args.coll == "buckets")
    status = b.comm.bcast(status, root=0)
    b.close()
    return status


if __name__ == "__main__":
    from .._common import exit_cleanly

    exit_cleanly(main())
