"""Repeated calls: the dispatcher reuses a validated call for any arrays of the same
signature (mpicomm._dispatch). New contents, new arrays, a new op or root, and arrays
whose shape or dtype was changed in place must all still give the right result or the
right error. Expectations are computed with NumPy from every rank's data."""
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp

# The tests change shape and dtype in place on purpose, which NumPy 2.5 deprecates (and
# which the repeat path must still notice while NumPy allows it).
pytestmark = [pytest.mark.mpi,
              pytest.mark.filterwarnings("ignore:Setting the (shape|dtype) on a NumPy array:DeprecationWarning")]


def rank_data(rank, key, step, shape, dt):
    g = np.random.default_rng([rank, step, zlib.crc32(key.encode())])
    return g.integers(-50, 51, size=shape).astype(dt)


def all_data(key, step, shape, dt):
    return [rank_data(r, key, step, shape, dt) for r in range(mpicomm.get_group_size())]


@pytest.mark.parametrize("dt", [np.float32, np.int64])
@pytest.mark.parametrize("mode", ["new", "out", "inplace"])
def test_all_reduce_same_arrays_new_contents_and_ops(comm, dt, mode):
    r = mpicomm.get_rank()
    x = np.empty(7, dt)
    o = np.empty(7, dt)
    ops = [ReduceOp.SUM, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MIN, ReduceOp.SUM]
    for step, op in enumerate(ops):
        x[...] = rank_data(r, "ar", step, 7, dt)
        exp = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}[op](
            np.stack(all_data("ar", step, 7, dt)), axis=0)
        if mode == "new":
            got = mpicomm.all_reduce(x, op)
            assert got is not x
        elif mode == "out":
            got = mpicomm.all_reduce(x, op, out=o)
            assert got is o
        else:
            got = mpicomm.all_reduce(x, op, out=x)
            assert got is x
        np.testing.assert_array_equal(got, exp.astype(dt))


def test_all_reduce_alternating_arrays(comm):
    r = mpicomm.get_rank()
    xs = [np.empty(5, np.float64), np.empty((2, 3), np.float64)]
    for step in range(6):
        x = xs[step % 2]
        x[...] = rank_data(r, "alt", step, x.shape, np.float64)
        got = mpicomm.all_reduce(x)
        assert got.shape == x.shape
        np.testing.assert_array_equal(got, np.sum(all_data("alt", step, x.shape, np.float64), axis=0))


def test_shape_changed_in_place(comm):
    r = mpicomm.get_rank()
    x = rank_data(r, "shape", 0, 6, np.float32)
    mpicomm.all_reduce(x)
    mpicomm.all_reduce(x)
    x.shape = (2, 3)
    got = mpicomm.all_reduce(x)
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, np.sum(all_data("shape", 0, 6, np.float32), axis=0).reshape(2, 3))
    # out= of the old shape no longer fits, and says so
    x.shape = (6,)
    o = np.empty(6, np.float32)
    mpicomm.all_reduce(x, out=o)
    mpicomm.all_reduce(x, out=o)
    x.shape = (3, 2)
    with pytest.raises(InvalidArgumentError, match=r"out\.shape"):
        mpicomm.all_reduce(x, out=o)


def test_dtype_changed_in_place(comm):
    r = mpicomm.get_rank()
    x = rank_data(r, "dtype", 0, 8, np.int32)
    mpicomm.all_reduce(x)
    mpicomm.all_reduce(x)
    x.dtype = np.int64      # same bytes, read as 4 int64
    got = mpicomm.all_reduce(x)
    assert got.dtype == np.int64 and got.shape == (4,)
    exp = np.sum([a.view(np.int64) for a in all_data("dtype", 0, 8, np.int32)], axis=0)
    np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("out", [False, True])
def test_all_gather_repeated(comm, out):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = np.empty((2, 3), np.int32)
    o = np.empty((2 * n, 3), np.int32)
    for step in range(4):
        x[...] = rank_data(r, "ag", step, (2, 3), np.int32)
        got = mpicomm.all_gather(x, out=o) if out else mpicomm.all_gather(x)
        np.testing.assert_array_equal(got, np.concatenate(all_data("ag", step, (2, 3), np.int32)))
    x.shape = (3, 2)
    if out:
        with pytest.raises(InvalidArgumentError, match=r"out\.shape"):
            mpicomm.all_gather(x, out=o)
    else:
        assert mpicomm.all_gather(x).shape == (3 * n, 2)


def test_reduce_scatter_repeated(comm):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = np.empty((2 * n, 3), np.float64)
    o = np.empty((2, 3), np.float64)
    for step, op in enumerate([ReduceOp.SUM, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MAX, ReduceOp.SUM]):
        x[...] = rank_data(r, "rs", step, x.shape, np.float64)
        total = (np.sum if op is ReduceOp.SUM else np.max)(np.stack(all_data("rs", step, x.shape, np.float64)), axis=0)
        got = mpicomm.reduce_scatter(x, op, out=o) if step % 2 else mpicomm.reduce_scatter(x, op)
        np.testing.assert_array_equal(got, total[2 * r:2 * r + 2])
    x.shape = (3, 2 * n)  # axis 0 no longer divides by the group size (unless n is 1 or 3)
    if 3 % n:
        with pytest.raises(InvalidArgumentError, match=r"x\.shape"):
            mpicomm.reduce_scatter(x)
    else:
        np.testing.assert_array_equal(mpicomm.reduce_scatter(x).shape, (3 // n, 2 * n))


def test_broadcast_repeated_roots(comm):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = np.empty(9, np.int64)
    for step, root in enumerate([0, 0, n - 1, n - 1, 0, n // 2]):
        x[...] = rank_data(r, "bc", step, 9, np.int64)
        got = mpicomm.broadcast(x, root)
        assert got is x
        np.testing.assert_array_equal(x, rank_data(root, "bc", step, 9, np.int64))
    with pytest.raises(InvalidArgumentError, match="root"):
        mpicomm.broadcast(x, n)


def test_large_arrays_repeat_without_being_kept_alive(comm):
    """all_gather and broadcast of large arrays repeat: right results with new contents and
    shapes, and the reused calls keep no array alive once it is dropped."""
    import gc
    import weakref

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    k = 65536 + 1001  # float32 elements per rank (above 256 KiB)
    x = np.empty(k, np.float32)
    o = np.empty(n * k, np.float32)
    b = np.empty(2 * k, np.int32)
    for step in range(4):
        x[...] = rank_data(r, "big-ag", step, k, np.float32)
        assert mpicomm.all_gather(x, out=o) is o
        np.testing.assert_array_equal(o, np.concatenate(all_data("big-ag", step, k, np.float32)))
        root = step % n
        b[...] = rank_data(r, "big-bc", step, 2 * k, np.int32)
        assert mpicomm.broadcast(b, root) is b
        np.testing.assert_array_equal(b, rank_data(root, "big-bc", step, 2 * k, np.int32))
    x.shape = (k, 1)
    with pytest.raises(InvalidArgumentError, match=r"out\.shape"):
        mpicomm.all_gather(x, out=o)
    wx, wo, wb = weakref.ref(x), weakref.ref(o), weakref.ref(b)
    del x, o, b
    gc.collect()
    assert wx() is None and wo() is None and wb() is None


def _expect(key, step, shape, dt, fn):
    return fn(np.stack(all_data(key, step, shape, dt)))


@pytest.mark.parametrize("role", ["new", "out", "inplace"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX])
def test_new_arrays_every_call(comm, role, op):
    """A training loop's pattern: a new input (and out=) array of the same signature each
    call; the reused call binds the new arrays and gives each call's own result."""
    r = mpicomm.get_rank()
    red = {ReduceOp.SUM: lambda a: a.sum(0), ReduceOp.AVG: lambda a: a.sum(0) / len(a),
           ReduceOp.MAX: lambda a: a.max(0)}[op]
    for step in range(6):
        x = rank_data(r, f"fresh-{op}", step, (4, 3), np.float64)
        want = _expect(f"fresh-{op}", step, (4, 3), np.float64, red)
        if role == "new":
            got = mpicomm.all_reduce(x, op)
            assert got is not x
        elif role == "out":
            o = np.full((4, 3), np.nan)
            got = mpicomm.all_reduce(x, op, out=o)
            assert got is o
        else:
            got = mpicomm.all_reduce(x, op, out=x)
            assert got is x
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_new_arrays_every_call_other_collectives(comm):
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    for step in range(5):
        x = rank_data(r, "fresh-ag", step, (2, 3), np.int32)
        np.testing.assert_array_equal(mpicomm.all_gather(x), np.concatenate(all_data("fresh-ag", step, (2, 3), np.int32)))
        o = np.empty((2 * n, 3), np.int32)
        assert mpicomm.all_gather(x, out=o) is o
        np.testing.assert_array_equal(o, np.concatenate(all_data("fresh-ag", step, (2, 3), np.int32)))
        x = rank_data(r, "fresh-rs", step, (2 * n, 2), np.int64)
        total = np.sum(all_data("fresh-rs", step, (2 * n, 2), np.int64), axis=0)
        np.testing.assert_array_equal(mpicomm.reduce_scatter(x), total[2 * r:2 * r + 2])
        root = step % n
        b = rank_data(r, "fresh-bc", step, 5, np.float32)
        assert mpicomm.broadcast(b, root) is b
        np.testing.assert_array_equal(b, rank_data(root, "fresh-bc", step, 5, np.float32))
        x = rank_data(r, "fresh-red", step, 6, np.int64)
        got = mpicomm.reduce(x, root=root)
        if r == root:
            np.testing.assert_array_equal(got, np.sum(all_data("fresh-red", step, 6, np.int64), axis=0))
        else:
            assert got is None
        x = rank_data(r, "fresh-a2a", step, (n, 2), np.float64)
        got = mpicomm.all_to_all(x)
        np.testing.assert_array_equal(got, np.stack([a[r] for a in all_data("fresh-a2a", step, (n, 2), np.float64)]))


def test_reused_call_still_checks_each_array(comm):
    """What can differ between arrays of one signature is checked on every call, also when
    the call is reused: a non-contiguous input is copied, a read-only, non-contiguous or
    overlapping out= is refused, a view of exactly x's memory works in place."""
    r = mpicomm.get_rank()
    want = np.sum(all_data("chk", 0, 8, np.float32), axis=0)
    for _ in range(2):  # the second round takes the reused call
        x = rank_data(r, "chk", 0, 8, np.float32)
        np.testing.assert_array_equal(mpicomm.all_reduce(x, out=np.empty(8, np.float32)), want)
    wide = np.empty((8, 2), np.float32)
    wide[:, 0] = rank_data(r, "chk", 0, 8, np.float32)
    np.testing.assert_array_equal(mpicomm.all_reduce(wide[:, 0], out=np.empty(8, np.float32)), want)
    ro = np.empty(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        mpicomm.all_reduce(x, out=ro)
    with pytest.raises(InvalidArgumentError, match="non-contiguous"):
        mpicomm.all_reduce(x, out=np.empty((8, 2), np.float32)[:, 1])
    buf = np.zeros(9, np.float32)
    buf[:8] = rank_data(r, "chk", 0, 8, np.float32)
    with pytest.raises(InvalidArgumentError, match="overlaps x"):
        mpicomm.all_reduce(buf[:8], out=buf[1:9])
    y = rank_data(r, "chk", 0, 8, np.float32)
    assert mpicomm.all_reduce(y, out=y.view()) is not None
    np.testing.assert_array_equal(y, want)
    for _ in range(2):  # in place, reused, then on a read-only array
        y = rank_data(r, "chk", 0, 8, np.float32)
        assert mpicomm.all_reduce(y, out=y) is y
        np.testing.assert_array_equal(y, want)
    y.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        mpicomm.all_reduce(y, out=y)
    # the reused call is still right after the errors
    np.testing.assert_array_equal(mpicomm.all_reduce(rank_data(r, "chk", 0, 8, np.float32),
                                                     out=np.empty(8, np.float32)), want)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_new_arrays_every_call_in_nccl_in_place_form(comm, op):
    """all_gather with x this rank's part of out, reduce_scatter with out this rank's part
    of x (NCCL's in-place forms), new buffers every call: each call's own result; a view
    one row off is refused (it overlaps without being this rank's part)."""
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    for step in range(5):
        parts = all_data(f"ip-ag-{op}", step, (2, 3), np.float64)
        o = np.full((2 * n, 3), np.nan)
        o[2 * r:2 * r + 2] = parts[r]
        assert mpicomm.all_gather(o[2 * r:2 * r + 2], out=o) is o
        np.testing.assert_array_equal(o, np.concatenate(parts))
        xs = all_data(f"ip-rs-{op}", step, (2 * n, 2), np.float64)
        x = xs[r].copy()
        want = np.sum(xs, axis=0)[2 * r:2 * r + 2] / (n if op is ReduceOp.AVG else 1)
        part = x[2 * r:2 * r + 2]
        assert mpicomm.reduce_scatter(x, op, out=part) is part
        np.testing.assert_allclose(part, want, rtol=1e-12)
    if n > 1:
        o = np.zeros((2 * n + 1, 3))
        x = o[2 * r + 1:2 * r + 3]
        with pytest.raises(mpicomm.InvalidArgumentError, match="overlap"):
            mpicomm.all_gather(x, out=o[:2 * n])


def test_many_signatures_in_turn(comm):
    """A loop over more signatures than one (a model's gradients, one all_reduce each; a
    reducer's buckets): every call kept prepared by its signature must still run exactly
    that signature's call. Shapes, dtypes, ops and out= roles in turn, three rounds, each
    checked; then a bad out= on a kept signature is still refused on every rank."""
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    sigs = [(shape, dt, op, role) for shape in (5, (2, 3), (4, 1, 2)) for dt in (np.float64, np.int32)
            for op in (ReduceOp.SUM, ReduceOp.MAX) for role in ("new", "out", "inplace")]
    red = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max}
    for rnd in range(3):
        for k, (shape, dt, op, role) in enumerate(sigs):
            key = f"sig{k}"
            x = rank_data(r, key, rnd, shape, dt)
            want = red[op](np.stack(all_data(key, rnd, shape, dt)), axis=0)
            if role == "new":
                got = mpicomm.all_reduce(x, op)
            elif role == "out":
                o = np.empty(np.shape(want), dt)
                got = mpicomm.all_reduce(x, op, out=o)
                assert got is o
            else:
                got = mpicomm.all_reduce(x, op, out=x)
                assert got is x
            assert got.shape == np.shape(want) and got.dtype == dt
            np.testing.assert_array_equal(got, want)
    with pytest.raises(InvalidArgumentError, match=r"out.shape"):
        mpicomm.all_reduce(rank_data(r, "sig0", 0, 5, np.float64), ReduceOp.SUM, out=np.empty(6))
    np.testing.assert_array_equal(mpicomm.all_reduce(np.full(5, r + 1.0)), np.full(5, n * (n + 1) / 2))


def test_known_calls_evict_the_least_recently_used(comm, monkeypatch):
    """A loop over as many signatures as a group keeps (KNOWN_CALLS - 1 shapes every step)
    plus one new shape per step (an evaluation batch, a last short batch): the new shapes
    push out each other, never the loop's, so after the first step only the new shape is
    prepared and every loop call reuses the very call prepared in the first step. (Evicting
    the oldest inserted pushed out the loop's shapes one by one, and from the third step on
    every loop call missed.) Results are checked on every call."""
    from mpicomm._dispatch import KNOWN_CALLS
    from mpicomm._ops import ALL_REDUCE
    from mpicomm._state import get_group

    if mpicomm._state.CTX.debug:
        pytest.skip("debug mode prepares every call")
    r = mpicomm.get_rank()
    d = get_group(None).disp
    t = d.transport
    prepared = []

    def counted(code, x, *a):
        prepared.append(x.shape)
        return type(t).prepare(t, code, x, *a)

    monkeypatch.setattr(t, "prepare", counted, raising=False)
    loop = [(k,) for k in range(1, KNOWN_CALLS)]
    first = []
    for step in range(4):
        del prepared[:]
        for k, shape in enumerate(loop + [(KNOWN_CALLS + step,)]):
            key = f"lru{k}"
            x = rank_data(r, key, step, shape, np.float64)
            got = mpicomm.all_reduce(x)
            np.testing.assert_array_equal(got, np.sum(all_data(key, step, shape, np.float64), axis=0))
            if k < len(loop):
                p = d.last[ALL_REDUCE]
                if step == 0:
                    first.append(p)
                else:
                    assert p is first[k], f"step {step}: the call of shape {shape} was prepared again"
        assert len(d.known) <= KNOWN_CALLS
        kept = {id(p) for p in d.known.values()}
        assert all(id(p) in kept for p in first)
        if step:
            assert prepared == [(KNOWN_CALLS + step,)], step
        else:   # (a shape an earlier test left prepared is reused)
            assert prepared[-1] == (KNOWN_CALLS,) and set(prepared) <= set(loop + [(KNOWN_CALLS,)])


class _ListShaped:
    """A DLPack array whose ``shape`` is a list (unhashable), as Paddle's Size is."""

    def __init__(self, a):
        self.a = a
        self.shape = list(a.shape)
        self.dtype = a.dtype

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@pytest.mark.mpi
def test_arrays_with_an_unhashable_shape_are_not_cached_and_work(comm):
    """An array type whose shape cannot be a dict key (Paddle's tensors) is prepared every
    call instead of kept, also when the group has kept no call yet."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    g = mpicomm.create_group(f"unhashable-{n}", list(range(n)))   # a group with no kept calls
    try:
        for i in range(3):
            x = np.random.default_rng(100 * r + i).standard_normal(5).astype(np.float32)
            want = sum(np.random.default_rng(100 * q + i).standard_normal(5).astype(np.float32) for q in range(n))
            got = mpicomm.all_reduce(_ListShaped(x), group=f"unhashable-{n}")
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
    finally:
        mpicomm.destroy_group(f"unhashable-{n}")
    del g
