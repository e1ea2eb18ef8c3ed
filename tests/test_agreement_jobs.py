"""Disagreements that no rank can recover from, each in its own job: a rank blocked in a
call that cannot complete (another collective, a count that makes MPI wait, another root).
The watchdog names the disagreement, with every rank's call, within 2 s of the wait (not
at the timeout), and the job ends with a non-zero status. The timeout here is 60 s, so a
report that came from the timeout would fail the time limit."""

import re

import pytest

from conftest import clean_mpi_env, mpirun_argv, run_job
from launch_support import spawns_mpirun

TIMEOUT = 60   # MPICOMM_TIMEOUT of the jobs, s
# s within which a job must end: start-up, 1-3 s of waiting, the report and the abort, with
# room for a crowded 2-core machine; a report by the timeout comes after TIMEOUT s
EARLY = TIMEOUT * 3 // 4

HEAD = r"""
import sys, time, numpy as np, mpicomm
mpicomm.init(backend="mpi")
r, n = mpicomm.get_rank(), mpicomm.get_group_size()
x = np.random.default_rng(r).standard_normal(8)
mpicomm.all_reduce(x)    # everyone is up
mpicomm.barrier()
t0 = time.monotonic()
"""


def _not_last(n):
    """A pattern of any rank number but the last one's."""
    return "(?:" + "|".join(str(k) for k in range(n - 1)) + ")"


# case: (the code every rank runs, n -> patterns of each rank's call as the reports name it)
CASES = {
    # every rank but the last calls all_reduce, the last all_gather
    "collective": ("mpicomm.all_reduce(x) if r < n - 1 else mpicomm.all_gather(x)",
                   lambda n: [rf"rank {_not_last(n)}: all_reduce of 8 x float64, op sum\b",
                              rf"rank {n - 1}: all_gather of 8 x float64\b"]),
    # the case: 100,000 against 100,001 float32 (the shared-memory path at 3 ranks)
    "count": ("mpicomm.all_reduce(np.ones(100000 + (r == n - 1), np.float32))",
              lambda n: [rf"rank {_not_last(n)}: all_reduce of 100000 x float32, op sum\b",
                         rf"rank {n - 1}: all_reduce of 100001 x float32, op sum\b"]),
    # two roots: both wait for the other's data
    "root": ("mpicomm.reduce(x, root=0 if r < n - 1 else n - 1)",
             lambda n: [rf"rank {_not_last(n)}: reduce of 8 x float64, op sum, root 0\b",
                        rf"rank {n - 1}: reduce of 8 x float64, op sum, root {n - 1}\b"]),
    # an object collective's root, the same way (the others' broadcast_object waits for root 0's)
    "object_root": ("mpicomm.broadcast_object({'from': r}, root=0 if r < n - 1 else n - 1)",
                    lambda n: [rf"rank {_not_last(n)}: broadcast, root 0\b",
                               rf"rank {n - 1}: broadcast, root {n - 1}\b"]),
    # the group's first exchange of objects against a barrier: it must not meet the barrier
    # (its set-up did, and went on to wait unwatched, holding the GIL, past the timeout)
    "object_barrier": ("mpicomm.all_gather_object({'r': r}) if r < n - 1 else mpicomm.barrier()",
                       lambda n: [rf"rank {_not_last(n)}: all_gather\b", rf"rank {n - 1}: barrier\b"]),
    "barrier_object": ("mpicomm.barrier() if r < n - 1 else mpicomm.gather_object(r)",
                       lambda n: [rf"rank {_not_last(n)}: barrier\b", rf"rank {n - 1}: gather, root 0\b"]),
    # a broadcast root (and the members it reaches) return at once and go on: the member left
    # blocked names their call from the description they publish of the call they returned
    # from (it said "rank 0: another call")
    "returned_root": ("mpicomm.all_reduce(x) if r == n - 1 else mpicomm.broadcast(x, root=0)",
                      lambda n: [rf"rank {_not_last(n)}: broadcast of 8 x float64, root 0\b",
                                 rf"rank {n - 1}: all_reduce of 8 x float64, op sum\b"]),
    # a blocking recv (or a send too large to go out eagerly) with rank 1 before the collective
    # that rank 1 waits in: rank 1 names both (rank 0 cannot say which call it waits for)
    "recv_before_collective": ("mpicomm.recv(np.empty(8), 1, tag=3) if r == 0 else mpicomm.all_reduce(x)",
                               lambda n: [r"rank 0 waits in recv from this rank, tag 3, while this rank waits in "
                                          r"all_reduce sequence \d+ on group 'world', which rank 0 has not reached"]),
    "send_before_collective": ("mpicomm.send(np.random.default_rng(7).standard_normal(1 << 22), 1, tag=4) if r == 0 "
                               "else mpicomm.barrier()",
                               lambda n: [r"rank 0 waits in send to this rank, tag 4, while this rank waits in "
                                          r"barrier sequence \d+ on group 'world', which rank 0 has not reached"]),
    # a barrier started async_op=True on the last rank only: MPI never matches Ibarrier with
    # Barrier (every rank waited for the timeout, "stuck in the transport"). The last rank,
    # in Work.wait, describes its call when it finds the difference itself; on a crowded
    # host a peer's watchdog may end the job first, naming it "another call"
    "barrier_async": ("mpicomm.barrier(async_op=True).wait() if r == n - 1 else mpicomm.barrier()",
                      lambda n: [rf"rank {_not_last(n)}: barrier;",
                                 rf"rank {n - 1}: (barrier, async_op=True\b|another call)"]),
}


def _job(tmp_path, text, n):
    """Run ``text`` as a script on ``n`` ranks, the check at its default (on: MPICOMM_CHECK
    unset), a 60 s timeout; returns (the finished process, seconds it took)."""
    script = tmp_path / "case.py"
    script.write_text(text)
    env = clean_mpi_env({"MPICOMM_BACKEND": "mpi", "MPICOMM_TIMEOUT": str(TIMEOUT), "MPICOMM_TRACE_DIR": str(tmp_path)})
    env.pop("MPICOMM_CHECK", None)
    return run_job(mpirun_argv(n, str(script)), env, 120)


@spawns_mpirun
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_blocked_disagreement_ends_the_job_naming_each_call(tmp_path, case, n):
    code, words = CASES[case]
    p, took = _job(tmp_path, HEAD + code + "\nprint(f'rank {r}: returned', flush=True)\n", n)
    err = p.stderr
    assert p.returncode != 0, (p.stdout, err)
    reports = [ln for ln in err.splitlines() if "CollectiveMismatchError:" in ln]
    assert reports, err
    # the reports name every call that differs, as the ranks made them
    missing = [w for w in words(n) if not re.search(w, "\n".join(reports))]
    assert not missing, (missing, reports)
    assert f"did not complete within {TIMEOUT} s" not in err, err
    assert took < EARLY, took


BAD_ROOT_CALLS = {
    "broadcast_object": "mpicomm.broadcast_object({'from': r}, root=root)",
    "gather_object": "mpicomm.gather_object({'from': r}, root=root)",
    "save_on_rank0": "mpicomm.save_on_rank0({'from': r}, os.path.join(os.path.dirname(__file__), 'ck.pkl'), root=root)",
}


@spawns_mpirun
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("call", sorted(BAD_ROOT_CALLS))
def test_a_root_out_of_range_on_one_rank_is_named_on_every_rank(tmp_path, call, n):
    """Root 0 on every rank but rank 0 itself, which passes a root out of range: rank 0
    raises InvalidArgumentError, and every other rank, waiting for root 0, raises the
    refusal or (blocked inside the transport call) ends the job with a report naming it,
    within seconds, never at the timeout."""
    code = HEAD.replace("import sys,", "import os, sys,") + f"""
root = n + 3 if r == 0 else 0
try:
    {BAD_ROOT_CALLS[call]}
    print(f"rank {{r}}: returned", flush=True)
except mpicomm.InvalidArgumentError as e:
    print(f"rank {{r}}: raised {{type(e).__name__}}: {{e}}", flush=True)
"""
    p, took = _job(tmp_path, code, n)
    bad = rf"invalid root={n + 3}: expected a .*rank.* in 0\.\.{n - 1}"
    assert re.search(rf"^rank 0: raised InvalidArgumentError: {bad}", p.stdout, re.M), (p.stdout, p.stderr)
    for q in range(1, n):
        assert (re.search(rf"^rank {q}: raised RefusedElsewhereError: rank 0 refused .*{bad}", p.stdout, re.M)
                or re.search(rf"^\[mpicomm rank {q}\] .*rank 0 refused .*{bad}", p.stderr, re.M)), (p.stdout, p.stderr)
    assert f"did not complete within {TIMEOUT} s" not in p.stderr, p.stderr
    assert took < EARLY, took


@spawns_mpirun
def test_check_off_leaves_it_to_the_timeout(tmp_path):
    """MPICOMM_CHECK=0: the same blocked disagreement is found only by the timeout (what the
    check buys)."""
    script = tmp_path / "case.py"
    script.write_text(HEAD + CASES["collective"][0] + "\n")
    env = clean_mpi_env({"MPICOMM_BACKEND": "mpi", "MPICOMM_TIMEOUT": "6", "MPICOMM_CHECK": "0",
                         "MPICOMM_TRACE_DIR": str(tmp_path)})
    p, _ = run_job(mpirun_argv(2, str(script)), env, 120)
    assert p.returncode != 0
    assert "CollectiveTimeoutError" in p.stderr and "CollectiveMismatchError" not in p.stderr, p.stderr


CAUGHT = r"""
import sys, time, numpy as np, mpicomm
mpicomm.init(backend="mpi")
r, n = mpicomm.get_rank(), mpicomm.get_group_size()
rng = np.random.default_rng(r)
last = r == n - 1
mpicomm.barrier()
t0 = time.monotonic()
try:
    CASE
    print(f"rank {r}: returned", flush=True)
except mpicomm.MpicommError as e:
    print(f"rank {r}: raised {type(e).__name__}", flush=True)
for salt in (1, 2):   # the group goes on (a rank that returned raises in the first of these)
    parts = [np.random.default_rng([salt, k]).standard_normal(5) for k in range(n)]
    try:
        got = mpicomm.all_reduce(parts[r])
        # (a broadcast too: bytes of an earlier broadcast left in the communicator come here)
        got2 = mpicomm.broadcast(parts[r] * 2, root=0)
        right = np.allclose(got, np.sum(parts, axis=0)) and np.array_equal(got2, parts[0] * 2)
        print(f"rank {r}: next {'ok' if right else 'WRONG'}", flush=True)
    except mpicomm.MpicommError as e:
        print(f"rank {r}: next raised {type(e).__name__}", flush=True)
print(f"rank {r}: done in {time.monotonic() - t0:.1f} s", flush=True)
"""

CAUGHT_CASES = {
    # splits that disagree: compared by the exchange before the call, raised on every rank
    "all_to_all_splits": "mpicomm.all_to_all(rng.standard_normal(2 * n).astype(np.float32), in_splits=[2] * n, "
                         "out_splits=[3 if last else 2] * n)",
    # another element count, started asynchronously: the others wait in Work.wait
    "async_count": "mpicomm.all_reduce(rng.standard_normal(5 if last else 4).astype(np.float32), async_op=True).wait()",
    # the same all_reduce, async on the last rank only: MPI never matches a nonblocking
    # collective with a blocking one (the results were wrong on every rank, and every call after)
    "async_vs_blocking": "(mpicomm.all_reduce(rng.standard_normal(4).astype(np.float32), async_op=True).wait() "
                         "if last else mpicomm.all_reduce(rng.standard_normal(4).astype(np.float32)))",
    # an object collective against an array collective
    "object_vs_array": "mpicomm.broadcast_object({'a': r}) if last else mpicomm.broadcast(rng.standard_normal(4))",
    # the same from the root: its object's bytes stay in the communicator, and members that
    # decided alone whether the group starts afresh returned them from their next broadcast
    "object_root_vs_array": "mpicomm.broadcast_object({'a': r}) if r == 0 else mpicomm.broadcast(rng.standard_normal(4))",
}


@spawns_mpirun
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(CAUGHT_CASES))
def test_caught_disagreement_raises_everywhere_or_ends_the_job(tmp_path, case, n):
    """Disagreements a program catches and goes on from: every rank raises (in the call, in
    Work.wait or, where it had returned, in its next call) and the calls after are right; or,
    where a rank is blocked inside a call its peer left, the job ends naming the disagreement
    within seconds. Never a hang until the timeout, never a wrong result, never MPI's own
    exception."""
    p, took = _job(tmp_path, CAUGHT.replace("CASE", CAUGHT_CASES[case]), n)
    out = p.stdout + p.stderr
    assert f"did not complete within {TIMEOUT} s" not in out, out[-3000:]
    assert took < EARLY, took
    assert "WRONG" not in out, out[-3000:]
    assert "mpi4py" not in out and "raised Exception" not in out, out[-3000:]
    if p.returncode == 0:
        for r in range(n):
            assert f"rank {r}: raised" in out or f"rank {r}: next raised" in out, out[-3000:]
        assert out.count(": next ok") >= n, out[-3000:]   # the second call at least
    else:
        assert "CollectiveMismatchError" in out, out[-3000:]


ROOT_AHEAD = r"""
import os, time, numpy as np, mpicomm
mpicomm.init(backend="mpi")
r, n = mpicomm.get_rank(), mpicomm.get_group_size()
here = os.path.dirname(os.path.abspath(__file__))

def wait_for(name):   # another rank's step, by the file it writes after it
    while not os.path.exists(os.path.join(here, name)):
        time.sleep(0.01)

def mark(name):
    open(os.path.join(here, name), "w").close()

x = np.random.default_rng(r).standard_normal(4)
mpicomm.barrier()
if r != 0:
    wait_for("root-made-call-3")   # rank 0, the root, makes calls 2 and 3 (they return at once) first
try:
    # rank 0 broadcasts 4 x float32 where the others take 4 x float64: other bytes, so the group
    # starts afresh after the call
    mpicomm.broadcast(x.astype(np.float32) if r == 0 else x, root=0)
    print(f"rank {r}: returned", flush=True)
except mpicomm.CollectiveMismatchError:
    print(f"rank {r}: raised", flush=True)
    mark(f"raised-{r}")   # (a rank raises once the report is in every member's row)
try:
    got = mpicomm.broadcast(x * 3, root=0)   # call 3: rank 0 makes it on the old communicator
    right = np.random.default_rng(0).standard_normal(4) * 3
    print(f"rank {r}: call 3 {'ok' if np.array_equal(got, right) else 'WRONG'}", flush=True)
except mpicomm.MpicommError as e:
    print(f"rank {r}: call 3 raised {type(e).__name__}", flush=True)
if r == 0:
    mark("root-made-call-3")
    wait_for("raised-1")   # the report about call 2 is in this rank's row now
mpicomm.all_reduce(x)
print(f"rank {r}: done", flush=True)
"""


@spawns_mpirun
@pytest.mark.parametrize("n", [2, 3])
def test_a_root_past_the_reported_call_ends_the_job_naming_its_calls(tmp_path, n):
    """A broadcast root returns at once, so it may make the group's next calls before a member
    reports the call that differed; those calls went out on the communicator the members leave
    for a fresh one, where they would wait for them for ever: the root ends the job at its
    next call, within seconds, naming them. No rank returns a wrong result."""
    p, took = _job(tmp_path, ROOT_AHEAD, n)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "WRONG" not in out and "rank 0: done" not in out, out[-3000:]
    assert all(f"rank {q}: raised" in out for q in range(1, n)), out[-3000:]
    assert re.search(r"rank 0 had returned from call 2 and made call 3 \(broadcast of 4 x float64, root 0\) of "
                     r"group 'world' before the report came", out), out[-3000:]
    assert "rank 1: call 3 ok" not in out, out[-3000:]   # (the members wait in it: the job ends)
    assert f"did not complete within {TIMEOUT} s" not in out, out[-3000:]
    assert took < EARLY, took


REPEATED = r"""
import time, numpy as np, mpicomm
mpicomm.init(backend="mpi")
r, n = mpicomm.get_rank(), mpicomm.get_group_size()
last = r == n - 1
CALLS = {
    # the same bytes: every call completes, only the words differ (a sender runs ahead)
    "gather_same_bytes": lambda x, i: mpicomm.gather(x.astype(np.int64) if r == 0 else x, root=n - 1),
    "allreduce_op": lambda x, i: mpicomm.all_reduce(x, op="max" if last else "sum"),
    "allgather_dtype": lambda x, i: mpicomm.all_gather(x.astype(np.int64) if last else x),
    "reduce_op": lambda x, i: mpicomm.reduce(x, op="max" if r == 1 else "sum", root=0),
    # refused on one rank
    "refuse_out_shape": lambda x, i: mpicomm.all_reduce(x, out=np.empty(5) if last else None),
    "refuse_bad_root": lambda x, i: mpicomm.broadcast(x, root=n + 3 if last else 0),
    # other bytes, or calls that cannot complete: caught, or the job ends naming them
    "bcast_other_bytes": lambda x, i: mpicomm.broadcast(x.astype(np.float32) if r == 0 else x, root=0),
    "allreduce_count": lambda x, i: mpicomm.all_reduce(x[:5] if last else x),
    "allreduce_dtype": lambda x, i: mpicomm.all_reduce(x.astype(np.float32) if last else x),
    "object_vs_bcast": lambda x, i: mpicomm.broadcast_object({"i": i}) if r == 0 else mpicomm.broadcast(x, root=0),
    "async_vs_blocking": lambda x, i: mpicomm.all_reduce(x, async_op=True).wait() if last else mpicomm.all_reduce(x),
}
call = CALLS[CASE]
for i in range(50):
    try:
        res = call(np.random.default_rng([i, r]).standard_normal(6), i)
        # a rank may return from the call itself (where the report came after) only with a right
        # result: a non-root of gather or reduce (None), root 0's data from a broadcast
        x0 = np.random.default_rng([i, 0]).standard_normal(6)
        right = res is None or (CASE == "object_vs_bcast" and r == 0) or (
            CASE in ("bcast_other_bytes", "object_vs_bcast", "refuse_bad_root") and isinstance(res, np.ndarray)
            and np.array_equal(res, x0.astype(res.dtype)) and (r == 0 or res.dtype == x0.dtype))
        if not right:
            print(f"rank {r}: iteration {i}: the call itself returned without raising: WRONG", flush=True)
    except mpicomm.MpicommError:
        pass
    parts = [np.random.default_rng([i, 99, k]).standard_normal(4) for k in range(n)]
    try:   # checked calls after each: an all_reduce and a broadcast from a rank that changes
        got = mpicomm.all_reduce(parts[r])
        got2 = mpicomm.broadcast(parts[r] * 2, root=i % n)
        if not (np.allclose(got, np.sum(parts, axis=0)) and np.array_equal(got2, parts[i % n] * 2)):
            print(f"rank {r}: iteration {i} WRONG", flush=True)
    except mpicomm.MpicommError:
        pass
print(f"rank {r}: done", flush=True)
"""
CAUGHT_50 = ("gather_same_bytes", "allreduce_op", "allgather_dtype", "reduce_op", "refuse_out_shape",
             "refuse_bad_root")


@spawns_mpirun
@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("case", ["gather_same_bytes", "allreduce_op", "allgather_dtype", "reduce_op",
                                  "refuse_out_shape", "refuse_bad_root", "bcast_other_bytes", "allreduce_count",
                                  "allreduce_dtype", "object_vs_bcast", "async_vs_blocking"])
def test_the_same_disagreement_caught_50_times_in_a_row(tmp_path, case, n):
    """One disagreement made and caught 50 times in a row, each followed by checked calls:
    never a wrong result, never a wait for the timeout. Where the calls move the same bytes,
    or one rank refuses, the program goes on to its end; otherwise it goes on or the job ends
    within seconds, naming the calls."""
    p, took = _job(tmp_path, REPEATED.replace("CASE", repr(case)), n)
    out = p.stdout + p.stderr
    assert "WRONG" not in out, out[-3000:]
    assert f"did not complete within {TIMEOUT} s" not in out, out[-3000:]
    assert took < EARLY, took
    if case in CAUGHT_50 or p.returncode == 0:
        assert p.returncode == 0 and out.count(": done") == n, out[-3000:]
    else:
        assert "CollectiveMismatchError" in out, out[-3000:]


RUN_AHEAD = r"""
import time, numpy as np, mpicomm
mpicomm.init(backend="mpi")
r, n = mpicomm.get_rank(), mpicomm.get_group_size()
root = n - 1
for i in range(16):
    # rank 0 sends int32 where the others send float32 of the same size: the root's gather
    # completes, and only the comparison of the calls' words can tell. Rank 0, a sender, may
    # run many calls ahead of the root (its sends do not wait)
    parts = [np.random.default_rng([i, q]).integers(1, 10, size=8).astype(np.float32) for q in range(n)]
    try:
        got = mpicomm.gather(parts[r].astype(np.int32) if r == 0 else parts[r], root=root)
        if r == root and not np.array_equal(got, np.concatenate(parts)):
            print(f"rank {r}: call {i} WRONG", flush=True)
    except mpicomm.MpicommError:
        pass
print(f"rank {r}: done", flush=True)
"""


@spawns_mpirun
@pytest.mark.parametrize("n", [3, 4])
def test_a_rank_calls_ahead_is_still_compared(tmp_path, n):
    """A rank whose rooted calls return at once (a sender) runs calls ahead of the root; the
    root still compares each of its calls with that rank's, so a gather whose data differ in
    dtype (same bytes: MPI sees nothing) never returns a wrong result (the host ranks' copy of
    each other's calls held the last 8, and a sender 16 calls ahead had overwritten them)."""
    script = tmp_path / "ahead.py"
    script.write_text(RUN_AHEAD)
    env = clean_mpi_env({"MPICOMM_BACKEND": "mpi", "MPICOMM_TIMEOUT": "10", "MPICOMM_TRACE_DIR": str(tmp_path)})
    env.pop("MPICOMM_CHECK", None)
    p, took = run_job(mpirun_argv(n, str(script)), env, 240)
    out = p.stdout + p.stderr
    assert "WRONG" not in out, out[-3000:]
    assert "mpi4py" not in out, out[-3000:]
    assert p.returncode != 0 or out.count(": done") == n, out[-3000:]


LEFT = r"""
import numpy as np, mpicomm
mpicomm.init(backend="mpi")
r, n = mpicomm.get_rank(), mpicomm.get_group_size()
x = np.random.default_rng(r).standard_normal(2).astype(np.float32)
sizes = [2] * n
if r == n - 1:
    sizes[0] = 3   # another sizes list: every rank raises, and the group makes a fresh communicator
try:
    mpicomm.all_gather(x, sizes=sizes)
except mpicomm.CollectiveMismatchError as e:
    print(f"rank {r}: raised", flush=True)
if r == n - 1:   # one more call on this rank only: the others have left their script
    mpicomm.all_reduce(np.random.default_rng(9).standard_normal(4))
print(f"rank {r}: done", flush=True)
"""


@spawns_mpirun
@pytest.mark.parametrize("n", [2, 3])
def test_fresh_communicator_after_a_disagreement_is_watched(tmp_path, n):
    """The fresh communicator a disagreement leaves due is made at the group's next call
    (collective over the members): a rank that makes it while the others have left their
    script ends the job within seconds, naming them, as a call would (not an unwatched wait)."""
    p, took = _job(tmp_path, LEFT, n)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert all(f"rank {r}: raised" in out for r in range(n)), out[-3000:]
    assert f"rank {n - 1}: done" not in out, out[-3000:]
    assert "left" in out and "CommunicationError" in out, out[-3000:]
    assert f"did not complete within {TIMEOUT} s" not in out, out[-3000:]
    assert took < EARLY, took


CROSSED = {
    # members that pass create_group other rank lists: rank n-1 is no member in its own list,
    # returns, and waits in the world's next call; the others wait for it in the creation
    "create_group_rank_lists": ("mpicomm.create_group('g', list(range(n - 1)) if r == n - 1 else list(range(n)))\n"
                                "mpicomm.all_reduce(x)", ("create_group sequence 1 on group 'g'",)),
    # two groups' calls in another order on one rank
    "call_order": ("mpicomm.create_group('g', list(range(n)))\n"
                   "if r == 0:\n    mpicomm.all_reduce(x, group='g'); mpicomm.all_reduce(x)\n"
                   "else:\n    mpicomm.all_reduce(x); mpicomm.all_reduce(x, group='g')",
                   ("all_reduce sequence 1 on group 'g'", "all_reduce sequence 3 on group 'world'")),
}


@spawns_mpirun
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", sorted(CROSSED))
def test_crossed_waits_end_the_job_naming_both_calls(tmp_path, case, n):
    """A rank waits for a member that waits, in another group's call that needs every member,
    for this rank: neither can go on. The job ends within seconds naming both calls (not at
    the timeout)."""
    code, words = CROSSED[case]
    p, took = _job(tmp_path, HEAD + code + "\nprint(f'rank {r}: returned', flush=True)\n", n)
    err = p.stderr
    assert p.returncode != 0, (p.stdout, err)
    assert "neither can go on" in err and "on group 'world'" in err, err[-3000:]
    assert any(w in err for w in words), err[-3000:]   # (the first rank to tell names the other's call)
    assert f"did not complete within {TIMEOUT} s" not in err, err[-3000:]
    assert took < EARLY, took
