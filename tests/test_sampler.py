"""DistributedSampler: every index once per epoch across shards, equal shares, the same
permutation on every rank, new ones per epoch; bad arguments."""
import itertools

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError
from mpicomm.training.sampler import DistributedSampler


def shards(n, s, **kw):
    return [DistributedSampler(n, num_shards=s, shard_id=i, **kw) for i in range(s)]


@pytest.mark.parametrize("n, s", list(itertools.product([0, 1, 3, 7, 10, 64, 101], [1, 2, 3, 4, 8])))
@pytest.mark.parametrize("shuffle", [True, False])
def test_cover_every_index_padded(n, s, shuffle):
    for epoch in range(3):
        parts = []
        for sm in shards(n, s, shuffle=shuffle, seed=5):
            sm.set_epoch(epoch)
            idx = sm.indices()
            assert len(idx) == len(sm) == -(-n // s)
            assert idx.dtype == np.int64 and list(sm) == idx.tolist()
            parts.append(idx)
        allidx = np.concatenate(parts) if parts else np.array([], np.int64)
        assert len(allidx) == -(-n // s) * s
        if n:
            assert set(allidx.tolist()) == set(range(n))           # every index at least once
            counts = np.bincount(allidx, minlength=n)
            assert counts.max() - counts.min() <= 1 + (s - 1) // max(n, 1)  # padding by wrap-around
            if n % s == 0:
                assert (counts == 1).all()


@pytest.mark.parametrize("n, s", list(itertools.product([0, 1, 3, 7, 10, 101], [1, 2, 3, 4, 8])))
def test_drop_last_drops_the_tail_only(n, s):
    parts = [sm.indices() for sm in shards(n, s, drop_last=True, seed=1)]
    allidx = np.concatenate(parts)
    assert all(len(p) == n // s for p in parts)
    assert len(allidx) == (n // s) * s == len(set(allidx.tolist()))  # no index twice


def test_same_permutation_for_a_seed_and_epoch_new_per_epoch():
    a, b = DistributedSampler(50, num_shards=2, shard_id=0, seed=3), DistributedSampler(50, num_shards=2, shard_id=0, seed=3)
    seen = []
    for epoch in range(4):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert a.indices().tolist() == b.indices().tolist()
        seen.append(a.indices().tolist())
    assert len({tuple(x) for x in seen}) == 4
    assert DistributedSampler(50, num_shards=2, shard_id=0, seed=4).indices().tolist() != seen[0]
    assert DistributedSampler(10, num_shards=2, shard_id=1, shuffle=False).indices().tolist() == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("kw, match", [
    (dict(num_samples=-1, num_shards=2, shard_id=0), r"num_samples=-1.*an int >= 0"),
    (dict(num_samples=10.0, num_shards=2, shard_id=0), r"num_samples=10.0"),
    (dict(num_samples=10, num_shards=0, shard_id=0), r"num_shards=0.*an int >= 1"),
    (dict(num_samples=10, num_shards=2, shard_id=2), r"shard_id=2.*an int in 0..1"),
    (dict(num_samples=10, num_shards=2, shard_id=-1), r"shard_id=-1"),
    (dict(num_samples=10, num_shards=2, shard_id=0, shuffle="yes"), r"shuffle='yes'.*True or False"),
    (dict(num_samples=10, num_shards=2, shard_id=0, drop_last=1), r"drop_last=1.*True or False"),
    (dict(num_samples=10, num_shards=2, shard_id=0, seed=-3), r"seed=-3.*an int >= 0"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        DistributedSampler(**kw)


def test_bad_epoch():
    with pytest.raises(InvalidArgumentError, match=r"epoch=-1.*an int >= 0"):
        DistributedSampler(10, num_shards=2, shard_id=0).set_epoch(-1)


@pytest.mark.parametrize("args", [(4, 0), (4, 3), (8, 1, True)])
def test_mindspore_positional_order_is_refused_alike(args):
    """MindSpore's ds.DistributedSampler(num_shards, shard_id, shuffle) order: the same
    error whatever the shard id (so on every rank), naming the keyword form."""
    with pytest.raises(InvalidArgumentError) as e:
        DistributedSampler(*args)
    msg = str(e.value)
    assert "positional arguments after num_samples" in msg
    assert "DistributedSampler(len(dataset), num_shards=n, shard_id=rank)" in msg


@pytest.mark.mpi
def test_defaults_from_the_world(comm):
    n, r = comm.get_group_size(), comm.get_rank()
    sm = mpicomm.DistributedSampler(37, seed=2)
    assert (sm.num_shards, sm.shard_id) == (n, r)
    sm.set_epoch(1)
    mine = sm.indices()
    everyone = comm.all_gather(mine)  # the shards of all ranks, in rank order
    assert set(everyone.tolist()) == set(range(37))
    assert len(everyone) == -(-37 // n) * n
