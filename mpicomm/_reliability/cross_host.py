"""The watchdog's comparison of calls across hosts.

Ranks of one host compare their calls through shared memory (mpicomm._reliability.agreement);
across hosts, the first member of a group on each host compares the group's history with
the next host's first member's, by RMA reads started at one wake of the watchdog and
completed at a later one. :class:`CrossHostCheck` is a part of
mpicomm._reliability.watchdog.Watchdog: its state is the watchdog's ``_xnext``, ``_xseen``,
``_xturn``, ``_xspec`` and ``_xread``; it ends the job through the watchdog's ``_report``.
"""
from __future__ import annotations

import time

from . import agreement as agr
from .progress import F


class CrossHostCheck:
    """The comparison across hosts of the watchdog (see the module docstring)."""

    def final_check(self):
        """At exit: the last comparison across hosts (a job whose last calls differ between
        hosts must not end with status 0): reads started now, waited for at most
        XHOST_GIVE_UP s."""
        if self.fired:
            return
        reads = {}   # (not the watchdog thread's: it may still be running)
        try:
            self._cross_hosts(time.monotonic(), final=True, reads=reads)   # starts the reads
            t0 = time.monotonic()
            while reads and not self.fired:
                time.sleep(0.01)
                self._cross_hosts(time.monotonic(), final=True, reads=reads, start=False,
                                  give_up=time.monotonic() - t0 > agr.XHOST_GIVE_UP)
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
            pend = reads.get(b)
            if pend is None or pend[0] != disp.xhost:   # start the reads; compared at a later wake
                if start:
                    started = agr.cross_host_start(self.progress, disp)
                    if started is not None:
                        reads[b] = (disp.xhost, started, now)
                continue
            _, (r1, r2), t0 = pend
            late = give_up or now - t0 > agr.XHOST_GIVE_UP
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
                continue
            first = found[0]
            if self._xseen.get(b, (None,))[0] != first:
                self._xseen[b] = (first, now)
                sp = disp.spec_for(first)
                self._xspec[b] = sp   # (the flight ring may have moved on when it fires)
                if sp is not None:    # for the other host's report
                    agr.publish_spec(self.progress.m, b, first, sp)
            if now - self._xseen[b][1] < agr.XHOST_PERIOD and not final:
                continue   # a member's report may still be on its way
            return self._fire_cross(g, b, disp, *found)
        return False

    def _fire_cross(self, g, b, disp, first, mine_w, theirs_w):
        from .._callspec import PeerSpec

        with self._lock:
            if self.fired:
                return True
            self.fired = True
        j, wr, slot = disp.xhost
        me = self.progress.wrank
        me_spec = self._xspec.get(b) or disp.spec_for(first)
        if me_spec is not None:
            agr.publish_spec(self.progress.m, b, first, me_spec)
        sw = None   # the other host's first member describes its call too (its watchdog)
        for _ in range(int(agr.XHOST_PERIOD * 2 / 0.1)):
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
        msg = (f"rank {me}: {why}. The calls returned on both hosts, so their results differ between "
               "them; every rank must make the same call (collective, dtype, element count, op, root, "
               "sizes). The job ends: ranks on different hosts are compared after their calls")
        self.lagging = []
        self._report(msg, False, g.ranks, kind="CollectiveMismatchError")
        return True
