"""Errors of point-to-point and object calls (issue 24), against each rank's seeded data.

MPI tests (run under mpirun at 1 to 4 ranks): a receive into an ``out`` smaller than what
was sent raises CollectiveMismatchError on the receiver, naming ``out``, its size and the
size sent, and the sender does not hang; so does one into an ``out`` larger than the message
(naming the sender and both sizes); bad tags (negative, -1 included, past MPI's
TAG_UB, not ints) are refused on the calling rank before anything is sent, by send, recv,
sendrecv, P2POp/batch_isend_irecv and the object calls; ``Work.wait`` refuses a timeout
that is not a number >= 0.

Serial tests start their own mpirun (this file is also the MPI program: ``python
tests/test_p2p_errors.py MODE``) under a 3 s timeout: object calls that can never complete
(the first object collective with a rank that comes late, two ranks that both recv_object
from each other, send_object and recv_object with different tags) are reported by the
watchdog naming the peer, and finalize() reports an async receive that can never
complete (and completes one whose send comes late).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zlib

import numpy as np
import pytest

import mpicomm
from conftest import ROOT, clean_mpi_env, left_behind, mpirun_argv, rank_rng, run_job

TIMEOUT = 3   # MPICOMM_TIMEOUT of the serial tests' jobs, seconds
DTYPES = [np.float64, np.int32, np.float32, np.int8]


def partner(r, n):
    """Pairs (0, 1), (2, 3), ...; the last rank of an odd count (and a lone rank) is its own."""
    return r ^ 1 if (r ^ 1) < n else r


def count_of(rank, key):
    """How many elements rank ``rank`` sends in test ``key``: 2..300 (eager-sized messages)."""
    return int(rank_rng(rank, key + "count").integers(2, 301))


def payload(rank, key, dt):
    g = rank_rng(rank, key + "data")
    return (g.integers(-100, 100, count_of(rank, key)) * (1.5 if np.dtype(dt).kind == "f" else 1)).astype(dt)


def the_tag(key):
    return zlib.crc32(key.encode()) % 30000 + 1


def barrier_sees_no_message():
    """No message is waiting for this rank (the refused calls sent nothing; every message sent
    was received). Between two barriers, so that no rank has gone on to its next test yet."""
    from mpi4py import MPI

    mpicomm.barrier()
    c = mpicomm._state.CTX.world.mpi_comm
    st = MPI.Status()
    waiting = c.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)
    mpicomm.barrier()
    assert not waiting, \
        f"a message is waiting: from {st.Get_source()}, tag {st.Get_tag()}, {st.Get_count(MPI.BYTE)} bytes"


# ------------------------------------------------------------------ out smaller than the message
@pytest.mark.mpi
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("how", ["recv", "recv_async", "sendrecv", "sendrecv_async", "batch"])
def test_recv_into_a_smaller_out_names_out_and_what_was_sent(comm, how, dt, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    p = partner(r, n)
    tag = the_tag(key)
    x = payload(r, key, dt)
    m = count_of(p, key)                          # what the partner sends
    small = int(rank_rng(r, key + "small").integers(1, m))   # 1..m-1 elements: too few
    out = np.full(small, 7, dt)
    sent = m * np.dtype(dt).itemsize
    err = None
    if p == r and how not in ("sendrecv", "sendrecv_async"):
        # a rank of its own (the last of an odd count): a message to oneself larger than the
        # receive goes past out's end in Open MPI 5's self path, which mpicomm does not see
        # (sendrecv with oneself knows both sizes and refuses it first: checked below)
        barrier_sees_no_message()
        return
    if how == "recv":
        # both blocking: the lower rank sends first; the eager send completes on its own
        try:
            if r < p:
                mpicomm.send(x, p, tag=tag)
                mpicomm.recv(out, p, tag=tag)
            else:
                try:
                    mpicomm.recv(out, p, tag=tag)
                finally:
                    mpicomm.send(x, p, tag=tag)
        except mpicomm.MpicommError as e:
            err = e
    elif how == "recv_async":
        w = mpicomm.recv(out, p, tag=tag, async_op=True)
        mpicomm.send(x, p, tag=tag)       # blocking: it completes, nothing hangs
        try:
            w.wait()
        except mpicomm.MpicommError as e:
            err = e
    elif how == "sendrecv":
        try:
            mpicomm.sendrecv(x, p, out, tag=tag)
        except mpicomm.MpicommError as e:
            err = e
    elif how == "sendrecv_async":
        try:   # (with oneself: refused at the call, both sizes being known)
            mpicomm.sendrecv(x, p, out, tag=tag, async_op=True).wait()
        except mpicomm.MpicommError as e:
            err = e
    else:
        try:
            with mpicomm.batch():   # (the send's Work is waited for first)
                mpicomm.send(x, p, tag=tag)
                mpicomm.recv(out, p, tag=tag)
        except mpicomm.MpicommError as e:
            err = e
    assert isinstance(err, mpicomm.CollectiveMismatchError), repr(err)
    msg = str(err)
    assert "MPI_ERR_TRUNCATE" not in msg   # mpicomm's own words, not MPI's
    for part in (f"rank {r}:", f"rank {p} (tag {tag})", f"out (shape ({small},), dtype {np.dtype(dt)})",
                 f"holds {small} elements, {small * np.dtype(dt).itemsize} bytes",
                 f"rank {p} sent {sent} bytes = {m} {np.dtype(dt)} elements"):
        assert part in msg, (part, msg)
    # the channel is clean: a matched exchange of the right size gets the partner's data
    right = np.empty(m, dt)
    got = mpicomm.sendrecv(x, p, right, tag=tag + 1)
    np.testing.assert_array_equal(got, payload(p, key, dt))
    barrier_sees_no_message()


# ------------------------------------------------------------------ out larger than the message
@pytest.mark.mpi
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("how", ["recv", "recv_async", "sendrecv", "sendrecv_async", "batch"])
def test_recv_into_a_larger_out_names_the_sender_and_both_sizes(comm, how, dt, request):
    """A message shorter than out (MPI receives it into out's head without a word) raises
    CollectiveMismatchError on the receiving rank, naming the sender, the size received and
    out's (a receive takes exactly out's size, as torch.distributed.recv); the sender returns."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    p = partner(r, n)
    tag = the_tag(key)
    x = payload(r, key, dt)
    m = count_of(p, key)                          # what the partner sends
    big = m + int(rank_rng(r, key + "big").integers(1, 50))   # room for more than that
    out = np.full(big, 7, dt)
    sent = m * np.dtype(dt).itemsize
    err = None
    if p == r and how not in ("sendrecv", "sendrecv_async"):   # (a blocking recv from oneself is refused)
        barrier_sees_no_message()
        return
    try:
        if how == "recv":
            if r < p:
                mpicomm.send(x, p, tag=tag)
                mpicomm.recv(out, p, tag=tag)
            else:
                try:
                    mpicomm.recv(out, p, tag=tag)
                finally:
                    mpicomm.send(x, p, tag=tag)
        elif how == "recv_async":
            w = mpicomm.recv(out, p, tag=tag, async_op=True)
            mpicomm.send(x, p, tag=tag)
            w.wait()
        elif how == "sendrecv":
            mpicomm.sendrecv(x, p, out, tag=tag)
        elif how == "sendrecv_async":
            mpicomm.sendrecv(x, p, out, tag=tag, async_op=True).wait()
        else:
            with mpicomm.batch():
                mpicomm.send(x, p, tag=tag)
                mpicomm.recv(out, p, tag=tag)
    except mpicomm.MpicommError as e:
        err = e
    assert isinstance(err, mpicomm.CollectiveMismatchError), repr(err)
    msg = str(err)
    for part in (f"rank {r}:", f"rank {p} (tag {tag}): the message is shorter than out",
                 f"rank {p} sent {sent} bytes = {m} {np.dtype(dt)} elements",
                 f"out (shape ({big},), dtype {np.dtype(dt)}) holds {big} elements, {big * np.dtype(dt).itemsize} bytes"):
        assert part in msg, (part, msg)
    if p != r:   # received: the head of out holds the message (with oneself, refused before MPI)
        np.testing.assert_array_equal(out[:m], payload(p, key, dt))
    # the channel is clean: a matched exchange of the right size gets the partner's data
    right = np.empty(m, dt)
    got = mpicomm.sendrecv(x, p, right, tag=tag + 1)
    np.testing.assert_array_equal(got, payload(p, key, dt))
    barrier_sees_no_message()


# ------------------------------------------------------------------ tags
def tag_ub():
    """MPI's TAG_UB, from MPI itself."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)


def bad_tags():
    ub = tag_ub()
    return ub, [-1, -7, ub + 1, 2 ** 63, np.int64(-1), "3", 2.0, None, True]


def refused(fn, tag, allowed):
    with pytest.raises(mpicomm.InvalidArgumentError) as e:
        fn()
    msg = str(e.value)
    assert f"tag={tag!r}" in msg and allowed in msg, msg
    return msg


@pytest.mark.mpi
def test_bad_tags_are_refused_before_anything_is_sent(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    p = partner(r, n)
    other = (r + 1) % n
    x = payload(r, key, np.float32)
    out = np.empty_like(x)
    ub, tags = bad_tags()
    assert ub >= 32767
    allowed = f"an int in 0..{ub}"
    for t in tags:
        refused(lambda: mpicomm.send(x, other, tag=t), t, allowed)
        refused(lambda: mpicomm.send(x, other, tag=t, async_op=True), t, allowed)
        refused(lambda: mpicomm.recv(out, other, tag=t), t, allowed)     # -1 is not ANY_TAG
        refused(lambda: mpicomm.recv(out, other, tag=t, async_op=True), t, allowed)
        refused(lambda: mpicomm.sendrecv(x, p, out, tag=t), t, allowed)
        refused(lambda: mpicomm.sendrecv(x, p, out, tag=t, async_op=True), t, allowed)
        refused(lambda: mpicomm.P2POp(mpicomm.send, x, other, tag=t), t, allowed)
        refused(lambda: mpicomm.P2POp("recv", out, other, tag=t), t, allowed)
        with pytest.raises(mpicomm.InvalidArgumentError, match="tag="):
            with mpicomm.batch():
                mpicomm.send(x, other, tag=t)
        if n > 1:
            refused(lambda: mpicomm.send_object({"r": r}, other, tag=t), t, "an int in 0..32767")
            refused(lambda: mpicomm.recv_object(other, tag=t), t, "an int in 0..32767")
    assert "-1 is not MPI's ANY_TAG" in refused(lambda: mpicomm.recv(out, other, tag=-1), -1, allowed)
    barrier_sees_no_message()


@pytest.mark.mpi
def test_tags_up_to_tag_ub_work(comm, request):
    """Tags past 32767 up to TAG_UB (and NumPy ints) are taken, and keep messages apart."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    p = partner(r, n)
    ub = tag_ub()
    big = int(rank_rng(0, key).integers(32768, ub))   # the same on every rank
    x, y = payload(r, key, np.float64), payload(r, key + "y", np.float64)
    ox, oy = np.empty(count_of(p, key)), np.empty(count_of(p, key + "y"))
    with mpicomm.batch():   # received in the other order than sent: the tags match them
        mpicomm.recv(oy, p, tag=np.int64(ub))
        mpicomm.recv(ox, p, tag=big)
        mpicomm.send(x, p, tag=big)
        mpicomm.send(y, p, tag=ub)
    np.testing.assert_array_equal(ox, payload(p, key, np.float64))
    np.testing.assert_array_equal(oy, payload(p, key + "y", np.float64))
    w = mpicomm.batch_isend_irecv([mpicomm.P2POp("send", x, p, tag=np.int32(7)),
                                   mpicomm.P2POp("recv", ox, p, tag=7)])
    assert all(v.is_completed() for v in w)
    np.testing.assert_array_equal(ox, payload(p, key, np.float64))
    if n > 1 and p != r:
        if r < p:
            mpicomm.send_object({"r": r, "x": x}, p, tag=np.int16(32767))
        got = mpicomm.recv_object(p, tag=32767)
        if r > p:
            mpicomm.send_object({"r": r, "x": x}, p, tag=32767)
        assert got["r"] == p and np.array_equal(got["x"], payload(p, key, np.float64))
    barrier_sees_no_message()


# ------------------------------------------------------------------ Work.wait(timeout=...)
@pytest.mark.mpi
def test_work_wait_refuses_a_bad_timeout(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    p = partner(r, n)
    x = payload(r, key, np.int32)
    out = np.empty(count_of(p, key), np.int32)
    w = mpicomm.sendrecv(x, p, out, tag=3, async_op=True)
    bad = [-1, -0.5, -1e-9, float("nan"), float("-inf"), "1", True, [1], np.float32(-2)]
    for t in bad:
        with pytest.raises(mpicomm.InvalidArgumentError) as e:
            w.wait(timeout=t)
        msg = str(e.value)
        assert f"timeout={t!r}" in msg and "a number of seconds >= 0" in msg, msg
        assert "did not complete" not in msg   # not reported as a stall
    assert w.wait(timeout=np.int64(60)) is out
    np.testing.assert_array_equal(out, payload(p, key, np.int32))
    for t in bad:   # a completed Work refuses them alike
        with pytest.raises(mpicomm.InvalidArgumentError, match="timeout="):
            w.wait(timeout=t)
    assert w.wait(timeout=0) is out and w.wait(timeout=2.5) is out
    a = mpicomm.all_reduce(np.full(3, r + 1.0), async_op=True)
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"timeout=-3"):
        a.wait(timeout=-3)
    np.testing.assert_array_equal(a.wait(), np.full(3, n * (n + 1) / 2))


# ------------------------------------------------------------------ serial: own mpirun
def inside_mpi_job():
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"))


serial = pytest.mark.skipif(inside_mpi_job(), reason="starts its own mpirun (a serial test)")


def job(n, mode, env=None, limit=TIMEOUT + 60):
    """Run this file as the MPI program ``mode`` at ``n`` ranks: (process, seconds)."""
    token = f"p2perr-{uuid.uuid4().hex}"
    argv = mpirun_argv(n, os.path.abspath(__file__), mode, token)
    traces = tempfile.mkdtemp(prefix="mpicomm-p2perr-")   # flight records and stacks of a report
    e = clean_mpi_env({"MPICOMM_TIMEOUT": str(TIMEOUT), "MPICOMM_TRACE_DIR": traces, **(env or {})})
    try:
        p, took = run_job(argv, e, limit, cwd=ROOT)
    except subprocess.TimeoutExpired as ex:
        raise AssertionError(f"the job ran past {limit} s: {ex.stderr[-3000:]}") from None
    finally:
        shutil.rmtree(traces, ignore_errors=True)
    left = left_behind(token)
    assert left == "", f"processes left behind: {left}"
    return p, took


def report(p, rank, kind="CollectiveTimeoutError"):
    m = re.search(rf"^\[mpicomm rank {rank}\] {kind}: (.*)$", p.stderr, re.M)
    assert m, p.stderr[-4000:]
    return m.group(1)


def timed_out(n, mode, env=None):
    p, took = job(n, mode, env)
    assert p.returncode != 0 and took < TIMEOUT + 25, (p.returncode, took, p.stderr[-3000:])
    assert "RESULT" not in p.stdout, p.stdout
    return p


@serial
@pytest.mark.parametrize("n, call, name", [(2, "all_gather_object", "all_gather"),
                                           (3, "all_gather_object", "all_gather"),
                                           (4, "all_gather_object", "all_gather"),
                                           (2, "gather_object", "gather"), (3, "scatter_object", "scatter")])
def test_first_object_collective_with_a_late_rank_times_out(n, call, name):
    """Rank 1 comes late to the job's first object collective (pkl5 duplicates the
    communicator there): the others report it after the timeout, naming rank 1."""
    p = timed_out(n, f"late_{call}")
    msg = report(p, 0)
    assert msg.startswith(f"rank 0: {name} sequence 1 on group 'world'"), msg
    assert f"did not complete within {TIMEOUT} s" in msg, msg
    assert f"Rank 1 of {n} has not reached this call" in msg, msg


@serial
@pytest.mark.parametrize("n", [2, 3, 4])
def test_recv_object_from_each_other_is_named(n):
    """Ranks 0 and 1 both recv_object from each other (the others sleep): each reports its
    recv after the timeout, naming the other rank, which is in a recv too."""
    p = timed_out(n, "recv_object_both")
    msg = report(p, 0)
    assert msg.startswith("rank 0: recv from rank 1 (tag 4, shape (), dtype object (recv_object)) on group 'world' "
                          f"did not complete within {TIMEOUT} s"), msg
    assert "Rank 1 is in another send or recv, not the matching send" in msg, msg
    assert re.search(r"^  rank 1: in recv from rank 0 \(tag 4\) on group 'world', not send to rank 0$",
                     p.stderr, re.M), p.stderr[-3000:]


@serial
@pytest.mark.parametrize("n", [2, 3, 4])
def test_send_object_and_recv_object_with_other_tags_are_named(n):
    """Rank 0 send_object's a 4 MiB object with tag 6 (past the eager limit: it waits) while
    rank 1 recv_object's with tag 5: both are reported, saying that the tags differ."""
    p = timed_out(n, "object_tags")
    msg = report(p, 0)
    assert msg.startswith("rank 0: send to rank 1 (tag 6, shape (), dtype object (send_object)) on group "
                          "'world' did not complete"), msg
    assert "Rank 1 is in the matching recv with another tag: the tags differ" in msg, msg
    assert re.search(r"^  rank 1: in recv from rank 0 with tag 5, not 6$", p.stderr, re.M), p.stderr[-3000:]


@serial
@pytest.mark.parametrize("n", [2, 3, 4])
def test_finalize_reports_an_async_recv_that_cannot_complete(n):
    """Rank 0 holds an async recv from rank 1 (never sent, never waited for) and calls
    finalize(): the recv is reported (naming it, its peer and finalize) and the job ends
    with an error, instead of finalize returning as if nothing were pending."""
    p = timed_out(n, "finalize_pending")
    msg = report(p, 0)
    assert msg.startswith("rank 0: recv from rank 1 (tag 9, shape (6,), dtype float32) on group 'world' did not "
                          f"complete within {TIMEOUT} s"), msg
    assert "Rank 1 has not reached the matching send" in msg, msg
    assert re.search(r"CollectiveTimeoutError: finalize\(\): recv from rank 1 \(tag 9, shape \(6,\), dtype float32\) "
                     r"on group 'world', started with async_op=True and never waited for, is still pending",
                     p.stderr), p.stderr[-3000:]
    assert "finished" not in p.stdout


@serial
@pytest.mark.parametrize("n", [2, 3])
def test_finalize_completes_an_async_recv_whose_send_comes_late(n):
    """The send comes 1 s after rank 0 called finalize(): finalize completes the held recv
    and returns; its Work then gives the data (checked against rank 1's seed)."""
    p, took = job(n, "finalize_late_send", env={"MPICOMM_TIMEOUT": "30"})   # (nothing here waits for the timeout:
    # 3 s let a loaded machine's MPI_Init end the job)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^RESULT rank=(\d+) (.*)$", p.stdout, re.M)}
    assert lines.get("0") == "received True", (lines, p.stderr[-3000:])
    assert sorted(lines) == [str(r) for r in range(n)]


# ------------------------------------------------------------------ the MPI program of the serial tests
def lagging_here(seconds):
    time.sleep(seconds)


def main(mode):
    import mpicomm

    mpicomm.init()
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    say = lambda *a: print(f"RESULT rank={r}", *a, flush=True)   # noqa: E731
    if mode.startswith("late_"):   # the job's first call: rank 1 comes late to it
        call = mode[len("late_"):]
        if r == 1:
            lagging_here(60)
        if call == "all_gather_object":
            mpicomm.all_gather_object({"r": r})
        elif call == "gather_object":
            mpicomm.gather_object({"r": r})
        else:
            mpicomm.scatter_object([{"i": i} for i in range(n)] if r == 0 else None)
        say("finished")
    elif mode == "recv_object_both":
        if r < 2:
            mpicomm.recv_object(1 - r, tag=4)
        else:
            lagging_here(60)
        say("finished")
    elif mode == "object_tags":
        if r == 0:
            mpicomm.send_object({"big": np.random.default_rng([r, 1]).standard_normal(1 << 19)}, 1, tag=6)
        elif r == 1:
            mpicomm.recv_object(0, tag=5)
        else:
            lagging_here(60)
        say("finished")
    elif mode == "finalize_pending":
        x = np.random.default_rng([r, 2]).standard_normal(6).astype(np.float32)
        mpicomm.all_reduce(x)
        if r == 0:
            w = mpicomm.recv(np.empty(6, np.float32), 1, tag=9, async_op=True)
            mpicomm.finalize()
            say("finished", w)
        else:
            lagging_here(60)
    elif mode == "finalize_late_send":
        x = np.random.default_rng([r, 3]).standard_normal(6).astype(np.float32)
        if r == 0:
            out = np.empty(6, np.float32)
            w = mpicomm.recv(out, 1, tag=9, async_op=True)
            mpicomm.finalize()
            ok = w.is_completed() and w.wait() is out and \
                np.array_equal(out, np.random.default_rng([1, 3]).standard_normal(6).astype(np.float32))
            say("received", ok)
        else:
            if r == 1:
                time.sleep(1)
                mpicomm.send(x, 0, tag=9)
            mpicomm.finalize()
            say("done")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1])
