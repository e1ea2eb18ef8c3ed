"""DistributedSampler (MindSpore's): every index once per epoch across shards, equal
shares, the same permutation on every rank, new ones per epoch, num_samples as MindSpore's;
DistributedBatchSampler (Paddle's): its batches, defaults and padding; bad arguments."""
import itertools

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError
from mpicomm.training.sampler import DistributedBatchSampler, DistributedSampler


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
    (dict(dataset_size=-1, num_shards=2, shard_id=0), r"dataset_size=-1.*an int >= 0"),
    (dict(dataset_size=10.0, num_shards=2, shard_id=0), r"dataset_size=10.0"),
    (dict(dataset_size="10", num_shards=2, shard_id=0), r"dataset_size='10'.*an int >= 0"),
    (dict(dataset_size=10, num_shards=2, shard_id=0, num_samples=-2), r"num_samples=-2.*None.*how many samples"),
    (dict(dataset_size=10, num_shards=2, shard_id=0, num_samples=3.0), r"num_samples=3.0"),
    (dict(dataset_size=10, num_shards=0, shard_id=0), r"num_shards=0.*an int >= 1"),
    (dict(dataset_size=10, num_shards=2, shard_id=2), r"shard_id=2.*an int in 0..1"),
    (dict(dataset_size=10, num_shards=2, shard_id=-1), r"shard_id=-1"),
    (dict(dataset_size=10, num_shards=2, shard_id=0, shuffle="yes"), r"shuffle='yes'.*True or False"),
    (dict(dataset_size=10, num_shards=2, shard_id=0, drop_last=1), r"drop_last=1.*True or False"),
    (dict(dataset_size=10, num_shards=2, shard_id=0, seed=-3), r"seed=-3.*an int >= 0"),
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
    assert "positional arguments after dataset_size" in msg
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


# ---------------------------------------------------------------- num_samples: MindSpore's meaning

@pytest.mark.parametrize("n, s, k", [(10, 2, 3), (101, 4, 7), (7, 3, 0), (9, 2, 50)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_num_samples_is_how_many_each_shard_draws(n, s, k, shuffle):
    """MindSpore's ds.DistributedSampler(num_shards, shard_id, num_samples=k): the first k of
    the shard's samples (all of them when k is larger)."""
    for i in range(s):
        full = DistributedSampler(n, num_shards=s, shard_id=i, shuffle=shuffle, seed=9)
        part = DistributedSampler(n, num_shards=s, shard_id=i, shuffle=shuffle, seed=9, num_samples=k)
        for epoch in (0, 3):
            full.set_epoch(epoch)
            part.set_epoch(epoch)
            want = full.indices().tolist()[:k]
            assert part.indices().tolist() == list(part) == want
            assert len(part) == min(k, -(-n // s))


def test_num_samples_without_the_data_sets_size_is_refused():
    """The first versions took the data set's size as num_samples=: that call is ambiguous
    now, so it is refused, naming dataset_size."""
    with pytest.raises(InvalidArgumentError, match=r"invalid num_samples=37.*dataset_size.*how many samples each "
                                                   r"shard draws"):
        DistributedSampler(num_samples=37, num_shards=2, shard_id=0)
    with pytest.raises(InvalidArgumentError, match=r"dataset_size.*missing"):
        DistributedSampler(num_shards=2, shard_id=0)
    assert DistributedSampler(dataset_size=6, num_shards=2, shard_id=1, shuffle=False).indices().tolist() == [1, 3, 5]


# ---------------------------------------------------------------- DistributedBatchSampler: Paddle's

def test_batch_sampler_has_paddles_signature_and_defaults():
    import inspect

    sig = inspect.signature(DistributedBatchSampler)
    assert list(sig.parameters) == ["dataset", "batch_size", "num_replicas", "rank", "shuffle", "drop_last"]
    assert sig.parameters["shuffle"].default is False and sig.parameters["drop_last"].default is False
    assert mpicomm.DistributedBatchSampler is DistributedBatchSampler


@pytest.mark.parametrize("n, size, bs, drop_last, want", [
    # worked by hand from Paddle's rule: pad 0.. to a multiple of the ranks; rank r takes the
    # r-th block of bs in every round of bs * ranks, then an equal part of the last, short round
    (10, 2, 3, False, [[[0, 1, 2], [6, 7]], [[3, 4, 5], [8, 9]]]),
    (10, 2, 3, True, [[[0, 1, 2]], [[3, 4, 5]]]),
    (7, 3, 2, False, [[[0, 1], [6]], [[2, 3], [0]], [[4, 5], [1]]]),
    (5, 1, 2, False, [[[0, 1], [2, 3], [4]]]),
    (8, 2, 2, False, [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
])
def test_batch_sampler_batches_without_shuffle(n, size, bs, drop_last, want):
    data = list(range(100, 100 + n))     # a data set: only its len() is used
    got = [list(DistributedBatchSampler(data, bs, num_replicas=size, rank=r, drop_last=drop_last))
           for r in range(size)]
    assert got == want
    assert [len(DistributedBatchSampler(n, bs, num_replicas=size, rank=r, drop_last=drop_last))
            for r in range(size)] == [len(w) for w in want]
    # a second pass gives the same batches: without shuffle, nothing moves between epochs
    assert list(DistributedBatchSampler(n, bs, num_replicas=size, rank=0, drop_last=drop_last)) == want[0]


@pytest.mark.parametrize("n, size, bs", [(37, 3, 4), (64, 4, 8), (5, 2, 8), (50, 1, 7)])
def test_batch_sampler_shuffles_as_paddle(n, size, bs):
    """shuffle=True: numpy.random.RandomState(epoch) shuffles the padded list, and the next
    pass takes the next epoch; put back in round order, the ranks' batches are that list."""
    samplers = [DistributedBatchSampler(n, bs, num_replicas=size, rank=r, shuffle=True) for r in range(size)]
    per = -(-n // size)
    for epoch in range(3):
        padded = list(range(n)) + list(range(n))[:per * size - n]
        np.random.RandomState(epoch).shuffle(padded)
        batches = [list(s) for s in samplers]
        assert all(sum(len(b) for b in mine) == per for mine in batches)
        rebuilt, rounds = [], max(len(b) for b in batches)
        for k in range(rounds):
            for r in range(size):
                rebuilt += batches[r][k] if k < len(batches[r]) else []
        assert rebuilt == padded
    samplers[0].set_epoch(1)
    again = list(samplers[0])
    padded = list(range(n)) + list(range(n))[:per * size - n]
    np.random.RandomState(1).shuffle(padded)
    assert sum(again, [])[:min(bs, per)] == padded[:min(bs, per)]


@pytest.mark.parametrize("args, kw, match", [
    ((object(), 4), {}, r"dataset=<object>.*len\(\)"),
    ((10, 0), {}, r"batch_size=0.*an int >= 1"),
    ((10, 2.0), {}, r"batch_size=2.0"),
    ((10, 2), dict(num_replicas=2, rank=2), r"rank=2.*an int in 0..1"),
    ((10, 2), dict(num_replicas=0, rank=0), r"num_replicas=0.*an int >= 1"),
    ((10, 2), dict(num_replicas=2, rank=0, shuffle=1), r"shuffle=1.*True or False"),
    ((10, 2), dict(num_replicas=2, rank=0, drop_last="no"), r"drop_last='no'.*True or False"),
])
def test_batch_sampler_bad_arguments(args, kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        DistributedBatchSampler(*args, **kw)


@pytest.mark.mpi
def test_batch_sampler_defaults_from_the_world(comm):
    n, r = comm.get_group_size(), comm.get_rank()
    sm = mpicomm.DistributedBatchSampler(23, 3)
    assert (sm.nranks, sm.local_rank) == (n, r)
    mine = np.array(sum(list(sm), []), np.int64)
    assert len(mine) == -(-23 // n)
    everyone = comm.all_gather(mine)
    assert set(everyone.tolist()) == set(range(23)) and len(everyone) == -(-23 // n) * n


# ---------------------------------------------------------------- torch's and OneFlow's form

class _Sized:   # a data set as torch's and OneFlow's DistributedSampler take it
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


@pytest.mark.parametrize("n, s", [(0, 2), (10, 3), (37, 4), (5, 8)])
def test_a_data_set_in_torchs_order_is_its_size(n, s):
    """DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last), torch's
    positional order and keywords: the same indices as the size with MindSpore's keywords."""
    for r in range(s):
        for shuffle, seed, drop_last in ((True, 3, False), (False, 0, True)):
            want = DistributedSampler(n, num_shards=s, shard_id=r, shuffle=shuffle, seed=seed,
                                      drop_last=drop_last).indices().tolist()
            data = list(range(100, 100 + n))
            assert DistributedSampler(data, s, r, shuffle, seed, drop_last).indices().tolist() == want
            assert DistributedSampler(_Sized(n), num_replicas=s, rank=r, shuffle=shuffle, seed=seed,
                                      drop_last=drop_last).indices().tolist() == want
    # torch's striding, unshuffled: rank r takes indices r, r + s, ... of the padded list
    padded = np.resize(np.arange(n), -(-n // s) * s) if n else np.arange(0)
    assert DistributedSampler(_Sized(n), num_replicas=s, rank=s - 1, shuffle=False).indices().tolist() \
        == padded[s - 1::s].tolist()


@pytest.mark.parametrize("args, kw, match", [
    ((_Sized(10), 2, 2), {}, r"invalid rank=2: expected an int in 0..1 \(num_replicas=2\)"),
    ((_Sized(10),), dict(num_replicas=0, rank=0), r"invalid num_replicas=0: expected an int >= 1"),
    ((_Sized(10),), dict(num_shards=2, num_replicas=2, shard_id=0), r"invalid num_replicas=2.*num_shards=2"),
    ((_Sized(10),), dict(num_shards=2, shard_id=0, rank=1), r"invalid rank=1.*shard_id=0"),
    ((_Sized(10), 2, 0, True, 0, False, "extra"), {}, r"at most 5, torch's order"),
    ((_Sized(10), 2, 0, "yes"), {}, r"shuffle='yes'.*True or False"),
])
def test_torchs_form_bad_arguments(args, kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        DistributedSampler(*args, **kw)


def test_a_long_value_is_cut_in_the_message():
    """A data set given where an int goes names the value without printing all of it."""
    with pytest.raises(InvalidArgumentError) as e:
        mpicomm.DistributedBatchSampler(list(range(10)), batch_size=list(range(50000)), num_replicas=2, rank=0)
    msg = str(e.value)
    assert len(msg) < 600 and "batch_size=[0, 1, 2" in msg and "49999]" in msg and "list of repr length" in msg
    assert "expected an int >= 1" in msg
