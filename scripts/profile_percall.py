"""Where mpicomm's per-call time goes, at the smallest size, against the raw library call.

Run under mpirun (2 ranks or more):

    mpirun -n 2 python scripts/profile_percall.py --backend nccl --array cupy
    mpirun -n 2 python scripts/profile_percall.py --backend mpi          # NumPy on the CPU

Every variant calls all_reduce of one float32 per rank (``out=`` given; new arrays every
call: a pool of 8 input/output pairs used in turn, as ``mpicomm-bench --percall --fresh``),
in interleaved rounds; each number is the median over rounds of the slowest rank's time per
call. The variants peel mpicomm's call apart, each measured in the same rounds:

    raw          the library call on this call's pointers (CuPy's NcclCommunicator.allReduce,
                 or mpi4py's Allreduce), the baseline
    mpicomm      mpicomm.all_reduce(x, out=o)
    no wrapper   the group's dispatcher called directly (what the public function adds)
    raw binding  the dispatcher around the raw call: the prepared call's own work (checks,
                 pointers, stream) replaced by what raw does
    no recorder  ... and the flight recorder off for the group
    no check     ... and the agreement check's stores and compares off for the group

and then, on one rank without communication, the host operations a call is made of
(the time of one, less an empty loop's).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "mpi"), default="nccl")
    p.add_argument("--array", choices=("cupy", "torch"), default="cupy", help="GPU array type (nccl)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=20000, help="calls per variant per round")
    return p.parse_args()


def main():
    a = parse()
    import mpicomm
    from mpicomm._ops import ALL_REDUCE
    from mpicomm._state import CTX
    from mpi4py import MPI

    mpicomm.init(backend=a.backend)
    g = CTX.world
    d = g.disp
    me, n = mpicomm.get_rank(), mpicomm.get_group_size()
    rng = np.random.default_rng(me)
    K = 8
    if a.backend == "nccl":
        import cupy
        from cupy.cuda import nccl

        dev = cupy.cuda.Device()
        if a.array == "torch":
            import torch

            xs = [torch.tensor(rng.random(1, dtype=np.float32), device=f"cuda:{dev.id}") for _ in range(K)]
            os_ = [torch.empty(1, device=f"cuda:{dev.id}") for _ in range(K)]
            stream = torch.cuda.current_stream().cuda_stream
            ptr = lambda t: t.data_ptr()   # noqa: E731
        else:
            xs = [cupy.asarray(rng.random(1, dtype=np.float32)) for _ in range(K)]
            os_ = [cupy.empty(1, np.float32) for _ in range(K)]
            stream = cupy.cuda.get_current_stream().ptr
            ptr = None
        uid = nccl.get_unique_id() if me == 0 else None
        comm = nccl.NcclCommunicator(n, MPI.COMM_WORLD.bcast(uid, root=0), me)
        F32, SUM = nccl.NCCL_FLOAT32, nccl.NCCL_SUM
        f = comm.allReduce
        if ptr is None:
            def raw(x, o):
                f(x.data.ptr, o.data.ptr, 1, F32, SUM, stream)
        else:
            def raw(x, o):
                f(x.data_ptr(), o.data_ptr(), 1, F32, SUM, stream)
        sync = cupy.cuda.Device().synchronize
    else:
        xs = [rng.random(1, dtype=np.float32) for _ in range(K)]
        os_ = [np.empty(1, np.float32) for _ in range(K)]
        mc = MPI.COMM_WORLD.Dup()
        R = mc.Allreduce

        def raw(x, o):
            R(x, o)
        sync = lambda: None   # noqa: E731

    ar = mpicomm.all_reduce
    call = g.call
    S = mpicomm.ReduceOp.SUM
    ar(xs[0], out=os_[0])
    p = d.last[ALL_REDUCE]
    own = p.run
    fr, shr = d.fr, d.shr

    def loop(fn, it):
        t0 = time.perf_counter()
        for i in range(it):
            fn(xs[i & 7], os_[i & 7])
        sync()
        return time.perf_counter() - t0

    variants = {
        "raw": lambda x, o: raw(x, o),
        "mpicomm": lambda x, o: ar(x, out=o),
        "no wrapper": lambda x, o: call(ALL_REDUCE, x, o, S, False, None),
        "raw binding": lambda x, o: call(ALL_REDUCE, x, o, S, False, None),
        "no recorder": lambda x, o: call(ALL_REDUCE, x, o, S, False, None),
        "no check": lambda x, o: call(ALL_REDUCE, x, o, S, False, None),
    }
    rawrun = lambda x, o: raw(x, o) or o   # noqa: E731

    def setup(name):
        p.run = rawrun if name in ("raw binding", "no recorder", "no check") else own
        d.fr = None if name in ("no recorder", "no check") else fr
        d.shr = None if name == "no check" else shr

    times = {k: [] for k in variants}
    for k in variants:   # warm-up, and every variant's sums checked once
        setup(k)
        loop(variants[k], 200)
    setup("mpicomm")
    want = sum(np.random.default_rng(r).random(1, dtype=np.float32) for r in range(n))
    got = ar(xs[0], out=os_[0])
    got = got.get() if hasattr(got, "get") else (got.cpu().numpy() if hasattr(got, "cpu") else got)
    assert np.allclose(got, want, rtol=1e-5), (got, want)
    for r in range(a.rounds):
        for k, fn in variants.items():
            setup(k)
            MPI.COMM_WORLD.Barrier()
            t = loop(fn, a.iters) / a.iters * 1e6
            times[k].append(MPI.COMM_WORLD.allreduce(t, op=MPI.MAX))
    setup("mpicomm")
    med = {k: statistics.median(v) for k, v in times.items()}

    # the host operations, one rank, no communication
    ops = host_ops(a, xs, os_, d)
    if me == 0:
        what = f"{a.backend}" + (f", {a.array}" if a.backend == "nccl" else "")
        print(f"# profile_percall: {n} ranks, {what}, all_reduce of 4 bytes, out= given, new arrays every call; "
              f"median of {a.rounds} rounds of {a.iters} calls, us per call (slowest rank)")
        print(f"{'variant':<14} {'us/call':>8} {'over raw':>9}")
        for k, v in med.items():
            print(f"{k:<14} {v:8.2f} {v - med['raw']:+9.2f}")
        print("breakdown of mpicomm's added cost (us):")
        print(f"  public function (wrapper)        {med['mpicomm'] - med['no wrapper']:+.2f}")
        print(f"  prepared call's binding          {med['no wrapper'] - med['raw binding']:+.2f}")
        print(f"  flight recorder                  {med['raw binding'] - med['no recorder']:+.2f}")
        print(f"  agreement check                  {med['no recorder'] - med['no check']:+.2f}")
        print(f"  dispatcher's rest                {med['no check'] - med['raw']:+.2f}")
        print("host operations, ns each (one rank):")
        for k, v in ops.items():
            print(f"  {k:<40} {v:7.0f}")
        sys.stdout.flush()
    mpicomm.finalize()


def host_ops(a, xs, os_, d):
    """ns per operation, less an empty loop's."""
    x, o = xs[0], os_[0]
    N = 200000

    def t(fn):
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            fn(N)
            best = min(best, (time.perf_counter() - t0) / N * 1e9)
        return best

    def empty(n):
        for _ in range(n):
            pass
    base = t(empty)
    shape, dtype = x.shape, x.dtype
    ops = {}

    def add(name, code):
        ns = {"x": x, "o": o, "shape": shape, "dtype": dtype, "d": d, "time": time}
        if a.backend == "nccl":
            import cupy
            ns["cupy"] = cupy
            if a.array == "torch":
                import torch
                ns["torch"] = torch
        src = f"def f(n):\n    for _ in range(n):\n        {code}\n"
        exec(src, ns)
        ops[name] = t(ns["f"]) - base

    add("x.shape != shape", "x.shape != shape")
    add("x.dtype is not dtype", "x.dtype is not dtype")
    add("o.dtype != dtype", "o.dtype != dtype")
    add("time.perf_counter_ns()", "time.perf_counter_ns()")
    add("d.seq (slot load)", "d.seq")
    add("d.mem[d.row] = 1 (progress store)", "d.mem[d.row] = 1")
    if a.backend == "nccl" and a.array == "cupy":
        add("x._c_contiguous", "x._c_contiguous")
        add("x.data.ptr", "x.data.ptr")
        add("x.data.device_id", "x.data.device_id")
        add("cupy.cuda.get_current_stream()", "cupy.cuda.get_current_stream()")
        add("cupy.cuda.get_current_stream().ptr", "cupy.cuda.get_current_stream().ptr")
        add("cupy.empty(1, dtype)", "cupy.empty(1, dtype)")
    if a.backend == "nccl" and a.array == "torch":
        add("x.is_contiguous()", "x.is_contiguous()")
        add("x.data_ptr()", "x.data_ptr()")
        add("x.get_device()", "x.get_device()")
        add("torch._C._cuda_getCurrentRawStream(0)", "torch._C._cuda_getCurrentRawStream(0)")
        add("torch.empty(1, device=x.device)", "torch.empty(1, device=x.device)")
    if a.backend == "mpi":
        add("x.flags.c_contiguous", "x.flags.c_contiguous")
        add("x.ctypes.data", "x.ctypes.data")
    return ops


if __name__ == "__main__":
    main()
