"""Repeated calls with the same arrays: the backends repeat a validated call without
checking again (mpicomm._backends.base.Replay). New contents, a new op or root, and
arrays whose shape or dtype was changed in place must all still give the right result
or the right error. Expectations are computed with NumPy from every rank's data."""
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp

# The tests change shape and dtype in place on purpose, which NumPy 2.5 deprecates (and
# which the repeat path must still notice while NumPy allows it).
pytestmark = [pytest.mark.mpi,
              pytest.mark.filterwarnings("ignore:Setting the (shape|dtype) on a NumPy array:DeprecationWarning")]


def rank_data(rank, key, step, shape, dt):
    g = np.random.default_rng([rank, step, zlib.crc32(key.encode())])
    return g.integers(-50, 51, size=shape).astype(dt)


def all_data(key, step, shape, dt):
    return [rank_data(r, key, step, shape, dt) for r in range(mpicomm.get_group_size())]


@pytest.mark.parametrize("dt", [np.float32, np.int64])
@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
def test_all_reduce_same_arrays_new_contents_and_ops(comm, dt, mode):
    r = mpicomm.get_rank()
    x = np.empty(7, dt)
    o = np.empty(7, dt)
    ops = [ReduceOp.SUM, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MIN, ReduceOp.SUM]
    for step, op in enumerate(ops):
        x[...] = rank_data(r, "ar", step, 7, dt)
        exp = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}[op](
            np.stack(all_data("ar", step, 7, dt)), axis=0)
        if mode == "new":
            got = mpicomm.all_reduce(x, op)
            assert got is not x
        elif mode == "out":
            got = mpicomm.all_reduce(x, op, out=o)
            assert got is o
        else:
            got = mpicomm.all_reduce(x, op, out=x)
            assert got is x
        np.testing.assert_array_equal(got, exp.astype(dt))


def test_all_reduce_alternating_arrays(comm):
    r = mpicomm.get_rank()
    xs = [np.empty(5, np.float64), np.empty((2, 3), np.float64)]
    for step in range(6):
        x = xs[step % 2]
        x[...] = rank_data(r, "alt", step, x.shape, np.float64)
        got = mpicomm.all_reduce(x)
        assert got.shape == x.shape
        np.testing.assert_array_equal(got, np.sum(all_data("alt", step, x.shape, np.float64), axis=0))


def test_shape_changed_in_place(comm):
    r = mpicomm.get_rank()
    x = rank_data(r, "shape", 0, 6, np.float32)
    mpicomm.all_reduce(x)
    mpicomm.all_reduce(x)
    x.shape = (2, 3)
    got = mpicomm.all_reduce(x)
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.sum(all_data("shape", 0, 6, np.float32), axis=0).reshape(2, 3))
    # out= of the old shape no longer fits, and says so
    x.shape = (6,)
    o = np.empty(6, np.float32)
    mpicomm.all_reduce(x, out=o)
    mpicomm.all_reduce(x, out=o)
    x.shape = (3, 2)
    with pytest.raises(InvalidArgumentError, match=r"out\.shape"):
        mpicomm.all_reduce(x, out=o)


def test_dtype_changed_in_place(comm):
    r = mpicomm.get_rank()
    x = rank_data(r, "dtype", 0, 8, np.int32)
    mpicomm.all_reduce(x)
    mpicomm.all_reduce(x)
    x.dtype = np.int64      # same bytes, read as 4 int64
    got = mpicomm.all_reduce(x)
    assert got.dtype == np.int64 and got.shape == (4,)
    exp = np.sum([a.view(np.int64) for a in all_data("dtype", 0, 8, np.int32)], axis=0)
    np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("out", [False, True])
def test_all_gather_repeated(comm, out):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = np.empty((2, 3), np.int32)
    o = np.empty((2 * n, 3), np.int32)
    for step in range(4):
        x[...] = rank_data(r, "ag", step, (2, 3), np.int32)
        got = mpicomm.all_gather(x, out=o) if out else mpicomm.all_gather(x)
        np.testing.assert_array_equal(got, np.concatenate(all_data("ag", step, (2, 3), np.int32)))
    x.shape = (3, 2)
    if out:
        with pytest.raises(InvalidArgumentError, match=r"out\.shape"):
            mpicomm.all_gather(x, out=o)
    else:
        assert mpicomm.all_gather(x).shape == (3 * n, 2)


def test_reduce_scatter_repeated(comm):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = np.empty((2 * n, 3), np.float64)
    o = np.empty((2, 3), np.float64)
    for step, op in enumerate([ReduceOp.SUM, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MAX, ReduceOp.SUM]):
        x[...] = rank_data(r, "rs", step, x.shape, np.float64)
        total = (np.sum if op is ReduceOp.SUM else np.max)(np.stack(all_data("rs", step, x.shape, np.float64)), axis=0)
        got = mpicomm.reduce_scatter(x, op, out=o) if step % 2 else mpicomm.reduce_scatter(x, op)
        np.testing.assert_array_equal(got, total[2 * r:2 * r + 2])
    x.shape = (3, 2 * n)  # axis 0 no longer divides by the group size (unless n is 1 or 3)
    if 3 % n:
        with pytest.raises(InvalidArgumentError, match=r"x\.shape"):
            mpicomm.reduce_scatter(x)
    else:
        np.testing.assert_array_equal(mpicomm.reduce_scatter(x).shape, (3 // n, 2 * n))


def test_broadcast_repeated_roots(comm):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = np.empty(9, np.int64)
    for step, root in enumerate([0, 0, n - 1, n - 1, 0, n // 2]):
        x[...] = rank_data(r, "bc", step, 9, np.int64)
        got = mpicomm.broadcast(x, root)
        assert got is x
        np.testing.assert_array_equal(x, rank_data(root, "bc", step, 9, np.int64))
    with pytest.raises(InvalidArgumentError, match="root"):
        mpicomm.broadcast(x, n)


def test_large_arrays_repeat_without_being_kept_alive(comm):
    """all_gather and broadcast of arrays above REPLAY_MAX repeat through weak references:
    right results with new contents and shapes, and the arrays are freed when dropped."""
    import gc
    import weakref

    from mpicomm._backends.base import REPLAY_MAX

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    k = REPLAY_MAX // 4 + 1001  # float32 elements per rank: above the strong-reference limit
    x = np.empty(k, np.float32)
    o = np.empty(n * k, np.float32)
    b = np.empty(2 * k, np.int32)
    for step in range(4):
        x[...] = rank_data(r, "big-ag", step, k, np.float32)
        assert mpicomm.all_gather(x, out=o) is o
        np.testing.assert_array_equal(o, np.concatenate(all_data("big-ag", step, k, np.float32)))
        root = step % n
        b[...] = rank_data(r, "big-bc", step, 2 * k, np.int32)
        assert mpicomm.broadcast(b, root) is b
        np.testing.assert_array_equal(b, rank_data(root, "big-bc", step, 2 * k, np.int32))
    x.shape = (k, 1)
    with pytest.raises(InvalidArgumentError, match=r"out\.shape"):
        mpicomm.all_gather(x, out=o)
    wx, wo, wb = weakref.ref(x), weakref.ref(o), weakref.ref(b)
    del x, o, b
    gc.collect()
    assert wx() is None and wo() is None and wb() is None
