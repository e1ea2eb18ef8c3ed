"""The watchdog's findings that a waiting call can never complete, short of the timeout: a
member left its script, a member waits for this rank in another group's call, or the members
decided differently on a fresh communicator (mixed into the Watchdog)."""
from __future__ import annotations

import time

from .._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, CREATE_GROUP, DESTROY_GROUP, NAMES,
                    REDUCE_SCATTER)
from .._timing import TIMING
from . import agreement as agr
from .progress import DONE, ENTERED, EXITED, GHASH, HDR, MEMBERS, P2P, P2P_TAG, ROWS, F, ghash, p2p_fields

# calls that complete on no rank before every member has entered them
_ALL_NEEDED = frozenset((ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BARRIER, CREATE_GROUP, DESTROY_GROUP))


class Standstills:
    """Needs the Watchdog's ``progress``, ``_refused_seen``, ``_peers_read`` and ``_fire_mismatch``."""

    def _fresh_apart(self, g, disp, key, seq, waited):
        """This rank makes the group's fresh communicator at the start of call ``seq`` while a
        member has entered that call on the old one (it did not decide on a fresh start):
        neither can go on. Ends the job after ``TIMING.refusal_wait`` s of it; True when it fired."""
        apart = []
        for j, wr in enumerate(g.ranks):
            row = agr.read_row(self.progress, wr, disp.slots[j]) if j != g.rank else None
            if row is not None and agr.ring_word(row, seq)[1] == "entered":
                apart.append(wr)
        if not apart:
            self._refused_seen.pop(key, None)
            return False
        first = self._refused_seen.setdefault(key, time.monotonic())
        if time.monotonic() - first < TIMING.refusal_wait:
            return False
        why = self.progress.latest_reason_of(self.progress.wrank, g.name, before=seq)\
            or "an earlier disagreement"
        return self._fire_mismatch(g, seq, f"after {why}: this rank makes the group's fresh communicator at "
                                   f"the start of call {seq}, which rank(s) {', '.join(map(str, apart))} entered on "
                                   "the old one (before the report reached them, or the members decided "
                                   "differently on a fresh start)", waited)

    def _crossed(self, g, b, e, s, now, states):
        """Call ``e`` (ENTERED word) of ``g`` waits for a member that is blocked in a call of
        another group this rank is in, that this rank has not reached, and that needs every
        member (all_reduce, all_gather, reduce_scatter, all_to_all, barrier, creating or
        destroying a group): neither can go on (the ranks called in another order, or passed
        create_group other rank lists). Ends the job naming both calls once that has held
        for ``TIMING.refusal_wait`` s; True when it fired."""
        p = self.progress
        if not self._peers_read or self._peers_read[0] != (b, e):
            self._peers_read = ((b, e), None, None)
        mine_gh = ghash(g.name)
        own = {int(p.m[bb - ENTERED + GHASH]): (gg, bb) for gg, bb in p.rows.items()}
        found = None
        for wr, st in states.items():
            if st is None or st[EXITED]:
                continue
            rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
            there = [r for r in rows if r[GHASH] == mine_gh and r[ENTERED]]
            if there and int(there[0][ENTERED]) >> 4 >= e >> 4:
                continue   # at this call, or past it
            pw = int(st[P2P])
            if pw and self.device_id is None and (e & 15) in _ALL_NEEDED and p2p_fields(pw)[1] == p.wrank:
                found = (wr, None, pw)   # blocked in a send or recv with this rank (MPI: held while it waits)
                break
            for r in rows:
                gh, pe = int(r[GHASH]), int(r[ENTERED])
                if not gh or gh == mine_gh or pe == int(r[DONE]) or (pe & 15) not in _ALL_NEEDED:
                    continue
                h = own.get(gh)
                if h is None:
                    continue
                oe, od = int(p.m[h[1]]), int(p.m[h[1] + 1])
                if oe >> 4 < pe >> 4 and oe == od:   # not reached here, and nothing of it pending
                    found = (wr, h[0], pe)
                    break
            if found:
                break
        if found is None:
            self._peers_read = ((b, e), None, None)
            return False
        key = (found[0], found[2])
        if self._peers_read[1] != key:
            self._peers_read = ((b, e), key, now)
            return False
        if now - self._peers_read[2] < TIMING.refusal_wait:
            return False
        wr, h, pe = found
        if h is None:   # a blocking send or recv of the member's, with this rank
            code, _ = p2p_fields(pe)
            st = states.get(wr)
            tag = f", tag {int(st[P2P_TAG])}" if st is not None else ""
            what = f"{NAMES.get(code, '?')} {'from' if NAMES.get(code) == 'recv' else 'to'} this rank{tag}"
            why = (f"rank {wr} waits in {what}, while this rank waits in {NAMES.get(e & 15, '?')} sequence "
                   f"{e >> 4} on group {g.name!r}, which rank {wr} has not reached: neither can go on (a send or "
                   "recv that its peer makes only after this collective, or a collective called before it)")
            return self._fire_mismatch(g, e >> 4, why, now - s[1])
        why = (f"rank {wr} waits in {NAMES.get(pe & 15, '?')} sequence {pe >> 4} on group {h.name!r}, which this "
               f"rank has not reached, while this rank waits in {NAMES.get(e & 15, '?')} sequence {e >> 4} on group "
               f"{g.name!r} for rank {wr}: neither can go on (the ranks made their calls of these groups in "
               "another order" + (", or passed create_group other names or rank lists" if (e & 15) == CREATE_GROUP
                                   or (pe & 15) == CREATE_GROUP else "") + ")")
        return self._fire_mismatch(g, e >> 4, why, now - s[1])

    def _creating_apart(self, g, e, states):
        """True while this rank creates group ``g`` (its call word ``e``) and a member is
        inside create_group of the same name with other members, or of another name with
        the same members while it has not created ``g``: neither can go on (the members
        passed create_group other rank_ids, or another name). A correct program cannot show
        either: a rank creates one group at a time, a group's members leave its creation
        together, and one that went on to create the next group has created ``g``."""
        if e & 15 != CREATE_GROUP:
            return False
        gh = ghash(g.name)
        mh = int(self.progress.m[self.progress.rows[g] - ENTERED + MEMBERS])
        for st in states.values():
            if st is None or st[EXITED]:
                continue
            rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
            made = any(r[GHASH] == gh and r[DONE] for r in rows)
            for r in rows:
                if int(r[ENTERED]) & 15 != CREATE_GROUP or r[ENTERED] == r[DONE] or not r[GHASH]:
                    continue
                if r[GHASH] == gh and int(r[MEMBERS]) != mh:
                    return True
                if r[GHASH] != gh and int(r[MEMBERS]) == mh and not made:
                    return True
        return False

    def _peer_exited(self, g, seq, states=None):
        """True when a rank of ``g`` has left its script without reaching call ``seq`` of ``g``
        (its window says so): the call can never complete."""
        gh = ghash(g.name)
        if states is None:
            states = self.progress.read_peers([r for r in g.ranks if r != self.progress.wrank])
        for st in states.values():
            if st is None or not st[EXITED]:
                continue
            rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
            mine = [r for r in rows if r[GHASH] == gh and r[ENTERED]]
            if not mine or int(mine[0][ENTERED]) >> 4 < seq:
                return True
        return False
