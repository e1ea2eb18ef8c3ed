"""Data-parallel training equals single-process training; the example script end to end;
the MNIST IDX reader."""
import importlib.util
import os
import re
import shutil
import sys

import numpy as np
import pytest
from conftest import ROOT, clean_mpi_env, mpirun_argv, run_job
from launch_support import SKLEARN, require_module

import mpicomm
from mpicomm import InvalidArgumentError

SCRIPT = os.path.join(ROOT, "scripts", "train_data_parallel.py")
sys.path.insert(0, os.path.dirname(SCRIPT))  # the example's data set reader, scripts/datasets.py
from datasets import load_mnist, read_idx, write_idx  # noqa: E402


def _script():
    spec = importlib.util.spec_from_file_location("train_data_parallel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines functions only: main() runs under __main__
    return mod


# ---------------------------------------------------------------- equivalence

B, K, SIZES, LR = 24, 6, [10, 12, 8, 4], 0.1
PLANS = {
    "blocking": dict(kw=dict(), overlap=False),
    "overlapped": dict(kw=dict(), overlap=True),
    "single_bucket": dict(kw=dict(bucket_cap_mb=None), overlap=True),
    "per_tensor": dict(kw=dict(bucket_cap_mb=0), overlap=True),
    "small_buckets_blocking": dict(kw=dict(bucket_cap_mb=400 / 2 ** 20), overlap=False),
    "fusion_config": dict(kw=dict(fusion_config=[1, 3]), overlap=True),
}


def _data(seed=7):
    g = np.random.default_rng(seed)
    x = g.standard_normal((K * B, SIZES[0]))
    y = g.integers(0, SIZES[-1], K * B)
    return x, y


def _reference(tr, x, y):
    """One process, the whole batch B at every step."""
    params = tr.init_params(SIZES, 0)
    grads = [np.zeros_like(p) for p in params]
    opt = tr.SGD(params, LR, 0.9)
    losses = []
    for k in range(K):
        s = slice(k * B, (k + 1) * B)
        losses.append(float(tr.loss_and_grads(params, x[s], y[s], grads)))
        opt.step(grads)
    return params, losses


@pytest.mark.mpi
@pytest.mark.parametrize("plan", list(PLANS))
def test_data_parallel_equals_single_process(comm, plan):
    n, r = comm.get_group_size(), comm.get_rank()
    if B % n:
        pytest.skip(f"the global batch {B} does not split over {n} ranks")
    tr = _script()
    x, y = _data()
    want, want_losses = _reference(tr, x, y)

    params = tr.init_params(SIZES, 0 if r == 0 else 100 + r)  # rank 0 has the reference model
    comm.broadcast_parameters(params, root=0)
    red = comm.DistributedGradReducer(params, mean=True, **PLANS[plan]["kw"])
    grads = red.grad_views()
    opt = tr.SGD(params, LR, 0.9)
    b = B // n
    loss_buf = np.zeros(1)
    for k in range(K):
        s = slice(k * B + r * b, k * B + (r + 1) * b)  # this rank's part of global batch k
        if PLANS[plan]["overlap"]:
            loss = tr.loss_and_grads(params, x[s], y[s], grads, ready=red.mark_ready)
            red.wait()
        else:
            loss = tr.loss_and_grads(params, x[s], y[s], grads)
            red.reduce_(grads)
        opt.step(grads)
        loss_buf[0] = loss
        comm.all_reduce(loss_buf, "avg", out=loss_buf)
        assert abs(loss_buf[0] - want_losses[k]) <= 1e-9 * abs(want_losses[k])
    for p, w in zip(params, want):
        rel = np.max(np.abs(p - w)) / np.max(np.abs(w))
        assert rel <= 1e-9, (plan, rel)
    assert not np.allclose(want[0], tr.init_params(SIZES, 0)[0])  # training moved the weights


# ---------------------------------------------------------------- the script end to end

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None and not os.path.exists(mpirun_argv(1)[0]),
                                  reason="no mpirun")
LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\d+\.\d+)$")


def _run(args, extra_env=None, timeout=180):
    env = clean_mpi_env(dict(MPICOMM_BACKEND="mpi", **(extra_env or {})))
    env.pop("DATA_PATH", None)
    if extra_env and "DATA_PATH" in extra_env:
        env["DATA_PATH"] = extra_env["DATA_PATH"]
    p, _ = run_job(mpirun_argv(2, SCRIPT, *args), env, timeout, cwd=ROOT)
    return p


@needs_mpirun
def test_script_trains_digits_at_two_ranks():
    require_module("sklearn", SKLEARN)
    p = _run(["--epochs", "8", "--min-accuracy", "0.9"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    steps = [LINE.match(s) for s in lines if s.startswith("epoch:")]
    assert steps and all(steps), lines[:5]
    assert {int(m.group(1)) for m in steps} == set(range(1, 9))
    losses = [float(m.group(3)) for m in steps]
    assert losses[-1] < losses[0]
    acc = [s for s in lines if s.startswith("held-out accuracy:")]
    assert len(acc) == 1, lines  # rank 0 only
    assert float(acc[0].split()[2]) >= 0.9


def _fake_mnist(d, n_train=300, n_test=100, seed=0):
    """Tiny IDX files in MNIST's layout: 28x28 uint8 images of 10 separable patterns."""
    g = np.random.default_rng(seed)
    protos = g.integers(0, 256, (10, 28, 28))
    for name, n in (("train", n_train), ("t10k", n_test)):
        y = g.integers(0, 10, n).astype(np.uint8)
        x = np.clip(protos[y] + g.integers(-40, 40, (n, 28, 28)), 0, 255).astype(np.uint8)
        write_idx(os.path.join(d, f"{name}-images-idx3-ubyte.gz"), x)
        write_idx(os.path.join(d, f"{name}-labels-idx1-ubyte"), y)
    return d


@needs_mpirun
def test_script_reads_mnist_idx_from_data_path(tmp_path):
    d = _fake_mnist(str(tmp_path))
    p = _run(["--epochs", "3", "--hidden", "32", "--min-accuracy", "0.9"], dict(DATA_PATH=d))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "data 300 train / 100 test, layers [784, 32, 10]" in p.stdout


# ---------------------------------------------------------------- IDX files

@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, dtype, gz):
    a = (np.arange(2 * 3 * 4) * 7 - 20).reshape(2, 3, 4).astype(dtype)
    p = str(tmp_path / ("a.idx" + (".gz" if gz else "")))
    write_idx(p, a)
    b = read_idx(p)
    assert b.dtype == np.dtype(dtype) and b.shape == (2, 3, 4)
    np.testing.assert_array_equal(a, b)


def test_idx_header_is_mnists(tmp_path):
    p = tmp_path / "l.idx"
    write_idx(str(p), np.array([3, 1, 4], np.uint8))
    assert p.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 3, 3, 1, 4])


def test_idx_errors(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x01\x02\x08\x01")
    with pytest.raises(InvalidArgumentError, match="magic bytes"):
        read_idx(str(p))
    p.write_bytes(bytes([0, 0, 0x0A, 1, 0, 0, 0, 1, 0]))
    with pytest.raises(InvalidArgumentError, match=r"type code one of .*\(got 0x0A\)"):
        read_idx(str(p))
    p.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(InvalidArgumentError, match=r"5 bytes of data after the header for shape \(5,\) \(got 2\)"):
        read_idx(str(p))


def test_load_mnist(tmp_path):
    d = _fake_mnist(str(tmp_path), 20, 10)
    (xtr, ytr), (xte, yte) = load_mnist(d)
    assert xtr.shape == (20, 784) and xte.shape == (10, 784) and ytr.shape == (20,)
    assert xtr.dtype == np.float64 and 0 <= xtr.min() and xtr.max() <= 1 and ytr.dtype == np.int64
    os.remove(os.path.join(d, "t10k-labels-idx1-ubyte"))
    with pytest.raises(InvalidArgumentError, match="t10k-labels-idx1-ubyte"):
        load_mnist(d)
    with pytest.raises(InvalidArgumentError, match="DATA_PATH"):
        load_mnist(str(tmp_path / "missing"))


def test_reducer_is_public():
    assert mpicomm.DistributedGradReducer.__module__ == "mpicomm.training.reducer"
    assert mpicomm.all_reduce_coalesced.__module__ == "mpicomm.training.fused"
    from mpicomm.training import buckets  # the names it held before the split, re-exported

    assert buckets.DistributedGradReducer is mpicomm.DistributedGradReducer
    assert buckets.broadcast_parameters is mpicomm.broadcast_parameters
    assert callable(buckets.plan_buckets) and buckets.TORCH is not None
    assert mpicomm.DistributedSampler.__module__ == "mpicomm.training.sampler"
    assert mpicomm.set_auto_parallel_context.__module__ == "mpicomm.training.context"
