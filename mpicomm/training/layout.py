"""One bucket of DistributedGradReducer: its flat buffer and the views of its gradients,
the buffer that goes on the wire (half precision with compression, float32 with fp32_sync),
how the mean is taken (divided before the sum, NCCL's AVG, or divided after), and which big
gradients NCCL reduces where they are (direct) instead of packing them.
"""
from __future__ import annotations

import numpy as np

from .._ops import ReduceOp
from .families import CUPY, TORCH, _is_gpu


class _Bucket:
    __slots__ = ("fam", "indices", "views", "flat", "wire", "prescale", "postscale", "device",
                 "stream_mode", "remaining", "work", "numel", "layout", "outs", "sizes", "op", "direct",
                 "nsmall", "small_numel", "small", "srcs", "later")


# NCCL buckets: gradients this large are reduced where they are, not copied into the bucket
# (ResNet-50 on 4 x H100: grouped out-of-place all-reduces of the 10 gradients of 4 MiB or
# more, and the other 151 packed, ran at 0.90 of one buffer; packing all of them at 0.86;
# from 1 MiB up (29 all-reduces), 0.88: each all-reduce in a group costs about 2 us)
_DIRECT_MIN_BYTES = 4 << 20


def _make_bucket(idx, specs, compression, fp32_sync, mean, nccl):
    """The bucket of gradients ``idx`` (one list of the plan), laid out in a new flat buffer.

    specs: (family, shape, dtype, device, nbytes) of every gradient; nccl: whether the
    backend is NCCL (GPU buckets are then reduced on the stream, and may be direct).
    ``b.indices`` lists the members in their order in the buffer (big direct ones last),
    ``b.views`` their views and ``b.layout`` (gradient index, offset, size, shape).
    """
    fam, _, dt, dev, _ = specs[idx[0]]
    b = _Bucket()
    b.fam, b.device = fam, dev
    name = fam.dtype_name(dt)
    wire = dt
    if compression and name == "float32":
        wire = fam.half(compression)
    elif fp32_sync and name in ("float16", "bfloat16"):
        wire = fam.f32
    half_wire = fam.dtype_name(wire) in ("float16", "bfloat16")
    b.stream_mode = nccl and _is_gpu(fam, dev)
    b.prescale = mean and half_wire
    # NCCL averages float32/float64 itself (ncclAvg): no division kernel after the sum
    b.op = (ReduceOp.AVG if mean and b.stream_mode and wire == dt and name in ("float32", "float64")
            else ReduceOp.SUM)
    b.postscale = mean and not half_wire and b.op is not ReduceOp.AVG
    # On NCCL, gradients of _DIRECT_MIN_BYTES or more can be reduced straight from
    # where they are (an out-of-place all_reduce into their place in the result)
    # instead of being copied into the bucket first: they go after the small ones,
    # which are packed and reduced as one range.
    idx = list(idx)
    big = []
    if b.stream_mode and wire == dt and not b.prescale:
        big = [i for i in idx if specs[i][4] >= _DIRECT_MIN_BYTES]
        if big:
            idx = [i for i in idx if specs[i][4] < _DIRECT_MIN_BYTES] + big
    b.indices = idx
    b.direct = bool(big)
    b.nsmall = len(idx) - len(big)
    sizes = [int(np.prod(specs[i][1], dtype=np.int64)) for i in idx]
    b.numel = sum(sizes)
    b.small_numel = sum(sizes[:b.nsmall])
    b.flat = fam.zeros(b.numel, dt, dev)
    off = 0
    b.views = []
    b.layout = []  # (gradient index, offset, size, shape)
    # bytes per member, for the CuPy copy kernel (CuPy arrays; CUDA tensors on NCCL)
    b.sizes = (tuple(sz * np.dtype(dt).itemsize for sz in sizes) if fam is CUPY else
               tuple(sz * dt.itemsize for sz in sizes) if fam is TORCH and b.stream_mode else None)
    for i, sz in zip(idx, sizes):
        b.layout.append((i, off, sz, specs[i][1]))
        b.views.append(fam.view(b.flat, off, sz, specs[i][1]))
        off += sz
    b.small = fam.view(b.flat, 0, b.small_numel, (b.small_numel,)) if b.direct and b.small_numel else None
    b.wire = b.flat if wire == dt else fam.zeros(b.numel, wire, dev)
    b.work = None
    b.outs = None
    b.srcs = None
    b.later = None
    return b
