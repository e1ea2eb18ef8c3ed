"""Published progress: where every rank is, readable by its peers without their help.

Each rank owns a row per group in an MPI RMA window (on an mpicomm-owned dup of the
world): the sequence number of the last collective it entered on that group, which
collective, the last one it completed, and when. The dispatcher writes these with
plain stores into its own window memory; peers read them with a passive-target
``Rget`` only when diagnosing a timeout, with a bounded wait so that a dead peer
yields "unknown" instead of a hang.
"""
from __future__ import annotations

import os
import time
import zlib

import numpy as np

from .abort import quiet

# Window layout (int64): [magic, pid, exited, exit status, point-to-point call, its group,
# its tag, stack-dump request, then ROWS rows of F fields]. "exited" is set when the process
# leaves the script (atexit), with its exit status + 1 where known (0: unknown), so peers
# waiting on it can say so. P2P is the blocking send/recv in progress (0: none): see
# p2p_word; its group's hash and tag follow. DUMP is written by a peer (RMA put) to ask
# this rank's watchdog for its Python stack.
MAGIC = 0x6D7069636F6D6D  # "mpicomm"
EXITED = 2
XSTATUS = 3
P2P, P2P_GH, P2P_TAG = 4, 5, 6
DUMP = 7
HDR = 8
ROWS = 256         # groups published per rank (the last row is a shared, unpublished overflow)
F = 6
# entered/done hold (sequence number << 4 | collective code); a collective is in progress
# while they differ. The completion time is stamped by the watchdog, not the hot path.
# RAISED holds the same for the last call that raised on this rank before or instead of
# taking part (a local check failed): the peers' diagnosis names it. MEMBERS is a hash of
# the group's world ranks as this rank was given them (create_group's rank_ids).
GHASH, ENTERED, DONE, TDONE, RAISED, MEMBERS = range(F)
WORDS = HDR + ROWS * F
# the dispatcher writes a row's words by their offset from ENTERED: DONE + 1, RAISED + 3
assert DONE - ENTERED == 1 and RAISED - ENTERED == 3
READ_WAIT = 2.0   # seconds to wait for peers' rows before calling them unknown


def ghash(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def members_hash(ranks):
    """The MEMBERS word of a group of these world ranks."""
    return zlib.crc32(",".join(map(str, ranks)).encode()) & 0x7FFFFFFF


def p2p_word(count, code, peer):
    """The P2P header word: the call's running number (so that two equal calls in a row
    differ), its collective code (send or recv) and the peer's world rank."""
    return (count & 0xFFFFFF) << 28 | (peer & 0xFFFFFF) << 4 | code


def p2p_fields(word):
    """(code, peer world rank) of a P2P word."""
    return word & 15, (word >> 4) & 0xFFFFFF


class Progress:
    """This rank's progress window and its rows, one per group."""

    def __init__(self, world_comm, world_rank):
        from mpi4py import MPI

        self.wrank = world_rank
        self.rows = {}                   # Group -> index of its ENTERED word
        self.names = {}                  # group hash -> name (every rank knows every group's name)
        self._next = 0                   # rows handed out so far
        self._free = []                  # rows of destroyed groups
        self.win = None
        self.comm = None
        try:
            self.comm = world_comm.Dup()
            self.win = quiet(lambda: MPI.Win.Allocate(WORDS * 8, 8, comm=self.comm))
            mem = memoryview(self.win.tomemory()).cast("B")
            self.win.Lock_all()          # one passive epoch for the whole run: reads need no lock
        except Exception:                # no RMA here: keep a private table, peers show "unknown"
            self.win = None
            mem = memoryview(bytearray(WORDS * 8))
        self.m = mem.cast("q")
        self.m[0] = MAGIC
        self.m[1] = os.getpid()
        for i in range(EXITED, HDR):
            self.m[i] = 0

    def add(self, g):
        """A row for group ``g``; returns the index of its ENTERED word."""
        self.names[ghash(g.name)] = g.name
        if self._free:
            b = self._free.pop()
        elif self._next < ROWS - 1:
            b = HDR + self._next * F
            self._next += 1
        else:  # more live groups than rows: share the last row, which is not published
            b = HDR + (ROWS - 1) * F
            self.rows[g] = b + ENTERED
            return b + ENTERED
        m = self.m
        m[b + ENTERED] = m[b + DONE] = m[b + RAISED] = 0
        m[b + GHASH] = ghash(g.name)
        m[b + MEMBERS] = members_hash(g.ranks)
        self.rows[g] = b + ENTERED
        return b + ENTERED

    def mark_exited(self, status=None):
        """This process is leaving the script (with ``status``, None if unknown): peers
        that wait on it will say so."""
        if status is not None:
            self.m[XSTATUS] = int(status) + 1
        self.m[EXITED] = 1

    def request_dump(self, ranks):
        """Ask the watchdogs of world ``ranks`` to print their Python stacks (an RMA put
        into their DUMP word: works across hosts; a stopped process cannot answer)."""
        if self.win is None:
            return
        from mpi4py import MPI

        stamp = np.array([time.time_ns() & 0x7FFFFFFFFFFFFFFF], np.int64)
        reqs = []
        for r in ranks:
            if r == self.wrank:
                continue
            try:
                reqs.append(self.win.Rput([stamp, MPI.INT64_T], r, target=(DUMP, 1, MPI.INT64_T)))
            except Exception:
                pass
        deadline = time.monotonic() + READ_WAIT   # a dead peer must not hold up the report
        while reqs and time.monotonic() < deadline:
            reqs = [q for q in reqs if not q.Test()]
            if reqs:
                time.sleep(0.002)

    def name(self, g):
        self.names[ghash(g.name)] = g.name

    def remove(self, g):
        b = self.rows.pop(g, None)
        if b is not None and b - ENTERED != HDR + (ROWS - 1) * F:
            self.m[b - ENTERED + GHASH] = 0
            self._free.append(b - ENTERED)

    def poke(self):
        """Let a transport that emulates RMA with messages make progress for peers."""
        if self.win is not None:
            try:
                from mpi4py import MPI

                self.comm.Iprobe(MPI.ANY_SOURCE, 0x6D70)
            except Exception:
                pass

    def read_peers(self, ranks):
        """{world rank: int64 array of its window, or None if it did not answer in time}."""
        out = {r: None for r in ranks}
        if self.win is None:
            return out
        from mpi4py import MPI

        bufs, reqs = {}, {}
        for r in ranks:
            if r == self.wrank:
                out[r] = np.frombuffer(self.m, np.int64, WORDS).copy()
                continue
            buf = np.zeros(WORDS, np.int64)
            try:
                reqs[r] = self.win.Rget([buf, MPI.INT64_T], r)
                bufs[r] = buf
            except Exception:
                pass
        deadline = time.monotonic() + READ_WAIT
        while reqs and time.monotonic() < deadline:
            for r, q in list(reqs.items()):
                if q.Test():
                    del reqs[r]
                    if bufs[r][0] == MAGIC:
                        out[r] = bufs[r]
            if reqs:
                time.sleep(0.002)
        return out

    def close(self, free):
        w, self.win = self.win, None
        if w is not None:
            try:
                w.Unlock_all()
                if free:
                    w.Free()
            except Exception:
                pass
        if free and self.comm is not None:
            try:
                self.comm.Free()
            except Exception:
                pass
            self.comm = None
