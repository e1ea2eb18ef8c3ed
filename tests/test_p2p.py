"""Point-to-point that cannot deadlock: sendrecv, mpicomm.batch() and batch_isend_irecv, on the
world and a sub-group, checked against every rank's rank-seeded data; the issue's deadlock
(every rank sends 16 MB first, then receives) written both ways; sends to oneself; tags; bad input."""
import numpy as np
import pytest

import mpicomm
from launch_support import TORCH, require_module
from mpicomm import ReduceOp
from test_collectives import BF16, close, data, in_group, members, pick, reduce_np, subgroup  # noqa: F401

pytestmark = pytest.mark.mpi
GROUPS = ["world", "sub"]
DTYPES = [np.int8, np.int64, np.float16, BF16, np.float32, np.complex128]


def ctx(which, subgroup):
    g = pick(which, subgroup)
    ranks = members(g)
    return g, ranks, len(ranks), (ranks.index(mpicomm.get_rank()) if in_group(g) else None)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sendrecv_ring(comm, subgroup, dt, which, async_op, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    key = request.node.name
    nxt, prv = (me + 1) % n, (me - 1) % n
    x = data(ranks[me], key, (5, 3), dt)
    out = np.empty((5, 3), dt)
    r = mpicomm.sendrecv(x, nxt, out, prv, group=g, async_op=async_op)
    if async_op:
        assert isinstance(r, mpicomm.Work)
        r = r.wait()
    assert r is out
    close(out, data(ranks[prv], key, (5, 3), dt), dt)
    # out=None: a new array; src defaults to dst (pairs exchange)
    peer = me ^ 1 if (me ^ 1) < n else me
    got = mpicomm.sendrecv(x, peer, group=g)
    close(got, data(ranks[peer], key, (5, 3), dt), dt)


@pytest.mark.parametrize("how", ["sendrecv", "batch", "batch_isend_irecv"])
def test_the_issue_deadlock_every_rank_sends_16MB_first(comm, how, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    m = 4 * 1024 * 1024   # float32: 16 MB
    nxt, prv = (r + 1) % n, (r - 1) % n
    x = data(r, key, (m,), np.float32)
    out = np.empty(m, np.float32)
    if how == "sendrecv":
        mpicomm.sendrecv(x, nxt, out, prv)
    elif how == "batch":
        with mpicomm.batch() as b:
            ws = mpicomm.send(x, nxt), mpicomm.recv(out, prv)
        assert all(w.is_completed() for w in ws) and list(b.works) == list(ws)
    else:
        ws = mpicomm.batch_isend_irecv([mpicomm.P2POp(mpicomm.send, x, nxt), mpicomm.P2POp("recv", out, prv)])
        assert len(ws) == 2 and all(w.is_completed() for w in ws)
    close(out, data(prv, key, (m,), np.float32), np.float32)


@pytest.mark.parametrize("which", GROUPS)
def test_batch_with_collectives_and_tags(comm, subgroup, which, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    key = request.node.name
    a = data(ranks[me], key + "a", (7,), np.int32)
    b = data(ranks[me], key + "b", (4,), np.float64)
    ra, rb = np.empty(7, np.int32), np.empty(4, np.float64)
    s = data(ranks[me], key + "s", (6,), np.float32)
    nxt, prv = (me + 1) % n, (me - 1) % n
    with mpicomm.batch(g):
        # receives posted in the other order than the sends: the tags match them
        wb = mpicomm.recv(rb, prv, group=g, tag=2)
        wa = mpicomm.recv(ra, prv, group=g, tag=1)
        mpicomm.send(a, nxt, group=g, tag=1)
        mpicomm.send(b, nxt, group=g, tag=2)
        wr = mpicomm.all_reduce(s, group=g)
        assert isinstance(wr, mpicomm.Work)
    assert wa.is_completed() and wb.is_completed() and wr.is_completed()
    close(ra, data(ranks[prv], key + "a", (7,), np.int32), np.int32)
    close(rb, data(ranks[prv], key + "b", (4,), np.float64), np.float64)
    close(wr.wait(), reduce_np([data(q, key + "s", (6,), np.float32) for q in ranks], ReduceOp.SUM), np.float32)
    # after the block, calls are plain again
    assert isinstance(mpicomm.all_reduce(s, group=g), np.ndarray)


def test_send_to_oneself(comm, request):
    r = mpicomm.get_rank()
    x = data(r, request.node.name, (9,), np.float64)
    out = np.empty(9)
    ws = mpicomm.send(x, r, async_op=True)
    wr = mpicomm.recv(out, r, async_op=True)
    ws.wait()
    wr.wait()
    close(out, x, np.float64)
    out2 = np.empty(9)
    with mpicomm.batch():
        mpicomm.recv(out2, r)
        mpicomm.send(x, r)
    close(out2, x, np.float64)
    close(mpicomm.sendrecv(x, r), x, np.float64)
    with pytest.raises(mpicomm.InvalidArgumentError, match="dst.*oneself"):
        mpicomm.send(x, r)


def test_sendrecv_in_place_and_torch(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    x = data(r, key, (8,), np.int64)
    y = x.copy()
    assert mpicomm.sendrecv(y, (r + 1) % n, y, (r - 1) % n) is y   # out is x: sent first, then replaced
    close(y, data((r - 1) % n, key, (8,), np.int64), np.int64)
    torch = require_module("torch", TORCH)
    t = torch.from_numpy(data(r, key + "t", (3, 2), np.float32))
    got = mpicomm.sendrecv(t, (r + 1) % n, src=(r - 1) % n)
    assert isinstance(got, torch.Tensor)
    close(got.numpy(), data((r - 1) % n, key + "t", (3, 2), np.float32), np.float32)


def test_bad_input(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    x = np.arange(3.0)
    with pytest.raises(mpicomm.InvalidArgumentError, match="dst"):
        mpicomm.sendrecv(x, n)
    with pytest.raises(mpicomm.InvalidArgumentError, match="src"):
        mpicomm.sendrecv(x, 0, src=-1)
    with pytest.raises(mpicomm.InvalidArgumentError, match="tag"):
        mpicomm.sendrecv(x, r, tag=-3)
    with pytest.raises(mpicomm.InvalidArgumentError, match="op"):
        mpicomm.P2POp("broadcast", x, 0)
    with pytest.raises(mpicomm.InvalidArgumentError, match="ops"):
        mpicomm.batch_isend_irecv([])
    with pytest.raises(mpicomm.InvalidArgumentError, match="ops"):
        mpicomm.batch_isend_irecv([x])
    with pytest.raises(mpicomm.InvalidArgumentError, match="one group"):
        mpicomm.batch_isend_irecv([mpicomm.P2POp("send", x, 0), mpicomm.P2POp("recv", x, 0, group="other")])
    with pytest.raises(mpicomm.InvalidArgumentError, match="batches do not nest"):
        with mpicomm.batch():
            with mpicomm.batch():
                pass
    # the outer batch was closed by its with-statement: plain calls work again
    close(mpicomm.all_reduce(np.full(2, r + 1.0)), np.full(2, n * (n + 1) / 2), np.float64)


@pytest.mark.parametrize("which", GROUPS)
def test_coalesced_block(comm, subgroup, which, request):
    """batch(coalesce=True): calls return what they return outside a batch (results, or a Work
    with async_op=True), nested blocks and a batch inside one work, nothing is left open."""
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    key = request.node.name
    xs = {q: data(q, key + "x", (5, 3), np.float32) for q in ranks}
    ys = {q: data(q, key + "y", (2,), np.int64) for q in ranks}
    out = np.empty((5, 3), np.float32)
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = np.empty(2, np.int64)
    with mpicomm.batch(g, coalesce=True) as c:
        r1 = mpicomm.all_reduce(xs[ranks[me]], ReduceOp.MAX, out=out, group=g)
        with mpicomm.batch(g, coalesce=True):
            r2 = mpicomm.all_gather(ys[ranks[me]], group=g)
        w3 = mpicomm.all_reduce(ys[ranks[me]], group=g, async_op=True)
        with mpicomm.batch(g) as b:
            mpicomm.send(ys[ranks[me]], nxt, group=g)
            mpicomm.recv(got, prv, group=g)
    assert c.works is None and len(b.works) == 2
    assert r1 is out and not isinstance(r2, mpicomm.Work) and isinstance(w3, mpicomm.Work)
    close(out, reduce_np(list(xs.values()), ReduceOp.MAX), np.float32)
    close(r2, np.concatenate([ys[q] for q in ranks]), np.int64)
    close(w3.wait(), reduce_np(list(ys.values()), ReduceOp.SUM), np.int64)
    close(got, ys[ranks[prv]], np.int64)
    # after the block, calls are plain again, and a batch opens as before
    close(mpicomm.all_reduce(xs[ranks[me]], group=g), reduce_np(list(xs.values()), ReduceOp.SUM), np.float32)
    with mpicomm.batch(g) as b2:
        w = mpicomm.all_reduce(xs[ranks[me]], group=g)
    assert isinstance(w, mpicomm.Work) and b2.works == [w]


def test_coalesce_must_be_a_bool(comm):
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"coalesce.*'yes'.*True or False"):
        mpicomm.batch(coalesce="yes")
