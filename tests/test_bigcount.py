"""Collectives of more elements than MPI's int count, on the MPI backend, with the limit
lowered so that small arrays take the piece-by-piece path (mpicomm._backends.bigcount).
The real 2**31 + 5 element case runs in tests/test_faults.py. Expectations come from
NumPy over every rank's data."""
import itertools
import zlib

import numpy as np
import pytest

import mpicomm
from conftest import shm_of
from mpicomm import ReduceOp
from mpicomm._backends import bigcount, mpi as mpi_transport
from mpicomm._backends.shm_config import NEVER

pytestmark = pytest.mark.mpi

MAX_COUNT, CHUNK = 100, 37   # the limits in these tests: more than 100 elements go in pieces of 37
_groups = itertools.count()


@pytest.fixture
def small_limit(comm, monkeypatch):
    """A group of every rank, made for the test, whose calls of more than MAX_COUNT elements
    go in pieces of CHUNK: a fresh group, so that no call prepared earlier in the session
    under the real limit is reused, with the shared-memory path off (MPICOMM_SHM_THRESHOLD
    is read when the group's transport is made). Yields (the group, the pieces of each
    large call since the last ``ran_in_pieces``)."""
    if mpicomm.get_backend() != "mpi":
        pytest.skip("the MPI transport's large-count path")
    monkeypatch.setattr(mpi_transport, "MAX_COUNT", MAX_COUNT)
    monkeypatch.setattr(bigcount, "CHUNK", CHUNK)
    monkeypatch.setenv("MPICOMM_SHM_THRESHOLD", "off")
    split = []
    real = bigcount.pieces

    def pieces(count, per=1):   # what the large-count path splits each call into
        p = real(count, per)
        split.append((count, per, len(p)))
        return p

    monkeypatch.setattr(bigcount, "pieces", pieces)
    name = f"bigcount{next(_groups)}"
    mpicomm.create_group(name, list(range(mpicomm.get_group_size())))
    shm = shm_of(name)
    assert (shm.min_all_reduce, shm.min_all_gather, shm.min_reduce_scatter, shm.min_broadcast) == (NEVER,) * 4
    yield name, split
    mpicomm.destroy_group(name)


def ran_in_pieces(split, count, per=1):
    """The one large call since the last check went through the large-count path: ``count``
    elements (a row of them where ``per`` ranks' pieces go together) in pieces of at most
    CHUNK elements together."""
    step = max(1, CHUNK // per)
    assert split == [(count, per, -(-count // step))], split
    split.clear()


def data(rank, key, shape, dt):
    g = np.random.default_rng([rank, zlib.crc32(key.encode())])
    return g.integers(-20, 21, size=shape).astype(dt)


def every(key, shape, dt):
    return [data(r, key, shape, dt) for r in range(mpicomm.get_group_size())]


@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_and_reduce_in_pieces(small_limit, async_op):
    g, split = small_limit
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    for dt, op in [(np.int64, ReduceOp.SUM), (np.float32, ReduceOp.MAX), (np.float64, ReduceOp.AVG)]:
        x = data(r, f"ar{dt}", (30, 11), dt)
        want = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.AVG: np.mean}[op](
            np.stack(every(f"ar{dt}", (30, 11), dt)), axis=0).astype(dt)
        got = mpicomm.all_reduce(x, op, group=g, async_op=async_op)
        got = got.wait() if async_op else got
        ran_in_pieces(split, 330)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        y = x.copy()
        res = mpicomm.all_reduce(y, op, out=y, group=g, async_op=async_op)
        assert (res.wait() if async_op else res) is y
        ran_in_pieces(split, 330)
        np.testing.assert_allclose(y, want, rtol=1e-6)
        root = n - 1
        red = mpicomm.reduce(x, op, root=root, group=g, async_op=async_op)
        red = red.wait() if async_op else red
        ran_in_pieces(split, 330)
        if r == root:
            np.testing.assert_allclose(red, want, rtol=1e-6)
        else:
            assert red is None


def test_gathers_scatters_broadcast_in_pieces(small_limit):
    g, split = small_limit
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    # sizes above MAX_COUNT at any group size, 1 included
    x = data(r, "ag", (41, 3), np.int32)
    np.testing.assert_array_equal(mpicomm.all_gather(x, group=g), np.concatenate(every("ag", (41, 3), np.int32)))
    ran_in_pieces(split, 123, n)
    x = data(r, "rs", (n * 101,), np.int64)
    total = np.sum(every("rs", (n * 101,), np.int64), axis=0)
    np.testing.assert_array_equal(mpicomm.reduce_scatter(x, group=g), total[101 * r:101 * (r + 1)])
    ran_in_pieces(split, 101, n)
    x = data(r, "a2a", (n * 51, 2), np.float64)
    want = np.concatenate([a[51 * r:51 * (r + 1)] for a in every("a2a", (n * 51, 2), np.float64)])
    np.testing.assert_array_equal(mpicomm.all_to_all(x, group=g), want)
    ran_in_pieces(split, 102, n)
    b = data(r, "bc", (150,), np.int8)
    assert mpicomm.broadcast(b, root=0, group=g) is b
    ran_in_pieces(split, 150)
    np.testing.assert_array_equal(b, data(0, "bc", (150,), np.int8))
