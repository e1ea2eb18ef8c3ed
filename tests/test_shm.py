"""The single-host shared-memory path of the MPI backend (mpicomm/_backends/shm.py).

Most tests lower the thresholds to a few hundred bytes and the piece to 4 KiB (on the
group's MPI transport, alike on every rank), so that small arrays take the path, in several
pieces; expectations are computed with NumPy from every rank's data, and results are
also compared with the ordinary (Open MPI) path. At 1 rank the path is never taken and
the same calls check the ordinary path.
"""
import hashlib

import ml_dtypes
import numpy as np
import pytest

import mpicomm
from mpicomm import ReduceOp
from mpicomm._backends import shm as _shm
from mpicomm._backends import shm_config as _cfg
from mpicomm.errors import InvalidArgumentError
from conftest import shm_groups
from conftest import shm_of as impl
from test_collectives import allowed, data, reduce_np  # one source of test data and expectations

pytestmark = pytest.mark.mpi

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, BF16,
          np.float32, np.float64, np.complex64, np.complex128]
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
THRESHOLD = 512      # bytes, in these tests
PIECE = 4096         # bytes of a segment buffer, in these tests: many pieces per call


def assert_close(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if a.dtype.kind in "iu":
        np.testing.assert_array_equal(a, b)
    else:
        tol = 1e-2 if a.dtype.itemsize == 2 else 1e-6
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        np.testing.assert_allclose(a.astype(wide), b.astype(wide), rtol=tol, atol=tol)


def digest(a):
    return hashlib.sha1(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def same_on_every_rank(group, a):
    g = mpicomm._state.CTX.world if group is None else mpicomm._state.CTX.groups[group]
    d = g.mpi_comm.allgather(digest(a))
    assert len(set(d)) == 1, d


def calls(group, name):
    s = impl(group).group
    return 0 if s is None else s.calls[name]


@pytest.fixture(scope="module")
def groups(comm):
    """The world and a reversed sub-group (None for ranks outside it), small thresholds."""
    yield from shm_groups("shm_rev", THRESHOLD)


def small_pieces(group):
    """Open the group's window if the path is available, and make pieces small."""
    m = impl(group)
    if m.size > 1 and m.group is None:
        m.open()
    if m.group is not None:
        m.group.set_piece(PIECE)
    return m


def expect_path(group, name, before, taken=True):
    if impl(group).size > 1:
        assert (calls(group, name) > before) == taken, (name, calls(group, name), before)


def rank_data(group, key, shape, dt, op=ReduceOp.SUM):
    """(this rank's array, every rank's arrays), keyed by world rank."""
    world = mpicomm._state.get_group(group).ranks
    arrs = [np.asarray(data(w, key, shape, dt, op)) for w in world]
    return arrs[mpicomm.get_rank(group)].copy(), arrs


# --------------------------------------------------------------------------- all_reduce

SHAPES = [(7,), (1000,), (3001,), (33, 65)]   # below and above THRESHOLD; uneven; many pieces


@pytest.mark.parametrize("dt,op", [(d, o) for o in OPS for d in DTYPES if allowed(o, d)],
                         ids=lambda v: np.dtype(v).name if not isinstance(v, ReduceOp) else str(v))
def test_all_reduce_matches_numpy(groups, dt, op):
    for group in groups:
        small_pieces(group)
        for shape in SHAPES:
            x, arrs = rank_data(group, f"ar{shape}{op}", shape, dt, op)
            before = calls(group, "all_reduce")
            y = mpicomm.all_reduce(x, op, group=group)
            expect_path(group, "all_reduce", before, x.nbytes >= THRESHOLD)
            assert_close(y, reduce_np(arrs, op))
            if np.dtype(dt).kind not in "iu":
                same_on_every_rank(group, y)


@pytest.mark.parametrize("dt", [np.int32, np.uint8, np.float32, BF16, np.complex64], ids=lambda d: np.dtype(d).name)
def test_all_reduce_same_as_ordinary_path(groups, dt):
    """Integers: identical to Open MPI's result; floats: at 2 ranks too (a+b == b+a),
    and bit-identical from call to call."""
    for group in groups:
        m = small_pieces(group)
        x, _ = rank_data(group, "ord", (5000,), dt)
        y = mpicomm.all_reduce(x, group=group)
        y2 = mpicomm.all_reduce(x, group=group)
        assert digest(y) == digest(y2)
        m.disable()
        try:
            before = calls(group, "all_reduce")
            z = mpicomm.all_reduce(x, group=group)
            assert calls(group, "all_reduce") == before
        finally:
            m.configure({"MPICOMM_SHM_THRESHOLD": str(THRESHOLD)})
        if np.dtype(dt).kind in "iu" or m.size <= 2:
            np.testing.assert_array_equal(y, z)
        else:
            assert_close(y, z)


def test_all_reduce_in_place_and_out(groups):
    for group in groups:
        small_pieces(group)
        x, arrs = rank_data(group, "inplace", (2, 3001), np.float64)
        want = reduce_np(arrs, ReduceOp.SUM)
        before = calls(group, "all_reduce")
        r = mpicomm.all_reduce(x, out=x, group=group)
        assert r is x
        assert_close(x, want)
        o = np.empty_like(x)
        x2, _ = rank_data(group, "inplace", (2, 3001), np.float64)
        assert mpicomm.all_reduce(x2, ReduceOp.MAX, out=o, group=group) is o
        assert_close(o, reduce_np(arrs, ReduceOp.MAX))
        expect_path(group, "all_reduce", before + 1)


def test_all_reduce_non_contiguous_input(groups):
    for group in groups:
        small_pieces(group)
        x, arrs = rank_data(group, "strided", (400, 6), np.int32)
        y = mpicomm.all_reduce(x[:, ::2], group=group)
        assert_close(y, reduce_np([a[:, ::2] for a in arrs], ReduceOp.SUM))


@pytest.mark.parametrize("count", [1, 2, 3, 5, 129, 1021, 4097])
def test_uneven_counts(groups, count):
    """Counts that do not divide by the group size or the alignment (some ranks get an
    empty chunk at small counts)."""
    _shm_all = {"MPICOMM_SHM_THRESHOLD": "1"}
    for group in groups:
        m = small_pieces(group)
        m.configure(_shm_all)
        try:
            x, arrs = rank_data(group, f"uneven{count}", (count,), np.int64)
            before = calls(group, "all_reduce")
            assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
            expect_path(group, "all_reduce", before)
            g = mpicomm.all_gather(x, group=group)
            assert_close(g, np.concatenate(arrs))
            b = x.copy()
            mpicomm.broadcast(b, root=m.size - 1, group=group)
            assert_close(b, arrs[-1])
            xs, arrs = rank_data(group, f"unevenrs{count}", (count * m.size,), np.int64)
            assert_close(mpicomm.reduce_scatter(xs, group=group),
                         reduce_np(arrs, ReduceOp.SUM)[m.rank * count:(m.rank + 1) * count])
        finally:
            m.configure({"MPICOMM_SHM_THRESHOLD": str(THRESHOLD)})


# --------------------------------------------------------------------------- the others

@pytest.mark.parametrize("dt,op", [(d, o) for o in OPS for d in DTYPES if allowed(o, d)],
                         ids=lambda v: np.dtype(v).name if not isinstance(v, ReduceOp) else str(v))
def test_reduce_scatter_matches_numpy(groups, dt, op):
    for group in groups:
        m = small_pieces(group)
        n = m.size
        for rows in (1, 250, 1501):
            x, arrs = rank_data(group, f"rs{rows}{op}", (rows * n, 2), dt, op)
            before = calls(group, "reduce_scatter")
            y = mpicomm.reduce_scatter(x, op, group=group)
            expect_path(group, "reduce_scatter", before, x.nbytes >= THRESHOLD)
            assert_close(y, reduce_np(arrs, op)[m.rank * rows:(m.rank + 1) * rows])


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_gather_and_broadcast_match_numpy(groups, dt):
    for group in groups:
        m = small_pieces(group)
        for shape in [(3,), (700, 3), (5000,)]:
            x, arrs = rank_data(group, f"ag{shape}", shape, dt)
            before = calls(group, "all_gather")
            y = mpicomm.all_gather(x, group=group)
            expect_path(group, "all_gather", before, y.nbytes >= THRESHOLD)
            assert_close(y, np.concatenate(arrs))
            for root in sorted({0, m.size - 1}):
                b = x.copy()
                before = calls(group, "broadcast")
                assert mpicomm.broadcast(b, root=root, group=group) is b
                expect_path(group, "broadcast", before, b.nbytes >= THRESHOLD)
                assert_close(b, arrs[root])


def test_scalar_all_gather(groups):
    for group in groups:
        small_pieces(group)
        impl(group).configure({"MPICOMM_SHM_THRESHOLD": "1"})
        try:
            x, arrs = rank_data(group, "scalar", (), np.float64)
            assert_close(mpicomm.all_gather(x, group=group), np.stack(arrs))
            assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
        finally:
            impl(group).configure({"MPICOMM_SHM_THRESHOLD": str(THRESHOLD)})


# --------------------------------------------------------------------------- async, mixing

def test_async_and_interleaved(groups):
    """Async collectives take MPI's non-blocking path (MPI progresses them inside any other
    MPI call, so waits in any order cannot deadlock); mixed with small collectives and
    blocking shared-memory ones, every result is right."""
    for group in groups:
        m = small_pieces(group)
        n = m.size
        a, arrs_a = rank_data(group, "async_a", (6001,), np.float32)
        b, arrs_b = rank_data(group, "async_b", (3000 * n,), np.int32)
        c, arrs_c = rank_data(group, "async_c", (2001,), np.int64)
        s, arrs_s = rank_data(group, "async_s", (3,), np.int64)
        before = calls(group, "all_reduce")
        w1 = mpicomm.all_reduce(a, async_op=True, group=group)
        w2 = mpicomm.reduce_scatter(b, ReduceOp.MAX, async_op=True, group=group)
        small = mpicomm.all_reduce(s, group=group)            # ordinary path in between
        w3 = mpicomm.all_gather(c, async_op=True, group=group)
        d = c.copy()
        w4 = mpicomm.broadcast(d, root=n - 1, async_op=True, group=group)
        w3.is_completed()
        blocking = mpicomm.all_reduce(c, ReduceOp.MIN, group=group)
        assert_close(w4.wait(), arrs_c[-1])
        assert_close(w2.wait(), reduce_np(arrs_b, ReduceOp.MAX)[m.rank * 3000:(m.rank + 1) * 3000])
        assert_close(w1.wait(), reduce_np(arrs_a, ReduceOp.SUM))
        assert_close(w3.wait(), np.concatenate(arrs_c))
        assert w1.is_completed() and w3.is_completed()
        assert_close(small, reduce_np(arrs_s, ReduceOp.SUM))
        assert_close(blocking, reduce_np(arrs_c, ReduceOp.MIN))
        if impl(group).size > 1:  # only the blocking all_reduce took the path
            assert calls(group, "all_reduce") == before + (impl(group).group is not None)


def test_async_polling_completes(groups):
    for group in groups:
        small_pieces(group)
        x, arrs = rank_data(group, "poll", (9000,), np.float64)
        w = mpicomm.all_reduce(x, ReduceOp.AVG, async_op=True, group=group)
        for _ in range(10_000_000):
            if w.is_completed():
                break
        assert_close(w.wait(), reduce_np(arrs, ReduceOp.AVG))


# --------------------------------------------------------------------------- the window

def test_window_grows_and_results_stay_right(groups):
    for group in groups:
        m = small_pieces(group)
        if m.group is None:
            continue
        g = m.group
        g.set_piece(1 << 30)                 # one piece per message: the window must grow
        try:
            grows = g.grows
            held = g.seg // 4   # int32 elements the window holds now (earlier tests may have grown it)
            for count in (20_000, held + 30_000, held + 100_000, 20_000, held + 100_000):
                x, arrs = rank_data(group, f"grow{count}", (count,), np.int32)
                assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
                y = mpicomm.all_gather(x, group=group)
                assert_close(y, np.concatenate(arrs))
            assert g.grows > grows
            assert g.seg >= (held + 100_000) * 4
        finally:
            g.set_piece(PIECE)


def test_both_ways_of_waiting(groups):
    """The spinning Barrier and the yielding Ibarrier (ranks outnumbering cores) give the
    same results, for every collective, with many pieces."""
    for group in groups:
        m = small_pieces(group)
        if m.group is None:
            continue
        g = m.group
        crowded = g.crowded
        try:
            for mode in (not crowded, crowded):
                g.crowded = mode             # the same on every rank, as open() decides it
                x, arrs = rank_data(group, f"wait{mode}", (3000,), np.int32)
                before = calls(group, "all_reduce")
                assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
                expect_path(group, "all_reduce", before)
                n = m.size
                y = mpicomm.reduce_scatter(x[:3000 // n * n], group=group)
                k = 3000 // n
                r = mpicomm.get_rank(group)
                assert_close(y, reduce_np([a[:k * n] for a in arrs], ReduceOp.SUM)[r * k:(r + 1) * k])
        finally:
            g.crowded = crowded


def test_piece_tuner_agrees_and_keeps_results(groups):
    """all_reduce's piece tuner (cores enough for the ranks): every rank uses the same
    piece at every call, results stay exact whichever piece runs, and both are tried."""
    for group in groups:
        m = small_pieces(group)
        if m.group is None:
            continue
        g = m.group
        try:
            g.cands, g.piece = (PIECE, 4 * PIECE), PIECE
            tc, used = g.tc, set()
            for i in range(8 * _shm.EXPLORE + 4):
                used.add(g.piece)
                x, arrs = rank_data(group, f"tune{i % 3}", (20_000 + 1000 * (i % 3),), np.int32)
                assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
                pieces = g.comm.allgather(g.piece)
                assert len(set(pieces)) == 1 and pieces[0] in g.cands, pieces
            assert g.tc == tc + 8 * _shm.EXPLORE + 4
            assert used == set(g.cands)
            # a message of one small piece is tuned only where Open MPI is a choice
            # (integers, or two ranks): float32 at 3 ranks or more is not
            x, arrs = rank_data(group, "tune-small", (300,), np.float32)  # above THRESHOLD, one piece
            assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
            assert g.tc == tc + 8 * _shm.EXPLORE + 4 + (1 if g.size == 2 else 0)
        finally:
            g.set_piece(PIECE)


@pytest.mark.parametrize("dt", [np.int32, np.float64])
@pytest.mark.parametrize("inplace", [False, True])
def test_tuner_may_choose_open_mpi_where_results_are_the_same(groups, dt, inplace):
    """The tuner's third choice, Open MPI's own all_reduce, is offered only where its
    result has the same bits as the shared-memory path's (integers, or two ranks); every
    rank makes the same choice at every call, and the results do not depend on it."""
    for group in groups:
        m = small_pieces(group)
        if m.group is None:
            continue
        g = m.group
        n = g.size
        allowed = np.dtype(dt).kind in "iu" or n == 2
        try:
            g.cands, g.piece = (PIECE, 4 * PIECE), PIECE
            seen, first = set(), None
            for i in range(6 * _shm.EXPLORE):
                x, arrs = rank_data(group, f"ord{i % 2}", (9_000,), dt)
                want = reduce_np(arrs, ReduceOp.SUM)
                before = g.ordinary
                seen.add(before)
                y = mpicomm.all_reduce(x, out=x if inplace else None, group=group)
                if dt is np.float64:  # bit-identical whichever path ran: compare with call 0's
                    if i % 2 == 0:
                        first = y.copy() if first is None else first
                        np.testing.assert_array_equal(y, first)
                    np.testing.assert_allclose(y, want, rtol=1e-12)
                else:
                    np.testing.assert_array_equal(y, want)
                assert len(set(g.comm.allgather((g.ordinary, g.piece)))) == 1
            assert seen == ({False, True} if allowed else {False}), seen
        finally:
            g.set_piece(PIECE)


def test_real_threshold(groups):
    """With the default thresholds: just below stays on Open MPI, just above takes the path."""
    for group in groups:
        m = impl(group)
        if m.size > 1:
            m.open()                         # open: crowded or not is known from here on
        m.configure({})
        try:
            t = m.min_all_reduce
            if m.size == 1:
                assert t == _cfg.NEVER
                continue
            if m.group is not None and m.group.crowded:
                assert t == _cfg.CROWDED_THRESHOLD
            else:
                assert t == _cfg.DEFAULT_THRESHOLD["all_reduce"]
            for count, taken in ((t // 4 - 16, False), (t // 4 + 16, True)):
                x, arrs = rank_data(group, f"real{count}", (count,), np.float32)
                before = calls(group, "all_reduce")
                assert_close(mpicomm.all_reduce(x, group=group), reduce_np(arrs, ReduceOp.SUM))
                expect_path(group, "all_reduce", before, taken)
        finally:
            m.configure({"MPICOMM_SHM_THRESHOLD": str(THRESHOLD)})


def test_single_rank_never_takes_the_path(comm):
    if mpicomm.get_group_size() != 1:
        pytest.skip("needs a group of one rank: at 1 rank")
    m = impl()
    assert m.min_all_reduce == _cfg.NEVER and m.group is None


class _SplitAsIfOnOtherHosts:
    """A communicator whose shared-memory split gives every rank a node of its own, as
    ``Split_type(COMM_TYPE_SHARED)`` does for ranks on different hosts. Everything else
    is the real communicator. (The real cross-host case is tests/test_two_host.py.)"""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Split_type(self, split_type, key=0, info=None):
        return self._comm.Split(self._comm.Get_rank(), key)


def test_group_across_hosts_is_unavailable(comm):
    """The decision rule: unless every rank's shared-memory node is the whole group,
    ShmGroup.open says no (on every rank), and the collectives take the ordinary path."""
    from mpicomm._backends.mpi import MPITransport

    world = mpicomm._state.CTX.world.mpi_comm
    if world.Get_size() == 1:
        pytest.skip("one rank is always on one host")
    dup = world.Dup()
    try:
        assert _shm.ShmGroup.open(_SplitAsIfOnOtherHosts(dup)) is None
        mc = MPITransport(_SplitAsIfOnOtherHosts(dup))
        mc.shm.configure({"MPICOMM_SHM_THRESHOLD": "1"})
        x = data(mpicomm.get_rank(), "hosts", (1000,), np.int32)
        from mpicomm._ops import ALL_REDUCE

        y = mc.prepare(ALL_REDUCE, x, None, ReduceOp.SUM, False, None).run(x, None)
        assert mc.shm.group is None and mc.shm.min_all_reduce == _cfg.NEVER
        assert_close(y, reduce_np([data(r, "hosts", (1000,), np.int32) for r in range(world.Get_size())],
                                  ReduceOp.SUM))
        # the real communicator, all on this host: available
        g = _shm.ShmGroup.open(dup)
        assert g is not None and g.size == world.Get_size() and g.rank == world.Get_rank()
        g.close()
    finally:
        dup.Free()


# --------------------------------------------------------------------------- settings

def test_threshold_settings():
    t = _cfg.thresholds
    assert t(4, {}) == _cfg.DEFAULT_THRESHOLD
    assert t(2, {})["all_gather"] == t(2, {})["broadcast"] == _cfg.NEVER
    assert t(2, {})["all_reduce"] == t(2, {})["reduce_scatter"] == 256 << 10
    assert set(t(2, {"MPICOMM_SHM_THRESHOLD": "1M"}).values()) == {1 << 20}
    assert set(t(1, {}).values()) == {_cfg.NEVER}
    assert t(4, {}, crowded=True)["all_reduce"] == _cfg.CROWDED_THRESHOLD
    assert t(4, {}, crowded=True)["reduce_scatter"] == _cfg.DEFAULT_THRESHOLD["reduce_scatter"]
    assert set(t(4, {"MPICOMM_SHM_THRESHOLD": "1M"}, crowded=True).values()) == {1 << 20}
    assert set(t(4, {"MPICOMM_SHM_THRESHOLD": "off"}).values()) == {_cfg.NEVER}
    assert set(t(4, {"MPICOMM_SHM_THRESHOLD": "2M"}).values()) == {2 << 20}
    assert set(t(4, {"MPICOMM_SHM_THRESHOLD": "300000"}).values()) == {300000}
    assert set(t(4, {"MPICOMM_SHM_THRESHOLD": "0"}).values()) == {1}
    for bad in ("-5", "lots", "1.5M"):
        with pytest.raises(InvalidArgumentError, match="MPICOMM_SHM_THRESHOLD"):
            t(2, {"MPICOMM_SHM_THRESHOLD": bad})
    assert _cfg.piece_bytes({"MPICOMM_SHM_PIECE": "8M"}) == 8 << 20
    assert _cfg.piece_bytes({}) == _cfg.DEFAULT_PIECE
    g = _shm.ShmGroup.__new__(_shm.ShmGroup)
    g.crowded = False
    g.set_piece(env={})
    assert g.cands == _cfg.AUTO_PIECES and g.piece == _cfg.AUTO_PIECES[0]
    g.set_piece(env={"MPICOMM_SHM_PIECE": "4M"})
    assert g.cands is None and g.piece == 4 << 20
    g.crowded = True
    g.set_piece(env={})
    assert g.cands == _cfg.AUTO_PIECES and g.piece == _cfg.AUTO_PIECES[0]
    g.set_piece(8192)
    assert g.cands is None and g.piece == 8192
    with pytest.raises(InvalidArgumentError, match="MPICOMM_SHM_PIECE"):
        _cfg.piece_bytes({"MPICOMM_SHM_PIECE": "x"})


# --------------------------------------------------------------------------- bool, int16, uint16

@pytest.mark.parametrize("dt", [np.bool_, np.int16, np.uint16, np.int8], ids=lambda d: np.dtype(d).name)
def test_bool_int16_on_the_shared_memory_path(groups, dt):
    """bool reduces as logical OR (SUM, MAX) and AND (PROD, MIN), and the 8/16-bit integers
    wrap around as NumPy's arithmetic, on the path (np.maximum/np.minimum for bool) and on
    the tuner's Open MPI choice alike (mpicomm._ops.mpi_table); the data movers too.
    Data and expectations: tests/test_bool_int16.py (whole-range integers, random bools)."""
    from test_bool_int16 import expect, same, vals

    for group in groups:
        m = small_pieces(group)
        world, n, me = mpicomm._state.get_group(group).ranks, m.size, m.rank
        for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
            for shape in [(7,), (3001,), (33, 65)]:
                key = f"bi{shape}{op}"
                arrs = [vals(w, key, shape, dt) for w in world]
                before = calls(group, "all_reduce")
                same(mpicomm.all_reduce(arrs[me], op, group=group), expect(arrs, op))
                expect_path(group, "all_reduce", before, arrs[me].nbytes >= THRESHOLD)
            for rows in (1, 1501):
                arrs = [vals(w, f"birs{rows}{op}", (rows * n, 2), dt) for w in world]
                before = calls(group, "reduce_scatter")
                same(mpicomm.reduce_scatter(arrs[me], op, group=group), expect(arrs, op)[me * rows:(me + 1) * rows])
                expect_path(group, "reduce_scatter", before, arrs[me].nbytes >= THRESHOLD)
        arrs = [vals(w, "biag", (700, 3), dt) for w in world]
        before = calls(group, "all_gather")
        same(mpicomm.all_gather(arrs[me], group=group), np.concatenate(arrs))
        expect_path(group, "all_gather", before)
        b = arrs[me].copy()
        before = calls(group, "broadcast")
        assert mpicomm.broadcast(b, root=n - 1, group=group) is b
        expect_path(group, "broadcast", before)
        same(b, arrs[-1])
        # the tuner's third choice (Open MPI's all_reduce) is offered for these dtypes: both
        # choices are taken, and every result is the expectation
        g = m.group
        if g is None:
            continue
        try:
            g.cands, g.piece = (PIECE, 4 * PIECE), PIECE
            seen = set()
            for i in range(6 * _shm.EXPLORE):
                op = (ReduceOp.SUM, ReduceOp.PROD)[i % 2]
                arrs = [vals(w, f"bitune{i % 4}", (9_000,), dt) for w in world]
                seen.add(g.ordinary)
                same(mpicomm.all_reduce(arrs[me], op, group=group), expect(arrs, op))
            assert seen == {False, True}, seen
        finally:
            g.set_piece(PIECE)
