"""Fault tests: each starts its own mpirun (tests/reliability_worker.py) under a hard timeout.

A missing rank must end the job with a diagnosis, an exception or a killed rank must end
it quickly, mismatched calls must raise on every rank, and a long loop must neither
corrupt data nor grow. The GPU variants run the same programs with CuPy arrays on NCCL.
"""
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, clean_mpi_env, mpirun_argv

WORKER = os.path.join(ROOT, "tests", "reliability_worker.py")
TIMEOUT = 5  # MPICOMM_TIMEOUT in these jobs, seconds


def _gpus():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPU = pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")],
                   id="nccl-gpu")
CPU = pytest.param(False, id="cpu")  # not "mpi": pytest-mpi reads ids as markers


def run(n, mode, gpu=False, limit=120, env=None, token=None):
    argv = mpirun_argv(n, WORKER, mode, *(["--gpu"] if gpu else []), *([token] if token else []))
    e = clean_mpi_env({"MPICOMM_TIMEOUT": str(TIMEOUT), **(env or {})})
    t0 = time.monotonic()
    p = subprocess.run(argv, env=e, capture_output=True, text=True, timeout=limit, errors="replace")
    return p, time.monotonic() - t0


def results(p):
    """{rank: [result line, ...]} from the RESULT lines of every rank."""
    out = {}
    for m in re.finditer(r"^RESULT rank=(\d+) (.*)$", p.stdout, re.M):
        out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_missing_rank_times_out_with_diagnosis(gpu):
    # rank 1 skips the third all_reduce: the others must name it, then the job ends
    # (3 ranks on CPU; 2 on GPU, since NCCL refuses two ranks on one GPU)
    n = 2 if gpu else 3
    p, took = run(n, "skip", gpu, limit=TIMEOUT + 60)
    assert p.returncode != 0
    assert took < TIMEOUT + 15, took
    assert "RESULT" not in p.stdout  # nobody finished the loop
    for r in [k for k in range(n) if k != 1]:
        m = re.search(rf"^\[mpicomm rank {r}\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
        assert m, p.stderr
        line = m.group(1)
        assert "all_reduce sequence 3 on group 'world'" in line
        assert "shape (4,), dtype float32" in line
        assert f"Rank 1 of {n} has not reached this call" in line
    assert re.search(r"^  rank 1: last call all_reduce sequence 2 on group 'world', finished [\d.]+ s ago; "
                     r"not in a collective$", p.stderr, re.M), p.stderr


def test_different_collectives_at_one_sequence_name_the_odd_rank():
    """Three ranks in all_reduce and one in barrier at sequence 2: the report names the rank
    in the other collective, instead of blaming the transport."""
    p, took = run(4, "other_collective", limit=TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + 15, took
    m = re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    assert "all_reduce sequence 2 on group 'world'" in m.group(1)
    assert "Rank 3 is in another collective at sequence 2: the ranks called different collectives" in m.group(1)
    assert re.search(r"^  rank 3: in barrier sequence 2 on group 'world', not all_reduce$", p.stderr, re.M), p.stderr
    assert "stuck in the transport" not in p.stderr


def test_a_caught_local_error_is_named_by_the_peers():
    """Rank 1's all_reduce fails its out= check and rank 1 catches it: rank 0, waiting in
    that all_reduce, is told that rank 1 raised there and did not take part."""
    p, took = run(2, "caught_raise", limit=TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + 15, took
    m = re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    assert "Rank 1 has raised an error in this call and did not take part" in m.group(1)
    assert re.search(r"^  rank 1: raised an error in its all_reduce sequence 2 on group 'world' and did not "
                     r"take part .*; now past it, at sequence 2$", p.stderr, re.M), p.stderr


@pytest.mark.parametrize("status", [0, 3])
def test_early_exit_is_reported_within_seconds(status):
    """Rank 1 leaves the script (sys.exit) while ranks 0 and 2 wait for it in all_reduce:
    they say so within seconds, long before the timeout (60 s here), and the job ends."""
    p, took = run(3, "early_exit", limit=90, env={"MPICOMM_TIMEOUT": "60", "EXIT_STATUS": str(status)})
    assert took < 30, took
    assert p.returncode != 0
    assert results(p) == {1: ["leaving"]}
    for r in (0, 2):
        m = re.search(rf"^\[mpicomm rank {r}\] CommunicationError: (.*)$", p.stderr, re.M)
        assert m, p.stderr
        assert "all_reduce sequence 2 on group 'world'" in m.group(1) and "cannot complete" in m.group(1)
        assert "Rank 1 has left the script (exited or returned) without reaching this call" in m.group(1)
    assert re.search(r"^  rank 1: has left its script \(it exited or returned\) without reaching this call; "
                     r"its last call was all_reduce sequence 1$", p.stderr, re.M), p.stderr


def test_group_creation_is_watched():
    """create_group is collective over the world: a rank that never comes is named."""
    p, took = run(3, "skip_create_group", limit=TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + 15, took
    m = re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    assert "create_group sequence 2 on group 'world'" in m.group(1)
    assert "Rank 1 of 3 has not reached this call" in m.group(1)
    assert re.search(r"^  rank 1: last call all_reduce sequence 1 on group 'world', finished [\d.]+ s ago; "
                     r"not in a collective$", p.stderr, re.M), p.stderr


def test_work_wait_timeout_raises_with_diagnosis():
    p, took = run(2, "wait_timeout", limit=60)
    assert p.returncode != 0 and took < 3 + 15
    assert re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: rank 0: all_reduce sequence 2 on group "
                     r"'world' \(shape \(4,\), dtype float32\) did not complete within 3 s", p.stderr, re.M), p.stderr
    assert "rank 1: last call all_reduce sequence 1 on group 'world'" in p.stderr
    assert "[mpicomm rank 0] uncaught exception; aborting the job" in p.stderr


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_raise_on_one_rank_aborts_job(gpu):
    p, took = run(2, "raise", gpu, limit=60)
    assert p.returncode != 0
    assert took < 10 + (10 if gpu else 0), took  # GPU: NCCL set-up is not part of the 10 s
    assert "[mpicomm rank 1] uncaught exception; aborting the job" in p.stderr
    assert "[mpicomm rank 1] ValueError: boom on purpose" in p.stderr
    assert "RESULT" not in p.stdout


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_sigkill_mid_loop_ends_job_and_leaves_nothing(gpu):
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, "kill", gpu, limit=TIMEOUT + 60, token=token)
    assert p.returncode != 0
    assert took < TIMEOUT + 15, took
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left behind: {left.stdout}"


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_debug_mode_mismatch_raises_on_every_rank(gpu):
    p, _ = run(2, "mismatch", gpu, limit=90, env={"MPICOMM_DEBUG": "1"})
    assert p.returncode == 0, p.stderr
    res = results(p)
    assert sorted(res) == [0, 1]
    for r in (0, 1):
        lines = res[r]
        assert len(lines) == 5, lines
        errs, after = lines[:4], lines[4]
        assert all(line.startswith("raised CollectiveMismatchError") for line in errs), errs
        # the same per-rank table on both ranks
        assert "differs in: shape" in errs[0]
        assert "rank 0 (world rank 0): all_reduce sequence 2 op=sum dtype=float32 shape=(4,)" in errs[0]
        assert "rank 1 (world rank 1): all_reduce sequence 2 op=sum dtype=float32 shape=(5,)" in errs[0]
        assert "differs in: dtype" in errs[1] and "dtype=float64" in errs[1]
        assert "differs in: collective" in errs[2] and "broadcast" in errs[2] and "root=0" in errs[2]
        assert "differs in: op" in errs[3] and "op=max" in errs[3]
        assert after == "after True"
    assert res[0][:4] == res[1][:4]


def test_different_shapes_without_debug_mode():
    # Documented in docs/RELIABILITY.md: without debug mode MPI sees only counts. At 2 ranks,
    # Open MPI's all_reduce of 4 vs 5 floats truncates on the rank with fewer and "succeeds"
    # on the other with data that is partly its own: a silent error. Debug mode catches it.
    p, _ = run(2, "shapes_nodebug", limit=60)
    res = results(p)
    assert res[0] == ["raised CommunicationError | all_reduce sequence 1 on group 'world' failed in MPI: "
                      "MPI_ERR_TRUNCATE: message truncated"], p.stdout + p.stderr
    assert res[1] == ["no-error"]


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_load_no_wrong_value_no_growth(gpu):
    # 10,000 small collectives, then 256 all_reduce of 16 MiB (4 GiB through each rank);
    # resident memory may not grow by more than 16 MiB during either phase after warm-up
    p, took = run(2, "load", gpu, limit=400, env={"MPICOMM_TIMEOUT": "120"})
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(p)
    assert sorted(res) == [0, 1]
    for r in (0, 1):
        kv = dict(item.split("=") for item in res[r][0].split())
        assert kv["bad"] == "0"
        assert int(kv["moved_bytes"]) >= 4 << 30
        assert int(kv["rss_growth_small"]) < 16 << 20, kv
        assert int(kv["rss_growth_big"]) < 16 << 20, kv


def test_large_count_all_reduce_and_broadcast():
    # 2**31 + 5 int8 elements (2 GiB a rank, about 10 GiB of memory in all at 2 ranks)
    p, _ = run(2, "bigcount", limit=600, env={"MPICOMM_TIMEOUT": "600"})
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(p)
    assert res == {0: ["allreduce_ok=True broadcast_ok=True"], 1: ["allreduce_ok=True broadcast_ok=True"]}


def test_init_errors_on_every_rank():
    """Before init, unknown backend, bad timeout, NCCL without a GPU, init twice."""
    p, _ = run(2, "before_init", limit=60)
    res = results(p)
    for r in (0, 1):
        assert len(res[r]) == 3 and all(x.startswith("raised NotInitializedError") for x in res[r]), res
        assert "needs mpicomm.init() first" in res[r][0]
    p, _ = run(2, "bad_backend", limit=60)
    res = results(p)
    for r in (0, 1):
        assert res[r][0].startswith("raised InvalidArgumentError | invalid backend='gloo': expected one of "
                                    "'mpi', 'nccl'"), res
        assert res[r][1].startswith("raised InvalidArgumentError | invalid timeout=-1: expected a number of "
                                    "seconds >= 0")
    p, _ = run(2, "reinit", limit=60)
    res = results(p)
    for r in (0, 1):
        assert "raised InvalidArgumentError" in res[r][0] and "call finalize() first" in res[r][0]
        assert res[r][1] == "reinit True"
    p, _ = run(2, "noabort", limit=60)
    res = results(p)
    for r in (0, 1):
        assert res[r] == ["hook mine", "default installed restored"], res


@pytest.mark.skipif(_gpus() > 0, reason="this machine has a GPU: NCCL is available")
def test_nccl_unavailable_on_every_rank():
    p, _ = run(2, "nccl_unavailable", limit=60)
    res = results(p)
    for r in (0, 1):
        assert res[r][0].startswith("raised BackendUnavailableError | the NCCL backend needs"), res
        assert "init(backend='mpi')" in res[r][0]
        assert res[r][1] == "after mpi 2"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
