"""Tagged point-to-point for device arrays: staged through host memory, matched by MPI.

NCCL matches the messages between two ranks in the order they are issued and has no tags,
so a tagged GPU message cannot share NCCL's link with untagged ones: a ``recv(tag=0)``
issued while a tagged message is still in front of it on the link would receive that
message. Tagged GPU messages therefore travel as MPI messages on the group's MPI
communicator, tag and all, and MPI's matching rules hold as they are: messages of
different tags between a pair may be received in another order than sent; messages of one
tag are non-overtaking. Untagged (``tag=0``) GPU messages stay on NCCL, untouched.

The device-specific steps (a copy to host memory on the call's stream, the copy back) are
the caller's (mpicomm._backends.nccl); this module is the host side, which the CPU tests
run with NumPy arrays standing in for device memory.

A blocking tagged send returns once its data is in a host buffer of its own (as NCCL's
untagged send returns once enqueued): the MPI send goes on in the background and is kept,
with its buffer, in the outbox until MPI has completed it. So a sender may send tag 1
and then tag 2 while the receiver takes tag 2 first, whatever the message size.
"""
from __future__ import annotations

import sys
import threading
import time

from .._ops import RECV, SEND
from .._timing import TIMING

PAUSE_MIN, PAUSE_MAX = 2e-5, 1e-3   # s between the outbox thread's tests (doubling while idle)
# sends never completed by close(): kept (request and buffer) for as long as the process
# lives, since MPI may still read the buffer, and never waited for again
_ABANDONED: list = []


class Outbox:
    """Blocking tagged sends whose MPI send is still in progress (Works holding their buffers).

    A large message needs MPI progress calls on the sending side, and after a blocking
    tagged send the sender may make none for a while (its next calls may be NCCL
    collectives that wait for the receiver): so, where MPI allows calls from several threads,
    a helper thread tests the sends until the outbox is empty, and is the only one that
    touches them. Elsewhere the sends are tested at each tagged call and at close."""

    def __init__(self, threaded):
        self._lock = threading.Lock()
        self._items = []
        self._threaded = threaded
        self._thread = None
        self._stop = False

    def __len__(self):
        return len(self._items)

    def add(self, w):
        with self._lock:
            self._items.append(w)
            if self._threaded and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpicomm-tagged-sends", daemon=True)
                self._thread.start()

    def _run(self):
        pause = PAUSE_MIN
        while True:
            with self._lock:
                items = list(self._items)
                if not items or self._stop:
                    self._thread = None
                    return
            done = [w for w in items if w.is_completed()]
            with self._lock:
                for w in done:
                    self._items.remove(w)
            pause = PAUSE_MIN if done else min(2 * pause, PAUSE_MAX)
            time.sleep(pause)

    def prune(self):
        """Without the thread: drop the sends MPI has completed (tested here)."""
        if self._items and not self._threaded:
            self._items = [w for w in self._items if not w.is_completed()]

    def drain(self, wait):
        """Wait up to ``wait`` seconds for the outbox to empty; stop the thread. Returns the
        sends never completed (no longer tested by anyone)."""
        deadline = time.monotonic() + wait
        while self._items and time.monotonic() < deadline:
            self.prune()
            time.sleep(1e-3)
        with self._lock:
            self._stop = True
            t = self._thread
        if t is not None:
            t.join()
        with self._lock:
            left, self._items = self._items, []
            self._stop = False
        return left


class TaggedP2P:
    """The tagged point-to-point of one group, over its MPI transport ``host``."""

    def __init__(self, host):
        from mpi4py import MPI

        self.host = host
        self.outbox = Outbox(MPI.Query_thread() == MPI.THREAD_MULTIPLE)

    def _prune(self):
        self.outbox.prune()

    def send(self, h, dst, tag, async_op):
        """Send host array ``h`` (this call's own copy) to group rank ``dst``.

        Blocking: returns None at once, the send kept in the outbox until complete.
        async_op: the Work of the MPI send (complete when MPI is done with ``h``)."""
        self._prune()
        w = self.host.point_to_point(SEND, h, dst, tag, True, None)
        if async_op:
            return w
        if not w.is_completed():
            self.outbox.add(w)
        return None

    def recv(self, o, src, tag, async_op, land, result):
        """Receive into host array ``o`` from group rank ``src``; then ``land(o)`` (the copy
        into the caller's device array) and return ``result`` (the Work's result with
        async_op). A message larger than ``o`` raises CollectiveMismatchError naming ``out``
        (the MPI transport's error; ``o`` has out's shape and dtype)."""
        self._prune()
        r = self.host.point_to_point(RECV, o, src, tag, async_op, None)
        if not async_op:
            land(o)
            return result
        return _landing(r, o, land, result)

    def sendrecv(self, h, dst, tag, async_op, o, src, land, result):
        """Send ``h`` to ``dst`` and receive into ``o`` from ``src`` (MPI_Sendrecv), then
        ``land(o)`` (None: ``o`` is the caller's own host array) and return ``result``."""
        self._prune()
        r = self.host.sendrecv(h, dst, tag, async_op, o, src)
        if land is None:
            return r
        if not async_op:
            land(o)
            return result
        return _landing(r, o, land, result)

    def close(self, wait=None):
        """Give MPI up to ``wait`` seconds (default ``TIMING.close_wait``) to complete the blocking sends still in the outbox;
        say on stderr which were never received."""
        left = self.outbox.drain(TIMING.close_wait if wait is None else wait)
        if left:
            what = ", ".join(f"{w.description.name} of shape {tuple(w.description.shape)}" for w in left[:4])
            sys.stderr.write(f"mpicomm: {len(left)} tagged GPU send(s) still not received when the "
                             f"group closed ({what}); their data is dropped\n")
            sys.stderr.flush()
            for w in left:
                w._done = True     # (not waited for again by the dropped-Work path)
            _ABANDONED.extend(left)


def _landing(w, o, land, result):
    """Work ``w`` of an MPI receive into ``o``: on completion, ``land(o)`` runs and the
    Work's result is ``result``."""
    w._result = result

    def post():
        land(o)
    w._post = post
    return w


__all__ = ["TaggedP2P", "Outbox"]
