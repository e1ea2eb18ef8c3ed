"""Collectives of more elements than MPI's int count, on the MPI backend, with the limit
lowered so that small arrays take the piece-by-piece path (mpicomm._backends.bigcount).
The real 2**31 + 5 element case runs in tests/test_faults.py. Expectations come from
NumPy over every rank's data."""
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import ReduceOp
from mpicomm._backends import bigcount, mpi as mpi_transport

pytestmark = pytest.mark.mpi


@pytest.fixture
def small_limit(comm, monkeypatch):
    if mpicomm.get_backend() != "mpi":
        pytest.skip("the MPI transport's large-count path")
    monkeypatch.setattr(mpi_transport, "MAX_COUNT", 100)
    monkeypatch.setattr(bigcount, "CHUNK", 37)
    monkeypatch.setenv("MPICOMM_SHM_THRESHOLD", "off")
    yield


def data(rank, key, shape, dt):
    g = np.random.default_rng([rank, zlib.crc32(key.encode())])
    return g.integers(-20, 21, size=shape).astype(dt)


def every(key, shape, dt):
    return [data(r, key, shape, dt) for r in range(mpicomm.get_group_size())]


@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_and_reduce_in_pieces(small_limit, async_op):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    for dt, op in [(np.int64, ReduceOp.SUM), (np.float32, ReduceOp.MAX), (np.float64, ReduceOp.AVG)]:
        x = data(r, f"ar{dt}", (30, 11), dt)
        want = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.AVG: np.mean}[op](
            np.stack(every(f"ar{dt}", (30, 11), dt)), axis=0).astype(dt)
        got = mpicomm.all_reduce(x, op, async_op=async_op)
        got = got.wait() if async_op else got
        np.testing.assert_allclose(got, want, rtol=1e-6)
        y = x.copy()
        res = mpicomm.all_reduce(y, op, out=y, async_op=async_op)
        assert (res.wait() if async_op else res) is y
        np.testing.assert_allclose(y, want, rtol=1e-6)
        root = n - 1
        red = mpicomm.reduce(x, op, root=root, async_op=async_op)
        red = red.wait() if async_op else red
        if r == root:
            np.testing.assert_allclose(red, want, rtol=1e-6)
        else:
            assert red is None


def test_gathers_scatters_broadcast_in_pieces(small_limit):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = data(r, "ag", (41, 3), np.int32)
    np.testing.assert_array_equal(mpicomm.all_gather(x), np.concatenate(every("ag", (41, 3), np.int32)))
    x = data(r, "rs", (n * 45,), np.int64)
    total = np.sum(every("rs", (n * 45,), np.int64), axis=0)
    np.testing.assert_array_equal(mpicomm.reduce_scatter(x), total[45 * r:45 * (r + 1)])
    x = data(r, "a2a", (n * 23, 2), np.float64)
    want = np.concatenate([a[23 * r:23 * (r + 1)] for a in every("a2a", (n * 23, 2), np.float64)])
    np.testing.assert_array_equal(mpicomm.all_to_all(x), want)
    b = data(r, "bc", (150,), np.int8)
    assert mpicomm.broadcast(b, root=0) is b
    np.testing.assert_array_equal(b, data(0, "bc", (150,), np.int8))
