"""The agreement check: ranks that disagree on a call are caught on every call.

Every call's :class:`~mpicomm._callspec.CallSpec` hashes to a 32-bit signature, built once
per prepared call. The dispatcher publishes ``seq << 32 | signature`` at ``seq % RING_N``
of the group's ring, twice: in its progress row (read by peers on any host, RMA) and in a
window that the ranks of one host share (``MPI.Win.Allocate_shared``), where its two
members on the host (up to ALL_PEERS of them; beyond, its two neighbours) read it with plain
loads right after their own call of that sequence number. The cost per call is two stores,
one load per host member compared and one load of the row's POISON word before and after
the call: it does not grow with the number of hosts.

What happens on a disagreement:

* **Both ranks took part** (different dtype, count, op, root, collective): the later of two
  host neighbours sees the other's word after its call and raises
  CollectiveMismatchError before returning (no wrong result leaves the call). It writes the
  report into its progress window and POISON into every member's row; they raise it at
  their next call on the group. A call that cannot complete (MPI or NCCL waits for data
  that never comes) is found by the watchdog, which compares the ranks' ring words once a
  call has waited ``TIMING.wait_check`` s (mpicomm._timing) and ends the job with every rank's call named.
* **A rank refused the call** (an argument error on that rank only): it publishes the
  refusal (signature REFUSED) and POISON, waits until every member has either refused too
  or entered the call, and, where a member is waiting inside the call, takes part with a
  stand-in built from that member's published spec, so the call completes; the members
  then raise CollectiveMismatchError naming the rank and its reason. A rank that reaches
  the call after POISON refuses it the same way.
* Afterwards (MPI), where any rank had entered the call, every member replaces the
  group's communicator with a fresh one at its next call (``MPI_Comm_dup``): messages of
  the failed call left unmatched can never reach a later call. The group goes on.

The same check runs on NCCL: signatures are host facts, and a stand-in is an NCCL call on
a scratch GPU buffer. Uneven calls with explicit per-rank sizes cannot be stood in for
(the peers' sizes are published as a hash): there a waiting rank ends the job.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .._callspec import REFUSED
from .progress import (CALLS_N, DECIDED, ENTERED, DONE, EPOCH, GHASH, MEMBERS, POISON, REPORTED, ROWS, SPEC_AT, SPEC_N, SPEC_SLOTS,
                       F, HDR, calls_base, checkpoints, reason_tag)

# calls kept in the host-shared copy of each row's ring: a rank compares its call with a host
# neighbour's word for the same call, so the copy must hold every call a rank can be ahead of a
# neighbour by (a sender of reduce/gather, a broadcast root, async calls run ahead of the rank
# that receives: 16 calls ahead within 20 calls of a loop were seen). 64 KiB a rank: ROWS * 64 words
HOST_N = 64
HOST_MASK = HOST_N - 1   # seq & HOST_MASK: call seq's place there (HOST_N is a power of two)
RING = F              # where a row read by read_row holds its ring of calls
RING_N = CALLS_N

ALL_PEERS = 8         # up to this many members on a host, each compares with all of them
XHOST_GROUPS = 8      # groups compared across hosts per round (two RMA reads each)
# (the waits: mpicomm._timing.TIMING)


ACROSS = 1 << 23     # in a POISON word: the report of a comparison across hosts (its text is in
#                      the reporter's window, XREASON)


def poison_word(seq, wrank, across=False):
    return seq << 24 | (ACROSS if across else 0) | (wrank + 1)


def poison_fields(word):
    """(sequence number, world rank) of a POISON word."""
    return word >> 24, (word & (ACROSS - 1)) - 1


def report_of(progress, word, name):
    """The text of the report a POISON word of group ``name``'s row is about (the reporter's
    words about that call), or None (none, or no longer kept)."""
    k, who = poison_fields(word)
    return progress.reason_of(who, across=bool(word & ACROSS), tag=reason_tag(name, k))


class HostRings:
    """The host-shared copy of every rank's rings: one segment per rank of this host."""

    def __init__(self, local_comm, world_rank, enabled):
        self.views = {}          # world rank on this host -> its segment (int64 memoryview)
        self.comm = self.win = None
        self.host = world_rank   # this host's name in the check: the lowest world rank on it
        if not enabled or local_comm is None or local_comm.Get_size() < 2:
            return
        ranks = local_comm.allgather(world_rank)   # (in the rank order of its Dup below)
        self.host = min(ranks)
        try:
            from mpi4py import MPI

            from .abort import quiet

            self.comm = local_comm.Dup()
            self.win = quiet(lambda: MPI.Win.Allocate_shared(ROWS * HOST_N * 8, 8, comm=self.comm))
            for i, r in enumerate(ranks):
                buf, _ = self.win.Shared_query(i)
                self.views[r] = memoryview(buf).cast("B").cast("q")
            mine = self.views[world_rank]
            for i in range(ROWS * HOST_N):
                mine[i] = 0
            self.comm.Barrier()
        except Exception:   # no shared memory here: only the watchdog compares
            self.views = {}

    @staticmethod
    def base(slot):
        """The first ring word of the row at window index ``slot`` in a shared segment."""
        return (slot - HDR) // F * HOST_N

    def close(self, free):
        w, self.win = self.win, None
        self.views = {}
        if free and w is not None:
            try:
                w.Free()
            except Exception:
                pass
        if free and self.comm is not None:
            try:
                self.comm.Free()
            except Exception:
                pass
        self.comm = None


def attach(disp, rings, progress, comm, wrank):
    """Collective over the group's communicator ``comm``: learn every member's row and give
    the dispatcher its host neighbours' rings (the ranks before and after it on this host)."""
    g = disp.group
    slot = progress.slot(g)
    host = getattr(rings, "host", wrank)
    mine = rings.views.get(wrank)
    if mine is not None and slot is not None:
        # the row may have been a destroyed group's: its old words must not meet this
        # group's sequence numbers (the peers read them only after the allgather below)
        b = rings.base(slot)
        for i in range(HOST_N):
            mine[b + i] = 0
    allv = comm.allgather((wrank, slot, host))
    disp.slots = tuple(v[1] for v in allv)
    if slot is None or any(s is None for s in disp.slots) or not disp.check:
        return
    # across hosts: the group's first member on each host compares its calls with the next
    # host's first member (the watchdog, about once a second: cross_host below)
    firsts = {}
    for j, v in enumerate(allv):
        firsts.setdefault(v[2], j)
    leaders = list(firsts.values())
    if len(leaders) > 1 and g.rank in leaders:
        j = leaders[(leaders.index(g.rank) + 1) % len(leaders)]
        # (group rank, world rank, row) of the next host's first member, and whether this rank
        # tells the members of a difference (of two hosts, the first member of the lower rank)
        disp.xhost = (j, allv[j][0], allv[j][1], len(leaders) > 2 or allv[g.rank][0] < allv[j][0])
    if not rings.views:
        return
    host = [i for i, v in enumerate(allv) if v[0] in rings.views]
    if len(host) < 2:
        return
    if len(host) <= ALL_PEERS:   # every member on this host: no wrong result leaves a call
        near = [j for j in host if j != g.rank]
    else:                        # the two neighbours: the later of any two that differ finds it
        me = host.index(g.rank)
        near = []
        for j in (host[me - 1], host[(me + 1) % len(host)]):
            if j != g.rank and j not in near:
                near.append(j)
    disp.peers = tuple((rings.views[allv[j][0]], rings.base(allv[j][1]), j) for j in near)
    disp.p1, disp.p1b, disp.p1j = disp.peers[0]
    disp.more = disp.peers[1:]
    disp.shr = rings.views[wrank]   # set last: the dispatcher compares where it is set
    disp.shb = rings.base(slot)


def cross_host_start(progress, disp):
    """Start reading the next host's first member's row and ring of calls (two RMA reads,
    completed at the watchdog's later wakes: cross_host)."""
    j, wr, slot, _ = disp.xhost
    r1 = progress.start_read(wr, slot, F)
    r2 = progress.start_read(wr, calls_base(slot + ENTERED), CALLS_N)
    return None if r1 is None or r2 is None else (r1, r2)


def cross_host(progress, disp, b, row, theirs):
    """Compare this rank's ring of calls for its group (row ENTERED index ``b``) with the
    next host's first member's (its ``row`` and ring ``theirs``, read by cross_host_start):
    every call both rings hold, but those refused or raised for on either rank (REPORTED)
    and while either rank has a member's report (POISON) to take in; then the histories of
    every call (HIST's checkpoints, since the same EPOCH), which also cover the calls that have
    left the rings. Returns None when they agree, else (the first call that differs, this
    rank's word, theirs, None), or for histories (the first checkpoint that differs, this
    rank's hash, theirs, the last call where they agreed)."""
    m = progress.m
    base = b - ENTERED
    if m[base + POISON] or int(row[GHASH]) != int(m[base + GHASH]) or int(row[MEMBERS]) != int(m[base + MEMBERS]) \
            or int(row[POISON]):
        return None
    done = max(int(m[base + REPORTED]), int(row[REPORTED]))
    mine = progress.read_words(progress.wrank, calls_base(b), CALLS_N)
    first = None
    for i in range(CALLS_N):
        a, t = int(mine[i]), int(theirs[i])
        if a != t and a and a >> 32 == t >> 32 and a >> 32 > done \
                and a & 0xFFFFFFFF != REFUSED and t & 0xFFFFFFFF != REFUSED:
            if first is None or a >> 32 < first[0]:
                first = (a >> 32, a, t, None)
    if first is not None:
        return first
    epoch = int(m[base + EPOCH])
    if epoch != int(row[EPOCH]):   # one of them raised in another call: not comparable
        return None
    mine_ck, theirs_ck = checkpoints(m, base), checkpoints(row, 0)
    agreed = max(epoch, done)
    for seq in sorted(set(mine_ck) & set(theirs_ck)):
        if seq <= max(epoch, done):
            continue
        if mine_ck[seq] != theirs_ck[seq]:
            return seq, mine_ck[seq], theirs_ck[seq], agreed
        agreed = seq
    return None


def read_row(progress, wrank, slot):
    """World rank ``wrank``'s row (F words at ``slot``) followed by its ring of calls
    (RING_N words from RING), or None."""
    row = progress.read_words(wrank, slot, F)
    if row is None:
        return None
    ring = progress.read_words(wrank, calls_base(slot + ENTERED), CALLS_N)
    return None if ring is None else np.concatenate([row, ring])


def ring_word(row, seq):
    """The ring word a row holds for ``seq``: (word or 0, state) with state 'refused',
    'entered', 'behind' (not there yet, or still preparing it) or 'ahead' (moved past the ring)."""
    w = int(row[RING + (seq % RING_N)])
    if w >> 32 == seq:
        return w, ("refused" if w & 0xFFFFFFFF == REFUSED else "entered")
    if int(row[ENTERED]) >> 4 <= seq:   # (entered but no word yet: still preparing the call)
        return 0, "behind"
    return 0, "ahead"


def pending(row, seq):
    """True when the row's rank is inside call ``seq`` (entered, not done)."""
    return int(row[ENTERED]) >> 4 == seq and row[ENTERED] != row[DONE]


def spec_words(row, seq):
    """The SPEC words a row (a copy) published for ``seq``, or None (no description of that
    call kept, or a copy taken while they were being written)."""
    at = SPEC_AT[seq % SPEC_SLOTS]
    if int(row[at]) != seq or int(row[at + 1 + SPEC_N]) != seq:
        return None
    return row[at + 1:at + 1 + SPEC_N]


def spec_published(m, b, seq):
    """True when the row at ENTERED index ``b`` of this rank's window ``m`` holds its
    description of call ``seq``."""
    at = b - ENTERED + SPEC_AT[seq % SPEC_SLOTS]
    return m[at] == seq and m[at + 1 + SPEC_N] == seq


def decision_word(k, fresh):
    """The word of a decision on call ``k``: a fresh communicator (``fresh``) or not."""
    return k << 2 | 2 | (1 if fresh else 0)


def decision_index(k):
    """Where a row holds its decision on call ``k`` (from its first word)."""
    return DECIDED + k % SPEC_SLOTS


def decision_in(words, k):
    """The decision on call ``k`` in ``words`` (a row's decision words, as read from
    decision_index(0)): True (a fresh communicator), False, or None (not decided yet)."""
    w = int(words[k % SPEC_SLOTS])
    return bool(w & 1) if w >> 2 == k and w & 2 else None


def decision_of(progress, who, slot, k):
    """World rank ``who``'s decision on call ``k``, read from its row at ``slot`` (the
    group's row offset): True, False, None (not decided yet), or ``...`` where the row cannot
    be read (the rank is gone)."""
    words = progress.read_words(who, slot + decision_index(0), SPEC_SLOTS)
    return ... if words is None else decision_in(words, k)


_PUBLISH = threading.Lock()   # the main thread and the watchdog both publish descriptions


def publish_spec(m, b, seq, spec):
    """Write ``spec`` as this rank's call ``seq`` into the row at ENTERED index ``b``, in the
    slot of ``seq`` (the descriptions of the last SPEC_SLOTS calls stay): SPECEND first,
    SPECSEQ last (see spec_words); one writer at a time."""
    at = b - ENTERED + SPEC_AT[seq % SPEC_SLOTS]
    with _PUBLISH:
        m[at + 1 + SPEC_N] = seq
        for i, v in enumerate(spec.words()):
            m[at + 1 + i] = int(v) if v is not None else 0
        m[at] = seq


def poison_index(slot):
    return slot + POISON


def wait_rows(progress, members, slots, done, timeout=None):
    """Read the rows of group ranks ``members`` (world ranks, their row ``slots``) until
    ``done(rows)`` is true; returns the rows ({group rank: row or None})."""
    t0 = time.monotonic()
    while True:
        rows = {j: read_row(progress, wr, slots[j]) for j, wr in members.items()}
        if done(rows):
            return rows
        if timeout is not None and time.monotonic() - t0 > timeout:
            return rows
        time.sleep(0.002)


def set_checking(on, group=None):
    """Turn the agreement check of ``group`` (None: the world) off (``on`` False) or back
    on, as ``init(check=False)`` leaves it: for the bench's on/off comparison in one run."""
    from .._state import get_group

    disp = get_group(group).disp
    if not on:
        _OFF[id(disp)] = (disp.check, disp.peers, disp.shr)
        disp.check, disp.peers, disp.shr = False, (), None
    elif id(disp) in _OFF:
        disp.check, disp.peers, disp.shr = _OFF.pop(id(disp))


_OFF = {}
