"""``mpicomm-trace``: merge the ranks' flight records and show who entered each call last.

Every rank of a job that timed out writes ``mpicomm-trace.rank{R}.json`` (its last calls
per group; see docs/RELIABILITY.md), as does :func:`mpicomm.dump_flight_record`. Run

    mpicomm-trace mpicomm-trace.rank*.json          (or: mpicomm-trace DIR)

to print, per group, a table of its last calls (group, sequence number, collective,
shape and dtype) against the ranks: each rank's start relative to the rank that entered
the call first, "-" where a rank has no record of the call, "(pending)" where it had
not completed, and the rank that entered last (the straggler) and by how much.
Every member of a group has a column, those without a file too ("missing (no record)"):
a rank that never reached the call prints no report and writes no file, but the files
written by a timeout report hold where each peer was (its last entered and completed
sequence number per group, read from its progress window), so such a rank is still
named as the one that did not enter the call, with its last call.
``--chrome OUT.json`` also writes a Chrome / Perfetto trace (one row per rank). Needs
no MPI. Exit status 2, naming the file, for a missing or invalid file.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from collections import Counter

from .._reliability.flight import FORMAT, VERSION

DEFAULT_LAST = 20


class TraceError(Exception):
    """A file that cannot be read as a flight record; the message names it."""


# ------------------------------------------------------------------ reading
_INT = (int,)
_REC = (("rank", _INT), ("world_size", _INT), ("clock_origin_ns", _INT), ("dumped_ns", _INT),
        ("groups", (dict,)), ("calls", (list,)))
_CALL = (("group", (str,)), ("seq", _INT), ("collective", (str,)), ("start_ns", _INT), ("done", (bool,)))
_TYPE = {int: "an integer", dict: "an object", list: "a list", str: "a string", bool: "true or false"}


def _check(path, where, obj, fields):
    for k, types in fields:
        v = obj.get(k)
        if not isinstance(v, types) or (types is _INT and isinstance(v, bool)):
            raise TraceError(f"{path}: invalid flight record: {where}{k} is {v!r}, expected {_TYPE[types[0]]}")


def load(path):
    """The flight record in ``path``; raises TraceError naming the file and what is wrong."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        rec = json.loads(text)
    except ValueError as e:
        where = f" at line {e.lineno} column {e.colno}" if hasattr(e, "lineno") else ""
        raise TraceError(f"{path}: not valid JSON ({getattr(e, 'msg', e)}{where}); a flight record is "
                         "the JSON that mpicomm.dump_flight_record() writes") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise TraceError(f"{path}: not an mpicomm flight record (no \"format\": \"{FORMAT}\"); these are "
                         "the mpicomm-trace.rank{R}.json files that mpicomm.dump_flight_record() writes")
    if not isinstance(rec.get("version"), int) or rec["version"] > VERSION:
        raise TraceError(f"{path}: flight record version {rec.get('version')!r}; this mpicomm-trace reads "
                         f"version {VERSION} (use the mpicomm that wrote the file)")
    _check(path, "", rec, _REC)
    for i, c in enumerate(rec["calls"]):
        if not isinstance(c, dict):
            raise TraceError(f"{path}: invalid flight record: calls[{i}] is {c!r}, expected an object")
        _check(path, f"calls[{i}].", c, _CALL)
    for name, g in rec["groups"].items():
        if not isinstance(g, dict) or not isinstance(g.get("ranks"), list) or not isinstance(g.get("last_seq"), int):
            raise TraceError(f"{path}: invalid flight record: groups[{name!r}] is {g!r}, expected an object "
                             "with ranks and last_seq")
        peers = g.get("peers", {})
        for k, v in (peers.items() if isinstance(peers, dict) else [(None, peers)]):
            if not (isinstance(k, str) and k.isdigit()) or not (v is None or _peer_ok(v)):
                raise TraceError(f"{path}: invalid flight record: groups[{name!r}].peers"
                                 + ("" if k is None else f"[{k!r}]") + f" is {v!r}, expected an object of "
                                 "world ranks, each null or an object with integers entered and done")
    rec["_path"] = path
    return rec


def _peer_ok(v):
    return isinstance(v, dict) and all(isinstance(v.get(k), int) and not isinstance(v.get(k), bool)
                                       for k in ("entered", "done"))


def _rank_in_name(path):
    m = re.search(r"rank(\d+)\.json$", path)
    return int(m.group(1)) if m else -1


def expand(args):
    """The files to read: each argument, or the mpicomm-trace.rank*.json files of a directory."""
    files = []
    for a in args:
        if os.path.isdir(a):
            found = sorted(glob.glob(os.path.join(glob.escape(a), "mpicomm-trace.rank*.json")), key=_rank_in_name)
            if not found:
                raise TraceError(f"{a}: no mpicomm-trace.rank*.json files in this directory")
            files += found
        else:
            files.append(a)
    return files


def load_all(paths):
    """{rank: record}; raises TraceError for a bad file or two files of one rank."""
    recs = {}
    for p in paths:
        rec = load(p)
        r = rec["rank"]
        if r in recs:
            raise TraceError(f"{p}: a second record of rank {r} (the first is {recs[r]['_path']}); "
                             "give each rank's file once, all from the same job")
        recs[r] = rec
    return dict(sorted(recs.items()))


# ------------------------------------------------------------------ merging
def describe(c):
    """(collective with op or root, 'shape dtype') of one recorded call."""
    what = c["collective"]
    extra = [str(c["op"])] if c.get("op") is not None else []
    if c.get("root") is not None:
        extra.append(f"root={c['root']}")
    if extra:
        what += f"({', '.join(extra)})"
    shape = c.get("shape")
    sd = "" if shape is None else f"{tuple(shape)} {c.get('dtype')}"
    return what, sd


def ago(ns):
    """A duration in ns as '+12.3us' (the unit that suits it)."""
    if ns == 0:
        return "+0"
    if ns < 1000:
        return f"+{ns}ns"
    if ns < 1_000_000:
        return f"+{ns / 1e3:.1f}us"
    if ns < 1_000_000_000:
        return f"+{ns / 1e6:.2f}ms"
    return f"+{ns / 1e9:.2f}s"


def merge(recs):
    """Per group (world first): its members, its columns (the members and the ranks with a
    file), what the others' records say of each member without a file ("absent") and its
    calls in sequence order, each a dict of what the ranks recorded."""
    groups = {}
    for r, rec in recs.items():
        for name, g in rec["groups"].items():
            e = groups.setdefault(name, {"members": set(), "last": {}, "heard": {}})
            e["members"].update(g["ranks"])
            e["last"][r] = g["last_seq"]
            for k, v in (g.get("peers") or {}).items():
                e["heard"].setdefault(int(k), []).append((r, v))
        for c in rec["calls"]:
            e = groups.setdefault(c["group"], {"members": set(), "last": {}, "heard": {}})
            e.setdefault("calls", {}).setdefault(c["seq"], {})[r] = c
    out = {}
    for name in sorted(groups, key=lambda n: (n != "world", n)):
        e = groups[name]
        e["absent"] = {r: _heard(e["heard"].get(r, [])) for r in sorted(e["members"]) if r not in recs}
        cols = sorted(set(recs) | e["members"])
        calls = [_call_row(name, seq, byrank, e, recs, cols) for seq, byrank in sorted(e.get("calls", {}).items())]
        out[name] = {"members": sorted(e["members"]), "cols": cols, "absent": e["absent"], "calls": calls}
    return out


def _heard(said):
    """What the others' records say of a member without a file, from [(rank whose record says
    it, what it read or None)]: the latest state read (highest entered, then done) with "by"
    the rank that read it; {"entered": None, "by": ...} where no read was answered; None
    where no record read it."""
    got = [(v["entered"], v["done"], -r, r, v) for r, v in said if v is not None]
    if got:
        *_, r, v = max(got)
        return {**v, "by": r}
    if said:
        return {"entered": None, "by": sorted(r for r, _ in said)[0]}
    return None


def _entered(a):
    """The last sequence number a member without a file entered, as the others read it (None: unknown)."""
    return None if a is None else a.get("entered")


def _absent_cell(a, seq):
    ent = _entered(a)
    if ent is None:
        return "missing (no record)"
    if ent < seq:
        return "not entered (no record)"
    if ent == seq and a["done"] < seq:
        return "pending (no record)"
    return "entered (no record)"


def _rlist(rs):
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def _call_row(name, seq, byrank, e, recs, cols):
    descs = {r: describe(c) for r, c in byrank.items()}
    common = Counter(descs.values()).most_common(1)[0][0]
    t0 = min(c["start_ns"] for c in byrank.values())
    absent = e["absent"]
    # a member rank with a file whose last call on the group came before this one never entered
    # it; nor did a member without a file whose last call, as a peer's report read it, came before
    missing = [r for r in cols if r in e["members"]
               and ((r in recs and r not in byrank and e["last"].get(r, 0) < seq)
                    or (r in absent and _entered(absent[r]) is not None and _entered(absent[r]) < seq))]
    unknown = [r for r in absent if _entered(absent[r]) is None]   # no file, and no peer read it
    row = {"group": name, "seq": seq, "what": common, "first": t0, "cells": {}, "missing": missing,
           "unknown": unknown, "odd": {r: d for r, d in descs.items() if d != common}}
    for r in cols:
        c = byrank.get(r)
        if r in absent:
            row["cells"][r] = _absent_cell(absent[r], seq)
            continue
        if c is None:
            row["cells"][r] = "-" if r in e["members"] or not e["members"] else "n/a"
            continue
        cell = ago(c["start_ns"] - t0) + ("" if c["done"] else " (pending)") + ("!" if r in row["odd"] else "")
        row["cells"][r] = cell
    pending = [r for r, c in byrank.items() if not c["done"]]
    if missing:
        row["straggler"] = (missing, None)
        nofile = [r for r in missing if r not in recs]
        tag = ("" if not nofile else "; no record" if len(nofile) == len(missing)
               else f"; no record of {_rlist(nofile)}")
        row["last"] = f"{_rlist(missing)} (not entered{tag})"
    elif unknown and pending:
        # every rank known has entered it and it is pending: the members nobody saw are the ones
        row["straggler"] = (unknown, None)
        row["last"] = f"{_rlist(unknown)} (missing: no record)"
    elif len(byrank) > 1:
        last = max(byrank, key=lambda r: (byrank[r]["start_ns"], r))
        by = byrank[last]["start_ns"] - t0
        if absent:   # when the members without a file entered is not known: not counted
            row["straggler"] = None
            row["last"] = f"rank {last} {ago(by)} ({_rlist(list(absent))}: no record)"
        else:
            row["straggler"] = ([last], by)
            row["last"] = f"rank {last} {ago(by)}"
    else:
        row["straggler"] = None
        row["last"] = ""
    return row


# ------------------------------------------------------------------ printing
def _table(header, rows):
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(n) for c, n in zip(cells, w)).rstrip()
    return "\n".join([line(header), line(["-" * n for n in w])] + [line(r) for r in rows])


def _when(ns):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns // 1_000_000 % 1000:03d} UTC"


def report(recs, last=DEFAULT_LAST):
    """The text mpicomm-trace prints for the records ``recs`` ({rank: record})."""
    ranks = list(recs)
    n = max(rec["world_size"] for rec in recs.values())
    lines = [f"mpicomm-trace: {len(recs)} flight record(s), rank{'s' if len(ranks) > 1 else ''} "
             f"{', '.join(map(str, ranks))} of {n}"]
    absent = [r for r in range(n) if r not in recs]
    if absent:
        lines.append(f"  no file for {_rlist(absent)} (not written, or not given): missing (no record)")
    for r, rec in recs.items():
        off = "" if rec.get("recorder_size", 1) else "; the recorder was off (MPICOMM_FLIGHT_RECORDER=0)"
        lines.append(f"  rank {r}: {rec.get('host', '?')} pid {rec.get('pid', '?')}, written "
                     f"{_when(rec['dumped_ns'])} ({rec.get('reason', '?')}), {rec['_path']}{off}")
    if len({rec.get("host") for rec in recs.values()}) > 1:
        lines.append("  the ranks ran on several hosts: times between hosts include their clocks' difference")
    lines.append("each rank's column: when it entered the call, after the rank that entered it first; "
                 "'-': no record of the call; (pending): not completed")
    if absent:
        lines.append("a rank without a file: 'missing (no record)', or where the others' reports read its "
                     "progress: 'not entered', 'pending' or 'entered (no record)'")
    for name, g in merge(recs).items():
        calls = g["calls"] if not last else g["calls"][-last:]
        lines.append("")
        lines.append(f"group {name!r} (world ranks {', '.join(map(str, g['members']))}): "
                     + (f"last {len(calls)} of {len(g['calls'])} recorded calls" if len(calls) < len(g["calls"])
                        else f"{len(calls)} recorded call{'s' if len(calls) != 1 else ''}"))
        if not calls:
            continue
        header = ["seq", "collective", "shape dtype"] + [f"rank {r}" for r in g["cols"]] + ["last to enter"]
        rows = [[c["seq"], c["what"][0], c["what"][1]] + [c["cells"][r] for r in g["cols"]] + [c["last"]]
                for c in calls]
        lines.append(_table(header, rows))
        for c in calls:
            for r, (what, sd) in sorted(c["odd"].items()):
                lines.append(f"  ! seq {c['seq']}: rank {r} recorded {what} {sd}".rstrip()
                             + f", the others {c['what'][0]} {c['what'][1]}".rstrip()
                             + ": the ranks called different collectives or arguments")
        never = [c for c in calls if c["missing"]]
        if never:
            c = never[0]
            who = c["missing"]
            lines.append(f"  {_rlist(who)} did not enter seq {c['seq']} {c['what'][0]}, nor any later call "
                         "of the group")
        else:
            c = next((c for c in calls if c["straggler"] and c["straggler"][1] is None), None)
            if c is not None:   # pending where every rank seen entered it: the unseen ones did not
                who, on = c["straggler"][0], [r for r in c["cells"] if "(pending)" in c["cells"][r]]
                lines.append(f"  {_rlist(who)} wrote no record, and no other rank's record says where "
                             f"{'they were' if len(who) > 1 else 'it was'}: every other member entered seq "
                             f"{c['seq']} {c['what'][0]}, pending on {_rlist(on)}")
        said = {}
        for r, a in g["absent"].items():
            said.setdefault(_absent_says(a, name), []).append(r)
        for text, rs in said.items():
            lines.append(f"  {_rlist(rs)}: missing (no record); {text}")
        lasts = Counter(c["straggler"][0][0] for c in calls if c["straggler"] and c["straggler"][1] is not None)
        top = lasts.most_common(2)
        if top and top[0][1] > 1 and (len(top) == 1 or top[0][1] > top[1][1]):
            r, k = top[0]
            timed = [c["straggler"][1] for c in calls if c["straggler"] and c["straggler"][0] == [r]
                     and c["straggler"][1] is not None]
            lines.append(f"  last to enter most often: rank {r} ({k} of {len(calls)} calls, "
                         f"by {ago(int(sum(timed) / len(timed)))} on average)")
    return "\n".join(lines)


def _absent_says(a, name):
    """What the others' records say of a member without a file, for the line under its group's table."""
    if a is None:
        return "no other rank's record read its progress"
    if a["entered"] is None:
        return f"rank {a['by']} could not read its progress at its report (no answer: the process may have died)"
    ent, done = a["entered"], a["done"]
    text = f"at rank {a['by']}'s report its last call on group {name!r} was "
    if not ent:
        text = f"at rank {a['by']}'s report it had made no call on group {name!r}"
    else:
        text += (f"seq {ent} {a.get('collective') or '?'}, "
                 + ("completed" if done >= ent else f"not completed (last completed: seq {done})"))
    return text + ("; it had left its script" if a.get("exited") else "")


def chrome(recs):
    """A Chrome / Perfetto trace (JSON trace event format): one process, one thread row per
    rank, an "X" event per call lasting until the rank's next call (the last: until the dump)."""
    t0 = min([c["start_ns"] for rec in recs.values() for c in rec["calls"]] or [0])
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "mpicomm"}}]
    for r, rec in recs.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r,
                   "args": {"name": f"rank {r} ({rec.get('host', '?')})"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": r, "args": {"sort_index": r}})
        calls = sorted(rec["calls"], key=lambda c: c["start_ns"])
        for i, c in enumerate(calls):
            end = calls[i + 1]["start_ns"] if i + 1 < len(calls) else max(rec["dumped_ns"], c["start_ns"])
            args = {k: c.get(k) for k in ("group", "seq", "shape", "dtype", "op", "root", "done")}
            ev.append({"ph": "X", "name": c["collective"], "cat": c["group"], "pid": 0, "tid": r,
                       "ts": (c["start_ns"] - t0) / 1e3, "dur": (end - c["start_ns"]) / 1e3, "args": args})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"source": "mpicomm-trace", "start_ns": t0}}


def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-trace",
        description="Merge the ranks' flight records (mpicomm-trace.rank*.json) and show, per group, "
                    "when each rank entered its last calls and which rank came last.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="the ranks' mpicomm-trace.rank{R}.json files, or a directory holding them")
    p.add_argument("--last", type=int, default=DEFAULT_LAST, metavar="K",
                   help=f"calls shown per group (default {DEFAULT_LAST}; 0: all recorded)")
    p.add_argument("--chrome", metavar="OUT.json",
                   help="also write a Chrome / Perfetto trace (open it in ui.perfetto.dev or chrome://tracing)")
    return p


def main(argv=None):
    """Print the merged table; exit status 2, naming the file, for a missing or invalid file."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse printed usage (or --help); hand back its status
        return exc.code
    if args.last < 0:
        print(f"mpicomm-trace: invalid --last {args.last}: expected a number of calls >= 0 (0: all)",
              file=sys.stderr)
        return 2
    try:
        recs = load_all(expand(args.files))
    except TraceError as e:
        print(f"mpicomm-trace: {e}", file=sys.stderr)
        return 2
    print(report(recs, args.last), flush=True)
    if args.chrome:
        try:
            with open(args.chrome, "w") as f:
                json.dump(chrome(recs), f)
        except OSError as e:
            print(f"mpicomm-trace: {args.chrome}: cannot write the Chrome trace ({e.strerror or e})",
                  file=sys.stderr)
            return 2
        print(f"Chrome / Perfetto trace: {args.chrome} (open it in ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
