"""Where the time of one small collective goes: the raw library call, then each layer
mpicomm adds (backend method, reliability hooks, front function), timed in one run.

    mpirun -n 2 python scripts/profile_call.py [--count 2] [--iters 20000]

Prints, on rank 0, microseconds per call for each collective and layer (min over rounds
of ``--iters`` calls; on NCCL each round ends with a device synchronize), and the
differences between layers. The backend is the one init() picks (MPICOMM_BACKEND).
"""
import argparse
import functools
import time

import numpy as np
from mpi4py import MPI

import mpicomm
from mpicomm._state import CTX


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2, help="float32 elements per rank (default 2 = 8 bytes)")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stream", choices=["null", "nonblocking"], default="null",
                    help="NCCL: work on CuPy's null stream, or on a non-blocking stream made current "
                         "with Stream.use() as mpicomm-bench does")
    ap.add_argument("--op", choices=["enum", "str"], default="enum",
                    help="pass the op as mpicomm.ReduceOp.SUM or as the string 'sum' (as mpicomm-bench does)")
    a = ap.parse_args()
    mpicomm.init()
    g = CTX.world
    n, rank = g.size, g.rank
    nccl = CTX.backend_name == "nccl"
    c = a.count
    if nccl:
        import cupy as xp

        if a.stream == "nonblocking":
            xp.cuda.Stream(non_blocking=True).use()
        stream = xp.cuda.get_current_stream()
        sync = stream.synchronize
    else:
        xp = np
        sync = None
    rng = np.random.default_rng(rank)
    x = xp.asarray(rng.standard_normal(c).astype(np.float32))
    xs = xp.asarray(rng.standard_normal(c * n).astype(np.float32))
    o = xp.empty(c, np.float32)
    og = xp.empty(c * n, np.float32)
    SUM = mpicomm.ReduceOp.SUM if a.op == "enum" else "sum"
    impl, h = g.impl, CTX.hooks
    p = functools.partial

    if nccl:
        from cupy.cuda import nccl as nc

        from mpicomm.backends.nccl import as_uid

        local = nc.get_unique_id()
        uid = g.mpi_comm.bcast(local if rank == 0 else None, root=0)
        raw = nc.NcclCommunicator(n, as_uid(uid, local), rank)
        s = stream.ptr
        F32 = nc.NCCL_FLOAT32
        raws = {
            "all_reduce": p(raw.allReduce, x.data.ptr, o.data.ptr, c, F32, nc.NCCL_SUM, s),
            "all_gather": p(raw.allGather, x.data.ptr, og.data.ptr, c, F32, s),
            "reduce_scatter": p(raw.reduceScatter, xs.data.ptr, o.data.ptr, c, F32, nc.NCCL_SUM, s),
            "broadcast": p(raw.broadcast, o.data.ptr, o.data.ptr, c, F32, 0, s),
        }
        pieces = {
            "cupy.cuda.get_current_stream().ptr": lambda: xp.cuda.get_current_stream().ptr,
            "x.shape": lambda: x.shape,
            "x.data.ptr": lambda: x.data.ptr,
        }
    else:
        raw = g.mpi_comm.Dup()
        raws = {
            "all_reduce": p(raw.Allreduce, x, o, MPI.SUM),
            "all_gather": p(raw.Allgather, x, og),
            "reduce_scatter": p(raw.Reduce_scatter_block, xs, o, MPI.SUM),
            "broadcast": p(raw.Bcast, o, 0),
        }
        pieces = {"x.shape": lambda: x.shape, "x.flags.c_contiguous": lambda: x.flags.c_contiguous}

    codes = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4}
    layers = {
        "all_reduce": (p(impl.all_reduce, x, mpicomm.ReduceOp.SUM, o, False, None),
                       (x, mpicomm.ReduceOp.SUM, o, False, None),
                       p(mpicomm.all_reduce, x, SUM, o)),
        "all_gather": (p(impl.all_gather, x, og, False, None), (x, og, False, None),
                       p(mpicomm.all_gather, x, og)),
        "reduce_scatter": (p(impl.reduce_scatter, xs, mpicomm.ReduceOp.SUM, o, False, None),
                           (xs, mpicomm.ReduceOp.SUM, o, False, None),
                           p(mpicomm.reduce_scatter, xs, SUM, o)),
        "broadcast": (p(impl.broadcast, o, 0, False, None), (o, 0, False, None),
                      p(mpicomm.broadcast, o, 0)),
    }

    def timeit(f, iters):
        best = float("inf")
        for _ in range(a.rounds):
            g.mpi_comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            if sync is not None:
                sync()
            best = min(best, time.perf_counter() - t0)
        t = np.array([best / iters * 1e6])
        g.mpi_comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        return float(t[0])

    rows = []
    for name, (meth, args, front) in layers.items():
        fn = getattr(impl, name)
        hooked = p(h.run, g, codes[name], args[0], False, fn, args) if h is not None else None
        r = {"raw": timeit(raws[name], a.iters), "backend": timeit(meth, a.iters)}
        r["+hooks"] = timeit(hooked, a.iters) if hooked else r["backend"]
        r["front"] = timeit(front, a.iters)
        rows.append((name, r))
    piece_t = {k: timeit(f, a.iters * 5) for k, f in pieces.items()}
    if rank == 0:
        print(f"# scripts/profile_call.py: backend {CTX.backend_name}, {n} ranks, {c} float32 "
              f"({4 * c} bytes) per rank, op as {a.op}, stream {a.stream if nccl else '-'}, "
              f"us per call (max over ranks of the min over {a.rounds} rounds)")
        print("| collective | raw | backend method | + hooks | front function | added by backend | "
              "by hooks | by front | total added |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in rows:
            print(f"| {name} | {r['raw']:.2f} | {r['backend']:.2f} | {r['+hooks']:.2f} | {r['front']:.2f} | "
                  f"{r['backend'] - r['raw']:+.2f} | {r['+hooks'] - r['backend']:+.2f} | "
                  f"{r['front'] - r['+hooks']:+.2f} | {r['front'] - r['raw']:+.2f} |")
        for k, v in piece_t.items():
            print(f"# piece: {k}: {v * 1e3:.0f} ns")
    if nccl:
        raw.destroy()
    else:
        raw.Free()


if __name__ == "__main__":
    main()
