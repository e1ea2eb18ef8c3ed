"""CUDA streams for the reducer: making a CuPy stream current and restoring the caller's
exactly (``_CupyOn``), a no-op context (``_Null``), and PyTorch's current stream seen as a
CuPy stream, so that CuPy kernels (the copy kernel) can run on it.

CuPy is imported when a function here first runs, never at import.
"""
from __future__ import annotations


class _CupyOn:
    """Make ``side`` CuPy's current stream, and restore exactly the stream that was current.

    (A CuPy stream's own ``with`` block restores the stream of the enclosing ``with``, which
    is the null stream when the caller had chosen its stream with ``Stream.use()``.)
    """

    __slots__ = ("cp", "side", "prev")

    def __init__(self, cp, side):
        self.cp, self.side = cp, side

    def __enter__(self):
        self.prev = self.cp.cuda.get_current_stream()
        self.side.use()

    def __exit__(self, *exc):
        self.prev.use()
        return False


_external = {}  # PyTorch stream handle -> CuPy ExternalStream


def _on_cupy_device(device):
    """Whether ``device`` ("cuda:N") is CuPy's current device (where its kernels run)."""
    import cupy

    return cupy.cuda.runtime.getDevice() == int(device.split(":")[1])


_torch_raw = None   # device index -> PyTorch's current cudaStream_t


def _torch_stream_for_cupy(device):
    """PyTorch's current stream on ``device`` ("cuda:N") for a CuPy kernel launch: None
    where it is CuPy's current stream already (both default to the device's null stream),
    else a CuPy ExternalStream of it (kept per handle)."""
    global _torch_raw
    if _torch_raw is None:
        from .._backends.gpu_arrays import torch_raw_stream

        _torch_raw = torch_raw_stream()
    import cupy as cp

    dev = int(device.split(":")[1])
    h = _torch_raw(dev)
    if h == cp.cuda.get_current_stream().ptr:
        return None
    ext = _external.get(h)
    if ext is None:
        if len(_external) >= 64:
            _external.clear()
        ext = _external[h] = cp.cuda.ExternalStream(h, dev)
    return ext


class _NullCtx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


_Null = _NullCtx()
