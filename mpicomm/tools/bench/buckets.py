"""``--coll buckets``: reduce the ResNet-50 gradient set (161 float32 tensors, 97.5 MiB) per
tensor, through ``mpicomm.DistributedGradReducer``'s buckets, and as one flat buffer."""
from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np

from ..smoke import make_data
from .cases import rotate
from .report import bucket_header, bucket_row, bucket_summary
from .timing import TRIAL_TENSORS, bandwidths, trial

SHAPES_FILE = "resnet50_grad_shapes.txt"
SHAPES_ENV = "MPICOMM_GRAD_SHAPES"  # a path to a shapes file
# The ResNet-50 set ships with mpicomm (package data), so --coll buckets runs from any install.
PACKAGED_SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", SHAPES_FILE)


def find_shapes_file(explicit=None):
    """The gradient shapes file: ``explicit`` (--shapes), else $MPICOMM_GRAD_SHAPES, else the
    ResNet-50 set shipped with mpicomm (:data:`PACKAGED_SHAPES`).

    Raises FileNotFoundError naming the path that is missing, where it came from, and how
    to point at another file.
    """
    how = f"pass --shapes FILE or set {SHAPES_ENV}=FILE (one shape per line, e.g. 64x3x7x7)"
    env = os.environ.get(SHAPES_ENV)
    if explicit:
        path, named = explicit, f"--shapes {explicit}"
    elif env:
        path, named = env, f"{SHAPES_ENV}={env}"
    else:
        path, named = PACKAGED_SHAPES, f"{PACKAGED_SHAPES} (shipped with mpicomm: reinstall it)"
    if os.path.isfile(path):
        return path
    raise FileNotFoundError(f"{named}: no such file; {how}")


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


def _modes(b, shapes, sizes, total):
    """[(mode, all_reduce calls per step, mpicomm step, raw step or None)], and a note."""
    mc, fam, a = b.mc, b.family, b.args
    f32 = np.dtype(np.float32)
    SUM = mc.ReduceOp.SUM

    def grad_set(family, base):
        return [family.from_host(make_data("sum", f32, b.rank + base + i, c)).reshape(s)
                for i, (s, c) in enumerate(zip(shapes, sizes))]

    # --fresh: K gradient sets (and flat buffers) used in turn, new arrays every step
    sets = [grad_set(fam, k) for k in range(b.pool)]
    flats = [fam.from_host(make_data("sum", f32, b.rank + k, total)) for k in range(b.pool)]

    def per_tensor(gs):
        ar = mc.all_reduce

        def step():
            for g in gs:
                ar(g, SUM, g)

        return step

    raw_per = raw_flat = None
    if b.raw is not None:
        if b.raw_family is fam:
            rsets, rflats = sets, flats
        else:
            rsets = [grad_set(b.raw_family, k) for k in range(b.pool)]
            rflats = [b.raw_family.from_host(make_data("sum", f32, b.rank + k, total)) for k in range(b.pool)]
        raw_per = rotate([_raw_per_tensor(b, gs) for gs in rsets])
        raw_flat = rotate([_raw_one(b, fl) for fl in rflats])

    modes = [("per-tensor", len(shapes), rotate([per_tensor(gs) for gs in sets]), raw_per)]
    note = None
    try:
        Reducer = mc.DistributedGradReducer
    except (AttributeError, ImportError) as e:
        Reducer, note = None, f"DistributedGradReducer not available ({type(e).__name__}: {e}): buckets rows skipped"
    if Reducer is not None:
        caps = a.bucket_caps or [None]
        kw = {} if caps[0] is None else {"bucket_cap_mb": caps[0]}
        red = Reducer(sets[0], mean=False, **kw)
        nb = len(red.buckets)
        modes.append(("buckets reducer(grads)", nb, rotate([functools.partial(red, gs) for gs in sets]), None))
        modes.append(("buckets reduce_(grads)", nb, rotate([functools.partial(red.reduce_, gs) for gs in sets]),
                      None))
        modes.append(("buckets (grad_views)", nb, functools.partial(red.reduce_, red.grad_views()), None))
        if b.backend == "nccl" and fam.gpu:
            red1 = Reducer(sets[0], mean=False, **kw)  # the same buckets issued one by one, not in an NCCL group
            red1.group_launch = False
            modes.append(("buckets (one by one)", nb, functools.partial(red1.reduce_, red1.grad_views()), None))
        order = list(range(len(shapes)))[::-1]  # the order backward produces gradients

        def overlapped(red=red, order=order):
            for i in order:
                red.mark_ready(i)
            red.wait()

        modes.append(("buckets (mark_ready)", nb, overlapped, None))
        for cap in caps[1:]:
            r = Reducer(sets[0], mean=False, bucket_cap_mb=cap)
            modes.append((f"buckets {cap:g} MiB (views)", len(r.buckets),
                          functools.partial(r.reduce_, r.grad_views()), None))
    modes.append(("one buffer", 1, rotate([functools.partial(mc.all_reduce, fl, SUM, fl) for fl in flats]),
                  raw_flat))
    return modes, note


def _raw_per_tensor(b, gs):
    if b.backend == "nccl":
        r = b.raw
        comm, dt, s = r.comm, r.dt, r.s
        if r.fresh:
            def step():
                for g in gs:
                    p = g.data.ptr
                    comm.allReduce(p, p, g.size, dt, 0, s)
        else:
            ptrs = [(g.data.ptr, g.size) for g in gs]

            def step():
                for p, c in ptrs:
                    comm.allReduce(p, p, c, dt, 0, s)
        return step
    comm, MPI = b.raw.comm, b.raw.MPI

    def step():
        for g in gs:
            comm.Allreduce(MPI.IN_PLACE, g, MPI.SUM)

    return step


def _raw_one(b, flat):
    if b.backend == "nccl":
        r = b.raw
        return r.bind(r.comm.allReduce, flat, flat, flat.size, r.dt, 0, r.s)
    return functools.partial(b.raw.comm.Allreduce, b.raw.MPI.IN_PLACE, flat, b.raw.MPI.SUM)


def run_buckets(b, progress, out):
    """Time each mode against its raw counterpart; returns the rows (on every rank).

    ``out``: where rank 0 prints (a callable taking one line).
    """
    a, n = b.args, b.n
    path = find_shapes_file(a.shapes)
    shapes = read_shapes(path)
    if trial():
        shapes = shapes[:TRIAL_TENSORS]
    sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes)
    nbytes = total * 4
    modes, note = _modes(b, shapes, sizes, total)
    if b.rank == 0:
        out(f"# ResNet-50 gradients: {len(shapes)} float32 tensors, {nbytes} bytes ({path})"
            + (f"; bucket_cap_mb {', '.join('%g' % c for c in a.bucket_caps)}" if a.bucket_caps else ""))
        if note:
            out("# " + note)
        out(bucket_header(a.compare))

    def measure(mode, calls, f, raw):
        b.clock.warm([f, raw], max(a.warmup, b.pool if b.pool > 1 else 1))
        iters = a.iters if a.iters > 0 else max(3, int(a.target_time / max(b.clock.probe(f, 1), 1e-9)))
        t, tr = b.clock.time([f, raw], iters, a.rounds, a.stat)
        alg, bus = bandwidths("all_reduce", nbytes, t, n)
        row = {"coll": "buckets", "mode": mode, "calls": calls, "size": nbytes, "iters": iters,
               "time_us": t * 1e6, "algbw": alg, "busbw": bus, "raw": None}
        if tr is not None:
            ra, rb = bandwidths("all_reduce", nbytes, tr, n)
            row["raw"] = {"time_us": tr * 1e6, "algbw": ra, "busbw": rb}
        return row

    # the one-buffer row first, so every row can print its share of it as it comes
    one = measure(*modes[-1])
    rows = []
    for m in modes[:-1] + [None]:
        row = one if m is None else measure(*m)
        row["of_one_buffer"] = row["busbw"] / one["busbw"] if one["busbw"] > 0 else None
        rows.append(row)
        if b.rank == 0:
            out(bucket_row(row, a.compare))
            if progress:
                print(f"[mpicomm-bench] buckets: {row['mode']} done ({row['iters']} iters)", file=sys.stderr,
                      flush=True)
    if b.rank == 0:
        for line in bucket_summary(rows):
            out(line)
    return rows
