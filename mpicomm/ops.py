"""MindSpore-style operators, for code ported from ``mindspore.ops``.

``from mpicomm import ops`` then ``ops.AllReduce(ops.ReduceOp.SUM, group)(x)``,
``ops.AllGather(group)(x)``, ``ops.ReduceScatter(op, group)(x)``,
``ops.Broadcast(root, group)((x,))`` and ``ops.AlltoAll(group)(x)`` run the collectives of
:mod:`mpicomm` (``mpicomm.all_reduce`` and the others). MindSpore's ``AlltoAll`` takes
``split_count, split_dim, concat_dim``; mpicomm's splits and concatenates along axis 0.
"""
from ._collectives import AllGather, AllReduce, AlltoAll, Broadcast, ReduceScatter
from ._ops import ReduceOp

__all__ = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll", "ReduceOp"]
