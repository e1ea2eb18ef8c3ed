"""Calls that differ between ranks are reported, not answered silently.

- The shared-memory path (mpicomm/_backends/shm.py) compares every rank's signature
  (collective, element count, dtype, op or root) at its first barrier: a difference raises
  CollectiveMismatchError on every rank, listing each rank's call, and the next matching
  call works (on the window's pieces, the tuner's Open MPI choice and the whole-message mode).
- An MPI truncation on one rank (a longer message than its call made room for) becomes
  CollectiveMismatchError naming the collective and MPICOMM_DEBUG=1 (a job of its own).
"""
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import CollectiveMismatchError, ReduceOp
from mpicomm._backends import shm as _shm

from conftest import clean_mpi_env, mpirun_argv, run_job, shm_groups
from conftest import shm_of as impl

THRESHOLD = 512
PIECE = 4096


@pytest.fixture(scope="module")
def groups(comm):
    yield from shm_groups("mm_rev", THRESHOLD)


def grank(g):
    return mpicomm.get_rank(g)


def gsize(g):
    return mpicomm.get_group_size(g)


def of(r, key, count, dt=np.float64):
    """Group rank r's random data (integers: sums are exact)."""
    return np.random.default_rng([r, zlib.crc32(key.encode())]).integers(-50, 50, count).astype(dt)


def rdata(g, key, count, dt=np.float64):
    """This rank's data and the sum over the group's ranks."""
    return of(grank(g), key, count, dt), sum(of(r, key, count, dt) for r in range(gsize(g)))


def calls(g, name):
    s = impl(g).group
    return 0 if s is None else s.calls[name]


# every case: (what this rank calls, given the group rank r and size n); the last rank differs
CASES = {
    "count": lambda r, n, x, g: mpicomm.all_reduce(x if r < n - 1 else np.concatenate([x, x[:64]]), group=g),
    "dtype": lambda r, n, x, g: mpicomm.all_reduce(x if r < n - 1 else x.astype(np.float32), group=g),
    "int_dtype": lambda r, n, x, g: mpicomm.all_reduce(x if r < n - 1 else x.astype(np.int64), group=g),
    "op": lambda r, n, x, g: mpicomm.all_reduce(x, ReduceOp.SUM if r < n - 1 else ReduceOp.MAX, group=g),
    "collective": lambda r, n, x, g: mpicomm.all_reduce(x, group=g) if r < n - 1
    else mpicomm.reduce_scatter(x, group=g),
    "broadcast_root": lambda r, n, x, g: mpicomm.broadcast(x, root=0 if r < n - 1 else 1, group=g),
    "all_gather_count": lambda r, n, x, g: mpicomm.all_gather(x if r < n - 1 else x[:-n], group=g),
}
DESC = {
    "count": ("all_reduce of {c} x float64, op sum", "all_reduce of {c2} x float64, op sum"),
    "dtype": ("all_reduce of {c} x float64, op sum", "all_reduce of {c} x float32, op sum"),
    "int_dtype": ("all_reduce of {c} x float64, op sum", "all_reduce of {c} x int64, op sum"),
    "op": ("all_reduce of {c} x float64, op sum", "all_reduce of {c} x float64, op max"),
    "collective": ("all_reduce of {c} x float64, op sum", "reduce_scatter of {c} x float64, op sum"),
    "broadcast_root": ("broadcast of {c} x float64, root 0", "broadcast of {c} x float64, root 1"),
    "all_gather_count": ("all_gather of {c} x float64", "all_gather of {c3} x float64"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("piece", ["pieces", "one", "ordinary", "whole"])
@pytest.mark.parametrize("case", list(CASES))
def test_shm_mismatch_raises_on_every_rank(groups, case, piece):
    for g in groups:
        n, r = gsize(g), grank(g)
        m = impl(g)
        if n > 1 and m.group is None:
            m.open()
        count = 12 * n * 64           # 6 KiB of float64 per rank: over the threshold, > 1 piece of 4 KiB
        x, total = rdata(g, f"{case}{piece}{g}", count)
        if m.group is not None:
            sg = m.group
            sg.set_piece({"pieces": PIECE, "one": 1 << 20, "ordinary": None, "whole": _shm.WHOLE}[piece])
            if piece == "ordinary":   # the tuner's Open MPI choice (where it may be chosen)
                sg.ordinary = True
        fn = CASES[case]
        if n == 1:
            fn(r, n + 1, x, g)      # nobody differs at one rank: the call just works
        else:
            with pytest.raises(CollectiveMismatchError) as ei:
                fn(r, n, x, g)
            msg = str(ei.value)
            if mpicomm._state.CTX.debug:   # debug mode's table comes first, before the path
                assert "differs in:" in msg and f"rank {n - 1} (world rank" in msg, msg
            else:
                same, other = DESC[case]
                fmt = dict(c=count, c2=count + 64, c3=count - n)
                for j in range(n):
                    assert f"rank {j}: " + (same if j < n - 1 else other).format(**fmt) in msg, msg
                assert "MPICOMM_DEBUG=1" in msg and "shared-memory path" in msg
        # the next matching calls work, on the path
        before = calls(g, "all_reduce")
        np.testing.assert_array_equal(mpicomm.all_reduce(x, group=g), total)
        if n > 1:
            assert calls(g, "all_reduce") == before + 1
        b = x.copy() if r == n - 1 else np.zeros_like(x)
        mpicomm.broadcast(b, root=n - 1, group=g)
        np.testing.assert_array_equal(b, of(n - 1, f"{case}{piece}{g}", count))
        if m.group is not None:
            m.group.set_piece()


@pytest.mark.mpi
def test_matching_calls_pass_the_check(groups):
    """Every collective of the path with equal signatures, interleaved, many pieces: no error,
    exact results (integers)."""
    for g in groups:
        n, r = gsize(g), grank(g)
        m = impl(g)
        if n > 1 and m.group is None:
            m.open()
        if m.group is not None:
            m.group.set_piece(PIECE)
        for i in range(6):
            x, total = rdata(g, f"ok{i}{g}", 5000 * n + 64 * i * n, np.int64)
            np.testing.assert_array_equal(mpicomm.all_reduce(x, group=g), total)
            np.testing.assert_array_equal(mpicomm.reduce_scatter(x, group=g), np.split(total, n)[r])
        if m.group is not None:
            m.group.set_piece()


# ------------------------------------------------------------- MPI truncation (own job)

TRUNC = r"""
import sys, numpy as np, mpicomm
mpicomm.init()
r = mpicomm.get_rank()
x = np.random.default_rng(r).standard_normal(64 if r == 0 else 32)
try:
    mpicomm.broadcast(x, root=0)
    print(f"rank {r}: ok", flush=True)
except Exception as e:
    print(f"rank {r}: {type(e).__name__}: {e}", flush=True)
"""


def test_truncation_becomes_mismatch_error(tmp_path):
    """Rank 0 broadcasts 64 values, rank 1 makes room for 32: MPI truncates on rank 1, which
    raises CollectiveMismatchError naming broadcast and MPICOMM_DEBUG=1 (not a raw MPI error).
    The root's broadcast is over when rank 1 reports it: the report reaches it after its call
    (then it raises too) or at its next call."""
    script = tmp_path / "trunc.py"
    script.write_text(TRUNC)
    env = clean_mpi_env({"MPICOMM_BACKEND": "mpi", "MPICOMM_TRACE_DIR": str(tmp_path),
                         "MPICOMM_SHM_THRESHOLD": "off"})
    p, _ = run_job(mpirun_argv(2, str(script)), env, 120)
    out = p.stdout
    root = next(ln for ln in out.splitlines() if ln.startswith("rank 0:"))
    assert root == "rank 0: ok" or root.startswith("rank 0: CollectiveMismatchError: broadcast sequence 1"), \
        out + p.stderr
    line = next(ln for ln in out.splitlines() if ln.startswith("rank 1:"))
    assert line.startswith("rank 1: CollectiveMismatchError: broadcast sequence 1 on group 'world'"), line
    assert ("MPI_ERR_TRUNCATE" in line or "differs in element count" in line) and "MPICOMM_DEBUG=1" in line, line


# ------------------------------------------------------------- MIN/MAX with NaN: one rule

@pytest.mark.mpi
@pytest.mark.parametrize("dt", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("path", ["ordinary", "shm", "shm_openmpi"])
def test_min_max_propagate_nan_on_every_path(comm, dt, path):
    """A NaN in any rank's element makes that element NaN for MIN and MAX (np.minimum /
    np.maximum), for all_reduce, reduce_scatter and reduce, whatever the size or rank count
    (Open MPI's own MIN/MAX keep or drop it by the order it combines the ranks in)."""
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = impl()
    m.configure({"MPICOMM_SHM_THRESHOLD": "off" if path == "ordinary" else "256"})
    if path != "ordinary" and n > 1 and m.group is None:
        m.open()
    if m.group is not None:
        m.group.set_piece(None if path == "shm_openmpi" else PIECE)
        m.group.ordinary = path == "shm_openmpi"   # the tuner's Open MPI choice (2 ranks)
    try:
        for count in (5, 3000):
            def of_nan(j):
                v = np.random.default_rng([j, count, 7]).standard_normal(n * count)
                v[j::n + 1] = np.nan                # each rank's NaNs at other places
                return v.astype(dtype)
            x = of_nan(r)
            for op, uf in ((ReduceOp.MAX, np.maximum), (ReduceOp.MIN, np.minimum)):
                exp = of_nan(0).astype(np.float64)
                for j in range(1, n):
                    exp = uf(exp, of_nan(j).astype(np.float64))
                exp = exp.astype(dtype)
                assert np.isnan(exp.astype(np.float64)).sum() >= count // 2 or n == 1
                got = mpicomm.all_reduce(x, op)
                np.testing.assert_array_equal(got.astype(np.float64), exp.astype(np.float64))
                got = mpicomm.reduce_scatter(x, op)
                np.testing.assert_array_equal(got.astype(np.float64), np.split(exp, n)[r].astype(np.float64))
                got = mpicomm.reduce(x, op, root=n - 1)
                if r == n - 1:
                    np.testing.assert_array_equal(got.astype(np.float64), exp.astype(np.float64))
    finally:
        m.configure()
        if m.group is not None:
            m.group.set_piece()
