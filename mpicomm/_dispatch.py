"""The dispatch core: every collective of a group goes through ``Dispatcher.call``.

The dispatcher keeps the group's last prepared call per collective and reuses it
whenever a new call has the same signature (the input's class, shape and dtype, the op
or root, the output role: new, in place or given, the stream, async or not), binding
the new arrays instead of validating again; anything else is prepared by the
transport (which validates it) and becomes the entry for that collective. A reused
call still checks, per call, whatever can differ between arrays of one signature
(contiguity, writability, overlap of ``out=`` with ``x``, the device): that lives in
the prepared call's ``run``.

Around the transport call the dispatcher publishes progress for the watchdog: the
sequence number and collective it entered on the group, then the same when it is
done (two stores into this rank's row of the progress window). In debug mode the
transport is wrapped by the cross-rank argument check (mpicomm._reliability.debug),
and nothing is reused. The flight recorder (mpicomm._reliability.flight) costs one
more store per call: ``(seq, code, prepared call, start)`` into the group's ring.

With the agreement check on (the default; mpicomm._reliability.agreement), each
prepared call carries its CallSpec (mpicomm._callspec); the call publishes ``seq << 32 |
signature`` and, after the transport call, compares the words of the other members on its
host. The slow paths (a disagreement, a refusal, a member's report) are the methods below
``call``; they run only when a check fails or a report word is set.
"""
from __future__ import annotations

import time

import numpy as np

from ._backends.base import IN_PLACE, NEVER, NEW, OUT, _dropped as _DROPPED, complete_dropped
from ._callspec import REFUSED, PeerSpec, plain_spec, spec_of
from ._ops import BARRIER, BROADCAST, COLLECTIVES, GATHER, NAMES, REDUCE, SCATTER, Sized
from ._reliability.flight import new_ring
from ._reliability.progress import ENTERED, P2P, P2P_GH, P2P_TAG, REPORTED, calls_base, ghash, p2p_word
from ._arrays import is_gpu_array, is_torch
from .errors import CollectiveMismatchError, CommunicationError, invalid

_now = time.perf_counter_ns


def mpi_error(e, name, seq, group):
    """The error for an MPI error ``e`` in collective ``name``: a truncated message means the
    ranks' calls differ (a rank received more than it made room for) -> CollectiveMismatchError."""
    from mpi4py import MPI

    where = f"{name} sequence {seq} on group {group!r}"
    try:
        truncated = e.Get_error_class() == MPI.ERR_TRUNCATE
    except Exception:
        truncated = False
    if truncated:
        return CollectiveMismatchError(
            f"{where}: MPI received a longer message than this rank's call makes room for ({e}): "
            "the ranks called different collectives or the same one with different sizes, dtypes "
            "or roots. Rerun with MPICOMM_DEBUG=1 to see every rank's call.")
    return CommunicationError(f"{where} failed in MPI: {e}")


SPEC_WAIT = 2.0   # s a refusing rank waits for the specs of members that took part (stand-in)
KNOWN_CALLS = 256  # prepared calls kept per group (they hold no arrays: checks and a bound NCCL/MPI call)


class Dispatcher:
    """Runs the collectives of one group: reuses prepared calls and publishes progress."""

    __slots__ = ("group", "transport", "last", "mem", "row", "seq", "watch", "fr", "fmask", "gh",
                 "p2p_n", "p2p_what", "p2p_ev", "batch", "known",
                 "check", "rel", "peers", "p1", "p1b", "p1j", "more", "shr", "shb", "slots", "raised", "resync",
                 "xhost", "cb")

    def __init__(self, group, transport, mem, row, watch=None, rel=None, check=True):
        self.group = group
        self.transport = transport     # the group's transport (or the debug wrapper around it)
        self.last = [NEVER] * (len(COLLECTIVES) + 1)   # collective code -> its last prepared call
        # every reusable prepared call by signature (up to KNOWN_CALLS, least recently used
        # out first): a loop over many shapes (one all_reduce per gradient, a reducer's
        # buckets) prepares each shape once, and one-off shapes do not push out the loop's
        self.known = {}
        self.mem = mem                 # this rank's progress words (int64 memoryview)
        self.row = row                 # index of the group's "entered" word; "done" follows it
        self.seq = 0                   # collectives issued on the group so far
        self.watch = watch             # the watchdog: a Work's timeout error, a departed peer
        self.fr = new_ring()           # the flight recorder's ring (a power of two long), or None
        self.fmask = len(self.fr) - 1 if self.fr is not None else 0
        self.batch = None              # the Works of an open mpicomm.batch() block, or None
        self.gh = ghash(group.name)    # the group's hash in the progress words
        self.p2p_n = 0                 # blocking send/recv calls so far (tells two equal ones apart)
        self.p2p_what = None           # (shape, dtype, peer, tag) of the send/recv in progress
        self.p2p_ev = None             # NCCL: (P2P word, CUDA event after it) until the GPU has done it
        # the agreement check (mpicomm._reliability.agreement)
        self.check = check and rel is not None
        self.rel = rel                 # the Reliability: progress window, host rings, resync
        self.peers = ()                # (ring segment, base, group rank) of the host neighbours
        self.p1 = self.p1b = self.p1j = None   # the first of them (read without a loop)
        self.more = ()                 # the others
        self.shr = None                # this rank's host-shared ring segment, or None
        self.shb = 0                   # its base for this group
        self.slots = None              # every member's row index in its progress window
        self.raised = 0                # the last sequence number a disagreement was raised for
        self.resync = False            # a fresh communicator is due at the next call (MPI)
        self.xhost = None              # (group rank, world rank, row) on the next host, compared
        #                                by the watchdog (this rank is its host's first member)
        self.cb = calls_base(row)      # the row's ring of calls (seq << 32 | signature at seq % 256)

    def call(self, code, x, out, arg, async_op, stream):
        """Run collective ``code`` on ``x``; ``arg`` is its op, root or (op, root)."""
        p = self.last[code]
        key = None
        role = NEW if out is None else (IN_PLACE if out is x else OUT)   # (role_of, inline)
        if x.__class__ is not p.cls or x.shape != p.shape or x.dtype is not p.dtype \
                or (arg is not p.arg and arg != p.arg) or stream is not p.stream or async_op is not p.async_op \
                or p.role is not role:
            p = None
            if arg.__class__ is not Sized:   # (sized calls are prepared every time)
                try:
                    key = (code, x.__class__, x.shape, x.dtype, arg, stream, async_op, role)
                    if not self.known:
                        hash(key)
                    p = self.known.pop(key, None)
                except (AttributeError, TypeError):   # no shape, or an unhashable argument (a shape
                    #                                   type such as Paddle's; pop() on an empty dict
                    #                                   does not hash, hence hash() there)
                    key = None
                if p is not None:
                    self.known[key] = p   # back in, as the most recently used
                    self.last[code] = p
        if _DROPPED:   # Works dropped unwaited complete first (their buffers are kept)
            complete_dropped()
        seq = self.seq = self.seq + 1
        v = seq << 4 | code
        m = self.mem
        b = self.row
        if m[b + 5]:     # POISON: a peer's report, or this rank's own resync due
            self.poisoned(seq, code, (x, out, arg, async_op, stream))
        m[b] = v
        k = seq & 7
        try:
            if p is None:
                # the entry stays the call in progress (the watchdog describes it); only
                # a reusable one (cls not None) is ever matched again
                p = self.last[code] = self.transport.prepare(code, x, out, arg, async_op, stream) \
                    if arg.__class__ is not Sized else self.plain().prepare_sized(code, x, out, arg, async_op, stream)
                sp = p.spec = spec_of(code, x, out, arg, self.group.size, self.group.rank)
                p.sig = sp.sig
                if key is not None and p.cls is not None:
                    known = self.known
                    if len(known) >= KNOWN_CALLS:
                        del known[next(iter(known))]   # the least recently used
                    known[key] = p
            w = seq << 32 | p.sig
            m[self.cb + (seq & 255)] = w   # the ring of calls (mpicomm._reliability.progress)
            sh = self.shr
            if sh is not None:
                sh[self.shb + k] = w
            fr = self.fr
            if fr is not None:
                fr[seq & self.fmask] = (seq, code, p, _now())
            r = p.run(x, out)
        except BaseException as e:  # the call is over on this rank: published as raised
            m[b + 3] = v      # the row's RAISED word (mpicomm._reliability.progress)
            if type(e).__module__ == "mpi4py.MPI":   # MPI's own error: say which call it was
                m[b + 1] = v
                err = mpi_error(e, NAMES[code], seq, self.group.name)
                if isinstance(err, CollectiveMismatchError) and self.check:
                    w = m[self.cb + (seq & 255)]
                    other = next((j for pm, pb, j in self.peers
                                  if pm[pb + k] != w and pm[pb + k] >> 32 == seq), None)
                    self.disagree(seq, code, other, err if other is None else None)
                self._raised_here(seq)
                raise err from e
            if self.check and isinstance(e, Exception) and not isinstance(e, CommunicationError) \
                    and self.group.size > 1:
                self.refuse(seq, code, e, None)   # raises
            m[b + 1] = v
            self._raised_here(seq)
            raise
        if m[b + 5]:     # a peer's report arrived during the call
            self.poisoned_after(seq, code)
        if sh is not None:   # the host neighbours' calls of this sequence number
            pw = self.p1[self.p1b + k]   # (the first one unrolled: 2 ranks a host is common)
            if pw != w and pw >> 32 == seq:
                self.differs(seq, code, self.p1j, pw)
            for pm, pb, j in self.more:
                pw = pm[pb + k]
                if pw != w and pw >> 32 == seq:
                    self.differs(seq, code, j, pw)
        m[b + 1] = v
        if async_op:
            r._what = r._what[:3] + (self.group, seq)
            r._watch = self.watch
        return r

    # ------------------------------------------------------ the agreement check
    def differs(self, seq, code, j, pw):
        """Group rank ``j``'s ring word ``pw`` for call ``seq`` differs from this rank's."""
        self.mem[self.row + 1] = seq << 4 | code
        self.disagree(seq, code, j, None) if pw & 0xFFFFFFFF != REFUSED else self.told(seq, j)

    def _me(self):
        """'rank 3', or 'rank 3 (rank 1 of group 'g')' in a group that is not the world."""
        g = self.group
        wr = g.ranks[g.rank]
        return f"rank {wr}" if g.name == "world" else f"rank {wr} (rank {g.rank} of group {g.name!r})"

    def spec_for(self, seq):
        """The CallSpec of this rank's call ``seq`` (from the flight ring, else the last call)."""
        fr = self.fr
        if fr is not None:
            e = fr[seq & self.fmask]
            if e is not None and e[0] == seq:
                return getattr(e[2], "spec", None) if e[2] is not None else plain_spec(e[1])
        m, b = self.mem, self.row
        e = m[b]
        w = m[self.cb + (seq & 255)]
        if e >> 4 == seq and w >> 32 == seq:   # (no ring word yet: still preparing, last[] is older)
            ps = plain_spec(e & 15)
            if ps.sig == w & 0xFFFFFFFF:       # a barrier, creating or destroying a group
                return ps
            p = self.last[e & 15]
            if p is not NEVER and getattr(p, "sig", None) == w & 0xFFFFFFFF:
                return getattr(p, "spec", None) or plain_spec(e & 15)
        return None

    def _members(self):
        """{group rank: world rank} of the other members."""
        g = self.group
        return {j: wr for j, wr in enumerate(g.ranks) if j != g.rank}

    def _tell(self, seq, text):
        """Publish report ``text`` and POISON every other member's row with it."""
        from ._reliability.agreement import poison_index, poison_word

        rel = self.rel
        rel.progress.set_reason(text)
        me = self.group.ranks[self.group.rank]
        if self.slots is None:
            return
        for j, wr in self._members().items():
            rel.progress.put_words(wr, poison_index(self.slots[j]), [poison_word(seq, me)])

    def _decision_wait(self):
        """Seconds to wait for a reporter's final words and its decision on a fresh
        communicator (on MPI the members must decide alike; NCCL only needs the words)."""
        return SPEC_WAIT + 0.5 if hasattr(self.plain(), "nccl") else SPEC_WAIT + 2

    def _answer(self, k):
        """Publish this rank's call ``k`` (a report about it came): the reporter describes it,
        and decides from it whether the group needs a fresh communicator."""
        from ._reliability.agreement import publish_spec

        sp = self.spec_for(k)
        if sp is not None:
            publish_spec(self.mem, self.row, k, sp)

    def _raised_here(self, seq):
        """Call ``seq`` raised on this rank (also outside the agreement check's paths: a
        transport's own error): a member's later report about it is not news here, and the
        comparison across hosts passes over it (REPORTED)."""
        if seq > self.raised:
            self.raised = seq
            self.mem[self.row - ENTERED + REPORTED] = seq

    def _after(self, seq, entered):
        """Bookkeeping once this rank has raised for call ``seq``: a fresh communicator is due
        (MPI) when any rank entered it."""
        from ._reliability.agreement import poison_word

        self._raised_here(seq)   # (published: the comparison across hosts passes over it)
        if entered and not hasattr(self.plain(), "nccl") and self.rel is not None:
            self.resync = True
            if not self.mem[self.row + 5]:   # (a member's report there brings the next call here too)
                self.mem[self.row + 5] = poison_word(seq, self.group.ranks[self.group.rank])

    def disagree(self, seq, code, peer, err):
        """This rank's call ``seq`` differs from group rank ``peer``'s (or MPI said so in
        ``err``): raise CollectiveMismatchError naming both calls, and tell every member."""
        from ._reliability.agreement import publish_spec, spec_words, wait_rows

        g = self.group
        mine = self.spec_for(seq)
        name = NAMES.get(code, "?")
        if mine is not None:
            publish_spec(self.mem, self.row, seq, mine)
        # tell first (the members' watchdogs then publish their calls of seq), describe after
        self._tell(seq, f"{name} sequence {seq} on group {g.name!r}: the ranks called differently "
                        f"({self._me()} found it)")
        calls = [f"{self._me()}: {mine.describe() if mine is not None else name}"]
        # whether messages of the call may be left unmatched (then: a fresh communicator): where
        # the peer's call could not be described, only MPI's own truncation error says so
        fresh = err is not None
        if peer is not None and self.slots is not None:
            wr = g.ranks[peer]
            rows = wait_rows(self.rel.progress, {peer: wr}, self.slots,
                             lambda rows: rows[peer] is None or spec_words(rows[peer], seq) is not None,
                             timeout=SPEC_WAIT)
            sw = spec_words(rows[peer], seq) if rows[peer] is not None else None
            other = PeerSpec(sw).describe(mine) if sw is not None else "another call (not described in time)"
            what = f"; differs in {mine.diff(PeerSpec(sw))}" if sw is not None and mine is not None else ""
            calls.append(f"rank {wr}: {other}{what}")
            if sw is not None and mine is not None:
                fresh = not _same_bytes(mine, PeerSpec(sw))
        elif err is not None:
            calls.append("MPI_ERR_TRUNCATE: a peer sent more than this call makes room for")
        text = (f"{name} sequence {seq} on group {g.name!r}: the ranks called differently: "
                + "; ".join(calls) + ". Every rank must make the same call (collective, dtype, element "
                "count, op, root, sizes); MPICOMM_DEBUG=1 compares every argument before each call")
        self.rel.progress.set_reason(text)
        self.rel.progress.set_decision(fresh)
        self._after(seq, fresh)
        raise CollectiveMismatchError(text)

    def refuse(self, seq, code, e, reason, who=None):
        """This rank does not take part in call ``seq`` (it raised ``e``, or a peer's report
        ``reason`` came first): publish the refusal, wait until every member has refused
        or entered, stand in for the call where members wait inside it, then raise."""
        from ._reliability.agreement import ring_word, spec_words, wait_rows

        from ._callspec import REFUSED as _R

        g = self.group
        m, b = self.mem, self.row
        name = NAMES.get(code, "?")
        # the words first (a member that sees the refusal reads them at once), then the refusal
        text = (f"{self._me()} refused {name} sequence {seq} on group {g.name!r}: {type(e).__name__}: {e}"
                if e is not None else reason)
        self.rel.progress.set_reason(text)
        w = seq << 32 | _R
        m[self.cb + (seq & 255)] = w
        if self.shr is not None:
            self.shr[self.shb + (seq & 7)] = w
        if e is not None:
            self._tell(seq, text)
        members = self._members()
        if self.slots is None:
            self._after(seq, False)
            m[b + 1] = m[b]
            raise e if e is not None else CollectiveMismatchError(reason)
        t0 = time.monotonic()

        def decided(rows):
            late = time.monotonic() - t0 > SPEC_WAIT
            for j, row in rows.items():
                if row is None:
                    continue      # no answer: taken as gone
                _, st = ring_word(row, seq)
                if st == "behind":
                    return False
                if st in ("entered", "ahead") and spec_words(row, seq) is None and not late:
                    return False   # it took part: its spec is needed for the stand-in
            return True

        rows = wait_rows(self.rel.progress, members, self.slots, decided)
        states = {j: (ring_word(r, seq)[1] if r is not None else "gone") for j, r in rows.items()}
        entered = [j for j, st in states.items() if st in ("entered", "ahead")]
        specs = [spec_words(rows[j], seq) for j in entered]
        specs = [PeerSpec(w) for w in specs if w is not None]
        stood = False
        try:
            if specs and not specs[0].sized:
                self._stand_in(code, specs[0])
                stood = True
        finally:
            m[b + 1] = m[b]
            self._after(seq, bool(entered) and not stood)
            self.rel.progress.set_decision(bool(entered) and not stood)
        if e is not None:
            raise e
        if who is not None:   # the reporter's final words (it may have been describing still)
            text, _ = self.rel.progress.reason_of(who, decision=True, wait=self._decision_wait())
            reason = text or reason
        raise _peer_error(reason)

    def refuse_early(self, code, e):
        """Collective ``code`` refused by a check before the dispatcher (``e``): published as
        this rank's next call of the group, refused."""
        from ._reliability.agreement import poison_fields

        m, b = self.mem, self.row
        # the call counts first, whatever comes next: a member's report may land at any moment,
        # and every rank's count of calls must stay alike
        seq = self.seq = self.seq + 1
        if self.resync:   # the fresh communicator due from an earlier call comes first
            self.resync = False
            self.rel.resync(self.group)
        m[b] = seq << 4 | code
        m[b + 3] = m[b]
        word = m[b + 5]
        if word:
            k, who = poison_fields(word)
            # this rank's own resync marker, a report about a call that raised here, or one
            # about this very call (this rank refuses it too): no news. A report about an
            # earlier call that returned here stays for the next call.
            if (who == self.group.ranks[self.group.rank] or k <= self.raised or k == seq) and m[b + 5] == word:
                m[b + 5] = 0
        self.refuse(seq, code, e, None)

    def _stand_in(self, code, spec):
        """Take part in call ``code`` as ``spec`` describes it, with scratch arrays (the result
        is dropped): the members waiting inside it complete."""
        from ._reliability.agreement import dtype_of

        if spec.sized or spec.code == 0:
            return
        t = self.plain()
        if spec.code == BARRIER:
            t.barrier(False)
            return
        if not spec.dtype:   # a call without arrays (creating or destroying a group): not
            return           # one a rank can make in another's place
        g = self.group
        n, me = g.size, g.rank
        dt = dtype_of(spec.dtype)
        c = spec.count
        code = spec.code
        root = spec.root
        gpu = hasattr(t, "nccl") and spec.gpu   # host arrays on NCCL go through MPI: stand in alike
        if gpu:
            import cupy as xp
        else:
            xp = np
        arg = spec.op
        if code == BROADCAST:
            arg = root
        elif code in (GATHER, SCATTER):
            arg = Sized((root, None, None))
        elif code == REDUCE:
            arg = (spec.op, root)
        count = c * n if (code == SCATTER and me == root) else c
        x = xp.zeros(count, dt)
        out = None
        if code == SCATTER and me != root:
            out = x
        if arg.__class__ is Sized:
            pc = t.prepare_sized(code, x, out, arg, False, None)
        else:
            pc = t.prepare(code, x, out, arg, False, None)
        pc.run(x, out)
        if gpu:
            xp.cuda.get_current_stream().synchronize()

    def poisoned(self, seq, code, call=None):
        """Before call ``seq``: a member's report (POISON) or this rank's resync is due.
        ``call``: the call's (x, out, arg, async_op, stream), checked here when the report is
        about this very call, so that a rank whose own arguments are refused raises its own
        error (ranks that all refuse alike each raise theirs)."""
        from ._reliability.agreement import poison_fields

        m, b = self.mem, self.row
        if self.resync:   # first of all: the fresh communicator every member makes at its next call
            self.resync = False
            self.rel.resync(self.group)
        word = m[b + 5]
        k, who = poison_fields(word)
        me = self.group.ranks[self.group.rank]
        if who == me or k <= self.raised:
            if m[b + 5] == word:
                m[b + 5] = 0
            return
        if k > seq:      # a member is ahead: this rank refuses that call when it gets there
            return
        if m[b + 5] == word:
            m[b + 5] = 0
        if k == seq:     # before taking part: refuse it too
            reason = self.rel.progress.reason_of(who) or f"rank {who} reported a disagreement in call {k}"
            m[b] = seq << 4 | code
            own = None
            if call is not None:
                x, out, arg, async_op, stream = call
                try:
                    if arg.__class__ is Sized:
                        self.plain().prepare_sized(code, x, out, arg, async_op, stream)
                    else:   # (without debug mode's exchange: the members are not in it)
                        self.plain().prepare(code, x, out, arg, async_op, stream)
                except Exception as e:   # this rank's own arguments are refused too
                    own = e
            m[b + 3] = m[b]
            self.refuse(seq, code, own, reason, who)
        # k < seq: this rank's call k is over (it returned before the report came): it
        # raises the report now, refusing call seq, so that members already inside call
        # seq are stood in for and raise too (every rank's count of calls stays alike)
        self._answer(k)
        m[b] = seq << 4 | code
        m[b + 3] = m[b]
        late = (f" [{self._me()} had returned from call {k} before the report came; it raises it in its "
                f"next call, {NAMES.get(code, '?')} sequence {seq}, and takes no part in that]")
        err = _peer_error((self.rel.progress.reason_of(who) or f"rank {who} reported a disagreement in call {k}")
                          + late)
        try:   # refused at once: members already inside call seq are stood in for without delay
            self.refuse(seq, code, err, None)
        finally:   # the reporter's final words and decision (it may still be describing)
            reason, resync = self.rel.progress.reason_of(who, decision=True, wait=self._decision_wait())
            self._after(k, bool(resync))
            if reason:
                err.args = (reason + late,)

    def told(self, seq, j):
        """Group rank ``j`` refused call ``seq``, which this rank has made: raise its report
        (once it has decided, after its stand-in, whether the group needs a fresh start)."""
        who = self.group.ranks[j]
        self._answer(seq)
        reason, resync = self.rel.progress.reason_of(who, decision=True, wait=self._decision_wait())
        m, b = self.mem, self.row
        if m[b + 5] and (m[b + 5] >> 24) == seq:
            m[b + 5] = 0
        self._after(seq, bool(resync))
        raise _peer_error(reason or f"rank {who} refused call {seq}")

    def poisoned_after(self, seq, code):
        """After call ``seq`` returned: a member's report about it arrived."""
        from ._reliability.agreement import poison_fields

        m, b = self.mem, self.row
        word = m[b + 5]
        k, who = poison_fields(word)
        me = self.group.ranks[self.group.rank]
        if who == me or k <= self.raised or k > seq:
            return
        m[b + 5] = 0
        m[b + 1] = seq << 4 | code
        self._answer(k)
        reason, resync = self.rel.progress.reason_of(who, decision=True, wait=self._decision_wait())
        self._after(k, bool(resync))
        raise _peer_error(reason or f"rank {who} reported a disagreement in call {k}")

    def describe(self, code):
        """'shape .., dtype ..' of the group's last call of collective ``code``."""
        p = self.last[code]
        return p.describe() if p is not NEVER else "no array"

    def barrier(self, async_op):
        r = self.watched(BARRIER, lambda: self.transport.barrier(async_op))
        if async_op:
            r._what = r._what[:3] + (self.group, self.seq)
            r._watch = self.watch
        return r

    def watched(self, code, fn):
        """Run ``fn()``, a call that every rank of the group makes without arrays (a barrier,
        creating or destroying a group), published and recorded like a collective."""
        if _DROPPED:
            complete_dropped()
        seq = self.seq = self.seq + 1
        v = seq << 4 | code
        m, b = self.mem, self.row
        if m[b + 5]:
            self.poisoned(seq, code)
        m[b] = v
        w = seq << 32 | plain_spec(code).sig
        m[self.cb + (seq & 255)] = w
        if self.shr is not None:
            self.shr[self.shb + (seq & 7)] = w
        if self.fr is not None:
            self.fr[seq & self.fmask] = (seq, code, None, _now())
        try:
            r = fn()
        except BaseException:
            m[b + 1] = v
            m[b + 3] = v
            raise
        for pm, pb, j in self.peers:
            pw = pm[pb + (seq & 7)]
            if pw != w and pw >> 32 == seq:
                self.differs(seq, code, j, pw)
        m[b + 1] = v
        return r

    def point_to_point(self, code, x, peer, tag, async_op, stream, recv=None):
        """send / recv: not numbered (only the two ranks take part), never reused.

        A blocking call is published in this rank's progress header (which call, the
        peer's world rank, the group and tag) while it runs, so that the watchdog names
        a peer that never comes; an async one carries the same facts in its Work, whose
        wait() reports with them."""
        if _DROPPED:
            complete_dropped()
        g = self.group
        wpeer = g.ranks[peer] if peer.__class__ is int and 0 <= peer < g.size else -1
        if async_op:
            r = self.transport.point_to_point(code, x, peer, tag, async_op, stream, recv)
            if r is not None and hasattr(r, "_what"):
                r._what = r._what[:3] + (g, ("p2p", code, wpeer, tag))
                r._watch = self.watch
            return r
        if wpeer < 0:   # the transport refuses it with the allowed range
            return self.transport.point_to_point(code, x, peer, tag, async_op, stream, recv)
        m = self.mem
        n = self.p2p_n = self.p2p_n + 1
        self.p2p_what = (getattr(x, "shape", None), getattr(x, "dtype", None), wpeer, tag)
        m[P2P_GH] = self.gh
        m[P2P_TAG] = tag if tag.__class__ is int else 0
        w = m[P2P] = p2p_word(n, code, wpeer)
        gpu = False
        try:
            r = self.transport.point_to_point(code, x, peer, tag, async_op, stream, recv)
            # NCCL enqueues and returns: the word stays up until the GPU has done the call
            # (the watchdog clears it when the event recorded here completes)
            gpu = hasattr(self.plain(), "nccl") and is_gpu_array(x) and _gpu_event(self, w, x, stream)
            return r
        finally:
            if not gpu:
                m[P2P] = 0

    def plain(self):
        """The transport without debug mode's wrapper. Calls with per-rank sizes (a Sized arg)
        are prepared by it: their shapes differ between ranks by design, and their signature
        is compared by the size exchange (mpicomm._collectives) instead."""
        t = self.transport
        return getattr(t, "inner", t)

    # ----------------------------------------------------------- mpicomm.batch()
    def batch_begin(self):
        """Open a batch: the group's calls start now and complete together at batch_end
        (one NCCL group; nonblocking MPI requests)."""
        if self.batch is not None:
            raise invalid("batch", f"a batch inside an open batch of group {self.group.name!r}",
                          "one mpicomm.batch() block per group at a time (batches do not nest)")
        self.batch = []
        self.plain().batch_begin()
        self.group.call = self.batch_call

    def batch_call(self, code, x, out, arg, async_op, stream):
        """A collective inside a batch: started as async_op=True, its Work kept for batch_end."""
        r = self.call(code, x, out, arg, True, stream)
        self.batch.append(r)
        return r

    def batch_p2p(self, code, x, peer, tag, stream, recv=None):
        """A send / recv / sendrecv inside a batch (nonblocking; a send to oneself allowed)."""
        r = self.point_to_point(code, x, peer, tag, True, stream, recv)
        self.batch.append(r)
        return r

    def batch_end(self, wait=True):
        """Launch the batch (NCCL's groupEnd) and complete its calls; returns their Works."""
        works, self.batch = self.batch, None
        self.group.call = self.call
        self.plain().batch_end()
        if wait:
            for w in works:
                if w is not None and hasattr(w, "wait"):
                    w.wait()
        return works


def _same_bytes(a, b):
    """True when two calls differ only in what MPI does not see (dtype of the same size, op):
    then every message of the call was matched, and the communicator needs no fresh start."""
    from ._reliability.agreement import dtype_of

    wa, wb = a.words(), b.words()
    try:
        sa, sb = dtype_of(a.dtype).itemsize, dtype_of(b.dtype).itemsize
    except Exception:
        return False
    return wa[0] == wb[0] and wa[2] == wb[2] and wa[4:] == wb[4:] and sa == sb


def _peer_error(reason):
    """The error for a member's report: a refusal for an invalid argument is also an
    InvalidArgumentError (the call was invalid, on that rank)."""
    from .errors import RefusedElsewhereError

    if " refused " in reason and ": InvalidArgumentError: " in reason:
        return RefusedElsewhereError(reason)
    return CollectiveMismatchError(reason)


def _gpu_event(d, word, x, stream):
    """Record a CUDA event on the stream of a GPU send/recv just enqueued; True when done."""
    try:
        import cupy

        if stream is None:
            if is_torch(x):
                import torch

                ptr = torch.cuda.current_stream(x.device).cuda_stream
            else:
                ptr = cupy.cuda.get_current_stream().ptr
        elif isinstance(stream, int):
            ptr = stream
        else:
            ptr = getattr(stream, "ptr", None) or stream.cuda_stream
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        cupy.cuda.runtime.eventRecord(ev.ptr, ptr)
    except Exception:   # not watched on the GPU: the word goes down as for a host call
        return False
    d.p2p_ev = (word, ev)
    return True
