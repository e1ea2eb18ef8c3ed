"""The dispatch core: every collective of a group goes through ``Dispatcher.call``.

The dispatcher keeps the group's last prepared call per collective and reuses it
whenever a new call has the same signature (the input's class, shape and dtype, the op
or root, the output role: new, in place or given, the stream, async or not), binding
the new arrays instead of validating again; anything else is prepared by the
transport (which validates it) and becomes the entry for that collective. A reused
call still checks, per call, whatever can differ between arrays of one signature
(contiguity, writability, overlap of ``out=`` with ``x``, the device): that lives in
the prepared call's ``run``.

Around the transport call the dispatcher publishes progress for the watchdog: the
sequence number and collective it entered on the group, then the same when it is
done (two stores into this rank's row of the progress window). In debug mode the
transport is wrapped by the cross-rank argument check (mpicomm._reliability.debug),
and nothing is reused. The flight recorder (mpicomm._reliability.flight) costs one
more store per call: ``(seq, code, prepared call, start)`` into the group's ring.

With the agreement check on (the default; mpicomm._reliability.agreement), each
prepared call carries its CallSpec (mpicomm._callspec); the call publishes ``seq << 32 |
signature`` and, after the transport call, compares the words of the other members on its
host. The slow paths (a disagreement, a refusal, a member's report) are in
mpicomm._dispatch_checks; they run only when a check fails or a report word is set.

Where the compiled call path is built (mpicomm/_native), ``call`` is its C twin
(dispatch.c: the same steps on the same slots and words, handing new signatures, report
words and errors to the same methods: call_new, poisoned, raise_in_call); this Python
``call`` stays as ``py_call``. Both paths share one definition of each thing they must
agree on: the words' layout (the C path gets NATIVE_LAYOUT at install), the cache key
(``call_key``; dispatch.c's key_matches compares with it item by item), the steps before
the call (``publish``) and those after it (``finish_call``; dispatch.c's enter() and leave()
mirror them). The Python ``call`` has the key and both sets of steps written out, checked
statement for statement against those definitions; tests/test_callpath_parity.py checks
that and drives every branch through both paths.
"""
from __future__ import annotations

import time

from ._backends.base import NEVER, Prepared, _dropped as _DROPPED, complete_dropped
from ._callspec import plain_spec, spec_of
from ._dispatch_checks import AgreementPaths, _code
from ._ops import BARRIER, COLLECTIVES, NAMES, Sized
from ._reliability.agreement import HOST_MASK, HOST_N
from ._reliability.progress import (AT_CKPT, AT_DONE, AT_HIST, AT_POISON, AT_RAISED, CALLS_MASK, CALLS_N, CK_LEVELS,
                                   CK_MASK, CK_N, CK_SHIFT, CK_STEP, HMASK, HMUL, P2P, P2P_GH, P2P_TAG, calls_base,
                                   checkpoint, ghash, p2p_word)
from ._arrays import is_gpu_array, is_torch
from . import _native
from .errors import CollectiveMismatchError, CommunicationError, MpicommError, invalid

_now = time.perf_counter_ns


def mpi_error(e, name, seq, group):
    """The error for an MPI error ``e`` in collective ``name``: a truncated message means the
    ranks' calls differ (a rank received more than it made room for) -> CollectiveMismatchError."""
    from mpi4py import MPI

    where = f"{name} sequence {seq} on group {group!r}"
    try:
        truncated = e.Get_error_class() == MPI.ERR_TRUNCATE
    except Exception:
        truncated = False
    if truncated:
        return CollectiveMismatchError(
            f"{where}: MPI received a longer message than this rank's call makes room for ({e}): "
            "the ranks called different collectives or the same one with different sizes, dtypes "
            "or roots. Rerun with MPICOMM_DEBUG=1 to see every rank's call.")
    return CommunicationError(f"{where} failed in MPI: {e}")


KNOWN_CALLS = 256  # prepared calls kept per group (they hold no arrays: checks and a bound NCCL/MPI call)


def call_key(x, out, arg, stream, async_op):
    """The signature for which a prepared call is reused (its ``key``): the input's class,
    shape and dtype, the op or root, the stream, async or not, and the output's role (a new
    output; in place). AttributeError where ``x`` has no shape or dtype (prepared every time).

    This is the key's one definition: ``Dispatcher.call`` has it written out, and dispatch.c's
    key_matches compares a call with a key item by item in this order
    (tests/test_callpath_parity.py checks both)."""
    return (x.__class__, x.shape, x.dtype, arg, stream, async_op, out is None, out is x)


class _Watched:
    """The flight ring's entry of a watched call with a spec of its own (an object
    collective's root): what the reports and the flight record read of a prepared call."""

    __slots__ = ("spec", "sig", "arg", "shape", "dtype", "async_op")

    def __init__(self, spec, async_op):
        self.spec, self.sig, self.arg, self.async_op = spec, spec.sig, spec.root, async_op
        self.shape = self.dtype = None

    def describe(self):
        return self.spec.describe()


class Dispatcher(AgreementPaths):
    """Runs the collectives of one group: reuses prepared calls and publishes progress."""

    __slots__ = ("group", "transport", "last", "mem", "row", "seq", "watch", "fr", "fmask", "gh",
                 "p2p_n", "p2p_what", "p2p_ev", "batch", "known",
                 "check", "rel", "peers", "p1", "p1b", "p1j", "more", "shr", "shb", "slots", "raised", "resync",
                 "xhost", "cb", "fresh_at")

    def __init__(self, group, transport, mem, row, watch=None, rel=None, check=True, ring=None):
        self.group = group
        self.transport = transport     # the group's transport (or the debug wrapper around it)
        self.last = [NEVER] * (len(COLLECTIVES) + 1)   # collective code -> its last prepared call
        # every reusable prepared call by signature (up to KNOWN_CALLS, least recently used
        # out first): a loop over many shapes (one all_reduce per gradient, a reducer's
        # buckets) prepares each shape once, and one-off shapes do not push out the loop's
        self.known = {}
        self.mem = mem                 # this rank's progress words (int64 memoryview)
        self.row = row                 # index of the group's "entered" word; "done" follows it
        self.seq = 0                   # collectives issued on the group so far
        self.watch = watch             # the watchdog: a Work's timeout error, a departed peer
        self.fr = ring                 # the flight recorder's ring (a power of two long), or None
        self.fmask = len(self.fr) - 1 if self.fr is not None else 0
        self.batch = None              # the Works of an open mpicomm.batch() block, or None
        self.gh = ghash(group.name)    # the group's hash in the progress words
        self.p2p_n = 0                 # blocking send/recv calls so far (tells two equal ones apart)
        self.p2p_what = None           # (shape, dtype, peer, tag) of the send/recv in progress
        self.p2p_ev = None             # NCCL: (P2P word, CUDA event after it) until the GPU has done it
        # the agreement check (mpicomm._reliability.agreement)
        self.check = check and rel is not None
        self.rel = rel                 # the Reliability: progress window, host rings, resync
        self.peers = ()                # (ring segment, base, group rank) of the host neighbours
        self.p1 = self.p1b = self.p1j = None   # the first of them (read without a loop)
        self.more = ()                 # the others
        self.shr = None                # this rank's host-shared ring segment, or None
        self.shb = 0                   # its base for this group
        self.slots = None              # every member's row index in its progress window
        self.raised = 0                # the last sequence number a disagreement was raised for
        self.resync = False            # a fresh communicator is due at the next call (MPI)
        self.fresh_at = 0              # the call at whose start the fresh communicator is being made
        self.xhost = None              # (group rank, world rank, row) on the next host, compared
        #                                by the watchdog (this rank is its host's first member)
        self.cb = calls_base(row)      # the row's ring of calls (seq << 32 | signature at seq % CALLS_N)

    def call(self, code, x, out, arg, async_op, stream):
        """Run collective ``code`` on ``x``; ``arg`` is its op, root or (op, root).

        The common case written out: the group's last call of this collective had the same
        signature, so its prepared call runs again. Anything else takes ``call_new``. The key,
        the steps before the call and those after it are ``call_key``, ``publish`` and
        ``finish_call`` written out (a Python call costs about 4% of this path's time each);
        tests/test_callpath_parity.py checks that they are theirs, statement for statement."""
        p = self.last[code]
        try:
            k = (x.__class__, x.shape, x.dtype, arg, stream, async_op, out is None, out is x)   # call_key
        except AttributeError:   # no shape or dtype: prepared every time
            k = ()
        if k != p.key:
            return self.call_new(code, x, out, arg, async_op, stream)
        if _DROPPED:   # Works dropped unwaited complete first (their buffers are kept)
            complete_dropped()
        seq = self.seq = self.seq + 1
        v = seq << 4 | code
        m = self.mem
        b = self.row
        if m[b + AT_POISON]:     # a peer's report, or this rank's own resync due
            self.poisoned(seq, code, (x, out, arg, async_op, stream))
            if self.last[code] is not p:   # it made the group's fresh communicator: p is the old one's
                return self.run_new(seq, code, None, x, out, arg, async_op, stream)
        m[b] = v
        # publish, written out
        w = seq << 32 | p.sig
        m[self.cb + (seq & CALLS_MASK)] = w   # the ring of calls (mpicomm._reliability.progress)
        h = m[b + AT_HIST] = (m[b + AT_HIST] * HMUL ^ w) & HMASK   # the group's history
        if not seq & CK_MASK:
            checkpoint(m, b, seq, h)
        sh = self.shr
        if sh is not None:
            sh[self.shb + (seq & HOST_MASK)] = w
        fr = self.fr
        if fr is not None:
            fr[seq & self.fmask] = (seq, code, p, _now())
        try:
            r = p.run(x, out)
        except BaseException as e:  # the call is over on this rank: published as raised
            self.raise_in_call(seq, code, e)
        # finish_call, written out
        if async_op:
            r._group, r._seq = self.group, seq
            r._watch = self.watch
            m[b + AT_DONE] = v
        if m[b + AT_POISON]:
            self.poisoned_after(seq, code)
        if sh is not None:
            k = seq & HOST_MASK
            pw = self.p1[self.p1b + k]
            if pw != w and pw >> 32 == seq:
                self.differs(seq, code, self.p1j, pw)
            for pm, pb, j in self.more:
                pw = pm[pb + k]
                if pw != w and pw >> 32 == seq:
                    self.differs(seq, code, j, pw)
        m[b + AT_DONE] = v
        return r

    def call_new(self, code, x, out, arg, async_op, stream):
        """``call`` for a signature other than the last one of this collective: a prepared
        call kept from earlier (least recently used out first), else a new one from the
        transport, which validates the call; then run as ``call`` runs it."""
        key = None
        if arg.__class__ is not Sized:   # (sized calls are prepared every time)
            try:
                key = (code, call_key(x, out, arg, stream, async_op))
                if not self.known:
                    hash(key)
                p = self.known.pop(key, None)
            except (AttributeError, TypeError):   # no shape, or an unhashable argument (a shape
                #                                   type such as Paddle's; pop() on an empty dict
                #                                   does not hash, hence hash() there)
                key = p = None
            if p is not None:
                self.known[key] = p   # back in, as the most recently used
                self.last[code] = p
                return self.call(code, x, out, arg, async_op, stream)
        if _DROPPED:
            complete_dropped()
        seq = self.seq = self.seq + 1
        if self.mem[self.row + AT_POISON]:
            self.poisoned(seq, code, (x, out, arg, async_op, stream))
        return self.run_new(seq, code, key, x, out, arg, async_op, stream)

    def run_new(self, seq, code, key, x, out, arg, async_op, stream):
        """Call ``seq`` (numbered, a member's report before it taken in) prepared by the
        transport and run; kept for reuse under ``key`` (None: not kept). ``call`` hands its
        call here where taking in the report made the group's fresh communicator (the prepared
        call it had is the old communicator's; dispatch.c does the same)."""
        m, b = self.mem, self.row
        m[b] = seq << 4 | code
        try:
            # the entry stays the call in progress (the watchdog describes it); only
            # a reusable one is ever matched again
            p = self.last[code] = self.transport.prepare(code, x, out, arg, async_op, stream) \
                if arg.__class__ is not Sized else self.plain().prepare_sized(code, x, out, arg, async_op, stream)
            sp = p.spec = spec_of(code, x, out, arg, self.group.size, self.group.rank)
            if async_op:
                sp.started_async()
            p.sig = sp.sig
            if p.cls is not None:
                p.key = call_key(x, out, arg, stream, async_op)
                if key is not None:
                    known = self.known
                    if len(known) >= KNOWN_CALLS:
                        del known[next(iter(known))]   # the least recently used
                    known[key] = p
            w = self.publish(seq, code, p.sig, p)
            r = p.run(x, out)
        except BaseException as e:
            self.raise_in_call(seq, code, e)
        return self.finish_call(seq, code, w, r, async_op)

    def publish(self, seq, code, sig, p):
        """Publish call ``seq`` (collective ``code``, its signature ``sig``, prepared call ``p``
        or None) before it runs: its ring word (returned) in the row's ring of calls and the
        host-shared copy, the group's history (and its checkpoint), the flight recorder's
        entry. (``call`` has these steps written out; dispatch.c's enter() mirrors them.)"""
        m, b = self.mem, self.row
        w = seq << 32 | sig
        m[self.cb + (seq & CALLS_MASK)] = w   # the ring of calls (mpicomm._reliability.progress)
        h = m[b + AT_HIST] = (m[b + AT_HIST] * HMUL ^ w) & HMASK   # the group's history
        if not seq & CK_MASK:
            checkpoint(m, b, seq, h)
        sh = self.shr
        if sh is not None:
            sh[self.shb + (seq & HOST_MASK)] = w
        fr = self.fr
        if fr is not None:
            fr[seq & self.fmask] = (seq, code, p, _now())
        return w

    def finish_call(self, seq, code, w, r, async_op, reports=True):
        """After call ``seq`` (its ring word ``w``) returned ``r`` here, for every call path
        (``call``, ``call_new``, ``watched``; dispatch.c's leave() in the same order): an async
        call's Work described and the call published as done first, then a member's report
        that arrived during the call (not with ``reports`` False: a watched call leaves it to
        the group's next call), then the host neighbours' calls of ``seq`` compared, then the
        row's DONE word. (``call`` has these steps written out.)"""
        m, b, sh, v = self.mem, self.row, self.shr, seq << 4 | code
        if async_op:   # (first: a Work whose call raises below is left, not waited for, once dropped;
            r._group, r._seq = self.group, seq   # and the call is over here, started: a member
            r._watch = self.watch                # that refuses it does not stand in for this rank)
            m[b + AT_DONE] = v
        if reports and m[b + AT_POISON]:     # a peer's report arrived during the call
            self.poisoned_after(seq, code)
        if sh is not None:   # the host neighbours' calls of this sequence number
            k = seq & HOST_MASK
            pw = self.p1[self.p1b + k]   # (the first one unrolled: 2 ranks a host is common)
            if pw != w and pw >> 32 == seq:
                self.differs(seq, code, self.p1j, pw)
            for pm, pb, j in self.more:
                pw = pm[pb + k]
                if pw != w and pw >> 32 == seq:
                    self.differs(seq, code, j, pw)
        m[b + AT_DONE] = v
        return r

    def raise_in_call(self, seq, code, e):
        """Publish that call ``seq`` raised ``e`` on this rank, and raise: MPI's own error as
        the call's (a mismatch when MPI says the messages differ), an argument error as a
        refusal the other members see (with the agreement check)."""
        m, b = self.mem, self.row
        v = seq << 4 | code
        m[b + AT_RAISED] = v
        if type(e).__module__ == "mpi4py.MPI":   # MPI's own error: say which call it was
            m[b + AT_DONE] = v
            err = mpi_error(e, NAMES[code], seq, self.group.name)
            # (with the check on, told to the members whatever MPI's error class: a failed
            # nonblocking schedule says MPI_ERR_OTHER on some ranks where others say truncated,
            # and every member must take the same way out, the fresh communicator included)
            if self.check and self.group.size > 1 and seq > self.raised:
                other = self.differing_peer(seq)
                self.disagree(seq, code, other, err if other is None else None)
            self._raised_here(seq)
            raise err from e
        if self.check and isinstance(e, Exception) and not isinstance(e, CommunicationError) \
                and self.group.size > 1:
            self.refuse(seq, code, e, None)   # raises
        m[b + AT_DONE] = v
        self._raised_here(seq)
        raise e

    def differing_peer(self, seq):
        """The group rank of a host member whose word for call ``seq`` differs from this rank's
        (None: none there, or no host-shared copy of the words)."""
        if self.shr is None:
            return None
        w = self.mem[self.cb + (seq & CALLS_MASK)]
        k = seq & HOST_MASK
        return next((j for pm, pb, j in self.peers if pm[pb + k] != w and pm[pb + k] >> 32 == seq), None)

    def foreign_message(self, seq, code, e):
        """Object collective ``seq`` received bytes that are not an object's pickle (``e``, as
        pickle or mpi4py's pkl5 raised it): the ranks' calls differ. Told to the members as a
        disagreement, raised as CollectiveMismatchError."""
        err = CollectiveMismatchError(
            f"{NAMES.get(code, '?')} sequence {seq} on group {self.group.name!r}: the message this rank "
            f"received is not an object collective's ({type(e).__name__}: {e}): the ranks called different "
            "collectives (an object collective against an array one, or another root). Rerun with "
            "MPICOMM_DEBUG=1 to see every rank's call.")
        if self.check and self.group.size > 1 and seq > self.raised:
            other = self.differing_peer(seq)
            self.disagree(seq, code, other, err if other is None else None)   # raises
        self._raised_here(seq)
        raise err from e

    def raise_in_wait(self, seq, name, e):
        """Work.wait of async call ``seq`` met MPI's own error ``e``: raised as the call's, and
        told to the members as a disagreement where MPI says the messages differ (as
        ``raise_in_call`` does for a blocking call). ``name``: the collective's."""
        code = _code(name)
        err = mpi_error(e, name, seq, self.group.name)
        if seq > self.raised and self.check and self.group.size > 1:   # (any class: as raise_in_call)
            other = self.differing_peer(seq)
            try:
                self.disagree(seq, code, other, err if other is None else None)   # raises
            except CollectiveMismatchError as told:
                err = told
        self._raised_here(seq)
        raise err from e

    def report_in_wait(self, seq, name):
        """Work.wait's periodic check while async call ``seq`` is pending: a member's report
        about it (or an earlier call) is raised as the call returning would have raised it
        (the call will not complete: its reporter left it)."""
        if self.mem[self.row + AT_POISON] and seq == self.seq:
            self.poisoned_after(seq, _code(name), True)

    def describe(self, code):
        """'shape .., dtype ..' of the group's last call of collective ``code``."""
        if self.fresh_at == self.seq:
            return "before it: the group's fresh communicator, due after a disagreement (collective)"
        p = self.last[code]
        return p.describe() if p is not NEVER else "no array"

    def barrier(self, async_op):
        return self.watched(BARRIER, lambda: self.transport.barrier(async_op), async_op)

    def watched(self, code, fn, async_op=False, spec=None):
        """Run ``fn()``, a call that every rank of the group makes without arrays (a barrier,
        creating or destroying a group, an object collective), published and recorded like a
        collective; with ``async_op``, ``fn`` returns the call's Work. ``spec``: what every
        rank must agree on beyond ``code`` (an object collective's root), else nothing."""
        if _DROPPED:
            complete_dropped()
        seq = self.seq = self.seq + 1
        v = seq << 4 | code
        m, b = self.mem, self.row
        if m[b + AT_POISON]:
            self.poisoned(seq, code)
        m[b] = v
        if spec is None and async_op:   # (an async barrier: its spec says so, and the flight ring too)
            w = self.publish(seq, code, plain_spec(code, True).sig, _Watched(plain_spec(code, True), True))
        else:
            w = self.publish(seq, code, (spec or plain_spec(code)).sig,
                             None if spec is None else _Watched(spec, async_op))
        try:
            r = fn()
        except BaseException as e:
            m[b + AT_DONE] = v
            m[b + AT_RAISED] = v
            if type(e).__module__ == "mpi4py.MPI":   # MPI's own error (a truncated message: the
                self.raise_in_call(seq, code, e)      # calls differ), as for an array collective
            if spec is not None and isinstance(e, Exception) and not isinstance(e, MpicommError):
                # an object collective's message that does not unpickle (its objects were
                # pickled before the call, so the bytes are another call's): a disagreement
                self.foreign_message(seq, code, e)
            raise
        return self.finish_call(seq, code, w, r, async_op, False)

    def point_to_point(self, code, x, peer, tag, async_op, stream, recv=None):
        """send / recv: not numbered (only the two ranks take part), never reused.

        A blocking call is published in this rank's progress header (which call, the
        peer's world rank, the group and tag) while it runs, so that the watchdog names
        a peer that never comes; an async one carries the same facts in its Work, whose
        wait() reports with them."""
        if _DROPPED:
            complete_dropped()
        g = self.group
        wpeer = g.ranks[peer] if peer.__class__ is int and 0 <= peer < g.size else -1
        if async_op:
            r = self.transport.point_to_point(code, x, peer, tag, async_op, stream, recv)
            if r is not None and hasattr(r, "_what"):
                r._group, r._p2p = g, (code, wpeer, tag)
                r._watch = self.watch
            return r
        if wpeer < 0:   # the transport refuses it with the allowed range
            return self.transport.point_to_point(code, x, peer, tag, async_op, stream, recv)
        m = self.mem
        n = self.p2p_n = self.p2p_n + 1
        self.p2p_what = (getattr(x, "shape", None), getattr(x, "dtype", None), wpeer, tag)
        m[P2P_GH] = self.gh
        m[P2P_TAG] = tag if tag.__class__ is int else 0
        w = m[P2P] = p2p_word(n, code, wpeer)
        gpu = False
        try:
            r = self.transport.point_to_point(code, x, peer, tag, async_op, stream, recv)
            # NCCL enqueues and returns: the word stays up until the GPU has done the call
            # (the watchdog clears it when the event recorded here completes)
            gpu = hasattr(self.plain(), "nccl") and is_gpu_array(x) and _gpu_event(self, w, x, stream)
            return r
        finally:
            if not gpu:
                m[P2P] = 0

    def plain(self):
        """The transport without debug mode's wrapper. Calls with per-rank sizes (a Sized arg)
        are prepared by it: their shapes differ between ranks by design, and their signature
        is compared by the size exchange (mpicomm._collectives) instead."""
        t = self.transport
        return getattr(t, "inner", t)

    # ----------------------------------------------------------- mpicomm.batch()
    def batch_begin(self):
        """Open a batch: the group's calls start now and complete together at batch_end
        (one NCCL group; nonblocking MPI requests)."""
        if self.batch is not None:
            raise invalid("batch", f"a batch inside an open batch of group {self.group.name!r}",
                          "one mpicomm.batch() block per group at a time (batches do not nest)")
        self.batch = []
        self.plain().batch_begin()
        self.group.call = self.batch_call

    def coalesce_begin(self):
        """Open a coalesced block (mpicomm.batch(coalesce=True)): the calls until
        coalesce_end run as they come and are launched together (one NCCL group)."""
        self.plain().group_start()

    def coalesce_end(self):
        self.plain().group_end()

    def batch_call(self, code, x, out, arg, async_op, stream):
        """A collective inside a batch: started as async_op=True, its Work kept for batch_end."""
        r = self.call(code, x, out, arg, True, stream)
        self.batch.append(r)
        return r

    def batch_p2p(self, code, x, peer, tag, stream, recv=None):
        """A send / recv / sendrecv inside a batch (nonblocking; a send to oneself allowed)."""
        r = self.point_to_point(code, x, peer, tag, True, stream, recv)
        self.batch.append(r)
        return r

    def batch_end(self, wait=True):
        """Launch the batch (NCCL's groupEnd) and complete its calls; returns their Works."""
        works, self.batch = self.batch, None
        self.group.call = self.call
        self.plain().batch_end()
        if wait:
            for w in works:
                if w is not None and hasattr(w, "wait"):
                    w.wait()
        return works


# The words' layout the compiled call path writes, from the modules that define it
# (dispatch.c holds no copy of these numbers: install() refuses a missing one)
NATIVE_LAYOUT = {"AT_DONE": AT_DONE, "AT_POISON": AT_POISON, "AT_HIST": AT_HIST, "AT_CKPT": AT_CKPT,
                 "CALLS_N": CALLS_N, "HOST_N": HOST_N, "HMUL": HMUL, "HMASK": HMASK, "CK_LEVELS": CK_LEVELS,
                 "CK_N": CK_N, "CK_SHIFT": CK_SHIFT, "CK_STEP": CK_STEP}

Dispatcher.py_call = Dispatcher.call   # the Python call path, under a name that stays
if _native.callpath is not None:
    # the compiled call path (mpicomm/_native): ``call``'s common case in C, handing anything
    # else to the Python above
    Dispatcher.call = _native.callpath.install(Dispatcher, Prepared, _DROPPED, complete_dropped, NATIVE_LAYOUT)


def _gpu_event(d, word, x, stream):
    """Record a CUDA event on the stream of a GPU send/recv just enqueued; True when done."""
    try:
        import cupy

        if stream is None:
            if is_torch(x):
                import torch

                ptr = torch.cuda.current_stream(x.device).cuda_stream
            else:
                ptr = cupy.cuda.get_current_stream().ptr
        elif isinstance(stream, int):
            ptr = stream
        else:
            ptr = getattr(stream, "ptr", None) or stream.cuda_stream
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        cupy.cuda.runtime.eventRecord(ev.ptr, ptr)
    except Exception:   # not watched on the GPU: the word goes down as for a host call
        return False
    d.p2p_ev = (word, ev)
    return True
