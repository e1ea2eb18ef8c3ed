"""The comparison across hosts, word by word (mpicomm._reliability.agreement.cross_host): two
rows of a real progress window stand for this rank's and the next host's first member's,
filled as the dispatcher fills them (ring words, the history's checkpoints, EPOCH, REPORTED,
POISON). The whole path, with real ranks on two hosts, is tests/test_two_host.py; this file
runs each case of the comparison itself, including those that a job shows only by timing.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpicomm._callspec import REFUSED
from mpicomm._reliability import agreement as agr
from mpicomm._reliability.progress import (AT_HIST, CALLS_N, ENTERED, EPOCH, F, GHASH, HMASK, HMUL, MEMBERS, POISON,
                                           REPORTED, Progress, calls_base, checkpoint)


class Group:
    """What the progress window needs of a group: its name and world ranks."""

    def __init__(self, name):
        self.name, self.ranks = name, [0]


class Row:
    """One group's row: its calls as the dispatcher publishes them (ring word, history)."""

    def __init__(self, p, g):
        self.m, self.b = p.m, p.add(Group(g))
        self.base = self.b - ENTERED
        self.m[self.base + GHASH] = 7
        self.m[self.base + MEMBERS] = 11

    def calls(self, sigs, first=1):
        """Calls ``first``, ``first + 1``, ... with these signatures."""
        m, b = self.m, self.b
        for i, sig in enumerate(sigs):
            seq = first + i
            w = seq << 32 | sig
            m[calls_base(b) + seq % CALLS_N] = w
            h = m[b + AT_HIST] = (m[b + AT_HIST] * HMUL ^ w) & HMASK
            if not seq % 256:
                checkpoint(m, b, seq, h)

    def words(self):
        """(row, ring) as the comparison reads the other rank's (an RMA read)."""
        m = np.frombuffer(self.m, np.int64)
        return m[self.base:self.base + F].copy(), m[calls_base(self.b):calls_base(self.b) + CALLS_N].copy()


@pytest.fixture
def rows():
    from mpi4py import MPI

    p = Progress(MPI.COMM_SELF, 0)
    try:
        yield p, Row(p, "mine"), Row(p, "theirs")
    finally:
        p.close(True)


def compare(p, mine, theirs):
    row, ring = theirs.words()
    return agr.cross_host(p, None, mine.b, row, ring)


def sigs(rng, n):
    return [int(s) for s in rng.integers(1, 1 << 31, n)]


@pytest.mark.mpi
def test_same_calls_agree_in_the_rings_and_in_the_histories(rows):
    p, mine, theirs = rows
    s = sigs(np.random.default_rng(1), 600)
    mine.calls(s)
    theirs.calls(s[:520])   # behind by 80 calls: rings and checkpoints 256 and 512 in common
    assert compare(p, mine, theirs) is None


@pytest.mark.mpi
def test_a_call_in_both_rings_is_named(rows):
    p, mine, theirs = rows
    s = sigs(np.random.default_rng(2), 100)
    t = list(s)
    t[57] ^= 0x10   # call 58
    mine.calls(s)
    theirs.calls(t)
    first, a, b, since = compare(p, mine, theirs)
    assert (first, a, b, since) == (58, 58 << 32 | s[57], 58 << 32 | t[57], None)


@pytest.mark.mpi
def test_a_call_gone_from_the_rings_is_found_by_the_histories(rows):
    p, mine, theirs = rows
    s = sigs(np.random.default_rng(3), 1200)
    t = list(s)
    t[1] ^= 0x10   # call 2, long gone from both rings
    mine.calls(s)
    theirs.calls(t[:700])   # the rings share no call (mine: 945-1200, theirs: 445-700)
    first, a, b, since = compare(p, mine, theirs)
    assert (first, since) == (256, 0)   # the first checkpoint both hold, none agreed before it
    assert a != b


@pytest.mark.mpi
def test_histories_compare_only_from_the_same_epoch(rows):
    p, mine, theirs = rows
    s = sigs(np.random.default_rng(4), 1200)
    t = list(s)
    t[1] ^= 0x10
    mine.calls(s[:300])
    theirs.calls(t[:300])
    for r in (mine, theirs):   # both raised in call 300: their histories start again there
        r.m[r.b + AT_HIST] = 0
        r.m[r.base + EPOCH] = 300
    mine.calls(s[300:], first=301)
    theirs.calls(s[300:700], first=301)
    assert compare(p, mine, theirs) is None   # checkpoint 256 (before the epoch) is passed over
    t2 = list(s[700:800])
    t2[10] ^= 1                                # call 711 differs, checkpoint 768 with it
    theirs.calls(t2, first=701)
    assert compare(p, mine, theirs)[::3] == (768, 512)   # (agreed at 512)
    theirs.m[theirs.base + EPOCH] = 301        # one rank raised in another call: not comparable
    assert compare(p, mine, theirs) is None


@pytest.mark.mpi
def test_reports_refusals_and_other_groups_are_passed_over(rows):
    p, mine, theirs = rows
    s = sigs(np.random.default_rng(5), 50)
    t = list(s)
    t[9] = REFUSED   # call 10 refused on that rank: a refusal, not a difference
    mine.calls(s)
    theirs.calls(t)
    assert compare(p, mine, theirs) is None
    t[19] ^= 4       # call 20 differs, but that rank raised a report for it (REPORTED)
    theirs.calls(t[19:20], first=20)
    theirs.m[theirs.base + REPORTED] = 20
    assert compare(p, mine, theirs) is None
    theirs.m[theirs.base + REPORTED] = 0
    assert compare(p, mine, theirs)[0] == 20
    mine.m[mine.base + POISON] = agr.poison_word(20, 3)   # a report waits here: not now
    assert compare(p, mine, theirs) is None
    mine.m[mine.base + POISON] = 0
    theirs.m[theirs.base + MEMBERS] = 12   # another group at that row: not comparable
    assert compare(p, mine, theirs) is None
