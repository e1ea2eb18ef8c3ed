"""The MPI program behind tests/test_faults.py and the init tests of tests/test_errors.py.

Run as ``mpirun -n N python tests/reliability_worker.py MODE [--gpu] [TOKEN]``. Every rank
prints lines ``RESULT rank=R ...`` that the tests read; faults are made on purpose.
"""
import os
import signal
import sys
import time

import numpy as np

MODE = sys.argv[1]
GPU = "--gpu" in sys.argv or "--double" in sys.argv
if "--double" in sys.argv:   # the NCCL backend over tests/fakecupy (the CPU double of CuPy)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecupy"))


def connect_pair(mpicomm, x, r):
    """NCCL connects a pair at its first send/recv, in the host call, which waits for the
    peer: ranks 0 and 1 make one matched exchange first, so that a later unmatched call is
    enqueued and waits on the GPU (or in Work.wait). Nothing to do on MPI."""
    if GPU and r < 2:
        mpicomm.sendrecv(x, 1 - r, out=arr(np.empty(4, np.float32)), src=1 - r)
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def rank_of_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def say(*parts):
    """A RESULT line on stdout, and in RELIABILITY_RESULTS/rank{R} where the test names that
    folder (mpirun forwards the ranks' output in chunks: a long line of one rank can be cut by
    another rank's line, so the tests read the files)."""
    line = " ".join([f"RESULT rank={rank_of_world()}", *map(str, parts)])
    print(line, flush=True)
    folder = os.environ.get("RELIABILITY_RESULTS")
    if folder:
        with open(os.path.join(folder, f"rank{rank_of_world()}"), "a") as f:
            f.write(line + "\n")


def expect_error(kind, fn):
    """Call fn; report the exception's class and message (one line), or that none came."""
    try:
        fn()
    except kind as e:
        say("raised", type(e).__name__, "|", str(e).replace("\n", " // "))
        return
    except Exception as e:  # the wrong kind
        say("wrong", type(e).__name__, "|", str(e).replace("\n", " // "))
        return
    say("no-error")


def arr(a):
    """The array type under test: CuPy on --gpu, else NumPy."""
    if GPU:
        import cupy

        return cupy.asarray(a)
    return a


def main():
    import mpicomm

    if MODE == "before_init":
        from mpi4py import MPI  # noqa: F401  (MPI up, mpicomm not)

        expect_error(mpicomm.NotInitializedError, lambda: mpicomm.all_reduce(np.ones(2)))
        expect_error(mpicomm.NotInitializedError, mpicomm.get_rank)
        expect_error(mpicomm.NotInitializedError, lambda: mpicomm.create_group("g", [0]))
        return
    if MODE == "bad_backend":
        from mpi4py import MPI  # noqa: F401

        expect_error(mpicomm.InvalidArgumentError, lambda: mpicomm.init(backend="gloo"))
        expect_error(mpicomm.InvalidArgumentError, lambda: mpicomm.init(timeout=-1))
        return
    if MODE == "nccl_unavailable":
        from mpi4py import MPI  # noqa: F401

        expect_error(mpicomm.BackendUnavailableError, lambda: mpicomm.init(backend="nccl"))
        mpicomm.init(backend="mpi")  # the failed init left nothing behind
        say("after", mpicomm.get_backend(), mpicomm.get_group_size())
        return
    if MODE == "reinit":
        mpicomm.init(backend="mpi", timeout=30)
        mpicomm.init(backend="mpi", timeout=30)  # same arguments: nothing happens
        expect_error(mpicomm.InvalidArgumentError, lambda: mpicomm.init(backend="mpi", timeout=31))
        mpicomm.finalize()
        mpicomm.init(backend="mpi", timeout=31)
        say("reinit", mpicomm.is_initialized())
        return
    if MODE == "noabort":
        prev = sys.excepthook
        mpicomm.init(abort_on_exception=False)
        say("hook", "mine" if sys.excepthook is prev else "replaced")
        mpicomm.finalize()
        mpicomm.init()
        installed = sys.excepthook is not prev
        mpicomm.finalize()
        say("default", "installed" if installed else "missing", "restored" if sys.excepthook is prev else "kept")
        return

    if MODE == "flight_bad_env":  # FLIGHT_BAD_VALUE as MPICOMM_FLIGHT_RECORDER (on FLIGHT_BAD_RANK only)
        from mpi4py import MPI

        only = os.environ.get("FLIGHT_BAD_RANK")
        if only is None or int(only) == MPI.COMM_WORLD.Get_rank():
            os.environ["MPICOMM_FLIGHT_RECORDER"] = os.environ["FLIGHT_BAD_VALUE"]
        expect_error(mpicomm.InvalidArgumentError, mpicomm.init)
        os.environ["MPICOMM_FLIGHT_RECORDER"] = "3"   # the failed init left nothing behind
        mpicomm.init()
        say("after", mpicomm.is_initialized(), float(mpicomm.all_reduce(np.ones(1))[0]))
        return

    if MODE == "timing_env":  # TIMING_BAD as MPICOMM_TIMING (on TIMING_BAD_RANK only, where given), then
        # each rank's own TIMING_GOOD_<rank>: every timing value after init, and a call
        import json

        from mpi4py import MPI

        r = MPI.COMM_WORLD.Get_rank()
        if "TIMING_BAD" in os.environ:
            only = os.environ.get("TIMING_BAD_RANK")
            if only is None or int(only) == r:
                os.environ["MPICOMM_TIMING"] = os.environ["TIMING_BAD"]
            expect_error(mpicomm.InvalidArgumentError, mpicomm.init)
        os.environ["MPICOMM_TIMING"] = os.environ.get(f"TIMING_GOOD_{r}", "")
        mpicomm.init()
        from mpicomm._timing import TIMING, names

        say("timing", json.dumps({k: getattr(TIMING, k) for k in names()}))
        n = mpicomm.get_group_size()
        got = mpicomm.all_reduce(np.random.default_rng([r, 5]).standard_normal(3))
        want = sum(np.random.default_rng([q, 5]).standard_normal(3) for q in range(n))
        say("after", "ok" if np.allclose(got, want) else "WRONG")
        return

    if MODE == "late_start":  # rank 1 starts MPI (its own init()) LATE_S seconds after the others
        if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")) == "1":   # (MPI not started yet)
            lagging_here(float(os.environ["LATE_S"]))
        mpicomm.init(backend="nccl" if GPU else None)
        r, n = mpicomm.get_rank(), mpicomm.get_group_size()
        got = mpicomm.all_reduce(np.random.default_rng([r, 11]).standard_normal(3))
        want = sum(np.random.default_rng([q, 11]).standard_normal(3) for q in range(n))
        say("finished", "ok" if np.allclose(got, want) else "WRONG")
        return

    if MODE == "late_init":  # rank 1 comes to init() long after the others
        if rank_of_world() == 1:
            lagging_here(120)
        mpicomm.init(backend="nccl" if GPU else None)
        say("finished")
        return

    mpicomm.init(backend="nccl" if GPU else None)
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    rng = np.random.default_rng([r, 7])

    if MODE == "skip":  # rank 1 skips the third all_reduce and sleeps
        x = arr(rng.standard_normal(4).astype(np.float32))
        for i in range(5):
            if i == 2 and r == 1:
                time.sleep(120)
                continue
            mpicomm.all_reduce(x)
            if GPU:
                import cupy

                cupy.cuda.get_current_stream().synchronize()
        say("finished")
    elif MODE == "replay_skip":  # a CuPy graph of one all_reduce; rank 1 skips the second replay and sleeps
        import cupy

        x = arr(rng.standard_normal(4).astype(np.float32))
        out = cupy.empty(4, np.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            mpicomm.all_reduce(x, out=out)
            s.synchronize()
            s.begin_capture()
            mpicomm.all_reduce(x, out=out)
            g = s.end_capture()
        for i in range(3):
            if i == 1 and r == 1:
                time.sleep(120)
                continue
            mpicomm.replay(g, s)
            s.synchronize()
        say("finished")
    elif MODE == "replay_stop":  # a graph of one all_reduce made by mpicomm.capture; rank 1 stops replaying
        import cupy

        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            x = arr(rng.standard_normal(4).astype(np.float32))
            out = cupy.empty(4, np.float32)
            mpicomm.all_reduce(x, out=out)
            s.synchronize()
        with mpicomm.capture(stream=s) as cap:
            mpicomm.all_reduce(x, out=out)
        say("captured", "|", cap.describe())
        for i in range(3):
            if i == 1 and r == 1:
                time.sleep(120)
                continue
            mpicomm.replay(cap.graph, s)
            s.synchronize()
        say("finished")
    elif MODE == "replay_pair":  # every rank replays a graph of the world once; ranks 0 and 1 then replay a
        # graph of their group "pair", and rank 1 stops after its first replay; rank 2 never captured that graph
        import cupy

        mpicomm.create_group("pair", [0, 1])
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            x = arr(rng.standard_normal(4).astype(np.float32))
            out = cupy.empty(4, np.float32)
            mpicomm.all_reduce(x, out=out)
            s.synchronize()
        with mpicomm.capture(stream=s) as w:
            mpicomm.all_reduce(x, out=out)
        mpicomm.replay(w.graph, s)
        s.synchronize()
        if r < 2:
            with s:
                mpicomm.all_reduce(x, out=out, group="pair")
                s.synchronize()
            with mpicomm.capture(stream=s) as cap:
                mpicomm.all_reduce(x, out=out, group="pair")
            say("captured", "|", cap.describe())
            for i in range(3):
                if i == 1 and r == 1:
                    time.sleep(120)
                    continue
                mpicomm.replay(cap.graph, s)
                s.synchronize()
        else:
            time.sleep(120)
        say("finished")
    elif MODE == "flight_skip":  # as "skip", but rank 1 writes its flight record before it stalls
        x = arr(rng.standard_normal(4).astype(np.float32))
        for i in range(5):
            if i == 2 and r == 1:
                say("dumped", mpicomm.dump_flight_record())
                time.sleep(120)
                continue
            mpicomm.all_reduce(x)
        say("finished")
    elif MODE == "flight_ring":  # 12 all_reduce of shapes (1,) .. (12,), then the record
        for i in range(12):
            mpicomm.all_reduce(arr(np.arange(i + 1, dtype=np.float64)))
        say("dumped", mpicomm.dump_flight_record())
    elif MODE == "wait_timeout":  # async work that can never complete: Work.wait raises
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == 1:
            time.sleep(120)
        w = mpicomm.all_reduce(x, async_op=True)
        w.wait(timeout=3)
        say("finished")
    elif MODE == "raise":
        x = arr(rng.standard_normal(4).astype(np.float32))
        for i in range(1000):
            mpicomm.all_reduce(x)
            if GPU:  # NCCL calls return before the GPU work ends: wait, as the CPU does
                import cupy

                cupy.cuda.get_current_stream().synchronize()
            if r == 1 and i == 20:
                raise ValueError("boom on purpose")
        say("finished")
    elif MODE == "kill":
        x = arr(rng.standard_normal(1024).astype(np.float32))
        for i in range(100000):
            mpicomm.all_reduce(x)
            if r == 1 and i == 50:
                os.kill(os.getpid(), signal.SIGKILL)
        say("finished")
    elif MODE == "mismatch":  # needs MPICOMM_DEBUG=1
        good = arr(rng.standard_normal(6).astype(np.float32))
        mpicomm.all_reduce(good)
        x = arr(rng.standard_normal(4 + r).astype(np.float32))
        expect_error(mpicomm.CollectiveMismatchError, lambda: mpicomm.all_reduce(x))
        y = arr(rng.standard_normal(4).astype(np.float32 if r == 0 else np.float64))
        expect_error(mpicomm.CollectiveMismatchError, lambda: mpicomm.all_gather(y))
        expect_error(mpicomm.CollectiveMismatchError,
                     lambda: mpicomm.broadcast(good, root=0) if r == 0 else mpicomm.all_reduce(good))
        expect_error(mpicomm.CollectiveMismatchError,
                     lambda: mpicomm.all_reduce(good, op="sum" if r else "max"))
        res = mpicomm.all_reduce(good)  # still usable after the errors: every rank's `good` summed
        want = sum(np.random.default_rng([k, 7]).standard_normal(6).astype(np.float32) for k in range(n))
        say("after", bool(np.allclose(_np(res), want, rtol=1e-5, atol=1e-6)))
    elif MODE == "other_collective":  # the last rank calls barrier where the others all_reduce
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == n - 1:
            mpicomm.barrier()
        else:
            mpicomm.all_reduce(x)
        say("finished")
    elif MODE == "caught_raise":  # rank 1's call fails a local check; it catches it and waits
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == 1:
            try:
                mpicomm.all_reduce(x, out=arr(np.empty(5, np.float32)))   # wrong out= shape
            except mpicomm.InvalidArgumentError:
                pass
            time.sleep(120)
        else:
            mpicomm.all_reduce(x)
        say("finished")
    elif MODE == "early_exit":  # rank 1 leaves the script while the others wait in all_reduce
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == 1:
            say("leaving")
            how, status = os.environ.get("EXIT_HOW", "sys.exit"), int(os.environ.get("EXIT_STATUS", "0"))
            if how == "raise":
                raise SystemExit(status)
            if how == "return":  # the script ends normally
                return
            if how == "finalize":   # done with mpicomm (fewer batches than its peers): it waits in finalize()
                mpicomm.finalize()
                say("finalized")
                return
            sys.exit(status)
        mpicomm.all_reduce(x)
        if GPU:   # NCCL enqueues the call: the wait is here
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        say("finished")
    elif MODE in ("fatal_inside", "fatal_outside"):   # rank 1 gets SIGSEGV, inside a call or after one
        import threading

        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == 1:
            say("segfaulting")
            if MODE == "fatal_outside":
                os.kill(os.getpid(), signal.SIGSEGV)
            # from another thread while this one waits in all_reduce sequence 2 (rank 0 comes late)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGSEGV)).start()
        else:
            time.sleep(4)
        mpicomm.all_reduce(x)
        say("finished")
    elif MODE == "count_crash":   # 2000 against 2100 float32: Open MPI 5 writes past a buffer
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
        x = arr(rng.standard_normal(2000 + 100 * (r == 1)).astype(np.float32))
        try:
            mpicomm.all_reduce(x)
            say("returned")
        except mpicomm.CollectiveMismatchError:
            say("raised CollectiveMismatchError")
    elif MODE == "skip_create_group":  # rank 1 never comes to create_group
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
        if r == 1:
            time.sleep(120)
        mpicomm.create_group("late", list(range(n)))
        say("finished")
    elif MODE in ("recv_nosend", "send_norecv", "recv_exit"):  # rank 0's recv/send; rank 1 never matches it
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        connect_pair(mpicomm, x, r)
        if r == 0:
            if MODE == "send_norecv" and GPU:  # GPU_SEND_COUNT: larger than NCCL can stage
                import cupy

                count = int(os.environ["GPU_SEND_COUNT"])
                y = cupy.random.default_rng(r + 1).standard_normal(count, dtype=cupy.float32)
                mpicomm.send(y, 1, tag=0)
            elif MODE == "send_norecv":   # 16 MiB: past the eager limit, the send waits for a recv
                mpicomm.send(arr(rng.standard_normal(4 << 20).astype(np.float32)), 1, tag=5)
            else:   # (GPU_TAG: a tagged GPU recv, which waits in MPI on the host)
                mpicomm.recv(x, 1, tag=int(os.environ.get("GPU_TAG", "0")) if GPU else 5)
            if GPU:   # NCCL enqueues the call: the wait is here
                import cupy

                cupy.cuda.get_current_stream().synchronize()
        elif r == 1:
            if MODE == "recv_exit":
                say("leaving")
                if os.environ.get("EXIT_HOW") == "finalize":
                    mpicomm.finalize()
                    say("finalized")
                    return
                sys.exit(int(os.environ.get("EXIT_STATUS", "0")))
            lagging_here(120)
        else:
            time.sleep(120)
        say("finished")
    elif MODE in ("async_recv_exit", "async_allreduce_exit"):  # rank 1 leaves; the others wait on a Work
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        connect_pair(mpicomm, x, r)
        if r == 1:
            say("leaving")
            sys.exit(int(os.environ.get("EXIT_STATUS", "0")))
        if MODE == "async_allreduce_exit":
            mpicomm.all_reduce(x, async_op=True).wait()
        elif r == 0:
            mpicomm.recv(x, 1, tag=0 if GPU else 5, async_op=True).wait()
        else:
            time.sleep(120)
        say("finished")
    elif MODE == "finalize_dropped":  # rank 0 drops an async recv that rank 1 never matches, then finalizes
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == 0:
            import warnings

            warnings.simplefilter("ignore")   # the dropped-Work warning: expected here
            mpicomm.recv(x, 1, tag=5, async_op=True)
            mpicomm.finalize()
        else:
            time.sleep(120)
        say("finished")
    elif MODE == "async_recv_timeout":  # rank 0's async recv from rank 1, which never sends
        x = arr(rng.standard_normal(4).astype(np.float32))
        mpicomm.all_reduce(x)
        if r == 0:
            mpicomm.recv(x, 1, tag=5, async_op=True).wait(timeout=3)
        else:
            time.sleep(120)
        say("finished")
    elif MODE == "tag_mismatch":  # rank 0 receives tag 5 from rank 1, which sends 16 MiB with tag 6
        y = rng.standard_normal(4 << 20).astype(np.float32)
        if r == 0:
            mpicomm.recv(np.empty_like(y), 1, tag=5)
        elif r == 1:
            mpicomm.send(y, 0, tag=6)
        else:
            time.sleep(120)
        say("finished")
    elif MODE == "exit_later":  # rank 1 leaves with EXIT_STATUS while the others compute (no call)
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
        if r == 1:
            say("leaving")
            sys.exit(int(os.environ.get("EXIT_STATUS", "0")))
        time.sleep(120)
        say("finished")
    elif MODE == "sigstop":  # rank 1 stops itself (SIGSTOP) in the middle of a loop
        x = arr(rng.standard_normal(64).astype(np.float32))
        for i in range(1000):
            mpicomm.all_reduce(x)
            if r == 1 and i == 10:
                os.kill(os.getpid(), signal.SIGSTOP)
        say("finished")
    elif MODE == "skip_member_create":  # only the members call create_group; member 1 never comes
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
        members = list(range(max(2, n - 1)))
        if r == 1:
            lagging_here(120)
        if r in members:
            mpicomm.create_group("late", members)
        else:
            time.sleep(120)
        say("finished")
    elif MODE in ("create_other_name", "create_other_ranks"):  # members disagree on create_group's arguments
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
        last = n - 1
        if MODE == "create_other_name":   # the last rank gives the group another name
            mpicomm.create_group("pair" if r != last else "pair2", list(range(n)))
        elif r != last:                   # the last rank leaves rank 1 out
            mpicomm.create_group("pair", list(range(n)))
        else:
            mpicomm.create_group("pair", [q for q in range(n) if q != 1])
        say("finished")
    elif MODE == "sigusr1":  # every rank idles after a call; the test signals mpirun with SIGUSR1
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
        stack = os.path.join(os.environ["MPICOMM_TRACE_DIR"], f"mpicomm-stack.rank{r}.txt")
        t0 = time.monotonic()
        ready = "ready"   # said from inside lagging_here: the test signals once every rank is there
        while not os.path.exists(stack) and time.monotonic() - t0 < 60:
            lagging_here(0.05, ready)
            ready = None
        time.sleep(0.5)
        say("dumped", os.path.exists(stack))
        mpicomm.all_reduce(arr(rng.standard_normal(4).astype(np.float32)))
    elif MODE == "shapes_nodebug":  # what MPI does with different counts, no debug mode
        x = np.arange(4 + r, dtype=np.float32)
        expect_error(Exception, lambda: mpicomm.all_reduce(x))
    elif MODE == "load":
        load()
    elif MODE == "bigcount":
        bigcount()
    else:
        raise SystemExit(f"unknown mode {MODE}")


def lagging_here(seconds, announce=None):
    """Sleep; the name shows in this rank's Python stack in a peer's timeout report.
    ``announce``: a result line to say first, from inside this function."""
    if announce:
        say(announce)
    time.sleep(seconds)


def statm_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load():
    """10,000 small collectives and several GiB, every value checked; report RSS growth."""
    import mpicomm

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    xp = np
    if GPU:
        import cupy as xp
    bad = 0
    # small: 10,000 collectives of 8-64 bytes, rank-dependent, exact in float64
    base = np.array([r + 1.5, -2.0 * r], np.float64)
    expect = np.array([sum(k + 1.5 for k in range(n)), sum(-2.0 * k for k in range(n))])
    rss0 = None
    for i in range(10000):
        if i == 500:
            rss0 = statm_rss()
        k = i % 4
        if k == 0:
            got = mpicomm.all_reduce(arr(base + i))
            ok = np.array_equal(_np(got), expect + n * i)
        elif k == 1:
            got = mpicomm.all_gather(arr(np.array([r * 10 + i], np.int64)))
            ok = np.array_equal(_np(got), np.arange(n) * 10 + i)
        elif k == 2:
            b = arr(np.array([i * 3 + r], np.int32))
            mpicomm.broadcast(b, root=i % n)
            ok = int(_np(b)[0]) == i * 3 + i % n
        else:
            got = mpicomm.all_reduce(arr(np.array([r, i], np.int32)), op="max")
            ok = np.array_equal(_np(got), [n - 1, i])
        bad += not ok
    rss_small = statm_rss()
    # large: 16 MiB float32 all_reduce x 256 = 4 GiB per rank; integer values: exact sums
    m = 4 << 20
    big = xp.asarray(np.random.default_rng([r, 1]).integers(-1000, 1000, m).astype(np.float32))
    total = xp.zeros(m, xp.float32)
    for k in range(n):
        total += xp.asarray(np.random.default_rng([k, 1]).integers(-1000, 1000, m).astype(np.float32))
    out = xp.empty_like(big)
    # one element every 16 KiB changes at every step (smaller than any piece a transport splits
    # the message into: the shared-memory path's pieces are 64 KiB or more), so that a stale
    # piece anywhere in the result would show
    marks = xp.arange(0, m, 4096)
    pattern = marks // 4096 % 13
    rss1 = None
    for i in range(256):
        if i == 8:
            rss1 = statm_rss()
        big[marks] = (pattern + i + r).astype(xp.float32)
        total[marks] = (n * (pattern + i) + sum(range(n))).astype(xp.float32)
        got = mpicomm.all_reduce(big, out=out)
        ok = bool((got == total).all())
        bad += not ok
    rss_big = statm_rss()
    say(f"bad={bad} rss_growth_small={rss_small - rss0} rss_growth_big={rss_big - rss1} "
        f"moved_bytes={256 * m * 4}")


def _np(a):
    if GPU:
        import cupy

        return cupy.asnumpy(a)
    return np.asarray(a)


def bigcount():
    """all_reduce (in place) and broadcast of 2**31 + 5 int8 elements (2 GiB a rank), which go
    in the pieces of mpicomm._backends.bigcount (CHUNK elements each): rank-dependent random
    values at the first, middle and last element of every piece, a rank-dependent fill
    elsewhere, every element checked, in steps, so that a rank holds little more than its
    2 GiB array."""
    import mpicomm
    from mpicomm._backends.bigcount import CHUNK

    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    count = 2 ** 31 + 5
    bounds = [(lo, min(count, lo + CHUNK)) for lo in range(0, count, CHUNK)]
    marks = np.array(sorted({i for lo, hi in bounds for i in (lo, (lo + hi) // 2, hi - 1)}))

    def at_marks(k, salt):   # rank k's values at the marks (the sum over the ranks fits int8)
        return np.random.default_rng([k, salt]).integers(-100 // n, 100 // n, marks.size).astype(np.int8)

    def fill_ok(x, want):    # every element but the marks is ``want``, checked 64 MiB at a time
        kept = x[marks]
        x[marks] = want
        step = 1 << 26
        ok = all(bool((x[lo:lo + step] == want).all()) for lo in range(0, count, step))
        x[marks] = kept
        return ok

    x = np.empty(count, np.int8)
    x[:] = r + 1
    x[marks] = at_marks(r, 1)
    y = mpicomm.all_reduce(x, out=x)
    want = np.sum([at_marks(k, 1).astype(np.int64) for k in range(n)], axis=0)
    ok = (y is x and x.shape == (count,) and np.array_equal(x[marks], want)
          and fill_ok(x, sum(k + 1 for k in range(n))))
    x[:] = r
    x[marks] = at_marks(r, 2)
    mpicomm.broadcast(x, root=n - 1)
    ok2 = np.array_equal(x[marks], at_marks(n - 1, 2)) and fill_ok(x, n - 1)
    say(f"pieces={len(bounds)} allreduce_ok={ok} broadcast_ok={ok2}")


if __name__ == "__main__":
    main()
