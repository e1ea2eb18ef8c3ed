"""Fault tests: each starts its own mpirun (tests/reliability_worker.py) under a hard timeout.

A missing rank must end the job with a diagnosis, an exception or a killed rank must end
it quickly, mismatched calls must raise on every rank, and a long loop must neither
corrupt data nor grow. The GPU variants run the same programs with CuPy arrays on NCCL.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from conftest import ROOT, clean_mpi_env, left_behind, mpirun_argv, run_job

WORKER = os.path.join(ROOT, "tests", "reliability_worker.py")
TIMEOUT = 5  # MPICOMM_TIMEOUT in these jobs, seconds
# s that a job may take beyond its own waits: start-up of up to 4 ranks, the report and the
# abort, on a loaded 2-core machine. A job that does not end by itself is killed at its limit
# (TIMEOUT + 60 unless a test says otherwise), which fails the test.
SLACK = 30
# MPICOMM_TIMEOUT of the jobs that show a finding long before the timeout: they must end
# within EARLY s, start-up included, where a finding by the timeout comes after LONG s.
LONG = 60
EARLY = LONG * 3 // 4
# float32 elements of the unmatched send on the GPU (1 GiB): NCCL completes a send once its
# data is in the receiver's staging buffers, and 16 MiB fit there over NVLink
GPU_SEND_COUNT = 256 << 20


def _gpus():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPU = pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")],
                   id="nccl-gpu")
CPU = pytest.param(False, id="cpu")  # not "mpi": pytest-mpi reads ids as markers


@pytest.fixture(autouse=True)
def _trace_dir(tmp_path, monkeypatch):
    """A rank that reports a timeout writes its flight record: into the test's directory."""
    monkeypatch.setenv("MPICOMM_TRACE_DIR", str(tmp_path / "traces"))
    (tmp_path / "results").mkdir()
    monkeypatch.setenv("RELIABILITY_RESULTS", str(tmp_path / "results"))   # (run() makes a folder a job there)


def run(n, mode, gpu=False, limit=120, env=None, token=None):
    argv = mpirun_argv(n, WORKER, mode, *(["--gpu"] if gpu else []), *([token] if token else []))
    folder = tempfile.mkdtemp(prefix="job", dir=os.environ["RELIABILITY_RESULTS"])   # the ranks' RESULT lines
    e = clean_mpi_env({"MPICOMM_TIMEOUT": str(TIMEOUT), "RELIABILITY_RESULTS": folder, **(env or {})})
    p, took = run_job(argv, e, limit)
    p.results_dir = folder
    return p, took


def timeout_report(n, mode, env=None):
    """Run ``mode`` at ``n`` ranks, which must end by the timeout: (process, rank 0's report match)."""
    p, took = run(n, mode, limit=TIMEOUT + 60, env=env)
    assert p.returncode != 0 and took < TIMEOUT + SLACK, took
    m = re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    return p, m


def results(p):
    """{rank: [result line, ...]} from the RESULT lines of every rank: from the files the ranks
    wrote (run()'s jobs), else from the job's stdout."""
    folder = getattr(p, "results_dir", None)
    text = p.stdout if folder is None else "".join(
        open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder)))
    out = {}
    for m in re.finditer(r"^RESULT rank=(\d+) (.*)$", text, re.M):
        out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_missing_rank_times_out_with_diagnosis(gpu):
    # rank 1 skips the third all_reduce: the others must name it, then the job ends
    # (3 ranks on CPU; 2 on GPU, since NCCL refuses two ranks on one GPU)
    n = 2 if gpu else 3
    p, took = run(n, "skip", gpu, limit=TIMEOUT + 60)
    assert p.returncode != 0
    assert took < TIMEOUT + SLACK, took
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


@pytest.mark.parametrize("gpu", [GPU])
def test_replay_that_a_rank_skips_names_it(gpu):
    """nccl-gpu: both ranks replay a captured all_reduce through mpicomm.replay; rank 1 skips
    the second replay: rank 0's replay waits on the GPU, and its watchdog reports it after the
    timeout, naming rank 1 by the graphs each rank replayed, and ends the job."""
    p, took = run(2, "replay_skip", gpu, limit=TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + SLACK, (took, p.stderr)
    assert "RESULT" not in p.stdout
    m = re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    assert "rank 0: the CUDA graph of this rank's replay 2 (mpicomm.replay) did not complete" in m.group(1)
    assert "rank 1 replayed fewer graphs" in m.group(1) and "rank 0: 2, rank 1: 1" in m.group(1), m.group(1)


def _no_cuda():
    """True where neither a CUDA driver nor a real CuPy is here: where the double runs (its
    handles must never reach the driver; tests/test_nccl_double.py skips alike)."""
    import ctypes
    import importlib.util

    try:
        ctypes.CDLL("libcuda.so.1")
        return False
    except OSError:
        return importlib.util.find_spec("cupy") is None


DOUBLE = pytest.param("double", id="nccl-double",   # the NCCL backend over tests/fakecupy, on the CPU
                      marks=pytest.mark.skipif(not _no_cuda(), reason="CUDA is here: the GPU variant runs"))
GPU_FLAG = pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")],
                        id="nccl-gpu")


@pytest.mark.parametrize("where", [DOUBLE, GPU_FLAG])
def test_rank_that_stops_replaying_is_named_with_the_graphs_collective(where):
    """Every rank replays a graph of one all_reduce made by mpicomm.capture; rank 1 stops
    after the first replay (3 ranks on the CPU double, 2 on GPUs). Every rank's report,
    within the timeout, names the graph's collective: the replaying ranks' (their replay 2
    did not complete; rank 1 replayed fewer graphs) and rank 1's own (its peers wait in the
    second replay of a graph it replayed once: by itself, or when their report asks)."""
    n = 3 if where == "double" else 2
    argv = mpirun_argv(n, WORKER, "replay_stop", f"--{where}")
    p, took = run_job(argv, clean_mpi_env({"MPICOMM_TIMEOUT": str(TIMEOUT)}), TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + SLACK, (took, p.stderr)
    got = results(p)
    assert "finished" not in str(got), got
    caps = {r: v[0] for r, v in got.items()}
    assert sorted(caps) == list(range(n)) and len(set(caps.values())) == 1, got
    coll = caps[0].split("| ", 1)[1]
    assert re.fullmatch(r"all_reduce sequence \d+ on group 'world' \(shape \(4,\), dtype float32\)", coll), coll
    for r in range(n):
        m = re.search(rf"^\[mpicomm rank {r}\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
        assert m, p.stderr
        line = m.group(1)
        assert coll in line, line
        if r == 1:
            ahead = ", ".join(str(q) for q in range(n) if q != 1)
            assert line.startswith(f"rank 1: rank{'s' if n > 2 else ''} {ahead} wait{'' if n > 2 else 's'} in "
                                   "replay 2 (mpicomm.replay) of a CUDA graph that holds "), line
            assert "which this rank has replayed 1 time(s) and is not replaying" in line, line
        else:
            assert line.startswith(f"rank {r}: the CUDA graph of this rank's replay 2 (mpicomm.replay) did not "
                                   "complete"), line
            assert "rank 1 replayed fewer graphs" in line, line


def test_a_graph_of_another_group_is_not_reported_by_a_non_member():
    """3 ranks on the CPU double: all replay a graph of the world once; ranks 0 and 1 then
    replay a graph of their group "pair", and rank 1 stops. Ranks 0 and 1 report that
    graph's collective (on group 'pair'); rank 2, which never captured it and is not in the
    group, reports nothing of its own (it sleeps until the job is ended)."""
    if not _no_cuda():
        pytest.skip("CUDA is here: the double's handles must not reach the driver")
    argv = mpirun_argv(3, WORKER, "replay_pair", "--double")
    p, took = run_job(argv, clean_mpi_env({"MPICOMM_TIMEOUT": str(TIMEOUT)}), TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + SLACK, (took, p.stderr)
    got = results(p)
    assert sorted(got) == [0, 1] and got[0] == got[1], got
    coll = got[0][0].split("| ", 1)[1]
    assert re.fullmatch(r"all_reduce sequence 3 on group 'pair' \(shape \(4,\), dtype float32\)", coll), coll
    for r in (0, 1):
        m = re.search(rf"^\[mpicomm rank {r}\] CollectiveTimeoutError: (.*)$", p.stderr, re.M)
        assert m and coll in m.group(1), p.stderr
    assert "rank 1: rank 0 waits in replay 2 (mpicomm.replay) of a CUDA graph that holds " + coll in p.stderr
    assert "; rank 1 replayed fewer graphs: a collective captured in this one waits for it" in p.stderr   # not rank 2
    assert not re.search(r"^\[mpicomm rank 2\] CollectiveTimeoutError", p.stderr, re.M), p.stderr


def test_timeout_writes_flight_records_that_show_the_missing_call(tmp_path):
    """Rank 1 of 3 writes its record and skips the third all_reduce: ranks 0 and 2 report the
    timeout and write theirs; rank 0's report ends with the file's path, and mpicomm-trace on
    the files shows that rank 1 never entered call 3 while the others wait in it."""
    d = tmp_path / "traces"
    p, took = run(3, "flight_skip", limit=TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + SLACK, took
    rank0 = [line for line in p.stderr.splitlines() if line.startswith("[mpicomm rank 0] ")]
    assert rank0[0].startswith("[mpicomm rank 0] CollectiveTimeoutError: rank 0: all_reduce sequence 3"), p.stderr
    f0 = d / "mpicomm-trace.rank0.json"
    assert rank0[-1] == f"[mpicomm rank 0] flight record: {f0}; merge the ranks' files with mpicomm-trace", p.stderr
    assert results(p) == {1: [f"dumped {d / 'mpicomm-trace.rank1.json'}"]}
    # the records: every rank's all_reduce calls of shape (4,) float32; rank 1 made two
    rec0 = json.loads(f0.read_text())
    assert rec0["reason"] == "timeout"
    assert [(c["seq"], c["collective"], c["shape"], c["dtype"], c["done"]) for c in rec0["calls"]] == \
        [(1, "all_reduce", [4], "float32", True), (2, "all_reduce", [4], "float32", True),
         (3, "all_reduce", [4], "float32", False)]
    rec1 = json.loads((d / "mpicomm-trace.rank1.json").read_text())
    assert [(c["seq"], c["done"]) for c in rec1["calls"]] == [(1, True), (2, True)]
    # rank 2 may be ended by rank 0's abort before it writes: merge whatever was written
    files = sorted(str(f) for f in d.glob("mpicomm-trace.rank*.json"))
    t = subprocess.run([sys.executable, "-m", "mpicomm.tools.trace", *files], capture_output=True, text=True,
                       timeout=60, env=clean_mpi_env())
    assert t.returncode == 0, t.stderr
    ranks = [int(re.search(r"rank(\d)\.json$", f).group(1)) for f in files]
    rows = {int(m.group(1)): re.split(r"\s{2,}", m.group(0).strip())
            for m in re.finditer(r"^(\d+)  .*$", t.stdout, re.M)}
    assert sorted(rows) == [1, 2, 3], t.stdout
    col = {r: 3 + i for i, r in enumerate(ranks)}   # seq, collective, shape dtype, then one column a rank
    for seq in (1, 2):
        assert all(rows[seq][col[r]].startswith("+") and "pending" not in rows[seq][col[r]] for r in ranks)
    assert rows[3][col[1]] == "-"
    assert rows[3][col[0]].endswith("(pending)")
    assert rows[3][-1] == "rank 1 (not entered)", t.stdout


def test_different_collectives_at_one_sequence_name_the_odd_rank():
    """Three ranks in all_reduce and one in barrier at sequence 2, with the agreement check
    off: the timeout's report names the rank in the other collective, instead of blaming the
    transport."""
    p, m = timeout_report(4, "other_collective", env={"MPICOMM_CHECK": "0"})
    assert "all_reduce sequence 2 on group 'world'" in m.group(1)
    assert "Rank 3 is in another collective at sequence 2: the ranks called different collectives" in m.group(1)
    assert re.search(r"^  rank 3: in barrier sequence 2 on group 'world', not all_reduce$", p.stderr, re.M), p.stderr
    assert "stuck in the transport" not in p.stderr


def test_different_collectives_are_named_within_seconds_with_the_check():
    """The same with the agreement check on (MPICOMM_CHECK=1): every waiting rank names the
    disagreement, each rank's call, a second or two after entering, and the job ends."""
    p, took = run(4, "other_collective", limit=120, env={"MPICOMM_TIMEOUT": str(LONG), "MPICOMM_CHECK": "1"})
    assert p.returncode != 0 and took < EARLY, took   # start-up, ~1-2 s of waiting; not the timeout
    m = re.search(r"^\[mpicomm rank 0\] CollectiveMismatchError: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    assert "all_reduce sequence 2 on group 'world': the ranks called differently" in m.group(1), m.group(1)
    assert "rank 3: barrier" in m.group(1) and "rank 0: all_reduce of 4 x float32" in m.group(1), m.group(1)
    assert "CollectiveTimeoutError" not in p.stderr


def test_a_caught_local_error_is_named_by_the_peers():
    """Rank 1's all_reduce fails its out= check and rank 1 catches it (agreement check off):
    rank 0, waiting in that all_reduce, is told at the timeout that rank 1 raised there and
    did not take part. (With the check on, rank 0 raises CollectiveMismatchError naming rank 1
    and its reason at once: tests/test_agreement.py.)"""
    p, m = timeout_report(2, "caught_raise", env={"MPICOMM_CHECK": "0"})
    assert "Rank 1 has raised an error in this call and did not take part" in m.group(1)
    assert re.search(r"^  rank 1: raised an error in its all_reduce sequence 2 on group 'world' and did not "
                     r"take part .*; now past it, at sequence 2$", p.stderr, re.M), p.stderr


@pytest.mark.parametrize("status", [0, 3])
def test_early_exit_is_reported_within_seconds(status):
    """Rank 1 leaves the script (sys.exit) while ranks 0 and 2 wait for it in all_reduce:
    they say so within seconds, long before the timeout (60 s here), naming its exit
    status, and the job ends with that status under plain mpirun (1 for a 0: the others
    could not finish)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(3, "early_exit", limit=90, env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_STATUS": str(status)},
                  token=token)
    assert took < EARLY, took
    assert p.returncode == (status or 1), (p.returncode, p.stderr)
    assert results(p) == {1: ["leaving"]}
    for r in (0, 2):
        m = re.search(rf"^\[mpicomm rank {r}\] CommunicationError: (.*)$", p.stderr, re.M)
        assert m, p.stderr
        assert "all_reduce sequence 2 on group 'world'" in m.group(1) and "cannot complete" in m.group(1)
        assert f"Rank 1 has left the script (exit status {status}) without reaching this call" in m.group(1)
    assert re.search(rf"^  rank 1: has left its script \(exit status {status}\) without reaching this call; "
                     r"its last call was all_reduce sequence 1$", p.stderr, re.M), p.stderr
    # the reporting rank names a non-zero status it ends the job with; a 0 ends it with 1, unnamed
    ends = re.findall(r"^[ \t]*\[mpicomm rank [02]\] (aborting the job.*)$", p.stderr, re.M)
    assert ends and set(ends) == {f"aborting the job with exit status {status}" if status else "aborting the job"}, \
        p.stderr
    nothing_left(token)


@pytest.mark.parametrize("how, status", [("raise", 3), ("return", 0)])
def test_early_exit_without_sys_exit(how, status):
    """Rank 1 leaves by ``raise SystemExit(3)`` or by returning from its script. Python 3.12
    and later: mpicomm sees the script's top level end (sys.monitoring), so the peers name
    the status and a non-zero one ends the job with it. Before 3.12 the two cannot be told
    apart at exit: the peers say the status is unknown, and the job ends with 1."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(3, "early_exit", limit=90, token=token,
                  env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_STATUS": str(status), "EXIT_HOW": how})
    assert took < EARLY, took
    assert results(p) == {1: ["leaving"]}
    if sys.version_info >= (3, 12):
        assert p.returncode == (status or 1), (p.returncode, p.stderr)
        said = f"exit status {status}"
    else:
        assert p.returncode == 1, (p.returncode, p.stderr)
        said = "it returned, or exited without sys.exit: status unknown"
    msg = report_of(p, 0, "CommunicationError") if "[mpicomm rank 0] CommunicationError" in p.stderr \
        else report_of(p, 2, "CommunicationError")
    assert f"Rank 1 has left the script ({said}) without reaching this call" in msg, msg
    nothing_left(token)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_rank_that_called_finalize_is_reported_within_seconds(n):
    """Rank 1 calls finalize() after one all_reduce (a rank with fewer batches than its
    peers) while the others wait for it in the second: they say within seconds, long before
    the timeout (60 s), that rank 1 called finalize() without reaching the call, and the job
    ends with 1 (rank 1, waiting in finalize() for the others, never returns from it)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(n, "early_exit", limit=90, env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_HOW": "finalize"},
                  token=token)
    nothing_left(token)
    assert took < EARLY and p.returncode == 1, (took, p.returncode, p.stderr)
    assert results(p) == {1: ["leaving"]}, p.stdout
    reporters = [r for r in range(n) if f"[mpicomm rank {r}] CommunicationError" in p.stderr]
    assert reporters and 1 not in reporters, p.stderr
    for r in reporters:
        msg = report_of(p, r, "CommunicationError")
        assert "all_reduce sequence 2 on group 'world'" in msg and "cannot complete" in msg, msg
        assert "Rank 1 has called mpicomm.finalize() without reaching this call" in msg, msg
    assert re.search(r"^  rank 1: has called mpicomm.finalize\(\) without reaching this call; "
                     r"its last call was all_reduce sequence 1$", p.stderr, re.M), p.stderr


def test_recv_from_a_rank_that_called_finalize():
    """Rank 1 calls finalize() while rank 0 waits for its send: rank 0 says so within
    seconds, naming finalize(), and the job ends with 1."""
    p, took = fault(2, "recv_exit", env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_HOW": "finalize"}, limit=90)
    assert p.returncode == 1 and took < EARLY, (p.returncode, took, p.stderr)
    msg = report_of(p, 0, "CommunicationError")
    assert msg.startswith("rank 0: recv from rank 1 (tag 5, shape (4,), dtype float32) on group 'world' cannot "
                          "complete"), msg
    assert "Rank 1 has called mpicomm.finalize() without the matching send" in msg, msg


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_fatal_signal_names_the_call(where):
    """Rank 1 gets SIGSEGV while it waits in all_reduce sequence 2 (sent by a thread of its
    own), or outside any call after sequence 1: before it dies it prints which call it was
    in (or its last one) and its Python stacks, and the job ends long before the timeout."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, f"fatal_{where}", limit=90, env={"MPICOMM_TIMEOUT": str(LONG)}, token=token)
    nothing_left(token)
    assert p.returncode != 0 and took < EARLY, (p.returncode, took, p.stderr)
    assert results(p).get(1) == ["segfaulting"], p.stdout
    said = {"inside": "inside all_reduce sequence 2 on group 'world'",
            "outside": "outside mpicomm's calls (its last: all_reduce sequence 1 on group 'world')"}[where]
    assert re.search(rf"^\[mpicomm rank 1\] fatal signal {int(signal.SIGSEGV)} \(SIGSEGV\) {re.escape(said)}\. "
                     r"Where the ranks' calls differ \(count, dtype, op\), MPI can write past a buffer", p.stderr,
                     re.M), p.stderr
    assert "Fatal Python error: Segmentation fault" in p.stderr, p.stderr   # (faulthandler's stacks)
    assert "reliability_worker.py" in p.stderr, p.stderr
    assert "[mpicomm rank 0] fatal signal" not in p.stderr, p.stderr


def test_a_count_mismatch_that_crashes_mpi_is_named():
    """2000 against 2100 float32 in all_reduce: Open MPI 5 writes past a buffer and a rank
    dies of SIGABRT before mpicomm compares the calls. The dying rank names the call and
    the way to compare first (MPICOMM_DEBUG=1); where MPI does not crash, every rank raises
    CollectiveMismatchError, or the job ends with the named disagreement. Never a wait for
    the timeout."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, "count_crash", limit=90, env={"MPICOMM_TIMEOUT": str(LONG)}, token=token)
    nothing_left(token)
    assert took < EARLY, (took, p.stderr)
    if re.search(r"fatal signal \d+ \(SIG", p.stderr):
        assert p.returncode != 0
        assert re.search(r"^\[mpicomm rank [01]\] fatal signal \d+ \(SIG[A-Z]+\) (inside all_reduce sequence 2|"
                         r"outside mpicomm's calls \(its last: all_reduce sequence [12]) on group 'world'.*"
                         r"MPICOMM_DEBUG=1 compares every call's arguments before it runs$", p.stderr, re.M), p.stderr
    elif p.returncode == 0:
        assert sorted(results(p)) == [0, 1] and all(v == ["raised CollectiveMismatchError"] for v in results(p).values()), \
            p.stdout
    else:
        assert "CollectiveMismatchError" in p.stderr and "2100" in p.stderr, p.stderr


@pytest.mark.parametrize("gpu", [GPU])
def test_early_exit_on_gpu_is_reported_within_seconds(gpu):
    """NCCL (nccl-gpu): rank 1 exits with 3 while rank 0's all_reduce waits on the GPU for it;
    the watchdog's GPU check reads rank 1's exit mark and ends the job with 3, long before
    the timeout (60 s)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, "early_exit", gpu, limit=120, env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_STATUS": "3"},
                  token=token)
    nothing_left(token)
    assert p.returncode == 3 and took < EARLY, (p.returncode, took, p.stderr[-3000:])
    msg = report_of(p, 0, "CommunicationError")
    assert "all_reduce sequence 2 on group 'world'" in msg and "cannot complete" in msg, msg
    assert "Rank 1 has left the script (exit status 3) without reaching this call" in msg


def test_early_exit_report_writes_the_flight_record(tmp_path):
    """The early-exit report, like the timeout's, ends with where the rank's record is."""
    p, took = run(3, "early_exit", limit=90, env={"MPICOMM_TIMEOUT": str(LONG)})
    assert p.returncode != 0 and took < EARLY, took
    for r in (0, 2):
        lines = [line for line in p.stderr.splitlines() if line.startswith(f"[mpicomm rank {r}] ")]
        f = tmp_path / "traces" / f"mpicomm-trace.rank{r}.json"
        if not f.exists():   # ended by the other reporting rank's abort before it wrote
            continue
        assert lines[0].startswith(f"[mpicomm rank {r}] CommunicationError: "), p.stderr
        assert lines[-1] == f"[mpicomm rank {r}] flight record: {f}; merge the ranks' files with mpicomm-trace"
        rec = json.loads(f.read_text())
        assert rec["reason"] == "early exit"
        assert [(c["seq"], c["done"]) for c in rec["calls"]] == [(1, True), (2, False)]
    assert (tmp_path / "traces" / "mpicomm-trace.rank0.json").exists() or \
        (tmp_path / "traces" / "mpicomm-trace.rank2.json").exists(), p.stderr


def test_group_creation_is_watched():
    """create_group called by every rank: a member that never comes is named (creation is
    call 1 of the new group)."""
    p, m = timeout_report(3, "skip_create_group")
    assert "create_group sequence 1 on group 'late'" in m.group(1)
    assert "Rank 1 of 3 has not reached this call" in m.group(1)
    assert re.search(r"^  rank 1 \(rank 1 of the group\): no collective on group 'late' yet; "
                     r"not in a collective$", p.stderr, re.M), p.stderr


def test_work_wait_timeout_raises_with_diagnosis():
    p, took = run(2, "wait_timeout", limit=60)
    assert p.returncode != 0 and took < 3 + SLACK
    assert re.search(r"^\[mpicomm rank 0\] CollectiveTimeoutError: rank 0: all_reduce sequence 2 on group "
                     r"'world' \(shape \(4,\), dtype float32\) did not complete within 3 s", p.stderr, re.M), p.stderr
    assert "rank 1: last call all_reduce sequence 1 on group 'world'" in p.stderr
    assert "[mpicomm rank 0] uncaught exception; aborting the job" in p.stderr


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_raise_on_one_rank_aborts_job(gpu):
    p, took = run(2, "raise", gpu, limit=LONG + 30, env={"MPICOMM_TIMEOUT": str(LONG)})
    assert p.returncode != 0
    assert took < EARLY, took   # the exception ends the job, not the timeout
    assert "[mpicomm rank 1] uncaught exception; aborting the job" in p.stderr
    assert "[mpicomm rank 1] ValueError: boom on purpose" in p.stderr
    assert "RESULT" not in p.stdout


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_sigkill_mid_loop_ends_job_and_leaves_nothing(gpu):
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, "kill", gpu, limit=TIMEOUT + 60, token=token)
    assert p.returncode != 0
    assert took < TIMEOUT + SLACK, took
    nothing_left(token)


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
    # The truncation that MPI reports on rank 0 becomes CollectiveMismatchError naming the call.
    # (With the agreement check, MPICOMM_CHECK=1, both ranks raise: the test after this one.)
    p, _ = run(2, "shapes_nodebug", limit=60, env={"MPICOMM_CHECK": "0"})
    res = results(p)
    assert len(res[0]) == 1 and res[0][0].startswith(
        "raised CollectiveMismatchError | all_reduce sequence 1 on group 'world': MPI received a longer message "
        "than this rank's call makes room for (MPI_ERR_TRUNCATE: message truncated)"), p.stdout + p.stderr
    assert "Rerun with MPICOMM_DEBUG=1" in res[0][0]
    assert res[1] == ["no-error"]


def test_different_shapes_raise_on_both_ranks_with_the_check():
    """all_reduce of 4 floats on rank 0 and 5 on rank 1, the agreement check on: neither rank
    returns; both raise CollectiveMismatchError naming both counts."""
    p, _ = run(2, "shapes_nodebug", limit=60, env={"MPICOMM_CHECK": "1"})
    res = results(p)
    for r in (0, 1):
        assert len(res[r]) == 1 and res[r][0].startswith("raised CollectiveMismatchError | all_reduce sequence 1"), \
            p.stdout + p.stderr
    assert any("4 x float32" in res[r][0] and "5 x float32" in res[r][0] for r in (0, 1)), res


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
    # 2**31 + 5 int8 elements in place (2 GiB a rank, about 2.2 GB peak a process at 2 ranks)
    p, _ = run(2, "bigcount", limit=600, env={"MPICOMM_TIMEOUT": "600"})
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(p)
    assert res == {r: ["pieces=3 allreduce_ok=True broadcast_ok=True"] for r in (0, 1)}, res


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


# ------------------------------------------------------------------ the fault matrix (2 and 4 ranks)
def nothing_left(token):
    """No process of the job (its argv holds ``token``) is still running."""
    left = left_behind(token)
    assert left == "", f"processes left behind: {left}"


def fault(n, mode, env=None, limit=TIMEOUT + 60):
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(n, mode, limit=limit, env=env, token=token)
    nothing_left(token)
    return p, took


def report_of(p, rank, kind="CollectiveTimeoutError"):
    # (at the start of a line, but for blanks: mpirun's abort banner, written by another
    # process to the same stderr, can leave one in front of it)
    m = re.search(rf"^[ \t]*\[mpicomm rank {rank}\] {kind}: (.*)$", p.stderr, re.M)
    assert m, p.stderr
    return m.group(1)


def timed_out(n, mode):
    """Run fault ``mode`` at ``n`` ranks: the job ends with status 1 soon after the timeout;
    (the process, rank 0's CollectiveTimeoutError message)."""
    p, took = fault(n, mode)
    assert p.returncode == 1 and took < TIMEOUT + SLACK, (p.returncode, took)
    return p, report_of(p, 0)


def stack_shown(p, tmp_path, rank, where="lagging_here"):
    """Rank ``rank`` printed its Python stack (asked for by a peer's report) and wrote it."""
    assert re.search(rf"^\[mpicomm rank {rank}\] Python stacks of rank {rank} \(asked for by a peer's timeout "
                     r"report\)", p.stderr, re.M), p.stderr
    assert re.search(rf'^\[mpicomm rank {rank}\]   File ".*reliability_worker.py", line \d+ in {where}$',
                     p.stderr, re.M), p.stderr
    assert f"in {where}" in (tmp_path / "traces" / f"mpicomm-stack.rank{rank}.txt").read_text()


NRANKS = [2, 4]


@pytest.mark.parametrize("n", NRANKS)
def test_unmatched_recv_names_the_peer_with_its_stack(n, tmp_path):
    """Rank 0 waits in recv from rank 1, which sleeps: the timeout report names rank 1 and
    where it is, and rank 1 prints its Python stack (the function it sleeps in)."""
    p, msg = timed_out(n, "recv_nosend")
    assert msg.startswith("rank 0: recv from rank 1 (tag 5, shape (4,), dtype float32) on group 'world' did not "
                          "complete within 5 s"), msg
    assert "Rank 1 has not reached the matching send" in msg
    assert re.search(r"^  rank 1: not in a send or recv; not in a collective \(last: all_reduce sequence 1 on "
                     r"group 'world'\)$", p.stderr, re.M), p.stderr
    assert "rank 1 was asked to print its Python stack" in p.stderr
    stack_shown(p, tmp_path, 1)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode, call, other", [("recv_nosend", "recv from", "send"),
                                               ("send_norecv", "send to", "recv")], ids=["nccl-gpu-recv", "nccl-gpu-send"])
def test_unmatched_gpu_send_recv_is_named(mode, call, other, tmp_path):
    """NCCL: the send/recv is enqueued and returns; the rank then waits in a stream
    synchronize. The watchdog keeps the call published until the GPU has done it, and
    reports it on the GPU, naming rank 1 and showing its stack (nccl-gpu)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, mode, True, limit=TIMEOUT + 90, token=token, env={"GPU_SEND_COUNT": str(GPU_SEND_COUNT)})
    nothing_left(token)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    msg = report_of(p, 0)
    shape = "(4,)" if mode == "recv_nosend" else f"({GPU_SEND_COUNT},)"
    assert msg.startswith(f"rank 0: {call} rank 1 (tag 0, shape {shape}, dtype float32) on group 'world' did not "
                          "complete within 5 s"), msg
    assert "on the GPU" in msg and f"Rank 1 has not reached the matching {other}" in msg, msg
    stack_shown(p, tmp_path, 1)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tag", [5], ids=["nccl-gpu-tagged-recv"])
def test_unmatched_tagged_gpu_recv_is_named(tag, tmp_path):
    """NCCL, a tagged GPU recv (it waits in MPI on the host): the report names rank 1 and
    the tag, and rank 1 shows its stack (tags on GPU arrays, docs/COLLECTIVES.md)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, "recv_nosend", True, limit=TIMEOUT + 90, token=token, env={"GPU_TAG": str(tag)})
    nothing_left(token)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    msg = report_of(p, 0)
    assert msg.startswith(f"rank 0: recv from rank 1 (tag {tag}, shape (4,), dtype float32) on group 'world' "
                          "did not complete within 5 s"), msg
    assert "Rank 1 has not reached the matching send" in msg, msg
    stack_shown(p, tmp_path, 1)


@pytest.mark.parametrize("n", NRANKS)
def test_unmatched_send_names_the_peer(n, tmp_path):
    """A 16 MiB send (past the eager limit) that rank 1 never receives."""
    p, msg = timed_out(n, "send_norecv")
    assert msg.startswith("rank 0: send to rank 1 (tag 5, shape (4194304,), dtype float32) on group 'world' did "
                          "not complete within 5 s"), msg
    assert "Rank 1 has not reached the matching recv" in msg
    stack_shown(p, tmp_path, 1)


def test_async_recv_wait_timeout_names_the_peer():
    """Work.wait(timeout=3) of an async recv whose peer never sends raises with the same
    diagnosis as a blocking one; uncaught, it ends the job."""
    p, took = fault(2, "async_recv_timeout")
    assert p.returncode == 1 and took < 3 + SLACK, (p.returncode, took)   # (rank 1 sleeps 120 s)
    msg = report_of(p, 0)
    assert msg.startswith("rank 0: recv from rank 1 (tag 5, shape (4,), dtype float32) on group 'world' did not "
                          "complete within 3 s"), msg
    assert "Rank 1 has not reached the matching send" in msg
    assert "[mpicomm rank 0] uncaught exception; aborting the job" in p.stderr


def test_send_recv_with_different_tags_is_named():
    """Rank 0 waits for tag 5 while rank 1 sends tag 6: both are in matching calls, and the
    report says the tags differ (not "stuck in the transport")."""
    p, msg = timed_out(2, "tag_mismatch")
    assert msg.startswith("rank 0: recv from rank 1 (tag 5, shape (4194304,), dtype float32) on group 'world' did "
                          "not complete within 5 s"), msg
    assert "Rank 1 is in the matching send with another tag: the tags differ" in msg, msg
    assert re.search(r"^  rank 1: in send to rank 0 with tag 6, not 5$", p.stderr, re.M), p.stderr


def test_exit_status_hook():
    """What the peers are told: sys.exit/exit/quit statuses as Python turns them into exit
    statuses, an uncaught exception as 1, nothing known otherwise; uninstall restores."""
    import builtins

    from mpicomm._reliability.abort import ExitStatus

    before = (sys.exit, builtins.exit, builtins.quit)
    e = ExitStatus()
    e.install()
    try:
        assert e.status() is None
        for call, arg, want in ((sys.exit, 3, 3), (sys.exit, None, 0), (sys.exit, "bye", 1), (sys.exit, 258, 2),
                                (builtins.exit, 7, 7), (builtins.quit, 0, 0), (sys.exit, True, 1)):
            with pytest.raises(SystemExit) as ex:
                call(arg)
            assert ex.value.code == arg and e.status() == want, (call, arg)
        e.code = None
        sys.last_value = ValueError("uncaught")
        try:
            assert e.status() == 1
        finally:
            del sys.last_value
    finally:
        e.uninstall()
    assert (sys.exit, builtins.exit, builtins.quit) == before


@pytest.mark.parametrize("n,status", [(2, 3), (4, 0)])
def test_recv_from_a_rank_that_exits(n, status):
    """Rank 1 exits while rank 0 waits for its send: rank 0 says so within seconds, and the
    job ends with rank 1's status (1 for a 0)."""
    p, took = fault(n, "recv_exit", env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_STATUS": str(status)}, limit=90)
    assert p.returncode == (status or 1) and took < EARLY, (p.returncode, took, p.stderr)
    msg = report_of(p, 0, "CommunicationError")
    assert msg.startswith("rank 0: recv from rank 1 (tag 5, shape (4,), dtype float32) on group 'world' cannot "
                          "complete"), msg
    assert f"Rank 1 has left the script (exit status {status}) without the matching send" in msg


@pytest.mark.parametrize("n, gpu", [pytest.param(2, False, id="2-cpu"), pytest.param(4, False, id="4-cpu"),
                                    pytest.param(2, True, marks=GPU.marks, id="2-nccl-gpu")])
@pytest.mark.parametrize("mode", ["async_recv_exit", "async_allreduce_exit"])
def test_a_rank_that_exits_is_noticed_by_work_wait(n, gpu, mode):
    """Rank 1 exits with 3 while rank 0 waits in Work.wait() (an async recv from it, or an
    async all_reduce): the wait notices within seconds, reports as a blocking call does,
    and the job ends with 3, long before the timeout (60 s). NCCL too (nccl-gpu)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(n, mode, gpu, limit=90, env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_STATUS": "3"}, token=token)
    nothing_left(token)
    assert p.returncode == 3 and took < EARLY, (p.returncode, took, p.stderr)
    assert results(p) == {1: ["leaving"]}
    if mode == "async_recv_exit":
        msg = report_of(p, 0, "CommunicationError")
        tag = 0 if gpu else 5
        assert msg.startswith(f"rank 0: recv from rank 1 (tag {tag}, shape (4,), dtype float32) on group 'world' "
                              "cannot complete"), msg
        assert "Rank 1 has left the script (exit status 3) without the matching send" in msg, msg
    else:
        reporters = [r for r in range(n) if f"[mpicomm rank {r}] CommunicationError" in p.stderr]
        assert reporters, p.stderr
        msg = report_of(p, reporters[0], "CommunicationError")
        assert "all_reduce sequence 2 on group 'world'" in msg and "cannot complete" in msg, msg
        assert "Rank 1 has left the script (exit status 3) without reaching this call" in msg, msg


def test_finalize_with_dropped_work_that_cannot_complete():
    """Rank 0 drops an async recv that rank 1 never matches and calls finalize(): finalize
    completes the dropped work first, which times out with its own diagnosis (naming
    rank 1 and where it is), and the job ends with 1 soon after the timeout."""
    p, took = fault(2, "finalize_dropped", limit=TIMEOUT + 60)
    assert p.returncode == 1 and took < TIMEOUT + SLACK, (p.returncode, took, p.stderr)
    msg = report_of(p, 0)
    assert msg.startswith("rank 0: recv from rank 1 (tag 5, shape (4,), dtype float32) on group 'world' did not "
                          "complete within 5 s"), msg
    assert "Rank 1 has not reached the matching send" in msg, msg
    assert "finalize() did not complete" not in p.stderr, p.stderr   # the Work's report, not a second one
    assert "finished" not in p.stdout


@pytest.mark.parametrize("n", NRANKS)
def test_nonzero_exit_while_the_others_compute_ends_the_job_with_its_status(n):
    """Rank 1 exits with 3 while the others are busy outside mpicomm (no call to notice it):
    rank 1 ends the job with 3 itself after a few seconds (plain mpirun would wait)."""
    from mpicomm._timing import TIMING

    p, took = fault(n, "exit_later", env={"MPICOMM_TIMEOUT": str(LONG), "EXIT_STATUS": "3"}, limit=90)
    assert p.returncode == 3 and took < TIMING.leave_wait + SLACK, (p.returncode, took, p.stderr)
    others = ", ".join(str(k) for k in range(n) if k != 1)
    assert (f"[mpicomm rank 1] this rank exits with status 3 while rank{'s' if n > 2 else ''} {others} still "
            "run: ending the job with exit status 3") in p.stderr, p.stderr


@pytest.mark.parametrize("n", NRANKS)
def test_sigstop_of_a_rank_is_named(n):
    """Rank 1 stops (SIGSTOP) between two all_reduce: the others name it at the timeout, and
    the job, the stopped process included, is gone."""
    p, msg = timed_out(n, "sigstop")
    assert msg.startswith("rank 0: all_reduce sequence 12 on group 'world' (shape (64,), dtype float32) did not "
                          "complete within 5 s"), msg
    assert f"Rank 1 of {n} has not reached this call" in msg
    assert re.search(r"^  rank 1: last call all_reduce sequence 11 on group 'world'", p.stderr, re.M), p.stderr


@pytest.mark.parametrize("n", NRANKS)
def test_member_only_group_creation_is_watched(n, tmp_path):
    """Only the members call create_group (MindSpore's usage) and member 1 never comes: the
    other members name it, with its stack; the non-member's world count is untouched."""
    p, msg = timed_out(n, "skip_member_create")
    k = max(2, n - 1)
    assert msg.startswith("rank 0: create_group sequence 1 on group 'late' (no array) did not complete"), msg
    assert f"Rank 1 of {k} has not reached this call" in msg
    assert re.search(r"^  rank 1 \(rank 1 of the group\): no collective on group 'late' yet; not in a "
                     r"collective$", p.stderr, re.M), p.stderr
    stack_shown(p, tmp_path, 1)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("mode", ["create_other_name", "create_other_ranks"])
def test_create_group_with_other_arguments_is_named_within_seconds(n, mode):
    """The last rank passes create_group another name (the whole world, as the others), or
    a rank list without rank 1: each member that waits sees a member creating its group
    with other members, or another group of its members, and reports within seconds, long
    before the timeout (60 s), naming that member (not "stuck in the transport")."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(n, mode, limit=90, env={"MPICOMM_TIMEOUT": str(LONG)}, token=token)
    nothing_left(token)
    assert p.returncode == 1 and took < EARLY, (p.returncode, took, p.stderr)
    last = n - 1
    reporters = [r for r in range(n) if f"[mpicomm rank {r}] CommunicationError" in p.stderr]
    assert reporters, p.stderr
    for r in reporters:
        msg = report_of(p, r, "CommunicationError")
        name = "pair2" if r == last and mode == "create_other_name" else "pair"
        assert msg.startswith(f"rank {r}: create_group sequence 1 on group '{name}' (no array) cannot complete"), msg
        assert "stuck in the transport" not in msg
        # the last rank's other members all passed another list (or name); the others' only the last rank
        others = ", ".join(str(q) for q in range(n) if q not in ((1, last) if mode == "create_other_ranks" else (last,))) \
            if r == last else str(last)
        assert re.search(rf"Ranks? {others} (is|are) creating this group with another name or other rank_ids: "
                         "every member must pass create_group the same name and rank_ids", msg), msg
    if 0 in reporters and mode == "create_other_ranks":
        assert re.search(rf"^  rank {last} \(rank {last} of the group\): in create_group sequence 1 on group "
                         rf"'pair' made of other ranks than this rank's \[0, 1, 2(, 3)?\]$", p.stderr, re.M), p.stderr
    elif 0 in reporters:
        assert re.search(rf"^  rank {last} \(rank {last} of the group\): no collective on group 'pair' yet; "
                         r"inside create_group sequence 1 on group '#\d+' \(a group of another name\)$", p.stderr, re.M), p.stderr


@pytest.mark.parametrize("gpu", [CPU, GPU])
def test_init_is_watched(gpu):
    """Rank 1 comes to init() long after the others: they report, at the timeout, the stage
    of init they wait in, and the job ends (on GPUs: before the NCCL communicator exists)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(2, "late_init", gpu, limit=TIMEOUT + 60, token=token)
    nothing_left(token)
    assert p.returncode == 1 and took < TIMEOUT + SLACK, (p.returncode, took)
    msg = report_of(p, 0)
    assert msg.startswith("rank 0: init() did not complete within 5 s; stage: joining the other ranks"), msg
    assert "RESULT" not in p.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_init_with_a_peer_late_to_start_mpi_succeeds_within_the_timeout(n):
    """Rank 1 calls init() (its first MPI call: MPI starts there) a third of the timeout after
    the others, whose MPI start waits for it: every rank's init succeeds and the first
    collective is right."""
    limit = 21
    p, took = run(n, "late_start", limit=limit + 60, env={"MPICOMM_TIMEOUT": str(limit), "LATE_S": str(limit / 3)})
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(p)
    assert all(res.get(r) == ["finished ok"] for r in range(n)), (res, p.stderr[-3000:])


@pytest.mark.parametrize("n", [2, 3])
def test_init_with_a_peer_that_never_starts_mpi_ends_the_job_naming_the_stage(n):
    """Rank 1 never calls init() within the job's life (it sleeps far past the timeout): the
    others, waiting in MPI's start (MPI_Init, which holds the GIL), report at the timeout that
    init did not complete, naming that stage, and the job ends; nothing is left running."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    p, took = run(n, "late_start", limit=TIMEOUT + 60, env={"LATE_S": "600"}, token=token)
    nothing_left(token)
    assert p.returncode != 0 and took < TIMEOUT + 15, (p.returncode, took, p.stderr[-3000:])
    # the first waiting rank whose timeout passes reports and ends the job (the others' reports
    # may be cut short by the end of the job)
    m = re.search(r"^[ \t]*\[mpicomm rank (\d+)\] CollectiveTimeoutError: rank \1: init\(\) did not complete "
                  rf"within {TIMEOUT} s; stage: starting MPI \(MPI_Init", p.stderr, re.M)
    assert m and m.group(1) != "1", p.stderr[-3000:]
    assert "RESULT" not in p.stdout


def test_sigusr1_prints_stacks_and_writes_flight_records(tmp_path):
    """kill -USR1 of mpirun (passed on to every rank): each rank prints its Python stack,
    writes it and its flight record, and goes on (the job then ends normally)."""
    token = f"faulttoken-{uuid.uuid4().hex}"
    argv = mpirun_argv(2, WORKER, "sigusr1", token)
    proc = subprocess.Popen(argv, env=clean_mpi_env({"MPICOMM_TIMEOUT": "30"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        ready = 0
        for line in proc.stdout:
            ready += line.startswith("RESULT") and line.rstrip().endswith("ready")
            if ready == 2:   # both ranks are in lagging_here
                break
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    d = tmp_path / "traces"
    for r in (0, 1):
        assert f"RESULT rank={r} dumped True" in out, out
        assert re.search(rf'^\[mpicomm rank {r}\]   File ".*reliability_worker.py", line \d+ in lagging_here$',
                         err, re.M), err
        assert f"[mpicomm rank {r}] flight record: {d / f'mpicomm-trace.rank{r}.json'}" in err
        assert json.loads((d / f"mpicomm-trace.rank{r}.json").read_text())["reason"] == "SIGUSR1"
        assert "in lagging_here" in (d / f"mpicomm-stack.rank{r}.txt").read_text()
    nothing_left(token)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


def test_launcher_stray_byte_after_a_banner_is_dropped():
    """The launcher's byte past its banner (a NUL or another byte) is not taken as the start of
    the rank's next line; a rank's own non-ASCII text stays."""
    from conftest import job_text
    banner = b"-" * 74 + b"\n"
    for stray in (b"\x00", b"\xd3"):
        assert job_text(banner + stray + b"[mpicomm rank 0] X\n") == banner.decode() + "[mpicomm rank 0] X\n"
        assert job_text(banner + stray) == banner.decode()
    assert job_text(banner + "é [rank 0]\n".encode()) == banner.decode() + "é [rank 0]\n"
    assert job_text(b"a\x00b\n") == "a\x00b\n"


ROW_REUSE = r"""
import time, numpy as np, mpicomm
mpicomm.init(backend="mpi")
r = mpicomm.get_rank()
x = np.random.default_rng(r).standard_normal(4)
want = sum(np.random.default_rng(q).standard_normal(4) for q in range(mpicomm.get_group_size()))
for name in ("first", "second"):
    mpicomm.create_group(name, [0, 1])
    np.testing.assert_allclose(mpicomm.all_reduce(x, group=name), want)
    if r == 1:
        time.sleep(1.5)    # rank 0's watchdog sees it wait in the destroy's barrier
    mpicomm.destroy_group(name)
    if name == "first":
        time.sleep(TIMEOUT + 2)
print(f"rank {r} done", flush=True)
"""


def test_a_destroyed_groups_row_leaves_nothing_to_the_next_group(tmp_path):
    """A group destroyed while rank 0's watchdog saw it wait (rank 1 came 1.5 s late to the
    destroy's barrier) frees its progress row, and the next group made takes it. That
    group's destroy is the same call number and collective: its 1.5 s wait must not be
    taken for the old one's, which began longer than the timeout ago (it was: a timeout
    report that counted from the old wait, and the job ended; in the suite, a false
    disagreement report in test_mismatch after test_agreement's group, at 4 ranks)."""
    script = tmp_path / "rows.py"
    script.write_text(f"TIMEOUT = {LONG // 10}\n" + ROW_REUSE)
    p, took = run_job(mpirun_argv(2, str(script)), clean_mpi_env({"MPICOMM_TIMEOUT": str(LONG // 10)}), 120)
    assert p.returncode == 0 and "CollectiveTimeoutError" not in p.stderr, p.stderr[-3000:]
    assert sorted(re.findall(r"^rank (\d) done$", p.stdout, re.M)) == ["0", "1"], p.stdout


UNEVEN = r"""
import numpy as np, mpicomm
mpicomm.init(backend="mpi")
r = mpicomm.get_rank()
x = np.ones(SHAPE(r), np.float32)
try:
    mpicomm.all_gather(x)
    print(f"rank {r}: returned", flush=True)
except Exception as e:
    print(f"rank {r}: {type(e).__module__}.{type(e).__name__}", flush=True)
print(f"rank {r}: after {mpicomm.all_reduce(np.ones(1, np.int32))[0]}", flush=True)
"""


@pytest.mark.parametrize("shape", ["rows", "trailing"])
def test_all_gather_of_rank_dependent_shapes_raises_or_ends_the_job_at_once(tmp_path, shape):
    """Horovod's allgather takes a different first dimension on each rank; mpicomm's needs
    sizes=. Without it (rows: 3 + rank rows; trailing: 10 x (rank + 1) columns) every rank
    raises CollectiveMismatchError and goes on, or the job ends long before the timeout: never
    MPI's own exception on a rank (a refusing rank's stand-in, which MPI truncated, let it
    through), never a wait for the timeout (Open MPI's handler of the SIGABRT that a corrupted
    heap raises could hang, so the crashed rank never exited)."""
    n = 4 if shape == "rows" else 2
    form = "(3 + r, 2)" if shape == "rows" else "(17, 10 * (r + 1), 17)"
    script = tmp_path / "uneven.py"
    script.write_text(f"SHAPE = lambda r: {form}\n" + UNEVEN)
    p, took = run_job(mpirun_argv(n, str(script)), clean_mpi_env({"MPICOMM_TIMEOUT": str(LONG)}), LONG + 60)
    assert took < EARLY, (took, p.stderr[-2000:])
    outcomes = re.findall(r"^rank (\d): (\S+)", p.stdout, re.M)
    assert all(o in ("mpicomm.errors.CollectiveMismatchError", "after") for _, o in outcomes), outcomes
    assert "mpi4py" not in p.stdout and "returned" not in p.stdout, p.stdout
    if p.returncode == 0:   # every rank raised, and the next call worked
        assert sorted(outcomes) == sorted([(str(r), o) for r in range(n)
                                           for o in ("mpicomm.errors.CollectiveMismatchError", "after")]), outcomes
        assert all(f"rank {r}: after {n}" in p.stdout for r in range(n)), p.stdout
