"""One-off fused calls: many arrays all-reduced or broadcast in one call per (array family,
dtype, device), through a fresh flat buffer (no persistent buckets; for a training loop's
gradients use DistributedGradReducer).
"""
from __future__ import annotations

import numpy as np

from .. import all_reduce, broadcast
from .._ops import ReduceOp, as_op
from .._state import CTX, get_group
from ..errors import invalid
from .families import _as_list, _is_gpu, _key_plan


def _groups_of(arrays, arg):
    specs, keys = _key_plan(arrays, arg)
    order = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    return specs, list(order.values())


def _pack(specs, idx):
    fam, _, dt, dev, _ = specs[idx[0]]
    sizes = [int(np.prod(specs[i][1], dtype=np.int64)) for i in idx]
    flat = fam.zeros(sum(sizes), dt, dev)
    views, off = [], 0
    for i, sz in zip(idx, sizes):
        views.append(fam.view(flat, off, sz, specs[i][1]))
        off += sz
    return fam, flat, views


def all_reduce_coalesced(arrays, op=ReduceOp.SUM, group=None):
    """All-reduce many arrays in one fused call per (array family, dtype, device).

    Returns a list of new arrays in the input order (views into one fresh buffer per
    fused group). Raises InvalidArgumentError for a non-list, an unsupported array type,
    or an op the dtype does not allow.
    """
    op = as_op(op)
    arrays = _as_list(arrays, "arrays")
    specs, groups = _groups_of(arrays, "arrays")
    nccl = CTX.backend_name == "nccl"
    out = [None] * len(arrays)
    pending = []
    for idx in groups:
        fam, flat, views = _pack(specs, idx)
        for i, v in zip(idx, views):
            fam.copy(v, arrays[i])
            out[i] = v
        if nccl and _is_gpu(fam, specs[idx[0]][3]):
            all_reduce(flat, op, out=flat, group=group)  # stream-ordered
        else:
            pending.append(all_reduce(flat, op, out=flat, group=group, async_op=True))
    for w in pending:
        w.wait()
    return out


def broadcast_parameters(parameters, root=0, group=None):
    """Overwrite ``parameters`` in place with rank ``root``'s (MindSpore's parameter_broadcast).

    parameters: a list, tuple or dict of arrays (NumPy, CuPy, PyTorch); one fused
    broadcast per (array family, dtype, device). Returns ``parameters``.
    """
    g = get_group(group)
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < g.size:
        raise invalid("root", root, f"a rank of the group in 0..{g.size - 1}")
    arrays = _as_list(parameters, "parameters")
    specs, groups = _groups_of(arrays, "parameters")
    me = g.rank == root
    for idx in groups:
        fam, flat, views = _pack(specs, idx)
        if me:
            for i, v in zip(idx, views):
                fam.copy(v, arrays[i])
        broadcast(flat, int(root), group=group)
        if not me:
            for i, v in zip(idx, views):
                fam.copy(arrays[i], v)
    from . import context

    context.parameters_broadcast()
    return parameters


__all__ = ["all_reduce_coalesced", "broadcast_parameters"]
