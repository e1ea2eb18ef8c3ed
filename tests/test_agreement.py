"""The always-on agreement check: ranks that disagree on a call raise on every rank, with
each rank's call named, and the group goes on.

The contract these tests hold every case to (docs/RELIABILITY.md, "Agreement check"):
every rank raises in the disagreeing call or, where it had already returned before the
report came (a root whose broadcast was over), in its next call of the group (or the one after,
where the report came while it was in the next one); in each call after the disagreeing one,
every rank raises or none does; no rank returns a wrong result without raising; each rank
raises within seconds (_limit()); and the call after that returns correct results on every
rank (nothing of the failed call is left over).
Cases that end the job instead (a rank blocked in a call that cannot complete) are in
test_agreement_jobs.py.
"""
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpicomm
from mpicomm import CollectiveMismatchError, InvalidArgumentError, MpicommError
from mpicomm._timing import TIMING

pytestmark = pytest.mark.mpi

def _limit():
    """s within which each rank raises: room for a crowded 2-core machine, and half the
    watchdog's timeout at most, which is what a disagreement that no check found would wait
    for. A report reaches every rank within a few of the watchdog's wakes; the protocol's
    steps wait for each other's words (docs/RELIABILITY.md), and where a call cannot
    complete the watchdog ends the job TIMING.refusal_wait after its refusal is over."""
    longest = TIMING.spec_wait + TIMING.refusal_wait
    timeout = mpicomm._state.CTX.timeout
    return min(4 * longest, timeout / 2) if timeout else 4 * longest


def _attempt(fn):
    t0 = time.monotonic()
    try:
        return fn(), None, time.monotonic() - t0
    except MpicommError as e:
        return None, e, time.monotonic() - t0


def _verify(n, r, salt):
    """A fresh call with rank-dependent random data, checked against its sum computed here."""
    rng = [np.random.default_rng([salt, k]) for k in range(n)]
    parts = [g.standard_normal(5) for g in rng]
    got = mpicomm.all_reduce(parts[r])
    np.testing.assert_allclose(got, np.sum(parts, axis=0), rtol=1e-12)


def _run_case(n, r, case, salt, returns_ok=None):
    """``case()`` disagrees on some rank; then the contract above. ``returns_ok(result)``:
    where a rank may return normally (a root whose call was over before the report came, a
    non-root of reduce), a check of what it returned. Returns this rank's error."""
    res, err, took = _attempt(case)
    if err is None:
        assert returns_ok is not None and returns_ok(res), f"rank {r} returned {res!r} without raising"
    else:
        assert took < _limit(), (took, err)
        assert isinstance(err, (CollectiveMismatchError, InvalidArgumentError)), repr(err)
    # the next two calls: a rank that had returned raises the report in the first of them, or,
    # where it was inside that one when the report came, in the second; it refuses the call it
    # raises in, so that in each call every rank raises or none does. Where one succeeds, its
    # result is checked
    errs = []
    for i in (1, 2):
        _, e, t = _attempt(lambda: _verify(n, r, salt + i))
        if e is not None:
            assert t < _limit(), (t, e)
        errs.append(e)
    raised = MPI.COMM_WORLD.allgather(tuple(e is not None for e in errs))   # (the test's own exchange)
    for i in (0, 1):
        assert len({q[i] for q in raised}) == 1, f"call {i + 1} after the case raised on some ranks only: {raised}"
    if err is None:
        assert any(errs), f"rank {r} returned from the disagreeing call and neither of its next two calls raised"
    _verify(n, r, salt + 3)   # nothing of the failed calls is left over
    return err if err is not None else next(e for e in errs if e is not None)


def _other(n, seed):
    return int(np.random.default_rng(seed).integers(n))


@pytest.fixture
def multi(comm):
    n = mpicomm.get_group_size()
    if n < 2:
        pytest.skip("a disagreement needs two ranks")
    if mpicomm._state.CTX.debug or not mpicomm._state.CTX.check:
        pytest.skip("the agreement check is off (MPICOMM_CHECK=0) or debug mode compares first")
    return n, mpicomm.get_rank()


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "gather"])
def test_dtype_disagreement(multi, coll):
    """One rank passes int32 where the others pass float32 (same bytes: MPI would not
    notice): every rank raises, naming both calls and "dtype"."""
    n, r = multi
    bad = _other(n, 11)
    dt = np.int32 if r == bad else np.float32
    x = (np.random.default_rng(r).standard_normal(4 * n) * 10).astype(dt)
    calls = {"all_reduce": lambda: mpicomm.all_reduce(x),
             "all_gather": lambda: mpicomm.all_gather(x),
             "reduce_scatter": lambda: mpicomm.reduce_scatter(x),
             "reduce": lambda: mpicomm.reduce(x, root=(bad + 1) % n),
             "broadcast": lambda: mpicomm.broadcast(x, root=(bad + 1) % n),
             "gather": lambda: mpicomm.gather(x, root=(bad + 1) % n)}
    root = (bad + 1) % n
    keep = x.copy()

    # the root's data, computed here (the root is never the rank with the other dtype)
    sent = (np.random.default_rng(root).standard_normal(4 * n) * 10).astype(np.float32)

    def root_ok(res):   # a call that may be over before the report: its result must be right
        if coll == "broadcast":   # the root, or a rank that got the root's data from the root
            return r != bad and np.array_equal(res, sent) and (r != root or np.array_equal(res, keep))
        return coll in ("reduce", "gather") and r != root and res is None   # non-roots get None

    err = _run_case(n, r, calls[coll], 100, returns_ok=root_ok)
    assert "dtype" in str(err) or "refused" in str(err) or "reported" in str(err), err


def test_op_disagreement(multi):
    n, r = multi
    bad = _other(n, 12)
    x = np.random.default_rng(r).standard_normal(6)
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, op="max" if r == bad else "sum"), 200)
    assert "op" in str(err), err


def test_async_count_disagreement(multi):
    """async_op=True with another element count on one rank: every rank raises, in the call
    or in Work.wait (a rank waiting there for a call that its reporter left raises the report
    within seconds), and the next calls go on (the abandoned request is not waited for)."""
    n, r = multi
    bad = _other(n, 13)
    x = np.random.default_rng(r).standard_normal(5 if r == bad else 4).astype(np.float32)
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, async_op=True).wait(), 300)
    assert isinstance(err, CollectiveMismatchError), repr(err)
    assert "element count" in str(err) or "longer message" in str(err) or "a peer sent more" in str(err) \
        or "reported" in str(err) or "refused" in str(err), err


def test_read_only_buffer_on_one_rank(multi):
    """broadcast into a read-only array on one non-root rank: that rank raises its own
    InvalidArgumentError; the others raise CollectiveMismatchError naming it and why."""
    n, r = multi
    bad = 1 + _other(n - 1, 14)
    x = np.random.default_rng(r).standard_normal(4)
    if r == bad:
        x.flags.writeable = False
    sent = np.random.default_rng(0).standard_normal(4)
    err = _run_case(n, r, lambda: mpicomm.broadcast(x, root=0), 400,
                    returns_ok=lambda res: r != bad and np.array_equal(res, sent))
    if r == bad:
        assert isinstance(err, InvalidArgumentError) and "writable" in str(err), err
    else:
        assert f"rank {bad} refused broadcast" in str(err) and "writable" in str(err), err


def test_bad_op_on_one_rank(multi):
    """An op refused before the call reaches the dispatcher travels too."""
    n, r = multi
    bad = _other(n, 15)
    x = np.random.default_rng(r).standard_normal(5)
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, op="median" if r == bad else "sum"), 500)
    assert "median" in str(err), err
    assert isinstance(err, InvalidArgumentError), type(err)   # also for the others: the call was invalid



@pytest.mark.parametrize("case", ["bool_avg", "int16_avg"])
def test_avg_on_bool_or_int16_on_one_rank(multi, case):
    """One rank asks for AVG of bool (or int16) where the others SUM the same array: refused on
    that rank, and the others raise too (the call was invalid), naming the dtype's rule."""
    n, r = multi
    bad = _other(n, 16)
    dt = bool if case == "bool_avg" else np.int16
    x = np.random.default_rng(r).integers(0, 2, 6).astype(dt)
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, op="avg" if r == bad else "sum"), 700)
    assert "invalid op='avg'" in str(err) and ("dtype bool" in str(err) if dt is bool else "int16" in str(err)), err
    assert isinstance(err, InvalidArgumentError), type(err)

def test_non_array_root_of_scatter(multi):
    n, r = multi
    err = _run_case(n, r, lambda: mpicomm.scatter("rows" if r == 0 else None, root=0, out=np.empty((1, 3))), 600)
    assert "refused scatter" in str(err) or r == 0, err


def test_wrong_out_shape_on_one_rank(multi):
    n, r = multi
    bad = _other(n, 16)
    x = np.random.default_rng(r).standard_normal(8)
    out = np.empty(7 if r == bad else 8)
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, out=out), 700)
    assert "out" in str(err), err


def _sequence_of(err):
    """The sequence number a member's error names ('... sequence 12 on group ...')."""
    m = re.search(r"sequence (\d+) on group", str(err))
    assert m, err
    return int(m.group(1))


@pytest.mark.parametrize("times", [2, 3])
def test_refusals_in_a_row_each_named_on_the_others(multi, times):
    """One rank refuses ``times`` calls in a row (a wrong out shape, another each time) while the
    others make them correctly: each of the others' errors names its own call (the refusing
    rank's report of that call: its shape, and sequence numbers one apart), never the report of
    a later refusal that the refusing rank made before the others read the first."""
    n, r = multi
    bad = _other(n, 18)
    x = np.random.default_rng(r).standard_normal(6).astype(np.float32)
    shapes = [5 - i for i in range(times)]
    errs = []
    for s in shapes:
        _, e, took = _attempt(lambda: mpicomm.all_reduce(x, out=np.zeros(s, np.float32)) if r == bad
                              else mpicomm.all_reduce(x))
        assert e is not None and took < _limit(), (s, e)
        errs.append(e)
    for s, e in zip(shapes, errs):
        assert isinstance(e, InvalidArgumentError) and f"out.shape=({s},)" in str(e), (s, e)
        if r != bad:
            assert f"rank {bad} refused all_reduce sequence" in str(e), e
    if r != bad:
        seqs = [_sequence_of(e) for e in errs]
        assert seqs == list(range(seqs[0], seqs[0] + times)), [str(e) for e in errs]
        everyone = MPI.COMM_WORLD.allgather(seqs)   # (the test's own exchange)
    else:
        everyone = MPI.COMM_WORLD.allgather(None)
    assert len({tuple(q) for q in everyone if q is not None}) == 1, everyone
    _verify(n, r, 760 + times)


def test_refused_broadcast_then_all_reduce_each_named(multi):
    """The last rank refuses a broadcast (a read-only x) and then an in-place all_reduce (a
    read-only out): the members' errors in the broadcast name the broadcast and its reason, not
    the all_reduce's (a rank may have returned from the broadcast: it raises a report in its
    all_reduce)."""
    n, r = multi
    bad = n - 1
    x = np.random.default_rng(r).standard_normal(4)
    sent = np.random.default_rng(0).standard_normal(4)
    y = np.random.default_rng([r, 1]).standard_normal(3)
    if r == bad:
        x.flags.writeable = False
        y.flags.writeable = False
    res, e1, t1 = _attempt(lambda: mpicomm.broadcast(x, root=0))
    _, e2, t2 = _attempt(lambda: mpicomm.all_reduce(y, out=y))
    assert e2 is not None and t2 < _limit(), e2
    if e1 is None:   # a rank whose broadcast was over before the report came (its all_reduce
        # raises that report, or where the report of the all_reduce came first, that one)
        assert r != bad and np.array_equal(res, sent), (r, res)
        assert f"rank {bad} refused broadcast sequence" in str(e2) or f"rank {bad} refused all_reduce sequence" \
            in str(e2), e2
        assert "writable" in str(e2), e2
    else:
        assert t1 < _limit(), e1
        assert "writable" in str(e1) and "writable" in str(e2), (e1, e2)
        if r != bad:
            assert f"rank {bad} refused broadcast sequence" in str(e1), e1
            assert f"rank {bad} refused all_reduce sequence" in str(e2), e2
            assert _sequence_of(e2) in (_sequence_of(e1), _sequence_of(e1) + 1), (e1, e2)
    _verify(n, r, 790)


def test_refusal_against_a_barrier(multi):
    """One rank refuses a collective while the others wait in a barrier: it stands in for
    the barrier, every rank raises (the barrier's ranks in it or at their next call)."""
    n, r = multi
    bad = _other(n, 17)
    x = np.random.default_rng(r).standard_normal(3)

    def case():
        if r == bad:   # the others are in the barrier first
            time.sleep(0.3)
            return mpicomm.all_reduce(x, op="bogus")
        return mpicomm.barrier()

    err = _run_case(n, r, case, 750,
                    returns_ok=lambda res: r != bad and res is None)
    assert "bogus" in str(err), err


def test_refusal_in_a_group(multi):
    """The same in a group of every other rank: only its members take part."""
    n, r = multi
    if n < 3:
        pytest.skip("a group of two needs three ranks to leave one out")
    members = [0, 2] if n < 4 else [1, 3]
    name = "agree-sub"
    if r in members:
        mpicomm.create_group(name, members)
        k = mpicomm.get_rank(name)
        x = np.random.default_rng(r).standard_normal(4)
        res, err, took = _attempt(lambda: mpicomm.all_reduce(x, op="bogus" if k == 1 else "sum", group=name))
        assert err is not None and took < _limit(), (res, err)
        parts = [np.random.default_rng([9, m]).standard_normal(3) for m in members]
        np.testing.assert_allclose(mpicomm.all_reduce(parts[k], group=name), np.sum(parts, axis=0), rtol=1e-12)
        mpicomm.destroy_group(name)
    mpicomm.barrier()
    _verify(n, r, 800)


FIELDS = ("dtype", "op", "refuse_op", "refuse_out")
COLLS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "all_to_all")


def test_randomized_disagreements(multi):
    """A fixed-seed random walk over collectives, dtypes, sizes and the field one random rank
    gets wrong (or the argument it refuses): every case holds the contract."""
    n, r = multi
    rng = np.random.default_rng(2026)   # the same choices on every rank
    cases = 200 if n <= 2 else 120
    for c in range(cases):
        coll = COLLS[rng.integers(len(COLLS))]
        field = FIELDS[rng.integers(len(FIELDS))]
        if field == "op" and coll not in ("all_reduce", "reduce_scatter", "reduce"):
            field = "dtype"
        bad = int(rng.integers(n))
        k = int(rng.integers(1, 9))
        dt = (np.float32, np.float64)[rng.integers(2)]
        odd = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}[np.dtype(dt)]
        mine = odd if (field == "dtype" and r == bad) else dt
        x = (np.random.default_rng([c, r]).standard_normal(k * n) * 100).astype(mine)
        op = "max" if (field == "op" and r == bad) else "sum"
        if field == "refuse_op" and r == bad:
            op = "bogus"
        root = (bad + 1) % n
        out = None
        if field == "refuse_out" and r == bad and coll != "broadcast":
            out = np.empty(k * n + 1, mine)
        ro = field == "refuse_out" and r == bad and coll == "broadcast"
        if ro:
            x.flags.writeable = False
        call = {"all_reduce": lambda: mpicomm.all_reduce(x, op=op, out=out),
                "all_gather": lambda: mpicomm.all_gather(x, out=out),
                "reduce_scatter": lambda: mpicomm.reduce_scatter(x, op=op, out=out),
                "reduce": lambda: mpicomm.reduce(x, op=op, root=root, out=out),
                "broadcast": lambda: mpicomm.broadcast(x, root=root),
                "all_to_all": lambda: mpicomm.all_to_all(x, out=out)}[coll]
        if field in ("refuse_op", "op") and coll in ("all_gather", "broadcast", "all_to_all"):
            continue   # no op there: the case would agree

        sent = (np.random.default_rng([c, root]).standard_normal(k * n) * 100).astype(dt)

        def ok(res, coll=coll, root=root, sent=sent):
            if coll == "broadcast":   # the root's data, on the root or a rank it reached first
                return np.array_equal(res, sent)
            if coll == "reduce":
                return r != root and res is None
            return False

        _run_case(n, r, call, 1000 + 10 * c, returns_ok=ok)


@pytest.mark.parametrize("coll", ["reduce", "gather"])
def test_late_root_stands_in_after_the_members_went_on(multi, coll):
    """One rank passes op max (reduce) or another dtype of the same size (gather); the root
    comes to the call late. The other ranks' sends complete without it, they find the
    difference, raise, and wait in their next call, whose description their watchdogs publish.
    The root then refuses the call, and stands in for it from a member's description of it,
    which each rank keeps while it describes the call it waits in next (the decision on a
    fresh communicator then agrees with the reporters': none). Every rank raises, and the
    next call returns correct sums on the same communicator. (Was: the root found only the
    descriptions of the next call, could not stand in, and decided on a fresh communicator
    alone; the watchdog ended the job.)"""
    n, r = multi
    root = n - 1
    dt = np.int64 if (coll == "gather" and r == 0) else np.float64
    x = (np.random.default_rng([31, r]).standard_normal(3) * 100).astype(dt)

    def case():
        if r == root:   # the members raise and wait in their next call, described (a few wakes)
            time.sleep(1.0 + 4 * TIMING.watch_every)
        if coll == "reduce":
            return mpicomm.reduce(x, op="max" if r == 0 else "sum", root=root)
        return mpicomm.gather(x, root=root)

    err = _run_case(n, r, case, 700, returns_ok=lambda res: r != root and res is None)
    assert ("op" if coll == "reduce" else "dtype") in str(err) or "reported" in str(err), err


def test_refused_on_every_rank_many_times(multi):
    """The same bad argument on every rank, refused 1,500 times in a row (each rank raises
    its own error, some while a member's report of the same call is landing): the ranks'
    counts of calls stay alike, so the checked calls between them return correct sums."""
    n, r = multi
    x = np.ones((1, 2), np.float32)
    calls = (lambda: mpicomm.all_gather(x, sizes=3), lambda: mpicomm.gather(x, sizes="even"),
             lambda: mpicomm.all_to_all(x, in_splits=[1] * n, out_splits=[-1] * n))
    for i in range(1500):
        with pytest.raises(InvalidArgumentError, match="sizes|splits"):
            calls[i % 3]()
        if i % 50 == 49:
            _verify(n, r, 5000 + i)


@pytest.mark.parametrize("async_op", [True, False])
def test_repeated_disagreements_then_calls_of_known_shapes(multi, async_op):
    """Disagreements caught over and over (the rank that differs rotates: another element count
    for async calls, another dtype of the same size for blocking ones, which complete at any rank
    count), each followed by calls of shapes the group has made before: where the group makes a
    fresh communicator, the calls after it run on it, never on a prepared call of the old one
    (whose abandoned requests would swallow or truncate their messages); an async call that
    differed never returns its result from Work.wait without raising."""
    n, r = multi

    def case(k):
        rng = np.random.default_rng([r, k])
        if async_op:
            return mpicomm.all_reduce(rng.standard_normal(5 if r == k % n else 4).astype(np.float32),
                                      async_op=True).wait()
        return mpicomm.all_reduce((rng.standard_normal(4) * 100).astype(np.int32 if r == k % n else np.float32))

    for k in range(3 * n):
        err = _run_case(n, r, lambda: case(k), 7000 + 10 * k)
        assert isinstance(err, CollectiveMismatchError), (k, err)
        for j in range(3):   # shapes made before: prepared calls kept from earlier iterations
            parts = [np.random.default_rng([q, k, j]).standard_normal(7) for q in range(n)]
            got = mpicomm.all_reduce(parts[r], async_op=async_op)
            got = got.wait() if async_op else got
            np.testing.assert_allclose(got, np.sum(parts, axis=0), rtol=1e-12)
