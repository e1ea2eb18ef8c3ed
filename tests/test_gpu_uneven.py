"""Per-rank sizes, gather/scatter, sendrecv and batch on GPU arrays under NCCL (CuPy arrays
and PyTorch CUDA tensors, world and sub-group, sync and async): the grouped send/recv paths
of the NCCL transport, checked against NumPy expectations from rank-seeded data. Skipped
(on every rank alike) where the backend is not NCCL; run on a multi-GPU machine:
    mpirun -n 2 python -m pytest -q --with-mpi -m mpi tests/test_gpu_uneven.py
"""
import numpy as np
import pytest

import mpicomm
from mpicomm import ReduceOp
from test_collectives import data, reduce_np
from test_gpu import Cupy, Torch, nccl  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]
KINDS = [Cupy(), Torch()]
DTYPES = ["int8", "int64", "float16", "bfloat16", "float32", "complex64"]


def group_ctx(which, grp):
    g = None if which == "world" else grp
    ranks = list(range(mpicomm.get_group_size())) if g is None else list(mpicomm._state.CTX.groups[g].ranks)
    me = ranks.index(mpicomm.get_rank()) if mpicomm.get_rank() in ranks else None
    return g, ranks, len(ranks), me


def sizes_of(n, salt=0):
    return [(3 * r + 1 + salt) % 4 for r in range(n)]


def host(kind, a):
    return kind.host(a)


def close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype.kind in "iu":
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a.astype(np.complex128), b.astype(np.complex128), rtol=1e-2, atol=1e-2)


def wait(r, async_op):
    return r.wait() if async_op else r


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", ["world", "sub"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_uneven_all(nccl, kind, dt, which, async_op, request):
    if not kind.ok(dt):
        pytest.skip(f"{kind.name} has no {dt}")
    g, ranks, n, me = group_ctx(which, nccl)
    if me is None:
        return
    key = request.node.name
    sizes = sizes_of(n)
    # all_gather sizes='auto'
    xs = [data(ranks[r], key, (sizes[r], 3), dt) for r in range(n)]
    got = wait(mpicomm.all_gather(kind.to(xs[me]), group=g, sizes="auto", async_op=async_op), async_op)
    close(host(kind, got), np.concatenate(xs))
    # all_to_all with splits
    S = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
    ys = [data(ranks[i], key + "a", (sum(S[i]), 2), dt) for i in range(n)]
    got = wait(mpicomm.all_to_all(kind.to(ys[me]), group=g, in_splits=S[me], out_splits="auto",
                                  async_op=async_op), async_op)
    close(host(kind, got), np.concatenate([ys[i][sum(S[i][:me]):sum(S[i][:me + 1])] for i in range(n)]))
    # reduce_scatter with sizes
    op = ReduceOp.SUM
    zs = [data(ranks[r], key + "rs", (sum(sizes), 2), dt) for r in range(n)]
    got = wait(mpicomm.reduce_scatter(kind.to(zs[me]), op, group=g, sizes=sizes, async_op=async_op), async_op)
    lo = sum(sizes[:me])
    close(host(kind, got), reduce_np(zs, op)[lo:lo + sizes[me]])
    # gather and scatter (root: the last rank)
    root = n - 1
    got = wait(mpicomm.gather(kind.to(xs[me]), root, group=g, sizes=sizes, async_op=async_op), async_op)
    if me == root:
        close(host(kind, got), np.concatenate(xs))
    else:
        assert got is None
    full = data(ranks[root], key + "sc", (2 * n, 3), dt)
    got = wait(mpicomm.scatter(kind.to(full) if me == root else None, root, group=g, sizes="auto",
                               async_op=async_op), async_op)
    close(host(kind, got), full[2 * me:2 * me + 2])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_sendrecv_batch_and_self(nccl, kind, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    nxt, prv = (r + 1) % n, (r - 1) % n
    m = 4 * 1024 * 1024   # 16 MB of float32: the deadlock, written correctly
    x = kind.to(data(r, key, (m,), "float32"))
    got = mpicomm.sendrecv(x, nxt, src=prv)
    close(host(kind, got), data(prv, key, (m,), "float32"))
    out = kind.to(np.zeros(m, np.float32))
    with mpicomm.batch():
        mpicomm.send(x, nxt)
        mpicomm.recv(out, prv)
        w = mpicomm.all_reduce(kind.to(data(r, key + "s", (5,), "float32")))
    close(host(kind, out), data(prv, key, (m,), "float32"))
    close(host(kind, w.wait()), reduce_np([data(q, key + "s", (5,), "float32") for q in range(n)], ReduceOp.SUM))
    # to oneself: inside a batch, or sendrecv
    self_out = kind.to(np.zeros(m, np.float32))
    with mpicomm.batch():
        mpicomm.send(x, r)
        mpicomm.recv(self_out, r)
    close(host(kind, self_out), data(r, key, (m,), "float32"))
    close(host(kind, mpicomm.sendrecv(x, r)), data(r, key, (m,), "float32"))
    ws = mpicomm.batch_isend_irecv([mpicomm.P2POp("send", x, nxt), mpicomm.P2POp("recv", out, prv)])
    for w in ws:
        w.wait()
    close(host(kind, out), data(prv, key, (m,), "float32"))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_p2p_refusals(nccl, kind):
    r = mpicomm.get_rank()
    x = kind.to(np.arange(4, dtype=np.float32))
    # (tags on GPU arrays: tests/test_gpu_tags.py)
    with pytest.raises(mpicomm.InvalidArgumentError, match="oneself"):
        mpicomm.send(x, r, async_op=True)
