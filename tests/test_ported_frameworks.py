"""The collective tests of MindSpore, Paddle and OneFlow, ported onto mpicomm's API: NumPy
arrays over the MPI backend, on the world and on a reversed sub-group (group rank != world
rank). The upstream tests fill tensors with ``ones * 0.01 * (rank + 1)`` or fixed lists at 2,
4 or 8 ranks; here each rank's data is random and seeded by its world rank (Paddle's value
ranges: floats in [0, 1), integers in 0..11, random bools), and every expectation is computed
with NumPy from every member's data, at any rank count. tests/test_ported.py (mpi4py, torch
in place), test_ported_horovod.py and test_ported_torch_dist.py have the other libraries.

MindSpore (mindspore-ai/mindspore), upstream file -> mpicomm call:

- tests/st/nccl/test_nccl_all_reduce_op.py (three ``P.AllReduce("sum", group=NCCL_WORLD_COMM_GROUP)``):
  ``mpicomm.ops.AllReduce(op, group)(x)`` for 'sum', 'max', 'min', 'prod', a new array, x left
  as it was: test_ms_all_reduce_op.
- test_nccl_all_gather_op.py: ``ops.AllGather(group)(x)``, axis 0 concatenated in group rank
  order: test_ms_all_gather_op.
- test_nccl_reduce_scatter_op.py ('sum', 'max', 'min', and 'prod' as the op names allow):
  ``ops.ReduceScatter(op, group)(x)`` with x of (size, 1, 3, 3), rank r keeping row r:
  test_ms_reduce_scatter_op.
- test_nccl_broadcast_op.py (``P.Broadcast(root)((x,))`` for roots 0, 1, 2): every root of
  the group, a tuple in and a tuple out: test_ms_broadcast_op.
- test_nccl_all_to_all_op.py (``AlltoAll(split_count=8, split_dim=0, concat_dim=0)``) and
  tests/ut/python/communication/test_comm.py (``AlltoAll(1, 0, 1)``): ``ops.AlltoAll(n, sd, cd,
  group)(x)``: test_ms_all_to_all_op.
- test_nccl_neighbor_exchange_op.py (send to rank-1, receive from rank+1): ``mpicomm.sendrecv(x,
  dst, src=...)``, a batch of sends and receives for several neighbours, and
  ``ops.NeighborExchange(send_rank_ids, recv_rank_ids, recv_shapes, send_shapes, recv_type,
  group)((x, ...))``: test_ms_neighbor_exchange; its argument checks: test_ms_neighbor_exchange_errors.
- test_nccl_send_recv_op.py (``P.Send(sr_tag, dest_rank)``, ``P.Receive(sr_tag, src_rank, shape,
  dtype)``): ``send(x, dst, tag=)``, ``recv(np.empty(shape, dtype), src, tag=)``:
  test_ms_send_recv_op.
- test_nccl_lenet.py (data-parallel training through ``nn.DistributedGradReducer``, the
  mean of the gradients): ``mpicomm.DistributedGradReducer(params, mean)(grads)``:
  test_ms_grad_reducer.
- tests/ut/python/communication/test_management_api.py and mindspore.communication's
  management API (get_rank, get_group_size, get_local_rank, get_local_rank_size,
  create_group, destroy_group, get_world_rank_from_group_rank, get_group_rank_from_world_rank,
  get_process_group_ranks, GlobalComm.WORLD_COMM_GROUP, NCCL_WORLD_COMM_GROUP, HCCL_WORLD_COMM_GROUP):
  test_ms_management_api; its error cases (a group that is not a name, duplicate ranks, a
  rank given as a string, destroying the world group) raise ValueError (InvalidArgumentError)
  on every rank, which MindSpore's ``has_raise_error`` counts as raised: test_ms_management_errors.
- The ops' argument checks (an op name MindSpore does not know, ReduceScatter of an axis 0
  the group size does not divide, AlltoAll's split_count other than the group size, a root
  outside the group, an all_gather whose trailing shapes differ): test_ms_op_errors.

Paddle (PaddlePaddle/Paddle test/collective, checked by test/legacy_test/test_collective_api_base.py):

- collective_allreduce_api.py (float16, float32, float64, int32, int64, int8, uint8, bool;
  ReduceOp SUM, MAX, MIN, PROD; AVG for floats): ``all_reduce(x, op, out=x)`` in place, and
  ``sync_op=False`` as ``async_op=True`` then ``wait()``: test_paddle_all_reduce_api.
  Paddle's bfloat16 (uint16 on the wire) has no NumPy dtype: not ported.
- collective_allgather_api.py (``all_gather(tensor_list, tensor)``): ``list(all_gather(x).reshape(n, ...))``:
  test_paddle_all_gather_api.
- collective_broadcast_api.py (src=1), collective_reduce_api.py (dst=0, the four ops),
  collective_scatter_api.py (src=1, ``scatter(tensor, tensor_list, src)``),
  collective_reduce_scatter_api.py (``reduce_scatter(tensor, tensor_list)``),
  collective_alltoall_api.py (``alltoall(in_tensor_list, out_tensor_list)``, the halves of
  each rank's input), every root: test_paddle_broadcast_reduce_scatter_api,
  test_paddle_reduce_scatter_alltoall_api.
- collective_sendrecv_api.py (rank 0 sends to rank 1): ``send``/``recv`` and a ring:
  test_paddle_sendrecv_api. collective_barrier_api.py: ``barrier(group)``, checked by files
  written before it: test_paddle_barrier_api.
- collective_allreduce_new_group_api.py (``new_group(ranks)``, ``get_rank(group)``,
  ``get_world_size(group)``): ``create_group(name, ranks)``: covered by every test's sub-group.
- Paddle's error cases: ReduceOp as Paddle's ints (dist.ReduceOp.SUM is 0 there), AVG of
  integers, a list where a tensor goes, a root outside the group, an alltoall whose rows do
  not split into one part per rank: test_paddle_errors.

OneFlow (Oneflow-Inc/oneflow python/oneflow/test/modules/test_comm_ops.py, test_comm.py):

- TestAllReduce (in place), TestAllGather (all_gather_into_tensor, all_gather to a list),
  TestBroadCast (src 1 then 0), TestScatter (src=1), TestGather (dst=1), TestReduce (dst=0,
  in place on dst), TestAllToAll (lists), TestReduceScatter (list and reduce_scatter_tensor):
  test_oneflow_comm_ops. OneFlow's all_gather_into_tensor and reduce_scatter_tensor take an
  output of any shape with the right element count ((2, 3, 2) for two (2, 3) inputs); mpicomm
  checks ``out=``'s shape and refuses it on every rank, so the port reshapes the result:
  test_oneflow_flat_shaped_out_is_refused.
- test_comm.py TestComm._test_send_recv (two sends, received with and without ``out=``):
  ``recv(out, src)``; OneFlow's ``recv(src)`` without a buffer (the shape sent as metadata)
  has no counterpart: test_oneflow_send_recv.
"""
import functools
import os
import socket
import tempfile

import numpy as np
import pytest

import mpicomm
from mpicomm import CollectiveMismatchError, InvalidArgumentError
from conftest import rank_rng, reversed_group

pytestmark = pytest.mark.mpi

SUB = "fw_rev"
UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
PADDLE_DTYPES = ["float16", "float32", "float64", "int32", "int64", "int8", "uint8", "bool"]


@pytest.fixture(scope="module")
def groups(comm):
    """(group name, its world ranks) for the groups this rank is in: the world under MindSpore's
    name for it, and the reversed sub-group."""
    sub = reversed_group(SUB)
    mine = [("nccl_world_group", list(range(comm.get_group_size())))]
    return mine + ([(SUB, sub)] if comm.get_rank() in sub else [])


def data(world_rank, key, shape, dtype="float32"):
    """World rank ``world_rank``'s array for ``key``, Paddle's value ranges (create_test_data)."""
    g = rank_rng(world_rank, key)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return g.random(shape) < 0.5
    if dt.kind in "iu":
        return g.integers(0, 12, shape).astype(dt)
    return g.random(shape).astype(dt)


def all_data(ranks, key, shape, dtype="float32"):
    return [data(w, key, shape, dtype) for w in ranks]


def reduced(parts, op):
    """The reduction of ``parts`` in their dtype (NumPy's wrap-around for integers, OR/AND for bool)."""
    if op == "avg":
        return (functools.reduce(np.add, [p.astype(np.float64) for p in parts]) / len(parts)).astype(parts[0].dtype)
    if parts[0].dtype == np.bool_:
        return functools.reduce(np.logical_or if op in ("sum", "max") else np.logical_and, parts)
    with np.errstate(over="ignore"):
        return functools.reduce(UFUNC[op], [p.copy() for p in parts])


def close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype.kind == "f":
        tol = 2e-3 if want.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def me(ranks):
    return ranks.index(mpicomm.get_rank())


# ---------------------------------------------------------------------------------------------- MindSpore


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_ms_all_reduce_op(groups, op):
    """test_nccl_all_reduce_op: three AllReduce ops of one Net, each a new array of x's shape."""
    for g, ranks in groups:
        ops = [mpicomm.ops.AllReduce(op, group=g) for _ in range(3)]
        for i, red in enumerate(ops):
            key = f"ms_ar_{op}_{g}_{i}"
            x = data(mpicomm.get_rank(), key, (3, 1, 3, 3))
            x0 = x.copy()
            out = red(x)
            close(out, reduced(all_data(ranks, key, (3, 1, 3, 3)), op))
            np.testing.assert_array_equal(x, x0)   # MindSpore's ops leave their input alone


def test_ms_all_gather_op(groups):
    """test_nccl_all_gather_op: (1, 1, 3, 3) from each rank -> (size, 1, 3, 3), group rank 0's first."""
    for g, ranks in groups:
        for shape in [(1, 1, 3, 3), (2, 5), (4,)]:
            key = f"ms_ag_{g}_{shape}"
            out = mpicomm.ops.AllGather(group=g)(data(mpicomm.get_rank(), key, shape))
            close(out, np.concatenate(all_data(ranks, key, shape)))
            assert mpicomm.get_group_size(g) == len(ranks)


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_ms_reduce_scatter_op(groups, op):
    """test_nccl_reduce_scatter_op: x of (size, 1, 3, 3); rank r gets [r:r+1] of the reduction."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        for rows in (1, 3):
            key = f"ms_rs_{op}_{g}_{rows}"
            shape = (n * rows, 1, 3, 3)
            out = mpicomm.ops.ReduceScatter(op, g)(data(mpicomm.get_rank(), key, shape))
            close(out, reduced(all_data(ranks, key, shape), op)[r * rows:(r + 1) * rows])


def test_ms_broadcast_op(groups):
    """test_nccl_broadcast_op: Broadcast(root)((x,)) for every root: a tuple of root's x, x untouched."""
    for g, ranks in groups:
        for root in range(len(ranks)):
            key = f"ms_bc_{g}_{root}"
            x = data(mpicomm.get_rank(), key, (3, 1, 3, 3))
            y = data(mpicomm.get_rank(), key + "y", (2, 4), "int32")
            x0 = x.copy()
            out = mpicomm.ops.Broadcast(root, g)((x, y))
            assert isinstance(out, tuple) and len(out) == 2
            close(out[0], data(ranks[root], key, (3, 1, 3, 3)))
            close(out[1], data(ranks[root], key + "y", (2, 4), "int32"))
            np.testing.assert_array_equal(x, x0)


def test_ms_all_to_all_op(groups):
    """test_nccl_all_to_all_op (split_count = size, split_dim = concat_dim = 0) and test_comm's
    AlltoAll(count, 0, 1): part j of split_dim goes to rank j, the parts received are joined
    along concat_dim, group rank 0's first."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        for sd, cd, shape in [(0, 0, (8 * n,)), (0, 1, (2 * n, 3)), (1, 0, (2, 3 * n)), (2, 1, (2, 3, n))]:
            key = f"ms_a2a_{g}_{sd}{cd}"
            out = mpicomm.ops.AlltoAll(split_count=n, split_dim=sd, concat_dim=cd, group=g)(
                data(mpicomm.get_rank(), key, shape))
            parts = [np.split(p, n, axis=sd)[r] for p in all_data(ranks, key, shape)]
            close(out, np.concatenate(parts, axis=cd))


def test_ms_neighbor_exchange(groups):
    """test_nccl_neighbor_exchange_op: each rank sends to rank-1 and receives from rank+1 (of 8 there,
    of the group here): sendrecv; and two neighbours at once (send_rank_ids=[r-1, r+1],
    recv_rank_ids=[r+1, r-1]) in one batch, and through ``ops.NeighborExchange`` itself."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        key = f"ms_nx_{g}"
        x = data(mpicomm.get_rank(), key, (8,))
        got = mpicomm.sendrecv(x, (r - 1) % n, src=(r + 1) % n, group=g)
        close(got, data(ranks[(r + 1) % n], key, (8,)))
        a = np.empty(8, np.float32)
        b = np.empty(8, np.float32)
        with mpicomm.batch(group=g):
            mpicomm.send(x, (r - 1) % n, group=g, tag=1)
            mpicomm.send(x, (r + 1) % n, group=g, tag=2)
            mpicomm.recv(a, (r + 1) % n, group=g, tag=1)
            mpicomm.recv(b, (r - 1) % n, group=g, tag=2)
        close(a, data(ranks[(r + 1) % n], key, (8,)))
        close(b, data(ranks[(r - 1) % n], key, (8,)))
        # MindSpore's own operator: a different shape to each neighbour
        y = data(mpicomm.get_rank(), key + "_y", (2, 3))
        if n >= 3:
            nx = mpicomm.ops.NeighborExchange([(r - 1) % n, (r + 1) % n], [(r + 1) % n, (r - 1) % n],
                                              ([8], [2, 3]), ([8], [2, 3]), np.float32, g)
            got = nx((x, y))
            assert isinstance(got, tuple) and [a.shape for a in got] == [(8,), (2, 3)]
            close(got[0], data(ranks[(r + 1) % n], key, (8,)))
            close(got[1], data(ranks[(r - 1) % n], key + "_y", (2, 3)))
        else:   # one peer: the other rank, or this one in a group of one
            other = (r + 1) % n
            got = mpicomm.ops.NeighborExchange([other], [other], ([2, 3],), ([2, 3],), "float32", g)((y,))
            close(got[0], data(ranks[other], key + "_y", (2, 3)))


def test_ms_send_recv_op(groups):
    """test_nccl_send_recv_op: rank r < size//2 sends to r + size//2 (sr_tag 0); the receiver
    builds its buffer from Receive's shape and dtype. With an odd size the last rank pairs with
    itself (sendrecv), as does the one rank of a group of one."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        h = n // 2
        key = f"ms_sr_{g}"
        x = data(mpicomm.get_rank(), key, (3, 3, 3, 3))
        if r < h:
            mpicomm.send(x, r + h, group=g, tag=0)
        elif r < 2 * h:
            out = mpicomm.recv(np.empty((3, 3, 3, 3), np.float32), r - h, group=g, tag=0)
            close(out, data(ranks[r - h], key, (3, 3, 3, 3)))
        else:
            out = mpicomm.sendrecv(x, r, out=np.empty((3, 3, 3, 3), np.float32), group=g, tag=5)
            close(out, x)


@pytest.mark.parametrize("mean", [False, True])
def test_ms_grad_reducer(groups, mean):
    """test_nccl_lenet's data parallelism: DistributedGradReducer(params, mean)(grads) returns the
    sum (MindSpore's default) or the mean of every rank's gradients, new arrays, in their shapes."""
    shapes = [(6, 3, 5, 5), (6,), (120, 40), (10,)]
    for g, ranks in groups:
        params = [np.zeros(s, np.float32) for s in shapes]
        red = mpicomm.DistributedGradReducer(params, mean, group=g)
        for step in range(2):
            keys = [f"ms_gr_{g}_{mean}_{step}_{i}" for i in range(len(shapes))]
            grads = [data(mpicomm.get_rank(), k, s) for k, s in zip(keys, shapes)]
            out = red(grads)
            for k, s, o in zip(keys, shapes, out):
                parts = all_data(ranks, k, s)
                want = reduced(parts, "avg") if mean else reduced(parts, "sum")
                close(o, want)


def test_ms_management_api(groups):
    """mindspore.communication: ranks and sizes of the world by each of its names, local ranks
    (one host here: the group's rank order), rank translation both ways on members and
    non-members, create_group / destroy_group and the same name made again."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for name in (None, "nccl_world_group", "hccl_world_group", mpicomm.GlobalComm.WORLD_COMM_GROUP,
                 mpicomm.NCCL_WORLD_COMM_GROUP, mpicomm.HCCL_WORLD_COMM_GROUP):
        assert mpicomm.get_rank(name) == r and mpicomm.get_group_size(name) == n
        assert mpicomm.get_local_rank(name) == mpicomm.get_local_rank()
        assert mpicomm.get_local_rank_size(name) == mpicomm.get_local_rank_size()
        assert mpicomm.get_world_rank_from_group_rank(name, n - 1) == n - 1
        assert mpicomm.get_process_group_ranks(name) == list(range(n))
    assert mpicomm.NCCL_WORLD_COMM_GROUP == "nccl_world_group"
    assert mpicomm.HCCL_WORLD_COMM_GROUP == "hccl_world_group"
    hosts = mpicomm.all_gather_object(socket.gethostname())   # the world ranks on this host, in order
    here = [w for w in range(n) if hosts[w] == hosts[r]]
    assert (mpicomm.get_local_rank(), mpicomm.get_local_rank_size()) == (here.index(r), len(here))
    sub = reversed_group(SUB)
    for gr, w in enumerate(sub):   # on every rank, members or not (MindSpore's test_group_funs)
        assert mpicomm.get_world_rank_from_group_rank(SUB, gr) == w
        assert mpicomm.get_group_rank_from_world_rank(w, SUB) == gr
    assert mpicomm.get_process_group_ranks(SUB) == sub
    if r in sub:
        assert mpicomm.get_rank(SUB) == sub.index(r) and mpicomm.get_group_size(SUB) == len(sub)
        sub_here = [w for w in sub if w in here]   # group rank order of the members on this host
        assert mpicomm.get_local_rank(SUB) == sub_here.index(r) and mpicomm.get_local_rank_size(SUB) == len(sub_here)
    # create, use, destroy, create again (only the members call it, as MindSpore's users do)
    odd = [w for w in range(n) if w % 2 == 1] or [0]
    for rnd in range(2):
        if r in odd:
            mpicomm.create_group("ms_odd", odd)
            key = f"ms_mgmt_{rnd}"
            got = mpicomm.all_reduce(data(r, key, (5,)), "sum", group="ms_odd")
            close(got, reduced(all_data(odd, key, (5,)), "sum"))
            mpicomm.destroy_group("ms_odd")
        with pytest.raises(InvalidArgumentError, match="ms_odd"):
            mpicomm.get_rank("ms_odd")   # gone (never made on the others)


def _raises_everywhere(fn, match, group=None, exc=InvalidArgumentError):
    """``fn`` raises ``exc`` here; every rank of ``group`` checks that it raised (no rank went on)."""
    with pytest.raises(exc, match=match) as e:
        fn()
    assert isinstance(e.value, ValueError)   # what MindSpore's and Paddle's tests catch
    assert mpicomm.all_gather_object(True, group=group) == [True] * mpicomm.get_group_size(group)


def test_ms_neighbor_exchange_errors(comm):
    """NeighborExchange's argument checks (MindSpore's: the lists' lengths, each rank once, the
    input's shapes), refused before anything is sent, on every rank that makes the call."""
    n = mpicomm.get_group_size()
    x = data(mpicomm.get_rank(), "ms_nx_err", (2, 3))
    NX = mpicomm.ops.NeighborExchange
    _raises_everywhere(lambda: NX([0, 0], [0], ([1],), ([1], [1]), np.float32), "send_rank_ids=.*each rank at most once")
    _raises_everywhere(lambda: NX([0], [0], ([1], [2]), ([1],), np.float32), "recv_shapes=.*one for each rank")
    _raises_everywhere(lambda: NX([0], [0], ([1],), [[-1]], np.float32), "send_shapes=")
    _raises_everywhere(lambda: NX(["0"], [0], ([1],), ([1],), np.float32), "send_rank_ids=")
    _raises_everywhere(lambda: NX([0], [0], ([2, 3],), ([2, 3],), np.float32)(x), "x=<.*ndarray>.*a tuple of 1")
    _raises_everywhere(lambda: NX([0], [0], ([2, 3],), ([3, 2],), np.float32)((x,)), r"x\[0\].shape=\(2, 3\)")
    _raises_everywhere(lambda: NX([n], [0], ([2, 3],), ([2, 3],), np.float32)((x,)), "send_rank_ids=.*0\\.\\.")
    _raises_everywhere(lambda: NX([0], [0], ([2, 3],), ([2, 3],), "no-such-type")((x,)), "recv_type=")


def test_ms_management_errors(comm):
    """test_management_api.test_raise_error_funcs, the cases that mean the same here."""
    _raises_everywhere(lambda: mpicomm.get_group_size(123), "group=123")
    _raises_everywhere(lambda: mpicomm.create_group("0-1", [0, 0]), "duplicated")
    _raises_everywhere(lambda: mpicomm.create_group("hccl_world_group", [0]), "world")
    _raises_everywhere(lambda: mpicomm.create_group("0-1", [0, mpicomm.get_group_size()]), "out of range")
    _raises_everywhere(lambda: mpicomm.destroy_group(mpicomm.HCCL_WORLD_COMM_GROUP), "cannot be destroyed")
    _raises_everywhere(lambda: mpicomm.destroy_group("0-1"), "0-1")
    sub = reversed_group(SUB)
    _raises_everywhere(lambda: mpicomm.get_world_rank_from_group_rank(SUB, "0"), "group_rank_id")
    _raises_everywhere(lambda: mpicomm.get_world_rank_from_group_rank(SUB, len(sub)), "group_rank_id")
    _raises_everywhere(lambda: mpicomm.get_group_rank_from_world_rank("0", SUB), "world_rank_id")
    outside = [w for w in range(mpicomm.get_group_size()) if w not in sub]
    if outside:
        _raises_everywhere(lambda: mpicomm.get_group_rank_from_world_rank(outside[0], SUB), "world_rank_id")
    _raises_everywhere(lambda: mpicomm.get_world_rank_from_group_rank("0-1", 0), "0-1")
    _raises_everywhere(lambda: mpicomm.get_process_group_ranks("0-1"), "group='0-1'")


def test_ms_op_errors(groups):
    """MindSpore's op checks: raised on every rank of the group, and its next call is right."""
    for g, ranks in groups:
        n = len(ranks)
        x = data(mpicomm.get_rank(), f"ms_err_{g}", (n, 4))
        _raises_everywhere(lambda: mpicomm.ops.AllReduce("mean_of_squares", g), "op=", group=g)
        _raises_everywhere(lambda: mpicomm.ops.ReduceScatter("avgg", g), "op=", group=g)
        _raises_everywhere(lambda: mpicomm.all_reduce(x, "foo", group=g), "op=", group=g)
        _raises_everywhere(lambda: mpicomm.ops.ReduceScatter("sum", g)(np.ones((n + 1, 2) if n > 1 else (), np.float32)),
                           "divisible by the group size", group=g)
        _raises_everywhere(lambda: mpicomm.ops.AlltoAll(n + 1, 0, 0, g)(np.ones(n * (n + 1), np.float32)),
                           "split_count", group=g)
        _raises_everywhere(lambda: mpicomm.ops.AlltoAll(n, 0, 0, g)(np.ones(n + 1, np.float32)) if n > 1
                           else mpicomm.ops.AlltoAll(n, 3, 0, g)(np.ones(2, np.float32)), "x.shape|split_dim", group=g)
        _raises_everywhere(lambda: mpicomm.ops.Broadcast(n, g)((x,)), "root", group=g)
        _raises_everywhere(lambda: mpicomm.ops.Broadcast(-1, g)((x,)), "root", group=g)
        if n > 1:   # another trailing shape on odd group ranks (the same element count)
            shape = (2, 6) if me(ranks) % 2 else (3, 4)
            with pytest.raises(CollectiveMismatchError, match="shape"):
                mpicomm.ops.AllGather(g)(np.zeros(shape, np.float32))
        key = f"ms_err_after_{g}"
        close(mpicomm.ops.AllGather(g)(data(mpicomm.get_rank(), key, (2,))), np.concatenate(all_data(ranks, key, (2,))))


# ---------------------------------------------------------------------------------------------- Paddle


@pytest.mark.parametrize("dtype", PADDLE_DTYPES)
def test_paddle_all_reduce_api(groups, dtype):
    """collective_allreduce_api(_dygraph): paddle.distributed.all_reduce(tensor, op) in place, for
    Paddle's dtypes and ReduceOp SUM, MAX, MIN, PROD (and AVG of floats); sync_op=False."""
    ops = ["sum", "max", "min", "prod"] + (["avg"] if dtype.startswith("float") else [])
    for g, ranks in groups:
        for op in ops:
            key = f"pd_ar_{dtype}_{op}_{g}"
            x = data(mpicomm.get_rank(), key, (10, 100), dtype)
            assert mpicomm.all_reduce(x, op, out=x, group=g) is x
            close(x, reduced(all_data(ranks, key, (10, 100), dtype), op))
        key = f"pd_ar_async_{dtype}_{g}"
        x = data(mpicomm.get_rank(), key, (10, 100), dtype)
        task = mpicomm.all_reduce(x, mpicomm.ReduceOp.SUM, out=x, group=g, async_op=True)
        task.wait()
        close(x, reduced(all_data(ranks, key, (10, 100), dtype), "sum"))


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "float16"])
def test_paddle_all_gather_api(groups, dtype):
    """collective_allgather_api: all_gather(tensor_list, tensor); the test vstacks the list."""
    for g, ranks in groups:
        n = len(ranks)
        key = f"pd_ag_{dtype}_{g}"
        x = data(mpicomm.get_rank(), key, (10, 100), dtype)
        tensor_list = list(mpicomm.all_gather(x, group=g).reshape(n, *x.shape))
        assert len(tensor_list) == n
        for got, want in zip(tensor_list, all_data(ranks, key, (10, 100), dtype)):
            close(got, want)


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "bool"])
def test_paddle_broadcast_reduce_scatter_api(groups, dtype):
    """collective_broadcast_api (src=1), collective_reduce_api (dst=0; SUM, MAX, MIN, PROD), and
    collective_scatter_api (src=1; tensor_list the rows of the root's input), from every root:
    broadcast in place; reduce in place on the root (``out=x``), the others' x untouched;
    scatter into the other ranks' ``out=``."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        for root in range(n):
            key = f"pd_bc_{dtype}_{g}_{root}"
            x = data(mpicomm.get_rank(), key, (10, 100), dtype)
            mpicomm.broadcast(x, root, group=g)
            close(x, data(ranks[root], key, (10, 100), dtype))
            for op in ["sum", "max", "min", "prod"]:
                key = f"pd_red_{dtype}_{g}_{root}_{op}"
                x = data(mpicomm.get_rank(), key, (10, 100), dtype)
                x0 = x.copy()
                res = mpicomm.reduce(x, op, root, out=x, group=g)
                if r == root:
                    assert res is x
                    close(x, reduced(all_data(ranks, key, (10, 100), dtype), op))
                else:
                    assert res is None
                    close(x, x0)
            key = f"pd_sc_{dtype}_{g}_{root}"
            full = data(mpicomm.get_rank(), key, (2 * n, 100), dtype)
            sub = full[:2].copy()       # paddle.split(tindata, n)[0], the output on every rank
            tensor_list = np.split(full, n)
            mpicomm.scatter(np.concatenate(tensor_list) if r == root else None, root, out=sub, group=g)
            close(sub, np.split(data(ranks[root], key, (2 * n, 100), dtype), n)[r])


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_paddle_reduce_scatter_alltoall_api(groups, op):
    """collective_reduce_scatter_api: reduce_scatter(tensor, [part_0, ..., part_n-1]) into tensor;
    collective_alltoall_api: alltoall(in_tensor_list, out_tensor_list), out[i] = rank i's in[r]."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        key = f"pd_rs_{op}_{g}"
        x = data(mpicomm.get_rank(), key, (2 * n, 100))
        parts = np.split(x, n)
        tensor = parts[0].copy()
        mpicomm.reduce_scatter(np.concatenate(parts), op, out=tensor, group=g)
        close(tensor, np.split(reduced(all_data(ranks, key, (2 * n, 100)), op), n)[r])
        key = f"pd_a2a_{g}"
        in_list = np.split(data(mpicomm.get_rank(), key, (2 * n, 100)), n)
        out_list = np.split(mpicomm.all_to_all(np.concatenate(in_list), group=g), n)
        for i, got in enumerate(out_list):
            close(got, np.split(data(ranks[i], key, (2 * n, 100)), n)[r])


def test_paddle_sendrecv_api(groups):
    """collective_sendrecv_api: rank 0 sends, rank 1 receives into a tensor of the shape (2 ranks
    upstream); here every pair (0, 1), (2, 3) of the group, and a ring with sendrecv."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        key = f"pd_sr_{g}"
        x = data(mpicomm.get_rank(), key, (10, 100))
        if r % 2 == 0 and r + 1 < n:
            mpicomm.send(x, r + 1, group=g)
        elif r % 2 == 1:
            out = mpicomm.recv(np.zeros((10, 100), np.float32), r - 1, group=g)
            close(out, data(ranks[r - 1], key, (10, 100)))
        got = mpicomm.sendrecv(x, (r + 1) % n, src=(r - 1) % n, group=g)
        close(got, data(ranks[(r - 1) % n], key, (10, 100)))


def test_paddle_barrier_api(groups):
    """collective_barrier_api: paddle.distributed.barrier(group): every member's file, written
    before the barrier, is there after it."""
    for g, ranks in groups:
        d = os.path.join(tempfile.gettempdir(), f"mpicomm_fw_barrier_{os.environ.get('OMPI_COMM_WORLD_SIZE', '1')}"
                         f"_{mpicomm.broadcast_object(os.getpid(), 0, group=g)}_{g}")
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, str(mpicomm.get_rank())), "w").close()
        assert mpicomm.barrier(group=g) is None
        assert sorted(int(f) for f in os.listdir(d)) == sorted(ranks)
        mpicomm.barrier(group=g)
        os.remove(os.path.join(d, str(mpicomm.get_rank())))


def test_paddle_errors(groups):
    """Paddle's ReduceOp ints (dist.ReduceOp.MAX == 1), AVG of an integer tensor, a tensor list
    where one tensor goes, a root outside the group, alltoall rows that do not split into one
    part per rank: InvalidArgumentError (a ValueError, as Paddle raises) on every rank."""
    for g, ranks in groups:
        n = len(ranks)
        x = data(mpicomm.get_rank(), f"pd_err_{g}", (2 * n, 3))
        xi = x.astype(np.int32)
        _raises_everywhere(lambda: mpicomm.all_reduce(x, 1, group=g), "op=1", group=g)
        _raises_everywhere(lambda: mpicomm.all_reduce(xi, "avg", group=g), "AVG", group=g)
        _raises_everywhere(lambda: mpicomm.reduce(xi, mpicomm.ReduceOp.AVG, 0, group=g), "AVG", group=g)
        _raises_everywhere(lambda: mpicomm.all_gather([x] * n, group=g), "list", group=g)
        _raises_everywhere(lambda: mpicomm.all_to_all(list(np.split(x, n)), group=g), "list", group=g)
        _raises_everywhere(lambda: mpicomm.broadcast(x, n, group=g), "root", group=g)
        _raises_everywhere(lambda: mpicomm.reduce(x, "sum", n, group=g), "root", group=g)
        _raises_everywhere(lambda: mpicomm.scatter(x, n, out=x[:2].copy(), group=g), "root", group=g)
        if n > 1:
            _raises_everywhere(lambda: mpicomm.all_to_all(np.ones((n + 1, 3), np.float32), group=g), "x", group=g)
        key = f"pd_err_after_{g}"
        got = mpicomm.all_reduce(data(mpicomm.get_rank(), key, (4,)), group=g)
        close(got, reduced(all_data(ranks, key, (4,)), "sum"))


# ---------------------------------------------------------------------------------------------- OneFlow


def test_oneflow_comm_ops(groups):
    """test_comm_ops.py: flow.comm's calls, each as its port writes it."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        me_w = mpicomm.get_rank()
        # TestAllReduce: flow.comm.all_reduce(tensor), in place
        key = f"of_ar_{g}"
        t = data(me_w, key, (2, 2), "int64")
        mpicomm.all_reduce(t, out=t, group=g)
        close(t, reduced(all_data(ranks, key, (2, 2), "int64"), "sum"))
        # TestAllGather: all_gather_into_tensor(out (n*2, 3), in (2, 3)), and all_gather to a list
        key = f"of_ag_{g}"
        tin = data(me_w, key, (2, 3), "int64")
        tout = np.zeros((2 * n, 3), np.int64)
        assert mpicomm.all_gather(tin, out=tout, group=g) is tout
        close(tout, np.concatenate(all_data(ranks, key, (2, 3), "int64")))
        close(mpicomm.all_gather(tin, group=g).reshape(n, 3, 2), tout.reshape(n, 3, 2))   # out (n, 3, 2)
        tensor_list = list(mpicomm.all_gather(tin, group=g).reshape(n, 2, 3))
        for got, want in zip(tensor_list, all_data(ranks, key, (2, 3), "int64")):
            close(got, want)
        # TestBroadCast: src 1 then 0 (every root here), in place
        for root in reversed(range(n)):
            key = f"of_bc_{g}_{root}"
            t = data(me_w, key, (2, 2), "int32")
            mpicomm.broadcast(t, root, group=g)
            close(t, data(ranks[root], key, (2, 2), "int32"))
        # TestScatter: scatter(output, tensor_list, src=1); TestGather: gather(input, gather_list, dst=1)
        src = 1 % n
        key = f"of_sc_{g}"
        output = np.zeros((2, 2), np.int64)
        tensor_list = [data(me_w, f"{key}_{i}", (2, 2), "int64") for i in range(n)]
        mpicomm.scatter(np.concatenate(tensor_list) if r == src else None, src, out=output, group=g)
        close(output, data(ranks[src], f"{key}_{r}", (2, 2), "int64"))
        key = f"of_ga_{g}"
        got = mpicomm.gather(data(me_w, key, (2, 2), "int32"), root=src, group=g)
        if r == src:
            for got_i, want in zip(list(got.reshape(n, 2, 2)), all_data(ranks, key, (2, 2), "int32")):
                close(got_i, want)
        else:
            assert got is None
        # TestReduce: reduce(tensor, 0), in place on dst, the others' tensor as it was
        key = f"of_red_{g}"
        t = data(me_w, key, (2, 2), "int32")
        t0 = t.copy()
        mpicomm.reduce(t, root=0, out=t, group=g)
        close(t, reduced(all_data(ranks, key, (2, 2), "int32"), "sum") if r == 0 else t0)
        # TestAllToAll: all_to_all(output_list, input_list): output_list[i] is rank i's input_list[r]
        key = f"of_a2a_{g}"
        input_list = [data(me_w, f"{key}_{i}", (2,), "int64") for i in range(n)]
        output_list = np.split(mpicomm.all_to_all(np.concatenate(input_list), group=g), n)
        for i, got in enumerate(output_list):
            close(got, data(ranks[i], f"{key}_{r}", (2,), "int64"))
        # TestReduceScatter: reduce_scatter(output, tensor_list) and reduce_scatter_tensor(out, in)
        key = f"of_rs_{g}"
        tensor_list = [data(me_w, f"{key}_{i}", (2, 2), "int64") for i in range(n)]
        output = np.zeros((2, 2), np.int64)
        mpicomm.reduce_scatter(np.concatenate(tensor_list), out=output, group=g)
        close(output, reduced([data(w, f"{key}_{r}", (2, 2), "int64") for w in ranks], "sum"))
        tin = data(me_w, key + "t", (2 * n, 3), "int64")
        tout = np.zeros((2, 3), np.int64)
        mpicomm.reduce_scatter(tin, out=tout, group=g)
        close(tout, np.split(reduced(all_data(ranks, key + "t", (2 * n, 3), "int64"), "sum"), n)[r])
        tout2 = mpicomm.reduce_scatter(tin.reshape(n, 3, 2), group=g).reshape(2, 3)   # in of (n, 3, 2)
        close(tout2, tout)


def test_oneflow_flat_shaped_out_is_refused(groups):
    """OneFlow's all_gather_into_tensor(out (n, 3, 2), in (2, 3)) and reduce_scatter_tensor(out
    (2, 3), in (n, 3, 2)) fill any output of the right element count; mpicomm's out= must have
    the result's shape, and another one is refused on every rank, naming the shape expected."""
    for g, ranks in groups:
        n = len(ranks)
        tin = np.arange(6, dtype=np.int64).reshape(2, 3)
        _raises_everywhere(lambda: mpicomm.all_gather(tin, out=np.zeros((n, 3, 2), np.int64), group=g),
                           r"out.shape.*expected shape \(%d, 3\)" % (2 * n), group=g)
        _raises_everywhere(lambda: mpicomm.reduce_scatter(np.ones((n, 3, 2), np.int64), out=np.zeros((2, 3), np.int64),
                                                          group=g), r"out.shape.*expected shape \(1, 3, 2\)", group=g)


def test_oneflow_send_recv(groups):
    """test_comm.py _test_send_recv: src sends x twice; dst receives both (OneFlow: recv(src) makes
    the tensor from the metadata sent, recv(src, out=x2) fills x2; mpicomm: recv(out, src) both
    times). Pairs (src, dst) = (1, 0), (n-1, 1), (0, n-1) of the group, as the 2- and 4-device tests."""
    for g, ranks in groups:
        n, r = len(ranks), me(ranks)
        for src, dst in {(1 % n, 0), ((n - 1), 1 % n), (0, n - 1)}:
            if src == dst:
                continue
            key = f"of_sr_{g}_{src}_{dst}"
            x0 = data(ranks[src], key, (1, 2), "int64")
            if r == src:
                mpicomm.send(x0, dst, group=g)
                mpicomm.send(x0, dst, group=g)
            elif r == dst:
                x1 = mpicomm.recv(np.empty((1, 2), np.int64), src, group=g)
                close(x1, x0)
                x2 = np.zeros_like(x0)
                assert mpicomm.recv(x2, src, group=g) is x2
                close(x2, x0)
        mpicomm.barrier(group=g)
