"""MindSpore-style operators, for code ported from ``mindspore.ops``.

``from mpicomm import ops`` then ``ops.AllReduce(ops.ReduceOp.SUM, group)(x)``,
``ops.AllGather(group)(x)``, ``ops.ReduceScatter(op, group)(x)``,
``ops.Broadcast(root, group)((x,))`` and ``ops.AlltoAll(group)(x)`` run the collectives of
:mod:`mpicomm` (``mpicomm.all_reduce`` and the others). ``ops.AlltoAll(split_count, split_dim,
concat_dim, group)(x)`` splits along ``split_dim`` and concatenates along ``concat_dim`` as
MindSpore's does (``AlltoAll(group)`` alone splits and joins axis 0);
``ops.AllGatherV(group)(x, output_split_sizes)`` and ``ops.ReduceScatterV(op, group)(x,
input_split_sizes)`` take per-rank sizes; ``ops.NeighborExchange(send_rank_ids, recv_rank_ids,
recv_shapes, send_shapes, recv_type, group)((x0, ...))`` sends to and receives from chosen ranks.
"""
from ._operators import (AllGather, AllGatherV, AllReduce, AlltoAll, Broadcast, NeighborExchange, ReduceScatter,
                         ReduceScatterV)
from ._ops import ReduceOp

__all__ = ["AllReduce", "AllGather", "AllGatherV", "ReduceScatter", "ReduceScatterV", "Broadcast", "AlltoAll",
           "NeighborExchange", "ReduceOp"]
