"""The host side of tagged GPU point-to-point (mpicomm._backends.tagged) on the CPU, under
real mpirun: the group's MPI transport carries the messages, and NumPy arrays stand in for
device memory (``land`` copies into them, as the NCCL transport's copies to the GPU do).
Out-of-order tags with messages far above MPI's eager limit (blocking sends return at once,
so the receiver may take tag 2 before tag 1), same-tag order, async receives, sendrecv, a
receive into a buffer too small, the outbox draining on close, and a sender that makes no
MPI call after its send (discriminating where MPI's large messages need the sender's
progress calls, e.g. ``mpirun --mca smsc ^cma,xpmem,knem`` on Open MPI 5). The GPU side is
tests/test_gpu_tags.py."""
import numpy as np
import pytest

import mpicomm
from mpicomm._backends.tagged import TaggedP2P
from test_collectives import data

pytestmark = pytest.mark.mpi(min_size=2)

BIG = 1 << 20     # 1 Mi float32 = 4 MB a message: MPI's rendezvous protocol, not eager


@pytest.fixture
def tp(comm):
    t = mpicomm._state.get_group(None).transport
    t = getattr(t, "inner", t)
    host = getattr(t, "host", t)   # (under NCCL, the MPI transport host arrays take)
    p = TaggedP2P(host)
    yield p
    p.close(wait=60)
    assert not p.outbox
    mpicomm.barrier()


def lander(dev):
    def land(o):
        np.copyto(dev, o)
    return land


def test_tags_out_of_order(tp, request):
    """Rank 0 sends tag 1 then tag 2 (blocking, 4 MB each); rank 1 receives tag 2 first."""
    me, key = mpicomm.get_rank(), request.node.name
    a, b = data(0, key + "1", (BIG,), np.float32), data(0, key + "2", (BIG // 2, 2), np.float32)
    if me == 0:
        assert tp.send(a.copy(), 1, 1, False) is None
        assert tp.send(b.copy(), 1, 2, False) is None   # returned: the receiver has not taken tag 1
    elif me == 1:
        db, da = np.zeros_like(b), np.zeros_like(a)
        assert tp.recv(np.empty_like(b), 0, 2, False, lander(db), db) is db
        np.testing.assert_array_equal(db, b)
        assert tp.recv(np.empty_like(a), 0, 1, False, lander(da), da) is da
        np.testing.assert_array_equal(da, a)


def test_same_tag_in_order_among_others(tp, request):
    """Messages of one tag arrive in the order sent, whatever other tags come between."""
    me, key = mpicomm.get_rank(), request.node.name
    plan = [(7, (5,), np.int64), (3, (BIG,), np.float32), (7, (4, 3), np.float64), (7, (5,), np.int64),
            (3, (2,), np.float32), (9, (0,), np.int8)]
    msgs = [data(0, f"{key}{i}", s, dt) for i, (_, s, dt) in enumerate(plan)]
    if me == 0:
        for (tag, _, _), m in zip(plan, msgs):
            tp.send(m.copy(), 1, tag, False)
    elif me == 1:
        order = [i for i in range(len(plan)) if plan[i][0] == 9] + \
                [i for i in range(len(plan)) if plan[i][0] == 7] + [i for i in range(len(plan)) if plan[i][0] == 3]
        for i in order:
            tag, s, dt = plan[i]
            dev = np.full(s, -1, dt)
            tp.recv(np.empty(s, dt), 0, tag, False, lander(dev), dev)
            np.testing.assert_array_equal(dev, msgs[i], err_msg=f"message {i} (tag {tag})")


def test_async_recv_lands_on_wait(tp, request):
    """An async receive posted before the send lands in the 'device' array when waited for;
    two async receives of one tag match the sends in order."""
    me, key = mpicomm.get_rank(), request.node.name
    xs = [data(0, key + str(i), (BIG // 4,), np.float64) for i in range(2)]
    if me == 1:
        devs = [np.zeros_like(x) for x in xs]
        ws = [tp.recv(np.empty_like(x), 0, 4, True, lander(d), d) for x, d in zip(xs, devs)]
        np.testing.assert_array_equal(devs[0], 0)   # nothing lands before wait()
    mpicomm.barrier()
    if me == 0:
        w = tp.send(xs[0].copy(), 1, 4, True)
        tp.send(xs[1].copy(), 1, 4, False)
        assert w.wait() is None
    elif me == 1:
        for w, d, x in zip(ws[::-1], devs[::-1], xs[::-1]):
            assert w.wait() is d
            np.testing.assert_array_equal(d, x)


def test_sendrecv_tagged(tp, request):
    """Ranks 0 and 1 exchange with sendrecv on tag 11 (blocking and async), landing in new arrays."""
    me, key = mpicomm.get_rank(), request.node.name
    if me > 1:
        return
    peer = 1 - me
    x = data(me, key, (3, 5), np.int32)
    dev = np.zeros((3, 5), np.int32)
    assert tp.sendrecv(x.copy(), peer, 11, False, np.empty_like(x), peer, lander(dev), dev) is dev
    np.testing.assert_array_equal(dev, data(peer, key, (3, 5), np.int32))
    dev2 = np.zeros((3, 5), np.int32)
    w = tp.sendrecv(x.copy(), peer, 11, True, np.empty_like(x), peer, lander(dev2), dev2)
    assert w.wait() is dev2
    np.testing.assert_array_equal(dev2, data(peer, key, (3, 5), np.int32))


def test_too_small_names_out(tp, request):
    """A tagged message larger than the receive buffer: CollectiveMismatchError on the receiver,
    naming out, its size and the size sent; the sender's blocking send still completes."""
    me, key = mpicomm.get_rank(), request.node.name
    x = data(0, key, (10,), np.float32)
    if me == 0:
        tp.send(x.copy(), 1, 6, False)
    elif me == 1:
        dev = np.zeros(4, np.float32)
        with pytest.raises(mpicomm.CollectiveMismatchError, match=r"out \(shape \(4,\), dtype float32\).*40 bytes"):
            tp.recv(np.empty(4, np.float32), 0, 6, False, lander(dev), dev)
        np.testing.assert_array_equal(dev, 0)   # nothing landed


def test_sender_away_from_mpi(tp, request, tmp_path, monkeypatch):
    """After a blocking tagged send the sender makes no MPI call (as when its next calls are
    NCCL's) until the receiver says, in a file, not through MPI, that it has the 4 MB
    message: where MPI allows threads, the outbox's thread moves it meanwhile. A message that
    waited for the sender's next MPI call would not come before the sender's deadline (half
    the watchdog's timeout, at most 60 s), and the test fails. (The sender's watchdog, which
    calls MPI_Iprobe once a second and so moves such a message too, in 5-10 s, is kept from
    doing so meanwhile.)"""
    import os
    import time

    from mpi4py import MPI

    me, key = mpicomm.get_rank(), request.node.name
    threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    a = data(0, key, (BIG,), np.float32)
    got = mpicomm.broadcast_object(str(tmp_path / "received") if me == 0 else None, root=0)
    timeout = mpicomm._state.CTX.timeout
    away = min(60.0, timeout / 2) if timeout else 60.0
    mpicomm.barrier()
    if me == 0:
        rel = mpicomm._state.CTX.reliability
        if rel is not None:
            monkeypatch.setattr(rel.progress, "poke", lambda: None)
        tp.send(a.copy(), 1, 12, False)
        if threaded:   # away from MPI until the receiver has the message, or the deadline
            deadline = time.monotonic() + away
            while not os.path.exists(got) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.path.exists(got), f"rank 1 did not receive the message within {away:g} s of its send"
    elif me == 1:
        dev = np.zeros_like(a)
        tp.recv(np.empty_like(a), 0, 12, False, lander(dev), dev)
        open(got, "w").close()
        np.testing.assert_array_equal(dev, a)
