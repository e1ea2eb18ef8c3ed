"""The flight recorder: every rank's last N collectives per group, written to a file on demand.

Each group's dispatcher owns a ring list (a power of two long, at least N) and stores
one tuple per call into it, ``(seq, code, prepared call, perf_counter_ns)``, after the
call is prepared and before it runs: the only cost on the hot path. Whether a call has
completed is read from the group's progress row when the record is written (every
sequence number up to the row's DONE word is done). The prepared call knows shape,
dtype and op or root.

:func:`dump_flight_record` writes this rank's record as JSON; the watchdog writes it
before it aborts the job, and ``mpicomm-trace`` (mpicomm.tools.trace) merges the ranks'
files. MPICOMM_FLIGHT_RECORDER sets N (default 64; 0 turns the recorder off).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

from .._ops import ALL_REDUCE, BROADCAST, NAMES, REDUCE, REDUCE_SCATTER
from .._timing import TIMING
from ..errors import invalid

ENV = "MPICOMM_FLIGHT_RECORDER"
DIR_ENV = "MPICOMM_TRACE_DIR"
DEFAULT = 64
FORMAT = "mpicomm-flight-record"
VERSION = 1
ALLOWED = f"an integer >= 0: the calls kept per group (default {DEFAULT}; 0 turns the flight recorder off)"

def size_from_env(rank=None):
    """N from MPICOMM_FLIGHT_RECORDER (default 64). Raises InvalidArgumentError naming the
    variable, its value and ``rank`` when it is not an integer >= 0."""
    v = os.environ.get(ENV, "").strip()
    if v == "":
        return DEFAULT
    try:
        n = int(v, 10)
    except ValueError:
        n = -1
    if n < 0:
        raise invalid(ENV, os.environ[ENV], ALLOWED, rank)
    return n


def trace_path(rank, path=None):
    """``path``, else MPICOMM_TRACE_DIR (default: the working directory)/mpicomm-trace.rank{R}.json."""
    if path is None:
        path = os.path.join(os.environ.get(DIR_ENV) or os.getcwd(), f"mpicomm-trace.rank{rank}.json")
    return os.path.abspath(os.fspath(path))


def _op_root(code, arg):
    if code in (ALL_REDUCE, REDUCE_SCATTER):
        return arg, None
    if code == BROADCAST:
        return None, arg
    if code == REDUCE and isinstance(arg, tuple):
        return arg
    return None, None


def _call(gname, seq, code, p, t, origin, done_seq):
    shape = dtype = op = root = None
    async_op = False
    if p is not None:
        if p.shape is not None:
            shape = [int(s) for s in p.shape]
        if p.dtype is not None:
            dtype = str(p.dtype).replace("torch.", "")
        op, root = _op_root(code, p.arg)
        async_op = bool(p.async_op)
    return {"group": gname, "seq": seq, "collective": NAMES.get(code, "?"), "shape": shape, "dtype": dtype,
            "op": None if op is None else str(getattr(op, "value", op)),
            "root": None if root is None else int(root), "async_op": async_op,
            "start_ns": origin + t, "done": seq <= done_seq}


class FlightRecorder:
    """The recorder of one initialised context: the size of new rings and writing the record."""

    def __init__(self, size, groups, progress, world_rank, world_size):
        self.size = size                       # N: calls kept per group
        self.slots = 1 << (size - 1).bit_length() if size else 0
        self.groups = groups                   # () -> the live groups (each with .disp)
        self.progress = progress               # the group's DONE word tells which calls completed
        self.rank = world_rank
        self.world_size = world_size
        self.peers = None   # the peers' windows a report's diagnosis read, for the record written with it
        # turns perf_counter_ns (what the hot path stores) into wall-clock ns
        self.origin = time.time_ns() - time.perf_counter_ns()

    def new_ring(self):
        """The ring of a new group's dispatcher (a power of two long), or None when off."""
        return [None] * self.slots if self.slots else None

    def close(self):
        pass

    def record(self, reason, peers=None, report=None):
        """This rank's record as a JSON-ready dict: the calls of every group, oldest first.
        ``peers``: {world rank: window or None}, read by a report: each group says where they were;
        ``report``: the text the report printed (kept with the record: a job's stderr may be lost)."""
        m = self.progress.m
        groups, calls = {}, []
        for g in self.groups():
            d = getattr(g, "disp", None)
            if d is None:   # a group this rank is not in
                continue
            b = self.progress.rows.get(g)
            # the calls before the dispatcher's last one have returned; the last one has
            # when the row's DONE word says so
            done_seq = max(d.seq - 1, int(m[b + 1]) >> 4 if b is not None else d.seq)
            groups[g.name] = {"ranks": list(g.ranks), "rank": g.rank, "last_seq": d.seq, "done_seq": done_seq}
            if peers:
                groups[g.name]["peers"] = _peer_rows(g, peers, self.rank)
            ring = d.fr
            if ring is None:
                continue
            mask = len(ring) - 1
            for seq in range(max(1, d.seq - self.size + 1), d.seq + 1):
                e = ring[seq & mask]
                if e is not None and e[0] == seq:   # else: not recorded (its preparation raised)
                    calls.append(_call(g.name, seq, e[1], e[2], e[3], self.origin, done_seq))
        calls.sort(key=lambda c: c["start_ns"])
        return {"format": FORMAT, "version": VERSION, "rank": self.rank, "world_size": self.world_size,
                "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
                "recorder_size": self.size, "clock_origin_ns": self.origin, "dumped_ns": time.time_ns(),
                **({"report": report} if report else {}), "groups": groups, "calls": calls}

    def dump(self, path=None, reason="dump_flight_record()", peers=None, report=None):
        """Write the record; returns its absolute path. Raises OSError when it cannot be written."""
        path = trace_path(self.rank, path)
        rec = self.record(reason, peers, report)
        calls = rec.pop("calls")   # one call a line: readable, and greppable
        text = (json.dumps(rec)[:-1] + ',\n "calls": [' + ",".join("\n  " + json.dumps(c) for c in calls)
                + "\n ]}")
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"   # a rank killed while writing leaves no half file
        try:
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def report_line(self, reason, prefix, report=None):
        """Write the record for a report and return the report's line saying where (or why
        not); never raises, and gives up after ``TIMING.dump_wait`` s (a hung file system)."""
        box = []
        peers, self.peers = self.peers, None   # what this report's diagnosis read (once)

        def write():
            try:
                box.append((self.dump(reason=reason, peers=peers, report=report), None))
            except BaseException as e:
                box.append((None, f"{type(e).__name__}: {e}"))

        t = threading.Thread(target=write, name="mpicomm-flight-dump", daemon=True)
        t.start()
        t.join(TIMING.dump_wait)
        if not box:
            return f"{prefix}flight record: not written (still writing after {TIMING.dump_wait:g} s)\n"
        path, err = box[0]
        if err is not None:
            return f"{prefix}flight record: not written ({err})\n"
        return f"{prefix}flight record: {path}; merge the ranks' files with mpicomm-trace\n"


def _peer_rows(g, peers, me):
    """{world rank: its last entered and completed call on group ``g``, or None (no answer)}
    of the members of ``g`` whose progress window a report read."""
    from .progress import DONE, ENTERED, EXITED, GHASH, HDR, ROWS, F, ghash

    out, gh = {}, ghash(g.name)
    for wr in g.ranks:
        if wr == me or wr not in peers:
            continue
        st = peers[wr]
        if st is None:
            out[str(wr)] = None
            continue
        row = next((r for r in st[HDR:].reshape(ROWS, F)[:ROWS - 1] if r[GHASH] == gh), None)
        e, d = (0, 0) if row is None else (int(row[ENTERED]), int(row[DONE]))
        out[str(wr)] = {"entered": e >> 4, "collective": NAMES.get(e & 15) if e else None, "done": d >> 4,
                        "exited": bool(st[EXITED])}
    return out


def dump_flight_record(path=None):
    """Write this rank's flight record as JSON and return the file's path.

    The record holds the last calls of every group this rank is in (MPICOMM_FLIGHT_RECORDER
    per group, default 64), oldest first: group, sequence number, collective, shape, dtype,
    op or root, wall-clock start and whether it completed. path: the file (default
    MPICOMM_TRACE_DIR, else the working directory, /mpicomm-trace.rank{R}.json with R the
    world rank). Merge the ranks' files with ``mpicomm-trace FILES...``.

    Raises NotInitializedError before init(), InvalidArgumentError for a path that is no
    string or path object, and OSError when the file cannot be written.
    """
    from .._state import require_init

    rel = require_init("dump_flight_record()").reliability
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise invalid("path", path, "a file path (str or os.PathLike), or None for "
                      f"${DIR_ENV}/mpicomm-trace.rank{rel.flight.rank}.json")
    return rel.flight.dump(path)
