"""bool, int16 and uint16 on host arrays (the MPI backend), as torch.distributed, mpi4py and
Horovod users expect them: every collective and send/recv moves them; bool reduces as
torch.distributed does (SUM and MAX are logical OR, PROD and MIN logical AND, AVG refused);
int16 and uint16 reduce with NumPy's 16-bit arithmetic, wrapping around.

Each rank's data is random and seeded by its rank: bools True and False, integers over the
dtype's whole range (so sums and products wrap). Expectations are computed independently
with NumPy: np.logical_or/logical_and.reduce for bool, the ufuncs' reduce in the dtype itself
for the integers. bool results are also checked byte by byte (0 or 1: a SUM of bytes would
leave a 2 that still reads as True). The shared-memory path's forms are in tests/test_shm.py
(test_bool_int16_on_the_shared_memory_path), the NCCL transport's in tests/test_nccl_double.py,
mpi4py's 'h' and '?' typecodes in tests/test_ported.py.
"""
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp
from conftest import reversed_group, ring_pass

pytestmark = pytest.mark.mpi

DTYPES = [np.bool_, np.int16, np.uint16]
IDS = lambda d: np.dtype(d).name   # noqa: E731
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
GROUPS = ["world", "sub"]


def vals(rank, key, shape, dt):
    """Group member ``rank``'s data (a world rank): random bools, or integers over the whole range."""
    g = np.random.default_rng([rank, zlib.crc32(key.encode())])
    dt = np.dtype(dt)
    if dt.kind == "b":
        return g.integers(0, 2, size=shape).astype(bool)
    i = np.iinfo(dt)
    return g.integers(i.min, i.max + 1, size=shape).astype(dt)


def expect(arrs, op):
    """The reduction of ``arrs``, computed with NumPy in their own dtype."""
    s = np.stack(arrs)
    if s.dtype == np.bool_:
        f = np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and
        return f.reduce(s, axis=0)
    f = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
    return f.reduce(s, axis=0, dtype=s.dtype)


def same(got, want):
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(got, want)
    if want.dtype == np.bool_:   # bytes 0 and 1 only
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.fixture(scope="module")
def sub(comm):
    return reversed_group("bi16_rev")


def ctx(which, sub):
    """(group, its world ranks, this rank's group rank or None)."""
    if which == "world":
        return None, list(range(mpicomm.get_group_size())), mpicomm.get_rank()
    me = mpicomm.get_rank()
    return "bi16_rev", sub, (sub.index(me) if me in sub else None)


def run(fn, async_op, *a, **kw):
    if async_op:
        w = fn(*a, async_op=True, **kw)
        return w.wait()
    return fn(*a, **kw)


def test_expectations_are_not_trivial():
    """The data and the expectation helper: bools of both values, sums that wrap."""
    b = [vals(r, "t", (64,), bool) for r in range(2)]
    assert b[0].any() and not b[0].all() and (b[0] != b[1]).any()
    np.testing.assert_array_equal(expect(b, ReduceOp.SUM), b[0] | b[1])
    np.testing.assert_array_equal(expect(b, ReduceOp.PROD), b[0] & b[1])
    h = [np.array([30000, -32768], np.int16), np.array([10000, -1], np.int16)]
    np.testing.assert_array_equal(expect(h, ReduceOp.SUM), np.array([-25536, 32767], np.int16))
    np.testing.assert_array_equal(expect(h, ReduceOp.PROD), np.array([-23808, -32768], np.int16))


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
def test_all_reduce(comm, sub, op, dt, which, async_op, request):
    g, ranks, me = ctx(which, sub)
    if me is None:
        return
    key = request.node.name
    xs = [vals(w, key, (9, 7), dt) for w in ranks]
    want = expect(xs, op)
    x = xs[me].copy()
    same(run(mpicomm.all_reduce, async_op, x, op, group=g), want)
    same(x, xs[me])                                   # the input is left as it was
    assert run(mpicomm.all_reduce, async_op, x, op, out=x, group=g) is x   # in place
    same(x, want)
    # op given as a string, as torch users write it
    same(mpicomm.all_reduce(xs[me], op.value, group=g), want)


@pytest.mark.parametrize("count", [7, 64, 1000, 70_000])
@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16, np.uint16], ids=IDS)
def test_narrow_integer_sum_wraps_around(comm, sub, dt, count, request):
    """SUM of 8- and 16-bit integers wraps around as NumPy's arithmetic at every count (Open
    MPI's own SUM saturates wherever its AVX code runs), in all_reduce, reduce and reduce_scatter."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    xs = [vals(r, key, (n * count,), dt) for r in range(n)]
    want = expect(xs, ReduceOp.SUM)
    same(mpicomm.all_reduce(xs[me]), want)
    got = mpicomm.reduce(xs[me], root=n - 1)
    if me == n - 1:
        same(got, want)
    same(mpicomm.reduce_scatter(xs[me]), want[me * count:(me + 1) * count])
    if n > 1:   # the data wraps: a saturating sum would differ
        assert not np.array_equal(want, np.clip(np.sum(xs, axis=0), np.iinfo(dt).min, np.iinfo(dt).max))


@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_reduce_to_every_root(comm, sub, dt, which, request):
    g, ranks, me = ctx(which, sub)
    if me is None:
        return
    for root in range(len(ranks)):
        for op in OPS:
            key = f"{request.node.name}{root}{op.value}"
            xs = [vals(w, key, (11,), dt) for w in ranks]
            got = mpicomm.reduce(xs[me], op, root=root, group=g)
            if me == root:
                same(got, expect(xs, op))
            else:
                assert got is None


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_reduce_scatter(comm, sub, dt, which, async_op, request):
    g, ranks, me = ctx(which, sub)
    if me is None:
        return
    n = len(ranks)
    for op in OPS:
        key = f"{request.node.name}{op.value}"
        xs = [vals(w, key, (3 * n, 2), dt) for w in ranks]
        same(run(mpicomm.reduce_scatter, async_op, xs[me], op, group=g), expect(xs, op)[3 * me:3 * me + 3])
        # per-rank sizes
        sizes = [(q % 3) + 1 for q in range(n)]
        ys = [vals(w, key + "v", (sum(sizes), 2), dt) for w in ranks]
        lo = sum(sizes[:me])
        same(mpicomm.reduce_scatter(ys[me], op, sizes=sizes, group=g), expect(ys, op)[lo:lo + sizes[me]])


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_data_movement(comm, sub, dt, which, async_op, request):
    """all_gather (even and uneven), broadcast, all_to_all, gather and scatter from every root."""
    g, ranks, me = ctx(which, sub)
    if me is None:
        return
    n, key = len(ranks), request.node.name
    xs = [vals(w, key, (2 * n, 3), dt) for w in ranks]
    same(run(mpicomm.all_gather, async_op, xs[me], group=g), np.concatenate(xs))
    same(run(mpicomm.all_to_all, async_op, xs[me], group=g), np.concatenate([a[2 * me:2 * me + 2] for a in xs]))
    sizes = [q + 1 for q in range(n)]
    us = [vals(w, key + "u", (sizes[q], 3), dt) for q, w in enumerate(ranks)]
    same(mpicomm.all_gather(us[me], sizes=sizes, group=g), np.concatenate(us))
    for root in range(n):
        b = xs[me].copy()
        assert run(mpicomm.broadcast, async_op, b, root=root, group=g) is b
        same(b, xs[root])
        got = run(mpicomm.gather, async_op, xs[me], root, group=g)
        if me == root:
            same(got, np.concatenate(xs))
        else:
            assert got is None
        full = vals(ranks[root], key + f"s{root}", (2 * n, 3), dt)
        part = run(mpicomm.scatter, async_op, full if me == root else None, root, group=g,
                   out=None if me == root else np.empty((2, 3), dt))
        same(part, full[2 * me:2 * me + 2])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_send_recv_ring(comm, dt, request):
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    x = vals(me, key, (13,), dt)
    out = np.zeros(13, dt)
    dst, src = (me + 1) % n, (me - 1) % n
    same(ring_pass(x, out), vals(src, key, (13,), dt))
    same(mpicomm.sendrecv(x, dst, src=src), vals(src, key, (13,), dt))


def test_avg_on_bool_refused_on_every_rank(comm, sub):
    from test_errors import raises_everywhere

    n = mpicomm.get_group_size()
    x = vals(mpicomm.get_rank(), "avg", (2 * n,), bool)
    for f in (lambda: mpicomm.all_reduce(x, ReduceOp.AVG), lambda: mpicomm.reduce(x, "avg", root=n - 1),
              lambda: mpicomm.reduce_scatter(x, "mean")):
        raises_everywhere(InvalidArgumentError, f, "invalid op='avg'", "SUM or MAX (logical OR), PROD or MIN "
                          "(logical AND) for dtype bool")
    # int16 AVG: refused as for every integer dtype
    h = vals(mpicomm.get_rank(), "avg", (2 * n,), np.int16)
    raises_everywhere(InvalidArgumentError, lambda: mpicomm.all_reduce(h, "avg"), "invalid op='avg'",
                      "integer dtype int16")
    # after the refusals the world works, in step
    xs = [vals(r, "after", (5,), bool) for r in range(n)]
    same(mpicomm.all_reduce(xs[mpicomm.get_rank()]), expect(xs, ReduceOp.SUM))


def test_torch_cpu_tensors(comm, request):
    """torch.bool and torch.int16 CPU tensors take the host path and come back as tensors."""
    torch = pytest.importorskip("torch")
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    bs = [vals(r, key, (2 * n,), bool) for r in range(n)]
    t = torch.from_numpy(bs[me].copy())
    got = mpicomm.all_reduce(t, "prod")
    assert isinstance(got, torch.Tensor) and got.dtype is torch.bool
    same(got.numpy(), expect(bs, ReduceOp.PROD))
    assert mpicomm.all_reduce(t, "max", out=t) is t   # in place, as torch.distributed's
    same(t.numpy(), expect(bs, ReduceOp.MAX))
    hs = [vals(r, key + "h", (2 * n, 2), np.int16) for r in range(n)]
    h = torch.from_numpy(hs[me].copy())
    got = mpicomm.all_reduce(h)
    assert isinstance(got, torch.Tensor) and got.dtype is torch.int16
    same(got.numpy(), expect(hs, ReduceOp.SUM))
    got = mpicomm.all_gather(h)
    assert got.dtype is torch.int16
    same(got.numpy(), np.concatenate(hs))
    got = mpicomm.reduce_scatter(h, "min")
    same(got.numpy(), expect(hs, ReduceOp.MIN)[2 * me:2 * me + 2])
