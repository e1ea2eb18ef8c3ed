"""The collectives on GPU arrays under the NCCL backend: CuPy arrays and PyTorch CUDA
tensors, world and sub-group, sync and async, default and explicit streams. Skipped
(on every rank alike) where the backend is not NCCL; run on the 2-GPU machine."""
import numpy as np
import pytest

import mpicomm
from mpicomm import ReduceOp
from conftest import reversed_group, ring_pass
from test_collectives import allowed, data, reduce_np

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64"]


@pytest.fixture(scope="module")
def nccl(comm):
    if mpicomm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    reversed_group("grev")
    return "grev"


class Cupy:
    name = "cupy"

    def ok(self, dt):
        return dt != "bfloat16"  # CuPy has no bfloat16 arrays

    def to(self, a):
        import cupy

        return cupy.asarray(a)

    def host(self, a):
        return a.get()

    def stream(self):
        import cupy

        return cupy.cuda.Stream(non_blocking=True)


class Torch:
    name = "torch"

    def ok(self, dt):
        return True

    def to(self, a):
        import torch

        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda()
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def host(self, a):
        import torch

        if a.dtype == torch.bfloat16:
            import ml_dtypes

            return a.float().cpu().numpy().astype(ml_dtypes.bfloat16)
        return a.cpu().numpy()

    def stream(self):
        import torch

        return torch.cuda.Stream()


def kinds():
    out = []
    try:
        import cupy  # noqa: F401

        out.append(Cupy())
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            out.append(Torch())
    except ImportError:
        pass
    return out


def close(a, b):
    dt = b.dtype
    if dt.kind in "iu":
        np.testing.assert_array_equal(a, b)
    else:
        tol = 1e-2 if dt.itemsize == 2 else 1e-6
        wide = np.complex128 if dt.kind == "c" else np.float64
        np.testing.assert_allclose(np.asarray(a).astype(wide), b.astype(wide), rtol=tol, atol=tol)


def members(group):
    return list(mpicomm._state.CTX.groups[group].ranks) if group else list(range(mpicomm.get_group_size()))


def synced(result, k):
    if k.name == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.Device().synchronize()
    return result


@pytest.mark.parametrize("which", ["world", "sub"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_gpu_collectives(nccl, which, async_op, request):
    group = None if which == "world" else nccl
    world = members(group)
    me_w = mpicomm.get_rank()
    if me_w not in world:
        return
    me, n = mpicomm.get_rank(group), len(world)
    checked = 0

    def go(fn, *a, **kw):
        if async_op:
            return fn(*a, async_op=True, **kw).wait()
        return synced(fn(*a, **kw), k)

    for k in kinds():
        for dt in DTYPES:
            if not k.ok(dt):
                continue
            ndt = np.dtype(dt) if dt != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
            for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG):
                if not allowed(op, ndt):
                    continue
                key = f"{request.node.name}{k.name}{dt}{op.value}"
                shape = (2 * n, 3)
                xs = [data(r, key, shape, ndt, op) for r in world]
                x = k.to(xs[world.index(me_w)])
                full = reduce_np(xs, op)
                r = go(mpicomm.all_reduce, x, op, group=group)
                assert type(r) is type(x)
                close(k.host(r), full)
                close(k.host(go(mpicomm.reduce_scatter, x, op, group=group)), full[2 * me:2 * me + 2])
                red = go(mpicomm.reduce, x, op, root=n - 1, group=group)
                if me == n - 1:
                    close(k.host(red), full)
                else:
                    assert red is None
                checked += 1
            key = f"{request.node.name}{k.name}{dt}"
            xs = [data(r, key, (2 * n, 2), ndt) for r in world]
            x = k.to(xs[world.index(me_w)])
            close(k.host(go(mpicomm.all_gather, x, group=group)), np.concatenate(xs))
            close(k.host(go(mpicomm.all_to_all, x, group=group)),
                  np.concatenate([a[2 * me:2 * me + 2] for a in xs]))
            b = k.to(xs[world.index(me_w)])
            go(mpicomm.broadcast, b, root=0, group=group)
            close(k.host(b), xs[0])
    assert checked > 0


def test_gpu_in_place_out_and_explicit_stream(nccl, request):
    n = mpicomm.get_group_size()
    for k in kinds():
        key = request.node.name + k.name
        xs = [data(r, key, (1000,), np.float32) for r in range(n)]
        x = k.to(xs[mpicomm.get_rank()])
        s = k.stream()
        r = mpicomm.all_reduce(x, out=x, stream=s)
        assert r is x
        s.synchronize()
        close(k.host(x), reduce_np(xs, ReduceOp.SUM))
        out = k.to(np.zeros(1000 * n, np.float32))
        assert mpicomm.all_gather(k.to(xs[mpicomm.get_rank()]), out=out) is out
        synced(None, k)
        close(k.host(out), np.concatenate(xs))


@pytest.mark.mpi(min_size=2)
def test_gpu_send_recv(nccl, request):
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    for k in kinds():
        key = request.node.name + k.name
        x = k.to(data(me, key, (33,), np.float64))
        out = ring_pass(x, k.to(np.zeros(33)))
        src = (me - 1) % n
        synced(None, k)
        close(k.host(out), data(src, key, (33,), np.float64))
        mpicomm.barrier()  # after point-to-point GPU work (once broke the watchdog's note)


def test_gpu_zero_size_and_numpy_on_nccl(nccl, request):
    """Zero-size GPU arrays work; NumPy arrays on the NCCL backend take the MPI path."""
    import cupy

    n = mpicomm.get_group_size()
    z = mpicomm.all_reduce(cupy.zeros((0, 3), cupy.float32))
    assert z.shape == (0, 3)
    key = request.node.name
    h = mpicomm.all_reduce(data(mpicomm.get_rank(), key, (5,), np.int64))
    assert isinstance(h, np.ndarray)
    np.testing.assert_array_equal(h, sum(data(r, key, (5,), np.int64) for r in range(n)))


def test_gpu_errors(nccl):
    import cupy

    with pytest.raises(mpicomm.InvalidArgumentError, match="op"):
        mpicomm.all_reduce(cupy.arange(4, dtype=cupy.int32), op=ReduceOp.AVG)
    n = mpicomm.get_group_size()
    with pytest.raises(mpicomm.InvalidArgumentError, match="out.shape"):
        mpicomm.all_gather(cupy.ones(3), out=cupy.empty(3 * n + 1))
    with pytest.raises(mpicomm.InvalidArgumentError, match="root"):
        mpicomm.broadcast(cupy.ones(3), root=n)
    if n > 1:
        with pytest.raises(mpicomm.InvalidArgumentError, match="divisible"):
            mpicomm.reduce_scatter(cupy.ones(n + 1))


def test_gpu_arrays_staged_on_mpi_backend(comm, request):
    """CuPy arrays and CUDA tensors on the MPI backend are staged through the host and
    come back as the caller's type (run with MPICOMM_BACKEND=mpi on a GPU machine)."""
    if mpicomm.get_backend() != "mpi" or not kinds():
        pytest.skip("needs the MPI backend on a machine with a GPU")
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    for k in kinds():
        key = request.node.name + k.name
        xs = [data(r, key, (2 * n, 3), np.float32) for r in range(n)]
        x = k.to(xs[me])
        r = mpicomm.all_reduce(x)
        assert type(r) is type(x)
        close(k.host(r), reduce_np(xs, ReduceOp.SUM))
        y = k.to(xs[me])
        assert mpicomm.all_reduce(y, out=y) is y
        close(k.host(y), reduce_np(xs, ReduceOp.SUM))
        close(k.host(mpicomm.all_gather(x)), np.concatenate(xs))
        b = k.to(xs[me])
        mpicomm.broadcast(b, root=n - 1)
        close(k.host(b), xs[n - 1])


def test_gpu_repeated_calls_same_arrays(nccl):
    """Reused calls on the same CuPy arrays (mpicomm._dispatch): new contents, a new op or
    root and a shape changed in place must still give the right result or error."""
    import cupy

    from test_repeat import all_data, rank_data

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = cupy.empty(7, cupy.float32)
    o = cupy.empty(7, cupy.float32)
    for mode in ("new", "out", "inplace"):
        for step, op in enumerate([ReduceOp.SUM, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MAX, ReduceOp.SUM]):
            x[...] = cupy.asarray(rank_data(r, "g" + mode, step, 7, np.float32))
            exp = (np.sum if op is ReduceOp.SUM else np.max)(np.stack(all_data("g" + mode, step, 7, np.float32)), 0)
            got = {"new": lambda: mpicomm.all_reduce(x, op), "out": lambda: mpicomm.all_reduce(x, op, out=o),
                   "inplace": lambda: mpicomm.all_reduce(x, op, out=x)}[mode]()
            np.testing.assert_array_equal(got.get(), exp)
    x.shape = (7, 1)
    assert mpicomm.all_reduce(x).shape == (7, 1)
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"out\.shape"):
        mpicomm.all_reduce(x, out=o)
    xg = cupy.empty((2, 3), cupy.int32)
    og = cupy.empty((2 * n, 3), cupy.int32)
    xs = cupy.empty((2 * n, 3), cupy.float64)
    os_ = cupy.empty((2, 3), cupy.float64)
    b = cupy.empty(5, cupy.int64)
    for step in range(4):
        xg[...] = cupy.asarray(rank_data(r, "gag", step, (2, 3), np.int32))
        got = mpicomm.all_gather(xg, out=og) if step % 2 else mpicomm.all_gather(xg)
        np.testing.assert_array_equal(got.get(), np.concatenate(all_data("gag", step, (2, 3), np.int32)))
        xs[...] = cupy.asarray(rank_data(r, "grs", step, xs.shape, np.float64))
        got = mpicomm.reduce_scatter(xs, out=os_) if step % 2 else mpicomm.reduce_scatter(xs)
        np.testing.assert_array_equal(got.get(), np.sum(all_data("grs", step, xs.shape, np.float64), 0)[2 * r:2 * r + 2])
        root = [0, 0, n - 1, n - 1][step]
        b[...] = cupy.asarray(rank_data(r, "gbc", step, 5, np.int64))
        mpicomm.broadcast(b, root)
        np.testing.assert_array_equal(b.get(), rank_data(root, "gbc", step, 5, np.int64))


def test_gpu_stream_dropped_after_a_collective(nccl):
    """The watchdog records events on the stream of the last NCCL call; a stream the user
    drops right after the call must stay valid for it (it holds the stream object)."""
    import gc
    import time

    import cupy

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = cupy.arange(6, dtype=cupy.float32) * (r + 1)
    s = cupy.cuda.Stream(non_blocking=True)
    y = mpicomm.all_reduce(x, stream=s)
    s.synchronize()
    del s
    gc.collect()
    time.sleep(2.5)  # the watchdog wakes every second (timeout 600 s): it checks the last call twice
    np.testing.assert_array_equal(y.get(), np.arange(6, dtype=np.float32) * sum(range(1, n + 1)))
    np.testing.assert_array_equal(mpicomm.all_reduce(x).get(), y.get())


@pytest.mark.parametrize("k", kinds(), ids=lambda k: k.name)
def test_gpu_new_arrays_every_call_and_per_call_checks(nccl, k):
    """A training loop's pattern on GPU arrays: new arrays of one signature every call,
    out=, in place, and NCCL's in-place forms of all_gather and reduce_scatter; a reused
    call still copies a non-contiguous input and refuses an overlapping out=."""
    from test_repeat import all_data, rank_data

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    for step in range(4):
        xs = all_data("gfresh", step, (4, 3), np.float32)
        want = np.sum(xs, axis=0)
        x = k.to(rank_data(r, "gfresh", step, (4, 3), np.float32))
        o = k.to(np.zeros((4, 3), np.float32))
        assert synced(mpicomm.all_reduce(x, out=o), k) is o
        close(k.host(o), want)
        y = k.to(rank_data(r, "gfresh", step, (4, 3), np.float32))
        assert synced(mpicomm.all_reduce(y, out=y), k) is y
        close(k.host(y), want)
        close(k.host(synced(mpicomm.all_reduce(k.to(xs[r]), ReduceOp.AVG), k)), want / n)
        g = k.to(np.zeros((4 * n, 3), np.float32))
        g[4 * r:4 * r + 4] = k.to(xs[r])
        assert synced(mpicomm.all_gather(g[4 * r:4 * r + 4], out=g), k) is not None
        close(k.host(g), np.concatenate(xs))
        big = all_data("gfresh-rs", step, (2 * n, 3), np.float32)
        z = k.to(big[r])
        part = z[2 * r:2 * r + 2]
        mpicomm.reduce_scatter(z, out=part)
        synced(None, k)
        close(k.host(z)[2 * r:2 * r + 2], np.sum(big, axis=0)[2 * r:2 * r + 2])
    wide = k.to(np.zeros((4, 6), np.float32))
    wide[:, ::2] = k.to(rank_data(r, "gfresh", 0, (4, 3), np.float32))
    o = k.to(np.zeros((4, 3), np.float32))
    synced(mpicomm.all_reduce(wide[:, ::2], out=o), k)   # a reused call, a non-contiguous input
    close(k.host(o), np.sum(all_data("gfresh", 0, (4, 3), np.float32), axis=0))
    buf = k.to(np.zeros(13, np.float32))
    with pytest.raises(mpicomm.InvalidArgumentError, match="overlaps x"):
        mpicomm.all_reduce(buf[:12].reshape(4, 3), out=buf[1:13].reshape(4, 3))


@pytest.mark.parametrize("which", ["world", "sub"])
def test_gpu_bool_reduces_and_int16_moves(nccl, which, request):
    """On real NCCL, CuPy arrays and PyTorch tensors: bool reduces as torch.distributed does
    (SUM/MAX logical OR, PROD/MIN logical AND, bytes 0 and 1 only); int16 and uint16 move
    through all_gather, all_to_all and broadcast as bytes; their reductions, and bool's AVG,
    are refused on every rank naming the dtype, and the group goes on. Data and expectations:
    tests/test_bool_int16.py (rank-seeded, computed with NumPy)."""
    from test_bool_int16 import expect, same, vals
    from test_errors import raises_everywhere

    group = None if which == "world" else nccl
    world = members(group)
    me_w = mpicomm.get_rank()
    if me_w not in world:
        return
    me, n = mpicomm.get_rank(group), len(world)
    for k in kinds():
        key = f"{request.node.name}{k.name}"
        for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX):
            xs = [vals(w, key + op.value, (2 * n, 3), bool) for w in world]
            full = expect(xs, op)
            x = k.to(xs[world.index(me_w)])
            same(k.host(synced(mpicomm.all_reduce(x, op, group=group), k)), full)
            same(k.host(synced(mpicomm.reduce_scatter(x, op, group=group), k)), full[2 * me:2 * me + 2])
            same(k.host(x), xs[world.index(me_w)])
        for dt in (np.int16, np.uint16, np.bool_):
            if k.name == "torch" and dt is np.uint16:
                continue   # (PyTorch's uint16 is a limited dtype: not tried here)
            kk = f"{key}{np.dtype(dt).name}"
            xs = [vals(w, kk, (2 * n, 2), dt) for w in world]
            x = k.to(xs[world.index(me_w)])
            same(k.host(synced(mpicomm.all_gather(x, group=group), k)), np.concatenate(xs))
            same(k.host(synced(mpicomm.all_to_all(x, group=group), k)),
                 np.concatenate([a[2 * me:2 * me + 2] for a in xs]))
            b = k.to(xs[world.index(me_w)])
            synced(mpicomm.broadcast(b, root=n - 1, group=group), k)
            same(k.host(b), xs[-1])
        if group is not None:
            continue   # (the refusals on the world: raises_everywhere compares over every rank)
        h = k.to(vals(me_w, key + "h", (4,), np.int16))
        raises_everywhere(mpicomm.InvalidArgumentError, lambda: mpicomm.all_reduce(h, group=group),
                          "invalid x.dtype='int16'", "cast to int32")
        t = k.to(vals(me_w, key + "t", (4,), bool))
        raises_everywhere(mpicomm.InvalidArgumentError, lambda: mpicomm.all_reduce(t, ReduceOp.AVG, group=group),
                          "invalid op='avg'", "dtype bool")
        xs = [vals(w, key + "after", (3,), bool) for w in world]   # in step after the refusals
        same(k.host(synced(mpicomm.all_reduce(k.to(xs[world.index(me_w)]), group=group), k)),
             expect(xs, ReduceOp.SUM))


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_gpu_avg_of_a_large_count_not_a_multiple_of_4(nccl, dt, request):
    """AVG of 1 MiB and more whose count is not a multiple of 4 (NCCL 2.28's ncclAvg on a
    one-rank communicator leaves the last elements unwritten there), every element checked,
    all_reduce, reduce_scatter and reduce, CuPy and PyTorch."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    count = n * (131075 if dt == "float64" else 262147)
    for k in kinds():
        xs = [data(r, f"{request.node.name}{k.name}", (count,), np.dtype(dt)) for r in range(n)]
        want = np.mean(np.stack(xs), axis=0)
        x = k.to(xs[me])
        close(k.host(synced(mpicomm.all_reduce(x, ReduceOp.AVG), k)), want)
        c = count // n
        close(k.host(synced(mpicomm.reduce_scatter(x, ReduceOp.AVG), k)), want[me * c:(me + 1) * c])
        red = synced(mpicomm.reduce(x, ReduceOp.AVG, root=n - 1), k)
        if me == n - 1:
            close(k.host(red), want)
