"""The progress window's words that more than one writer touches: the POISON word goes
through compare-and-swap and atomic swap (mpicomm._reliability.progress.Progress.cas/swap),
a call's description (SPEC) through a seqlock (SPECSEQ ... SPECEND). Real windows, real
ranks: the peers' RMA atomics and this rank's two threads race on one word here."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from mpicomm._reliability import agreement as agr
from mpicomm._reliability.progress import (ENTERED, F, HDR, REASON_SIZE, REASON_SLOTS, REASON_WORDS, REASONS, SPEC_AT,
                                           SPEC_N, SPEC_SLOTS, SPECSEQ, Progress, reason_tag)

N_ADDS = 300


class Group:
    def __init__(self, name):
        self.name, self.ranks = name, [0]


class Spec:
    def __init__(self, words):
        self._w = list(words)

    def words(self):
        return self._w


def _add_by_cas(p, rank, index, n, counts):
    """``n`` increments of the word by compare-and-swap loops; counts[0] += the retries."""
    for _ in range(n):
        while True:
            old = p.read_words(rank, index, 1)
            if old is None:
                raise AssertionError(f"rank {rank}'s window did not answer")
            if p.cas(rank, index, int(old[0]), int(old[0]) + 1) == int(old[0]):
                break
            counts[0] += 1


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_compare_and_swap_loses_no_store_between_ranks_and_threads():
    """Every rank adds to one word of rank 0's window by compare-and-swap, rank 0 from two
    threads at once: the word ends at exactly the number of adds (a read followed by a
    plain store loses some of them)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    p = Progress(comm, rank)
    try:
        if p.win is None:
            pytest.fail("no RMA window on this MPI: the atomics cannot be tested")
        row = p.add(Group("atomics"))
        index = row - ENTERED + SPECSEQ   # any word of the row (0 here, alike on every rank)
        comm.Barrier()
        counts = [0]
        rng = np.random.default_rng(1234 + rank)
        mine = N_ADDS + int(rng.integers(0, 50))
        extra = None
        if rank == 0:
            extra = threading.Thread(target=_add_by_cas, args=(p, 0, index, N_ADDS, counts))
            extra.start()
        _add_by_cas(p, 0, index, mine, counts)
        if extra is not None:
            extra.join()
        expected = comm.allreduce(mine) + N_ADDS
        comm.Barrier()
        got = p.read_words(0, index, 1)
        # a compare that does not match changes nothing and returns what is there
        comm.Barrier()
        no_match = p.cas(0, index, expected + 1, -5) if rank == n - 1 else None
        comm.Barrier()
        after = p.read_words(0, index, 1)
        comm.Barrier()
        # swap stores whatever is there and returns the old value, from every rank in turn
        swapped = None
        for r in range(n):
            if rank == r:
                swapped = p.swap(0, index, 1000 + r)
            comm.Barrier()
        last = p.read_words(0, index, 1)
        # (every rank reaches every barrier, whatever it read: the assertions come after)
        assert got is not None and int(got[0]) == expected, (got, expected)
        assert no_match in ((expected,) if rank == n - 1 else (None,))
        assert int(after[0]) == expected
        assert swapped == (expected if rank == 0 else 1000 + rank - 1)
        assert int(last[0]) == 1000 + n - 1
    finally:
        comm.Barrier()
        p.close(True)


def test_atomics_without_a_window_use_the_lock():
    """Without RMA (a private table): this rank's own word still loses no store between
    threads; a peer's word cannot be reached (None)."""
    p = Progress.__new__(Progress)
    p.win, p.wrank, p.lock = None, 0, threading.Lock()
    p.m = memoryview(bytearray(64)).cast("q")
    for i in range(8):
        p.m[i] = 0
    counts = [0]

    def own(n):
        for _ in range(n):
            while True:
                old = int(p.m[3])
                if p.cas(0, 3, old, old + 1) == old:
                    break
                counts[0] += 1

    ts = [threading.Thread(target=own, args=(2000,)) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert p.m[3] == 8000
    assert p.cas(1, 3, 8000, 0) is None and p.swap(1, 3, 5) is None and p.m[3] == 8000
    assert p.swap(0, 3, 42) == 8000 and p.m[3] == 42


def test_a_description_copied_while_it_is_written_is_not_taken():
    """spec_words takes a row's description only where its slot's SPECSEQ and SPECEND agree:
    a copy taken halfway through publish_spec (SPECEND already the new call's) is refused,
    and so is one of another call."""
    rng = np.random.default_rng(7)
    m = memoryview(bytearray(8 * F)).cast("q")
    for i in range(F):
        m[i] = 0
    b = ENTERED
    old = [int(v) for v in rng.integers(1, 1 << 40, SPEC_N)]
    new = [int(v) for v in rng.integers(1, 1 << 40, SPEC_N)]
    later = 5 + SPEC_SLOTS   # the next call that takes call 5's slot
    agr.publish_spec(m, b, 5, Spec(old))
    row = np.frombuffer(m, np.int64).copy()
    assert list(agr.spec_words(row, 5)) == old
    assert agr.spec_words(row, 6) is None and agr.spec_words(row, later) is None
    # halfway through publishing call `later` in slot 5's: SPECEND says later, SPECSEQ still 5
    at = SPEC_AT[5 % SPEC_SLOTS]
    half = row.copy()
    half[at + 1 + SPEC_N] = later
    half[at + 1:at + 4] = new[:3]
    assert agr.spec_words(half, 5) is None and agr.spec_words(half, later) is None
    agr.publish_spec(m, b, later, Spec(new))
    row = np.frombuffer(m, np.int64).copy()
    assert list(agr.spec_words(row, later)) == new and agr.spec_words(row, 5) is None


def test_the_last_calls_descriptions_are_kept():
    """A rank keeps its descriptions of its last SPEC_SLOTS calls (a refusing member reads
    the reported call's while this rank already describes the call it waits in next); each
    later call's takes the slot of the call SPEC_SLOTS before it."""
    rng = np.random.default_rng(8)
    m = memoryview(bytearray(8 * F)).cast("q")
    for i in range(F):
        m[i] = 0
    b = ENTERED
    words = {c: [int(v) for v in rng.integers(1, 1 << 40, SPEC_N)] for c in range(20, 20 + 2 * SPEC_SLOTS)}
    for c, w in words.items():
        agr.publish_spec(m, b, c, Spec(w))
        row = np.frombuffer(m, np.int64).copy()
        for k in words:
            got = agr.spec_words(row, k)
            if c - SPEC_SLOTS < k <= c:
                assert got is not None and list(got) == words[k], (c, k)
                assert agr.spec_published(m, b, k)
            else:
                assert got is None and not agr.spec_published(m, b, k), (c, k)


def test_decisions_are_kept_per_call():
    """A reporter's decision on a fresh communicator is kept per call (its last SPEC_SLOTS):
    a member that reads the decision on call k gets it, or "not yet", even where the reporter
    has since decided on later calls; never a later call's decision."""
    rng = np.random.default_rng(9)
    words = np.zeros(SPEC_SLOTS, np.int64)
    calls = range(40, 40 + 3 * SPEC_SLOTS)
    fresh = {k: bool(rng.integers(2)) for k in calls}
    for k in calls:
        assert agr.decision_in(words, k) is None   # not decided yet
        words[agr.decision_index(k) - agr.decision_index(0)] = agr.decision_word(k, fresh[k])
        for j in calls:
            got = agr.decision_in(words, j)
            assert got == (fresh[j] if k - SPEC_SLOTS < j <= k else None), (k, j, got)


def _private_progress():
    """A Progress with a private table (no RMA window): this rank reads its own words."""
    p = Progress.__new__(Progress)
    p.win, p.wrank, p.lock, p._reasons_written = None, 0, threading.Lock(), 0
    p.m = memoryview(bytearray(8 * HDR)).cast("q")
    for i in range(HDR):
        p.m[i] = 0
    return p


def test_reports_are_kept_per_call():
    """A rank's agreement reports (refusals, disagreements) are kept per call, its last
    REASON_SLOTS: a member asking for call k's report gets that call's text, or None once it
    is gone, never another call's (of this group or another); a report rewritten for the same
    call (completed) keeps its slot."""
    rng = np.random.default_rng(10)
    p = _private_progress()
    calls = [("world", k) for k in range(30, 30 + 2 * REASON_SLOTS)] + [("other", 33)]
    texts = {c: f"rank 0 refused call {c[1]} of {c[0]}: {rng.integers(1 << 40)}" for c in calls}
    done = []
    for c in calls:
        p.set_reason(texts[c], tag=reason_tag(*c))
        done.append(c)
        for k in calls:
            got = p.reason_of(0, tag=reason_tag(*k))
            assert got == (texts[k] if k in done[-REASON_SLOTS:] else None), (c, k, got)
    # the newest call's report completed: its slot is taken again, the others stay
    p.set_reason(texts[calls[-1]] + " (completed)", tag=reason_tag(*calls[-1]))
    assert p.reason_of(0, tag=reason_tag(*calls[-1])) == texts[calls[-1]] + " (completed)"
    for k in calls[-REASON_SLOTS:-1]:
        assert p.reason_of(0, tag=reason_tag(*k)) == texts[k], k
    assert p.latest_reason_of(0, "world") == texts[calls[-2]]
    assert p.latest_reason_of(0, "world", before=calls[-2][1]) == texts[calls[-3]]
    assert p.latest_reason_of(0, "nowhere") is None
    # a long text is cut to fit its slot, and the next slot's words are untouched
    p.set_reason("x" * (8 * REASON_WORDS + 40), tag=reason_tag("world", 99))
    assert p.reason_of(0, tag=reason_tag("world", 99)) == "x" * (8 * REASON_WORDS)


def test_a_report_copied_while_it_is_written_is_not_taken():
    """reason_of takes a slot only where its first and last words (the write's number) agree:
    a copy taken halfway through a rewrite, even of the same call's report, is refused."""
    p = _private_progress()
    tag = reason_tag("world", 7)
    p.set_reason("first text of call 7", tag=tag)
    at = next(REASONS + i * REASON_SIZE for i in range(REASON_SLOTS) if p.m[REASONS + i * REASON_SIZE + 1] == tag)
    p.m[at + REASON_SIZE - 1] = p.m[at] + 1   # a rewrite has begun: the end's number first
    p.m[at + 3] = int.from_bytes(b"SECOND t", "little")
    assert p._reasons(0, lambda t: t == tag) == []   # (read again for a while, then given up)
    assert p.reason_of(0, tag=tag) is None
