"""A Work dropped before it completed: mpicomm keeps its request and buffers alive until
the operation completes (at the next collective, barrier or finalize) and warns once.
Thousands of dropped handles, in place and out of place; every result checked against
NumPy over every rank's data."""
import gc
import warnings
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm._backends import base

pytestmark = pytest.mark.mpi


def data(rank, i, shape, dt=np.float64):
    g = np.random.default_rng([rank, i, zlib.crc32(b"dropped")])
    return g.integers(-100, 101, size=shape).astype(dt)


def test_dropped_work_completes_and_keeps_its_buffers(comm):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    count = 3000
    ins = [data(r, i, (5,)) for i in range(count)]
    outs = [np.full(5, np.nan) for _ in range(count)]
    inplace = [data(r, count + i, (3,), np.int64) for i in range(count)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(count):
            # each handle is dropped at once: its buffers must stay alive until it completes
            mpicomm.all_reduce(ins[i], out=outs[i], async_op=True)
            mpicomm.all_reduce(inplace[i], out=inplace[i], async_op=True)
            mpicomm.all_gather(data(r, i, (2,)), async_op=True)   # a new output nobody holds
            if i % 500 == 0:
                gc.collect()
        mpicomm.barrier()   # completes every dropped Work
    assert not base._dropped
    assert sum(base.DROPPED_WARNING in str(w.message) for w in caught) <= 1  # once per process
    for i in range(count):
        np.testing.assert_array_equal(outs[i], np.sum([data(k, i, (5,)) for k in range(n)], axis=0))
        np.testing.assert_array_equal(inplace[i], np.sum([data(k, count + i, (3,), np.int64) for k in range(n)],
                                                         axis=0))


def test_the_warning_says_what_to_do(comm):
    """Rank 0 drops its all_reduce before any other rank has started theirs, so it cannot
    have completed: rank 0 warns (alone in a job, the call completes at once: no warning)."""
    from mpi4py import MPI

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    base._warned.clear()
    x = data(r, 7, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if r == 0:
            mpicomm.all_reduce(x, out=x, async_op=True)
        MPI.COMM_WORLD.Barrier()   # the user's own communicator: the others start after rank 0
        if r != 0:
            mpicomm.all_reduce(x, out=x, async_op=True)
        mpicomm.barrier()
    mine = [w for w in caught if issubclass(w.category, RuntimeWarning) and base.DROPPED_WARNING in str(w.message)]
    if r == 0:
        assert len(mine) == (1 if n > 1 else 0)
        if mine:
            assert "wait()" in str(mine[0].message)
    np.testing.assert_array_equal(x, np.sum([data(k, 7, (4,)) for k in range(n)], axis=0))


def test_waited_and_completed_work_is_not_kept(comm):
    before = len(base._dropped)
    w = mpicomm.all_reduce(np.arange(3.0), async_op=True)
    w.wait()
    del w
    assert len(base._dropped) == before
