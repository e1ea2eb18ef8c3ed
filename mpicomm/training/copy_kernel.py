"""The CUDA copy kernel: many contiguous device buffers copied in one launch.

Packing a bucket (gradients into one flat buffer) and copying results back out would
otherwise cost one launch per gradient. ``_multi_copy`` builds a table of (source,
destination, bytes) chunks of 256 KiB, uploads it once per set of pointers (the table
cache below keeps the most recent sets), and launches one kernel over it.
``_torch_multi_copy`` runs it for CUDA tensors on PyTorch's current stream.
"""
from __future__ import annotations

import numpy as np

from .streams import _CupyOn, _Null, _torch_stream_for_cupy

_CHUNK = 1 << 18  # bytes per thread block
_COPY_SRC = r"""
extern "C" __global__ void mpicomm_multi_copy(const unsigned long long* __restrict__ tab, long long nchunks) {
    // tab[3c], tab[3c+1], tab[3c+2]: source, destination and size in bytes of chunk c.
    // Four loads in flight per thread before their stores (the buffers never overlap).
    const unsigned long long bd = blockDim.x;
    for (long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const unsigned long long s = tab[3 * c], d = tab[3 * c + 1], n = tab[3 * c + 2];
        if (((s | d | n) & 15) == 0) {
            const int4* __restrict__ src = (const int4*)s; int4* __restrict__ dst = (int4*)d;
            const unsigned long long m = n / 16;
            unsigned long long i = threadIdx.x;
            for (; i + 3 * bd < m; i += 4 * bd) {
                const int4 a0 = src[i], a1 = src[i + bd], a2 = src[i + 2 * bd], a3 = src[i + 3 * bd];
                dst[i] = a0; dst[i + bd] = a1; dst[i + 2 * bd] = a2; dst[i + 3 * bd] = a3;
            }
            for (; i < m; i += bd) dst[i] = src[i];
        } else if (((s | d | n) & 3) == 0) {
            const int* __restrict__ src = (const int*)s; int* __restrict__ dst = (int*)d;
            for (unsigned long long i = threadIdx.x; i < n / 4; i += bd) dst[i] = src[i];
        } else {
            const char* __restrict__ src = (const char*)s; char* __restrict__ dst = (char*)d;
            for (unsigned long long i = threadIdx.x; i < n; i += bd) dst[i] = src[i];
        }
    }
}
"""
_kernels = {}      # device id -> RawKernel
_tables = {}       # (srcs, dsts, sizes) -> (device table, chunks); a few, the most recent kept
_TABLES_KEPT = 64


def _multi_copy(cp, a, b, nbytes, gather, sizes_key=None, stream=None):
    """Copy many contiguous device buffers in one kernel launch on the current stream.

    gather=True: ``a`` are source pointers, ``b`` the destination base (packed one after
    the other); gather=False: ``a`` destination and ``b`` source pointers. The pointer
    table goes to the device once per set of pointers and is then reused (a step that
    hands the same gradient arrays, or a few sets of them in turn, uploads nothing).
    ``stream``: a CuPy stream to run on instead of the current one.
    """
    key = (gather, tuple(a), b if gather else tuple(b), sizes_key if sizes_key is not None else tuple(nbytes))
    hit = _tables.get(key)
    dev = cp.cuda.runtime.getDevice()
    if hit is None or hit[2] != dev:
        sizes = np.asarray(nbytes, np.uint64)
        if gather:
            src = np.asarray(a, np.uint64)
            dst = np.uint64(b) + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
        else:
            dst, src = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
        per = np.maximum((sizes + _CHUNK - 1) // _CHUNK, 1).astype(np.int64)
        idx = np.repeat(np.arange(len(sizes)), per)
        first = np.concatenate(([0], np.cumsum(per)[:-1]))
        off = ((np.arange(int(per.sum())) - np.repeat(first, per)) * _CHUNK).astype(np.uint64)
        n = np.minimum(sizes[idx] - off, np.uint64(_CHUNK))
        tab = np.stack([src[idx] + off, dst[idx] + off, n], axis=1).astype(np.uint64)
    else:
        tab = None
    k = _kernels.get(dev)
    if k is None:
        k = _kernels[dev] = cp.RawKernel(_COPY_SRC, "mpicomm_multi_copy")
    # the table is uploaded, and the kernel runs, on ``stream`` (a RawKernel runs on the current one)
    with _CupyOn(cp, stream) if stream is not None else _Null:
        if tab is not None:
            hit = (cp.asarray(tab.ravel()), len(tab), dev)
            if len(_tables) >= _TABLES_KEPT:
                _tables.pop(next(iter(_tables)))
            _tables[key] = hit
        if hit[1]:
            k((min(hit[1], 65535),), (256,), (hit[0], np.int64(hit[1])))


def _torch_multi_copy(device, a, b, nbytes, gather, sizes_key=None):
    """_multi_copy for CUDA tensors' pointers, on PyTorch's current stream of ``device``."""
    import cupy

    _multi_copy(cupy, a, b, nbytes, gather, sizes_key=sizes_key, stream=_torch_stream_for_cupy(device))
