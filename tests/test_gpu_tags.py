"""Tags on GPU arrays under NCCL (send/recv, sendrecv, batch_isend_irecv): MPI's matching
rules, with CuPy arrays and PyTorch CUDA tensors, checked against NumPy expectations from
rank-seeded data. Out-of-order tags (sent 1 then 2, received 2 then 1), same-tag order with
other tags and an untagged (NCCL) message between, mixed sizes and dtypes, sendrecv and
batch_isend_irecv with tags, a buffer too small, bad tags, tag 0 still on NCCL, and MindSpore's
ops.NeighborExchange over them. Skipped
(on every rank alike) where the backend is not NCCL; run on a multi-GPU machine:
    mpirun -n 2 python -m pytest -q --with-mpi -m mpi tests/test_gpu_tags.py
The host side (the outbox of sends, async landing) is tested on the CPU in tests/test_p2p_tags.py.
"""
import numpy as np
import pytest

import mpicomm
from test_collectives import BF16, data
from test_gpu import Cupy, Torch, nccl  # noqa: F401  (the fixture)
from test_gpu_uneven import close, group_ctx

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]
KINDS = [Cupy(), Torch()]
BIG = 1 << 20      # 4 MB of float32: far above MPI's eager limit


def sync(kind):
    if kind.name == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.Device().synchronize()


def empty(kind, shape, dt):
    return kind.to(np.zeros(shape, dt))


@pytest.mark.parametrize("which", ["world", "sub"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_tags_out_of_order(nccl, kind, which, request):
    """Every rank sends tag 1 then tag 2 to the next rank (blocking sends: they return at
    once) and receives tag 2 then tag 1 from the previous one; sizes and dtypes differ."""
    g, ranks, n, me = group_ctx(which, nccl)
    if me is None or n < 2:
        return
    key = request.node.name
    nxt, prv = (me + 1) % n, (me - 1) % n
    d1, d2 = (BF16 if kind.name == "torch" else np.float16), np.int64
    s1, s2 = (BIG,), (3, 7)
    assert mpicomm.send(kind.to(data(ranks[me], key + "1", s1, d1)), nxt, group=g, tag=1) is None
    assert mpicomm.send(kind.to(data(ranks[me], key + "2", s2, d2)), nxt, group=g, tag=2) is None
    o2, o1 = empty(kind, s2, d2), empty(kind, s1, d1)
    assert mpicomm.recv(o2, prv, group=g, tag=2) is o2
    assert mpicomm.recv(o1, prv, group=g, tag=1) is o1
    sync(kind)
    close(kind.host(o2), data(ranks[prv], key + "2", s2, d2))
    close(kind.host(o1), data(ranks[prv], key + "1", s1, d1))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_same_tag_in_order_with_untagged_between(nccl, kind, request):
    """Rank 2k sends to 2k+1: tag 7 A, tag 0 B (NCCL), tag 7 C, tag 3 D; the receiver takes
    A, B, then D before C: same-tag messages in order, other tags overtaking."""
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    key = request.node.name
    plan = {"A": (7, (5,), np.float32), "B": (0, (BIG,), np.float32), "C": (7, (2, 9), np.int32),
            "D": (3, (BIG // 2,), np.float64)}
    src = r & ~1

    def msg(name):
        return data(src, key + name, plan[name][1], plan[name][2])
    if (r ^ 1) >= n:
        pass   # the odd rank out (at an odd rank count) only joins the barrier
    elif r % 2 == 0:
        for name in "ABCD":
            mpicomm.send(kind.to(msg(name)), r + 1, tag=plan[name][0])
    else:
        for name in "ABDC":
            tag, shape, dt = plan[name]
            o = empty(kind, shape, dt)
            mpicomm.recv(o, r - 1, tag=tag)
            sync(kind)
            close(kind.host(o), msg(name))
    sync(kind)
    mpicomm.barrier()


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_tagged_async_and_sendrecv(nccl, kind, async_op, request):
    """Async tagged receives posted before the sends; sendrecv with a tag (out=None, out=,
    out=x) around a ring."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    nxt, prv = (me + 1) % n, (me - 1) % n
    dts = [np.float32, np.int8, BF16 if kind.name == "torch" else np.complex64]
    shapes = [(BIG // 4,), (17,), (4, 4)]
    if async_op:
        outs = [empty(kind, s, dt) for s, dt in zip(shapes, dts)]
        ws = [mpicomm.recv(o, prv, tag=20 + i, async_op=True) for i, o in enumerate(outs)]
        sent = [mpicomm.send(kind.to(data(me, key + str(i), s, dt)), nxt, tag=20 + i, async_op=True)
                for i, (s, dt) in enumerate(zip(shapes, dts))]
        for i in (2, 0, 1):
            assert ws[i].wait() is outs[i]
            close(kind.host(outs[i]), data(prv, key + str(i), shapes[i], dts[i]))
        for w in sent:
            assert w.wait() is None
    x = kind.to(data(me, key + "x", (6, 5), np.float32))
    got = mpicomm.sendrecv(x, nxt, src=prv, tag=9, async_op=async_op)
    got = got.wait() if async_op else got
    close(kind.host(got), data(prv, key + "x", (6, 5), np.float32))
    out = empty(kind, (6, 5), np.float32)
    got = mpicomm.sendrecv(x, nxt, out=out, src=prv, tag=9, async_op=async_op)
    assert (got.wait() if async_op else got) is out
    close(kind.host(out), data(prv, key + "x", (6, 5), np.float32))
    got = mpicomm.sendrecv(x, nxt, out=x, src=prv, tag=10, async_op=async_op)   # in place
    assert (got.wait() if async_op else got) is x
    sync(kind)
    close(kind.host(x), data(prv, key + "x", (6, 5), np.float32))
    mpicomm.barrier()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_batch_isend_irecv_tags(nccl, kind, request):
    """One batch: tags 1 and 2 to the next rank, received from the previous rank in the other
    order, beside an untagged (NCCL) pair; and mpicomm.batch() with tags."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    nxt, prv = (me + 1) % n, (me - 1) % n
    xs = {t: kind.to(data(me, f"{key}{t}", (t + 3, 2), np.float32)) for t in (0, 1, 2)}
    outs = {t: empty(kind, (t + 3, 2), np.float32) for t in (0, 1, 2)}
    ops = [mpicomm.P2POp(mpicomm.send, xs[1], nxt, tag=1), mpicomm.P2POp(mpicomm.send, xs[2], nxt, tag=2),
           mpicomm.P2POp(mpicomm.send, xs[0], nxt),
           mpicomm.P2POp(mpicomm.recv, outs[2], prv, tag=2), mpicomm.P2POp(mpicomm.recv, outs[1], prv, tag=1),
           mpicomm.P2POp(mpicomm.recv, outs[0], prv)]
    for w in mpicomm.batch_isend_irecv(ops):
        w.wait()
    sync(kind)
    for t in (0, 1, 2):
        close(kind.host(outs[t]), data(prv, f"{key}{t}", (t + 3, 2), np.float32))
    y = kind.to(data(me, key + "y", (BIG,), np.float32))
    o = empty(kind, (BIG,), np.float32)
    with mpicomm.batch():
        mpicomm.recv(o, prv, tag=5)
        mpicomm.send(y, nxt, tag=5)
    sync(kind)
    close(kind.host(o), data(prv, key + "y", (BIG,), np.float32))
    mpicomm.barrier()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_tagged_too_small(nccl, kind, request):
    """A tagged message larger than out: CollectiveMismatchError on the receiver naming out,
    its size and the size sent; the sender goes on."""
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    if (r ^ 1) < n:
        x = data(r & ~1, request.node.name, (10,), np.float32)
        if r % 2 == 0:
            mpicomm.send(kind.to(x), r + 1, tag=6)
        else:
            with pytest.raises(mpicomm.CollectiveMismatchError, match=r"out \(shape \(4,\).*40 bytes"):
                mpicomm.recv(empty(kind, (4,), np.float32), r - 1, tag=6)
    mpicomm.barrier()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_bad_tags(nccl, kind):
    """Bad tags are refused on the calling rank before anything is sent, as on the host."""
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    x = kind.to(np.arange(4, dtype=np.float32))
    for bad in (-1, True, 1.5, "3", 2 ** 62):
        with pytest.raises(mpicomm.InvalidArgumentError, match="tag"):
            mpicomm.send(x, (r + 1) % n, tag=bad)
        with pytest.raises(mpicomm.InvalidArgumentError, match="tag"):
            mpicomm.recv(x, (r + 1) % n, tag=bad, async_op=True)
        with pytest.raises(mpicomm.InvalidArgumentError, match="tag"):
            mpicomm.sendrecv(x, r, tag=bad)
        with pytest.raises(mpicomm.InvalidArgumentError, match="tag"):
            mpicomm.P2POp("send", x, r, tag=bad)
    with pytest.raises(mpicomm.InvalidArgumentError, match="oneself"):
        mpicomm.recv(x, r, tag=4)       # blocking, with oneself: never completes
    mpicomm.barrier()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_tag0_still_nccl_and_self(nccl, kind, request):
    """tag=0 stays on NCCL (an NCCL Work, not an MPI one); a tagged message to oneself works
    with async_op=True, as on MPI."""
    r, n = mpicomm.get_rank(), mpicomm.get_group_size()
    key = request.node.name
    x = kind.to(data(r, key, (33,), np.float64))
    if (r ^ 1) < n:
        o = empty(kind, (33,), np.float64)
        if r % 2 == 0:
            w = mpicomm.send(x, r + 1, async_op=True)
            assert type(w).__name__ == "NCCLWork"
            w.wait()
        else:
            w = mpicomm.recv(o, r - 1, async_op=True)
            assert type(w).__name__ == "NCCLWork"
            w.wait()
            sync(kind)
            close(kind.host(o), data(r - 1, key, (33,), np.float64))
    o = empty(kind, (33,), np.float64)
    ws = mpicomm.send(x, r, tag=8, async_op=True), mpicomm.recv(o, r, tag=8, async_op=True)
    assert type(ws[0]).__name__ != "NCCLWork"
    for w in ws[::-1]:
        w.wait()
    close(kind.host(o), data(r, key, (33,), np.float64))
    mpicomm.barrier()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gpu_neighbor_exchange(nccl, kind, request):
    """MindSpore's ops.NeighborExchange on GPU arrays: to both neighbours with another shape for
    each (one neighbour at 2 ranks, oneself at 1); the arrays received are of the input's kind,
    on this rank's GPU, in recv_rank_ids order."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    nxt, prv = (me + 1) % n, (me - 1) % n
    x = kind.to(data(me, key + "x", (5,), np.float32))
    y = kind.to(data(me, key + "y", (2, 3), np.float32))
    if kind.name == "torch":
        import torch

        rt = torch.float32
    else:
        rt = np.float32
    if n >= 3:
        got = mpicomm.ops.NeighborExchange([prv, nxt], [nxt, prv], ([5], [2, 3]), ([5], [2, 3]), rt)((x, y))
        want = [data(nxt, key + "x", (5,), np.float32), data(prv, key + "y", (2, 3), np.float32)]
    else:
        got = mpicomm.ops.NeighborExchange([nxt], [nxt], ([2, 3],), ([2, 3],), rt)((y,))
        want = [data(nxt, key + "y", (2, 3), np.float32)]
    sync(kind)
    assert isinstance(got, tuple) and len(got) == len(want)
    for a, w in zip(got, want):
        assert type(a) is type(x) and tuple(a.shape) == w.shape
        assert (a.device == x.device) if kind.name == "torch" else (a.data.device_id == x.data.device_id)
        close(kind.host(a), w)
    mpicomm.barrier()
