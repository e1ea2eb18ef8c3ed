"""The watchdog's reports: where every other rank of a group is when a call does not complete.

:class:`Diagnosis` is a part of mpicomm._reliability.watchdog.Watchdog: it reads the
peers' progress rows (``self.progress``) and writes ``self.lagging`` (the ranks asked for
their Python stacks). ``diagnose`` reports a collective, ``diagnose_p2p`` a send or recv.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

from .._ops import NAMES, RECV
from .._timing import TIMING
from .progress import (DONE, ENTERED, EXITED, GHASH, HDR, P2P, P2P_GH, P2P_TAG, RAISED, ROWS, TDONE,
                       XSTATUS, F, FINALIZED, MEMBERS, ghash, members_hash, p2p_fields)


class Diagnosis:
    """The report texts of the watchdog (see the module docstring)."""

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
            line = f"state unknown (no answer within {TIMING.read_wait:g} s: the process may have died)"
            part = f"rank {peer} did not answer"
        elif st[EXITED]:
            line = f"{_left(st, 'its')} without a matching {other}"
            part = f"rank {peer} {_left(st, 'the')} without the matching {other}"
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

    def diagnose(self, g, seq, name, desc, waited, gpu=False, limit=None, early=False):
        """The timeout message: what is pending here, and where every other rank of ``g`` is."""
        limit = self.timeout if limit is None else limit
        p = self.progress
        states = p.read_peers(list(g.ranks))
        if self.flight is not None:   # the record written with this report says where the peers were
            self.flight.peers = states
        k = _Call(g, seq, name, next((c for c, nm in NAMES.items() if nm == name), 0), ghash(g.name),
                  members_hash(g.ranks), int(time.time() * 1000))
        c = _Census()
        for gr, wr in enumerate(g.ranks):
            if wr != p.wrank:
                self._place(c, k, gr, wr, states.get(wr))
        what = f"{name} sequence {seq} on group {g.name!r} ({desc})"
        if early:
            head = f"rank {p.wrank}: {what} cannot complete (waited {waited:.1f} s). "
        else:
            head = (f"rank {p.wrank}: {what} did not complete within {limit:g} s "
                    f"(waited {waited:.1f} s)" + (" on the GPU" if gpu else "") + ". ")
        text, rest = _summary(c, g, seq)
        self.lagging = rest + c.other
        if text:
            head += text[0].upper() + text[1:] + ":\n"
        else:
            head += ("Every rank of the group has reached this call: it is stuck in the transport "
                     "(network, a GPU kernel, or ranks that disagree on the arguments: try MPICOMM_DEBUG=1).\n")
        tail = (f"  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s; "
                f"sequence numbers count the collectives on a group from 1)")
        return head + "\n".join(c.lines) + ("\n" if c.lines else "") + tail

    def _place(self, c, k, gr, wr, st):
        """Add world rank ``wr`` (rank ``gr`` of the group; ``st``: its window, None where it did
        not answer) to census ``c`` of call ``k``: its line, and what keeps it from the call."""
        g, seq, name = k.g, k.seq, k.name
        where = f"rank {wr}" if g is self.world else f"rank {wr} (rank {gr} of the group)"
        if st is None:
            c.missing.append(wr)
            c.lines.append(f"  {where}: state unknown (no answer within {TIMING.read_wait:g} s: "
                           "the process may have died)")
            return
        rows = st[HDR:].reshape(ROWS, F)[:ROWS - 1]
        mine = [r for r in rows if r[GHASH] == k.gh and r[ENTERED]]
        word = int(mine[0][ENTERED]) if mine else 0
        entered = word >> 4
        if st[EXITED] and entered < seq:
            c.exited.append(wr)
            c.missing.append(wr)
            last = (f"its last call was {NAMES.get(word & 15, '?')} sequence {entered}" if mine
                    else f"it made no call on group {g.name!r}")
            c.lines.append(f"  {where}: {_left(st, 'its')} without reaching this call; {last}")
            c.how.append(_how(st))
            return
        if mine and int(mine[0][RAISED]) >> 4 == seq:   # its call of this sequence raised
            c.raised.append(wr)
            c.missing.append(wr)
            c.lines.append(f"  {where}: raised an error in its {NAMES.get(int(mine[0][RAISED]) & 15, '?')} "
                           f"sequence {seq} on group {g.name!r} and did not take part (a check of its "
                           "arguments failed there); now "
                           + (f"in {NAMES.get(word & 15, '?')} sequence {entered}"
                              if mine[0][ENTERED] != mine[0][DONE] else f"past it, at sequence {entered}"))
            return
        if mine and int(mine[0][MEMBERS]) != k.mh:   # the same name, other members
            c.apart.append(wr)
            c.missing.append(wr)
            c.lines.append(f"  {where}: in {NAMES.get(word & 15, '?')} sequence {entered} on group "
                           f"{g.name!r} made of other ranks than this rank's {list(g.ranks)}")
            return
        if entered == seq and word & 15 != k.code:   # the same sequence, another collective
            c.other.append(wr)
            c.lines.append(f"  {where}: in {NAMES.get(word & 15, '?')} sequence {seq} on group {g.name!r}, "
                           f"not {name}")
            return
        if entered >= seq:
            return
        c.missing.append(wr)
        now, apart = _inside(rows, self.progress.names, name == "create_group", k.gh)
        if apart:
            c.apart.append(wr)
        c.lines.append(f"  {where}: {_last(mine, entered, g.name, k.nowms)}; {now}")


class _Call(NamedTuple):
    """The call a timeout report is about, and what its rows in the peers' windows hold."""

    g: Any          # the group
    seq: int        # its sequence number on the group
    name: str       # the collective's name
    code: int       # its code (mpicomm._ops), 0 where the name is none of theirs
    gh: int         # the group's name hash (GHASH)
    mh: int         # the hash of its members (MEMBERS)
    nowms: int      # the wall clock of the report, in ms (how long ago a peer finished)


class _Census:
    """Where the other ranks of a group are, against this rank's call: one line per rank, and
    the ranks by what keeps them from the call."""

    __slots__ = ("lines", "missing", "other", "raised", "exited", "how", "apart")

    def __init__(self):
        self.lines, self.missing, self.other, self.raised = [], [], [], []
        self.exited, self.how, self.apart = [], [], []


def _ranks(rs, one, many, of=""):
    return (f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}{of} "
            f"{many if len(rs) > 1 else one}")


def _summary(c, g, seq):
    """(the report's sentence naming the ranks by what keeps them from the call, '' where
    every rank is in it; the ranks that have simply not reached it)."""
    rest = [r for r in c.missing if r not in c.raised and r not in c.exited and r not in c.apart]
    parts = []
    if c.apart:
        parts.append(_ranks(c.apart, "is", "are") + " creating this group with another name or other "
                     "rank_ids: every member must pass create_group the same name and rank_ids")
    if c.exited:
        left = ("called mpicomm.finalize()" if all(h == _FINALIZED for h in c.how)
                else f"left the script ({', '.join(c.how)})")
        parts.append(_ranks(c.exited, "has", "have") + f" {left} without reaching this call")
    if c.other:
        parts.append(_ranks(c.other, "is", "are") + f" in another collective at sequence {seq}: the ranks "
                     "called different collectives")
    if c.raised:
        parts.append(_ranks(c.raised, "has", "have") + " raised an error in this call and did not take part")
    if rest:
        parts.append(_ranks(rest, "has", "have", f" of {len(g.ranks)}") + " not reached this call")
    return "; ".join(parts), rest


def _last(mine, entered, gname, nowms):
    """A rank's last call on the group (``mine``: its row of the group, if any)."""
    if not mine:
        return f"no collective on group {gname!r} yet"
    r = mine[0]
    last = (f"last call {NAMES.get(int(r[ENTERED]) & 15, '?')} sequence {entered} "
            f"on group {gname!r}")
    if r[DONE] == r[ENTERED] and r[TDONE]:
        last += f", finished {max(0, nowms - int(r[TDONE])) / 1000:.1f} s ago"
    return last


def _inside(rows, names, creating, gh):
    """(where a rank is now, from its group rows; True where, while this rank creates a group,
    it is creating one of another name)."""
    inside = [r for r in rows if r[ENTERED] != r[DONE] and r[GHASH]]
    if not inside:
        return "not in a collective", False
    r = inside[0]
    gname = names.get(int(r[GHASH]), f"#{int(r[GHASH])}")
    cname = NAMES.get(int(r[ENTERED]) & 15, '?')
    now = f"inside {cname} sequence {int(r[ENTERED]) >> 4} on group {gname!r}"
    if creating and cname == "create_group" and int(r[GHASH]) != gh:
        return now + " (a group of another name)", True
    return now, False


def describe_array(shape, dtype):
    return f"shape {tuple(shape) if shape is not None else ()}, dtype {str(dtype).replace('torch.', '')}"


_FINALIZED = "it called mpicomm.finalize()"


def _left(st, its):
    """How a rank that left is described: 'has called mpicomm.finalize()', else 'has left
    its (the) script (how)'."""
    if int(st[XSTATUS]) == FINALIZED:
        return "has called mpicomm.finalize()"
    return f"has left {its} script ({_how(st)})"


def _how(st):
    """How a rank left, from its window: its exit status where known."""
    x = int(st[XSTATUS])
    if x == FINALIZED:
        return _FINALIZED
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
