"""Where each rank's parts go in a call with per-rank sizes on NCCL: one function per collective.

NCCL has no v-collectives, so all_gather, all_to_all, gather and scatter with per-rank
sizes are grouped ``send``/``recv`` calls (one ncclGroupStart/End), and reduce_scatter with
sizes is one ``reduce`` per rank. Each function here takes the facts of one rank's call
and returns its :class:`Layout`, validating what only it can (the sizes against the
input's axis 0): the transport (mpicomm._backends.nccl) turns a layout into library calls.

Arguments: ``shape`` the input's shape (on scatter's non-root ranks: the output's), ``rank``
and ``n`` this rank and the group size, ``root`` (gather, scatter), ``sizes`` the axis-0
length of each rank's part (None: even), ``outs`` all_to_all's out_splits, ``o0`` the
axis-0 length of a given ``out=`` (all_to_all without out_splits; else None).
"""
from __future__ import annotations

from typing import NamedTuple

from .._arrays import offsets
from .._ops import ALL_GATHER, ALL_TO_ALL, GATHER, REDUCE_SCATTER, SCATTER
from ..errors import invalid
from .gpu_arrays import prod


class Layout(NamedTuple):
    oshape: tuple    # this rank's output shape
    sends: list      # (peer, offset in elements, elements) from x
    recvs: list      # (peer, offset in elements, elements) into the output
    reduces: list    # (root, offset in elements, elements): reduce_scatter's one reduce per rank
    is_root: bool    # False where this rank gets no output (gather's non-root ranks)


def _own_part(shape, sizes, rank, arg="x.shape"):
    if shape[0] != sizes[rank]:
        raise invalid(arg, shape, f"axis 0 of length sizes[{rank}] = {sizes[rank]} on rank {rank}")


def all_gather(shape, rank, n, root, sizes, outs, o0):
    _own_part(shape, sizes, rank)
    t, offs = prod(shape[1:]), offsets(sizes)
    return Layout((sum(sizes),) + shape[1:], [(j, 0, sizes[rank] * t) for j in range(n)],
                  [(j, offs[j] * t, sizes[j] * t) for j in range(n)], [], True)


def all_to_all(shape, rank, n, root, sizes, outs, o0):
    trail = shape[1:]
    ins = sizes
    if ins is None:
        if shape[0] % n:
            raise invalid("x.shape", shape, f"a first axis divisible by the group size {n}, or in_splits")
        ins = (shape[0] // n,) * n
    elif sum(ins) != shape[0]:
        raise invalid("in_splits", list(ins), f"sizes that add up to x.shape[0] = {shape[0]} (on rank {rank})")
    if outs is None:
        o0 = shape[0] if o0 is None else o0
        if o0 % n:
            raise invalid("out.shape", (o0,) + trail, f"a first axis divisible by the group size {n}, "
                          "or out_splits (a list, or 'auto')")
        outs = (o0 // n,) * n
    t, so, ro = prod(trail), offsets(ins), offsets(outs)
    return Layout((sum(outs),) + trail, [(j, so[j] * t, ins[j] * t) for j in range(n)],
                  [(j, ro[j] * t, outs[j] * t) for j in range(n)], [], True)


def reduce_scatter(shape, rank, n, root, sizes, outs, o0):
    if sum(sizes) != shape[0]:
        raise invalid("sizes", list(sizes), f"sizes that add up to x.shape[0] = {shape[0]}")
    t, offs = prod(shape[1:]), offsets(sizes)
    return Layout((sizes[rank],) + shape[1:], [], [], [(j, offs[j] * t, sizes[j] * t) for j in range(n)], True)


def gather(shape, rank, n, root, sizes, outs, o0):
    is_root = rank == root
    if sizes is None:
        sizes = ((shape[0] if shape else 1),) * n
    else:
        _own_part(shape, sizes, rank)
    t, offs = prod(shape[1:]), offsets(sizes)
    return Layout((sum(sizes),) + shape[1:], [(root, 0, sizes[rank] * t)],
                  [(j, offs[j] * t, sizes[j] * t) for j in range(n)] if is_root else [], [], is_root)


def scatter(shape, rank, n, root, sizes, outs, o0):
    sends = []
    if rank == root:
        if sizes is None:
            if shape[0] % n:
                raise invalid("x.shape", shape, f"a first axis divisible by the group size {n} on the root, "
                              "or sizes")
            sizes = (shape[0] // n,) * n
        elif sum(sizes) != shape[0]:
            raise invalid("sizes", list(sizes), f"sizes that add up to the root's x.shape[0] = {shape[0]}")
        t, offs = prod(shape[1:]), offsets(sizes)
        sends = [(j, offs[j] * t, sizes[j] * t) for j in range(n)]
        oshape = (sizes[rank],) + shape[1:]
    else:
        if sizes is not None:
            _own_part(shape, sizes, rank, "out.shape")
        oshape = shape
    return Layout(oshape, sends, [(root, 0, prod(oshape))], [], True)


LAYOUTS = {ALL_GATHER: all_gather, ALL_TO_ALL: all_to_all, REDUCE_SCATTER: reduce_scatter, GATHER: gather,
           SCATTER: scatter}
