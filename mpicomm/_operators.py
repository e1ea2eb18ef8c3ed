"""MindSpore-style operators (``mpicomm.ops``): objects made once with the group and op,
then called with the array, as ``mindspore.ops`` has them. Each calls the collective of
the same name in mpicomm._collectives.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from ._collectives import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from ._ops import ReduceOp, as_op
from ._state import get_group
from ._typing import ArrayLike
from .errors import TypeOf, invalid


class _Op:
    """An operator made with the group (None: the world)."""

    def __init__(self, group: str | None = None) -> None:
        self.group = group

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class _Reducing(_Op):
    """An operator made with the reduction op and the group."""

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM, group: str | None = None) -> None:
        self.op = as_op(op)
        self.group = group


class AllReduce(_Reducing):
    """``AllReduce(op=ReduceOp.SUM, group=None)(x)`` runs :func:`all_reduce`."""

    def __call__(self, x: ArrayLike) -> Any:
        # (MindSpore's parameter_broadcast without a reducer: say that nothing was broadcast;
        # the context module is loaded only where set_auto_parallel_context was used)
        ctx = sys.modules.get("mpicomm.training.context")
        if ctx is not None and ctx.broadcast_pending:
            ctx.warn_unbroadcast("mpicomm.ops.AllReduce call")
        return all_reduce(x, self.op, group=self.group)


class AllGather(_Op):
    """``AllGather(group=None)(x)`` runs :func:`all_gather`."""

    def __call__(self, x: ArrayLike) -> Any:
        return all_gather(x, group=self.group)


class ReduceScatter(_Reducing):
    """``ReduceScatter(op=ReduceOp.SUM, group=None)(x)`` runs :func:`reduce_scatter`."""

    def __call__(self, x: ArrayLike) -> Any:
        return reduce_scatter(x, self.op, group=self.group)


class Broadcast(_Op):
    """``Broadcast(root=0, group=None)(x)``: root's ``x`` on every rank, as a new array, or
    each array of a tuple/list (as MindSpore's Broadcast does: a tuple in, a tuple out).
    As in MindSpore, the input is left as it was (:func:`broadcast` fills ``x`` in place)."""

    def __init__(self, root: int = 0, group: str | None = None) -> None:
        self.root = root
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        if isinstance(x, (tuple, list)):
            return type(x)(broadcast(_copy(a), self.root, group=self.group) for a in x)
        return broadcast(_copy(x), self.root, group=self.group)


def _copy(x: Any) -> Any:
    """A new array with x's values, of x's kind (NumPy, CuPy, PyTorch, other host buffers)."""
    if hasattr(x, "clone") and hasattr(x, "detach"):   # a torch tensor
        return x.detach().clone()
    if hasattr(x, "copy") and hasattr(x, "shape"):      # NumPy, CuPy
        return x.copy()
    try:                                                 # host buffers: a NumPy copy
        return np.array(memoryview(x))
    except TypeError:
        return x   # anything else is checked (and refused, or filled) by broadcast itself


class AlltoAll(_Op):
    """``AlltoAll(group=None)(x)`` runs :func:`all_to_all` (splits and joins axis 0).

    MindSpore's form ``AlltoAll(split_count, split_dim, concat_dim, group=None)(x)`` splits
    x into ``split_count`` (the group size) equal parts along ``split_dim``, sends part j to
    rank j, and concatenates the parts received (rank i's first) along ``concat_dim``.
    """

    def __init__(self, split_count: int | str | None = None, split_dim: int = 0, concat_dim: int = 0,
                 group: str | None = None) -> None:
        if isinstance(split_count, str) and group is None:   # AlltoAll("group name"): the old form
            split_count, group = None, split_count
        if split_count is not None and (not isinstance(split_count, (int, np.integer))
                                        or isinstance(split_count, bool) or split_count < 1):
            raise invalid("split_count", split_count, "a positive int: the group size")
        for name, v in (("split_dim", split_dim), ("concat_dim", concat_dim)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise invalid(name, v, "an int (an axis of x)")
        self.split_count = split_count
        self.split_dim = int(split_dim)
        self.concat_dim = int(concat_dim)
        self.group = group

    def __call__(self, x: ArrayLike) -> Any:
        if self.split_count is None or (self.split_dim == 0 and self.concat_dim == 0):
            if self.split_count is not None:
                _check_split_count(self.split_count, self.group)
            return all_to_all(x, group=self.group)
        n = _check_split_count(self.split_count, self.group)
        xp = _ArrayNS(x)
        nd = len(x.shape)
        sd, cd = self.split_dim, self.concat_dim
        for name, d in (("split_dim", sd), ("concat_dim", cd)):
            if not -nd <= d < nd:
                raise invalid(name, d, f"an axis of x, in {-nd}..{nd - 1} (x has shape {tuple(x.shape)})")
        sd, cd = sd % nd, cd % nd
        if x.shape[sd] % n:
            raise invalid("x.shape", tuple(x.shape), f"axis split_dim={sd} divisible by split_count={n}")
        # part j along split_dim becomes block j of axis 0, sent to rank j
        y = all_to_all(xp.contiguous(xp.moveaxis(x, sd, 0)), group=self.group)
        k = x.shape[sd] // n
        parts = [xp.moveaxis(y[j * k:(j + 1) * k], 0, sd) for j in range(n)]
        return xp.concat(parts, cd)


def _check_split_count(split_count: int, group: str | None) -> int:
    n = get_group(group).size
    if split_count != n:
        raise invalid("split_count", split_count, f"the group size {n} (MindSpore's AlltoAll sends one part "
                      "to each rank)")
    return n


class _ArrayNS:
    """moveaxis / concatenate / contiguous for NumPy, CuPy and PyTorch arrays."""

    moveaxis: Callable[..., Any]
    contiguous: Callable[..., Any]
    concat: Callable[..., Any]

    def __init__(self, x: Any) -> None:
        mod = type(x).__module__.split(".")[0]
        if mod == "torch":
            import torch

            self.moveaxis, self.contiguous = torch.movedim, (lambda a: a.contiguous())
            self.concat = lambda parts, d: torch.cat(parts, d)
        else:
            xp: Any = np
            if mod == "cupy":
                import cupy

                xp = cupy
            self.moveaxis, self.contiguous = xp.moveaxis, xp.ascontiguousarray
            self.concat = lambda parts, d: xp.concatenate(parts, d)


class AllGatherV(_Op):
    """MindSpore's ``AllGatherV(group=None)(x, output_split_sizes)``: all_gather of 1-D arrays
    whose lengths differ; ``output_split_sizes`` is every rank's length (or ``"auto"``)."""

    def __call__(self, x: ArrayLike, output_split_sizes: Sequence[int] | str) -> Any:
        return all_gather(x, group=self.group, sizes=output_split_sizes)


class ReduceScatterV(_Reducing):
    """MindSpore's ``ReduceScatterV(op=ReduceOp.SUM, group=None)(x, input_split_sizes)``:
    reduce_scatter where rank i gets ``input_split_sizes[i]`` elements of axis 0."""

    def __call__(self, x: ArrayLike, input_split_sizes: Sequence[int]) -> Any:
        return reduce_scatter(x, self.op, group=self.group, sizes=input_split_sizes)


class NeighborExchange(_Op):
    """MindSpore's ``NeighborExchange(send_rank_ids, recv_rank_ids, recv_shapes, send_shapes,
    recv_type, group=None)((x0, x1, ...))``: sends ``x[i]`` (of shape ``send_shapes[i]``) to
    group rank ``send_rank_ids[i]`` and receives from each ``recv_rank_ids[j]`` an array of
    shape ``recv_shapes[j]`` and dtype ``recv_type``, all at once (one :func:`batch_isend_irecv`,
    so no order of the peers can deadlock); returns the received arrays as a tuple, in
    ``recv_rank_ids`` order, of the inputs' kind (NumPy, CuPy, PyTorch on x[0]'s device;
    NumPy where nothing is sent). Each peer at most once per list; the peers' calls must
    match (a rank that sends to r is in r's ``recv_rank_ids``, with that shape and dtype).
    """

    def __init__(self, send_rank_ids: Sequence[int], recv_rank_ids: Sequence[int], recv_shapes: Sequence[Any],
                 send_shapes: Sequence[Any], recv_type: Any, group: str | None = None) -> None:
        self.send_rank_ids = _rank_list("send_rank_ids", send_rank_ids)
        self.recv_rank_ids = _rank_list("recv_rank_ids", recv_rank_ids)
        self.send_shapes = _shape_list("send_shapes", send_shapes, len(self.send_rank_ids), "send_rank_ids")
        self.recv_shapes = _shape_list("recv_shapes", recv_shapes, len(self.recv_rank_ids), "recv_rank_ids")
        self.recv_type = recv_type
        self.group = group

    def __call__(self, x: Sequence[ArrayLike]) -> tuple[Any, ...]:
        from ._collectives import P2POp, batch_isend_irecv, recv, send

        if not isinstance(x, (tuple, list)):
            raise invalid("x", TypeOf(x), f"a tuple of {len(self.send_rank_ids)} arrays, one for each of "
                          f"send_rank_ids={self.send_rank_ids} (MindSpore's input is a tuple)")
        if len(x) != len(self.send_rank_ids):
            raise invalid("x", f"a tuple of {len(x)} arrays", f"{len(self.send_rank_ids)} arrays, one for each of "
                          f"send_rank_ids={self.send_rank_ids}")
        n = get_group(self.group).size
        for name, ids in (("send_rank_ids", self.send_rank_ids), ("recv_rank_ids", self.recv_rank_ids)):
            bad = [r for r in ids if r >= n]
            if bad:
                raise invalid(name, ids, f"ranks of the group in 0..{n - 1}")
        for i, (a, shape) in enumerate(zip(x, self.send_shapes)):
            if tuple(getattr(a, "shape", ())) != shape:
                raise invalid(f"x[{i}].shape", tuple(getattr(a, "shape", ())), f"send_shapes[{i}] = {list(shape)}")
        outs = tuple(_empty_of_kind(x[0] if x else None, shape, self.recv_type) for shape in self.recv_shapes)
        ops = [P2POp(send, a, r, self.group) for a, r in zip(x, self.send_rank_ids)]
        ops += [P2POp(recv, o, r, self.group) for o, r in zip(outs, self.recv_rank_ids)]
        if ops:
            for w in batch_isend_irecv(ops):
                w.wait()
        return outs


def _rank_list(name: str, ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool)
                                                     and r >= 0 for r in ids):
        raise invalid(name, ids, "a list of group ranks (non-negative ints)")
    ids = [int(r) for r in ids]
    if len(set(ids)) != len(ids):
        raise invalid(name, ids, "each rank at most once")
    return ids


def _shape_list(name: str, shapes: Any, count: int, ids_name: str) -> list[tuple[int, ...]]:
    ok = isinstance(shapes, (list, tuple)) and all(
        isinstance(s, (list, tuple)) and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                                             for d in s) for s in shapes)
    if not ok:
        raise invalid(name, shapes, "a tuple of shapes, each a list of non-negative ints")
    if len(shapes) != count:
        raise invalid(name, shapes, f"{count} shapes, one for each rank of {ids_name}")
    return [tuple(int(d) for d in s) for s in shapes]


def _empty_of_kind(like: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A new array of ``shape`` and ``dtype``, of ``like``'s kind (NumPy where ``like`` is None)."""
    mod = type(like).__module__.split(".")[0] if like is not None else "numpy"
    if mod == "torch":
        import torch

        if not isinstance(dtype, torch.dtype):
            try:
                dtype = torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype
            except TypeError as e:
                raise invalid("recv_type", dtype, "a torch dtype, or a NumPy dtype torch has") from e
        return torch.empty(shape, dtype=dtype, device=like.device)
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise invalid("recv_type", dtype, "a NumPy dtype (np.float32, 'float32', ...)") from e
    if mod == "cupy":
        import cupy

        with cupy.cuda.Device(like.data.device_id):
            return cupy.empty(shape, dt)
    return np.empty(shape, dt)
