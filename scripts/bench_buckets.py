#!/usr/bin/env python
"""Benchmark gradient fusion on the ResNet-50 gradient set (161 float32 tensors, 97.5 MiB).

    mpirun -n 2 python scripts/bench_buckets.py [--iters 20] [--warmup 3] [--bucket-cap-mb 25]

Times one step of reducing every gradient three ways, in the same run: one all_reduce
per tensor (DistributedGradReducer with bucket_cap_mb=0), the default 25 MiB buckets
(DistributedGradReducer), and the whole set as one flat buffer (a single all_reduce,
the bound). NumPy on the MPI backend, CuPy on NCCL. Prints a table with bus bandwidth
(nccl-tests' definition: busbw = bytes / time * 2(n-1)/n) and each row's share of the
one-buffer bandwidth.

The shapes file is found at $MPICOMM_GRAD_SHAPES, else ../shared/data/resnet50_grad_shapes.txt
relative to the repository root (one shape per line, "64x3x7x7").
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

try:
    import mpicomm
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mpicomm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES_ENV = "MPICOMM_GRAD_SHAPES"
MODES = ("per-tensor", "buckets", "one-buffer")


def shapes_path(path=None):
    """The ResNet-50 shapes file: ``path``, $MPICOMM_GRAD_SHAPES, or ../shared/data/ next to the repo."""
    path = path or os.environ.get(SHAPES_ENV) or os.path.join(
        os.path.dirname(ROOT), "shared", "data", "resnet50_grad_shapes.txt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no gradient shapes file at {path}; set {SHAPES_ENV}=/path/to/"
                                "resnet50_grad_shapes.txt (one shape per line, e.g. 64x3x7x7)")
    return path


def load_shapes(path=None):
    """The gradient shapes, in registration order: a list of tuples."""
    with open(shapes_path(path)) as f:
        return [tuple(int(d) for d in line.strip().split("x")) for line in f if line.strip()]


def _family():
    if mpicomm.get_backend() == "nccl":
        import cupy

        return cupy, cupy.cuda.get_current_stream().synchronize
    return np, (lambda: None)


def _mode_cap(mode, bucket_cap_mb):
    """The bucket cap of a reducer mode ("per-tensor", "buckets", "buckets:4"), else None."""
    if mode == "per-tensor":
        return 0.0
    if mode == "buckets":
        return bucket_cap_mb
    if mode.startswith("buckets:"):
        return float(mode.split(":", 1)[1])
    if mode == "one-buffer":
        return None
    raise ValueError(f"invalid mode={mode!r}: expected per-tensor, buckets, buckets:<MiB> or one-buffer")


def run_buckets_bench(iters=20, warmup=3, shapes=None, bucket_cap_mb=25.0, dtype="float32",
                      modes=MODES, group=None, rounds=3):
    """Time each mode over ``iters`` steps after ``warmup``; returns one dict per mode.

    modes: "per-tensor" (bucket_cap_mb=0), "buckets" (``bucket_cap_mb``), "buckets:<MiB>",
        "one-buffer" (one all_reduce of a flat buffer of the same size).
    rounds: the modes take turns this many times; each row reports its median round, so
        a noisy spell on the machine does not favour one mode.
    Row keys: mode, calls (all_reduce calls per step), bytes (per rank), time_s (per step,
    the slowest rank's mean), algbw_GBps, busbw_GBps, of_one_buffer (busbw / one-buffer
    busbw, when that mode ran). mpicomm must be initialised; collective over ``group``.
    """
    xp, sync = _family()
    shapes = load_shapes() if shapes is None else [tuple(s) for s in shapes]
    dt = np.dtype(dtype)
    n = mpicomm.get_group_size(group)
    nbytes = sum(int(np.prod(s)) for s in shapes) * dt.itemsize
    steps = {}
    for mode in modes:
        cap = _mode_cap(mode, bucket_cap_mb)
        if mode == "one-buffer":
            flat = xp.zeros(nbytes // dt.itemsize, dt)
            steps[mode] = (1, lambda flat=flat: mpicomm.all_reduce(flat, out=flat, group=group))
        else:
            red = mpicomm.DistributedGradReducer([xp.zeros(s, dt) for s in shapes], mean=False,
                                                 bucket_cap_mb=cap, group=group)
            steps[mode] = (len(red.buckets), lambda red=red, v=red.grad_views(): red.reduce_(v))
    times = {m: [] for m in modes}
    for _ in range(max(rounds, 1)):
        for mode in modes:
            step = steps[mode][1]
            for _ in range(warmup):
                step()
            sync()
            mpicomm.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            sync()
            t = np.array([(time.perf_counter() - t0) / max(iters, 1)])
            mpicomm.all_reduce(t, "max", out=t, group=group)  # host array: over MPI on either backend
            times[mode].append(float(t[0]))
    rows = []
    for mode in modes:
        t = float(np.median(times[mode]))
        algbw = nbytes / t / 1e9
        rows.append(dict(mode=mode, calls=steps[mode][0], bytes=nbytes, time_s=t, algbw_GBps=algbw,
                         busbw_GBps=algbw * 2 * (n - 1) / n))
    ref = next((r["busbw_GBps"] for r in rows if r["mode"] == "one-buffer"), None)
    for r in rows:
        r["of_one_buffer"] = (r["busbw_GBps"] / ref) if ref else None
    return rows


def format_table(rows, n):
    out = [f"{'mode':<12} {'calls':>5} {'MiB':>7} {'time/step':>11} {'algbw GB/s':>10} "
           f"{'busbw GB/s':>10} {'of 1 buffer':>11}"]
    for r in rows:
        share = f"{100 * r['of_one_buffer']:.0f}%" if r["of_one_buffer"] is not None and n > 1 else "-"
        out.append(f"{r['mode']:<12} {r['calls']:>5} {r['bytes'] / 2**20:>7.1f} {r['time_s'] * 1e3:>8.2f} ms "
                   f"{r['algbw_GBps']:>10.2f} {r['busbw_GBps']:>10.2f} {share:>11}")
    per = {r["mode"]: r for r in rows}
    if "per-tensor" in per and "buckets" in per:
        out.append(f"buckets vs per-tensor: {per['per-tensor']['time_s'] / per['buckets']['time_s']:.2f}x faster")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--shapes", default=None, help=f"shapes file (default: ${SHAPES_ENV} or ../shared/data/)")
    p.add_argument("--rounds", type=int, default=3, help="turns each mode takes (median reported)")
    p.add_argument("--modes", nargs="+", default=list(MODES),
                   help="per-tensor, buckets, buckets:<MiB>, one-buffer (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = p.parse_args(argv)
    mpicomm.init()
    n, rank = mpicomm.get_group_size(), mpicomm.get_rank()
    shapes = load_shapes(args.shapes)
    rows = run_buckets_bench(args.iters, args.warmup, shapes, args.bucket_cap_mb, modes=args.modes,
                             rounds=args.rounds)
    if rank == 0:
        dev = "CPU" if mpicomm.get_backend() == "mpi" else "GPU"
        print(f"# buckets benchmark: {len(shapes)} tensors, backend {mpicomm.get_backend()} ({dev}), "
              f"{n} rank(s), host {platform.node()}, {datetime.date.today().isoformat()}, "
              f"iters {args.iters} x {args.rounds} rounds (median), warmup {args.warmup}, "
              f"bucket_cap_mb {args.bucket_cap_mb}")
        print(format_table(rows, n))
        if args.json:
            print(json.dumps(rows))
    mpicomm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
