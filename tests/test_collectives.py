"""Every collective x op x representative dtypes x (world, sub-group) x (sync, async),
checked against expectations computed independently with NumPy from every rank's
rank-seeded data. The same tests run on GPU arrays (CuPy, PyTorch) under NCCL."""
import zlib

import ml_dtypes
import numpy as np
import pytest

import mpicomm
from mpicomm import ReduceOp
from conftest import reversed_group

pytestmark = pytest.mark.mpi

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.int8, np.uint8, np.int32, np.int64, np.float16, BF16, np.float32, np.float64,
          np.complex64, np.complex128]
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]


def allowed(op, dt):
    dt = np.dtype(dt)
    if dt.kind == "c":
        return op in (ReduceOp.SUM, ReduceOp.AVG)
    if op is ReduceOp.AVG:
        return dt.kind == "f" or dt == BF16
    return True


def data(rank, key, shape, dt, op=ReduceOp.SUM):
    """Rank-dependent random data, small enough that PROD and SUM stay exact in the dtype."""
    g = np.random.default_rng([rank, zlib.crc32(key.encode())])
    dt = np.dtype(dt)
    if op is ReduceOp.PROD:
        v = g.choice(np.array([1, 2, -1, 3] if dt.kind != "u" else [1, 2, 3]), size=shape)
    elif dt.kind in "iu":
        v = g.integers(0 if dt.kind == "u" else -20, 21, size=shape)
    else:
        v = g.integers(-64, 65, size=shape) / 4.0  # exactly representable even in bfloat16
    if dt.kind == "c":
        w = g.integers(-64, 65, size=shape) / 4.0
        return (v + 1j * w).astype(dt)
    return v.astype(dt)


def reduce_np(arrs, op):
    """The expectation, computed in float64/int64 then cast (what the dtype can hold)."""
    dt = arrs[0].dtype
    wide = np.complex128 if dt.kind == "c" else (np.float64 if dt.kind in "fV" or dt == BF16 else np.int64)
    s = np.stack([a.astype(wide) for a in arrs])
    r = {ReduceOp.SUM: lambda: s.sum(0), ReduceOp.PROD: lambda: s.prod(0), ReduceOp.MIN: lambda: s.min(0),
         ReduceOp.MAX: lambda: s.max(0), ReduceOp.AVG: lambda: s.sum(0) / len(arrs)}[op]()
    return r.astype(dt)


def close(a, b, dt):
    dt = np.dtype(dt)
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if dt.kind in "iu":
        np.testing.assert_array_equal(a, b)
    else:
        tol = {2: 1e-2}.get(dt.itemsize, 1e-6)
        wide = np.complex128 if dt.kind == "c" else np.float64
        np.testing.assert_allclose(a.astype(wide), b.astype(wide), rtol=tol, atol=tol)


# -------------------------------------------------------------------- array kinds

@pytest.fixture(scope="module")
def subgroup(comm):
    reversed_group("rev")
    return "rev"


def members(group):
    n = mpicomm.get_group_size()
    if group is None:
        return list(range(n))
    return list(mpicomm._state.CTX.groups[group].ranks)


def in_group(group):
    return mpicomm.get_rank() in members(group)


def outside(group, fn):
    """On a rank outside the group: using the group is refused, naming it (asserted here so
    that the test asserts on every rank)."""
    with pytest.raises(mpicomm.InvalidArgumentError, match="a group this rank belongs to"):
        fn(np.ones(2 * mpicomm.get_group_size(), np.float32), group=group)


def refused_op(fn, op, dt, **kw):
    """An op the dtype does not allow is refused, naming op (on every rank)."""
    with pytest.raises(mpicomm.InvalidArgumentError, match="op"):
        fn(data(0, "x", (2 * mpicomm.get_group_size(),), dt), op, **kw)


GROUPS = ["world", "sub"]


def pick(which, subgroup):
    return None if which == "world" else subgroup


def run(fn, async_op, *a, **kw):
    if async_op:
        w = fn(*a, async_op=True, **kw)
        assert isinstance(w, mpicomm.Work)
        r = w.wait()
        assert w.is_completed()
        return r
    return fn(*a, **kw)


# -------------------------------------------------------------------- tests

@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
def test_all_reduce(comm, subgroup, op, dt, which, async_op, request):
    group = pick(which, subgroup)
    if not allowed(op, dt):
        with pytest.raises(mpicomm.InvalidArgumentError, match="op"):
            mpicomm.all_reduce(data(0, "x", (3,), dt), op)
        return
    if not in_group(group):
        return outside(group, mpicomm.all_reduce)
    key = request.node.name
    shape = (5, 3)
    world = members(group)
    x = data(mpicomm.get_rank(), key, shape, dt, op)
    exp = reduce_np([data(r, key, shape, dt, op) for r in world], op)
    out = run(mpicomm.all_reduce, async_op, x, op, group=group)
    close(out, exp, dt)
    np.testing.assert_array_equal(x, data(mpicomm.get_rank(), key, shape, dt, op))  # input untouched
    y = x.copy()  # in place
    r = run(mpicomm.all_reduce, async_op, y, op, out=y, group=group)
    assert r is y
    close(y, exp, dt)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.int8, np.int64, BF16, np.float32, np.complex128], ids=lambda d: np.dtype(d).name)
def test_all_gather(comm, subgroup, dt, which, async_op, request):
    group = pick(which, subgroup)
    if not in_group(group):
        return outside(group, mpicomm.all_gather)
    key = request.node.name
    world = members(group)
    x = data(mpicomm.get_rank(), key, (2, 3), dt)
    exp = np.concatenate([data(r, key, (2, 3), dt) for r in world])
    close(run(mpicomm.all_gather, async_op, x, group=group), exp, dt)
    out = np.empty_like(exp)
    assert run(mpicomm.all_gather, async_op, x, out=out, group=group) is out
    close(out, exp, dt)


def test_all_gather_mindspore_example(comm):
    """[[rank]] over n ranks gives [[0], [1], ..., [n-1]], as MindSpore's AllGather does."""
    n = mpicomm.get_group_size()
    out = mpicomm.AllGather()(np.array([[mpicomm.get_rank()]], np.float32))
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32).reshape(n, 1))


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.uint8, np.int32, np.float16, np.float64, np.complex64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
def test_reduce_scatter(comm, subgroup, op, dt, which, async_op, request):
    group = pick(which, subgroup)
    if not allowed(op, dt):
        return refused_op(mpicomm.reduce_scatter, op, dt)
    if not in_group(group):
        return outside(group, mpicomm.reduce_scatter)
    key = request.node.name
    world = members(group)
    n = len(world)
    shape = (2 * n, 3)
    x = data(mpicomm.get_rank(), key, shape, dt, op)
    full = reduce_np([data(r, key, shape, dt, op) for r in world], op)
    me = mpicomm.get_rank(group)
    close(run(mpicomm.reduce_scatter, async_op, x, op, group=group), full[2 * me:2 * me + 2], dt)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.int8, np.int64, BF16, np.float32], ids=lambda d: np.dtype(d).name)
def test_broadcast(comm, subgroup, dt, which, async_op, request):
    group = pick(which, subgroup)
    if not in_group(group):
        return outside(group, mpicomm.broadcast)
    key = request.node.name
    world = members(group)
    for root in range(len(world)):
        x = data(mpicomm.get_rank(), key + str(root), (4, 2), dt)
        r = run(mpicomm.broadcast, async_op, x, root=root, group=group)
        assert r is x
        close(x, data(world[root], key + str(root), (4, 2), dt), dt)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.int32, np.float32, BF16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG], ids=lambda o: o.value)
def test_reduce(comm, subgroup, op, dt, which, async_op, request):
    group = pick(which, subgroup)
    if not allowed(op, dt):
        return refused_op(mpicomm.reduce, op, dt)
    if not in_group(group):
        return outside(group, mpicomm.reduce)
    key = request.node.name
    world = members(group)
    root = len(world) - 1
    x = data(mpicomm.get_rank(), key, (3, 3), dt, op)
    r = run(mpicomm.reduce, async_op, x, op, root=root, group=group)
    if mpicomm.get_rank(group) == root:
        close(r, reduce_np([data(w, key, (3, 3), dt, op) for w in world], op), dt)
    else:
        assert r is None


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.uint8, np.int64, np.float32, np.complex128], ids=lambda d: np.dtype(d).name)
def test_all_to_all(comm, subgroup, dt, which, async_op, request):
    group = pick(which, subgroup)
    if not in_group(group):
        return outside(group, mpicomm.all_to_all)
    key = request.node.name
    world = members(group)
    n, me = len(world), mpicomm.get_rank(group)
    x = data(mpicomm.get_rank(), key, (2 * n, 3), dt)
    exp = np.concatenate([data(w, key, (2 * n, 3), dt)[2 * me:2 * me + 2] for w in world])
    close(run(mpicomm.all_to_all, async_op, x, group=group), exp, dt)
    close(mpicomm.AlltoAll(group=group)(x), exp, dt)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_send_recv_ring(comm, async_op, request):
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    x = data(me, key, (7,), np.float64)
    out = np.empty(7)
    dst, src = (me + 1) % n, (me - 1) % n
    if me % 2 == 0:
        run(mpicomm.send, async_op, x, dst)
        run(mpicomm.recv, async_op, out, src)
    else:
        run(mpicomm.recv, async_op, out, src)
        run(mpicomm.send, async_op, x, dst)
    np.testing.assert_array_equal(out, data(src, key, (7,), np.float64))


@pytest.mark.parametrize("shape", [(0,), (0, 4), (1,), (13,), (3, 5, 7)], ids=str)
def test_odd_and_zero_sizes(comm, shape, request):
    n = mpicomm.get_group_size()
    key = request.node.name
    x = data(mpicomm.get_rank(), key, shape, np.int32)
    np.testing.assert_array_equal(mpicomm.all_reduce(x), reduce_np([data(r, key, shape, np.int32)
                                                                    for r in range(n)], ReduceOp.SUM))
    g = mpicomm.all_gather(x)
    assert g.shape == ((n * shape[0],) + shape[1:])


def test_non_contiguous_input_is_copied(comm, request):
    n = mpicomm.get_group_size()
    key = request.node.name
    base = data(mpicomm.get_rank(), key, (6, 4), np.float64)
    x = base[:, ::2]  # non-contiguous view
    assert not x.flags.c_contiguous
    exp = sum(data(r, key, (6, 4), np.float64)[:, ::2] for r in range(n))
    np.testing.assert_allclose(mpicomm.all_reduce(x), exp)


def test_mindspore_ops(comm, request):
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    x = data(me, key, (2 * n,), np.float32)
    allx = [data(r, key, (2 * n,), np.float32) for r in range(n)]
    close(mpicomm.AllReduce()(x), reduce_np(allx, ReduceOp.SUM), np.float32)
    close(mpicomm.AllReduce(ReduceOp.MAX)(x), reduce_np(allx, ReduceOp.MAX), np.float32)
    close(mpicomm.ReduceScatter("sum")(x), reduce_np(allx, ReduceOp.SUM)[2 * me:2 * me + 2], np.float32)
    a, b = data(me, key + "a", (3,), np.int32), data(me, key + "b", (2,), np.float64)
    out = mpicomm.Broadcast(0)((a, b))
    assert isinstance(out, tuple) and len(out) == 2
    ra, rb = out
    np.testing.assert_array_equal(ra, data(0, key + "a", (3,), np.int32))
    np.testing.assert_array_equal(rb, data(0, key + "b", (2,), np.float64))
    # MindSpore's Broadcast leaves its inputs as they were, on every rank
    np.testing.assert_array_equal(a, data(me, key + "a", (3,), np.int32))
    np.testing.assert_array_equal(b, data(me, key + "b", (2,), np.float64))
    c = data(me, key + "c", (2, 3), np.float32)
    rc = mpicomm.Broadcast(n - 1)(c)
    np.testing.assert_array_equal(rc, data(n - 1, key + "c", (2, 3), np.float32))
    np.testing.assert_array_equal(c, data(me, key + "c", (2, 3), np.float32))


def test_numpy_scalars_keep_shape_0d(comm, request):
    """A NumPy scalar (np.float32(x)) reduces to a 0-d array, as a 0-d array does; gathered,
    one element per rank."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    for dt in (np.float32, np.float64, np.int64):
        vals = [data(r, key, (), dt) for r in range(n)]
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            got = mpicomm.all_reduce(dt(vals[me][()]), op)
            assert got.shape == () and got.dtype == dt, (got.shape, got.dtype)
            close(got, reduce_np(vals, op), dt)
        g = mpicomm.all_gather(dt(vals[me][()]))
        assert g.shape == (n,)
        np.testing.assert_array_equal(g, np.stack(vals))
