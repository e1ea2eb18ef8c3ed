"""The agreement check's slow paths of the dispatcher (mpicomm._dispatch): what a rank does
when its call differs from a member's (``differs``, ``disagree``), when it refuses a call
(``refuse``, ``refuse_early``, standing in for members that entered it), and when a member's
report arrives before, during or after its own call (``poisoned``, ``told``,
``poisoned_after``). They run only when a check fails or a report word is set; the hot
path (``Dispatcher.call``) stays in mpicomm._dispatch. Protocol: docs/RELIABILITY.md,
"Agreement check"; the words: mpicomm._reliability.agreement and .progress.
"""
from __future__ import annotations

import time

import numpy as np

from ._backends.base import NEVER
from ._callspec import ASYNC, REFUSED, PeerSpec, plain_spec, same_bytes, standable
from ._dtypes import dtype_of
from ._ops import BARRIER, BROADCAST, GATHER, NAMES, REDUCE, SCATTER, Sized
from ._reliability.agreement import HOST_MASK
from ._reliability.progress import (AT_DONE, AT_HIST, AT_POISON, AT_RAISED, CALLS_MASK, ENTERED, EPOCH, REPORTED,
                                   SPEC_SLOTS, reason_tag)
from ._timing import TIMING
from .errors import CollectiveMismatchError


class AgreementPaths:
    """Mixed into Dispatcher: the agreement check's slow paths (see the module docstring)."""

    __slots__ = ()
    def differs(self, seq, code, j, pw):
        """Group rank ``j``'s ring word ``pw`` for call ``seq`` differs from this rank's."""
        self.mem[self.row + AT_DONE] = seq << 4 | code
        self.disagree(seq, code, j, None) if pw & 0xFFFFFFFF != REFUSED else self.told(seq, j)

    def check_waited(self, seq, name):
        """Work.wait of async call ``seq`` (collective ``name``) completed here: the checks a
        blocking call makes as it returns, so that no result of a call that differed leaves a
        Work. A member's report about the call, then the host neighbours' words for ``seq``: a
        member's word is published before its transport call starts, and this rank's call could
        not complete before every member's had started, so the words are there to compare."""
        if seq is None or seq <= self.raised:
            return
        if seq == self.seq:   # (no call since: the row's words are this call's, as after a blocking one)
            if self.mem[self.row + AT_POISON]:
                self.poisoned_after(seq, _code(name))
        if self.shr is None:
            return
        w = self.mem[self.cb + (seq & CALLS_MASK)]
        if w >> 32 != seq:
            return
        k = seq & HOST_MASK
        for pm, pb, j in self.peers:
            pw = pm[pb + k]
            if pw != w and pw >> 32 == seq:
                if seq == self.seq:
                    self.differs(seq, _code(name), j, pw)
                elif pw & 0xFFFFFFFF != REFUSED:   # (later calls made since: DONE is theirs)
                    self.disagree(seq, _code(name), j, None)

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
        w = m[self.cb + (seq & CALLS_MASK)]
        if e >> 4 == seq and w >> 32 == seq:   # (no ring word yet: still preparing, last[] is older)
            for ps in (plain_spec(e & 15), plain_spec(e & 15, True)):
                if ps.sig == w & 0xFFFFFFFF:   # a barrier (async or not), creating or destroying a group
                    return ps
            p = self.last[e & 15]
            if p is not NEVER and getattr(p, "sig", None) == w & 0xFFFFFFFF:
                return getattr(p, "spec", None) or plain_spec(e & 15)
        return None

    def spec_any(self, seq, word=None):
        """``spec_for(seq)``, else ``spec_kept(seq, word)``: the best description there is."""
        return self.spec_for(seq) or self.spec_kept(seq, word)

    def spec_kept(self, seq, word=None):
        """The CallSpec of this rank's call ``seq`` where ``spec_for`` has none (its flight
        ring moved on) but its ring word is kept, or is given (``word``, as read by the
        comparison across hosts, which describes calls found a second or more later): a
        prepared call of the same signature's (the watchdog's thread: the copies are taken at
        once)."""
        w = self.mem[self.cb + (seq & CALLS_MASK)] if word is None else int(word)
        if w >> 32 != seq:
            return None
        sig = w & 0xFFFFFFFF
        for p in (*tuple(self.last), *list(self.known.values())):
            if p is not NEVER and getattr(p, "sig", None) == sig and getattr(p, "spec", None) is not None:
                return p.spec
        return None

    def _members(self):
        """{group rank: world rank} of the other members."""
        g = self.group
        return {j: wr for j, wr in enumerate(g.ranks) if j != g.rank}

    def _tell(self, seq, text):
        """Publish report ``text`` and POISON every other member's row with it."""
        from ._reliability.agreement import poison_index, poison_word

        rel = self.rel
        rel.progress.set_reason(text, tag=reason_tag(self.group.name, seq))
        me = self.group.ranks[self.group.rank]
        if self.slots is None:
            return
        for j, wr in self._members().items():
            rel.progress.swap(wr, poison_index(self.slots[j]), poison_word(seq, me))

    def _poison_cas(self, expected, new):
        """This rank's POISON word for the group becomes ``new`` where it holds ``expected``
        (compare-and-swap: a member's report that lands meanwhile is never overwritten)."""
        p = self.rel.progress
        p.cas(p.wrank, self.row + AT_POISON, expected, new)

    def _every_call(self, seq, own=False):
        """Every member's call ``seq``: waits until each has refused or entered it, and for each
        signature among those that entered, until a member with it has described it (each
        does: as it reports or takes a report in, or at its watchdog's next wake; members with
        one signature made one call, so one description serves them all, and a member that
        went on, whose watchdog describes later calls, need not describe it), within the
        patience. A member's row is read again only until it has settled (two RMA reads each:
        a group of 1,000 costs about 2,000). ``own``: this rank entered the call too (its
        signature is described). Returns (rows {group rank: row or None (gone)},
        {signature: PeerSpec}, whether a member refused)."""
        from ._reliability.agreement import read_row, ring_word, spec_words

        members, p = self._members(), self.rel.progress
        rows, known, refused = {}, {}, False
        if own:
            mine, w = self.spec_for(seq), self.mem[self.cb + (seq & CALLS_MASK)]
            if mine is not None:
                known[w & 0xFFFFFFFF if w >> 32 == seq else mine.sig] = PeerSpec(mine.words())
        todo = dict(members)
        deadline = time.monotonic() + self._patience()
        while True:
            for j, wr in list(todo.items()):
                row = rows[j] = read_row(p, wr, self.slots[j])
                if row is None:       # no answer: taken as gone
                    del todo[j]
                    continue
                w, st = ring_word(row, seq)
                if st == "behind":
                    continue
                if st == "refused":
                    refused = True
                    del todo[j]
                    continue
                sw = spec_words(row, seq)
                if sw is not None:   # ('ahead': its ring word is gone, its description says it all)
                    known.setdefault(w & 0xFFFFFFFF if st == "entered" else ("ahead", j), PeerSpec(sw))
                    del todo[j]
            for j in list(todo):   # entered with a signature that another member described
                w, st = ring_word(rows[j], seq) if rows.get(j) is not None else (0, "behind")
                if st == "entered" and (w & 0xFFFFFFFF) in known:
                    del todo[j]
            if not todo or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        return rows, known, refused

    def _patience(self):
        """Seconds a step of the protocol waits for a member's word (its description, its
        decision on a fresh communicator): the job's timeout, without bound where there is
        none. Every such word comes (each is written before its writer waits for anything of
        this rank's), so the wait ends by acknowledgement; the bound only matters where a
        member is gone, which the watchdog reports within the timeout. With the timeout off
        there is no watchdog to publish a waiting member's description: TIMING.untimed_wait."""
        t = self.rel.ctx.timeout if self.rel is not None else 0
        return t if t and t > 0 else TIMING.untimed_wait

    def _decide(self, k, fresh):
        """Publish this rank's decision on call ``k`` (after its REASON): whether the group
        makes a fresh communicator. The members that take its report wait for this word."""
        from ._reliability.agreement import decision_index, decision_word

        self.mem[self.row - ENTERED + decision_index(k)] = decision_word(k, fresh)

    def _decision(self, who, k):
        """World rank ``who``'s report and its decision on call ``k``: (text or None, True /
        False / None where it did not come within the patience: _fresh's rule then). Waits
        for the decision word, which ``who`` writes after its report's text."""
        from ._reliability.agreement import decision_of

        g, p = self.group, self.rel.progress
        fresh = None
        if self.slots is not None and who in g.ranks:
            slot = self.slots[g.ranks.index(who)]
            deadline = time.monotonic() + self._patience()
            while True:
                fresh = decision_of(p, who, slot, k)
                if fresh is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            fresh = None if fresh is ... else fresh
        return p.reason_of(who, tag=reason_tag(g.name, k)), fresh

    def _answer(self, k, upto=None):
        """Publish this rank's call ``k`` (a report about it came): the reporter describes it,
        and decides from it whether the group needs a fresh communicator. With ``upto``, also
        the calls after ``k`` up to ``upto`` that this rank made (a member refusing one of them
        stands in for it from its description); ``k``'s last, so that it stays."""
        from ._reliability.agreement import publish_spec

        for c in ([*range(max(k + 1, upto - SPEC_SLOTS + 2), upto + 1)] if upto is not None else []) + [k]:
            sp = self.spec_for(c)
            if sp is not None:
                publish_spec(self.mem, self.row, c, sp)

    def _raised_here(self, seq):
        """Call ``seq`` raised on this rank (also outside the agreement check's paths: a
        transport's own error): a member's later report about it is not news here, and the
        comparison across hosts passes over it (REPORTED)."""
        if seq > self.raised:
            self.raised = seq
            self.mem[self.row - ENTERED + REPORTED] = seq
        # the history compared across hosts starts again after the call this rank raises in
        # (every member raises in the same call: the refusal protocol keeps their counts alike)
        m, b = self.mem, self.row
        if m[b - ENTERED + EPOCH] != self.seq:
            m[b + AT_HIST] = 0
            m[b - ENTERED + EPOCH] = self.seq

    def _after(self, seq, entered):
        """Bookkeeping once this rank has raised for call ``seq``: a fresh communicator is due
        (MPI) when any rank entered it."""
        from ._reliability.agreement import poison_word

        self._raised_here(seq)   # (published: the comparison across hosts passes over it)
        if entered and self.rel is not None:   # (NCCL: host arrays' MPI communicator afresh)
            self.resync = True
            # (where a member's report waits, it brings the next call here too)
            self._poison_cas(0, poison_word(seq, self.group.ranks[self.group.rank]))

    def disagree(self, seq, code, peer, err):
        """This rank's call ``seq`` differs from group rank ``peer``'s (or MPI said so in
        ``err``): raise CollectiveMismatchError naming both calls, and tell every member."""
        from ._reliability.agreement import publish_spec, ring_word, spec_words

        g = self.group
        mine = self.spec_for(seq)
        name = NAMES.get(code, "?")
        if mine is not None:
            publish_spec(self.mem, self.row, seq, mine)
        # tell first (the members' watchdogs then publish their calls of seq), describe after
        self._tell(seq, f"{name} sequence {seq} on group {g.name!r}: the ranks called differently "
                        f"({self._me()} found it)")
        calls = [f"{self._me()}: {mine.describe() if mine is not None else name}"]
        # whether messages of the call may be left unmatched (then: a fresh communicator), from
        # every member's call (see _clean), or MPI's own error here
        rows, known, one_refused = self._every_call(seq, True) if self.slots is not None else ({}, {}, False)
        fresh = err is not None or mine is None or not _clean(list(known.values()), one_refused)
        if peer is not None and self.slots is not None:
            wr = g.ranks[peer]
            # (a peer that refused the call publishes no description: its refusal is the answer)
            pw, st = ring_word(rows[peer], seq) if rows.get(peer) is not None else (0, "gone")
            sp = known.get(pw & 0xFFFFFFFF) if st == "entered" else None
            sw = sp.words() if sp is not None else (spec_words(rows[peer], seq) if st == "ahead" else None)
            refused = st == "refused"
            other = PeerSpec(sw).describe(mine) if sw is not None else \
                f"refused the call ({self.rel.progress.reason_of(wr, tag=reason_tag(g.name, seq)) or 'its reason not kept'})" if refused \
                else "another call (not described)"
            what = f"; differs in {mine.diff(PeerSpec(sw))}" if sw is not None and mine is not None else ""
            calls.append(f"rank {wr}: {other}{what}")
        elif isinstance(err, CollectiveMismatchError):
            calls.append("MPI_ERR_TRUNCATE: a peer sent more than this call makes room for")
        elif err is not None:
            calls.append(f"MPI's error in the call: {err}")
        text = (f"{name} sequence {seq} on group {g.name!r}: the ranks called differently: "
                + "; ".join(calls) + ". Every rank must make the same call (collective, dtype, element "
                "count, op, root, sizes); MPICOMM_DEBUG=1 compares every argument before each call")
        self.rel.progress.set_reason(text, tag=reason_tag(g.name, seq))
        self._decide(seq, fresh)
        self._after(seq, fresh)
        raise CollectiveMismatchError(text)

    def refuse(self, seq, code, e, reason, who=None):
        """This rank does not take part in call ``seq`` (it raised ``e``, or a peer's report
        ``reason`` came first): publish the refusal, wait until every member has refused
        or entered, stand in for the call where members wait inside it, then raise."""

        g = self.group
        m, b = self.mem, self.row
        name = NAMES.get(code, "?")
        # the words first (a member that sees the refusal reads them at once), then the refusal
        text = (f"{self._me()} refused {name} sequence {seq} on group {g.name!r}: {type(e).__name__}: {e}"
                if e is not None else reason)
        self.rel.progress.set_reason(text, tag=reason_tag(g.name, seq))
        w = seq << 32 | REFUSED
        m[self.cb + (seq & CALLS_MASK)] = w
        if self.shr is not None:
            self.shr[self.shb + (seq & HOST_MASK)] = w
        if e is not None:
            self._tell(seq, text)
        if self.slots is None:
            self._after(seq, False)
            m[b + AT_DONE] = m[b]
            raise e if e is not None else CollectiveMismatchError(reason)

        # every member's call, described (a stand-in for members inside the call needs it, and
        # so does the decision on a fresh start, which every deciding rank makes alike: _clean)
        _, known, _ = self._every_call(seq)
        specs = list(known.values())
        clean = _clean(specs, True)
        text = None
        try:   # (where the calls are clean, one stand-in fits every member inside: none of them
            # started it async, and all move the same bytes)
            if specs and clean:
                try:
                    clean = self._stand_in(code, specs[0])
                except Exception:   # (MPI's error here, e.g. the members' own calls differ
                    clean = False   # in what a description does not show: the group starts afresh)
        finally:
            m[b + AT_DONE] = m[b]
            self._after(seq, not clean)
            self._decide(seq, not clean)
        if e is not None:
            raise e
        if who is not None:   # the reporter's final words (it may have been describing still)
            text, _ = self._decision(who, seq)
        raise _peer_error(text or reason)

    def refuse_early(self, code, e):
        """Collective ``code`` refused by a check before the dispatcher (``e``): published as
        this rank's next call of the group, refused."""
        from ._reliability.agreement import poison_fields

        m, b = self.mem, self.row
        # the call counts first, whatever comes next: a member's report may land at any moment,
        # and every rank's count of calls must stay alike
        seq = self.seq = self.seq + 1
        if self.resync:   # the fresh communicator due from an earlier call comes first
            self._resync_now(seq, code)
        m[b] = seq << 4 | code
        m[b + AT_RAISED] = m[b]
        word = m[b + AT_POISON]
        if word:
            k, who = poison_fields(word)
            # this rank's own resync marker, a report about a call that raised here, or one
            # about this very call (this rank refuses it too): no news. A report about an
            # earlier call that returned here stays for the next call.
            if k <= self.raised or k == seq:
                self._poison_cas(word, 0)
        self.refuse(seq, code, e, None)

    def _stand_in(self, code, spec):
        """Take part in call ``code`` as ``spec`` describes it, with scratch arrays (the result
        is dropped): the members waiting inside it complete. True where it did; False for a
        call it cannot make in another's place (then messages of the call may be left in the
        communicator, and the group starts afresh)."""
        if not standable(spec):
            return False
        t = self.plain()
        if spec.code == BARRIER:
            t.barrier(False)
            return True
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
            arg = Sized(root, None)
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
        return True

    def _resync_now(self, seq, code):
        """Make the fresh communicator due (collective over the members) at the start of call
        ``seq``, published first as this rank's call ``seq`` entered: the watchdog watches the
        duplication as it watches the call (members that left their script, or never come,
        are named), where it would otherwise wait unwatched."""
        self.resync = False
        self.mem[self.row] = seq << 4 | code
        self.fresh_at = seq
        try:
            self.rel.resync(self.group)
        finally:
            self.fresh_at = 0

    def poisoned(self, seq, code, call=None):
        """Before call ``seq``: a member's report (POISON) or this rank's resync is due.
        ``call``: the call's (x, out, arg, async_op, stream), checked here when the report is
        about this very call, so that a rank whose own arguments are refused raises its own
        error (ranks that all refuse alike each raise theirs)."""
        from ._reliability.agreement import ACROSS, poison_fields, report_of

        m, b = self.mem, self.row
        if self.resync:   # first of all: the fresh communicator every member makes at its next call
            self._resync_now(seq, code)
        word = m[b + AT_POISON]
        k, who = poison_fields(word)
        # a word about a call this rank raised for: its own resync marker (_after), or a report
        # it has raised already. (A report across hosts may name this rank: its watchdog's.)
        if k <= self.raised:
            self._poison_cas(word, 0)
            return
        if k > seq or (k == seq and word & ACROSS):   # a member is ahead: this rank refuses that
            return   # call when it gets there; a report across hosts is raised after call k returns
        self._poison_cas(word, 0)
        if k == seq:     # before taking part: refuse it too
            reason = report_of(self.rel.progress, word, self.group.name) or f"rank {who} reported a disagreement in call {k}"
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
            m[b + AT_RAISED] = m[b]
            self.refuse(seq, code, own, reason, who)
        # k < seq: this rank's call k is over (it returned before the report came): it
        # raises the report now, refusing call seq, so that members already inside call
        # seq are stood in for and raise too (every rank's count of calls stays alike).
        # Its calls since k described too: a member that refuses one of them stands in for it
        self._answer(k, seq - 1)
        # the reporter's decision first: where the members make a fresh communicator at their
        # next call (this one), this rank makes it with them before refusing the call (else
        # its refusal would wait for members that wait for it in the duplication)
        decided = None
        if not word & ACROSS:
            decided = self._decision(who, k)
            if self._fresh(decided[1], k):
                if k < seq - 1:
                    self._ran_ahead(k, seq, who, decided[0])
                self._raised_here(k)
                self._resync_now(seq, code)
        m[b] = seq << 4 | code
        m[b + AT_RAISED] = m[b]
        late = (f" [{self._me()} had returned from call {k} before the report came; it raises it in its "
                f"next call, {NAMES.get(code, '?')} sequence {seq}, and takes no part in that]") \
            if not word & ACROSS else f" [{self._me()} was past call {k}, after which the others raise this]"
        err = _peer_error((report_of(self.rel.progress, word, self.group.name) or f"rank {who} reported a disagreement in call {k}")
                          + late)
        try:   # refused at once: members already inside call seq are stood in for without delay
            self.refuse(seq, code, err, None)
        finally:   # the reporter's final words (read above, with its decision)
            if word & ACROSS:   # decided (no fresh communicator), its words read above
                self._after(k, False)
            else:
                reason, resync = decided
                self._after(k, resync is None and self._fresh(self._late_decision(who, k), k))
                if reason:
                    err.args = (reason + late,)

    def _late_decision(self, who, k):
        """The decision of reporter ``who`` that was not there in time before this rank's
        refusal: read once more (a fresh communicator at this rank's next call); None when
        still undecided."""
        return self._decision(who, k)[1]

    def _ran_ahead(self, k, seq, who, reason):
        """This rank made calls ``k + 1`` to ``seq - 1`` of the group on the old communicator
        before the report about call ``k`` came (it had returned from call k: a broadcast's
        root, a gather's sender), and the group starts afresh after call k: the members make
        those calls on the fresh communicator, where they wait for this rank's part for ever.
        Ends the job now, naming the calls (never returns)."""
        names = ", ".join(f"call {c} ({sp.describe()})" if sp is not None else f"call {c}"
                          for c, sp in ((c, self.spec_for(c)) for c in range(k + 1, min(seq, k + 4))))
        more = f" and {seq - k - 4} more" if seq - k > 4 else ""
        msg = (f"{reason or f'rank {who} reported a disagreement in call {k}'}. {self._me()} had returned "
               f"from call {k} and made {names}{more} of group {self.group.name!r} before the report came; "
               "the group starts afresh after the report, and the members make them on the fresh "
               "communicator, where they cannot complete: the job ends")
        self.rel.watchdog.end_job(self.group, msg)

    def _fresh(self, decision, k):
        """Whether the group makes a fresh communicator after call ``k``: the reporter's
        ``decision``, or where it was not published in time, the decision every reporter makes
        for an async call (its request may stay pending: always afresh)."""
        if decision is not None:
            return bool(decision)
        sp = self.spec_for(k)
        return sp is not None and bool(sp.words()[0] & ASYNC)

    def told(self, seq, j):
        """Group rank ``j`` refused call ``seq``, which this rank has made: raise its report
        (once it has decided, after its stand-in, whether the group needs a fresh start)."""
        who = self.group.ranks[j]
        self._answer(seq)
        reason, resync = self._decision(who, seq)
        m, b = self.mem, self.row
        word = m[b + AT_POISON]
        if word and (word >> 24) == seq:
            self._poison_cas(word, 0)
        self._after(seq, self._fresh(resync, seq))
        raise _peer_error(reason or f"rank {who} refused call {seq}")

    def poisoned_after(self, seq, code, waiting=False):
        """After call ``seq`` returned: a member's report about it arrived, or the report across
        hosts that every rank raises after this call. A report about an earlier call, which
        this rank had returned from (it came while this rank was in call ``seq``, which its
        members made too), stays for the next call: this rank refuses that one and raises the
        report there (``poisoned``), so that every member raises in that same call. (Raised
        here, on this rank alone, it made a program that catches the error skip other calls
        on this rank than on the others.) ``waiting``: Work.wait's check while call ``seq`` is
        pending, where a report about an earlier call is raised at once, the request abandoned
        (where the group starts afresh its members never come to it)."""
        from ._reliability.agreement import ACROSS, poison_fields, report_of

        m, b = self.mem, self.row
        word = m[b + AT_POISON]
        k, who = poison_fields(word)
        if k <= self.raised or k > seq or (k < seq and (word & ACROSS or not waiting)):
            return   # (k > seq: a member ahead, refused when this rank gets there; k < seq: as above)
        self._poison_cas(word, 0)   # (a word that came meanwhile stays for the next call)
        m[b + AT_DONE] = seq << 4 | code
        if word & ACROSS:   # every member made call k as usual: the group needs nothing more
            self._raised_here(k)
            raise _peer_error((report_of(self.rel.progress, word, self.group.name) or f"rank {who} found that calls differ between "
                               "hosts") + f" [raised after call {k}, on every rank of the group]")
        self._answer(k, seq)
        reason, resync = self._decision(who, k)
        self._after(k, self._fresh(resync, k))
        raise _peer_error(reason or f"rank {who} reported a disagreement in call {k}")


def _code(name):
    """The collective code of ``name`` (looked up only on a slow path)."""
    return next((c for c, n in NAMES.items() if n == name), 0)


def _clean(specs, refused):
    """Whether the calls of one sequence number leave no message in the communicator (then the
    group needs no fresh start), from the descriptions ``specs`` (PeerSpec) of the calls of the
    members that entered it (one for each signature among them) and whether a member refused it
    (that member's stand-in makes its part). Every rank that decides has all the descriptions, so all decide alike (members that kept the old
    communicator where others started afresh would return another call's bytes)."""
    if not specs:
        return True   # no member entered the call
    a = specs[0]
    if any(sp.started and not sp.gpu for sp in specs):   # (a started MPI request may stay
        return False                                    # pending; a blocking stand-in never matches it)
    if not all(sp.words() == a.words() or same_bytes(a, sp) for sp in specs[1:]):
        return False
    return not refused or standable(a)   # (a refusing member stands in with scratch arrays)


def _peer_error(reason):
    """The error for a member's report: a refusal for an invalid argument is also an
    InvalidArgumentError (the call was invalid, on that rank)."""
    from .errors import RefusedElsewhereError

    if " refused " in reason and ": InvalidArgumentError: " in reason:
        return RefusedElsewhereError(reason)
    return CollectiveMismatchError(reason)
