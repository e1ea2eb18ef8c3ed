"""The NCCL transport in CI: mpicomm's NCCL backend over a test double of CuPy.

tests/fakecupy/cupy is a CuPy whose "device" arrays live in host memory and whose
``cupy.cuda.nccl.NcclCommunicator`` moves real data between the ranks through MPI, with
CuPy's call signatures (raw pointers, counts, NCCL type and op codes, stream handles) and
NCCL's group semantics; every pointer and count is checked against the allocation it
points into, and a stream-order model records reads that race with a write on another
stream (its docstrings say what it models and what not). This module finalises
mpicomm, puts the double first on ``sys.path``, initialises the NCCL backend, runs the
transport's layouts, roles, validation and grouping through the public API at every rank
count, and restores the session as it found it (the double removed, the former backend
back). Expectations come from NumPy on every rank's rank-seeded data. Where a real CuPy is
installed the module skips: tests/test_gpu*.py run the real transport there.
"""
import ctypes
import importlib.util
import os
import sys

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp
from conftest import reversed_group, ring_pass
from test_collectives import allowed, data, reduce_np

pytestmark = pytest.mark.mpi
FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecupy")
DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64"]
OPS = list(ReduceOp)


@pytest.fixture(scope="module")
def cp():
    """The double as ``cupy``, with mpicomm on its NCCL backend (and a reversed sub-group
    "nrev") for this module; the session's state is restored afterwards."""
    if "cupy" in sys.modules or importlib.util.find_spec("cupy") is not None:
        pytest.skip("a real CuPy is installed: tests/test_gpu*.py run the NCCL transport on GPUs")
    try:   # mpicomm asks the CUDA driver whether a stream captures: never with the double's handles
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is here: tests/test_gpu*.py run the NCCL transport on GPUs")
    except OSError:
        pass
    from mpicomm._state import CTX

    key = CTX.init_key if mpicomm.is_initialized() else None
    mpicomm.finalize()
    sys.path.insert(0, FAKE)
    try:
        import cupy

        assert getattr(cupy, "FAKE", False), cupy.__file__
        _, timeout, debug, abort, check = key or (None, 600.0, False, True, True)
        mpicomm.init("nccl", timeout=timeout, debug=debug, abort_on_exception=abort, check=check)
        assert mpicomm.get_backend() == "nccl"
        reversed_group("nrev")
        yield cupy
        mpicomm.finalize()
    finally:
        sys.path.remove(FAKE)
        for m in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
            del sys.modules[m]
    if key is not None:
        mpicomm.init(key[0], timeout=key[1], debug=key[2], abort_on_exception=key[3], check=key[4])


@pytest.fixture(autouse=True)
def no_races(cp):
    """Every test ends with no race recorded by the double's stream-order model."""
    cp.hazards.clear()
    yield
    races, cp.hazards[:] = list(cp.hazards), []
    assert not races, races


def races(cp):
    """The races recorded since the last call (and forget them)."""
    r, cp.hazards[:] = list(cp.hazards), []
    return r


def ctx(which):
    """(group name, its world ranks, size, this rank's group rank or None)."""
    if which == "world":
        n = mpicomm.get_group_size()
        return None, list(range(n)), n, mpicomm.get_rank()
    ranks = list(mpicomm._state.CTX.groups["nrev"].ranks)
    me = mpicomm.get_rank()
    return "nrev", ranks, len(ranks), (ranks.index(me) if me in ranks else None)


def close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = 1e-2 if want.dtype.itemsize == 2 else 1e-6
        wide = np.complex128 if want.dtype.kind == "c" else np.float64
        np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=tol, atol=tol)


def done(r, async_op):
    return r.wait() if async_op else r


def history_since(cp, mark):
    """The double's calls after ``mark`` (a length of its history) as (group, name, bytes)."""
    return list(cp.cuda.nccl.history)[mark:]


# ----------------------------------------------------------------------- every collective
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", ["world", "sub"])
def test_collectives_every_dtype_and_op(cp, which, async_op, request):
    g, ranks, n, me = ctx(which)
    if me is None:
        return
    checked = 0
    for dt in DTYPES:
        for op in OPS:
            if not allowed(op, dt):
                continue
            key = f"{request.node.name}{dt}{op.value}"
            xs = [data(w, key, (2 * n, 3), dt, op) for w in ranks]
            full = reduce_np(xs, op)
            x = cp.asarray(xs[me])
            r = done(mpicomm.all_reduce(x, op, group=g, async_op=async_op), async_op)
            assert type(r) is cp.ndarray and r is not x
            close(r.get(), full)
            close(done(mpicomm.reduce_scatter(x, op, group=g, async_op=async_op), async_op).get(),
                  full[2 * me:2 * me + 2])
            red = done(mpicomm.reduce(x, op, root=n - 1, group=g, async_op=async_op), async_op)
            if me == n - 1:
                close(red.get(), full)
            else:
                assert red is None
            close(x.get(), xs[me])   # the input is left as it was
            checked += 1
        key = f"{request.node.name}{dt}"
        xs = [data(w, key, (2 * n, 2), dt) for w in ranks]
        x = cp.asarray(xs[me])
        close(done(mpicomm.all_gather(x, group=g, async_op=async_op), async_op).get(), np.concatenate(xs))
        close(done(mpicomm.all_to_all(x, group=g, async_op=async_op), async_op).get(),
              np.concatenate([a[2 * me:2 * me + 2] for a in xs]))
        for root in {0, n - 1}:
            b = cp.asarray(xs[me])
            assert done(mpicomm.broadcast(b, root=root, group=g, async_op=async_op), async_op) is b
            close(b.get(), xs[root])
    assert checked == 33   # 4 integer dtypes x 4 ops, 3 floating x 5, complex64 x 2


# ----------------------------------------------------------------------- bool, int16, uint16
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", ["world", "sub"])
def test_bool_reduces_and_int16_moves(cp, which, async_op, request):
    """bool reduces as torch's ProcessGroupNCCL does it, on ncclUint8: SUM/MAX with ncclMax
    (logical OR), PROD/MIN with ncclMin (logical AND); results are checked byte by byte (a
    ncclSum would leave 2s). int16 and uint16 move as two NCCL bytes per element through
    every data-moving collective, even and uneven. Data and expectations: tests/test_bool_int16.py."""
    from test_bool_int16 import expect, same, vals

    g, ranks, n, me = ctx(which)
    if me is None:
        return
    key = request.node.name
    for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
        xs = [vals(w, key + op.value, (2 * n, 3), bool) for w in ranks]
        full = expect(xs, op)
        x = cp.asarray(xs[me])
        same(done(mpicomm.all_reduce(x, op, group=g, async_op=async_op), async_op).get(), full)
        same(done(mpicomm.reduce_scatter(x, op, group=g, async_op=async_op), async_op).get(), full[2 * me:2 * me + 2])
        red = done(mpicomm.reduce(x, op, root=n - 1, group=g, async_op=async_op), async_op)
        if me == n - 1:
            same(red.get(), full)
        else:
            assert red is None
        same(x.get(), xs[me])
        sizes = sizes_of(n, 1)
        zs = [vals(w, key + op.value + "v", (sum(sizes), 2), bool) for w in ranks]
        lo = sum(sizes[:me])
        got = done(mpicomm.reduce_scatter(cp.asarray(zs[me]), op, group=g, sizes=sizes, async_op=async_op), async_op)
        same(got.get(), expect(zs, op)[lo:lo + sizes[me]])
        y = cp.asarray(xs[me])   # in place
        assert done(mpicomm.all_reduce(y, op, out=y, group=g, async_op=async_op), async_op) is y
        same(y.get(), full)
    for dt in (np.int16, np.uint16, np.bool_):
        k = f"{key}{np.dtype(dt).name}"
        xs = [vals(w, k, (2 * n, 3), dt) for w in ranks]
        x = cp.asarray(xs[me])
        same(done(mpicomm.all_gather(x, group=g, async_op=async_op), async_op).get(), np.concatenate(xs))
        same(done(mpicomm.all_to_all(x, group=g, async_op=async_op), async_op).get(),
             np.concatenate([a[2 * me:2 * me + 2] for a in xs]))
        sizes = sizes_of(n)
        us = [vals(ranks[q], k + "u", (sizes[q], 3), dt) for q in range(n)]
        same(done(mpicomm.all_gather(cp.asarray(us[me]), group=g, sizes=sizes, async_op=async_op), async_op).get(),
             np.concatenate(us))
        S = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
        ys = [vals(ranks[i], k + "a", (sum(S[i]), 2), dt) for i in range(n)]
        got = done(mpicomm.all_to_all(cp.asarray(ys[me]), group=g, in_splits=S[me], out_splits=[S[i][me] for i in range(n)],
                                      async_op=async_op), async_op)
        same(got.get(), np.concatenate([ys[i][sum(S[i][:me]):sum(S[i][:me + 1])] for i in range(n)]))
        for root in range(n):
            b = cp.asarray(xs[me])
            assert done(mpicomm.broadcast(b, root=root, group=g, async_op=async_op), async_op) is b
            same(b.get(), xs[root])
            got = done(mpicomm.gather(x, root, group=g, async_op=async_op), async_op)
            if me == root:
                same(got.get(), np.concatenate(xs))
            else:
                assert got is None
            got = done(mpicomm.gather(cp.asarray(us[me]), root, group=g, sizes=sizes, async_op=async_op), async_op)
            if me == root:
                same(got.get(), np.concatenate(us))
            full = vals(ranks[root], k + f"s{root}", (sum(sizes), 3), dt)
            offs = np.cumsum([0] + sizes)
            got = done(mpicomm.scatter(cp.asarray(full) if me == root else None, root, group=g, sizes=sizes,
                                       out=None if me == root else cp.zeros((sizes[me], 3), dt),
                                       async_op=async_op), async_op)
            same(got.get(), full[offs[me]:offs[me + 1]])
            even = vals(ranks[root], k + f"e{root}", (2 * n, 3), dt)
            got = done(mpicomm.scatter(cp.asarray(even) if me == root else None, root, group=g, sizes="auto",
                                       async_op=async_op), async_op)
            same(got.get(), even[2 * me:2 * me + 2])


def test_bool_and_int16_point_to_point(cp, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    from test_bool_int16 import same, vals

    for dt in (np.int16, np.uint16, np.bool_):
        key = f"{request.node.name}{np.dtype(dt).name}"
        x = cp.asarray(vals(r, key, (101, 3), dt))
        want = vals(prv, key, (101, 3), dt)
        if n > 1:
            same(ring_pass(x, cp.zeros((101, 3), dt)).get(), want)
            out = cp.zeros((101, 3), dt)   # tagged: staged through host memory
            w = mpicomm.send(x, nxt, tag=4, async_op=True)
            mpicomm.recv(out, prv, tag=4)
            w.wait()
            same(out.get(), want)
        same(mpicomm.sendrecv(x, nxt, src=prv).get(), want)


def test_int16_reductions_and_bool_avg_refused_on_every_rank(cp, request):
    """NCCL has no 16-bit integer type: GPU int16/uint16 reductions are refused on every rank,
    naming x.dtype, the value and what to do; bool's AVG too (as on MPI). Host int16 arrays on
    the NCCL backend reduce (over MPI). After the refusals the group works, in step."""
    from test_bool_int16 import expect, same, vals
    from test_errors import raises_everywhere

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    for dt in (np.int16, np.uint16):
        name = np.dtype(dt).name
        x = cp.asarray(vals(r, key + name, (2 * n, 3), dt))
        for op in ("sum", "max"):
            for f in (lambda: mpicomm.all_reduce(x, op), lambda: mpicomm.reduce(x, op, root=n - 1),
                      lambda: mpicomm.reduce_scatter(x, op), lambda: mpicomm.all_reduce(x, op, async_op=True),
                      lambda: mpicomm.reduce_scatter(x, op, sizes=[2] * n)):
                raises_everywhere(InvalidArgumentError, f, f"invalid x.dtype='{name}'", f"op={op}",
                                  "NCCL has no 16-bit integer reduction: cast to int32")
        hs = [vals(q, key + name + "h", (2 * n, 3), dt) for q in range(n)]
        same(mpicomm.all_reduce(hs[r]), expect(hs, ReduceOp.SUM))   # a host array: MPI reduces it
    b = cp.asarray(vals(r, key + "b", (2 * n,), bool))
    for f in (lambda: mpicomm.all_reduce(b, "avg"), lambda: mpicomm.reduce_scatter(b, ReduceOp.AVG),
              lambda: mpicomm.reduce(b, "mean", root=0)):
        raises_everywhere(InvalidArgumentError, f, "invalid op='avg'", "PROD or MIN (logical AND) for dtype bool")
    xs = [vals(q, key + "ok", (2 * n, 3), bool) for q in range(n)]
    same(mpicomm.all_reduce(cp.asarray(xs[r]), "min").get(), expect(xs, ReduceOp.MIN))


@pytest.mark.mpi(min_size=2)
def test_int16_gpu_reduction_on_one_rank_refused_on_every_rank(cp, request):
    """One rank reduces an int16 GPU array, the others an int32 GPU array of the same shape (what
    the message says to do): every rank raises, the others naming the refusing rank's reason;
    the next call is in step."""
    from test_bool_int16 import expect, same, vals
    from test_errors import raises_everywhere

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    bad = n - 1
    key = request.node.name
    x = cp.asarray(vals(r, key, (2 * n, 3), np.int16 if r == bad else np.int32))
    raises_everywhere(InvalidArgumentError, lambda: mpicomm.all_reduce(x), "invalid x.dtype='int16'",
                      "cast to int32")
    xs = [vals(q, key + "ok", (2 * n, 3), np.int32) for q in range(n)]
    same(mpicomm.all_reduce(cp.asarray(xs[r])).get(), expect(xs, ReduceOp.SUM))


# ----------------------------------------------------------------------- roles
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])   # (async: the general path)
def test_roles_out_in_place_and_nccl_slots(cp, async_op, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    xs = [data(q, key, (2 * n, 3), "float32") for q in range(n)]
    full = reduce_np(xs, ReduceOp.SUM)

    def go(fn, *a, **kw):
        return done(fn(*a, async_op=async_op, **kw), async_op)

    # out= a new array: written and returned, the input untouched
    x = cp.asarray(xs[r])
    for fn, want in ((mpicomm.all_reduce, full), (mpicomm.reduce_scatter, full[2 * r:2 * r + 2]),
                     (mpicomm.all_gather, np.concatenate(xs)),
                     (mpicomm.all_to_all, np.concatenate([a[2 * r:2 * r + 2] for a in xs]))):
        o = cp.zeros(want.shape, np.float32)
        assert go(fn, x, out=o) is o
        close(o.get(), want)
        close(x.get(), xs[r])
    o = cp.zeros((2 * n, 3), np.float32)
    got = go(mpicomm.reduce, x, ReduceOp.MAX, root=0, out=o)
    if r == 0:
        assert got is o
        close(o.get(), reduce_np(xs, ReduceOp.MAX))
    # in place: out=x, and out= a view of exactly x's memory
    for mode in ("x", "view"):
        x = cp.asarray(xs[r])
        o = x if mode == "x" else x.view()
        assert go(mpicomm.all_reduce, x, out=o) is o
        close(x.get(), full)
        x = cp.asarray(xs[r])
        o = x if mode == "x" else x.view()
        assert go(mpicomm.all_to_all, x, out=o) is o
        close(x.get(), np.concatenate([a[2 * r:2 * r + 2] for a in xs]))
    # NCCL's own in-place forms: x is this rank's slot of all_gather's out, reduce_scatter's
    # out is this rank's slot of x
    big = cp.zeros((2 * n * n, 3), np.float32)
    mine = big[2 * n * r:2 * n * (r + 1)]
    mine[...] = cp.asarray(xs[r])
    assert go(mpicomm.all_gather, mine, out=big) is big
    close(big.get(), np.concatenate(xs))
    x = cp.asarray(xs[r])
    slot = x[2 * r:2 * r + 2]
    assert go(mpicomm.reduce_scatter, x, out=slot) is slot
    close(slot.get(), full[2 * r:2 * r + 2])
    # a non-contiguous input is copied; broadcast writes back into it
    wide = cp.asarray(np.stack([xs[r], -xs[r]], axis=1))     # (2n, 2, 3)
    strided = wide[:, 0]
    assert not strided._c_contiguous
    close(go(mpicomm.all_reduce, strided).get(), full)
    assert go(mpicomm.broadcast, strided, root=n - 1) is strided
    close(wide.get()[:, 0], xs[n - 1])
    close(wide.get()[:, 1], -xs[r])   # its neighbours untouched

    # an array known only by __cuda_array_interface__ (another library's): results as CuPy
    class Foreign:
        def __init__(self, a):
            self.a = a
            self.__cuda_array_interface__ = a.__cuda_array_interface__
    got = go(mpicomm.all_reduce, Foreign(cp.asarray(xs[r])), ReduceOp.MIN)
    assert type(got) is cp.ndarray
    close(got.get(), reduce_np(xs, ReduceOp.MIN))
    # NumPy arrays on the NCCL backend take its MPI transport, and stay NumPy
    h = go(mpicomm.all_reduce, xs[r].copy())
    assert type(h) is np.ndarray
    close(h, full)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", ["world", "sub"])
def test_reduce_scatter_into_a_chunk_of_x(cp, which, async_op, request):
    """out= any one of x's n chunks, on every rank alike: the head of x (MPI's in-place form,
    staged through a new array: NCCL's in-place form is this rank's own chunk), this rank's
    own chunk (NCCL in place), another; every dtype and op. Other overlaps are refused."""
    g, ranks, n, me = ctx(which)
    if me is None:
        return
    for dt in DTYPES:
        for op in OPS:
            if not allowed(op, dt):
                continue
            for k in range(n):
                key = f"{request.node.name}{dt}{op.value}{k}"
                xs = [data(w, key, (2 * n, 3), dt, op) for w in ranks]
                x = cp.asarray(xs[me])
                out = x[2 * k:2 * k + 2]
                assert done(mpicomm.reduce_scatter(x, op, out=out, group=g, async_op=async_op), async_op) is out
                close(out.get(), reduce_np(xs, op)[2 * me:2 * me + 2])
    # (one row more than x: out, shifted by one element, has a chunk's length at any rank count)
    buf = cp.asarray(data(ranks[me], "rsoff", (2 * n + 1, 3), "float32")).reshape(-1)
    with pytest.raises(InvalidArgumentError, match=r"invalid out='an array that overlaps x'"):
        mpicomm.reduce_scatter(buf[:6 * n], out=buf[1:3 * 2 + 1], group=g)
    close(buf.get(), data(ranks[me], "rsoff", (2 * n + 1, 3), "float32").reshape(-1))


# ----------------------------------------------------------------------- streams
def test_explicit_and_current_streams(cp, request):
    """stream= a non-blocking stream, and a stream made current: the double's stream-order
    model raises where a read on one stream follows a write on another that nothing orders."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    xs = [data(q, request.node.name, (2 * n, 3), "float32") for q in range(n)]
    full = reduce_np(xs, ReduceOp.SUM)
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.asarray(xs[r])
    mpicomm.all_reduce(x, stream=s)   # the model itself: the copy into x (null stream) may still run
    assert [h.split(" reads")[0] for h in races(cp)] == ["NCCL allReduce"]
    cp.cuda.Device().synchronize()
    got = mpicomm.all_reduce(x, stream=s)
    got.get()                         # s not synchronised
    assert [h.split(" reads")[0] for h in races(cp)] == ["x.get()"]
    s.synchronize()
    close(got.get(), full)
    o = cp.zeros((2 * n * n, 3), np.float32)
    cp.cuda.Device().synchronize()
    assert mpicomm.all_gather(x, out=o, stream=s) is o
    w = mpicomm.reduce_scatter(x, stream=s, async_op=True)
    res = w.wait()
    s.synchronize()
    close(o.get(), np.concatenate(xs))
    close(res.get(), full[2 * r:2 * r + 2])
    with s:   # the current stream: the transport's own copies are ordered with the call
        y = cp.asarray(xs[r])
        close(mpicomm.all_reduce(y[::-1]).get(), full[::-1])
        close(mpicomm.all_to_all(y, out=y).get(), np.concatenate([a[2 * r:2 * r + 2] for a in xs]))
    if n > 1:   # a tag: staged through the host on the call's stream
        z = cp.asarray(xs[r])
        cp.cuda.Device().synchronize()
        got = mpicomm.sendrecv(z, (r + 1) % n, src=(r - 1) % n, tag=3, stream=s)
        s.synchronize()
        close(got.get(), xs[(r - 1) % n])


@pytest.mark.parametrize("case", [
    "strided all_reduce",
    "strided broadcast",
    "all_to_all in place",
    "sendrecv out=x",
    "gather in place",
])
def test_transport_copies_on_the_calls_stream(cp, case, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    xs = [data(q, request.node.name, (2 * n, 3), "float32") for q in range(n)]
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.asarray(xs[r])
    wide = cp.asarray(np.stack([xs[r], -xs[r]], axis=1))
    big = cp.zeros((2 * n * n, 3), np.float32)
    big[2 * n * r:2 * n * (r + 1)] = x
    cp.cuda.Device().synchronize()
    if case == "strided all_reduce":
        got, want = mpicomm.all_reduce(wide[:, 0], stream=s), reduce_np(xs, ReduceOp.SUM)
    elif case == "strided broadcast":
        got, want = mpicomm.broadcast(wide[:, 0], root=0, stream=s), xs[0]
    elif case == "all_to_all in place":
        got, want = mpicomm.all_to_all(x, out=x, stream=s), np.concatenate([a[2 * r:2 * r + 2] for a in xs])
    elif case == "sendrecv out=x":
        got, want = mpicomm.sendrecv(x, (r + 1) % n, out=x, src=(r - 1) % n, stream=s), xs[(r - 1) % n]
    else:
        got = mpicomm.gather(big[2 * n * r:2 * n * (r + 1)] if r == 0 else x, 0, out=big if r == 0 else None,
                             sizes=[2 * n] * n, stream=s)
        want = np.concatenate(xs) if r == 0 else None
    s.synchronize()
    cp.cuda.Device().synchronize()
    if want is not None:
        close(got.get(), want)
    seen = mpicomm.all_gather_object(races(cp))   # (gather's race is on the root only)
    assert not any(seen), seen


# ----------------------------------------------------------------------- uneven layouts
def sizes_of(n, salt=0):
    return [(3 * q + 1 + salt) % 4 for q in range(n)]   # zeros included from 2 ranks on


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", ["world", "sub"])
def test_uneven_sizes_gather_scatter(cp, which, async_op, request):
    g, ranks, n, me = ctx(which)
    if me is None:
        return
    key, dt = request.node.name, "int32"
    sizes = sizes_of(n)
    xs = [data(ranks[q], key, (sizes[q], 3), dt) for q in range(n)]
    for sz in (sizes, "auto"):
        got = done(mpicomm.all_gather(cp.asarray(xs[me]), group=g, sizes=sz, async_op=async_op), async_op)
        close(got.get(), np.concatenate(xs))
    S = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
    ys = [data(ranks[i], key + "a", (sum(S[i]), 2), dt) for i in range(n)]
    want = np.concatenate([ys[i][sum(S[i][:me]):sum(S[i][:me + 1])] for i in range(n)])
    for outs in ([S[i][me] for i in range(n)], "auto"):
        got = done(mpicomm.all_to_all(cp.asarray(ys[me]), group=g, in_splits=S[me], out_splits=outs,
                                      async_op=async_op), async_op)
        close(got.get(), want)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        zs = [data(ranks[q], key + "rs", (sum(sizes), 2), dt, op) for q in range(n)]
        got = done(mpicomm.reduce_scatter(cp.asarray(zs[me]), op, group=g, sizes=sizes, async_op=async_op), async_op)
        lo = sum(sizes[:me])
        close(got.get(), reduce_np(zs, op)[lo:lo + sizes[me]])
    for root in {0, n - 1}:
        for sz in (sizes, "auto", None):
            parts = xs if sz is not None else [data(ranks[q], key + "g", (2, 3), dt) for q in range(n)]
            got = done(mpicomm.gather(cp.asarray(parts[me]), root, group=g, sizes=sz, async_op=async_op), async_op)
            if me == root:
                close(got.get(), np.concatenate(parts))
            else:
                assert got is None
        full = data(ranks[root], key + "sc", (sum(sizes), 3), dt)
        offs = np.cumsum([0] + sizes)
        got = done(mpicomm.scatter(cp.asarray(full) if me == root else None, root, group=g, sizes=sizes,
                                   out=None if me == root else cp.zeros((sizes[me], 3), dt),
                                   async_op=async_op), async_op)
        close(got.get(), full[offs[me]:offs[me + 1]])
        even = data(ranks[root], key + "se", (2 * n, 3), dt)
        got = done(mpicomm.scatter(cp.asarray(even) if me == root else None, root, group=g, sizes="auto",
                                   async_op=async_op), async_op)
        close(got.get(), even[2 * me:2 * me + 2])
    # gather with x the root's own part of out (in place on the root)
    root = n - 1
    out = cp.zeros((sum(sizes), 3), dt)
    lo = sum(sizes[:me])
    x = out[lo:lo + sizes[me]] if me == root else cp.asarray(xs[me])
    if me == root:
        x[...] = cp.asarray(xs[me])
    got = mpicomm.gather(x, root, group=g, sizes=sizes, out=out if me == root else None)
    if me == root:
        assert got is out
        close(out.get(), np.concatenate(xs))


# ----------------------------------------------------------------------- point to point, batches
def test_send_recv_sendrecv_and_tags(cp, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    nxt, prv = (r + 1) % n, (r - 1) % n
    x = cp.asarray(data(r, key, (1000, 3), "float64"))
    want = data(prv, key, (1000, 3), "float64")
    if n > 1:
        close(ring_pass(x, cp.zeros((1000, 3))).get(), want)
        # both sides send first (NCCL only enqueues; the double completes sends later)
        out = cp.zeros((1000, 3))
        w = mpicomm.send(x, nxt, async_op=True)
        assert mpicomm.recv(out, prv) is out
        w.wait()
        close(out.get(), want)
        # a tag: staged through host memory and matched by MPI, out of order
        a, b = cp.zeros((1000, 3)), cp.zeros((1000, 3))
        ws = [mpicomm.send(x, nxt, tag=7, async_op=True), mpicomm.send(cp.asarray(-data(r, key, (1000, 3), "float64")),
                                                                       nxt, tag=3, async_op=True)]
        mpicomm.recv(b, prv, tag=3)
        mpicomm.recv(a, prv, tag=7)
        for w in ws:
            w.wait()
        close(a.get(), want)
        close(b.get(), -want)
    close(mpicomm.sendrecv(x, nxt, src=prv).get(), want)
    out = cp.zeros((1000, 3))
    assert mpicomm.sendrecv(x, nxt, out=out, src=prv, async_op=True).wait() is out
    close(out.get(), want)
    close(mpicomm.sendrecv(x, r).get(), x.get())   # to oneself
    close(mpicomm.sendrecv(x, nxt, src=prv, tag=5).get(), want)


def test_sendrecv_out_overlapping_x(cp, request):
    """sendrecv(x, out=o) with o sharing part of x's memory: the peer's x arrives, as on MPI."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    xs = [data(q, request.node.name, (10,), "float32") for q in range(n)]
    buf = cp.asarray(xs[r])
    got = mpicomm.sendrecv(buf[:8], (r + 1) % n, out=buf[2:], src=(r - 1) % n)
    close(got.get(), xs[(r - 1) % n][:8])


def test_batches_are_one_nccl_group(cp, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    xs = {q: data(q, key, (64, 2), "float32") for q in range(n)}
    mine = cp.asarray(xs[r])
    # every pair, oneself included, in any order, with a collective among them
    outs = {q: cp.zeros((64, 2), np.float32) for q in range(n)}
    mark = len(cp.cuda.nccl.history)
    with mpicomm.batch() as bt:
        for q in reversed(range(n)):
            mpicomm.recv(outs[q], q)
        s = mpicomm.all_reduce(mine, ReduceOp.MAX)
        for q in range(n):
            mpicomm.send(mine, q)
    for q in range(n):
        close(outs[q].get(), xs[q])
    close(s.wait().get(), reduce_np(list(xs.values()), ReduceOp.MAX))
    assert len(bt.works) == 2 * n + 1
    calls = history_since(cp, mark)
    gids = {gid for gid, name, _ in calls if name in ("send", "recv", "allReduce")}
    assert len(gids) == 1 and None not in gids, calls           # one group
    assert sorted(name for _, name, _ in calls if name in ("send", "recv", "allReduce")) == \
        ["allReduce"] + ["recv"] * n + ["send"] * n
    # batch_isend_irecv: a ring
    out = cp.zeros((64, 2), np.float32)
    for w in mpicomm.batch_isend_irecv([mpicomm.P2POp("recv", out, (r - 1) % n),
                                        mpicomm.P2POp("send", mine, (r + 1) % n)]):
        w.wait()
    close(out.get(), xs[(r - 1) % n])
    # all_to_all and uneven all_gather are one group of sends and receives each
    mark = len(cp.cuda.nccl.history)
    mpicomm.all_to_all(cp.asarray(data(r, key + "a", (2 * n, 2), "float32")))
    mpicomm.all_gather(mine[:r + 1], sizes=[q + 1 for q in range(n)])
    calls = history_since(cp, mark)
    per = {}
    for gid, name, _ in calls:
        if name in ("send", "recv"):
            per.setdefault(gid, []).append(name)
    assert None not in per and [sorted(v) for v in per.values()] == [["recv"] * n + ["send"] * n] * 2, calls


# ----------------------------------------------------------------------- validation
def refused(match, fn, *a, **kw):
    with pytest.raises(InvalidArgumentError, match=match):
        fn(*a, **kw)


def test_bad_arguments_refused_on_every_rank(cp, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    x = cp.asarray(data(r, request.node.name, (2 * n, 3), "float32"))
    refused(r"out\.shape.*\(3, 3\).*shape \(" + str(2 * n), mpicomm.all_reduce, x, out=cp.zeros((3, 3), np.float32))
    refused(r"out\.dtype.*float64.*float32", mpicomm.all_reduce, x, out=cp.zeros((2 * n, 3)))
    refused(r"out\.shape.*\(%d, 3\)" % (2 * n * n), mpicomm.all_gather, x, out=cp.zeros((2 * n * n, 4), np.float32))
    refused(r"out\.shape.*\(2, 3\)", mpicomm.reduce_scatter, x, out=cp.zeros((2, 4), np.float32))
    wide = cp.zeros((2 * n, 6), np.float32)
    refused(r"out.*non-contiguous", mpicomm.all_reduce, x, out=wide[:, :3])
    if n > 1:
        refused(r"out.*non-contiguous", mpicomm.recv, wide[:, :3], (r + 1) % n, async_op=True)
    big = cp.zeros((4 * n, 3), np.float32)
    big[:2 * n] = x
    refused(r"out.*overlaps x", mpicomm.all_reduce, big[:2 * n], out=big[1:2 * n + 1])
    refused(r"out.*overlaps x", mpicomm.all_gather, big[:2], out=big[1:1 + 2 * n])
    refused(r"out.*a GPU array", mpicomm.all_reduce, x, out=np.zeros((2 * n, 3), np.float32))
    refused(r"root.*%d" % n, mpicomm.broadcast, x, root=n)
    refused(r"root.*-1", mpicomm.reduce, x, root=-1)
    refused(r"root", mpicomm.gather, x, n)
    refused(r"dst.*%d" % (n + 1), mpicomm.send, x, n + 1)
    if n > 1:   # (at one rank these are fine)
        refused(r"out.*x \(in place\).*shape", mpicomm.all_gather, x, out=x)
        refused(r"x\.shape.*divisible by the group size", mpicomm.reduce_scatter, x[:2 * n - 1])
        refused(r"x\.shape.*divisible by the group size", mpicomm.all_to_all, x[:2 * n - 1])
    refused(r"op.*prod", mpicomm.all_reduce, cp.zeros(4, np.complex64), "prod")
    refused(r"sizes.*add up", mpicomm.reduce_scatter, x, sizes=[1] * n)
    refused(r"dst.*oneself|not this rank", mpicomm.send, x, r, async_op=True)
    other = (x.data.device_id + 1) % cp.cuda.runtime.getDeviceCount()
    with cp.cuda.Device(other):
        y = cp.zeros((2 * n, 3), np.float32)
    refused(r"x\.device.*cuda:%d.*cuda:%d" % (other, x.data.device_id), mpicomm.all_reduce, y)
    refused(r"out\.device.*cuda:%d" % other, mpicomm.all_reduce, x, out=y)
    # after the refusals the group works, in step
    xs = [data(q, request.node.name + "ok", (5,), "int64") for q in range(n)]
    close(mpicomm.all_reduce(cp.asarray(xs[r])).get(), reduce_np(xs, ReduceOp.SUM))


@pytest.mark.mpi(min_size=2)
def test_refusal_on_one_rank_stands_in(cp):
    """A wrong out= on one rank only (refused in the transport's checks) and a dtype that
    differs on one rank: the agreement check's contract (tests/test_agreement.py), where the
    refusing rank stands in with a scratch array of the double so that no rank stays blocked
    inside the NCCL call; the next call is right."""
    from test_agreement import _other, _run_case

    if not mpicomm._state.CTX.check:
        pytest.skip("the agreement check is off (MPICOMM_CHECK=0)")
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    bad = _other(n, 22)
    x = cp.asarray(np.random.default_rng(r).standard_normal(6).astype(np.float32))
    out = cp.zeros(5 if r == bad else 6, np.float32)
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, out=out), 3200, returns_ok=lambda res: r != bad)
    if r == bad:
        assert isinstance(err, InvalidArgumentError) and "out.shape" in str(err), err
    y = cp.asarray((np.random.default_rng(r).standard_normal(4 * n) * 10).astype(np.int32 if r == bad else np.float32))
    _run_case(n, r, lambda: mpicomm.all_reduce(y), 3300, returns_ok=lambda res: True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [True, False])
def test_host_array_disagreements_on_the_nccl_backend(cp, async_op):
    """Host (NumPy) arrays on the NCCL backend go through MPI: disagreements on them, caught
    over and over, leave that MPI communicator as on the MPI backend: afresh at the next
    call, so that no request of a failed call is left to swallow a later one's messages
    (an async call after a caught async disagreement waited until the timeout)."""
    from test_agreement import test_repeated_disagreements_then_calls_of_known_shapes as repeated

    if not mpicomm._state.CTX.check:
        pytest.skip("the agreement check is off (MPICOMM_CHECK=0)")
    repeated((mpicomm.get_group_size(), mpicomm.get_rank()), async_op)

def test_the_double_refuses_what_nccl_would(cp):
    """The double's own checks, which keep the tests above honest: a count past the end of
    an allocation, a host pointer, overlapping buffers and a receive of the wrong size."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    nccl = cp.cuda.nccl
    c = mpicomm._state.CTX.world.transport.comm
    x, o = cp.zeros(8, np.float32), cp.zeros(8, np.float32)
    with pytest.raises(nccl.NcclError, match=r"allReduce: recvbuff.*overruns"):
        c.allReduce(x.data.ptr, o.data.ptr + 4, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    h = np.zeros(8, np.float32)
    with pytest.raises(nccl.NcclError, match=r"sendbuff.*not device memory"):
        c.allGather(h.ctypes.data, o.data.ptr, 8 // n, nccl.NCCL_FLOAT32, 0)
    with pytest.raises(nccl.NcclError, match=r"overlap"):
        c.allReduce(x.data.ptr, x.data.ptr + 4, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    with pytest.raises(nccl.NcclError, match=r"stream"):
        c.allReduce(x.data.ptr, o.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, cp.cuda.Stream())
    nccl.groupStart()
    c.send(x.data.ptr, 8, nccl.NCCL_FLOAT32, r, 0)
    c.recv(x.data.ptr, 8, nccl.NCCL_FLOAT32, r, 0)
    with pytest.raises(nccl.NcclError, match=r"overlaps the send buffer"):
        nccl.groupEnd()
    nccl.groupStart()
    c.send(x.data.ptr, 4, nccl.NCCL_FLOAT32, r, 0)
    c.recv(o.data.ptr, 8, nccl.NCCL_FLOAT32, r, 0)
    with pytest.raises(nccl.NcclError, match=r"got a send of 16 B"):
        nccl.groupEnd()


def test_coalesced_block_is_one_nccl_group(cp, request):
    """batch(coalesce=True): the block's collectives are one NCCL group, launched at its end;
    each call returned its result, ready after the block."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    xs = [data(q, key + "x", (6, 2), "float32") for q in range(n)]
    ys = [data(q, key + "y", (3,), "int32") for q in range(n)]
    x, y = cp.asarray(xs[r]), cp.asarray(ys[r])
    out = cp.empty((6, 2), np.float32)
    mark = len(cp.cuda.nccl.history)
    with mpicomm.batch(coalesce=True) as c:
        a = mpicomm.all_reduce(x, ReduceOp.MIN, out=out)
        with mpicomm.batch(coalesce=True):
            b = mpicomm.all_gather(y)
        d = mpicomm.broadcast(cp.asarray(ys[r]), root=n - 1)
    assert c.works is None and a is out
    calls = [(gid, name) for gid, name, _ in history_since(cp, mark) if name in ("allReduce", "allGather", "broadcast")]
    assert sorted(name for _, name in calls) == ["allGather", "allReduce", "broadcast"], calls
    assert len({gid for gid, _ in calls}) == 1 and None not in {gid for gid, _ in calls}, calls   # one group
    cp.cuda.Device().synchronize()
    close(a.get(), reduce_np(xs, ReduceOp.MIN))
    close(b.get(), np.concatenate(ys))
    close(d.get(), ys[n - 1])


# ----------------------------------------------------------------------- the compiled run
def test_blocking_calls_run_compiled(cp, request):
    """Where mpicomm/_native is built, a blocking collective on CuPy arrays runs through the
    compiled NcclRun: new output, in place, out=, reduce's root, broadcast, on new arrays
    every call (the prepared call reused)."""
    from mpicomm._ops import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER
    from mpicomm._state import CTX
    from test_native import need_compiled

    need_compiled()
    d = CTX.world.disp
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for i in range(3):
        xs = [data(q, f"{request.node.name}{i}", (2 * n, 3), "float32") for q in range(n)]
        full = reduce_np(xs, ReduceOp.SUM)
        o = cp.zeros((2 * n, 3), np.float32)
        assert mpicomm.all_reduce(cp.asarray(xs[r]), out=o) is o
        close(o.get(), full)
        x = cp.asarray(xs[r])
        assert mpicomm.all_reduce(x, ReduceOp.MAX, out=x) is x
        close(x.get(), reduce_np(xs, ReduceOp.MAX))
        close(mpicomm.all_gather(cp.asarray(xs[r])).get(), np.concatenate(xs))
        close(mpicomm.reduce_scatter(cp.asarray(xs[r])).get(), full[2 * r:2 * r + 2])
        x = cp.asarray(xs[r])
        assert mpicomm.broadcast(x, root=n - 1) is x
        close(x.get(), xs[n - 1])
        got = mpicomm.reduce(cp.asarray(xs[r]), root=n - 1)
        assert (got is None) == (r != n - 1)
        if got is not None:
            close(got.get(), full)
        for code in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE):
            assert type(d.last[code].run).__name__ == "NcclRun", (code, d.last[code].run)


# ----------------------------------------------------------------------- CUDA graphs (the double's capture)
def test_capture_names_its_collectives_and_replays(cp, request):
    """mpicomm.capture on a CuPy stream records the calls the double's NCCL captured; each
    mpicomm.replay runs them on the arrays' current contents (rank-seeded data, NumPy's sums
    and concatenations), counts the replay with the graph's key in the progress window, and
    the capture's lines name each captured collective, alike on every rank."""
    from mpicomm._reliability.progress import REPLAY_KEY, REPLAYS
    from mpicomm._state import CTX

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = CTX.reliability.progress.m
    s = cp.cuda.Stream(non_blocking=True)
    with s:   # (the arrays written on the stream that reads them: no race in the double's model)
        x = cp.asarray(data(r, request.node.name, (3, 2), "float32"))
        out, gat = cp.empty((3, 2), np.float32), cp.empty((3 * n, 2), np.float32)
        mpicomm.all_reduce(x, out=out)        # prepared before the capture
        mpicomm.all_gather(x, out=gat)
    seq = CTX.world.disp.seq
    with mpicomm.capture(stream=s) as cap:
        mpicomm.all_reduce(x, out=out)
        mpicomm.all_gather(x, out=gat)
    assert cap.collectives == [f"all_reduce sequence {seq + 1} on group 'world' (shape (3, 2), dtype float32)",
                               f"all_gather sequence {seq + 2} on group 'world' (shape (3, 2), dtype float32)"], \
        cap.collectives
    keys = mpicomm.all_gather(np.array([cap.key], np.int64))
    assert cap.key > 0 and (keys == cap.key).all(), keys
    for rep in range(1, 4):
        xs = [data(q, f"{request.node.name}{rep}", (3, 2), "float32") for q in range(n)]
        with s:
            x[...] = cp.asarray(xs[r])
        before = int(m[REPLAYS])
        mpicomm.replay(cap.graph, s)
        assert int(m[REPLAYS]) == before + 1 and int(m[REPLAY_KEY]) == cap.key
        s.synchronize()
        close(out.get(), reduce_np(xs, ReduceOp.SUM))
        close(gat.get(), np.concatenate(xs))
    assert CTX.reliability.watchdog.graphs[cap.key].describe() == cap.describe()
    with pytest.raises(InvalidArgumentError, match=r"invalid stream=<NoneType>.*cupy.cuda.Stream other than the null"):
        with mpicomm.capture():
            pass
    with pytest.raises(InvalidArgumentError, match=r"invalid graph=<object>.*torch.cuda.CUDAGraph"):
        with mpicomm.capture(object()):
            pass
    with pytest.raises(InvalidArgumentError, match=r"invalid stream=<int>.*cupy.cuda.Stream for a CuPy graph"):
        mpicomm.replay(cap.graph, 3)

    class Unlaunchable:   # a graph whose launch raises: neither counted nor watched
        def launch(self, stream=None):
            raise RuntimeError("no launch")
    before = int(m[REPLAYS])
    with pytest.raises(RuntimeError, match="no launch"):
        mpicomm.replay(Unlaunchable(), s)
    assert int(m[REPLAYS]) == before
    assert all(slot[0] is not None and slot[0].done for slot in CTX.reliability.watchdog._replays)
    mpicomm.barrier()   # nothing was entered: the group goes on
