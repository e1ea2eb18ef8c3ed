"""The MPI transport's shared-memory strategy for one group (ShmPath): when a blocking
collective tries the shared window (mpicomm._backends.shm), opening it at the first use, and
falling back to the ordinary path where it cannot run."""
from __future__ import annotations

import os

from .._ops import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER
from .shm import ShmGroup, mismatch_error, signature
from .shm_config import CROWDED_THRESHOLD, DEFAULT_THRESHOLD, WHOLE, thresholds


class ShmPath:
    """The shared-memory strategy of one group's MPI transport.

    ``min_<collective>`` is the smallest message in bytes that tries the path (one
    integer compare on the small-message path). Each entry point returns the output
    when the path ran, or None when the ordinary path must run instead: the group spans
    hosts or the window cannot be allocated. Both are found collectively, alike on every
    rank, and remembered (the thresholds become NEVER). Blocking calls only.
    """

    def __init__(self, comm, env=os.environ):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.group = None       # the ShmGroup, opened at the first call that may use it
        self._closed = False
        self.configure(env)

    def configure(self, env=os.environ):
        """Set the thresholds from MPICOMM_SHM_THRESHOLD in ``env`` (call it alike on every rank)."""
        t = thresholds(self.size, env, self.group is not None and self.group.crowded)
        self.min_all_reduce = t["all_reduce"]
        self.min_all_gather = t["all_gather"]
        self.min_reduce_scatter = t["reduce_scatter"]
        self.min_broadcast = t["broadcast"]

    def disable(self):
        self.configure({"MPICOMM_SHM_THRESHOLD": "off"})

    def open(self):
        """The group's ShmGroup, opening it at the first use (collective); None if unavailable."""
        g = self.group
        if g is None and not self._closed:
            g = ShmGroup.open(self.comm)
            if g is None:
                self.disable()
                self._closed = True
                return None
            self.group = g
            if g.crowded and self.min_all_reduce == DEFAULT_THRESHOLD["all_reduce"]:
                self.min_all_reduce = CROWDED_THRESHOLD    # the default, crowded
        return g

    def close(self):
        if self.group is not None:
            self.group.close()
            self.group = None

    def _go(self, g, name, gen, o, sig):
        if gen is None:              # the window could not grow (on every rank alike)
            self.disable()
            return None
        g.run(name, gen, sig)
        return o

    @staticmethod
    def _whole(g, sig):
        """One piece per message (MPICOMM_SHM_PIECE=0): the window grows to the message, so
        ranks whose calls differ could disagree on growing it; compare before (an allgather)."""
        if g.piece >= WHOLE:
            rows = g.comm.allgather(sig)
            if any(s != sig for s in rows):
                raise mismatch_error(rows, "on the shared-memory path")

    def all_reduce(self, x, o, row, op):
        g = self.open()
        if g is None or x.nbytes < self.min_all_reduce:   # (raised when the group opened)
            return None
        sig = signature(ALL_REDUCE, x, op)
        self._whole(g, sig)
        return self._go(g, "all_reduce", g.all_reduce(x, o, row, op), o, sig)

    def reduce_scatter(self, x, o, row, op):
        g = self.open()
        if g is None:
            return None
        sig = signature(REDUCE_SCATTER, x, op)
        self._whole(g, sig)
        return self._go(g, "reduce_scatter", g.reduce_scatter(x, o, row, op), o, sig)

    def all_gather(self, x, o):
        g = self.open()
        if g is None:
            return None
        sig = signature(ALL_GATHER, x)
        self._whole(g, sig)
        return self._go(g, "all_gather", g.all_gather(x, o), o, sig)

    def broadcast(self, h, root):
        g = self.open()
        if g is None:
            return None
        sig = signature(BROADCAST, h, root=root)
        self._whole(g, sig)
        return self._go(g, "broadcast", g.broadcast(h, root), h, sig)
