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
import threading
import time
import zlib

import numpy as np

from .._timing import TIMING
from . import crash
from .abort import quiet

# Window layout (int64): [magic, pid, exited, exit status, point-to-point call, its group,
# its tag, stack-dump request, CUDA graphs replayed through mpicomm.replay, the key of the
# last one, the agreement report (its length in bytes, then REASON_WORDS words of UTF-8
# text), then ROWS rows of F fields]. REPLAYS counts this rank's mpicomm.replay calls: a
# replay that does not complete is diagnosed by comparing the counts (mpicomm._replay);
# REPLAY_KEY names the graph of the last one (0: a graph not made by mpicomm.capture, else
# a hash of the collectives it captured, the same on every rank that captured the same).
# REPLAY_WAIT, written by the watchdog alone, is the replay it sees pending (replay_wait:
# the graph's own replay number and key; 0: none), so that a rank that has replayed that
# graph fewer times names the collective its peers wait in. "exited" is set when the process
# leaves the script (atexit), with its exit status + 1 where known (0: unknown; FINALIZED:
# it called finalize(), after which it makes no call), so peers waiting on it can say so. P2P is the blocking send/recv in progress (0: none): see
# p2p_word; its group's hash and tag follow. DUMP is written by a peer (RMA put) to ask
# this rank's watchdog for its Python stack. The agreement reports are the texts of the last
# REASON_SLOTS disagreements or refusals this rank found or made (mpicomm._reliability.agreement),
# one slot per call: the ranks it tells read the one of the call they ask about from here.
MAGIC = 0x6D7069636F6D6D  # "mpicomm"
EXITED = 2
XSTATUS = 3
FINALIZED = -1   # the exit status word of a rank that called finalize()
P2P, P2P_GH, P2P_TAG = 4, 5, 6
DUMP = 7
REPLAYS = 8
REPLAY_KEY = 9
REPLAY_WAIT = 10
# The agreement reports: REASON_SLOTS slots of REASON_SIZE words from REASONS, each [its write's
# number, its call's tag (reason_tag: the group and the sequence number), the text's length in
# bytes, REASON_WORDS words of UTF-8 text, the write's number again]: the end's number written
# first, the first word last, so that a reader (which copies the slots in order) takes a text only
# where the two agree (a seqlock, as for SPEC below: never half of one text and half of another,
# even of one call's text rewritten). A call takes the slot that holds its tag already (its report
# rewritten, e.g. completed), else the one written longest ago: the reports of the last REASON_SLOTS calls
# this rank reported stay, and a reader asking for an older one finds it gone instead of reading
# another call's text (Progress.set_reason, reason_of).
REASON_WORDS = 64
REASON_SLOTS = 4
REASON_SIZE = REASON_WORDS + 4
REASONS = 11
XREASON_LEN = REASONS + REASON_SLOTS * REASON_SIZE   # the last report of the comparison across hosts
XREASON = XREASON_LEN + 1              # that this rank told its group's members: its length, its text
HDR = XREASON + REASON_WORDS
ROWS = 256         # groups published per rank (the last row is a shared, unpublished overflow)
# entered/done hold (sequence number << 4 | collective code); a collective is in progress
# while they differ. The completion time is stamped by the watchdog, not the hot path.
# RAISED holds the same for the last call that raised on this rank before or instead of
# taking part (a local check failed): the peers' diagnosis names it. MEMBERS is a hash of
# the group's world ranks as this rank was given them (create_group's rank_ids).
# The agreement check's words: POISON, written by peers (RMA put), says that a rank found
# a disagreement or refused call (its sequence number << 24 | that world rank + 1);
# SPECSEQ and the SPEC words describe this rank's call of that sequence number (the
# watchdog publishes them when a call waits, or when a peer's report asks for them);
# SPECEND repeats SPECSEQ after them: written first, SPECSEQ last, so that a reader (which
# copies the row in order) takes the words only where the two agree (a seqlock: never half
# of one call's description and half of another's).
(GHASH, ENTERED, DONE, TDONE, RAISED, MEMBERS, POISON, SPECSEQ) = range(8)
SPEC = 8
SPEC_N = 7
SPECEND = SPEC + SPEC_N
REPORTED = SPECEND + 1     # the last call this rank raised a disagreement or refusal for
# The group's history of calls, for the comparison across hosts at any call rate: HIST is a
# running hash of every call's ring word since the call EPOCH (the call in which this rank
# last raised a disagreement or refusal: there it starts again from 0, at the same call on
# every rank); CKPT holds checkpoints of it, CK_LEVELS levels of CK_N (call, hash) pairs, level
# L at the calls that are multiples of 1 << (CK_SHIFT + CK_STEP * L). One multiply-add and
# one store per call; a checkpoint's stores once in 1 << CK_SHIFT calls.
HIST = REPORTED + 1
EPOCH = HIST + 1
CKPT = EPOCH + 1
CK_LEVELS, CK_N, CK_SHIFT, CK_STEP = 3, 4, 8, 4
CK_MASK = (1 << CK_SHIFT) - 1   # a call with seq & CK_MASK == 0 records a checkpoint (checkpoint())
HMUL = 16777619             # h = (h * HMUL ^ word) & HMASK: FNV-1's 32-bit step over the
HMASK = 0xFFFFFFFF          # signature (the word's low half); its order counts
# The descriptions of calls (SPEC above) are kept for the last SPEC_SLOTS calls that had one,
# slot seq % SPEC_SLOTS: SPEC_AT[slot] is the index of that slot's SPECSEQ (slot 0 is SPECSEQ,
# the others follow the checkpoints), its SPEC_N words and SPECEND after it. A rank describes
# the call a report is about and the call it waits in: a refusing member needs the first
# while this rank may already be describing the second (agreement.publish_spec, spec_words).
SPEC_SLOTS = 4
_MORE = CKPT + CK_LEVELS * CK_N * 2
SPEC_AT = (SPECSEQ,) + tuple(_MORE + i * (SPEC_N + 2) for i in range(SPEC_SLOTS - 1))
# A reporter's or refuser's decision on a fresh communicator after call k, at DECIDED + k %
# SPEC_SLOTS: k << 2 | 2 | fresh (agreement.decision_word). Per call, so that a member reading
# the decision on call k gets it even where the rank has since reported a later call.
DECIDED = _MORE + (SPEC_SLOTS - 1) * (SPEC_N + 2)
F = DECIDED + SPEC_SLOTS
WORDS = HDR + ROWS * F
# After the rows: each row's ring of calls, CALLS_N words at calls_base(row): at
# seq % CALLS_N, the word of the group's call seq (seq << 32 | its signature), or of its
# refusal (signature REFUSED). One store per call; the host neighbours' copy is
# agreement.HostRings; the watchdog compares it across hosts and for a waiting call.
CALLS_N = 256
CALLS_MASK = CALLS_N - 1    # seq & CALLS_MASK: call seq's place in the ring (CALLS_N is a power of two)
XR = WORDS
WIN_WORDS = WORDS + ROWS * CALLS_N


def calls_base(row):
    """The first word of the ring of calls of the row whose ENTERED word is at ``row``."""
    return XR + (row - ENTERED - HDR) // F * CALLS_N


# The dispatcher holds a row by the index of its ENTERED word and writes the row's other
# words by their offset from it: mem[row + AT_DONE], ...
AT_DONE, AT_RAISED, AT_POISON = DONE - ENTERED, RAISED - ENTERED, POISON - ENTERED
AT_HIST, AT_CKPT = HIST - ENTERED, CKPT - ENTERED


def checkpoint(m, b, seq, h):
    """Record hash ``h`` of the history up to call ``seq`` (a multiple of 1 << CK_SHIFT) in
    the row whose ENTERED word is at ``b``: the call after the hash, so that a reader never
    takes an old hash for a new call's (the compiled path does the same: _native/dispatch.c)."""
    for lv in range(CK_LEVELS):
        s = CK_SHIFT + CK_STEP * lv
        if seq & ((1 << s) - 1):
            return
        i = b + AT_CKPT + 2 * (lv * CK_N + ((seq >> s) & (CK_N - 1)))
        m[i] = 0
        m[i + 1] = h
        m[i] = seq


def checkpoints(words, base):
    """{call: hash} of the checkpoints in the row at ``base`` (its first word) of ``words``."""
    out = {}
    for i in range(CK_LEVELS * CK_N):
        seq = int(words[base + CKPT + 2 * i])
        if seq:
            out[seq] = int(words[base + CKPT + 2 * i + 1])
    return out


def ghash(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def reason_tag(name, seq):
    """The tag of an agreement report (see REASONS): about call ``seq`` of the group ``name``."""
    return int(seq) << 32 | ghash(name)


def members_hash(ranks):
    """The MEMBERS word of a group of these world ranks."""
    return zlib.crc32(",".join(map(str, ranks)).encode()) & 0x7FFFFFFF


KEY_BITS = 32


def replay_wait(number, key):
    """The REPLAY_WAIT word of a pending replay: its graph's replay ``number`` and ``key``."""
    return (int(number) << KEY_BITS) | int(key)


def replay_wait_fields(word):
    """(the graph's replay number, its key) of a REPLAY_WAIT word; (0, 0) for none."""
    w = int(word)
    return w >> KEY_BITS, w & ((1 << KEY_BITS) - 1)


def p2p_word(count, code, peer):
    """The P2P header word: the call's running number (so that two equal calls in a row
    differ), its collective code (send or recv) and the peer's world rank."""
    return (count & 0xFFFFFF) << 28 | (peer & 0xFFFFFF) << 4 | code


def _done(q):
    try:
        return q.Test()
    except Exception:
        return True


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
        self._late = []                  # (request, buffer) of RMA reads not answered in time
        self.lock = threading.Lock()     # the atomic word operations where there is no RMA window
        self._reasons_written = 0        # the reports set_reason wrote (each slot's write number)
        self.win = None
        self.comm = None
        try:
            self.comm = world_comm.Dup()
            self.win = quiet(lambda: MPI.Win.Allocate(WIN_WORDS * 8, 8, comm=self.comm))
            mem = memoryview(self.win.tomemory()).cast("B")
            self.win.Lock_all()          # one passive epoch for the whole run: reads need no lock
        except Exception:                # no RMA here: keep a private table, peers show "unknown"
            self.win = None
            mem = memoryview(bytearray(WIN_WORDS * 8))
        self.m = mem.cast("q")
        self.m[0] = MAGIC
        self.m[1] = os.getpid()
        for i in range(EXITED, HDR):
            self.m[i] = 0

    def add(self, g):
        """A row for group ``g``; returns the index of its ENTERED word."""
        self.name(g)
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
        for i in range(F):
            m[b + i] = 0
        x = calls_base(b + ENTERED)
        for i in range(CALLS_N):
            m[x + i] = 0
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

    def mark_finalized(self):
        """This process called finalize(): it makes no further call, and peers waiting in a
        call it did not reach say so at once (finalize() itself may wait for them: freeing
        the windows and communicators is collective)."""
        self.m[XSTATUS] = FINALIZED
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
        deadline = time.monotonic() + TIMING.read_wait   # a dead peer must not hold up the report
        while reqs and time.monotonic() < deadline:
            reqs = [q for q in reqs if not q.Test()]
            if reqs:
                time.sleep(0.002)
        for q in reqs:
            self._keep(q, stamp)

    def name(self, g):
        self.names[ghash(g.name)] = g.name
        crash.name(ghash(g.name), g.name)

    def slot(self, g):
        """The index of group ``g``'s row (its first word), or None (unpublished overflow)."""
        b = self.rows.get(g)
        if b is None or b - ENTERED == HDR + (ROWS - 1) * F:
            return None
        return b - ENTERED

    def put_words(self, rank, index, values):
        """Write int64 ``values`` at word ``index`` of world ``rank``'s window (RMA put);
        waits at most ``TIMING.read_wait`` s for them to leave (a dead peer must not hold anyone up)."""
        if rank == self.wrank:
            for i, v in enumerate(values):
                self.m[index + i] = v
            return
        if self.win is None:
            return
        from mpi4py import MPI

        buf = np.array(values, np.int64)
        try:
            self.win.Put([buf, MPI.INT64_T], rank, target=(index, len(values), MPI.INT64_T))
            self.win.Flush(rank)   # there before this rank goes on
        except Exception:
            return

    def cas(self, rank, index, expected, new):
        """Compare-and-swap of word ``index`` of world ``rank``'s window (this rank's own
        too): it becomes ``new`` where it holds ``expected``. Returns the value it held (None
        where a peer's window cannot be reached). Every writer of a word that more than one
        thread or process writes (POISON) goes through this or ``swap``: MPI's atomics, alike
        for a peer's window and this rank's own, so that no store is lost between a read and
        a write (without RMA: this process's lock, over its private table)."""
        return self._atomic(rank, index, new, expected)

    def swap(self, rank, index, value):
        """Atomically store ``value`` at word ``index`` of world ``rank``'s window (MPI
        Fetch_and_op with REPLACE); returns the value it held (None where it cannot be reached)."""
        return self._atomic(rank, index, value, None)

    def _atomic(self, rank, index, value, expected):
        if self.win is None:
            if rank != self.wrank:
                return None
            with self.lock:
                old = int(self.m[index])
                if expected is None or old == expected:
                    self.m[index] = value
                return old
        from mpi4py import MPI

        new, old = np.array([value], np.int64), np.zeros(1, np.int64)
        try:
            if expected is None:
                self.win.Fetch_and_op([new, MPI.INT64_T], [old, MPI.INT64_T], rank, index, MPI.REPLACE)
            else:
                cmp = np.array([expected], np.int64)
                self.win.Compare_and_swap([new, MPI.INT64_T], [cmp, MPI.INT64_T], [old, MPI.INT64_T], rank, index)
            self.win.Flush(rank)   # done (there) before this rank goes on
        except Exception:
            return None
        return int(old[0])

    def put_if_zero(self, rank, index, value):
        """Write ``value`` at word ``index`` of world ``rank``'s window where that word is 0."""
        self.cas(rank, index, 0, value)

    def read_words(self, rank, index, n):
        """``n`` int64 words at ``index`` of world ``rank``'s window (a copy), or None when it
        does not answer within ``TIMING.read_wait`` s."""
        if rank == self.wrank:
            return np.frombuffer(self.m, np.int64, n, index * 8).copy()
        if self.win is None:
            return None
        from mpi4py import MPI

        buf = np.zeros(n, np.int64)
        try:
            q = self.win.Rget([buf, MPI.INT64_T], rank, target=(index, n, MPI.INT64_T))
        except Exception:
            return None
        deadline = time.monotonic() + TIMING.read_wait
        while not q.Test():
            if time.monotonic() > deadline:
                self._keep(q, buf)
                return None
            time.sleep(0.0005)
        return buf

    def start_read(self, rank, index, n):
        """Start reading ``n`` words at ``index`` of world ``rank``'s window (RMA); returns
        (request, buffer), or None. The watchdog tests it at its next wakes (``done_read``)
        instead of waiting: a busy wait here was seen to stall the job's own calls on a
        transport that emulates RMA with messages."""
        if self.win is None or rank == self.wrank:
            return None
        from mpi4py import MPI

        buf = np.zeros(n, np.int64)
        try:
            return self.win.Rget([buf, MPI.INT64_T], rank, target=(index, n, MPI.INT64_T)), buf
        except Exception:
            return None

    def done_read(self, read, give_up=False):
        """The words of a read from ``start_read`` once it has completed, else None (with
        ``give_up``: it is abandoned, its buffer kept until MPI has written it)."""
        q, buf = read
        if _done(q):
            return buf
        if give_up:
            self._keep(q, buf)
        return None

    def _keep(self, q, buf):
        """An RMA request that did not complete in time: its buffer stays alive until it
        has (MPI writes into it when the peer answers late; freeing it would corrupt the heap)."""
        self._late = [(r, b) for r, b in self._late if not _done(r)]
        self._late.append((q, buf))

    def set_reason(self, text, across=False, tag=0):
        """Publish the text (truncated to fit) of this rank's agreement report about the call
        of ``tag`` (reason_tag(group, seq)), in that call's slot (see REASONS); with ``across``,
        of the last report of its comparison across hosts (a slot of its own: the members read
        it while this rank may be reporting a refusal of its own)."""
        b = text.encode()[:REASON_WORDS * 8]
        raw = np.zeros(REASON_WORDS, np.int64)
        raw.view(np.uint8)[:len(b)] = np.frombuffer(b, np.uint8)
        m = self.m
        if across:
            for i in range(REASON_WORDS):
                m[XREASON + i] = int(raw[i])
            m[XREASON_LEN] = len(b)
            return
        with self.lock:   # (one writer at a time: the main thread and the watchdog both report)
            ats = [REASONS + i * REASON_SIZE for i in range(REASON_SLOTS)]
            at = next((a for a in ats if m[a + 1] == tag and m[a]), None)
            if at is None:   # (else the one written longest ago)
                at = min(ats, key=lambda a: m[a])
            self._reasons_written += 1
            v = self._reasons_written
            m[at + REASON_SIZE - 1] = v   # (first: a reader copying the slot meanwhile sees it differ)
            m[at + 1] = tag
            m[at + 2] = len(b)
            for i in range(REASON_WORDS):
                m[at + 3 + i] = int(raw[i])
            m[at] = v

    def reason_of(self, rank, across=False, tag=None):
        """World ``rank``'s agreement report about the call of ``tag`` (reason_tag(group, seq)),
        or None where it has none for that call (never reported, or no longer kept: another
        call's text is never returned). ``across``: its last report of the comparison across
        hosts (``tag`` not used)."""
        if across:
            w = self.read_words(rank, XREASON_LEN, 1 + REASON_WORDS)
            n = int(w[0]) & 0xFFFFFFFF if w is not None else 0
            return w[1:].view(np.uint8)[:n].tobytes().decode(errors="replace") \
                if w is not None and 0 < n <= REASON_WORDS * 8 else None
        got = self._reasons(rank, lambda t: t == tag)
        return got[0][1] if got else None

    def latest_reason_of(self, rank, name, before=None):
        """World ``rank``'s latest kept report about a call of group ``name`` (with ``before``:
        of a call before that one), or None."""
        gh = ghash(name)
        got = self._reasons(rank, lambda t: t & 0xFFFFFFFF == gh and (before is None or t >> 32 < before))
        return max(got)[1] if got else None

    def _reasons(self, rank, want):
        """[(tag, text)] of world ``rank``'s kept reports whose tag ``want`` takes (read again
        for a while where a slot is being written: a report being completed is not missed)."""
        for _ in range(20):
            w = self.read_words(rank, REASONS, REASON_SLOTS * REASON_SIZE)
            if w is None:
                return []
            got, busy = [], False
            for i in range(REASON_SLOTS):
                s = w[i * REASON_SIZE:(i + 1) * REASON_SIZE]
                t, n = int(s[1]), int(s[2]) & 0xFFFFFFFF
                if int(s[0]) != int(s[-1]):
                    busy = True
                elif s[0] and want(t) and 0 < n <= REASON_WORDS * 8:
                    got.append((t, s[3:3 + REASON_WORDS].view(np.uint8)[:n].tobytes().decode(errors="replace")))
            if got or not busy:
                return got
            time.sleep(0.002)
        return []

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
        deadline = time.monotonic() + TIMING.read_wait
        while reqs and time.monotonic() < deadline:
            for r, q in list(reqs.items()):
                if q.Test():
                    del reqs[r]
                    if bufs[r][0] == MAGIC:
                        out[r] = bufs[r]
            if reqs:
                time.sleep(0.002)
        for r, q in reqs.items():
            self._keep(q, bufs[r])
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
