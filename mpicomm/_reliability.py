"""Timeouts that name the missing rank, mismatch detection, and abort on failure.

Installed by :func:`mpicomm.init` as ``CTX.hooks``; every collective goes through
``hooks.run``. The pieces:

* **Published progress.** Each rank owns a row per group in an MPI RMA window (on an
  mpicomm-owned dup of the world): the sequence number of the last collective it
  entered on that group, which collective, the last one it completed and when. The
  hot path writes these with plain stores into its own window memory; peers read
  them with a passive-target ``Rget`` only when diagnosing a timeout, with a bounded
  wait so a dead peer yields "unknown" instead of a hang.
* **Watchdog.** A daemon thread that sleeps on an Event and wakes every
  ``min(1 s, timeout / 10)``. When it sees the same collective pending on two wakes
  further apart than the timeout, it reads the peers' rows, prints
  ``CollectiveTimeoutError: ...`` naming the collective, the group, its sequence
  number, shape, dtype and the ranks that have not reached it, aborts the NCCL
  communicators and then ``MPI.COMM_WORLD.Abort(1)``. Synchronous collectives stay
  blocking MPI calls (much faster than a nonblocking call plus polling), so the
  thread that notices must be another one. On NCCL the host call returns at once:
  the watchdog records a CUDA event on the last collective's stream and checks it.
* **Debug checker** (``init(debug=True)``): before each collective the ranks of the
  group allgather a fixed 16-integer descriptor over a side communicator; any
  difference raises :class:`CollectiveMismatchError` on every rank, with a table.
* **Abort on exception**: ``sys.excepthook`` and ``threading.excepthook`` print the
  traceback prefixed with the rank and abort the job.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import zlib

import numpy as np

from .errors import CollectiveMismatchError, CollectiveTimeoutError

_CODES = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "reduce": 5,
          "all_to_all": 6, "barrier": 7}
_NAMES = {v: k for k, v in _CODES.items()}
_OPS = {"sum": 1, "prod": 2, "min": 3, "max": 4, "avg": 5}
_OPNAMES = {v: k for k, v in _OPS.items()}

# Window layout (int64): [magic, pid, then _ROWS rows of _F fields]
_MAGIC = 0x6D7069636F6D6D  # "mpicomm"
_HDR = 2
_ROWS = 256         # groups published per rank (the last row is a shared, unpublished overflow)
_F = 4
# entered/done hold (sequence number << 4 | collective code); a collective is in progress
# while they differ. The completion time is stamped by the watchdog, not the hot path.
_GHASH, _ENTERED, _DONE, _TDONE = range(_F)
_WORDS = _HDR + _ROWS * _F
_READ_WAIT = 2.0   # seconds to wait for peers' rows before calling them unknown
_GRACE = 2.0       # seconds between printing a timeout and aborting, so other ranks print theirs


def _ghash(name):
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _rank_prefix():
    try:
        from mpi4py import MPI

        return f"[mpicomm rank {MPI.COMM_WORLD.Get_rank()}] "
    except Exception:  # pragma: no cover
        return "[mpicomm] "


# ---------------------------------------------------------------- install / uninstall

def install(ctx):
    """Create the hooks for an initialised context (called at the end of init)."""
    h = Hooks(ctx)
    ctx.hooks = h
    if ctx.abort_on_exception:
        _install_excepthooks()
    h.start()


def uninstall(ctx):
    """Stop the watchdog and free what install made (collective, from finalize)."""
    h = ctx.hooks
    ctx.hooks = None
    _uninstall_excepthooks()
    if h is not None:
        h.close(free=True)


def on_group(ctx, g):
    """A group was created (collectively over the world): set up its side channel."""
    h = ctx.hooks
    if h is not None and g.mpi_comm is not None:
        h.group_created(g)


def on_group_destroyed(ctx, g):
    h = ctx.hooks
    if h is not None:
        h.group_destroyed(g)


class Hooks:
    """Sequence numbers, published progress and the watchdog (no debug comparison)."""

    def __init__(self, ctx):
        from mpi4py import MPI

        self.ctx = ctx
        self.timeout = ctx.timeout
        self.world = ctx.world
        self.wrank = ctx.world.rank
        self.nccl = ctx.backend_name == "nccl"
        self.debug = ctx.debug
        self._side = {}                  # debug mode: Group -> dup of its MPI communicator
        self.x = None                    # the input of the collective in progress (diagnosis only)
        self._rows = {}                  # Group -> base index of its row in the window
        self._names = {}                 # group hash -> name (every rank knows every group's name)
        self._next = 0                   # rows handed out so far
        self._free = []                  # rows of destroyed groups
        self._win = None
        self._comm = None
        try:
            self._comm = ctx.world.mpi_comm.Dup()
            self._win = _quiet(lambda: MPI.Win.Allocate(_WORDS * 8, 8, comm=self._comm))
            mem = memoryview(self._win.tomemory()).cast("B")
            self._win.Lock_all()         # one passive epoch for the whole run: reads need no lock
        except Exception:                # no RMA here: keep a private table, peers show "unknown"
            self._win = None
            mem = memoryview(bytearray(_WORDS * 8))
        self._mem = mem
        self._m = mem.cast("q")
        self._m[0] = _MAGIC
        self._m[1] = os.getpid()
        self._stop = threading.Event()
        self._thread = None
        self._fired = False
        self._lock = threading.Lock()    # diagnosis from the watchdog and from Work.wait
        self._row(ctx.world)
        if self.debug:
            self._side[ctx.world] = ctx.world.mpi_comm.Dup()
        if self.debug:
            self.run = self.run_checked

    # ------------------------------------------------------------ hot path
    def run(self, g, code, x, async_op, fn, args):
        """Run ``fn(*args)``, collective ``code`` (see _CODES) on group ``g``, publishing progress.

        The hot path of every collective: a few stores, no clock, no allocation.
        """
        b = g.row
        if b is None:
            b = self._row(g)
        seq = g.seq + 1
        g.seq = seq
        v = seq << 4 | code
        m = self._m
        m[b] = v
        self.x = x
        try:
            r = fn(*args)
        except BaseException:  # a validation error is not a pending collective
            self.x = None
            m[b + 1] = v
            raise
        m[b + 1] = v
        self.x = None
        if async_op and r is not None:
            r._what = r._what[:3] + (g, seq)
        return r

    def run_checked(self, g, code, x, async_op, fn, args):
        """run() for debug mode: compare the arguments across the group first (inside the
        published call, so a rank missing from the comparison shows as pending)."""
        if self._fired:  # the watchdog is aborting the job
            from .errors import CommunicationError

            raise CommunicationError(f"{_NAMES[code]} on group {g.name!r}: the job is being aborted "
                                     "after a collective timed out (see the CollectiveTimeoutError above)")
        return Hooks.run(self, g, code, x, async_op, self._checked_call, (g, code, x, fn, args))

    def _checked_call(self, g, code, x, fn, args):
        self.check(g, code, x, *_op_root(code, args), g.seq)  # g.seq: this call's, set by run()
        return fn(*args)

    def _row(self, g):
        if self._free:
            b = self._free.pop()
        elif self._next < _ROWS - 1:
            b = _HDR + self._next * _F
            self._next += 1
        else:  # more live groups than rows: share the last row, which is not published
            b = _HDR + (_ROWS - 1) * _F
            self._rows[g] = g.row = b + _ENTERED
            return b + _ENTERED
        h = _ghash(g.name)
        self._names[h] = g.name
        m = self._m
        m[b + _ENTERED] = m[b + _DONE] = 0
        m[b + _GHASH] = h
        self._rows[g] = g.row = b + _ENTERED
        return b + _ENTERED

    def group_created(self, g):
        self._names[_ghash(g.name)] = g.name
        if self.debug:
            self._side[g] = g.mpi_comm.Dup()

    def group_destroyed(self, g):
        b = self._rows.pop(g, None)
        g.row = None
        if b is not None and b - _ENTERED != _HDR + (_ROWS - 1) * _F:
            self._m[b - _ENTERED + _GHASH] = 0
            self._free.append(b - _ENTERED)
        c = self._side.pop(g, None)
        if c is not None:
            c.Free()

    # ------------------------------------------------------------ debug mode
    def check(self, g, code, x, op, root, seq):
        """Allgather this call's descriptor over the group; raise on every rank if any differ."""
        from mpi4py import MPI

        side = self._side[g]
        d = _descriptor(code, x, op, root, g, seq)
        allv = np.empty((g.size, 16), np.int64)
        side.Allgather([d, MPI.INT64_T], [allv, MPI.INT64_T])
        if (allv != allv[0]).any():
            raise CollectiveMismatchError(_mismatch_table(g, allv))

    # ------------------------------------------------------------ NCCL
    # ------------------------------------------------------------ watchdog
    def start(self):
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._loop, name="mpicomm-watchdog", daemon=True)
            self._thread.start()
        atexit.register(self._atexit)

    def _loop(self):
        period = min(1.0, self.timeout / 10)
        seen = {}       # row base -> (seq, first seen monotonic)
        done = {}       # row base -> last done seq seen
        events = {}     # row base -> (seq, cuda event, recorded at, entry)
        if self.nccl and self.ctx.device_id is not None:
            try:
                import cupy

                cupy.cuda.runtime.setDevice(self.ctx.device_id)
            except Exception:
                pass
        while not self._stop.wait(period):
            try:
                self._tick(seen, done, events)
            except Exception as e:  # never let the watchdog die silently
                sys.stderr.write(f"{_rank_prefix()}mpicomm watchdog error: {type(e).__name__}: {e}\n")
            if self._fired:
                return

    def _tick(self, seen, done, events):
        now = time.monotonic()
        wall = int(time.time() * 1000)
        m = self._m
        for g, b in list(self._rows.items()):  # b: index of the row's ENTERED field
            e, d = m[b], m[b + 1]
            if done.get(b) != d:  # stamp completion time here, not on the hot path
                done[b] = d
                m[b - _ENTERED + _TDONE] = wall
            if e != d:
                s = seen.get(b)
                if s is None or s[0] != e:
                    seen[b] = (e, now)
                elif now - s[1] >= self.timeout:
                    self._fire(g, e >> 4, _NAMES.get(e & 15, "?"), _desc(self.x), now - s[1])
                    return
            else:
                seen.pop(b, None)
        if self.nccl:
            self._tick_gpu(events, now)
        if self._win is not None:
            try:  # let a transport that emulates RMA with messages make progress for peers
                from mpi4py import MPI

                self._comm.Iprobe(MPI.ANY_SOURCE, 0x6D70)
            except Exception:
                pass

    def _tick_gpu(self, events, now):
        """NCCL calls return at once: watch the GPU side of each group's last collective.

        The backend keeps the stream (object) and input of its last watched call. When a
        group's done marker has moved since the last event, record an event on that stream;
        an event still pending after the timeout is a hang on the GPU.
        """
        import cupy

        m = self._m
        for g, b in list(self._rows.items()):
            impl = g.impl
            st = getattr(impl, "last_stream", None)
            if st is None:  # no GPU collective on this group yet (or an MPI group)
                continue
            d = m[b + 1]
            ev = events.get(b)
            if ev is None or ev[0] != d:
                if ev is not None and not ev[1].done:
                    pass  # the earlier event is still pending: judge by it first
                else:
                    x = impl.last_x
                    e = cupy.cuda.Event(block=False, disable_timing=True)
                    p = getattr(st, "ptr", None)
                    try:
                        cupy.cuda.runtime.eventRecord(e.ptr, p if p is not None else st.cuda_stream)
                    except Exception:
                        continue
                    events[b] = (d, e, now, x, g)
                    continue
            d0, e, t0, x, g0 = events[b]
            if e.done:
                if x is not None:
                    if impl.last_x is x:  # done: release the input (a race here only loses a description)
                        impl.last_x = None
                    events[b] = (d0, e, t0, None, g0)
            elif now - t0 >= self.timeout:
                self._fire(g0, d0 >> 4, _NAMES.get(d0 & 15, "?"), _desc(x).replace("torch.", ""), now - t0,
                           gpu=True)
                return

    def _fire(self, g, seq, name, desc, waited, gpu=False):
        with self._lock:
            if self._fired:
                return
            self._fired = True
        msg = self.diagnose(g, seq, name, desc, waited, gpu=gpu)
        sys.stderr.write(f"{_rank_prefix()}CollectiveTimeoutError: {msg}\n"
                         f"{_rank_prefix()}aborting the job\n")
        sys.stderr.flush()
        abort_job(grace=_GRACE)

    # ------------------------------------------------------------ diagnosis
    def read_peers(self, ranks):
        """{world rank: int64 array of its window, or None if it did not answer in time}."""
        out = {r: None for r in ranks}
        if self._win is None:
            return out
        from mpi4py import MPI

        bufs, reqs = {}, {}
        for r in ranks:
            if r == self.wrank:
                out[r] = np.frombuffer(self._m, np.int64, _WORDS).copy()
                continue
            buf = np.zeros(_WORDS, np.int64)
            try:
                reqs[r] = self._win.Rget([buf, MPI.INT64_T], r)
                bufs[r] = buf
            except Exception:
                pass
        deadline = time.monotonic() + _READ_WAIT
        while reqs and time.monotonic() < deadline:
            for r, q in list(reqs.items()):
                if q.Test():
                    del reqs[r]
                    if bufs[r][0] == _MAGIC:
                        out[r] = bufs[r]
            if reqs:
                time.sleep(0.002)
        return out

    def diagnose(self, g, seq, name, desc, waited, gpu=False, limit=None):
        """The timeout message: what is pending here, and where every other rank of ``g`` is."""
        limit = self.timeout if limit is None else limit
        gh = _ghash(g.name)
        states = self.read_peers(list(g.ranks))
        nowms = int(time.time() * 1000)
        missing, lines = [], []
        for gr, wr in enumerate(g.ranks):
            if wr == self.wrank:
                continue
            st = states.get(wr)
            where = f"rank {wr}" if g is self.world else f"rank {wr} (rank {gr} of the group)"
            if st is None:
                missing.append(wr)
                lines.append(f"  {where}: state unknown (no answer within {_READ_WAIT:g} s: "
                             "the process may have died)")
                continue
            rows = st[_HDR:].reshape(_ROWS, _F)[:_ROWS - 1]
            mine = [r for r in rows if r[_GHASH] == gh and r[_ENTERED]]
            entered = int(mine[0][_ENTERED]) >> 4 if mine else 0
            if entered >= seq:
                continue
            missing.append(wr)
            if mine:
                r = mine[0]
                last = (f"last call {_NAMES.get(int(r[_ENTERED]) & 15, '?')} sequence {entered} "
                        f"on group {g.name!r}")
                if r[_DONE] == r[_ENTERED] and r[_TDONE]:
                    last += f", finished {max(0, nowms - int(r[_TDONE])) / 1000:.1f} s ago"
            else:
                last = f"no collective on group {g.name!r} yet"
            inside = [r for r in rows if r[_ENTERED] != r[_DONE] and r[_GHASH]]
            if inside:
                r = inside[0]
                gname = self._names.get(int(r[_GHASH]), f"#{int(r[_GHASH])}")
                now = (f"inside {_NAMES.get(int(r[_ENTERED]) & 15, '?')} sequence {int(r[_ENTERED]) >> 4} "
                       f"on group {gname!r}")
            else:
                now = "not in a collective"
            lines.append(f"  {where}: {last}; {now}")
        what = f"{name} sequence {seq} on group {g.name!r} ({desc})"
        head = (f"rank {self.wrank}: {what} did not complete within {limit:g} s "
                f"(waited {waited:.1f} s)" + (" on the GPU" if gpu else "") + ". ")
        if missing:
            head += (f"Rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                     f"of {len(g.ranks)} {'have' if len(missing) > 1 else 'has'} not reached this call:\n")
        else:
            head += ("Every rank of the group has reached this call: it is stuck in the transport "
                     "(network, a GPU kernel, or ranks that disagree on the arguments: try MPICOMM_DEBUG=1).\n")
        tail = (f"  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s; "
                f"sequence numbers count the collectives on a group from 1)")
        return head + "\n".join(lines) + ("\n" if lines else "") + tail

    def work_timeout(self, what, timeout):
        """The error Work.wait raises when an async collective has not completed in time."""
        name, shape, dtype = what[:3]
        desc = f"shape {tuple(shape) if shape is not None else ()}, dtype {dtype}"
        if len(what) >= 5:
            g, seq = what[3], what[4]
            with self._lock:
                msg = self.diagnose(g, seq, name, desc, timeout, limit=timeout)
        else:
            msg = f"{name} ({desc}) did not complete within {timeout:g} s"
        return CollectiveTimeoutError(msg)

    # ------------------------------------------------------------ shutdown
    def _atexit(self):
        self.close(free=False)

    def close(self, free):
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._thread = None
        try:
            atexit.unregister(self._atexit)
        except Exception:  # pragma: no cover
            pass
        w = self._win
        self._win = None
        if w is not None:
            try:
                w.Unlock_all()
                if free:
                    w.Free()
            except Exception:
                pass
        if free and self._comm is not None:
            try:
                self._comm.Free()
            except Exception:
                pass
            self._comm = None


# ---------------------------------------------------------------- descriptors

_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "bfloat16", "float32",
           "float64", "complex64", "complex128", "bool", "int16", "uint16"]
_DTCODE = {n: i + 1 for i, n in enumerate(_DTYPES)}


def _shape_dtype(x):
    if x is None:
        return None, None
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        try:
            a = np.asarray(memoryview(x))
            shape, dtype = a.shape, a.dtype
        except Exception:
            return None, type(x).__name__
    return tuple(int(s) for s in shape), str(dtype).replace("torch.", "")


def _desc(x):
    if x is None:
        return "no array"
    shape, dtype = _shape_dtype(x)
    return f"shape {shape}, dtype {dtype}"


def _op_root(code, args):
    """(op, root) of a collective from the arguments its backend method takes."""
    if code in (1, 3):   # all_reduce, reduce_scatter: (x, op, out, ...)
        return args[1], None
    if code == 4:        # broadcast: (x, root, ...)
        return None, args[1]
    if code == 5:        # reduce: (x, op, root, out, ...)
        return args[1], args[2]
    return None, None


def _descriptor(code, x, op, root, g, seq):
    shape, dtype = _shape_dtype(x)
    d = np.full(16, -1, np.int64)
    d[0] = code
    d[1] = _OPS.get(getattr(op, "value", None), 0) if op is not None else 0
    d[2] = (_DTCODE.get(dtype) or (zlib.crc32(dtype.encode()) | (1 << 40))) if dtype else 0
    if shape is not None:
        d[3] = len(shape)
        if len(shape) <= 8:
            d[4:4 + len(shape)] = shape
        else:
            d[4:11] = shape[:7]
            d[11] = zlib.crc32(repr(shape[7:]).encode())
    d[12] = root if root is not None and isinstance(root, (int, np.integer)) else -1
    d[13] = _ghash(g.name)
    d[14] = seq
    d[15] = 0
    return d


def _fmt_desc(d):
    name = _NAMES.get(int(d[0]), f"collective#{int(d[0])}")
    parts = [f"{name} sequence {int(d[14])}"]
    if d[1]:
        parts.append(f"op={_OPNAMES.get(int(d[1]), int(d[1]))}")
    if d[2]:
        c = int(d[2])
        parts.append(f"dtype={_DTYPES[c - 1] if 0 < c <= len(_DTYPES) else f'#{c}'}")
    if d[3] >= 0:
        nd = int(d[3])
        shape = tuple(int(s) for s in d[4:4 + min(nd, 8)]) if nd <= 8 else "(...)"
        parts.append(f"shape={shape}")
    if d[12] >= 0:
        parts.append(f"root={int(d[12])}")
    return " ".join(parts)


def _mismatch_table(g, allv):
    fields = {"collective": [0], "op": [1], "dtype": [2], "shape": list(range(3, 12)), "root": [12],
              "sequence number": [14]}
    diff = [k for k, idx in fields.items() if (allv[:, idx] != allv[0, idx]).any()]
    rows = "\n".join(f"  rank {r} (world rank {g.ranks[r]}): {_fmt_desc(allv[r])}" for r in range(len(allv)))
    return (f"ranks of group {g.name!r} called different collectives or the same one with different "
            f"arguments (differs in: {', '.join(diff)}):\n{rows}\n"
            "  every rank must call the same collectives in the same order, with the same "
            "op, dtype, shape and root")


# ---------------------------------------------------------------- abort

def abort_job(grace=0.0):
    """Abort NCCL communicators, then the whole MPI job (never returns)."""
    from ._state import CTX

    for g in [CTX.world] + list(CTX.groups.values()):
        impl = getattr(g, "impl", None) if g is not None else None
        ab = getattr(impl, "abort", None)
        if ab is not None:
            try:
                ab()
            except Exception:
                pass
    if grace:
        time.sleep(grace)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


_prev_hooks = None


def _excepthook(tp, val, tb):
    p = _rank_prefix()
    text = "".join(traceback.format_exception(tp, val, tb))
    sys.stderr.write(f"{p}uncaught exception; aborting the job "
                     "(init(abort_on_exception=False) turns this off):\n"
                     + "".join(p + line for line in text.splitlines(True)))
    sys.stderr.flush()
    abort_job()


def _thread_excepthook(args):
    if args.exc_type is SystemExit:
        return
    p = _rank_prefix()
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    name = args.thread.name if args.thread is not None else "?"
    sys.stderr.write(f"{p}uncaught exception in thread {name}; aborting the job:\n"
                     + "".join(p + line for line in text.splitlines(True)))
    sys.stderr.flush()
    abort_job()


def _install_excepthooks():
    global _prev_hooks
    if _prev_hooks is None:
        _prev_hooks = (sys.excepthook, threading.excepthook)
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook


def _uninstall_excepthooks():
    global _prev_hooks
    if _prev_hooks is None:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _prev_hooks[0]
    if threading.excepthook is _thread_excepthook:
        threading.excepthook = _prev_hooks[1]
    _prev_hooks = None


def _quiet(fn):
    """Run fn with fd 2 silenced: Open MPI's PyPI build prints a harmless osc/ucx component
    message on every window creation on hosts without UCX devices."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except Exception:  # pragma: no cover
        return fn()
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        return fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def timeout_error(what, timeout):
    """The error Work.wait raises (with the peers' state when the hooks are installed)."""
    from ._state import CTX

    h = CTX.hooks
    if h is not None:
        return h.work_timeout(what, timeout)
    name, shape, dtype = what[:3]
    return CollectiveTimeoutError(f"{name} (shape {shape}, dtype {dtype}) did not complete within {timeout:g} s")
