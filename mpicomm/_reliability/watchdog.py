"""The watchdog: a thread that notices a collective pending past the timeout and says why.

It sleeps on an Event and wakes every ``min(1 s, timeout / 10)``. When it sees the
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

import sys
import threading
import time

from .._ops import NAMES, RECV
from ..errors import CollectiveTimeoutError
from .abort import abort_job, rank_prefix
from . import agreement as agr
from .progress import (DONE, DUMP, ENTERED, EXITED, GHASH, HDR, P2P, P2P_GH, P2P_TAG, POISON, RAISED, READ_WAIT,
                       ROWS, SPECSEQ, TDONE, XSTATUS, F, MEMBERS, ghash, members_hash, p2p_fields)
from .stacks import Stacks, stack_path

GRACE = 2.0       # seconds between printing a timeout and aborting, so other ranks print theirs
EXIT_CHECK = 2.0  # seconds a call waits before the watchdog looks whether a peer has exited


class Watchdog:
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
        self._dump_seen = 0            # the last DUMP stamp answered
        self._xnext = 0.0              # when the calls are next compared across hosts
        self._xseen = {}               # row -> (first call that differs across hosts, when first seen)
        self._xturn = 0                # where the next round of those comparisons starts
        self._xspec = {}               # row -> this rank's CallSpec of the first call that differs
        self._xread = {}               # row -> (partner, its reads in flight, started)
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
            t.join(timeout=5)
        self._thread = None

    def _loop(self):
        period = min(0.25, self.timeout / 10)
        seen = {}       # row -> (entered word, first seen monotonic)
        done = {}       # row -> last done word seen
        events = {}     # row -> (done word, cuda event, recorded at, what, group)
        if self.device_id is not None:
            try:
                import cupy

                cupy.cuda.runtime.setDevice(self.device_id)
            except Exception:
                pass
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
        for g, b in list(p.rows.items()):  # b: index of the row's ENTERED word
            e, d = m[b], m[b + 1]
            if done.get(b) != d:  # stamp completion time here, not on the hot path
                done[b] = d
                m[b - ENTERED + TDONE] = wall
            self._answer(g, b, e, d)
            if e != d:
                s = seen.get(b)
                if s is None or s[0] != e:
                    seen[b] = (e, now)
                elif now - s[1] >= agr.WAIT_CHECK and self._disagreement(g, b, e >> 4, now - s[1]):
                    return
                elif now - s[1] >= self.timeout or (now - s[1] >= EXIT_CHECK and self._peer_exited(g, e >> 4)):
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
                if waited >= self.timeout or (waited >= EXIT_CHECK and self._exited([peer])):
                    self.fire_p2p(w, waited, early=waited < self.timeout)
                    return
        else:
            self._p2p_seen = None
        if m[DUMP] != self._dump_seen:   # a peer's report asks for this rank's stack
            self._dump_seen = m[DUMP]
            self.stacks.publish(self.stacks.take(), "asked for by a peer's timeout report")
        text = self.stacks.signalled()
        if text:
            self.stacks.publish(text, "SIGUSR1")
            sys.stderr.write(self._flight_line("SIGUSR1"))
            sys.stderr.flush()
        if self.device_id is not None:
            self._tick_gpu(events, now)
        if now >= self._xnext:
            self._xnext = now + agr.XHOST_EVERY
            if self._cross_hosts(now):
                return
        p.poke()

    # ------------------------------------------------------ the agreement check
    def _answer(self, g, b, e, d):
        """Publish this rank's spec where a peer needs it: the call a member's report
        (POISON) is about, else the call waiting now (for the peers' diagnosis)."""
        m = self.progress.m
        base = b - ENTERED
        disp = getattr(g, "disp", None)
        if disp is None:
            return
        pw = m[base + POISON]
        want = None
        if pw:
            k, who = agr.poison_fields(pw)
            if who != self.progress.wrank and k <= e >> 4:
                want = k
        if want is None and e != d:   # the call waiting now, unless this rank refused it (no spec:
            w = m[disp.cb + (e >> 4) % agr.CALLS_N]   # the SPEC words keep the reported call's)
            if not (w >> 32 == e >> 4 and w & 0xFFFFFFFF == agr.REFUSED):
                want = e >> 4
        if want is None or m[base + SPECSEQ] == want or b in self._xseen:   # (keeps the cross-host report's)
            return
        sp = disp.spec_for(want)
        if sp is not None:
            agr.publish_spec(m, b, want, sp)

    def _disagreement(self, g, b, seq, waited):
        """Once per waiting call: compare every member's signature of call ``seq``; where they
        differ (or a member refused it, or a report says the call cannot come) end the job
        with every rank's call named. True when it fired."""
        disp = getattr(g, "disp", None)
        key = (b, seq)
        if disp is None or disp.slots is None or not disp.check:
            return False
        m = self.progress.m
        pw = m[b - ENTERED + POISON]
        if pw:   # a report about an earlier call: the members will not come to this one
            k, who = agr.poison_fields(pw)
            if who != self.progress.wrank and k < seq and waited >= agr.REFUSAL_WAIT:
                why = self.progress.reason_of(who) or f"rank {who} reported a disagreement in call {k}"
                return self._fire_mismatch(g, seq, f"{why}; this rank went on to call {seq}, which the "
                                           "others will not make", waited)
        if key in self._compared and key not in self._refused_seen:
            return False
        self._compared.add(key)
        if len(self._compared) > 4096:
            self._compared.clear()
            self._refused_seen.clear()
        mine = int(m[disp.cb + seq % agr.CALLS_N])
        if mine >> 32 == seq and mine & 0xFFFFFFFF == agr.REFUSED:
            return False   # this rank refused the call: its refusal is in progress
        bad, refused = [], []
        for j, wr in enumerate(g.ranks):
            if j == g.rank:
                continue
            row = agr.read_row(self.progress, wr, disp.slots[j])
            if row is None:
                continue
            w, st = agr.ring_word(row, seq)
            if st == "refused":
                refused.append(wr)
            elif st == "entered" and w != mine:
                bad.append((j, wr, row))
        if refused:   # the refusing rank stands in for this call: fire only if that does not come
            first = self._refused_seen.setdefault(key, time.monotonic())
            if time.monotonic() - first >= agr.REFUSAL_WAIT:
                why = "; ".join(self.progress.reason_of(wr) or f"rank {wr} refused the call" for wr in refused)
                return self._fire_mismatch(g, seq, why, waited)
            return False
        if not bad:
            return False
        from .._callspec import PeerSpec

        me_spec = disp.spec_for(seq)
        time.sleep(2 * 0.25)   # the peers' watchdogs publish their specs
        calls = [f"rank {self.progress.wrank}: {me_spec.describe() if me_spec else NAMES.get(int(m[b]) & 15, '?')}"]
        for j, wr, _ in bad:
            row = agr.read_row(self.progress, wr, disp.slots[j])
            sw = agr.spec_words(row, seq) if row is not None else None
            calls.append(f"rank {wr}: " + (PeerSpec(sw).describe(me_spec) if sw is not None else "another call"))
        why = (f"{NAMES.get(int(m[b]) & 15, '?')} sequence {seq} on group {g.name!r}: the ranks called "
               f"differently: " + "; ".join(calls))
        return self._fire_mismatch(g, seq, why, waited)

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

    def _peer_exited(self, g, seq):
        """True when a rank of ``g`` has left its script without reaching call ``seq`` of ``g``
        (its window says so): the call can never complete."""
        gh = ghash(g.name)
        states = self.progress.read_peers([r for r in g.ranks if r != self.progress.wrank])
        for st in states.values():
            if st is None or not st[EXITED]:
                continue
            rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
            mine = [r for r in rows if r[GHASH] == gh and r[ENTERED]]
            if not mine or int(mine[0][ENTERED]) >> 4 < seq:
                return True
        return False

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
            if ev is None or (ev[0] != d and ev[1].done):
                e = cupy.cuda.Event(block=False, disable_timing=True)
                ptr = st if isinstance(st, int) else getattr(st, "ptr", None)
                if ptr is None:
                    ptr = st.cuda_stream
                try:
                    cupy.cuda.runtime.eventRecord(e.ptr, ptr)
                except Exception:
                    continue
                events[b] = (d, e, now, t.last_what, g)
                continue
            d0, e, t0, what, g0 = ev
            if not e.done and now - t0 >= agr.WAIT_CHECK and self._disagreement(g0, b, d0 >> 4, now - t0):
                return
            if not e.done and (now - t0 >= self.timeout
                               or (now - t0 >= EXIT_CHECK and self._peer_exited(g0, d0 >> 4))):
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
        sys.stderr.write(self._flight_line(reason))
        sys.stderr.flush()
        abort_job([g.transport for g in self.groups() if getattr(g, "transport", None) is not None],
                  grace=GRACE, code=code)

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
        desc = _desc(wh[0], wh[1]) if wh else "?"
        ev = getattr(d, "p2p_ev", None)
        msg = self.diagnose_p2p(g, code, peer, tag, desc, waited, early=early,
                                gpu=ev is not None and ev[0] == word)
        self._report(msg, early, [peer])

    def diagnose_p2p(self, g, code, peer, tag, desc, waited, limit=None, early=False, gpu=False):
        """The report of a send or recv: where its peer (world rank ``peer``) is."""
        limit = self.timeout if limit is None else limit
        p = self.progress
        me = p.wrank
        st = p.read_peers([peer]).get(peer)
        other = "send" if code == RECV else "recv"
        to = f"from rank {peer}" if code == RECV else f"to rank {peer}"
        gr = g.ranks.index(peer) if peer in g.ranks else None
        where = f"rank {peer}" if g is self.world or gr is None else f"rank {peer} (rank {gr} of the group)"
        self.lagging = []
        if st is None:
            line = f"state unknown (no answer within {READ_WAIT:g} s: the process may have died)"
            part = f"rank {peer} did not answer"
        elif st[EXITED]:
            line = f"has left its script ({_how(st)}) without a matching {other}"
            part = f"rank {peer} has left the script ({_how(st)}) without the matching {other}"
        else:
            pw = int(st[P2P])
            if pw:
                pcode, ppeer = p2p_fields(pw)
                ptag, pgh = int(st[P2P_TAG]), int(st[P2P_GH])
                pname = p.names.get(pgh, f"#{pgh}")
                pto = f"from rank {ppeer}" if pcode == RECV else f"to rank {ppeer}"
                if ppeer == me and pcode != code and pgh == ghash(g.name):
                    if ptag != tag:
                        line = f"in {NAMES.get(pcode, '?')} {pto} with tag {ptag}, not {tag}"
                        part = f"rank {peer} is in the matching {other} with another tag: the tags differ"
                    else:
                        line = f"in the matching {other} {pto} (tag {ptag})"
                        part = (f"rank {peer} is in the matching {other}: it is stuck in the transport "
                                "(network, or the two disagree on the size or dtype)")
                else:
                    line = f"in {NAMES.get(pcode, '?')} {pto} (tag {ptag}) on group {pname!r}, not {other} to rank {me}"
                    part = f"rank {peer} is in another send or recv, not the matching {other}"
                    self.lagging = [peer]
            else:
                line = "not in a send or recv; " + _now_at(st, p.names)
                part = f"rank {peer} has not reached the matching {other}"
                self.lagging = [peer]
        what = f"{NAMES.get(code, '?')} {to} (tag {tag}, {desc}) on group {g.name!r}"
        if early:
            head = f"rank {me}: {what} cannot complete (waited {waited:.1f} s). "
        else:
            head = (f"rank {me}: {what} did not complete within {limit:g} s (waited {waited:.1f} s)"
                    + (" on the GPU" if gpu else "") + ". ")
        tail = f"  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s)"
        return head + part[0].upper() + part[1:] + ":\n" + f"  {where}: {line}\n" + tail

    # ------------------------------------------------------------ diagnosis
    def diagnose(self, g, seq, name, desc, waited, gpu=False, limit=None, early=False):
        """The timeout message: what is pending here, and where every other rank of ``g`` is."""
        limit = self.timeout if limit is None else limit
        gh = ghash(g.name)
        code = next((c for c, nm in NAMES.items() if nm == name), 0)
        p = self.progress
        states = p.read_peers(list(g.ranks))
        if self.flight is not None:   # the record written with this report says where the peers were
            self.flight.peers = states
        nowms = int(time.time() * 1000)
        missing, lines, other, raised, exited, how, apart = [], [], [], [], [], [], []
        creating = name == "create_group"
        mh = members_hash(g.ranks)
        for gr, wr in enumerate(g.ranks):
            if wr == p.wrank:
                continue
            st = states.get(wr)
            where = f"rank {wr}" if g is self.world else f"rank {wr} (rank {gr} of the group)"
            if st is None:
                missing.append(wr)
                lines.append(f"  {where}: state unknown (no answer within {READ_WAIT:g} s: "
                             "the process may have died)")
                continue
            rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
            mine = [r for r in rows if r[GHASH] == gh and r[ENTERED]]
            word = int(mine[0][ENTERED]) if mine else 0
            entered = word >> 4
            if st[EXITED] and entered < seq:
                exited.append(wr)
                missing.append(wr)
                last = (f"its last call was {NAMES.get(word & 15, '?')} sequence {entered}" if mine
                        else f"it made no call on group {g.name!r}")
                lines.append(f"  {where}: has left its script ({_how(st)}) without reaching this "
                             f"call; {last}")
                how.append(_how(st))
                continue
            if mine and int(mine[0][RAISED]) >> 4 == seq:   # its call of this sequence raised
                raised.append(wr)
                missing.append(wr)
                lines.append(f"  {where}: raised an error in its {NAMES.get(int(mine[0][RAISED]) & 15, '?')} "
                             f"sequence {seq} on group {g.name!r} and did not take part (a check of its "
                             "arguments failed there); now "
                             + (f"in {NAMES.get(word & 15, '?')} sequence {entered}"
                                if mine[0][ENTERED] != mine[0][DONE] else f"past it, at sequence {entered}"))
                continue
            if mine and int(mine[0][MEMBERS]) != mh:   # the same name, other members
                apart.append(wr)
                missing.append(wr)
                lines.append(f"  {where}: in {NAMES.get(word & 15, '?')} sequence {entered} on group "
                             f"{g.name!r} made of other ranks than this rank's {list(g.ranks)}")
                continue
            if entered == seq and word & 15 != code:   # the same sequence, another collective
                other.append(wr)
                lines.append(f"  {where}: in {NAMES.get(word & 15, '?')} sequence {seq} on group {g.name!r}, "
                             f"not {name}")
                continue
            if entered >= seq:
                continue
            missing.append(wr)
            if mine:
                r = mine[0]
                last = (f"last call {NAMES.get(int(r[ENTERED]) & 15, '?')} sequence {entered} "
                        f"on group {g.name!r}")
                if r[DONE] == r[ENTERED] and r[TDONE]:
                    last += f", finished {max(0, nowms - int(r[TDONE])) / 1000:.1f} s ago"
            else:
                last = f"no collective on group {g.name!r} yet"
            inside = [r for r in rows if r[ENTERED] != r[DONE] and r[GHASH]]
            if inside:
                r = inside[0]
                gname = p.names.get(int(r[GHASH]), f"#{int(r[GHASH])}")
                cname = NAMES.get(int(r[ENTERED]) & 15, '?')
                now = f"inside {cname} sequence {int(r[ENTERED]) >> 4} on group {gname!r}"
                if creating and cname == "create_group" and int(r[GHASH]) != gh:
                    apart.append(wr)
                    now += " (a group of another name)"
            else:
                now = "not in a collective"
            lines.append(f"  {where}: {last}; {now}")
        what = f"{name} sequence {seq} on group {g.name!r} ({desc})"
        if early:
            head = f"rank {p.wrank}: {what} cannot complete (waited {waited:.1f} s). "
        else:
            head = (f"rank {p.wrank}: {what} did not complete within {limit:g} s "
                    f"(waited {waited:.1f} s)" + (" on the GPU" if gpu else "") + ". ")
        def ranks(rs, one, many, of=""):
            return (f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}{of} "
                    f"{many if len(rs) > 1 else one}")

        rest = [r for r in missing if r not in raised and r not in exited and r not in apart]
        parts = []
        self.lagging = rest + other
        if apart:
            parts.append(ranks(apart, "is", "are") + " creating this group with another name or other "
                         "rank_ids: every member must pass create_group the same name and rank_ids")
        if exited:
            parts.append(ranks(exited, "has", "have") + f" left the script ({', '.join(how)}) without "
                         "reaching this call")
        if other:
            parts.append(ranks(other, "is", "are") + f" in another collective at sequence {seq}: the ranks "
                         "called different collectives")
        if raised:
            parts.append(ranks(raised, "has", "have") + " raised an error in this call and did not take part")
        if rest:
            parts.append(ranks(rest, "has", "have", f" of {len(g.ranks)}") + " not reached this call")
        if parts:
            text = "; ".join(parts)
            head += text[0].upper() + text[1:] + ":\n"
        else:
            head += ("Every rank of the group has reached this call: it is stuck in the transport "
                     "(network, a GPU kernel, or ranks that disagree on the arguments: try MPICOMM_DEBUG=1).\n")
        tail = (f"  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s; "
                f"sequence numbers count the collectives on a group from 1)")
        return head + "\n".join(lines) + ("\n" if lines else "") + tail

    def work_departed(self, what, waited):
        """Work.wait's periodic check: when a rank its call waits for has left its script,
        report it as for a blocking call (naming the rank and its exit status) and end the
        job with that status; else return."""
        if len(what) < 5 or self.fired:
            return
        name, shape, dtype = what[:3]
        desc = _desc(shape, dtype)
        if isinstance(what[4], tuple):   # a send or recv: ("p2p", code, world peer, tag)
            _, code, peer, tag = what[4]
            if peer < 0 or not self._exited([peer]):
                return
            with self._lock:
                if self.fired:
                    return
                self.fired = True
            msg = self.diagnose_p2p(what[3], code, peer, tag, desc, waited, early=True)
            self._report(msg, True, [peer])
        else:
            g, seq = what[3], what[4]
            if not self._peer_exited(g, seq):
                return
            with self._lock:
                if self.fired:
                    return
                self.fired = True
            msg = self.diagnose(g, seq, name, desc, waited, early=True)
            self._report(msg, True, g.ranks)

    def work_timeout(self, what, timeout):
        """The error Work.wait raises when an async collective has not completed in time."""
        name, shape, dtype = what[:3]
        desc = f"shape {tuple(shape) if shape is not None else ()}, dtype {dtype}"
        if len(what) >= 5 and isinstance(what[4], tuple):   # a send or recv: ("p2p", code, peer, tag)
            _, code, peer, tag = what[4]
            with self._lock:
                msg = self.diagnose_p2p(what[3], code, peer, tag, desc, timeout, limit=timeout)
        elif len(what) >= 5:
            g, seq = what[3], what[4]
            with self._lock:
                msg = self.diagnose(g, seq, name, desc, timeout, limit=timeout)
        else:
            msg = f"{name} ({desc}) did not complete within {timeout:g} s"
        sys.stderr.write(f"{rank_prefix()}CollectiveTimeoutError: {msg}\n")
        sys.stderr.flush()
        sys.stderr.write(self._flight_line("Work.wait timeout"))
        sys.stderr.flush()
        return CollectiveTimeoutError(msg)

    def _flight_line(self, reason):
        """Write the flight record; the report's line that says where ('' with the recorder off)."""
        f = self.flight
        if f is None or not f.size:
            return ""
        return f.report_line(reason, rank_prefix())


def _desc(shape, dtype):
    return f"shape {tuple(shape) if shape is not None else ()}, dtype {str(dtype).replace('torch.', '')}"


def _how(st):
    """How a rank left, from its window: its exit status where known."""
    x = int(st[XSTATUS])
    if x:
        return f"exit status {x - 1}"
    return "it returned, or exited without sys.exit: status unknown"


def _now_at(st, names):
    """Where a rank is in its collectives, from its window: its group rows."""
    rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
    inside = [r for r in rows if r[ENTERED] != r[DONE] and r[GHASH]]
    if inside:
        r = inside[0]
        gname = names.get(int(r[GHASH]), f"#{int(r[GHASH])}")
        return f"inside {NAMES.get(int(r[ENTERED]) & 15, '?')} sequence {int(r[ENTERED]) >> 4} on group {gname!r}"
    done = [r for r in rows if r[GHASH] and r[ENTERED]]
    if done:
        r = max(done, key=lambda r: int(r[TDONE]))
        gname = names.get(int(r[GHASH]), f"#{int(r[GHASH])}")
        return (f"not in a collective (last: {NAMES.get(int(r[ENTERED]) & 15, '?')} sequence "
                f"{int(r[ENTERED]) >> 4} on group {gname!r})")
    return "not in a collective"


class InitGuard:
    """Watches init() itself, before the progress window exists: if a stage does not end
    within the timeout (each stage has the whole timeout), prints which stage and aborts
    the job. Every rank must reach each stage; which rank did not cannot be read yet
    (nothing is published before the window), so the report says what the stage waits for."""

    STAGES = {
        "join": "joining the other ranks (MPI_Comm_dup of the world): every rank must call init()",
        "agree": "agreeing on the backend with the other ranks",
        "backend": "starting the backend on this rank (under NCCL: importing CuPy, creating the CUDA "
                   "context of the selected GPU)",
        "transport": "creating the world's transport (under NCCL: ncclCommInitRank, NCCL's own "
                     "bootstrap over the network; every rank has passed the backend agreement just before)",
        "window": "creating the progress window (MPI_Win_allocate on every rank)",
        "free": "freeing the communicators (under NCCL, ncclCommDestroy waits for the work still queued "
                "on them, which a stuck peer never completes)",
    }

    def __init__(self, timeout, rank, call="init()", first="join"):
        self.timeout = timeout
        self.rank = rank
        self.call = call
        self._t = None
        self.set(first)

    def set(self, stage):
        """Enter ``stage``: its own timeout starts now."""
        self.done()
        self.stage = stage
        if self.timeout > 0:
            self._t = threading.Timer(self.timeout, self._fire)
            self._t.daemon = True
            self._t.name = "mpicomm-init-guard"
            self._t.start()

    def _fire(self):
        why = ("A rank that never calls init() cannot be named here (progress is published from the end "
               "of init on)." if self.call == "init()" else "")
        sys.stderr.write(f"{rank_prefix()}CollectiveTimeoutError: rank {self.rank}: {self.call} did not complete "
                         f"within {self.timeout:g} s; stage: {self.STAGES.get(self.stage, self.stage)}. {why}\n"
                         f"{rank_prefix()}  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s)\n"
                         f"{rank_prefix()}aborting the job\n")
        sys.stderr.flush()
        abort_job(grace=GRACE)

    def done(self):
        t, self._t = self._t, None
        if t is not None:
            t.cancel()
