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
import time

from .._ops import RECV, SEND

# seconds close() waits for blocking tagged sends that MPI has not completed yet
CLOSE_WAIT = 5.0
# sends never completed by close(): kept (request and buffer) for as long as the process
# lives, since MPI may still read the buffer, and never waited for again
_ABANDONED: list = []


class TaggedP2P:
    """The tagged point-to-point of one group, over its MPI transport ``host``."""

    def __init__(self, host):
        self.host = host
        self.outbox = []     # Works of blocking sends whose MPI send is still in progress

    def _prune(self):
        if self.outbox:
            self.outbox = [w for w in self.outbox if not w.is_completed()]

    def send(self, h, dst, tag, async_op):
        """Send host array ``h`` (this call's own copy) to group rank ``dst``.

        Blocking: returns None at once, the send kept in the outbox until complete.
        async_op: the Work of the MPI send (complete when MPI is done with ``h``)."""
        self._prune()
        w = self.host.point_to_point(SEND, h, dst, tag, True, None)
        if async_op:
            return w
        if not w.is_completed():
            self.outbox.append(w)
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

    def close(self, wait=CLOSE_WAIT):
        """Give MPI up to ``wait`` seconds to complete the blocking sends still in the outbox;
        say on stderr which were never received."""
        deadline = time.monotonic() + wait
        while self.outbox and time.monotonic() < deadline:
            self._prune()
            if self.outbox:
                time.sleep(1e-3)
        if self.outbox:
            left = ", ".join(f"{w._what[0]} of shape {tuple(w._what[1])}" for w in self.outbox[:4])
            sys.stderr.write(f"mpicomm: {len(self.outbox)} tagged GPU send(s) still not received when the "
                             f"group closed ({left}); their data is dropped\n")
            sys.stderr.flush()
            for w in self.outbox:
                w._done = True     # (not waited for again by the dropped-Work path)
            _ABANDONED.extend(self.outbox)
        self.outbox = []


def _landing(w, o, land, result):
    """Work ``w`` of an MPI receive into ``o``: on completion, ``land(o)`` runs and the
    Work's result is ``result``."""
    w._result = result

    def post():
        land(o)
    w._post = post
    return w


__all__ = ["TaggedP2P", "CLOSE_WAIT"]
