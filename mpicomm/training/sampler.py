"""DistributedSampler: each rank's share of a data set's indices, epoch by epoch."""
from __future__ import annotations

import numpy as np

from .._state import require_init
from ..errors import invalid


def _int(name, v, lo, allowed):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise invalid(name, v, allowed)
    return int(v)


class DistributedSampler:
    """The indices of shard ``shard_id`` of ``num_samples`` samples split ``num_shards`` ways.

    Every epoch, all shards together hold every index once: with ``drop_last=False`` the
    list is padded by wrapping around to a multiple of ``num_shards`` (so a few indices
    appear twice); with ``drop_last=True`` the tail that does not divide is dropped.
    With ``shuffle=True`` the order is a permutation drawn from ``(seed, epoch)``, the
    same on every rank; call :meth:`set_epoch` before each epoch for a new one.

    num_shards, shard_id (keywords only): default to the world's size and this process's
    rank (needs :func:`mpicomm.init`). Raises InvalidArgumentError for values out of
    range, and for positional arguments after ``num_samples`` (MindSpore's
    ``DistributedSampler(num_shards, shard_id)`` order would be misread).
    """

    def __init__(self, num_samples, *args, num_shards=None, shard_id=None, shuffle=True, seed=0,
                 drop_last=False):
        if args:  # MindSpore's DistributedSampler(num_shards, shard_id, ...) would be misread
            raise invalid("positional arguments after num_samples", (num_samples, *args),
                          "DistributedSampler(num_samples, num_shards=..., shard_id=...) with num_shards "
                          "and shard_id as keywords: num_samples is the data set's size (MindSpore's "
                          "ds.DistributedSampler(num_shards, shard_id) takes the shards first; write "
                          "DistributedSampler(len(dataset), num_shards=n, shard_id=rank))")
        self.num_samples = _int("num_samples", num_samples, 0, "an int >= 0 (the size of the data set)")
        if num_shards is None or shard_id is None:
            ctx = require_init("DistributedSampler(num_shards=None or shard_id=None)")
            num_shards = ctx.world.size if num_shards is None else num_shards
            shard_id = ctx.world.rank if shard_id is None else shard_id
        self.num_shards = _int("num_shards", num_shards, 1, "an int >= 1 (the number of ranks)")
        if isinstance(shard_id, bool) or not isinstance(shard_id, (int, np.integer)) \
                or not 0 <= shard_id < self.num_shards:
            raise invalid("shard_id", shard_id, f"an int in 0..{self.num_shards - 1} (num_shards={self.num_shards})")
        self.shard_id = int(shard_id)
        for name, v in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(v, (bool, np.bool_)):
                raise invalid(name, v, "True or False")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = _int("seed", seed, 0, "an int >= 0")
        self.epoch = 0
        n, s = self.num_samples, self.num_shards
        self.total_size = (n // s) * s if self.drop_last else -(-n // s) * s
        self.num_per_shard = self.total_size // s

    def set_epoch(self, epoch):
        """Use the permutation of ``epoch`` (an int >= 0) from now on."""
        self.epoch = _int("epoch", epoch, 0, "an int >= 0")

    def indices(self):
        """This shard's indices for the current epoch, as an int64 array."""
        n = self.num_samples
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n)
        if self.total_size > n:  # wrap around, more than once when n < num_shards
            order = np.resize(order, self.total_size)
        else:
            order = order[:self.total_size]
        return order[self.shard_id:self.total_size:self.num_shards].astype(np.int64)

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_per_shard

    def __repr__(self):
        return (f"DistributedSampler(num_samples={self.num_samples}, num_shards={self.num_shards}, "
                f"shard_id={self.shard_id}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")


__all__ = ["DistributedSampler"]
