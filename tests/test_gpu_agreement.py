"""The agreement check on the NCCL backend, with CuPy arrays and PyTorch CUDA tensors: the
same contract as test_agreement.py (every rank raises in the call or its next one, within
2 s; the next call is right). An NCCL call returns once queued, so a rank may return
before the report and raise it in its next call, as documented. Skipped (on every rank
alike) where the backend is not NCCL; run on the lent GPU machine."""
import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError
from test_agreement import _other, _run_case

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


@pytest.fixture(scope="module")
def gpu(comm):
    if mpicomm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    if mpicomm.get_group_size() < 2:
        pytest.skip("a disagreement needs two ranks")
    if not mpicomm._state.CTX.check:
        pytest.skip("the agreement check is off: MPICOMM_CHECK=0 in this run")
    # both array kinds once first: their first use (a CUDA context for PyTorch, NCCL's setup)
    # takes seconds, which the 2 s limit on a report is not about
    for kind in ("cupy", "torch"):
        mpicomm.all_reduce(_dev(kind, np.ones(4, np.float32)))
        mpicomm.all_reduce(_dev(kind, np.ones(4, np.float32)), out=_dev(kind, np.empty(4, np.float32)))
    return mpicomm.get_group_size(), mpicomm.get_rank()


def _dev(kind, a):
    if kind == "cupy":
        import cupy

        return cupy.asarray(a)
    import torch

    return torch.as_tensor(a, device="cuda")


def _host(a):
    if a is None:
        return None
    return a.get() if hasattr(a, "get") and not hasattr(a, "cpu") else a.cpu().numpy()


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "broadcast", "reduce_scatter"])
def test_dtype_disagreement_on_the_gpu(gpu, kind, coll):
    n, r = gpu
    bad = _other(n, 21)
    root = (bad + 1) % n
    dt = np.int32 if r == bad else np.float32
    h = (np.random.default_rng(r).standard_normal(4 * n) * 10).astype(dt)
    x = _dev(kind, h)
    call = {"all_reduce": lambda: mpicomm.all_reduce(x), "all_gather": lambda: mpicomm.all_gather(x),
            "broadcast": lambda: mpicomm.broadcast(x, root=root),
            "reduce_scatter": lambda: mpicomm.reduce_scatter(x)}[coll]

    def ok(res):   # an NCCL call returns once queued, before any report: the next call raises
        return True

    _run_case(n, r, call, 3000, returns_ok=ok)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_refusal_on_one_rank_on_the_gpu(gpu, kind):
    """A bad op on one rank (refused before NCCL sees the call) and a wrong out= (refused in
    the call's checks): the others raise naming the rank, the rank its own error; the
    refusing rank stands in with a scratch GPU buffer, so nothing is left queued."""
    n, r = gpu
    bad = _other(n, 22)
    x = _dev(kind, np.random.default_rng(r).standard_normal(6).astype(np.float32))
    err = _run_case(n, r, lambda: mpicomm.all_reduce(x, op="median" if r == bad else "sum"), 3100,
                    returns_ok=lambda res: r != bad)   # the refusing rank raises at once
    assert isinstance(err, InvalidArgumentError) and "median" in str(err), err
    out = _dev(kind, np.zeros(5 if r == bad else 6, np.float32))
    _run_case(n, r, lambda: mpicomm.all_reduce(x, out=out), 3200, returns_ok=lambda res: r != bad)


def test_randomized_on_the_gpu(gpu):
    n, r = gpu
    rng = np.random.default_rng(2027)
    for c in range(40):
        coll = ("all_reduce", "all_gather", "broadcast", "reduce_scatter")[rng.integers(4)]
        kind = ("cupy", "torch")[rng.integers(2)]
        bad = int(rng.integers(n))
        refuse = bool(rng.integers(2))
        k = int(rng.integers(1, 9))
        root = (bad + 1) % n
        dt = np.int32 if (r == bad and not refuse) else np.float32
        h = (np.random.default_rng([c, r]).standard_normal(k * n) * 100).astype(dt)
        x = _dev(kind, h)
        op = "bogus" if (refuse and r == bad) else "sum"
        if refuse and coll in ("all_gather", "broadcast"):
            coll = "all_reduce"
        call = {"all_reduce": lambda: mpicomm.all_reduce(x, op=op),
                "all_gather": lambda: mpicomm.all_gather(x),
                "broadcast": lambda: mpicomm.broadcast(x, root=root),
                "reduce_scatter": lambda: mpicomm.reduce_scatter(x, op=op)}[coll]

        def ok(res, refuse=refuse):   # queued before the report (the next call raises); a refusing rank raises
            return not (refuse and r == bad)

        _run_case(n, r, call, 4000 + 10 * c, returns_ok=ok)
