#!/usr/bin/env python3
"""Per-call time of 8 B all_reduces on GPUs: mpicomm captured in a CUDA graph and replayed,
mpicomm uncaptured, and raw CuPy NcclCommunicator calls on the same arrays and stream, in
the same job, interleaved.

    mpicomm-run -n 2 python scripts/bench_capture.py [--calls 100] [--rounds 30] [--array cupy|torch]

Each round times --calls calls (one graph replay of --calls captured calls) from a barrier
to the stream's end, on every rank; the table gives the median over rounds of rank 0's
time per call, in microseconds. The captured calls' results are checked after the timing
(every replay sums rank-dependent random data).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mpicomm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--array", choices=("cupy", "torch"), default="cupy")
    a = ap.parse_args()
    mpicomm.init(backend="nccl")
    import cupy as cp
    from cupy.cuda import nccl

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    comm = mpicomm._state.CTX.world.transport.comm   # the raw NcclCommunicator, for the baseline
    s = cp.cuda.Stream(non_blocking=True)
    parts = [np.random.default_rng([7, q]).standard_normal(2).astype(np.float32) for q in range(n)]
    if a.array == "torch":
        import torch

        ts = torch.cuda.ExternalStream(s.ptr)
        x = torch.from_numpy(parts[r]).cuda()
        o = torch.empty_like(x)
        xp, op_ = x.data_ptr(), o.data_ptr()
    else:
        ts = None
        x = cp.asarray(parts[r])
        o = cp.empty_like(x)
        xp, op_ = x.data.ptr, o.data.ptr

    def many():
        for _ in range(a.calls):
            mpicomm.all_reduce(x, out=o)

    def raw():
        for _ in range(a.calls):
            comm.allReduce(xp, op_, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)

    def on_stream(fn):
        if ts is not None:
            import torch

            with torch.cuda.stream(ts):
                return fn()
        with s:
            return fn()

    on_stream(many)
    s.synchronize()
    s.begin_capture()   # (CuPy's stream capture takes PyTorch's work on the stream too)
    on_stream(many)
    g = s.end_capture()
    variants = {"raw NCCL": lambda: raw(), "mpicomm": lambda: on_stream(many),
                "mpicomm, replayed graph": lambda: g.launch(stream=s)}
    times = {k: [] for k in variants}
    for _ in range(a.rounds):
        for k, fn in variants.items():
            s.synchronize()
            mpicomm.barrier()
            t0 = time.perf_counter()
            fn()
            s.synchronize()
            times[k].append((time.perf_counter() - t0) / a.calls * 1e6)
    # the replay's result, checked
    x2 = [np.random.default_rng([8, q]).standard_normal(2).astype(np.float32) for q in range(n)]
    if ts is not None:
        import torch

        x.copy_(torch.from_numpy(x2[r]).cuda())
        torch.cuda.synchronize()
    else:
        x[...] = cp.asarray(x2[r])
    s.synchronize()
    g.launch(stream=s)
    s.synchronize()
    got = o.cpu().numpy() if ts is not None else cp.asnumpy(o)
    ok = np.allclose(got, np.sum(x2, axis=0), rtol=1e-5)
    if r == 0:
        dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
        print(f"# bench_capture: {n} x {dev}, {a.array} arrays, 8 B all_reduce, {a.calls} calls a round, "
              f"{a.rounds} rounds, median us per call")
        base = float(np.median(times["raw NCCL"]))
        print(f"{'variant':<26}{'us/call':>9}{'vs raw':>9}")
        for k, v in times.items():
            m = float(np.median(v))
            print(f"{k:<26}{m:9.2f}{m - base:+9.2f}")
        print(f"# replayed result {'checked: OK' if ok else 'WRONG'}")
    mpicomm.barrier()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
