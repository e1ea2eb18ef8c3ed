"""Per-call cost of mpicomm's reliability hooks (docs/RELIABILITY.md): interleaved A/B, min over repetitions.

    mpirun -n 2 python scripts/bench_reliability.py [debug]
"""
import sys, time, numpy as np
import mpicomm
from mpicomm._state import CTX
from mpi4py import MPI
debug = "debug" in sys.argv
mpicomm.init(debug=debug)
comm = CTX.world.mpi_comm
x = np.ones(2, np.float32); y = np.empty_like(x)
N = 5000
ar = mpicomm.all_reduce
h = CTX.hooks
def loop_raw():
    f = comm.Allreduce
    for _ in range(N): f(x, y)
def loop_mc():
    for _ in range(N): ar(x, out=y)
res = {"raw": [], "nohooks": [], "hooks": []}
for rep in range(30):
    for k in ("raw", "nohooks", "hooks"):
        CTX.hooks = h if k == "hooks" else None
        comm.Barrier()
        t0 = time.perf_counter()
        (loop_raw if k == "raw" else loop_mc)()
        dt = comm.allreduce((time.perf_counter() - t0) / N, op=MPI.MAX)
        res[k].append(dt * 1e6)
CTX.hooks = h
# pure-Python cost of run() around a no-op, independent of MPI noise
g = CTX.world
noop = lambda *a: None
M = 200000
best_run = best_direct = 1e9
run = h.run
for rep in range(5):
    if debug: break
    t0 = time.perf_counter()
    for _ in range(M): run(g, 1, x, None, None, False, noop, (x, None, y, False, None))
    best_run = min(best_run, (time.perf_counter() - t0) / M * 1e6)
    t0 = time.perf_counter()
    for _ in range(M): noop(x, None, y, False, None)
    best_direct = min(best_direct, (time.perf_counter() - t0) / M * 1e6)
if mpicomm.get_rank() == 0:
    m = {k: min(v) for k, v in res.items()}
    med = {k: sorted(v)[len(v)//2] for k, v in res.items()}
    print(f"ranks={mpicomm.get_group_size()} debug={debug} 8-byte all_reduce, us/call min (median): "
          + "  ".join(f"{k} {m[k]:.2f} ({med[k]:.2f})" for k in res)
          + f"  | hooks add {m['hooks']-m['nohooks']:.2f} us (min), mpicomm total over raw {m['hooks']-m['raw']:.2f} us")
    if not debug:
        print(f"  run() around a no-op: {best_run - best_direct:.3f} us per call (pure Python)")
