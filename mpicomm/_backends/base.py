"""What every backend provides, and the handle of an asynchronous collective.

A backend is a factory of per-group communicators. Every communicator has the same
methods with the same signature, whatever the transport (cupyx.distributed style):

    all_reduce(x, op, out, async_op, stream)      all_gather(x, out, async_op, stream)
    reduce_scatter(x, op, out, async_op, stream)  broadcast(x, root, async_op, stream)
    reduce(x, op, root, out, async_op, stream)    all_to_all(x, out, async_op, stream)
    send(x, dst, tag, async_op, stream)           recv(out, src, tag, async_op, stream)
    barrier(async_op)                             close()

``op`` is already a :class:`mpicomm.ReduceOp`; ``root``, ``dst`` and ``src`` are group
ranks. A communicator validates the arrays (dtype, shape, out) itself, since what is
allowed depends on the transport.
"""
from __future__ import annotations

import time

from ..errors import CollectiveTimeoutError


class Work:
    """Handle of a collective started with ``async_op=True``.

    ``wait(timeout=None)`` blocks until it has completed and returns its result
    (``timeout`` in seconds; None means the timeout given to :func:`mpicomm.init`);
    ``is_completed()`` tells without blocking.
    """

    __slots__ = ("_result", "_done", "_what")

    def __init__(self, result, what):
        self._result = result
        self._done = False
        self._what = what

    def _poll(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _finish(self):
        """Runs once, when the transfer has completed (post-processing, write-back)."""

    def is_completed(self):
        if not self._done and self._poll():
            self._finish()
            self._done = True
        return self._done

    def wait(self, timeout=None):
        """Block until the collective completes and return its result.

        timeout: seconds (None: the timeout given to init, no limit where that is 0). Raises CollectiveTimeoutError naming the collective, its group and
        sequence number and the ranks that have not reached it; the communicator is
        then unusable (on NCCL it is aborted), and an uncaught error aborts the job.
        """
        if not self._done:
            if timeout is None:
                from .._state import CTX

                timeout = CTX.timeout or None
            self._block(timeout)
            self._finish()
            self._done = True
        return self._result

    def _block(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        while not self._poll():
            spins += 1
            if spins & 255 == 0:
                if deadline is not None and time.monotonic() > deadline:
                    self._timed_out(timeout)
                self._idle()

    def _idle(self):
        """Between polls: MPI needs polling for progress; GPU work does not."""

    def _timed_out(self, timeout):
        import sys

        from .. import _reliability

        err = _reliability.timeout_error(self._what, timeout)
        sys.stderr.write(f"{_reliability._rank_prefix()}CollectiveTimeoutError: {err}\n")
        sys.stderr.flush()
        self._abandon()
        raise err

    def _abandon(self):
        """After a timeout: release what the transport holds (NCCL aborts its communicator)."""

    def __repr__(self):
        state = "completed" if self._done else "pending"
        return f"<mpicomm.Work {self._what[0]} {state}>"


REPLAY_MAX = 256 * 1024  # bytes: the largest arrays a Replay keeps a reference to


class Replay:
    """The last blocking call of one collective on one communicator that took the plain path.

    Loops call a collective with the same arrays again and again. When ``x``, ``out`` and
    ``op`` are the very objects of the last validated call, and ``x`` still has the shape
    and dtype it had (NumPy lets code change both in place), the call is repeated with
    the arguments prepared then, and no check is done twice. Only small arrays are kept
    (up to REPLAY_MAX bytes), as the entry holds a reference to them; above that size the
    checks cost nothing next to the transfer.
    """

    __slots__ = ("x", "out", "op", "shape", "dtype", "a", "b", "c", "d", "e", "f")

    def __init__(self, x=None, out=None, op=None, a=None, b=None, c=None, d=None, e=None, f=None):
        self.x = x if x is not None else _NEVER  # no array is the sentinel: an empty entry never matches
        self.out, self.op = out, op
        self.shape = x.shape if x is not None else None
        self.dtype = x.dtype if x is not None else None
        self.a, self.b, self.c, self.d, self.e, self.f = a, b, c, d, e, f


_NEVER = object()
NO_REPLAY = Replay()


def _dead():
    return None


class WeakReplay:
    """A Replay for arrays above REPLAY_MAX: it holds them by weak reference, so it never
    keeps a large array alive, and the call's buffer specs are rebuilt each time (two
    small lists). Used by the MPI backend's all_gather and broadcast, whose large
    messages take Open MPI's path, where the checks showed up at 1 MiB."""

    __slots__ = ("x", "out", "op", "shape", "dtype", "c", "dt")

    def __init__(self, x=None, out=None, op=None, c=None, dt=None):
        import weakref

        self.x = weakref.ref(x) if x is not None else _dead
        self.out = weakref.ref(out) if out is not None else _dead
        self.op, self.c, self.dt = op, c, dt
        self.shape = x.shape if x is not None else None
        self.dtype = x.dtype if x is not None else None


NO_WEAK = WeakReplay()


class Backend:
    """A transport: makes one communicator per group."""

    name = "base"

    def __init__(self, ctx):
        self.ctx = ctx

    def make_comm(self, mpi_comm):  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self):
        pass


__all__ = ["Backend", "Work", "Replay", "NO_REPLAY", "WeakReplay", "NO_WEAK", "REPLAY_MAX", "CollectiveTimeoutError"]
