"""The array families the bench hands to mpicomm (``--array``): NumPy, CuPy, PyTorch.

Each family makes arrays from host data, zeroed arrays, and reads them back to the host
for the result checks; all arrays are 1-D and contiguous. The raw baselines use their
library's own family (NumPy for mpi4py, CuPy for NCCL), whatever ``--array`` says.
"""
from __future__ import annotations

import numpy as np

ARRAYS = ("numpy", "cupy", "torch")
_INT_OF_SIZE = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def np_dtype(name):
    """The NumPy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("-d bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_importable(name):
    """Raise ValueError naming the package when ``--array name`` cannot be used here."""
    mod = {"cupy": "cupy", "torch": "torch"}.get(name)
    if mod is None:
        return
    try:
        __import__(mod)
    except ImportError as e:
        pkg = "cupy-cuda12x (or cupy-cuda13x)" if mod == "cupy" else "torch"
        raise ValueError(f"--array {name} needs {mod}, which cannot be imported here ({e}): "
                         f"pip install {pkg}, or use --array numpy") from None


class NumpyFamily:
    name, gpu = "numpy", False

    def from_host(self, host):
        return np.array(host, copy=True)

    def zeros(self, count, dt):
        return np.zeros(count, dt)

    def to_host(self, a, dt):
        return np.asarray(a)

    def copy_in(self, dst, host):
        np.copyto(dst, host)


class CupyFamily:
    """CuPy arrays on the current device. ``bytes_only``: dtypes CuPy lacks (bfloat16) are
    stored as same-sized integers, for the raw NCCL baseline, which needs only pointers."""

    name, gpu = "cupy", True

    def __init__(self, bytes_only=False):
        import cupy

        self.cp = cupy
        self.bytes_only = bytes_only

    def _store(self, dt):
        if dt.kind == "V":  # ml_dtypes' bfloat16
            if not self.bytes_only:
                raise ValueError(f"CuPy has no {dt}: use --array torch (or numpy)")
            return np.dtype(_INT_OF_SIZE[dt.itemsize])
        return dt

    def from_host(self, host):
        return self.cp.asarray(host.view(self._store(host.dtype)))

    def zeros(self, count, dt):
        return self.cp.zeros(count, self._store(dt))

    def to_host(self, a, dt):
        return self.cp.asnumpy(a).view(dt)

    def copy_in(self, dst, host):
        dst.set(host.view(dst.dtype))


class TorchFamily:
    """PyTorch tensors on ``device`` ("cpu", or a CUDA device)."""

    name = "torch"
    _NAMES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
              "uint64": "uint64", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
              "float64": "float64", "complex64": "complex64", "complex128": "complex128"}

    def __init__(self, device="cpu"):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"

    def tdtype(self, dt):
        t = getattr(self.torch, self._NAMES.get(str(dt), "?"), None)
        if t is None:
            raise ValueError(f"-d {dt} has no PyTorch dtype in torch {self.torch.__version__}: "
                             "use another -d or --array numpy")
        return t

    def _from_numpy(self, host):
        td = self.tdtype(host.dtype)
        if host.dtype.kind in "cf" or host.dtype in (np.int8, np.uint8, np.int32, np.int64):
            return self.torch.from_numpy(host)
        # bfloat16 (ml_dtypes), uint32, uint64: through a same-sized integer
        return self.torch.from_numpy(host.view(_INT_OF_SIZE[host.dtype.itemsize])).view(td)

    def from_host(self, host):
        return self._from_numpy(np.ascontiguousarray(host)).to(self.device, copy=True)

    def zeros(self, count, dt):
        return self.torch.zeros(count, dtype=self.tdtype(dt), device=self.device)

    def to_host(self, a, dt):
        t = a.detach().to("cpu")
        if dt.kind in "cf":
            return t.numpy()
        return t.view(getattr(self.torch, np.dtype(_INT_OF_SIZE[dt.itemsize]).name)).numpy().view(dt)

    def copy_in(self, dst, host):
        dst.copy_(self._from_numpy(np.ascontiguousarray(host)))
