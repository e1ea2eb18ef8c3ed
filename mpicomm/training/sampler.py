"""Samplers: each rank's share of a data set's indices, epoch by epoch.

- :class:`DistributedSampler`: MindSpore's ``ds.DistributedSampler`` (indices of one shard,
  shuffled by default; ``num_samples`` is how many of them to draw, as in MindSpore).
- :class:`DistributedBatchSampler`: Paddle's ``paddle.io.DistributedBatchSampler``
  (batches of indices, not shuffled by default, each rank's list padded to equal length).
"""
from __future__ import annotations

import numpy as np

from .._state import require_init
from ..errors import TypeOf, invalid

_UNSET = object()


def _int(name, v, lo, allowed):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise invalid(name, v, allowed)
    return int(v)


def _flag(name, v):
    if not isinstance(v, (bool, np.bool_)):
        raise invalid(name, v, "True or False")
    return bool(v)


def _shards(num_shards, shard_id, names, what):
    """(count, id) from the arguments, the world's size and this rank where None."""
    if num_shards is None or shard_id is None:
        ctx = require_init(f"{what}({names[0]}=None or {names[1]}=None)")
        num_shards = ctx.world.size if num_shards is None else num_shards
        shard_id = ctx.world.rank if shard_id is None else shard_id
    num_shards = _int(names[0], num_shards, 1, "an int >= 1 (the number of ranks)")
    if isinstance(shard_id, bool) or not isinstance(shard_id, (int, np.integer)) or not 0 <= shard_id < num_shards:
        raise invalid(names[1], shard_id, f"an int in 0..{num_shards - 1} ({names[0]}={num_shards})")
    return num_shards, int(shard_id)


class DistributedSampler:
    """The indices of shard ``shard_id`` of a data set of ``dataset_size`` samples split
    ``num_shards`` ways.

    Every epoch, all shards together hold every index once: with ``drop_last=False`` the
    list is padded by wrapping around to a multiple of ``num_shards`` (so a few indices
    appear twice); with ``drop_last=True`` the tail that does not divide is dropped.
    With ``shuffle=True`` the order is a permutation drawn from ``(seed, epoch)``, the
    same on every rank; call :meth:`set_epoch` before each epoch for a new one.

    dataset_size: the data set's size (``len(dataset)``), the one positional argument; or
        the data set itself (anything with ``len()``), as torch's and OneFlow's
        ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)`` take
        it, with their positional order after it.
    num_shards, shard_id (keywords only): default to the world's size and this process's
        rank (needs :func:`mpicomm.init`). ``num_replicas`` and ``rank`` are torch's names
        for them.
    num_samples: MindSpore's meaning: how many of this shard's indices to draw each epoch
        (the first ``num_samples`` of them; None: all of them).

    Raises InvalidArgumentError for values out of range; for positional arguments after
    an int ``dataset_size`` (MindSpore's ``DistributedSampler(num_shards, shard_id)`` order
    would be misread); and for ``num_samples=`` without ``dataset_size`` (the first versions
    of mpicomm took the data set's size under that name; MindSpore's ``num_samples`` is the
    number to draw).
    """

    def __init__(self, dataset_size=_UNSET, *args, num_shards=None, shard_id=None, shuffle=True, seed=0,
                 drop_last=False, num_samples=None, num_replicas=None, rank=None):
        sized = not isinstance(dataset_size, (int, np.integer, str, bytes)) and hasattr(dataset_size, "__len__")
        if sized:   # torch's DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)
            if len(args) > 5:
                raise invalid("positional arguments after the data set", len(args),
                              "at most 5, torch's order: num_replicas, rank, shuffle, seed, drop_last")
            given = {"num_replicas": num_replicas, "rank": rank, "shuffle": shuffle, "seed": seed,
                     "drop_last": drop_last}
            for name, v in zip(given, args):
                given[name] = v
            num_replicas, rank, shuffle, seed, drop_last = given.values()
            dataset_size = len(dataset_size)
        elif args:  # MindSpore's DistributedSampler(num_shards, shard_id, ...) would be misread
            raise invalid("positional arguments after dataset_size", (dataset_size, *args),
                          "DistributedSampler(dataset_size, num_shards=..., shard_id=...) with num_shards "
                          "and shard_id as keywords: dataset_size is the data set's size (MindSpore's "
                          "ds.DistributedSampler(num_shards, shard_id) takes the shards first; write "
                          "DistributedSampler(len(dataset), num_shards=n, shard_id=rank))")
        for mine, torchs, v, w in (("num_shards", "num_replicas", num_shards, num_replicas),
                                   ("shard_id", "rank", shard_id, rank)):
            if v is not None and w is not None:
                raise invalid(torchs, w, f"None where {mine}={v!r} is given ({torchs} is torch's name for "
                              f"{mine}: give one of them)")
        names = ("num_shards" if num_replicas is None else "num_replicas", "shard_id" if rank is None else "rank")
        num_shards = num_replicas if num_shards is None else num_shards
        shard_id = rank if shard_id is None else shard_id
        if dataset_size is _UNSET:
            raise invalid("num_samples" if num_samples is not None else "dataset_size",
                          num_samples if num_samples is not None else "missing",
                          "DistributedSampler(len(dataset), ...): the data set's size is the first argument, "
                          "dataset_size; num_samples is MindSpore's: how many samples each shard draws "
                          "(None: all of them)")
        self.dataset_size = _int("dataset_size", dataset_size, 0, "an int >= 0 (the size of the data set), or "
                                 "the data set itself (anything with len())")
        if num_samples is not None:
            num_samples = _int("num_samples", num_samples, 0, "None (every index of the shard) or an int >= 0 "
                               "(MindSpore's: how many samples this shard draws; the data set's size is the "
                               "first argument, dataset_size)")
        self.num_samples = num_samples
        self.num_shards, self.shard_id = _shards(num_shards, shard_id, names, "DistributedSampler")
        self.shuffle = _flag("shuffle", shuffle)
        self.drop_last = _flag("drop_last", drop_last)
        self.seed = _int("seed", seed, 0, "an int >= 0")
        self.epoch = 0
        n, s = self.dataset_size, self.num_shards
        self.total_size = (n // s) * s if self.drop_last else -(-n // s) * s
        self.num_per_shard = self.total_size // s
        if num_samples is not None:
            self.num_per_shard = min(self.num_per_shard, num_samples)

    def set_epoch(self, epoch):
        """Use the permutation of ``epoch`` (an int >= 0) from now on."""
        self.epoch = _int("epoch", epoch, 0, "an int >= 0")

    def indices(self):
        """This shard's indices for the current epoch, as an int64 array."""
        n = self.dataset_size
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        if self.total_size > n:  # wrap around, more than once when n < num_shards
            order = np.resize(order, self.total_size)
        else:
            order = order[:self.total_size]
        mine = order[self.shard_id:self.total_size:self.num_shards]
        return mine[:self.num_per_shard].astype(np.int64)

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_per_shard

    def __repr__(self):
        return (f"DistributedSampler(dataset_size={self.dataset_size}, num_shards={self.num_shards}, "
                f"shard_id={self.shard_id}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, num_samples={self.num_samples}, epoch={self.epoch})")


class DistributedBatchSampler:
    """Paddle's ``paddle.io.DistributedBatchSampler``: this rank's batches of indices.

    ``DistributedBatchSampler(dataset, batch_size, num_replicas=None, rank=None,
    shuffle=False, drop_last=False)`` as in Paddle, and the same batches: the indices
    ``0..len(dataset)-1`` (shuffled with ``numpy.random.RandomState(epoch)`` when
    ``shuffle=True``) padded from their start to a multiple of ``num_replicas``; rank r
    takes the r-th block of ``batch_size`` of every ``batch_size * num_replicas``, and an
    equal part of the tail that fills no whole round, so every rank gets
    ``ceil(len(dataset) / num_replicas)`` indices. Iterating yields lists of
    ``batch_size`` indices, the last one shorter unless ``drop_last``. With shuffle, each
    full iteration moves to the next epoch, as Paddle's does; :meth:`set_epoch` sets it.

    dataset: anything with ``len()``, or the data set's size as an int.
    num_replicas, rank: default to the world's size and this process's rank (needs
        :func:`mpicomm.init`).

    Raises InvalidArgumentError naming the argument, its value and what is allowed.
    """

    def __init__(self, dataset, batch_size, num_replicas=None, rank=None, shuffle=False, drop_last=False):
        if isinstance(dataset, (int, np.integer)) and not isinstance(dataset, bool):
            size = dataset
        else:
            try:
                size = len(dataset)
            except TypeError:
                raise invalid("dataset", TypeOf(dataset), "a data set with len() (paddle.io.Dataset, "
                              "a list, an array) or its size as an int") from None
        self.dataset_size = _int("dataset", size, 0, "a data set of size >= 0 (or an int >= 0)")
        self.batch_size = _int("batch_size", batch_size, 1, "an int >= 1 (samples per batch on each rank)")
        self.nranks, self.local_rank = _shards(num_replicas, rank, ("num_replicas", "rank"),
                                               "DistributedBatchSampler")
        self.shuffle = _flag("shuffle", shuffle)
        self.drop_last = _flag("drop_last", drop_last)
        self.epoch = 0
        self.num_samples = -(-self.dataset_size // self.nranks)
        self.total_size = self.num_samples * self.nranks

    def set_epoch(self, epoch):
        """Shuffle with the permutation of ``epoch`` (an int >= 0) from now on."""
        self.epoch = _int("epoch", epoch, 0, "an int >= 0")

    def _indices(self):
        n, size, bs, r = self.dataset_size, self.nranks, self.batch_size, self.local_rank
        idx = list(range(n))
        while len(idx) < self.total_size:          # pad from the start (more than once when n < nranks)
            idx += idx[:self.total_size - len(idx)]
        if self.shuffle:
            np.random.RandomState(self.epoch).shuffle(idx)
            self.epoch += 1
        if size == 1:
            return idx
        tail = self.total_size % (bs * size)       # a multiple of size: split evenly
        mine = []
        for i in range(r * bs, self.total_size - tail, bs * size):
            mine.extend(idx[i:i + bs])
        each = tail // size
        last = idx[self.total_size - tail:]
        mine.extend(last[r * each:(r + 1) * each])
        return mine

    def __iter__(self):
        idx = self._indices()
        bs = self.batch_size
        for i in range(0, len(idx), bs):
            b = idx[i:i + bs]
            if len(b) == bs or not self.drop_last:
                yield b

    def __len__(self):
        """Batches per epoch on this rank."""
        return (self.num_samples + (0 if self.drop_last else self.batch_size - 1)) // self.batch_size

    def __repr__(self):
        return (f"DistributedBatchSampler(dataset={self.dataset_size}, batch_size={self.batch_size}, "
                f"num_replicas={self.nranks}, rank={self.local_rank}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")


__all__ = ["DistributedSampler", "DistributedBatchSampler"]
