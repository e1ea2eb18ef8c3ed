"""What every transport provides: prepared calls, the handle of an asynchronous call.

A backend makes one transport per group. The dispatcher (mpicomm._dispatch) asks the
transport to ``prepare`` a call once per signature and then runs the prepared call
for any arrays of that signature:

    prepare(code, x, out, arg, async_op, stream) -> Prepared
        code: the collective (mpicomm._ops.ALL_REDUCE, ...); arg: the ReduceOp, the root,
        or None. It validates everything the signature decides (dtype, shape, op, root,
        the out= shape and dtype) and raises InvalidArgumentError alike on every rank.
    Prepared.run(x, out) -> result (a Work with async_op)
        binds this call's arrays: it checks and converts what can differ between arrays
        of one signature (contiguity, writability, overlap of out= with x, the device)
        and makes the transport call, then the post-steps (AVG's divide, the float32
        round trip of 16-bit floats on MPI, the write-back into a non-NumPy out=).
    point_to_point(code, x, peer, tag, async_op, stream)   send / recv, not cached
    barrier(async_op)
    group_start() / group_end()   calls issued in between are launched together (NCCL)
    abort(), close()

State the watchdog reads (never writes): ``last_stream`` (the stream of the last GPU
call: an object, a PyTorch pool stream's handle, or None) and ``last_what`` (its
collective name, shape and dtype). Transports import nothing
from mpicomm's state, dispatch or reliability modules.
"""
from __future__ import annotations

import enum
import numbers
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

from .._ops import NAMES
from .._timing import TIMING
from ..errors import CollectiveTimeoutError, MpicommError, invalid

# Works dropped before they completed. MPI and NCCL go on writing into their buffers
# after the handle is gone, so a dropped Work is kept here (with its request and
# buffers) and completed at the next collective, barrier or finalize.
_dropped: list[Work] = []
# Works of calls that raised on this rank after they started (a disagreement found as the
# call returned, a member's report while waiting): they may never complete, and the group
# goes on with a fresh communicator where needed; kept (with their buffers), never waited for.
_abandoned: list[Work] = []
_warned: list[bool] = []
DROPPED_WARNING = ("mpicomm: a Work (async_op=True) was dropped before it completed; mpicomm keeps "
                   "its buffers until the operation completes, at the next collective, barrier or "
                   "finalize. Call wait() on it to use the result (this warning is shown once)")


def complete_dropped():
    """Complete every dropped Work (blocking), in the order they were dropped.

    Each waits with its own timeout; one that does not complete raises its
    CollectiveTimeoutError (with the diagnosis) here, in the call that came next, as
    ``wait()`` would have: the group cannot go on, and left uncaught it ends the job."""
    while _dropped:
        w = _dropped.pop(0)
        if not w._done:
            w._complete(None, False)


# Works of async sends and receives (send/recv/sendrecv with async_op=True) that the caller
# may still hold, weakly (one dropped unwaited goes to _dropped): finalize completes those
# still pending, so that one that can never complete is reported, not left behind silently.
_pending: weakref.WeakSet[Work] = weakref.WeakSet()


def track(w):
    """Remember async send/recv Work ``w`` for :func:`complete_pending`; returns ``w``."""
    if isinstance(w, Work) and not w._done:
        _pending.add(w)
    return w


def describe_p2p(w):
    """'recv from rank 1 (tag 5, shape (4,), dtype float32) on group 'world'' for a Work."""
    d = w.description
    name, shape = d.name, d.shape
    desc = f"shape {tuple(shape) if shape is not None else ()}, dtype {str(d.dtype).replace('torch.', '')}"
    if d.p2p:
        to = {"recv": "from", "send": "to"}.get(name, "with")
        gname = getattr(d.group, "name", "?")
        return f"{name} {to} rank {d.peer} (tag {d.tag}, {desc}) on group {gname!r}"
    return f"{name} ({desc})"


def complete_pending(where="finalize()"):
    """Complete every tracked async send/recv that is still pending (blocking, each with its
    timeout), before ``where`` releases the communicators: one that cannot complete raises
    its error (a CollectiveTimeoutError with the watchdog's diagnosis, naming the peer),
    prefixed with ``where`` and the call, instead of being forgotten."""
    while _pending:
        w = _pending.pop()
        try:
            if w._done or w.is_completed():
                continue
            if Work.default_timeout is None:   # no timeout: say what this may wait for forever
                sys.stderr.write(f"mpicomm: {where} waits for {describe_p2p(w)}, started with "
                                 "async_op=True and not completed (no timeout is set)\n")
                sys.stderr.flush()
            w.wait()
        except MpicommError as e:
            raise type(e)(f"{where}: {describe_p2p(w)}, started with async_op=True and never waited "
                          f"for, is still pending and cannot complete: {e}") from e


def _timeout_arg(timeout):
    """``Work.wait``'s timeout as a float of seconds >= 0; InvalidArgumentError otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise invalid("timeout", timeout, "a number of seconds >= 0, or None (the timeout given to init)")
    return float(timeout)


class Role(enum.IntEnum):
    """What a call's result is written into: a new array, ``x`` itself, or the given ``out=``."""

    NEW = 0        # out=None: a new output
    IN_PLACE = 1   # out=x
    OUT = 2        # another array given as out=


# The members as module names: a per-call test reads ``role is OUT`` (one global load)
# rather than ``role is Role.OUT`` (a global and an attribute load).
NEW, IN_PLACE, OUT = Role


def role_of(x, out):
    """The :class:`Role` of ``out=`` for input ``x``."""
    return NEW if out is None else (IN_PLACE if out is x else OUT)


class Prepared:
    """One validated call signature and the function that runs it for given arrays.

    ``cls``, ``shape``, ``dtype``, ``arg``, ``role`` (a :class:`Role`), ``stream`` and
    ``async_op`` are the signature the dispatcher
    compares; ``cls`` None means "never reuse" (arrays converted through the host by
    a route that depends on more than these facts).
    """

    __slots__ = ("code", "cls", "shape", "dtype", "arg", "role", "stream", "async_op", "run", "spec", "sig", "key")

    def __init__(self, code, x, out, arg, async_op, stream, run, reuse=True):
        self.code = code
        # only arrays whose class has .shape and .dtype can be compared by the dispatcher
        self.cls = x.__class__ if reuse and hasattr(x, "shape") and hasattr(x, "dtype") else None
        self.shape = getattr(x, "shape", None)
        self.dtype = getattr(x, "dtype", None)
        self.arg = arg
        self.role = role_of(x, out)
        self.stream = stream
        self.async_op = async_op
        self.run = run
        self.spec = None     # the call's CallSpec and its signature: set by the dispatcher
        self.sig = 0
        self.key = None      # what the dispatcher compares (set by it for a reusable call)

    @property
    def name(self):
        return NAMES.get(self.code, "?")

    def describe(self):
        shape = tuple(self.shape) if self.shape is not None else ()
        return f"shape {shape}, dtype {str(self.dtype).replace('torch.', '')}"


class _Never:
    """The empty cache entry: no array's class is None's, so nothing matches it."""

    cls = shape = dtype = arg = stream = async_op = role = key = None


NEVER = _Never()


@dataclass(slots=True)
class WorkDescription:
    """What a Work stands for, in its timeout and departed-rank reports: the call (``name``:
    all_reduce, send, ...) and its array's ``shape`` and ``dtype``, and where the dispatcher
    handed it out: the ``group`` and, for a collective or barrier, the group's call number
    ``seq``; for a send or recv, the call's ``code``, the ``peer``'s world rank and the
    ``tag`` (``seq`` None). ``group`` is None for a Work the dispatcher did not hand out."""

    name: str
    shape: Any
    dtype: Any
    group: Any = None
    seq: int | None = None
    code: int | None = None
    peer: int | None = None
    tag: Any = None

    @property
    def p2p(self) -> bool:
        """A send or recv (from the dispatcher), not a numbered call."""
        return self.code is not None


class Work:
    """Handle of a collective started with ``async_op=True``.

    ``wait(timeout=None)`` blocks until it has completed and returns its result
    (``timeout`` in seconds; None means the timeout given to :func:`mpicomm.init`);
    ``is_completed()`` tells without blocking.
    """

    __slots__ = ("_result", "_done", "_what", "_group", "_seq", "_p2p", "_post", "_watch", "__weakref__")

    default_timeout: float | None = None   # set by init: the group's timeout (None: no limit)

    def __init__(self, result, what, post=None):
        self._result = result
        self._done = False
        self._what = what           # (name, shape, dtype), from the transport
        self._post = post
        self._watch = None          # from the dispatcher: the watchdog (diagnosis, departed peers)
        # set by the dispatcher, read through ``description``: _group and _seq on a collective
        # or barrier (its group and call number), _group and _p2p (code, world peer, tag) on a
        # send or recv

    @property
    def description(self) -> WorkDescription:
        """What this Work stands for (:class:`WorkDescription`), for reports."""
        name, shape, dtype = self._what[:3]
        group = getattr(self, "_group", None)
        p2p = getattr(self, "_p2p", None)
        if p2p is not None:
            return WorkDescription(name, shape, dtype, group, None, *p2p)
        return WorkDescription(name, shape, dtype, group, getattr(self, "_seq", None))

    def _poll(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _finish(self):
        self._done = True
        if self._post is not None:
            r = self._post()
            if r is not None:
                self._result = r

    def is_completed(self) -> bool:
        if not self._done and self._poll():
            self._finish()
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective completes and return its result.

        timeout: seconds (None: the timeout given to init, no limit where that is 0);
        anything but a number >= 0 or None raises InvalidArgumentError.
        Raises CollectiveTimeoutError naming the collective, its group and sequence
        number and the ranks that have not reached it; the communicator is then
        unusable (on NCCL it is aborted), and an uncaught error aborts the job.
        """
        if timeout is not None and (timeout.__class__ is not float or not timeout >= 0):
            timeout = _timeout_arg(timeout)
        if not self._done:
            self._complete(timeout, True)
        return self._result

    def _complete(self, timeout, check):
        """Block until done (``timeout`` None: init's), then finish. ``check``: first the
        agreement check's comparison of the call with the members', as a blocking call makes it
        as it returns (a dropped Work, whose result nobody reads, is not checked)."""
        if timeout is None:
            timeout = Work.default_timeout
        disp = self._disp()
        try:
            self._block(timeout)
        except Exception as e:
            if type(e).__module__ != "mpi4py.MPI" or disp is None:
                raise
            self._done = True   # (over, in error: MPI's message, as the call's error)
            disp.raise_in_wait(self._seq, self._what[0], e)
        if check and disp is not None and disp.check:
            try:
                disp.check_waited(self._seq, self._what[0])
            except Exception:
                self._done = True   # (over: its result is not the call's)
                self._result = None
                raise
        self._finish()

    def _disp(self):
        """The dispatcher of this Work's collective (None for a send or recv, or unknown)."""
        if getattr(self, "_seq", None) is None:
            return None
        return getattr(getattr(self, "_group", None), "disp", None)

    def _block(self, timeout):
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        # then (and every TIMING.exit_check s, through the watchdog the dispatcher hands it):
        # has a rank this waits for left its script? (the watchdog's check of blocking calls)
        check = start + TIMING.exit_check
        disp = self._disp()
        spins = 0
        while not self._poll():
            spins += 1
            if spins & 255 == 0:
                # a member's report about the call (its report word: one load): the call will
                # not complete, and the members go on once this rank has raised it too
                if disp is not None:
                    try:
                        disp.report_in_wait(self._seq, self._what[0])
                    except Exception:
                        self._done = True   # (left: its reporter left the call)
                        _abandoned.append(self)
                        raise
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    self._timed_out(timeout)
                if now > check and self._watch is not None:
                    check = now + TIMING.exit_check
                    self._watch.work_departed(self.description, now - start)  # reports and ends the job
                self._idle()

    def _idle(self):
        """Between polls: MPI needs polling for progress; GPU work does not."""

    def _timed_out(self, timeout):
        if self._watch is not None:
            raise self._watch.work_timeout(self.description, timeout)
        d = self.description
        raise CollectiveTimeoutError(f"{d.name} (shape {d.shape}, dtype {d.dtype}) did not complete within {timeout:g} s")

    def __repr__(self):
        state = "completed" if self._done else "pending"
        return f"<mpicomm.Work {self._what[0]} {state}>"

    def __del__(self):
        # Dropped unwaited: keep it (and so its request and buffers) until it completes.
        try:
            if self._done or self._poll():
                return
        except Exception:  # MPI already finalised, or the communicator is gone
            return
        disp = self._disp()
        if disp is not None and disp.raised >= self._seq:   # its call raised here (a disagreement
            _abandoned.append(self)   # reported as it returned): it may never complete; kept with
            return                    # its buffers, never waited for
        _dropped.append(self)
        if not _warned:
            _warned.append(True)
            warnings.warn(DROPPED_WARNING, RuntimeWarning, stacklevel=2)


class DoneWork(Work):
    """A Work whose operation completed before it was returned (e.g. a chunked large call)."""

    __slots__ = ()

    def _poll(self):
        return True


class HostCall:
    """A blocking host call that a transport's ``point_to_point`` runs as it is (``fn()``,
    whose result it returns): send_object / recv_object go through the dispatcher's
    point_to_point in one, so they are published for the watchdog like a blocking send or
    recv. ``shape`` and ``dtype`` describe it in a timeout report."""

    __slots__ = ("fn", "dtype")
    shape = ()

    def __init__(self, fn, what):
        self.fn = fn
        self.dtype = what


class Backend:
    """A transport factory: one transport per group."""

    name = "base"

    def __init__(self, local_rank):
        self.device_id = None

    def make_transport(self, mpi_comm):  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self):
        pass
