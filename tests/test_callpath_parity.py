"""Both call paths, branch by branch, in one job: the compiled ``Dispatcher.call``
(mpicomm/_native/dispatch.c) and the Python ``Dispatcher.py_call`` it mirrors, each driven
through the public API (the world group's ``call`` is set to the path under test).

Every branch of the call: a new signature, a repeat (the prepared call reused), an async
call, a refusal (an argument error on one rank only), a disagreement (another dtype of the
same size on one rank), a member's report arriving before and during a call, and a Work
dropped unwaited. Each case checks what the call returns against NumPy, what every rank
raises, and the words the call publishes (ENTERED, DONE, RAISED, the ring word and its
host-shared copy) against the same words computed here; the second path's words are also
compared with the first's. Where a case needs one rank to go before another, the other
waits for its acknowledgement (a word it published), never for a length of time. Under
``MPICOMM_NATIVE=0`` the compiled cases are skipped and the Python ones run as the only path.

Without MPI: the compiled path's reuse decision (key_matches) against the Python key
(``call_key``), its refusal of an incomplete layout, and the Python ``call``'s written-out
key and steps against ``call_key``, ``publish`` and ``finish_call``.
"""
from __future__ import annotations

import ast
import gc
import inspect
import itertools
import textwrap
import time
import warnings

import numpy as np
import pytest

import mpicomm
from mpicomm import CollectiveMismatchError, InvalidArgumentError, ReduceOp
from mpicomm._backends import base
from mpicomm._callspec import REFUSED, spec_of
from mpicomm._dispatch import NATIVE_LAYOUT, Dispatcher, call_key
from mpicomm._ops import ALL_REDUCE
from mpicomm._reliability.agreement import HOST_MASK, read_row, ring_word
from mpicomm._reliability.progress import AT_DONE, AT_POISON, AT_RAISED, CALLS_MASK
from mpicomm.errors import RefusedElsewhereError
from mpicomm import _native
from test_collectives import data, reduce_np
from test_native import PATHS, need_compiled

@pytest.fixture(params=PATHS)
def path(request, comm):
    """The world group's calls go through ``request.param``'s path for the test."""
    from mpicomm._state import CTX

    g = CTX.world
    if request.param == "compiled":
        need_compiled()
    saved = g.call
    g.call = g.disp.call if request.param == "compiled" else Dispatcher.py_call.__get__(g.disp)
    yield request.param
    g.call = saved


@pytest.fixture
def multi(comm):
    """(size, rank, dispatcher) where a disagreement can be set up and found at the call:
    two ranks or more, the agreement check on, every member on this host (each compares its
    call with the others' as it returns)."""
    from mpicomm._state import CTX

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    if n < 2:
        pytest.skip("a disagreement needs two ranks")
    if CTX.debug or not CTX.check:
        pytest.skip("the agreement check is off (MPICOMM_CHECK=0) or debug mode compares first")
    d = CTX.world.disp
    if d.shr is None or len(d.peers) != n - 1:
        pytest.skip("the members are not all on this host (their calls are compared by the watchdog)")
    return n, r, d


def limit():
    """s: how long a rank waits for another's acknowledgement (the job's timeout, or 60)."""
    t = base.Work.default_timeout
    return t if t else 60.0


def expect(n, key, shape=(5,), dt=np.float64):
    """Every rank's rank-dependent random data for ``key`` (exact in ``dt``), and their sum
    computed here."""
    parts = [data(k, key, shape, dt) for k in range(n)]
    return parts, reduce_np(parts, ReduceOp.SUM)


def checked_sum(n, r, key):
    parts, want = expect(n, key)
    np.testing.assert_array_equal(mpicomm.all_reduce(parts[r]), want)


def after_disagreement(n, r, key, raised):
    """The calls after a disagreement (docs/RELIABILITY.md, "Agreement check"): a rank that
    returned from the call before the report came (``raised`` None) raises it at its next
    call, which it refuses, so the others may raise there too; the call after that returns
    the sum computed here on every rank. Returns the error this rank raised for it. (Both
    calls are made before anything is asserted: a check that fails on one rank leaves the
    ranks' counts of calls alike, so it fails this test alone, not the ones after it.)"""
    try:
        checked_sum(n, r, key + "1")
    except CollectiveMismatchError as e:
        raised = raised or str(e)
    checked_sum(n, r, key + "2")
    assert raised is not None, f"rank {r} returned from the disagreeing call and its next call did not raise"
    return raised


def guarded(fn, *args):
    """``fn(*args)``, or the AssertionError it raised (compared, and so shown, after the
    group's next calls)."""
    try:
        return fn(*args)
    except AssertionError as e:
        return e


def raised_by(fn, kind):
    """``fn()``'s error of class ``kind`` (asserted after the group's next calls, see
    after_disagreement), or an AssertionError naming what it did instead."""
    try:
        got = fn()
    except kind as e:
        return e
    return AssertionError(f"did not raise {kind.__name__} (returned {got!r})")


def wait_until(cond, what):
    """Poll ``cond()`` (an acknowledgement from another rank) until it holds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit(), f"no {what} within {limit():g} s"
        time.sleep(0.002)


def entered(d, j, seq):
    """True when group rank ``j`` has published its call ``seq`` (its ring word)."""
    wr = d.group.ranks[j]
    row = read_row(d.rel.progress, wr, d.slots[j])
    return row is not None and ring_word(row, seq)[1] in ("entered", "refused", "ahead")


def world():
    from mpicomm._state import CTX

    return CTX.world, CTX.world.disp


def words(d, seq, code=ALL_REDUCE):
    """What call ``seq`` left in this rank's progress row: (ENTERED is it, DONE is it, RAISED
    is it, its ring word's signature or 'refused'), after checking that the ring word is
    the call's and that the host-shared copy holds the same word."""
    m, b = d.mem, d.row
    v = seq << 4 | code
    w = int(m[d.cb + (seq & CALLS_MASK)])
    assert w >> 32 == seq, (w >> 32, seq)
    if d.shr is not None:
        assert d.shr[d.shb + (seq & HOST_MASK)] == w
    sig = w & 0xFFFFFFFF
    return m[b] == v, m[b + AT_DONE] == v, m[b + AT_RAISED] == v, "refused" if sig == REFUSED else sig


SEEN = {}   # (test, rank, what) -> the words the first path left (compared with the second's)


def same_on_both_paths(request, what, facts):
    """``facts`` of this path's run of the test, equal to the other path's where it ran first
    in this job (the compiled path runs first; under MPICOMM_NATIVE=0 there is nothing to
    compare with)."""
    params = tuple(sorted((k, v) for k, v in request.node.callspec.params.items() if k != "path"))
    k = (request.node.originalname, params, mpicomm.get_rank(), what)
    if k in SEEN:
        assert SEEN[k] == facts, f"{what}: {request.node.callspec.params['path']} path left {facts}, the other {SEEN[k]}"
    else:
        SEEN[k] = facts


def sig_of(x, op=ReduceOp.SUM, async_op=False):
    """The signature of all_reduce(x, op, async_op=async_op) on this rank, computed from its
    CallSpec (a host array's async call has its own: MPI matches it with no blocking call)."""
    sp = spec_of(ALL_REDUCE, x, None, op, mpicomm.get_group_size(), mpicomm.get_rank())
    if async_op:
        sp.started_async()
    return sp.sig


@pytest.mark.mpi
def test_new_repeat_and_async_calls(comm, path, request):
    """A new signature, its repeat (the same prepared call, new arrays), async calls (new, then
    repeated), another signature, then the first again (kept by signature): each result
    against NumPy, each call's number and words, an async call's Work described and the call
    published as done when it returns."""
    g, d = world()
    n, r = g.size, g.rank
    key = request.node.name
    k = 3 if path == "compiled" else 5   # (signatures that the other path's run did not leave)
    steps = [   # (shape, dtype, async, reused: the prepared call is the group's last one)
        ((k,), np.float32, False, False), ((k,), np.float32, False, True),
        ((k,), np.float32, True, False), ((k,), np.float32, True, True),
        ((2, k), np.int64, False, False), ((k,), np.float32, False, False)]
    checked_sum(n, r, key)   # (another signature first: the group's last call is not the first step's)
    facts = []
    for i, (shape, dt, a, reused) in enumerate(steps):
        parts, want = expect(n, f"{key}{i}", shape, dt)
        before, seq = d.last[ALL_REDUCE], d.seq + 1
        got = mpicomm.all_reduce(parts[r], async_op=a)
        assert d.seq == seq
        assert (d.last[ALL_REDUCE] is before) == reused, i
        if a:
            assert (got._group, got._seq, got._watch) == (g, seq, d.watch)
            f = words(d, seq)   # (done here once started: DONE)
            got = got.wait()
        else:
            f = words(d, seq)
        assert f == (True, True, False, sig_of(parts[r], async_op=a)), (i, f)
        assert d.last[ALL_REDUCE].sig == f[3]
        if d.fr is not None:
            assert d.fr[seq & d.fmask][:3] == (seq, ALL_REDUCE, d.last[ALL_REDUCE])
        np.testing.assert_array_equal(got, want)
        facts.append(f[:3])   # (the signatures differ: other shapes)
    same_on_both_paths(request, "words", facts)


@pytest.mark.mpi
def test_async_repeat_disagreement_leaves_no_work_behind(multi, path, request):
    """An async call of a reused signature that finds, as it returns, that a member called with
    another dtype (same size): it raises CollectiveMismatchError, and the Work it started is
    left (abandoned, never waited for), not taken for one the caller dropped and waited for
    at the next call (there it would wait for members that never started the call: a hang).

    The order, by acknowledgement: the rank with the other dtype (``bad``) starts first; the
    finder starts once ``bad``'s call is published, and finds it as its call returns; any
    other rank starts after the finder's report reached it, so it refuses the call without
    starting it. Every rank raises CollectiveMismatchError (``bad`` in wait(), or at its next
    call where its call had completed: its call was over before the report came), and the
    next all_reduce returns the sum computed here."""
    n, r, d = multi
    bad, finder = n - 1, 0
    key = request.node.name
    shape = (4,)
    # the signature of the call after the disagreement, prepared on the communicator that the
    # disagreement replaces (that call must run on the fresh one: a refusing member stands in
    # for it there)
    checked_sum(n, r, key + "0")
    for i in range(3):   # the signature prepared, then reused
        parts, want = expect(n, f"{key}{i}", shape, np.float32)
        np.testing.assert_array_equal(mpicomm.all_reduce(parts[r], async_op=True).wait(), want)
    base._warned.clear()
    seq = d.seq + 1
    x = data(r, key, shape, np.int32 if r == bad else np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        err = None
        if r == bad:
            w = mpicomm.all_reduce(x, async_op=True)
            try:
                w.wait()   # (completes where every rank started the call: the same bytes)
            except CollectiveMismatchError as e:
                err = str(e)
            del w
        else:
            if r == finder:
                wait_until(lambda: entered(d, bad, seq), f"call {seq} of rank {bad}")
            else:
                wait_until(lambda: d.mem[d.row + AT_POISON], "report of the finder")
            e = raised_by(lambda: mpicomm.all_reduce(x, async_op=True), CollectiveMismatchError)
            err = str(e) if isinstance(e, CollectiveMismatchError) else None
            f = guarded(words, d, seq)
        gc.collect()
        left = [wk.description for wk in base._dropped]   # waited for at the next call
        err = after_disagreement(n, r, key, err)
        if r != bad:
            assert isinstance(e, CollectiveMismatchError), e
            # the finder took part (its own signature, done, not raised before the call);
            # a later rank refused the call before taking part
            assert f == ((True, True, False, sig_of(x, async_op=True)) if r == finder else (True, True, True, "refused")), f
            same_on_both_paths(request, "words", f)
    assert d.seq >= seq
    assert "dtype" in err or "reported" in err or "refused" in err, err
    assert not left, f"the Work of a call that raised here is waited for at the next call: {left}"
    assert not [c for c in caught if base.DROPPED_WARNING in str(c.message)]


def prepared_with_out(n, r, key, bad=None):
    """all_reduce of a (4,) float32 with a given out=, twice (the second reuses the first's
    prepared call), checked; then this rank's arrays for the next call of the signature: on
    rank ``bad``, an out= that is not contiguous (refused by the prepared call's run)."""
    for i in range(2):
        parts, want = expect(n, f"{key}{i}", (4,), np.float32)
        o = np.empty(4, np.float32)
        assert mpicomm.all_reduce(parts[r], out=o) is o
        np.testing.assert_array_equal(o, want)
    x = data(r, key, (4,), np.float32)
    return x, (np.empty(8, np.float32)[::2] if r == bad else np.empty(4, np.float32))


def refuser(n, seed):
    return int(np.random.default_rng(seed).integers(n))


@pytest.mark.mpi
def test_refusal_on_one_rank(multi, path, request):
    """A reused signature whose out= one rank passes not contiguous: that rank raises its own
    InvalidArgumentError naming out=, every other one RefusedElsewhereError naming that rank
    (both InvalidArgumentError), all in the call; the refusing rank publishes the call as
    refused and raised; the next call is right everywhere."""
    n, r, d = multi
    bad = refuser(n, 1)
    x, o = prepared_with_out(n, r, request.node.name, bad)
    seq = d.seq + 1
    e = raised_by(lambda: mpicomm.all_reduce(x, out=o), InvalidArgumentError)
    f = guarded(words, d, seq)
    checked_sum(n, r, request.node.name + "after")
    assert isinstance(e, InvalidArgumentError), e
    if r == bad:
        assert not isinstance(e, RefusedElsewhereError) and "out" in str(e), e
        assert f == (True, True, True, "refused"), f
        same_on_both_paths(request, "words", f)
    else:
        assert isinstance(e, RefusedElsewhereError) and f"rank {bad} refused all_reduce" in str(e)
        assert f[1], f   # (taken part and stood in for, or refused on the report: as it came)


@pytest.mark.mpi
def test_disagreement_in_a_blocking_call(multi, path, request):
    """A reused float32 signature, one rank passing int32 of the same size: the call completes
    on every rank (MPI sees the same bytes), and every rank finds the other call as it returns
    (every member had published its call before any could complete): CollectiveMismatchError
    on every rank, naming the dtype; no wrong result leaves the call; the next all_reduce
    returns the sum computed here."""
    n, r, d = multi
    bad = refuser(n, 2)
    key = request.node.name
    for i in range(2):
        parts, want = expect(n, f"{key}{i}", (4,), np.float32)
        np.testing.assert_array_equal(mpicomm.all_reduce(parts[r]), want)
    x = data(r, key, (4,), np.int32 if r == bad else np.float32)
    seq = d.seq + 1
    e = raised_by(lambda: mpicomm.all_reduce(x), CollectiveMismatchError)
    f = guarded(words, d, seq)
    checked_sum(n, r, key + "after")
    assert isinstance(e, CollectiveMismatchError), e
    assert "dtype" in str(e) or "reported" in str(e), e
    assert f == (True, True, False, sig_of(x)), f
    same_on_both_paths(request, "words", f)


@pytest.mark.mpi
@pytest.mark.parametrize("when", ["before", "during"])
def test_report_arriving(multi, path, request, when):
    """A member's report about the call, arriving before this rank's call (it refuses the
    call without taking part) or while it is inside it (the refusing member stands in, the
    call completes, and the report is raised as the call returns): RefusedElsewhereError
    naming the refusing rank, the words of a refused or of a completed call; the next call
    is right everywhere. The order, by acknowledgement: the others call once the report is
    in their row ("before"), or the refusing rank refuses once every other one is inside
    the call ("during")."""
    n, r, d = multi
    bad = refuser(n, 3)
    x, o = prepared_with_out(n, r, request.node.name, bad)
    seq = d.seq + 1
    others = [j for j in range(n) if j != bad]
    if r == bad and when == "during":
        wait_until(lambda: all(entered(d, j, seq) for j in others), f"call {seq} of every other rank")
    if r != bad and when == "before":
        wait_until(lambda: d.mem[d.row + AT_POISON], f"report of rank {bad}")
    e = raised_by(lambda: mpicomm.all_reduce(x, out=o), InvalidArgumentError)
    f = guarded(words, d, seq)
    checked_sum(n, r, request.node.name + "after")
    assert isinstance(e, InvalidArgumentError), e
    if r == bad:
        assert "out" in str(e) and f == (True, True, True, "refused"), (e, f)
    else:
        assert isinstance(e, RefusedElsewhereError) and f"rank {bad} refused all_reduce" in str(e)
        assert f == ((True, True, True, "refused") if when == "before" else (True, True, False, sig_of(x))), f
    same_on_both_paths(request, "words", f)


@pytest.mark.mpi
def test_dropped_work(comm, path, request):
    """An async call's Work dropped unwaited on rank 0 before any other rank has started the
    call: kept, described (its group and number), and completed at rank 0's next call, its
    out= then holding the sum computed here; warned about once."""
    from mpi4py import MPI

    g, d = world()
    n, r = g.size, g.rank
    key = request.node.name
    for i in range(2):   # the signature prepared, then reused
        parts, want = expect(n, f"{key}{i}", (6,), np.float64)
        o = np.empty(6)
        np.testing.assert_array_equal(mpicomm.all_reduce(parts[r], out=o, async_op=True).wait(), want)
    parts, want = expect(n, key, (6,), np.float64)
    out = np.full(6, np.nan)
    seq = d.seq + 1
    base._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if r == 0:
            mpicomm.all_reduce(parts[r].copy(), out=out, async_op=True)   # dropped at once
            gc.collect()
            kept = [(w.description.group, w.description.seq) for w in base._dropped]
            assert kept == ([(g, seq)] if n > 1 else []), kept   # (alone, it completed at once)
        MPI.COMM_WORLD.Barrier()   # the user's own communicator: the others start after rank 0
        if r != 0:
            assert mpicomm.all_reduce(parts[r], out=out, async_op=True).wait() is out
        f = guarded(words, d, seq)
        checked_sum(n, r, key + "after")   # (rank 0: the dropped Work completes first)
        assert f == (True, True, False, sig_of(parts[r], async_op=True)), f
    assert not base._dropped
    np.testing.assert_array_equal(out, want)
    warned = [c for c in caught if base.DROPPED_WARNING in str(c.message)]
    assert len(warned) == (1 if r == 0 and n > 1 else 0), warned
    same_on_both_paths(request, "words", f)


# ------------------------------------------------------------------ the key, without MPI

class Sub(np.ndarray):
    pass


def test_compiled_key_matches_the_python_key():
    """dispatch.c's key_matches decides, for every variation of a call, as comparing
    ``call_key`` of the call with the prepared call's key decides (the Python path): the
    input's class, shape, dtype (of the same size too), the op or root, the stream, async or
    not, out= new, in place or given, and an input without shape or dtype."""
    if _native.callpath is None:
        need_compiled()
    km = _native.callpath.key_matches
    x = np.zeros((2, 3), np.float32)
    o = np.zeros((2, 3), np.float32)
    xs = [x, np.zeros((2, 3), np.float32), x.view(Sub), np.zeros((3, 2), np.float32), np.zeros(6, np.float32),
          np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float64), [1.0, 2.0]]
    args = [ReduceOp.SUM, ReduceOp.MAX, 0, 1, (ReduceOp.SUM, 0), (ReduceOp.SUM, 1), None]
    streams = [None, 0, 7]
    checked = 0
    for x0, a0, s0, as0, role0 in [(x, ReduceOp.SUM, None, False, "new"), (x, 1, 7, True, "same"),
                                   (x, (ReduceOp.SUM, 0), None, False, "given")]:
        key = call_key(x0, {"new": None, "same": x0, "given": o}[role0], a0, s0, as0)
        for xi, a, s, asy, role in itertools.product(xs, args, streams, (False, True), ("new", "same", "given")):
            out = {"new": None, "same": xi, "given": o}[role]
            try:
                py = call_key(xi, out, a, s, asy) == key
            except AttributeError:   # no shape: the Python path's key is () (prepared every time)
                py = () == key
            assert km(key, xi, out, a, asy, s) is py, (key, xi, out, a, s, asy)
            checked += py
    assert checked >= 3   # each key matched by its own call, at least
    assert km(key[:-1], x, None, ReduceOp.SUM, False, None) is False   # a key of another length


def _statements(f):
    """The AST of function ``f``'s body (its docstring left out)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(f))).body[0].body
    return body[1:] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body


class _AsWrittenOut(ast.NodeTransformer):
    """What call's copy of a step leaves out or names otherwise: watched's ``reports and``
    condition (finish_call), the prepared call's ``p.sig`` for the ``sig`` argument (publish)."""

    def visit_BoolOp(self, node):
        if isinstance(node.op, ast.And) and isinstance(node.values[0], ast.Name) and node.values[0].id == "reports":
            rest = node.values[1:]
            return self.visit(rest[0] if len(rest) == 1 else ast.BoolOp(ast.And(), rest))
        return self.generic_visit(node)

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == "p" and node.attr == "sig":
            return ast.Name("sig", ast.Load())
        return self.generic_visit(node)


def _dump(nodes):
    return [ast.dump(_AsWrittenOut().visit(n)) for n in nodes]


def test_python_call_writes_out_call_key_publish_and_finish_call():
    """Dispatcher.call (the Python path's hot path) has the cache key, the steps before the
    call and those after it written out, to save a Python call each: they must be call_key's
    expression, publish's statements and finish_call's statements (what finish_call and
    publish leave in their first line: the row's words, read by call earlier), so that the
    key and the order of the steps cannot drift between call, call_new and watched again."""
    call = _statements(Dispatcher.py_call)
    key = [n.value for n in ast.walk(ast.Module(call, [])) if isinstance(n, ast.Assign)
           and [ast.unparse(t) for t in n.targets] == ["k"] and isinstance(n.value, ast.Tuple) and n.value.elts]
    assert _dump(key) == _dump([_statements(call_key)[-1].value])
    dumped = _dump(call)
    pub = _dump(_statements(Dispatcher.publish)[1:-1])   # (between the first line and ``return w``)
    assert len(pub) > 5 and any(dumped[i:i + len(pub)] == pub for i in range(len(dumped))), \
        "Dispatcher.call does not have publish's statements written out"
    fin = _dump(_statements(Dispatcher.finish_call)[1:])
    assert len(fin) > 4 and dumped[-len(fin):] == fin, "Dispatcher.call does not end in finish_call's statements"


def test_install_takes_the_layout_from_python():
    """The compiled path gets the words' layout (ring sizes, offsets, the history's constants)
    from Python at install: a layout without one of them, or with a ring size that is not a
    power of two, is refused naming it (and changes nothing: the path in use stays)."""
    if _native.callpath is None:
        need_compiled()
    from mpicomm._backends.base import Prepared, _dropped, complete_dropped

    inst = _native.callpath.install
    for name in NATIVE_LAYOUT:
        lay = {k: v for k, v in NATIVE_LAYOUT.items() if k != name}
        with pytest.raises(KeyError, match=name):
            inst(Dispatcher, Prepared, _dropped, complete_dropped, lay)
    for name in ("CALLS_N", "HOST_N", "CK_N"):
        with pytest.raises(ValueError, match=f"{name}=.*power of two"):
            inst(Dispatcher, Prepared, _dropped, complete_dropped, dict(NATIVE_LAYOUT, **{name: 6}))
