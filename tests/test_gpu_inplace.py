"""In place and NaN on the NCCL backend (GPU arrays): all_to_all(x, out=x) and the other
collectives' out=x / out= a view of exactly x's memory, on CuPy arrays and PyTorch CUDA
tensors; out= overlapping x refused on every rank; and what NCCL's MIN/MAX do with NaN,
recorded (printed, and written as JSON to $MPICOMM_NAN_RECORD when set) and checked to be
the same on every rank. Skipped (on every rank alike) where the backend is not NCCL."""
import json
import os
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


@pytest.fixture(scope="module")
def nccl(comm):
    if mpicomm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    return True


def of(r, key, count, dt=np.float32):
    g = np.random.default_rng([r, zlib.crc32(key.encode())])
    return (g.integers(1, 4, count) * g.choice([-1, 1], count)).astype(dt)


def to_gpu(kind, a):
    if kind == "cupy":
        import cupy

        return cupy.asarray(a)
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def host(a):
    if type(a).__module__.startswith("torch"):
        return a.cpu().numpy()
    return a.get()


def view_of(kind, x):
    return x.view() if kind == "cupy" else x.view(x.shape)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_all_to_all_in_place(nccl, kind):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for i, rows in enumerate([1, 3, 1000, 70000]):
        key = f"a2a{kind}{i}"
        for mode in ("x", "view"):
            x = to_gpu(kind, of(r, key, n * rows * 2).reshape(n * rows, 2))
            out = x if mode == "x" else view_of(kind, x)
            res = mpicomm.all_to_all(x, out=out)
            assert res is out
            exp = np.concatenate([of(j, key, n * rows * 2).reshape(n * rows, 2)[r * rows:(r + 1) * rows]
                                  for j in range(n)])
            np.testing.assert_array_equal(host(x), exp)
    # async in place
    x = to_gpu(kind, of(r, "a2a-async", n * 8))
    w = mpicomm.all_to_all(x, out=x, async_op=True)
    assert w.wait() is x
    np.testing.assert_array_equal(host(x), np.concatenate([of(j, "a2a-async", n * 8)[r * 8:(r + 1) * 8]
                                                          for j in range(n)]))


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_reduce_and_all_reduce_in_place(nccl, kind):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
        s = np.stack([of(j, f"ar{op}", 100) for j in range(n)])
        exp = {ReduceOp.SUM: s.sum(0), ReduceOp.MAX: s.max(0), ReduceOp.AVG: s.sum(0) / n}[op].astype(np.float32)
        for mode in ("x", "view"):
            x = to_gpu(kind, of(r, f"ar{op}", 100))
            out = x if mode == "x" else view_of(kind, x)
            assert mpicomm.all_reduce(x, op, out=out) is out
            np.testing.assert_allclose(host(x), exp, rtol=1e-6)
        for root in range(n):
            x = to_gpu(kind, of(r, f"ar{op}", 100))
            res = mpicomm.reduce(x, op, root=root, out=x)
            if r == root:
                assert res is x
                np.testing.assert_allclose(host(x), exp, rtol=1e-6)
            else:
                assert res is None


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_overlapping_out_refused_everywhere(nccl, kind):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    buf = to_gpu(kind, of(r, "ov", 4 * n + 2))
    x, out = buf[:4 * n], buf[1:4 * n + 1]
    for call in (lambda: mpicomm.all_reduce(x, out=out), lambda: mpicomm.all_to_all(x, out=out),
                 lambda: mpicomm.reduce(x, out=out, root=n - 1)):
        with pytest.raises(InvalidArgumentError, match="overlaps x"):
            call()
    np.testing.assert_array_equal(host(buf), of(r, "ov", 4 * n + 2))


@pytest.mark.parametrize("dt", ["float32", "float16", "float64"])
def test_nccl_min_max_with_nan_recorded(nccl, dt):
    """Records what NCCL's MIN/MAX give where one rank's element is NaN: 'propagate' (NaN,
    as NumPy's maximum), 'ignore' (the other ranks' extreme, as fmax), or 'mixed' (either,
    by position or rank). Asserts the answer is the same on every rank and, where no NaN is
    involved, the exact extreme."""
    import cupy

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    count = 4096

    def data(j):
        v = np.random.default_rng([j, 11]).standard_normal(n * count)
        v[j::n + 1] = np.nan          # rank j's NaNs: positions j, j + n + 1, ...
        return v.astype(dt)

    record = {}
    for op, uf, ig in ((ReduceOp.MAX, np.maximum, np.fmax), (ReduceOp.MIN, np.minimum, np.fmin)):
        got = mpicomm.all_reduce(cupy.asarray(data(r)), op).get().astype(np.float64)
        arrs = [data(j).astype(np.float64) for j in range(n)]
        prop, ign = arrs[0], arrs[0]
        for a in arrs[1:]:
            prop, ign = uf(prop, a), ig(ign, a)
        nan_at = np.isnan(prop)
        clean = ~nan_at
        np.testing.assert_array_equal(got[clean], prop[clean])
        kept = np.isnan(got[nan_at])
        all_nan = np.isnan(ign)   # (every rank NaN there: NaN whatever the rule)
        if kept.all():
            rule = "propagate"
        elif not kept[~all_nan[nan_at]].any() and np.array_equal(got[nan_at & ~all_nan], ign[nan_at & ~all_nan]):
            rule = "ignore"
        else:
            rule = "mixed"
        record[op.value] = {"rule": rule, "nan_positions": int(nan_at.sum()), "nan_kept": int(kept.sum())}
        g = mpicomm._state.CTX.world.mpi_comm
        digests = g.allgather(got.tobytes())
        assert all(d == digests[0] for d in digests), "NCCL's MIN/MAX answer differs between ranks"
    from cupy.cuda import nccl as _nccl

    line = {"dtype": dt, "ranks": n, "nccl": _nccl.get_version(), **record}
    if r == 0:
        print("NCCL NaN rule:", json.dumps(line))
        path = os.environ.get("MPICOMM_NAN_RECORD")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
