"""CUDA-graph capture, as the NCCL transport and the watchdog need to know of it.

A collective on GPU arrays enqueued on a stream that is capturing a graph is captured
(NCCL allows it) and runs on every replay; what mpicomm does on the host for it (sequence
number, progress words, agreement check, flight record) happens once, at capture. What
cannot be captured is refused during a capture: a call on host arrays runs at once over
MPI, and a replay would not repeat it. The watchdog never records its events on a
capturing stream, and its thread is in CUDA's relaxed capture mode, so that its event
queries never invalidate a capture that the script's thread is making (PyTorch's NCCL
watchdog does the same). The driver API is called through ctypes: the same on every CuPy
and PyTorch version.
"""
from __future__ import annotations

import ctypes
import sys

_ACTIVE = 1        # CU_STREAM_CAPTURE_STATUS_ACTIVE
_RELAXED = 2       # CU_STREAM_CAPTURE_MODE_RELAXED
_lib = None


def _driver():
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _lib = False
    return _lib


def stream_capturing(ptr):
    """True when the CUDA stream ``ptr`` (a cudaStream_t) is capturing a graph."""
    lib = _driver()
    if not lib:
        return False
    status = ctypes.c_int(0)
    if lib.cuStreamIsCapturing(ctypes.c_void_p(ptr), ctypes.byref(status)) != 0:
        return False
    return status.value == _ACTIVE


def current_capturing():
    """True when this thread's current CuPy stream or PyTorch stream is capturing."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            if stream_capturing(cupy.cuda.get_current_stream().ptr):
                return True
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
                return True
        except Exception:
            pass
    return False


def relax_this_thread():
    """Put the calling thread in CUDA's relaxed capture mode (its calls then never
    invalidate another thread's capture); True when done."""
    lib = _driver()
    if not lib:
        return False
    mode = ctypes.c_int(_RELAXED)
    return lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
