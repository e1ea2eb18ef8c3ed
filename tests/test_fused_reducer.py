"""reducer(grads)'s fused path: each bucket packed by one copy launch into a result buffer
that is reduced in place; result buffers are reused only once nothing outside holds them
(the results, views derived from them, exports). NumPy over MPI here; CuPy arrays on the
NCCL backend (the multi-tensor copy kernel) where a GPU is."""
import numpy as np
import pytest

import mpicomm
from conftest import rank_rng
from launch_support import TORCH, require_module

pytestmark = pytest.mark.mpi

SHAPES = [(3, 4), (5,), (2, 2, 3), (1,), (7, 3)]


def grads_of(q, k, name, xp=np, dtype=np.float64):
    g = rank_rng(q, f"{name}-{k}")
    return [xp.asarray(g.standard_normal(s).astype(dtype)) for s in SHAPES]


def want_of(n, k, name, dtype=np.float64):
    return [sum(grads_of(q, k, name, dtype=dtype)[i].astype(np.float64) for q in range(n)) for i in range(len(SHAPES))]


def check_results_survive(xp, get, name, cap, dtype=np.float64):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    red = mpicomm.DistributedGradReducer([xp.zeros(s, dtype) for s in SHAPES], mean=False, bucket_cap_mb=cap)
    if dtype == np.float64:
        tol = dict(rtol=1e-12, atol=1e-12)
    elif dtype == np.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    else:  # float16: NCCL rounds after each of its additions; MPI sums in float32 and rounds once
        tol = dict(rtol=n * 2.0 ** -10, atol=n * 2.0 ** -10 * 4)
    a = red(grads_of(r, 1, name, xp, dtype))
    b = red(grads_of(r, 2, name, xp, dtype))  # a is still held: its buffers must not be reused
    for got, w in zip(a, want_of(n, 1, name, dtype)):
        np.testing.assert_allclose(get(got), w, **tol)
    keep = b[2][1:]  # a view derived from b
    del a
    c = red(grads_of(r, 3, name, xp, dtype))  # a's buffers are free again
    del b
    d = red(grads_of(r, 4, name, xp, dtype))  # b's results are dropped, but `keep` still looks at them
    np.testing.assert_allclose(get(keep), want_of(n, 2, name, dtype)[2][1:], **tol)
    for res, k in ((c, 3), (d, 4)):
        for got, w, s in zip(res, want_of(n, k, name, dtype), SHAPES):
            assert got.shape == s
            np.testing.assert_allclose(get(got), w, **tol)
    return red


@pytest.mark.parametrize("cap", [25.0, 0, 100 / 2 ** 20])
def test_results_survive_later_calls_numpy(comm, cap, request):
    check_results_survive(np, lambda a: a, request.node.name, cap)


@pytest.mark.parametrize("cap", [25.0, 0, 100 / 2 ** 20])
def test_results_survive_later_calls_torch_cpu(comm, cap, request):
    """PyTorch tensors: a result buffer is reused only when no tensor shares its storage
    (PyTorch's own count of the storage's references), so held results, derived views and
    exports stay intact."""
    torch = require_module("torch", TORCH)
    if comm.get_backend() != "mpi":
        pytest.skip("CPU tensors: the MPI backend")

    class T:  # grads_of's xp for CPU tensors
        asarray = staticmethod(lambda a: torch.from_numpy(np.ascontiguousarray(a)))
        zeros = staticmethod(lambda s, dt: torch.zeros(s, dtype=torch.float64))

    check_results_survive(T, lambda a: a.numpy(), request.node.name, cap)


def test_dropped_torch_results_are_reused(comm, request):
    """The point of keeping result buffers: once every result of a call is dropped, the
    next call packs into the same memory (no new views to make); a result still held
    anywhere (here a view of a view) keeps its buffer out of reuse."""
    torch = require_module("torch", TORCH)
    from mpicomm.training.results import _torch_storage_use_count

    if comm.get_backend() != "mpi":
        pytest.skip("CPU tensors: the MPI backend")
    assert _torch_storage_use_count() is not None, "this PyTorch has no torch._C._storage_Use_Count"
    n, r = comm.get_group_size(), comm.get_rank()
    red = mpicomm.DistributedGradReducer([torch.zeros(s, dtype=torch.float64) for s in SHAPES], mean=False)

    def step(k):
        return red([torch.from_numpy(g) for g in grads_of(r, k, request.node.name)])

    a = step(1)
    ptr = a[0].data_ptr()
    del a
    b = step(2)
    assert b[0].data_ptr() == ptr  # reused
    keep = b[2][1:][0]   # a view of a view: no Python reference to b's tensors
    del b
    c = step(3)
    assert c[0].data_ptr() != ptr  # b's buffer is still looked at through `keep`
    np.testing.assert_allclose(keep.numpy(), want_of(n, 2, request.node.name)[2][1:][0], rtol=1e-12)
    for got, w in zip(c, want_of(n, 3, request.node.name)):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-12, atol=1e-12)


def test_grad_views_given_to_call_are_left_alone(comm, request):
    n, r = comm.get_group_size(), comm.get_rank()
    red = mpicomm.DistributedGradReducer([np.zeros(s) for s in SHAPES], mean=True)
    views = red.grad_views()
    mine = grads_of(r, 0, request.node.name)
    for v, g in zip(views, mine):
        v[...] = g
    out = red(views)
    for got, w in zip(out, want_of(n, 0, request.node.name)):
        np.testing.assert_allclose(got, w / n, rtol=1e-12, atol=1e-12)
        assert not any(np.shares_memory(got, v) for v in views)


@pytest.fixture(scope="module")
def cupy_nccl(comm):
    if mpicomm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [25.0, 0, 100 / 2 ** 20])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_results_survive_later_calls_cupy(cupy_nccl, cap, dtype, request):
    check_results_survive(cupy_nccl, lambda a: a.get(), request.node.name, cap, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    [1, 3, 16, 17, 1000, (1 << 18) + 5, 2 * (1 << 18), 7],      # every alignment, 1 to 16 bytes
    [16, 4096, 1 << 18, (1 << 18) + 16 * 7, 48, 16 * 1023],     # 16-byte aligned: the unrolled path
    [4, 8, 4 * 100003, 12],                                     # 4-byte aligned
], ids=["mixed", "aligned16", "aligned4"])
def test_multi_copy_kernel_odd_sizes(cupy_nccl, rng, sizes):
    """The copy kernel over buffers of every alignment (1-byte to 16-byte) and sizes
    across its 256 KiB chunks, both ways."""
    cp = cupy_nccl
    from mpicomm.training.families import CUPY

    arrays = [cp.asarray(rng.integers(0, 255, s, dtype=np.uint8)) for s in sizes]
    flat = cp.zeros(sum(sizes), np.uint8)
    CUPY.pack(flat, arrays)
    np.testing.assert_array_equal(flat.get(), np.concatenate([a.get() for a in arrays]))
    back = [cp.zeros_like(a) for a in arrays]
    offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    CUPY.copy_out(back, [flat[o:o + s] for o, s in zip(offs, sizes)])
    for a, b in zip(arrays, back):
        np.testing.assert_array_equal(a.get(), b.get())


def check_direct(xp, to_dev, get, name, mean, low, monkeypatch, mode="call"):
    """reducer(grads) on NCCL reduces each gradient of 4 MiB or more (``low``: 64 bytes, so
    that small arrays take the path too) straight from the caller's array into its place
    in the result, and packs only the smaller ones. The same calls on every rank even where
    one rank's big gradient is not contiguous (it is copied into place first); the inputs
    stay as they were; earlier results stay intact."""
    from mpicomm.training import layout

    if low:
        monkeypatch.setattr(layout, "_DIRECT_MIN_BYTES", 64)
        shapes = [(6, 5), (5,), (40, 30), (4,), (30, 7), (3,)]
    else:
        shapes = [(3,), (1100, 1000), (5, 7), (1024, 1025), (9,)]
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()

    def host(q, k):
        g = rank_rng(q, f"{name}-{k}")
        return [g.standard_normal(s).astype(np.float32) for s in shapes]

    def dev(q, k):
        out = []
        for j, h in enumerate(host(q, k)):
            if h.ndim == 2 and (q + j) % 2:  # on some ranks a transposed (non-contiguous) array
                out.append(to_dev(np.ascontiguousarray(h.T)).T)
            else:
                out.append(to_dev(h))
        return out

    red = mpicomm.DistributedGradReducer([to_dev(np.zeros(s, np.float32)) for s in shapes], mean=mean)
    assert any(b.direct for b in red._buckets)
    if mode == "reduce_":  # in place (packed and copied back; the calls are the buckets')
        g = dev(r, 1)
        out = red.reduce_(g)
        assert out is g
        for j, got in enumerate(g):
            want = sum(host(q, 1)[j].astype(np.float64) for q in range(n)) / (n if mean else 1)
            np.testing.assert_allclose(get(got), want, rtol=1e-5, atol=1e-5 * n)
        return
    g1 = dev(r, 1)
    before = [get(g).copy() for g in g1]
    a = red(g1)
    b = red(dev(r, 2))
    for k, res in ((1, a), (2, b)):
        for j, got in enumerate(res):
            want = sum(host(q, k)[j].astype(np.float64) for q in range(n)) / (n if mean else 1)
            assert got.shape == shapes[j]
            np.testing.assert_allclose(get(got), want, rtol=1e-5, atol=1e-5 * n)
    for g, h in zip(g1, before):
        np.testing.assert_array_equal(get(g), h)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["call", "reduce_"])
@pytest.mark.parametrize("low", [False, True], ids=["4MiB", "64B"])
@pytest.mark.parametrize("mean", [False, True])
def test_big_gradients_reduced_where_they_are_cupy(cupy_nccl, mean, low, mode, monkeypatch, request):
    check_direct(cupy_nccl, cupy_nccl.asarray, lambda a: a.get(), request.node.name, mean, low, monkeypatch, mode)
