"""The result buffers of ``reducer(grads)``: each bucket keeps a few flat buffers with their
views and packs into one again once nothing outside holds it (its reference counts are
back to what they were when only the bucket held it).
"""
from __future__ import annotations

import sys

import numpy as np

from .families import TORCH

_OUT_SLOTS = 2  # result buffers kept per bucket for reducer(grads), reused once the caller drops them
_torch_use_count = None  # torch._C._storage_Use_Count, looked up at the first PyTorch bucket


def _refcounts(slot):
    """The reference counts that tell whether anything outside the slot holds its buffer,
    its views, or their memory: derived views and DLPack or CUDA-array-interface consumers
    all hold one of these (CuPy: the allocation's Python object; PyTorch: the storage's
    C++ use count, which every tensor sharing it holds, Python object or not)."""
    flat, views = slot[0], slot[1]
    if isinstance(flat, np.ndarray):
        held = 0
    elif _torch_use_count is not None and type(flat).__module__.startswith("torch"):
        held = _torch_use_count(flat.untyped_storage()._cdata)
    else:
        held = sys.getrefcount(flat.data.mem)  # CuPy: the allocation itself
    return (sys.getrefcount(flat), held, tuple(map(sys.getrefcount, views)))


def _torch_storage_use_count():
    """PyTorch's count of the references to a storage (its C++ intrusive pointer), or None
    where this PyTorch has no such function (then its results are never reused)."""
    try:
        import torch

        return getattr(torch._C, "_storage_Use_Count", None)
    except Exception:
        return None


def _out_slot(b):
    """[flat, views] for reducer(grads)'s result: a kept one that nothing outside holds
    any more (NumPy, CuPy: reference counts; making 161 views costs more host time than
    the reduction), else a new one."""
    global _torch_use_count
    if b.fam is TORCH and _torch_use_count is None:
        _torch_use_count = _torch_storage_use_count()
    # a PyTorch view holds its base in C++, out of sight of Python's counts: reused only
    # where the storage's own count can be read
    pooled = b.fam is not TORCH or _torch_use_count is not None
    if pooled:
        if b.outs is None:
            b.outs = []
        for sl in b.outs:
            if _refcounts(sl) == sl[2]:
                return sl
    sl = [b.fam.empty(b.numel, b.fam.spec(b.flat)[1], b.device), None, None, None]
    if b.fam is TORCH:
        sl[1] = TORCH.views(sl[0], b.views)
    else:
        sl[1] = [b.fam.view(sl[0], off, sz, shape) for _, off, sz, shape in b.layout]
    if b.small is not None:
        sl[3] = b.fam.view(sl[0], 0, b.small_numel, (b.small_numel,))
    if pooled and len(b.outs) < _OUT_SLOTS:
        b.outs.append(sl)
        sl[2] = _refcounts(sl)  # the counts while only the slot holds them
    return sl
