"""Raw mpi4py vs mpicomm for the CPU collectives of one host (issue 7: shared-memory path).

    mpirun -n 2 python scripts/bench_shm.py --coll all_reduce -b 1K -e 256M
    mpirun -n 4 python scripts/bench_shm.py --coll all -b 64K -e 64M --shm-threshold 0

Prints one table per collective: bytes, raw time, mpicomm time, busbw of each (as
nccl-tests defines it) and the ratio. Both sides write into preallocated arrays; each
size runs ``--rounds`` alternating rounds of raw and mpicomm, and each side's best
round counts (time per call: the slowest rank's). ``--shm-threshold`` and
``--piece`` set MPICOMM_SHM_THRESHOLD / MPICOMM_SHM_PIECE ('off' for the ordinary
path only; without ``--piece`` all_reduce tunes its piece, and the path column shows the
piece in use after the row).
"""
import argparse
import os
import sys
import time


def size_arg(s):
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if s[-1] in "KMG":
        mult = 1 << (10 * ("KMG".index(s[-1]) + 1))
        s = s[:-1]
    return int(s) * mult


def human(b):
    for unit, sh in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << sh and b % (1 << sh) == 0:
            return f"{b >> sh}{unit}"
    return str(b)


BUSBW = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coll", default="all_reduce",
                   help="all_reduce, all_gather, reduce_scatter, broadcast, or 'all'")
    p.add_argument("-b", "--begin", type=size_arg, default=size_arg("1K"))
    p.add_argument("-e", "--end", type=size_arg, default=size_arg("64M"))
    p.add_argument("-f", "--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time", type=float, default=0.15, help="seconds per round and side, about")
    p.add_argument("--shm-threshold", default=None)
    p.add_argument("--piece", default=None)
    a = p.parse_args(argv)
    if a.shm_threshold is not None:
        os.environ["MPICOMM_SHM_THRESHOLD"] = a.shm_threshold
    if a.piece is not None:
        os.environ["MPICOMM_SHM_PIECE"] = a.piece

    import numpy as np
    from mpi4py import MPI

    import mpicomm

    mpicomm.init(backend="mpi")
    raw = MPI.COMM_WORLD.Dup()
    n, rank = raw.Get_size(), raw.Get_rank()
    dt = np.dtype(a.dtype)
    from mpicomm.arrays import dtype_info

    mdt = dtype_info(dt).mpi     # what the ordinary path passes to MPI
    colls = list(BUSBW) if a.coll == "all" else a.coll.split(",")
    impl = mpicomm.comm.CTX.world.impl

    def timeit(fn, iters):
        raw.Barrier()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        t = (time.perf_counter() - t) / iters
        return raw.allreduce(t, op=MPI.MAX)

    if rank == 0:
        print(f"# {n} ranks, {a.dtype}, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"mpi4py {__import__('mpi4py').__version__}, numpy {np.__version__}; "
              f"MPICOMM_SHM_THRESHOLD={os.environ.get('MPICOMM_SHM_THRESHOLD', '(default)')} "
              f"MPICOMM_SHM_PIECE={os.environ.get('MPICOMM_SHM_PIECE', '(default: tuned)')}")
    for coll in colls:
        factor = BUSBW[coll](n)
        if rank == 0:
            print(f"\n## {coll}\n| bytes | raw mpi4py | mpicomm | raw busbw GB/s | mpicomm busbw GB/s | speed-up | path |")
            print("|---:|---:|---:|---:|---:|---:|---|")
        size = a.begin
        while size <= a.end:
            count = max(n, size // dt.itemsize // n * n)
            nbytes = count * dt.itemsize
            g = np.random.default_rng(rank)
            x = (g.random(count) * 4 - 2).astype(dt)
            if coll == "all_reduce":
                y = np.empty_like(x)
                fr = lambda: raw.Allreduce([x, mdt], [y, mdt], MPI.SUM)  # noqa: E731
                fm = lambda: mpicomm.all_reduce(x, out=y)  # noqa: E731
            elif coll == "reduce_scatter":
                y = np.empty(count // n, dt)
                fr = lambda: raw.Reduce_scatter_block([x, mdt], [y, mdt], MPI.SUM)  # noqa: E731
                fm = lambda: mpicomm.reduce_scatter(x, out=y)  # noqa: E731
            elif coll == "all_gather":  # size = the gathered total, as nccl-tests counts it
                xs = x[:count // n].copy()
                y = np.empty(count, dt)
                fr = lambda: raw.Allgather([xs, mdt], [y, mdt])  # noqa: E731
                fm = lambda: mpicomm.all_gather(xs, out=y)  # noqa: E731
            else:
                fr = lambda: raw.Bcast([x, mdt], 0)  # noqa: E731
                fm = lambda: mpicomm.broadcast(x, 0)  # noqa: E731
            before = dict(impl.shm.calls) if impl.shm else {}
            fr(), fm(), fr(), fm()   # warm up (window allocation, page faults)
            t1 = timeit(fm, 1)
            iters = max(2, min(2000, int(a.time / max(t1, 1e-7))))
            tr, tm = [], []
            for _ in range(a.rounds):
                tr.append(timeit(fr, iters))
                tm.append(timeit(fm, iters))
            tr, tm = min(tr), min(tm)
            after = impl.shm.calls if impl.shm else {}
            path = "shm" if after.get(coll, 0) > before.get(coll, 0) else "mpi"
            if path == "shm":
                path += f" ({human(impl.shm.piece)})"
            if rank == 0:
                bw = lambda t: nbytes / t / 1e9 * factor  # noqa: E731
                print(f"| {human(nbytes)} | {tr * 1e6:.1f} us | {tm * 1e6:.1f} us | {bw(tr):.2f} | "
                      f"{bw(tm):.2f} | {tr / tm:.2f}x | {path} |", flush=True)
            size *= a.factor
    raw.Free()
    mpicomm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
