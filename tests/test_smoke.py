"""mpicomm-smoke: its closed-form expectations, and real runs under mpirun at 1, 2 and 4
ranks, including the checker's self-test (a deliberately corrupted collective)."""

import numpy as np
import pytest

from conftest import clean_mpi_env, mpirun_argv, run_job
from launch_support import have_mpirun, spawns_mpirun
from mpicomm.tools import smoke

TIMEOUT = 240  # seconds for one mpirun of the quick smoke (a few seconds when the machine is idle)

needs_mpirun = pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")


# ---------------------------------------------------------------- expectations

def _direct(op, dt, keys, count):
    """The reduction done the slow way, element by element in the dtype's own arithmetic."""
    xs = [smoke.make_data(op, dt, k, count) for k in keys]
    if dt.kind in "iu":
        wide = [x.astype(np.int64) for x in xs]
        f = {"sum": sum, "prod": lambda v: np.prod(np.stack(v), axis=0),
             "min": lambda v: np.min(np.stack(v), axis=0), "max": lambda v: np.max(np.stack(v), axis=0)}[op]
        return f(wide).astype(dt)
    wide = np.stack([x.astype(np.complex128 if dt.kind == "c" else np.float64) for x in xs])
    r = {"sum": wide.sum(0), "avg": wide.sum(0) / len(keys), "prod": wide.prod(0),
         "min": wide.min(0) if dt.kind != "c" else None, "max": wide.max(0) if dt.kind != "c" else None}[op]
    return r.astype(dt)


@pytest.mark.parametrize("name", smoke.DTYPES)
def test_reduce_keys_matches_a_direct_reduction(name):
    dt = smoke.np_dtype(name)
    for op in smoke.ops_for(dt):
        for keys in (range(1), range(4), [3, 7, 11]):
            for count in (0, 1, 1001, 2 * smoke.PERIOD + 5):
                got = smoke.reduce_keys(op, dt, keys, count)
                assert got.dtype == dt and got.shape == (count,)
                assert smoke.compare(got, _direct(op, dt, keys, count), dt) is None, (name, op, keys, count)


@pytest.mark.parametrize("name", smoke.DTYPES)
def test_data_is_exact_and_rank_dependent(name):
    dt = smoke.np_dtype(name)
    for op in (None,) + smoke.ops_for(dt):
        a, b = smoke.make_data(op, dt, 0, 2000), smoke.make_data(op, dt, 1, 2000)
        assert not np.array_equal(a, b), (name, op)  # never the same on two ranks
        assert len(np.unique(a.astype(np.complex128 if dt.kind == "c" else np.float64))) > 1
        wide = smoke.pattern(op, dt, 5)
        assert np.array_equal(smoke.make_data(op, dt, 5, smoke.PERIOD).astype(wide.dtype), wide), \
            "values are integers the dtype holds exactly"
    # data-movement keys of different ranks and chunks stay distinct for small jobs
    pats = {smoke.pattern(None, dt, k).tobytes() for k in range(16)}
    assert len(pats) == 16


def test_compare_names_the_first_wrong_element():
    dt = np.dtype(np.int32)
    exp = smoke.reduce_keys("sum", dt, range(3), 10)
    got = exp.copy()
    got[4] += 1
    msg = smoke.compare(got, exp, dt)
    assert msg.startswith("1 of 10 element(s) wrong, first at [4]")
    assert smoke.compare(exp[:5], exp, dt).startswith("shape")
    f = smoke.reduce_keys("avg", np.dtype(np.float32), range(3), 10)
    assert smoke.compare(f * (1 + 1e-7), f, np.dtype(np.float32)) is None  # within tolerance
    assert smoke.compare(f + 0.5, f, np.dtype(np.float32)) is not None


def test_plan_reduces_bool_without_avg_and_16_bit_integers_only_where_the_backend_can():
    """bool reduces with SUM, PROD, MIN and MAX (as torch.distributed: OR and AND), never AVG;
    int16 and uint16 reduce on MPI, and on NCCL (no 16-bit integer reduction there) only move."""
    for backend in ("mpi", "nccl"):
        cases = smoke.plan(["bool", "int16", "uint16", "float32"], ["world"], quick=True, backend=backend)
        ops = {(c.coll, c.dtype): set() for c in cases}
        for c in cases:
            ops[(c.coll, c.dtype)].add(c.op)
        for coll in smoke.REDUCING:
            assert ops[(coll, "bool")] == {"sum", "prod", "min", "max"}
            assert ops[(coll, "float32")] == set(smoke.OPS)
            for name in ("int16", "uint16"):
                assert ops.get((coll, name)) == ({"sum", "prod", "min", "max"} if backend == "mpi" else None)
        for name in ("bool", "int16", "uint16"):
            assert {c.coll for c in cases if c.dtype == name} >= set(smoke.COLLECTIVES) - set(smoke.REDUCING) - {"barrier"}


def test_plan_covers_every_collective_op_dtype_group_and_mode():
    cases = smoke.plan(list(smoke.DTYPES), ["world", "sub"], quick=True)
    keys = {(c.coll, c.dtype, c.op, c.group, c.mode) for c in cases}
    for coll in smoke.REDUCING:
        for name in smoke.DTYPES:
            for op in smoke.ops_for(smoke.np_dtype(name)):
                for g in ("world", "sub"):
                    for mode in ("sync", "async"):
                        assert (coll, name, op, g, mode) in keys
    assert {c.coll for c in cases} == set(smoke.COLLECTIVES)
    assert {c.count for c in cases} == set(smoke.QUICK_COUNTS)
    full = smoke.plan(["float32", "int64"], ["world", "sub"], quick=False, n=4)
    big = max(c.count for c in full if c.dtype == "float32")
    from mpicomm._backends.shm_config import AUTO_PIECES

    # odd, and more than the largest piece the shared-memory path moves at once
    assert big % 2 == 1 and big * 4 > max(AUTO_PIECES) and big * 4 >= 12 << 20
    assert {(c.coll, c.op, c.group, c.mode) for c in full if c.count == big} >= {
        ("all_reduce", "sum", "world", "sync"), ("all_reduce", "sum", "world", "async"),
        ("all_reduce", "sum", "sub", "sync"), ("broadcast", None, "world", "sync")}
    chunked = max(c.count for c in full if c.dtype == "float32" and c.coll == "all_gather")
    assert max(AUTO_PIECES) < chunked * 4 * 4 <= 13 << 20  # n chunks of it: 12 MiB
    assert max(c.count for c in full if c.dtype == "int64") < 1 << 20  # not a BIG_DTYPE


def test_failures_are_merged_per_case_with_the_ranks_that_disagreed():
    key = ("all_gather", "float32", "-", 7, "world", "sync")
    merged = smoke.merge_failures([(key, "bad on 3", 3), (key, "bad on 1", 1)])
    assert merged == [(key, [1, 3], {3: "bad on 3", 1: "bad on 1"})]
    line = smoke.failure_line(*merged[0])
    assert line.startswith("FAIL all_gather dtype=float32 count=7 group=world mode=sync: rank(s) 1, 3")
    assert "bad on 1" in line


# ---------------------------------------------------------------- real runs

def _run_smoke(n, extra_env=None, *args):
    proc, _ = run_job(mpirun_argv(n, "-m", "mpicomm.tools.smoke", "--quick", *args), clean_mpi_env(extra_env),
                      TIMEOUT)
    return proc.returncode, proc.stdout, proc.stderr


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_quick_smoke_passes(n):
    rc, out, err = _run_smoke(n)
    assert rc == 0, out + err
    assert f"PASS: " in out and f"on {n} rank(s)" in out
    for coll in smoke.COLLECTIVES:
        assert any(line.startswith(coll) and line.rstrip().endswith("PASS") for line in out.splitlines()), coll
    gathered = "[[0.]" + "".join(f"\n [{r}.]" for r in range(1, n)) + "]"
    assert "AllGather check" in out and gathered in out
    if n > 1:
        assert "sub[" in out  # the sub-group ran too


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("n", [1, 2])
def test_a_broken_collective_fails_the_smoke_and_is_named(n):
    rc, out, err = _run_smoke(n, {smoke.BREAK_ENV: "all_gather"})
    assert rc != 0, out + err
    assert "FAIL all_gather" in out
    # the last rank of each group corrupts its result: world rank n-1 in the world
    assert f"group=world mode=sync: rank(s) {n - 1} disagreed" in out
    table = {line.split()[0]: line for line in out.splitlines() if line.split()
             and line.split()[0] in smoke.COLLECTIVES}
    assert "FAIL" in table["all_gather"]
    assert all(table[c].rstrip().endswith("PASS") for c in smoke.COLLECTIVES if c != "all_gather")
    assert "FAIL: " in out and "in all_gather;" in out


def test_count_wrong_spans_chunks(monkeypatch):
    monkeypatch.setattr(smoke.expected, "_CHUNK", 100)   # where count_wrong reads it
    dt = np.dtype(np.float16)
    exp = smoke.reduce_keys("avg", dt, range(3), 1000)
    got = exp.copy()
    got[[150, 151, 999]] += 3
    assert smoke.count_wrong(got, exp, dt) == (3, 150)
    assert smoke.compare(got, exp, dt).startswith("3 of 1000 element(s) wrong, first at [150]")
