"""init/finalize, topology getters, groups and rank conversion (MindSpore's signatures)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mpicomm
from conftest import clean_mpi_env, mpirun_argv, run_job
from launch_support import spawns_mpirun

mpi = pytest.mark.mpi


def test_import_has_no_side_effects():
    """Importing mpicomm initialises neither MPI nor a GPU and prints nothing."""
    code = ("import sys, mpicomm; "
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI imported'; "
            "assert 'cupy' not in sys.modules, 'cupy imported'; "
            "assert not mpicomm.is_initialized()")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


@mpi
def test_init_twice_same_args_is_harmless_different_is_error(comm):
    backend = mpicomm.get_backend()
    mpicomm.init()  # same arguments: nothing happens
    mpicomm.init(backend)
    assert mpicomm.is_initialized() and mpicomm.get_backend() == backend
    with pytest.raises(mpicomm.InvalidArgumentError, match="same arguments"):
        mpicomm.init(backend, timeout=12345)


@mpi
def test_ranks_sizes_and_local(comm):
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    assert mpicomm.get_rank() == w.Get_rank()
    assert mpicomm.get_group_size() == w.Get_size()
    assert mpicomm.get_rank("nccl_world_group") == w.Get_rank()  # MindSpore's world names
    assert mpicomm.get_group_size("hccl_world_group") == w.Get_size()
    # every rank of this job is on one host here: the local view equals the world's,
    # computed independently from the host names
    hosts = w.allgather(MPI.Get_processor_name())
    me = hosts[w.Get_rank()]
    assert mpicomm.get_local_size() == hosts.count(me)
    assert mpicomm.get_local_rank_size() == hosts.count(me)  # MindSpore's name
    assert mpicomm.get_local_rank() == [i for i, h in enumerate(hosts) if h == me].index(w.Get_rank())


@mpi
def test_user_comm_world_traffic_does_not_match_mpicomm(comm):
    """mpicomm owns a clone of COMM_WORLD: a user's pending message is not consumed."""
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    n, me = w.Get_size(), w.Get_rank()
    req = w.isend(("user", me), dest=(me + 1) % n, tag=0)
    total = mpicomm.all_reduce(np.array([me + 1], np.int64))
    assert total[0] == n * (n + 1) // 2
    assert w.recv(source=(me - 1) % n, tag=0) == ("user", (me - 1) % n)
    req.wait()


@mpi
def test_groups_rank_conversion(comm):
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    ranks = list(range(n))[::-2]  # e.g. [3, 1] at 4 ranks, [1] at 2, [0] at 1
    mpicomm.create_group("odd_desc", ranks)
    try:
        for i, w in enumerate(ranks):
            assert mpicomm.get_world_rank_from_group_rank("odd_desc", i) == w
            assert mpicomm.get_group_rank_from_world_rank(w, "odd_desc") == i
        if me in ranks:
            assert mpicomm.get_rank("odd_desc") == ranks.index(me)
            assert mpicomm.get_group_size("odd_desc") == len(ranks)
            s = mpicomm.all_reduce(np.array([me], np.int64), group="odd_desc")
            assert s[0] == sum(ranks)
        else:
            with pytest.raises(mpicomm.InvalidArgumentError, match="not in"):
                mpicomm.all_reduce(np.array([me]), group="odd_desc")
        with pytest.raises(mpicomm.InvalidArgumentError, match="group_rank_id"):
            mpicomm.get_world_rank_from_group_rank("odd_desc", len(ranks))
        outside = [r for r in range(n) if r not in ranks]
        if outside:
            with pytest.raises(mpicomm.InvalidArgumentError, match="world_rank_id"):
                mpicomm.get_group_rank_from_world_rank(outside[0], "odd_desc")
    finally:
        mpicomm.destroy_group("odd_desc")
    with pytest.raises(mpicomm.InvalidArgumentError, match="odd_desc"):
        mpicomm.get_rank("odd_desc")


@mpi
def test_local_rank_of_a_group(comm):
    """MindSpore's get_local_rank(group) / get_local_rank_size(group): this rank's place
    among the group's members on its host, computed here from the host names."""
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    n, me = w.Get_size(), w.Get_rank()
    hosts = w.allgather(MPI.Get_processor_name())
    ranks = list(range(n))[::-2]   # descending: group rank order is not world rank order
    mpicomm.create_group("local_desc", ranks)
    try:
        if me in ranks:
            here = [wr for wr in ranks if hosts[wr] == hosts[me]]   # in group rank order
            assert mpicomm.get_local_rank("local_desc") == here.index(me)
            assert mpicomm.get_local_rank_size("local_desc") == len(here)
            assert mpicomm.get_local_size("local_desc") == len(here)
        else:
            with pytest.raises(mpicomm.InvalidArgumentError, match="not in"):
                mpicomm.get_local_rank("local_desc")
        assert mpicomm.get_local_rank("nccl_world_group") == mpicomm.get_local_rank()
        assert mpicomm.get_local_rank_size("hccl_world_group") == mpicomm.get_local_rank_size()
    finally:
        mpicomm.destroy_group("local_desc")
    with pytest.raises(mpicomm.InvalidArgumentError, match="local_desc"):
        mpicomm.get_local_rank("local_desc")


def test_calls_before_init_and_after_finalize_name_themselves():
    """A getter before init() names itself (not "a collective"); any call after finalize()
    (or MindSpore's release()) says finalize ended mpicomm and init() goes on; dir(mpicomm) lists the names loaded on
    first use."""
    code = """
import mpicomm, numpy as np
for f in ("get_rank", "get_group_size", "get_local_rank", "get_local_rank_size"):
    try:
        getattr(mpicomm, f)()
    except mpicomm.NotInitializedError as e:
        assert f + "() needs mpicomm.init() first" in str(e), e
    else:
        raise AssertionError(f)
mpicomm.init("mpi")
assert mpicomm.get_rank() == 0
mpicomm.finalize()
for call in (lambda: mpicomm.get_rank(), lambda: mpicomm.all_reduce(np.ones(2))):
    try:
        call()
    except mpicomm.NotInitializedError as e:
        assert "after mpicomm.finalize()" in str(e) and "call mpicomm.init() again" in str(e), e
    else:
        raise AssertionError("no error after finalize")
mpicomm.init("mpi")
x = np.random.default_rng(7).standard_normal(3)
np.testing.assert_array_equal(mpicomm.all_reduce(x), x)
mpicomm.release()                    # MindSpore's name for finalize()
assert not mpicomm.is_initialized()
try:
    mpicomm.get_rank()
except mpicomm.NotInitializedError as e:
    assert "after mpicomm.finalize()" in str(e), e
else:
    raise AssertionError("no error after release")
mpicomm.init("mpi")
assert mpicomm.get_process_group_ranks() == [0]
assert {"DistributedSampler", "GlobalComm", "average", "ops", "init"} <= set(dir(mpicomm))
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@mpi
def test_work_handle(comm):
    n = mpicomm.get_group_size()
    x = np.arange(10, dtype=np.float64) * (mpicomm.get_rank() + 1)
    w = mpicomm.all_reduce(x, async_op=True)
    res = w.wait(timeout=60)
    assert w.is_completed()
    np.testing.assert_allclose(res, np.arange(10) * n * (n + 1) / 2)
    assert w.wait() is res
    assert "completed" in repr(w)


def test_reduceop_names():
    assert mpicomm.ReduceOp.SUM == "sum"
    from mpicomm._ops import as_op

    assert as_op("MAX") is mpicomm.ReduceOp.MAX and as_op("avg") is mpicomm.ReduceOp.AVG
    with pytest.raises(mpicomm.InvalidArgumentError, match="op='bogus'.*SUM"):
        as_op("bogus")


def test_nccl_unique_id_forms():
    """CuPy >= 14 gives the NCCL id as bytes, older CuPy as a tuple of ints: accept both."""
    from mpicomm._backends.nccl import as_uid

    raw = bytes(range(120, 248))
    as_tuple = tuple(v - 256 if v > 127 else v for v in raw)
    assert as_uid(raw, like=b"") == raw
    assert as_uid(as_tuple, like=b"") == raw
    assert as_uid(raw, like=(0,)) == as_tuple
    assert as_uid(list(as_tuple), like=(0,)) == as_tuple


def test_finalize_does_not_wait_forever_for_a_communicator_nccl_will_not_destroy(capsys, monkeypatch):
    """NCCL waits in ncclCommDestroy until every CUDA graph that captured one of the
    communicator's calls is destroyed: finalize gives the destroy TIMING.destroy_wait seconds, then
    says why on stderr and goes on (a communicator whose destroy returns is destroyed as is)."""
    import contextlib
    import threading
    import time

    from mpicomm._backends import nccl
    from mpicomm._timing import TIMING

    class Communicator:   # stands for one whose ncclCommDestroy waits on a live graph
        def __init__(self, held):
            self.held, self.destroyed = held, threading.Event()

        def destroy(self):
            if self.held:
                threading.Event().wait(30)
            self.destroyed.set()

    monkeypatch.setattr(TIMING, "destroy_wait", 0.3)
    c = Communicator(held=False)
    nccl._destroy(c, 3, contextlib.nullcontext)
    assert c.destroyed.is_set() and capsys.readouterr().err == ""
    t0 = time.monotonic()
    nccl._destroy(Communicator(held=True), 3, contextlib.nullcontext)
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "rank 3: finalize() could not destroy the NCCL communicator within 0.3 s" in err
    assert "CUDA graph" in err and "del graph" in err


def test_init_hccl_says_what_to_use():
    """MindSpore's init("hccl") (Ascend): refused before MPI starts, naming nccl and mpi."""
    with pytest.raises(mpicomm.InvalidArgumentError) as e:
        mpicomm.init("hccl")
    msg = str(e.value)
    assert "invalid backend='hccl'" in msg and "'nccl'" in msg and "'mpi'" in msg and "Ascend" in msg


def test_mindspore_world_group_constants():
    """mindspore.communication's NCCL_WORLD_COMM_GROUP and HCCL_WORLD_COMM_GROUP (MindSpore's
    tests/st/nccl import them from mindspore.communication.management): the world's names."""
    from mpicomm import HCCL_WORLD_COMM_GROUP, NCCL_WORLD_COMM_GROUP
    from mpicomm._state import WORLD_ALIASES

    assert NCCL_WORLD_COMM_GROUP == "nccl_world_group" and HCCL_WORLD_COMM_GROUP == "hccl_world_group"
    assert {NCCL_WORLD_COMM_GROUP, HCCL_WORLD_COMM_GROUP} <= WORLD_ALIASES
    assert {"NCCL_WORLD_COMM_GROUP", "HCCL_WORLD_COMM_GROUP"} <= set(mpicomm.__all__)


@mpi
def test_mindspore_ops_module(comm):
    """from mpicomm import ops: MindSpore's operator classes, as mindspore.ops has them."""
    from mpicomm import ops

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    x = np.array([[r]], np.float32)
    np.testing.assert_array_equal(ops.AllGather()(x), np.arange(n, dtype=np.float32).reshape(n, 1))
    y = np.arange(4.0) * (r + 1)
    np.testing.assert_array_equal(ops.AllReduce(ops.ReduceOp.MAX)(y), np.arange(4.0) * n)
    assert mpicomm.ops is ops and ops.ReduceOp is mpicomm.ReduceOp


@mpi
def test_the_frameworks_rank_variables_are_set(comm):
    """After init(), the variables other launchers set (PyTorch/OneFlow RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE; MindSpore RANK_ID, RANK_SIZE; Paddle PADDLE_TRAINER_ID,
    PADDLE_TRAINERS_NUM, PADDLE_RANK_IN_NODE) hold MPI's values, which their own classes read
    (Paddle's DistributedBatchSampler): computed here from MPI and the host names."""
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    n, me = w.Get_size(), w.Get_rank()
    hosts = w.allgather(MPI.Get_processor_name())
    here = [r for r in range(n) if hosts[r] == hosts[me]]
    want = {"RANK": me, "WORLD_SIZE": n, "LOCAL_RANK": here.index(me), "LOCAL_WORLD_SIZE": len(here),
            "RANK_ID": me, "RANK_SIZE": n, "PADDLE_TRAINER_ID": me, "PADDLE_TRAINERS_NUM": n,
            "PADDLE_RANK_IN_NODE": here.index(me)}
    assert {k: os.environ.get(k) for k in want} == {k: str(v) for k, v in want.items()}


@spawns_mpirun
def test_rank_variables_from_the_launch_shell_are_replaced(tmp_path):
    """A RANK or PADDLE_TRAINER_ID inherited from the launch shell (another job's) names
    another rank: init() replaces it with this rank's."""

    script = tmp_path / "ranks.py"
    script.write_text("import os, mpicomm\nmpicomm.init('mpi')\n"
                      "print('ranks', mpicomm.get_rank(), os.environ['RANK'], os.environ['PADDLE_TRAINER_ID'],"
                      " os.environ['WORLD_SIZE'], flush=True)\n")
    env = clean_mpi_env({"RANK": "7", "PADDLE_TRAINER_ID": "7", "WORLD_SIZE": "99"})
    p, _ = run_job(mpirun_argv(2, str(script)), env, 120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = sorted(line.split()[1:] for line in p.stdout.splitlines() if line.startswith("ranks"))
    assert got == [["0", "0", "0", "2"], ["1", "1", "1", "2"]], p.stdout
