"""create_group as MindSpore uses it (only the members call it) and as before (every rank
calls it): collectives on the group against expectations computed from every member's
data, the world's calls counted alike on members and non-members, destroy_group by
members only. Runs at 1, 2, 3 and 4 ranks."""
import numpy as np
import pytest
from mpi4py import MPI

from conftest import rank_rng

pytestmark = pytest.mark.mpi


def _world_seqs():
    from mpicomm._state import CTX

    return MPI.COMM_WORLD.allgather(CTX.world.disp.seq)


def _members(n, how):
    if how == "reversed-odd":   # world ranks n-1, n-3, ...: group rank order differs from the world's
        return list(range(n - 1, -1, -2))
    return list(range(0, n, 2))


@pytest.mark.parametrize("who", ["members", "everyone"])
@pytest.mark.parametrize("how", ["reversed-odd", "even"])
def test_create_group_called_by_members_only_or_by_everyone(comm, request, who, how):
    n, r = comm.get_group_size(), comm.get_rank()
    members = _members(n, how)
    name = f"grp-{who}-{how}"
    seqs0 = _world_seqs()
    assert len(set(seqs0)) == 1, seqs0
    if r in members or who == "everyone":
        comm.create_group(name, members)
    if r in members:
        k = members.index(r)
        assert comm.get_rank(name) == k and comm.get_group_size(name) == len(members)
        assert comm.get_world_rank_from_group_rank(name, k) == r
        x = rank_rng(r, request.node.name).standard_normal((3, 2))
        got = comm.all_reduce(x, group=name)
        want = sum(rank_rng(m, request.node.name).standard_normal((3, 2)) for m in members)
        np.testing.assert_allclose(got, want, rtol=1e-12)
        g = comm.all_gather(np.array([r * 10 + 1], np.int64), group=name)
        np.testing.assert_array_equal(g, np.array(members) * 10 + 1)
        b = np.array([r + 0.5])
        comm.broadcast(b, root=len(members) - 1, group=name)
        assert b[0] == members[-1] + 0.5
    elif who == "everyone":   # a non-member that called it knows the group's ranks
        assert comm.get_world_rank_from_group_rank(name, 0) == members[0]
        with pytest.raises(comm.InvalidArgumentError, match="a group this rank belongs to"):
            comm.all_reduce(np.ones(2), group=name)
    # the world's calls are counted alike on members and non-members: the next world
    # collective is the same call everywhere, and its result is right
    assert _world_seqs() == seqs0
    x = rank_rng(r, request.node.name + "w").integers(-50, 50, 5)
    got = comm.all_reduce(x)
    want = sum(rank_rng(k, request.node.name + "w").integers(-50, 50, 5) for k in range(n))
    np.testing.assert_array_equal(got, want)
    if r in members or who == "everyone":
        comm.destroy_group(name)
    assert name not in __import__("mpicomm._state", fromlist=["CTX"]).CTX.groups or r not in members
    assert len(set(_world_seqs())) == 1
    MPI.COMM_WORLD.Barrier()


def test_group_recreated_after_destroy(comm, request):
    """The same name again after destroy_group, by the members only: a fresh group."""
    n, r = comm.get_group_size(), comm.get_rank()
    members = list(range(n))[::-1]
    for round_ in range(2):
        comm.create_group("grp-again", members)
        x = rank_rng(r, f"{request.node.name}{round_}").standard_normal(4)
        got = comm.all_reduce(x, group="grp-again", op="max")
        want = np.max([rank_rng(m, f"{request.node.name}{round_}").standard_normal(4) for m in members], axis=0)
        np.testing.assert_array_equal(got, want)
        comm.destroy_group("grp-again")
    MPI.COMM_WORLD.Barrier()


@pytest.mark.gpu
@pytest.mark.parametrize("who", ["members", "everyone"])
def test_member_only_group_on_gpu_arrays(comm, request, who):
    """Under NCCL the members build the group's communicator among themselves (a unique id
    sent over the members' MPI communicator): CuPy arrays on a group made by its members
    only. Skipped where the backend is not NCCL (no GPU)."""
    if comm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    import cupy

    n, r = comm.get_group_size(), comm.get_rank()
    members = list(range(n - 1, -1, -1))[: max(1, n - (n > 2))]   # all, or all but rank 0 beyond 2 ranks
    name = f"grp-gpu-{who}"
    if r in members or who == "everyone":
        comm.create_group(name, members)
    if r in members:
        x = rank_rng(r, request.node.name).standard_normal(1000).astype(np.float32)
        got = comm.all_reduce(cupy.asarray(x), group=name)
        cupy.cuda.get_current_stream().synchronize()
        want = sum(rank_rng(m, request.node.name).standard_normal(1000).astype(np.float32) for m in members)
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-5, atol=1e-5)
        g = comm.all_gather(cupy.asarray(np.array([r * 3 + 1], np.int64)), group=name)
        np.testing.assert_array_equal(cupy.asnumpy(g), np.array(members) * 3 + 1)
    x = rank_rng(r, request.node.name + "w").integers(-9, 9, 8).astype(np.float64)
    got = comm.all_reduce(cupy.asarray(x))
    want = sum(rank_rng(k, request.node.name + "w").integers(-9, 9, 8).astype(np.float64) for k in range(n))
    np.testing.assert_array_equal(cupy.asnumpy(got), want)
    if r in members or who == "everyone":
        comm.destroy_group(name)
    assert len(set(_world_seqs())) == 1
    MPI.COMM_WORLD.Barrier()
