"""What every data-parallel loop needs beside the reducer (docs/PORTING.md, "Every
framework"): a loss or metric averaged for logging (mpicomm.average), gradient
accumulation with DistributedGradReducer.no_sync(), and a checkpoint saved on rank 0 and
given to every rank (mpicomm.broadcast_state). Rank-dependent random data; the
expectations are computed here from every rank's data, not by the code under test."""
import numpy as np
import pytest

import mpicomm
from launch_support import TORCH, require_module
from mpicomm import InvalidArgumentError
from mpicomm.training.context import reset_auto_parallel_context

SHAPES = [(5,), (3, 4), (2,)]


@pytest.fixture(autouse=True)
def _fresh():
    reset_auto_parallel_context()
    yield
    reset_auto_parallel_context()


def _draw(seed, rank, step, shapes=SHAPES, dtype=np.float64):
    g = np.random.default_rng([seed, rank, step])
    return [g.standard_normal(s).astype(dtype) for s in shapes]


# ---------------------------------------------------------------- average

@pytest.mark.mpi
def test_average_of_a_number_and_of_arrays(comm):
    n, r = comm.get_group_size(), comm.get_rank()
    losses = [float(np.random.default_rng([1, q]).uniform(0.1, 5.0)) for q in range(n)]
    got = mpicomm.average(losses[r])
    assert isinstance(got, float) and got == pytest.approx(sum(losses) / n, rel=1e-14)
    assert mpicomm.average(np.float32(losses[r])) == pytest.approx(sum(np.float32(v) for v in losses) / n, rel=1e-6)
    counts = [int(np.random.default_rng([2, q]).integers(0, 100)) for q in range(n)]
    assert mpicomm.average(counts[r]) == pytest.approx(sum(counts) / n, rel=1e-14)
    metric = [np.random.default_rng([3, q]).standard_normal((2, 3)) for q in range(n)]
    mine = metric[r].copy()
    out = mpicomm.average(mine)
    np.testing.assert_allclose(out, sum(metric) / n, rtol=1e-13)
    np.testing.assert_array_equal(mine, metric[r])                 # a new array: x is left as it is
    hits = [np.random.default_rng([4, q]).integers(0, 10, 4) for q in range(n)]
    np.testing.assert_allclose(mpicomm.average(hits[r]), sum(h.astype(np.float64) for h in hits) / n, rtol=1e-14)


@pytest.mark.mpi
def test_average_of_a_torch_loss_that_requires_grad(comm):
    torch = require_module("torch", TORCH)
    n, r = comm.get_group_size(), comm.get_rank()
    vals = [float(np.random.default_rng([5, q]).uniform(0.5, 2.0)) for q in range(n)]
    w = torch.tensor(vals[r], dtype=torch.float64, requires_grad=True)
    loss = w * 3.0
    got = mpicomm.average(loss)
    assert isinstance(got, torch.Tensor) and not got.requires_grad
    assert got.item() == pytest.approx(3.0 * sum(vals) / n, rel=1e-13)
    assert mpicomm.average(loss.item()) == pytest.approx(3.0 * sum(vals) / n, rel=1e-13)


@pytest.mark.parametrize("bad", [True, "1.0", [1.0, 2.0], None])
@pytest.mark.mpi
def test_average_refuses_what_is_not_a_number_or_an_array(comm, bad):
    with pytest.raises(InvalidArgumentError, match=r"invalid x=.*a number .*or an array"):
        mpicomm.average(bad)


# ---------------------------------------------------------------- gradient accumulation: no_sync

def _want(n, seed, steps, mean):
    total = [sum(_draw(seed, q, k)[i] for q in range(n) for k in range(steps)) for i in range(len(SHAPES))]
    return [t / n for t in total] if mean else total


@pytest.mark.mpi
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("how", ["call", "reduce_", "mark_ready"])
def test_no_sync_accumulates_and_the_next_step_reduces_the_sum(comm, mean, how):
    """k - 1 micro-batches inside no_sync(), the k-th outside: the reduced gradients are
    the sum of every rank's k micro-batch gradients (divided by the ranks with mean)."""
    n, r = comm.get_group_size(), comm.get_rank()
    steps, seed = 3, 17
    red = comm.DistributedGradReducer([np.zeros(s) for s in SHAPES], mean=mean)
    for rnd in range(2):                                   # twice: the sum is forgotten after each
        s = seed + rnd
        with red.no_sync():
            for k in range(steps - 1):
                mine = _draw(s, r, k)
                given = [g.copy() for g in mine]
                back = red(given) if how != "reduce_" else red.reduce_(given)
                for b, m in zip(back, mine):
                    np.testing.assert_array_equal(b, m)   # not reduced: no communication
        last = _draw(s, r, steps - 1)
        if how == "call":
            got = red(last)
        elif how == "reduce_":
            got = red.reduce_(last)
        else:
            for i in reversed(range(len(last))):
                red.mark_ready(i, last[i])
            got = red.wait()
        for g, w in zip(got, _want(n, s, steps, mean)):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    # and a step with no block before it reduces only its own gradients
    plain = _draw(99, r, 0)
    got = red(plain)
    for i, g in enumerate(got):
        want = sum(_draw(99, q, 0)[i] for q in range(n))
        np.testing.assert_allclose(g, want / n if mean else want, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi
def test_no_sync_with_torch_gradients(comm):
    torch = require_module("torch", TORCH)
    n, r = comm.get_group_size(), comm.get_rank()
    red = comm.DistributedGradReducer([torch.zeros(s, dtype=torch.float64) for s in SHAPES], mean=True)
    with red.no_sync():
        red([torch.from_numpy(g) for g in _draw(23, r, 0)])
        red([torch.from_numpy(g) for g in _draw(23, r, 1)])
    got = red([torch.from_numpy(g) for g in _draw(23, r, 2)])
    for g, w in zip(got, _want(n, 23, 3, True)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi
def test_mark_ready_inside_no_sync_raises_on_every_rank(comm):
    red = comm.DistributedGradReducer([np.zeros(s) for s in SHAPES])
    with red.no_sync():
        with pytest.raises(InvalidArgumentError, match=r"mark_ready\(\) inside no_sync\(\)"):
            red.mark_ready(0, np.zeros(SHAPES[0]))
        with pytest.raises(InvalidArgumentError, match=r"invalid grads\[1\]"):
            red([np.zeros(SHAPES[0]), np.zeros((4, 3)), np.zeros(SHAPES[2])])
    r = comm.get_rank()
    got = red(_draw(31, r, 0))                               # nothing was accumulated: a plain step
    for i, g in enumerate(got):
        np.testing.assert_allclose(g, sum(_draw(31, q, 0)[i] for q in range(comm.get_group_size())), rtol=1e-12)


# ---------------------------------------------------------------- checkpoints: save on rank 0, load, give to all

def _shared_dir(comm, tmp_path):
    """One folder for every rank of the job (rank 0's tmp_path; the ranks share a host)."""
    return mpicomm.broadcast_object(str(tmp_path), root=0)


def _state(rank):
    g = np.random.default_rng([41, rank])
    return {"w": g.standard_normal((4, 3)), "b": g.standard_normal(3).astype(np.float32),
            "step": np.array(int(g.integers(1, 1000)))}


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["ckpt.npz", "ckpt.pkl"])
def test_save_on_rank0_then_load_gives_every_rank_rank_0s_state(comm, tmp_path, name):
    import os

    r = comm.get_rank()
    path = os.path.join(_shared_dir(comm, tmp_path), name)
    mine = _state(r)                                          # every rank's own state; only rank 0's is kept
    assert mpicomm.save_on_rank0(mine, path) is (r == 0)
    assert os.path.exists(path)                               # written before any rank returns
    got = mpicomm.load_on_rank0(path)
    want = _state(0)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
        assert np.asarray(got[k]).dtype == want[k].dtype
    mpicomm.barrier()


@pytest.mark.mpi
def test_torch_model_resumes_from_rank_0s_checkpoint(comm, tmp_path):
    torch = require_module("torch", TORCH)
    import functools
    import os

    r = comm.get_rank()
    path = os.path.join(_shared_dir(comm, tmp_path), "model.pt")
    torch.manual_seed(100 + r)                                # every rank a different model
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    mpicomm.save_on_rank0(model.state_dict(), path, save=torch.save)
    torch.manual_seed(200 + r)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    fresh.load_state_dict(mpicomm.load_on_rank0(path, load=functools.partial(torch.load, map_location="cpu")))
    torch.manual_seed(100)                                    # rank 0's model, drawn again here
    want = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    for a, b in zip(fresh.state_dict().values(), want.state_dict().values()):
        assert torch.equal(a, b)
    mpicomm.barrier()


@pytest.mark.mpi
def test_checkpoint_errors_are_raised_on_every_rank(comm, tmp_path):
    import os

    d = _shared_dir(comm, tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"load_on_rank0: rank 0 could not read .*missing\.npz.*"
                                                   r"(FileNotFoundError|No such file)"):
        mpicomm.load_on_rank0(os.path.join(d, "missing.npz"))
    with pytest.raises(InvalidArgumentError, match=r"save_on_rank0: rank 0 could not write .*nodir"):
        mpicomm.save_on_rank0(_state(0), os.path.join(d, "nodir", "x.npz"))
    with pytest.raises(InvalidArgumentError, match=r"save_on_rank0: rank 0 could not write .*invalid state=<list>"):
        mpicomm.save_on_rank0([1, 2], os.path.join(d, "x.npz"))
    with pytest.raises(InvalidArgumentError, match=r"invalid path=3"):
        mpicomm.load_on_rank0(3)
    with pytest.raises(InvalidArgumentError, match=r"invalid root=.*a rank of the group"):
        mpicomm.save_on_rank0({}, os.path.join(d, "y.pkl"), root=comm.get_group_size())
    mpicomm.barrier()
