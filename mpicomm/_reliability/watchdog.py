"""The watchdog: a thread that notices a collective pending past the timeout and says why.

It sleeps on an Event and wakes every ``min(TIMING.watch_every, timeout / 10)`` (0.25 s by
default; mpicomm._timing holds every wait named here). When it sees the
same collective pending on two wakes further apart than the timeout, it reads the
peers' progress rows, prints ``CollectiveTimeoutError: ...`` naming the collective,
the group, its sequence number, shape, dtype and the ranks that have not reached it,
aborts the NCCL communicators and then the job. Blocking MPI collectives stay
blocking calls (much faster than a nonblocking call plus polling), so the thread that
notices must be another one. NCCL calls return at once: for them the watchdog
records a CUDA event on the stream of each group's last call (the transport's
``last_stream``) and watches it.
"""
from __future__ import annotations

import collections
import sys
import threading
import time

from .._backends.capture import relax_this_thread, stream_capturing
from .._ops import NAMES
from .._timing import TIMING
from ..errors import CollectiveTimeoutError
from .abort import abort_job, rank_prefix
from . import agreement as agr
from .cross_host import CrossHostCheck
from .standstill import Standstills
from .diagnosis import Diagnosis, describe_array
from .progress import (DUMP, REPLAY_WAIT, REPLAYS, ENTERED, EXITED, P2P, P2P_GH, P2P_TAG, POISON, TDONE, XSTATUS,
                       replay_wait, replay_wait_fields,
                       ghash, p2p_fields, reason_tag)
from .stacks import Stacks, stack_path


class Watchdog(Diagnosis, CrossHostCheck, Standstills):
    """The watchdog thread of one process: its polling loop, the agreement check of waiting
    calls, the GPU events, and the report that ends the job. The report texts are
    Diagnosis's (mpicomm._reliability.diagnosis), the comparison across hosts
    CrossHostCheck's (mpicomm._reliability.cross_host)."""

    def __init__(self, progress, groups, timeout, world, device_id=None, flight=None):
        self.progress = progress
        self.groups = groups           # () -> the live groups (each with .transport and .disp)
        self.timeout = timeout
        self.world = world
        self.device_id = device_id     # the GPU to record events on (NCCL), else None
        self.flight = flight           # the flight recorder, written with every report (or None)
        self.fired = False
        self.stacks = Stacks(world.rank, rank_prefix)
        self.lagging = []              # the ranks the last diagnosis found not in the call
        self._p2p_seen = None          # (P2P word, first seen) of the send/recv in progress
        self._compared = set()         # (row, entered word) whose members' signatures were compared
        self._refused_seen = {}        # (row, seq) -> when a member's refusal of it was first seen
        self._peers_read = None          # ((row, ENTERED), crossed wait seen, since when): _crossed
        self._dump_seen = 0            # the last DUMP stamp answered
        self._xnext = 0.0              # when the calls are next compared across hosts
        self._xseen = {}               # row -> (first call that differs across hosts, when first seen)
        self._xturn = 0                # where the next round of those comparisons starts
        self._xspec = {}               # row -> this rank's CallSpec of the first call that differs
        self._xpeer = {}               # row -> the other host's SPEC words of that call (from its row)
        self._xread = {}               # row -> (partner, its reads in flight, started)
        self._xtold = {}               # row -> (group, call, report) told to the members
        self._xrate = {}               # row -> (time, sequence number, the same of the round before)
        self._owner = {}               # row -> the group it is watched for (a row freed by a destroyed
        #                                group and given to a new one starts with no state of the old)
        self._replays = collections.deque()   # [event, count, when, Captured or None] of mpicomm.replay
        #                                       calls not known done (event None: being launched)
        self.graphs = {}               # graph key -> its mpicomm._replay.Captured (made by mpicomm.capture)
        self._behind = None            # (the peers' REPLAY_WAIT words, first seen): peers wait in a graph
        #                                this rank has replayed fewer times
        self._behind_next = 0.0        # when the peers' replay counts are next read
        self._lock = threading.Lock()  # diagnosis from the watchdog and from Work.wait
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        if self.timeout > 0:
            self.stacks.install_signal()
            self._thread = threading.Thread(target=self._loop, name="mpicomm-watchdog", daemon=True)
            self._thread.start()

    def stop(self):
        self._stop.set()
        self.stacks.uninstall_signal()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=TIMING.stop_wait)
        self._thread = None

    def _loop(self):
        period = min(TIMING.watch_every, self.timeout / 10)
        seen = {}       # row -> (entered word, first seen monotonic)
        done = {}       # row -> last done word seen
        events = {}     # row -> (done word, cuda event, recorded at, what, group)
        if self.device_id is not None:
            try:
                import cupy

                cupy.cuda.runtime.setDevice(self.device_id)
            except Exception:
                pass
            relax_this_thread()   # its event queries never invalidate the script's CUDA-graph capture
        while not self._stop.wait(period):
            try:
                self._tick(seen, done, events)
            except Exception as e:  # never let the watchdog die silently
                sys.stderr.write(f"{rank_prefix()}mpicomm watchdog error: {type(e).__name__}: {e}\n")
            if self.fired:
                return

    def _tick(self, seen, done, events):
        now = time.monotonic()
        wall = int(time.time() * 1000)
        p = self.progress
        m = p.m
        rows = list(p.rows.items())
        self._own_rows(rows, seen, done, events)
        for g, b in rows:  # b: index of the row's ENTERED word
            e, d = m[b], m[b + 1]
            if done.get(b) != d:  # stamp completion time here, not on the hot path
                done[b] = d
                m[b - ENTERED + TDONE] = wall
            self._answer(g, b, e, d)
            if e != d:
                s = seen.get(b)
                if s is None or s[0] != e:
                    seen[b] = (e, now)
                    continue
                if now - s[1] >= TIMING.wait_check and self._disagreement(g, b, e >> 4, now - s[1]):
                    return
                states = p.read_peers([r for r in g.ranks if r != p.wrank]) if now - s[1] >= TIMING.exit_check else None
                if states is not None and self._crossed(g, b, e, s, now, states):
                    return   # (one read of the members' windows for both findings)
                if now - s[1] >= self.timeout or (states is not None and (self._peer_exited(g, e >> 4, states)
                                                                          or self._creating_apart(g, e, states))):
                    disp = getattr(g, "disp", None)
                    desc = disp.describe(e & 15) if disp is not None else "?"
                    self.fire(g, e >> 4, NAMES.get(e & 15, "?"), desc, now - s[1],
                              early=now - s[1] < self.timeout)
                    return
            else:
                seen.pop(b, None)
        w = m[P2P]   # a blocking send or recv in progress
        if w and self._p2p_gpu_done(w):
            w = 0
        if w:
            s = self._p2p_seen
            if s is None or s[0] != w:
                self._p2p_seen = (w, now)
            else:
                waited = now - s[1]
                peer = p2p_fields(w)[1]
                if waited >= self.timeout or (waited >= TIMING.exit_check and self._exited([peer])):
                    self.fire_p2p(w, waited, early=waited < self.timeout)
                    return
        else:
            self._p2p_seen = None
        if m[DUMP] != self._dump_seen:   # a peer's report asks for this rank's stack
            self._dump_seen = m[DUMP]
            self.stacks.publish(self.stacks.take(), "asked for by a peer's timeout report")
            if m[REPLAYS] and not self._replays and self._tick_behind(now, asked=True):
                return   # (its peers wait in a graph this rank has not replayed: its own report)
        text = self.stacks.signalled()
        if text:
            self.stacks.publish(text, "SIGUSR1")
            sys.stderr.write(self._flight_line("SIGUSR1"))
            sys.stderr.flush()
        if self.device_id is not None:
            if self._replays and self._tick_replays(now):
                return
            if not self._replays and self.progress.m[REPLAYS] and self._tick_behind(now):
                return
            self._tick_gpu(events, now)
        if now >= self._xnext:
            self._xnext = now + TIMING.xhost_every
            if self._cross_hosts(now):
                return
        p.poke()

    def _own_rows(self, rows, seen, done, events):
        """Forget what was watched on a row whose group is gone or changed: a destroyed
        group's row is handed to the next group made, whose calls may carry the same words
        (the same number and collective), which must not inherit the old group's waiting
        time or findings (a false timeout report)."""
        owners = {}
        for g, b in rows:
            owners.setdefault(b, []).append(g)
        for b in [b for b, g in self._owner.items() if owners.get(b) != [g]]:
            del self._owner[b]
            for d in (seen, done, events, self._xseen, self._xspec, self._xpeer, self._xread, self._xtold,
                      self._xrate):
                d.pop(b, None)
            self._compared = {k for k in self._compared if k[0] != b}
            self._refused_seen = {k: v for k, v in self._refused_seen.items() if k[0] != b}
            if self._peers_read is not None and self._peers_read[0][0] == b:
                self._peers_read = None
        for b, gs in owners.items():
            if len(gs) == 1:   # (the shared overflow row has no owner: nothing is published there)
                self._owner.setdefault(b, gs[0])

    # ------------------------------------------------------ the agreement check
    def _answer(self, g, b, e, d):
        """Publish this rank's description of each call a peer may need: the call a member's
        report (POISON) is about, and the call waiting now (a refusing member stands in for
        it; the peers' diagnosis names it). Each in its own slot (progress.SPEC_AT)."""
        m = self.progress.m
        base = b - ENTERED
        disp = getattr(g, "disp", None)
        if disp is None:
            return
        pw = m[base + POISON]
        if pw & agr.ACROSS:   # (a report across hosts: its reporter has described it already)
            pw = 0
        want = []
        if e != d:   # the call waiting now, unless this rank refused it (no spec)
            w = m[disp.cb + (e >> 4) % agr.CALLS_N]
            if not (w >> 32 == e >> 4 and w & 0xFFFFFFFF == agr.REFUSED):
                want.append(e >> 4)
        if not pw and d >> 4:
            # and the call this rank returned from last: a member still blocked in it (this rank
            # was a broadcast root, or its call returned at once) names it in its report, not as
            # "another call"
            w = m[disp.cb + (d >> 4) % agr.CALLS_N]
            if w >> 32 == d >> 4 and w & 0xFFFFFFFF != agr.REFUSED:
                want.append(d >> 4)
        if pw:
            k, who = agr.poison_fields(pw)
            if who != self.progress.wrank and k <= e >> 4:
                # and the calls this rank made since (a member that refuses one of them, as the
                # report reached it first, stands in for it): the reported call's last, so it stays
                want = [c for c in [*want, *range(max(k + 1, (e >> 4) - agr.SPEC_SLOTS + 2), e >> 4)]
                        if c == k or (c - k) % agr.SPEC_SLOTS] + [k]
        xs = self._xseen.get(b) if not pw else None   # (while a difference across hosts is being
        xs = xs[0] if xs is not None and isinstance(xs[0], int) else None   # described, its
        for k in want:                                                      # description stays)
            if xs is not None and k != xs and (k - xs) % agr.SPEC_SLOTS == 0:
                continue
            if not agr.spec_published(m, b, k):
                sp = disp.spec_for(k)
                if sp is not None:
                    agr.publish_spec(m, b, k, sp)

    def _members_go_afresh(self, g, disp, pw, who):
        """True when the report ``pw`` (by world rank ``who``) is across hosts, or its reporter
        decided that the group makes a fresh communicator after the reported call: the members
        will not make this rank's call on the old one. Where it decided not to, they come to it
        (the timeout watches them); undecided: not yet."""
        if pw & agr.ACROSS:
            return True
        if who not in g.ranks:
            return False
        k, _ = agr.poison_fields(pw)
        return agr.decision_of(self.progress, who, disp.slots[g.ranks.index(who)], k) is True

    def _disagreement(self, g, b, seq, waited):
        """Once per waiting call: compare every member's signature of call ``seq``; where they
        differ (or a member refused it, or a report says the call cannot come) end the job
        with every rank's call named. True when it fired."""
        disp = getattr(g, "disp", None)
        key = (b, seq)
        if disp is None or disp.slots is None or not disp.check:
            return False
        if disp.fresh_at == seq:   # making the fresh communicator before call seq: no call to compare
            return self._fresh_apart(g, disp, key, seq, waited)
        m = self.progress.m
        pw = m[b - ENTERED + POISON]
        if pw:   # a report about an earlier call: the members will not come to this one
            k, who = agr.poison_fields(pw)
            # (this rank's own word is a report when it comes from the comparison across hosts;
            # else it marks a fresh communicator due after this rank raised)
            news = k > disp.raised if pw & agr.ACROSS else who != self.progress.wrank
            if news and k < seq and waited >= TIMING.refusal_wait and self._members_go_afresh(g, disp, pw, who):
                why = agr.report_of(self.progress, pw, g.name) or f"rank {who} reported a disagreement in call {k}"
                return self._fire_mismatch(g, seq, f"{why}; this rank went on to call {seq}, which the "
                                           "others will not make", waited)
            if news and k == seq and not pw & agr.ACROSS and who in g.ranks:   # a member raised inside
                j = g.ranks.index(who)   # this very call (MPI's own error there, the same signatures;
                row = agr.read_row(self.progress, who, disp.slots[j])   # not a refusal: its stand-in
                if row is not None and agr.ring_word(row, seq)[1] == "entered":   # comes)
                    first = self._refused_seen.setdefault(key, time.monotonic())
                    if time.monotonic() - first >= 2 * TIMING.refusal_wait:
                        why = agr.report_of(self.progress, pw, g.name) or f"rank {who} raised in call {k}"
                        return self._fire_mismatch(g, seq, f"{why}; rank {who} left the call, in which this "
                                                   "rank waits for it", waited)
        if key in self._compared and key not in self._refused_seen:
            return False
        self._compared.add(key)
        if len(self._compared) > 4096:
            self._compared.clear()
            self._refused_seen.clear()
        mine = int(m[disp.cb + seq % agr.CALLS_N])
        if mine >> 32 != seq:   # still preparing the call: its word is not there yet, and the members'
            return False        # words compared with an older one would all differ; the timeout watches
        if mine & 0xFFFFFFFF == agr.REFUSED:
            # this rank refused the call: its refusal waits for every member to come to the call
            # (the timeout watches a member still on its way) and for a description of the call
            # from one that entered it, then stands in for those inside. Neither the wait for a
            # description nor the stand-in should take long: past 2 x refusal_wait, no member
            # described the call, or the stand-in does not complete (they left the call:
            # raised in it, or started it async)
            first = self._refused_seen.setdefault(key, time.monotonic())
            if time.monotonic() - first < 2 * TIMING.refusal_wait:
                return False
            for j, wr in enumerate(g.ranks):   # a member not there yet: the refusal waits for it
                row = agr.read_row(self.progress, wr, disp.slots[j]) if j != g.rank else None
                if row is not None and agr.ring_word(row, seq)[1] == "behind":
                    return False
            why = (self.progress.reason_of(self.progress.wrank, tag=reason_tag(g.name, seq))
                   or "this rank refused the call")
            return self._fire_mismatch(g, seq, f"{why}; this rank's stand-in for the members that entered "
                                       "the call does not complete (they left it, or none of them described it)",
                                       waited)
        bad, refused, behind, refusing = [], [], False, False
        for j, wr in enumerate(g.ranks):
            if j == g.rank:
                continue
            row = agr.read_row(self.progress, wr, disp.slots[j])
            if row is None:
                continue
            w, st = agr.ring_word(row, seq)
            behind = behind or st == "behind"
            if st == "refused":
                refused.append(wr)
                refusing = refusing or int(row[agr.DONE]) >> 4 < seq   # (its refusal not over yet)
            elif st == "entered" and w != mine:
                bad.append((j, wr, row))
        if refused:   # the refusing rank stands in for this call: fire only if that does not come
            # once its refusal is over (it has written DONE for the call: it stood in, or could
            # not) and this rank still waits. While it waits for the members (one still on its
            # way, or their descriptions) or stands in, its own watchdog and the timeout watch it
            if behind or refusing:
                self._refused_seen.pop(key, None)
                return False
            first = self._refused_seen.setdefault(key, time.monotonic())
            if time.monotonic() - first >= TIMING.refusal_wait:
                tag = reason_tag(g.name, seq)
                why = "; ".join(dict.fromkeys(self.progress.reason_of(wr, tag=tag) or f"rank {wr} refused the call"
                                              for wr in refused))   # (each reason once)
                return self._fire_mismatch(g, seq, why, waited)
            return False
        if not bad:
            return False
        from .._callspec import PeerSpec, same_bytes

        me_spec = disp.spec_for(seq)
        specs = self._peer_specs(g, disp, seq, bad)
        if me_spec is not None:
            # a member whose call moves the same bytes (an op or a dtype of one size apart) does
            # not keep this call from completing (a slow member may): the comparison after it
            # reports the difference; the timeout watches the wait
            bad = [t for t in bad if specs.get(t[1]) is None or not same_bytes(me_spec, PeerSpec(specs[t[1]]))]
            if not bad:
                return False
        calls = [f"rank {self.progress.wrank}: {me_spec.describe() if me_spec else NAMES.get(int(m[b]) & 15, '?')}"]
        for j, wr, _ in bad:
            sw = specs.get(wr)
            calls.append(f"rank {wr}: " + (PeerSpec(sw).describe(me_spec) if sw is not None else "another call"))
        why = (f"{NAMES.get(int(m[b]) & 15, '?')} sequence {seq} on group {g.name!r}: the ranks called "
               f"differently: " + "; ".join(calls))
        return self._fire_mismatch(g, seq, why, waited)

    def _peer_specs(self, g, disp, seq, bad):
        """{world rank: SPEC words} of the members in ``bad`` whose call ``seq`` differs: each
        publishes its description (as it enters the call, or at its watchdog's next wake); this
        waits for those words, at most TIMING.spec_wait, and names "another call" for a member
        whose words did not come."""
        specs = {}
        deadline = time.monotonic() + TIMING.spec_wait
        while True:
            for j, wr, _ in bad:
                if wr not in specs:
                    row = agr.read_row(self.progress, wr, disp.slots[j])
                    sw = agr.spec_words(row, seq) if row is not None else None
                    if sw is not None:
                        specs[wr] = sw
            if len(specs) == len(bad) or time.monotonic() > deadline:
                return specs
            time.sleep(TIMING.watch_every / 10)

    def _fire_mismatch(self, g, seq, why, waited):
        with self._lock:
            if self.fired:
                return True
            self.fired = True
        msg = (f"rank {self.progress.wrank}: call {seq} on group {g.name!r} cannot complete (waited "
               f"{waited:.1f} s): {why}. Every rank must make the same call; the job ends because this "
               "rank is blocked inside it")
        self.lagging = []
        self._report(msg, False, g.ranks, kind="CollectiveMismatchError")
        return True

    def end_job(self, g, msg):
        """End the job now, from the main thread, with ``msg`` (a disagreement in group ``g``
        that the members cannot recover from, found by the dispatcher); never returns."""
        with self._lock:
            fired, self.fired = self.fired, True
        if fired:   # (the watchdog is reporting already: it ends the job, else this rank does)
            time.sleep(TIMING.grace + TIMING.dump_wait + 5)
        self.lagging = []
        self._report(msg, False, g.ranks, kind="CollectiveMismatchError")

    def _p2p_disp(self):
        gh = int(self.progress.m[P2P_GH])
        g = next((g for g in self.groups() if ghash(g.name) == gh), None)
        return getattr(g, "disp", None)

    def _p2p_gpu_done(self, w):
        """An NCCL send/recv (its word left up by the dispatcher): True, and the word cleared,
        once the CUDA event after it has completed."""
        d = self._p2p_disp()
        ev = getattr(d, "p2p_ev", None)
        if ev is None or ev[0] != w:
            return False
        try:
            done = ev[1].done
        except Exception:
            done = True
        if done:
            m = self.progress.m
            if m[P2P] == w:
                m[P2P] = 0
            d.p2p_ev = None
            self._p2p_seen = None
        return done

    def _exited(self, ranks):
        """True when one of world ``ranks`` has left its script."""
        states = self.progress.read_peers([r for r in ranks if r != self.progress.wrank])
        return any(st is not None and st[EXITED] for st in states.values())

    def _exit_code(self, ranks):
        """The exit status the job should end with: that of the first of ``ranks`` that left
        its script with a non-zero status (read from its window), else 1."""
        states = self.progress.read_peers([r for r in ranks if r != self.progress.wrank])
        for r in sorted(states):
            st = states[r]
            if st is not None and st[EXITED] and int(st[XSTATUS]) > 1:
                return int(st[XSTATUS]) - 1
        return 1

    def _tick_gpu(self, events, now):
        """Watch the GPU side of each group's last collective: when the group's done marker
        has moved since the last event, record an event on the stream of its last call; an
        event still pending after the timeout is a hang on the GPU."""
        import cupy

        m = self.progress.m
        for g, b in list(self.progress.rows.items()):
            t = getattr(g, "transport", None)
            st = getattr(t, "last_stream", None)
            if st is None:  # no GPU collective on this group yet (or an MPI group)
                continue
            d = m[b + 1]
            ev = events.get(b)
            try:
                finished = ev is not None and ev[1].done
            except Exception:   # an event a capture took (recorded as its stream began one)
                events.pop(b, None)
                continue
            if ev is None or (ev[0] != d and finished):
                e = cupy.cuda.Event(block=False, disable_timing=True)
                ptr = st if isinstance(st, int) else getattr(st, "ptr", None)
                if ptr is None:
                    ptr = st.cuda_stream
                if stream_capturing(ptr):   # (its calls run on replay, unseen by the watchdog)
                    continue
                try:
                    cupy.cuda.runtime.eventRecord(e.ptr, ptr)
                except Exception:
                    continue
                events[b] = (d, e, now, t.last_what, g)
                continue
            d0, e, t0, what, g0 = ev
            if not finished and now - t0 >= TIMING.wait_check and self._disagreement(g0, b, d0 >> 4, now - t0):
                return
            if not finished and not self._replays and (now - t0 >= self.timeout   # (a replay: its own report)
                               or (now - t0 >= TIMING.exit_check and self._peer_exited(g0, d0 >> 4))):
                desc = f"shape {tuple(what[1])}, dtype {str(what[2]).replace('torch.', '')}" if what else "?"
                self.fire(g0, d0 >> 4, NAMES.get(d0 & 15, "?"), desc, now - t0, gpu=True,
                          early=now - t0 < self.timeout)
                return

    def fire(self, g, seq, name, desc, waited, gpu=False, early=False):
        """Print the diagnosis and abort the job. ``early``: before the timeout, because a
        rank the call waits for has left its script."""
        with self._lock:
            if self.fired:
                return
            self.fired = True
        msg = self.diagnose(g, seq, name, desc, waited, gpu=gpu, early=early)
        self._report(msg, early, g.ranks)

    def _report(self, msg, early, ranks, kind=None):
        """Print the report (asking the lagging ranks for their stacks), write the flight
        record, abort the job: with the exit status of a rank that left, else 1."""
        lag = self.lagging
        if lag:
            self.progress.request_dump(lag)
            msg += "\n  " + "; ".join(f"rank {r} was asked to print its Python stack (and to write {stack_path(r)}; a stopped process cannot)"
                                      for r in lag)
        code = self._exit_code(ranks) if early else 1
        kind = kind or ("CommunicationError" if early else "CollectiveTimeoutError")
        sys.stderr.write(f"{rank_prefix()}{kind}: {msg}\n"
                         f"{rank_prefix()}aborting the job" + (f" with exit status {code}" if code != 1 else "")
                         + "\n")
        sys.stderr.flush()   # the report is out before the record is written
        reason = "early exit" if early else ("mismatch" if kind == "CollectiveMismatchError" else "timeout")
        sys.stderr.write(self._flight_line(reason, f"{kind}: {msg}"))
        sys.stderr.flush()
        abort_job([g.transport for g in self.groups() if getattr(g, "transport", None) is not None],
                  grace=TIMING.grace, code=code)

    # ------------------------------------------------------ mpicomm.replay
    def watch_replay(self, count, cap=None):
        """A CUDA graph being replayed through mpicomm.replay (this rank's replay ``count``;
        ``cap``: its mpicomm._replay.Captured, or None where the graph was not made by
        mpicomm.capture). Returns its slot, whose first item mpicomm._replay sets to a CUDA
        event recorded after the launch: the replay is done when that event is."""
        q = self._replays
        while q and q[0][0] is not None and q[0][0].done:   # (the replays before it on the stream)
            q.popleft()
        slot = [None, count, time.monotonic(), cap, replay_wait(cap.replays, cap.key) if cap is not None else 0]
        q.append(slot)
        return slot

    def _tick_replays(self, now):
        """The oldest replay not done: reported past the timeout. True when it fired."""
        q = self._replays
        try:
            while q and q[0][0] is not None and q[0][0].done:
                q.popleft()
        except Exception:   # (an event of a context that is gone)
            q.clear()
        m = self.progress.m
        w = q[0][4] if q else 0
        if m[REPLAY_WAIT] != w:   # the replay waited in, for the peers (this thread owns the word)
            m[REPLAY_WAIT] = w
        if not q or now - q[0][2] < self.timeout:
            return False
        with self._lock:
            if self.fired:
                return True
            self.fired = True
        _, count, t0, cap, _ = q[0]
        colls = cap.describe() if cap is not None else None
        me, n = self.world.ranks[self.world.rank], self.world.size
        states = self.progress.read_peers(list(range(n)))
        counts = {r: (int(st[REPLAYS]) if st is not None else None) for r, st in states.items()}
        fewer = [r for r, c in counts.items() if c is not None and c < count
                 and (cap is None or not cap.members or r in cap.members)]   # (the graph's groups only)
        seen = ", ".join(f"rank {r}: {'unknown' if c is None else c}" for r, c in counts.items())
        why = (f"rank{'s' if len(fewer) > 1 else ''} {', '.join(map(str, fewer))} replayed fewer graphs: "
               "a collective captured in this one waits for {}".format("them" if len(fewer) > 1 else "it")
               if fewer else "every rank replayed as many graphs: their captured collectives differ, or a "
               "rank waits in other GPU work")
        held = (f"; the graph holds {colls}" if colls is not None else
                "; the graph was not made by mpicomm.capture, so its collectives are not known")
        msg = (f"rank {me}: the CUDA graph of this rank's replay {count} (mpicomm.replay) did not complete "
               f"within {now - t0:.0f} s{held}; {why} (graphs replayed so far: {seen}). Replay the same graphs "
               f"in the same order on every rank (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now "
               f"{self.timeout:g} s)")
        self.lagging = [r for r in fewer if r != me]
        self._report(msg, False, [r for r in range(n) if r != me])
        return True

    def _tick_behind(self, now, asked=False):
        """This rank has replayed graphs and has none pending: when peers wait in a replay of
        a graph that this rank captured too (the key they publish in REPLAY_WAIT is one of its
        own graphs) and has replayed fewer times, for about the timeout (the peers publish
        their wait within a tick and this rank reads it every wait_check, so from the first
        sight it gives them the timeout less wait_check), or at once when ``asked`` (a peer's
        report asked for this rank's stack), report it, naming that graph's collectives: the
        ranks that wait report it too. A peer waiting in a graph this rank did not capture
        (another group's) is not this rank's to report. True when it fired."""
        if not self.graphs or (not asked and now < self._behind_next):
            return False
        self._behind_next = now + TIMING.wait_check
        me, n = self.world.ranks[self.world.rank], self.world.size
        states = self.progress.read_peers([r for r in range(n) if r != me])
        waits = {}
        for r, st in states.items():
            if st is None or not st[REPLAY_WAIT]:
                continue
            number, key = replay_wait_fields(st[REPLAY_WAIT])
            cap = self.graphs.get(key)
            if cap is not None and cap.replays < number:
                waits[r] = (number, cap)
        if not waits:
            self._behind = None
            return False
        seen = tuple(sorted((r, w[0], w[1].key) for r, w in waits.items()))
        if self._behind is None or self._behind[0] != seen:
            self._behind = (seen, now)
            if not asked:
                return False
        waited = now - self._behind[1]
        if not asked and waited < self.timeout - TIMING.wait_check:
            return False
        with self._lock:
            if self.fired:
                return True
            self.fired = True
        ahead = sorted(waits)
        number, cap = waits[ahead[0]]
        msg = (f"rank {me}: rank{'s' if len(ahead) > 1 else ''} {', '.join(map(str, ahead))} "
               f"{'wait' if len(ahead) > 1 else 'waits'} in replay {number} (mpicomm.replay) of a CUDA graph that "
               f"holds {cap.describe()}, which this rank has replayed {cap.replays} time(s) and is not replaying"
               f"{' (a peer reported it)' if asked else ''}. Replay the same graphs in the same order on every rank "
               f"(timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s)")
        self._report(msg, False, [r for r in range(n) if r != me])
        return True

    def fire_p2p(self, word, waited, early=False):
        """Report a blocking send/recv that did not complete (or whose peer left) and abort."""
        with self._lock:
            if self.fired:
                return
            self.fired = True
        m = self.progress.m
        code, peer = p2p_fields(word)
        gh, tag = int(m[P2P_GH]), int(m[P2P_TAG])
        g = next((g for g in self.groups() if ghash(g.name) == gh), self.world)
        d = getattr(g, "disp", None)
        wh = getattr(d, "p2p_what", None)
        desc = describe_array(wh[0], wh[1]) if wh else "?"
        ev = getattr(d, "p2p_ev", None)
        msg = self.diagnose_p2p(g, code, peer, tag, desc, waited, early=early,
                                gpu=ev is not None and ev[0] == word)
        self._report(msg, early, [peer])

    def work_departed(self, what, waited):
        """Work.wait's periodic check: when a rank its call waits for has left its script,
        report it as for a blocking call (naming the rank and its exit status) and end the
        job with that status; else return. ``what``: the Work's description
        (mpicomm._backends.base.WorkDescription)."""
        if (what.seq is None and not what.p2p) or self.fired:
            return
        desc = describe_array(what.shape, what.dtype)
        if what.p2p:   # a send or recv
            peer = what.peer
            if peer < 0 or not self._exited([peer]):
                return
            with self._lock:
                if self.fired:
                    return
                self.fired = True
            msg = self.diagnose_p2p(what.group, what.code, peer, what.tag, desc, waited, early=True)
            self._report(msg, True, [peer])
        else:
            g, seq = what.group, what.seq
            if not self._peer_exited(g, seq):
                return
            with self._lock:
                if self.fired:
                    return
                self.fired = True
            msg = self.diagnose(g, seq, what.name, desc, waited, early=True)
            self._report(msg, True, g.ranks)

    def work_timeout(self, what, timeout):
        """The error Work.wait raises when an async collective has not completed in time.
        ``what``: the Work's description (mpicomm._backends.base.WorkDescription)."""
        shape = what.shape
        desc = f"shape {tuple(shape) if shape is not None else ()}, dtype {what.dtype}"
        if what.p2p:   # a send or recv
            with self._lock:
                msg = self.diagnose_p2p(what.group, what.code, what.peer, what.tag, desc, timeout, limit=timeout)
        elif what.seq is not None:
            with self._lock:
                msg = self.diagnose(what.group, what.seq, what.name, desc, timeout, limit=timeout)
        else:
            msg = f"{what.name} ({desc}) did not complete within {timeout:g} s"
        sys.stderr.write(f"{rank_prefix()}CollectiveTimeoutError: {msg}\n")
        sys.stderr.flush()
        sys.stderr.write(self._flight_line("Work.wait timeout"))
        sys.stderr.flush()
        return CollectiveTimeoutError(msg)

    def _flight_line(self, reason, report=None):
        """Write the flight record (with the report's text); the report's line that says where
        ('' with the recorder off)."""
        f = self.flight
        if f is None or not f.size:
            return ""
        return f.report_line(reason, rank_prefix(), report)

