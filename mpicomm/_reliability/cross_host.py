"""The watchdog's comparison of calls across hosts.

Ranks of one host compare their calls through shared memory (mpicomm._reliability.agreement);
across hosts, the first member of a group on each host compares the group's history with
the next host's first member's, by RMA reads started at one wake of the watchdog and
completed at a later one. A difference is told to every member of the group as a report
word (POISON, ACROSS) that names a call a little ahead: every member makes that call as
usual and raises the report as it returns, and the group goes on. At exit, a report that
this rank has not raised yet (no call came) ends the job. :class:`CrossHostCheck` is a part of
mpicomm._reliability.watchdog.Watchdog: its state is the watchdog's ``_xnext``, ``_xseen``,
``_xturn``, ``_xspec``, ``_xread`` and ``_xtold``; it ends the job through the watchdog's
``_report``.
"""
from __future__ import annotations

import time

from .._timing import TIMING
from . import agreement as agr
from .progress import AT_POISON, ENTERED, POISON, F


class CrossHostCheck:
    """The comparison across hosts of the watchdog (see the module docstring)."""

    def final_check(self):
        """At exit: the last comparison across hosts (a job whose last calls differ between
        hosts must not end with status 0): reads started now, waited for at most
        ``TIMING.xhost_give_up`` s."""
        if self.fired:
            return
        for b, (g, first, msg, _) in list(self._xtold.items()):   # told, but no call came to raise it in
            disp = getattr(g, "disp", None)
            if disp is not None and disp.raised < first and not self.fired:
                self.fired = True
                self.lagging = []
                self._report(msg + ". This rank made no call of the group after the report; the job ends",
                             False, g.ranks, kind="CollectiveMismatchError")
                return
        reads = {}   # (not the watchdog thread's: it may still be running)
        try:
            self._cross_hosts(time.monotonic(), final=True, reads=reads)   # starts the reads
            t0 = time.monotonic()
            while reads and not self.fired:
                time.sleep(0.01)
                self._cross_hosts(time.monotonic(), final=True, reads=reads, start=False,
                                  give_up=time.monotonic() - t0 > TIMING.xhost_give_up)
        except Exception:
            pass

    def _cross_hosts(self, now, final=False, reads=None, give_up=False, start=True):
        """Across hosts (no host neighbour compares those calls): for each group where this
        rank is its host's first member, compare the group's history (every call so far,
        hashed) with the next host's first member's (agreement.cross_host; two RMA reads per
        group a round, at most XHOST_GROUPS groups a round). A difference still there a round
        later is calls that returned different results on the two hosts: the job ends naming
        them. True when it fired."""
        todo = [(g, b, g.disp) for g, b in list(self.progress.rows.items())
                if getattr(g, "disp", None) is not None and g.disp.xhost is not None and g.disp.check]
        if len(todo) > agr.XHOST_GROUPS:   # in turns
            self._xturn = (self._xturn + agr.XHOST_GROUPS) % len(todo)
            todo = (todo[self._xturn:] + todo[:self._xturn])[:agr.XHOST_GROUPS]
        if reads is None:
            reads = self._xread
        for g, b, disp in todo:
            if not final:   # (this rank's pace of calls on the group, from the last round: _raise_after)
                last = self._xrate.get(b)
                self._xrate[b] = (now, disp.seq, last[:2] if last is not None else None)
            pend = reads.get(b)
            if pend is None or pend[0] != disp.xhost:   # start the reads; compared at a later wake
                if start:
                    started = agr.cross_host_start(self.progress, disp)
                    if started is not None:
                        reads[b] = (disp.xhost, started, now)
                continue
            _, (r1, r2), t0 = pend
            late = give_up or now - t0 > TIMING.xhost_give_up
            row, theirs = self.progress.done_read(r1, late), self.progress.done_read(r2, late)
            if row is None or theirs is None:
                if late:
                    del reads[b]
                continue
            del reads[b]
            found = agr.cross_host(self.progress, disp, b, row, theirs)
            if found is None:
                self._xseen.pop(b, None)
                self._xspec.pop(b, None)
                self._xpeer.pop(b, None)
                continue
            first = found[0] if found[3] is None else "history"   # (a history's first checkpoint
            if self._xseen.get(b, (None,))[0] != first:           # that differs moves on with the calls)
                self._xseen[b] = (first, now)
                self._xpeer.pop(b, None)
                sp = disp.spec_any(first, found[1]) if found[3] is None else None
                self._xspec[b] = sp   # (the flight ring may have moved on when it fires)
                if sp is not None:    # for the other host's report
                    agr.publish_spec(self.progress.m, b, first, sp)
            if found[3] is None and b not in self._xpeer:   # the other host's description of its
                sw = agr.spec_words(row, first)              # call, from the row read this round
                if sw is not None:
                    self._xpeer[b] = sw.copy()
            waited = now - self._xseen[b][1]
            if not final and (waited < TIMING.xhost_period or (
                    found[3] is None and b not in self._xpeer and waited < TIMING.xhost_describe)):
                continue   # a member's report may still be on its way; the other host's words too
            if final:
                return self._fire_cross(g, b, disp, *found)
            self._tell_cross(g, b, disp, *found)
        return False

    def _describe_cross(self, g, b, disp, first, mine_w, theirs_w, since=None):
        """The report of call ``first`` that differs between this rank and the next host's
        first member (both calls described: the other one's words as its row had them in a
        round of the comparison, else read now, waiting up to twice ``TIMING.xhost_period`` for
        them), or with ``since``, of their histories of the calls after ``since`` up to ``first``."""
        from .._callspec import PeerSpec

        j, wr, slot, _ = disp.xhost
        me = self.progress.wrank
        if since is not None:
            return (f"calls {since + 1} to {first} on group {g.name!r}: the ranks on two hosts called differently "
                    f"in at least one of them: rank {me}'s history of those calls (a hash of their signatures) "
                    f"differs from rank {wr}'s; which call differs is not known (more than 256 calls between two "
                    "comparisons; MPICOMM_DEBUG=1 names it). The calls returned, so their results differ; every "
                    "rank must make the same call")
        me_spec = self._xspec.get(b) or disp.spec_any(first, mine_w)
        if me_spec is not None:
            agr.publish_spec(self.progress.m, b, first, me_spec)
        sw = self._xpeer.get(b)   # the other host's first member describes its call too (its
        for _ in range(0 if sw is not None else int(TIMING.xhost_period * 2 / 0.1)):   # watchdog)
            row = self.progress.read_words(wr, slot, F)
            sw = agr.spec_words(row, first) if row is not None else None
            if sw is not None or row is None:
                break
            time.sleep(0.1)
        mine = me_spec.describe() if me_spec is not None else f"signature {mine_w & 0xFFFFFFFF:#010x}"
        other = PeerSpec(sw).describe(me_spec) if sw is not None else \
            f"another call (signature {theirs_w & 0xFFFFFFFF:#010x})"
        what = f"; differs in {me_spec.diff(PeerSpec(sw))}" if sw is not None and me_spec is not None else ""
        name = me_spec.name if me_spec is not None else "call"
        why = (f"{name} sequence {first} on group {g.name!r}: the ranks on two hosts called differently: "
               f"rank {me}: {mine}; rank {wr}: {other}{what}")
        return (f"{why}. Both calls returned (ranks on different hosts are compared after their calls), "
                "so their results differ; every rank must make the same call")

    def _tell_cross(self, g, b, disp, first, mine_w, theirs_w, since=None):
        """Tell every member of the group (this rank too) of the difference: the report in
        this rank's window (XREASON) and a word in each member's row naming the call after
        which every member raises it (mpicomm._dispatch_checks: ``poisoned_after``); the group
        goes on."""
        p = self.progress
        me = p.wrank
        told = self._xtold.get(b)
        if not disp.xhost[3] or (told is not None and disp.raised < told[3]):
            return   # (of two hosts, the other first member, of the lower rank, tells; told already)
        msg = self._describe_cross(g, b, disp, first, mine_w, theirs_w, since)
        with self._lock:
            if self.fired or self._told_here(b):   # (another host's first member told it first)
                return
            after = self._raise_after(b, disp)
            self._xtold[b] = (g, first, f"rank {me}: {msg}", after)
            p.set_reason(f"rank {me} (comparing with rank {disp.xhost[1]}): {msg}", across=True)
        # the words; no fresh communicator follows (the calls returned on every rank: their
        # bytes matched). Only where no other report waits: a member with one raises that one
        # in the same call as the others. Here, over this rank's own marker of a fresh start.
        word = agr.poison_word(after, me, across=True)
        for j, wr in enumerate(g.ranks):
            if wr == me:
                w = int(p.m[b + AT_POISON])
                if not w or (agr.poison_fields(w)[1] == me and agr.poison_fields(w)[0] <= disp.raised):
                    p.cas(me, b + AT_POISON, w, word)   # (a member's report that came meanwhile stays)
            else:
                p.put_if_zero(wr, agr.poison_index(disp.slots[j]), word)

    def _raise_after(self, b, disp):
        """The call after which every member raises a report told now: this rank's next calls
        for ``TIMING.xhost_ahead`` s at its present pace (at least 16), so that the report reaches
        every member before the call, and they all raise it after the same call, which
        every one of them makes as usual (no call of the group is refused or left unmatched)."""
        seq = disp.seq
        last = self._xrate.get(b)
        last = last[2] if last is not None else None
        rate = (seq - last[1]) / max(time.monotonic() - last[0], 0.05) if last is not None else 0
        return seq + max(16, int(rate * TIMING.xhost_ahead))

    def _told_here(self, b):
        """A report across hosts waits in this rank's row (group row ``b``) already."""
        w = int(self.progress.m[b - ENTERED + POISON])
        return bool(w & agr.ACROSS) and agr.poison_fields(w)[1] != self.progress.wrank

    def _fire_cross(self, g, b, disp, first, mine_w, theirs_w, since=None):
        """At exit (no call is left to raise it in): end the job with the report."""
        with self._lock:
            if self.fired:
                return True
            self.fired = True
        msg = self._describe_cross(g, b, disp, first, mine_w, theirs_w, since)
        self.lagging = []
        self._report(f"rank {self.progress.wrank}: {msg}. The job ends: the difference was found as this "
                     "rank left", False, g.ranks, kind="CollectiveMismatchError")
        return True
