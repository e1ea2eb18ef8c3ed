"""mpicomm collectives captured in a CUDA graph (CuPy stream capture and torch.cuda.graph)
and replayed: each replay runs the captured NCCL calls on the arrays' current contents.
Calls that cannot be captured (host arrays, sizes="auto") raise during capture. Skipped
(on every rank alike) where the backend is not NCCL; run on the 2-GPU machine."""
import numpy as np
import pytest

import mpicomm

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]

COLLS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


@pytest.fixture(scope="module")
def nccl(comm):
    if mpicomm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    return mpicomm.get_group_size(), mpicomm.get_rank()


def parts(n, seed, k):
    """Every rank's float32 input of k * n elements for replay ``seed`` (the same on every rank)."""
    return [np.random.default_rng([seed, q]).standard_normal(k * n).astype(np.float32) for q in range(n)]


def expected(coll, p, r, k):
    if coll == "all_reduce":
        return np.sum(p, axis=0)
    if coll == "all_gather":
        return np.concatenate(p)
    if coll == "reduce_scatter":
        return np.sum(p, axis=0)[r * k:(r + 1) * k]
    return p[0]   # broadcast from rank 0


def call(coll, x, out=None):
    if coll == "all_reduce":
        return mpicomm.all_reduce(x, out=out)
    if coll == "all_gather":
        return mpicomm.all_gather(x, out=out)
    if coll == "reduce_scatter":
        return mpicomm.reduce_scatter(x, out=out)
    return mpicomm.broadcast(x, root=0)


@pytest.mark.parametrize("coll", COLLS)
@pytest.mark.parametrize("given_out", [True, False], ids=["out", "new"])
def test_cupy_capture_and_replay(nccl, coll, given_out):
    import cupy as cp

    n, r, k = *nccl, 6
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.asarray(parts(n, 0, k)[r])
    oshape = {"all_reduce": k * n, "all_gather": k * n * n, "reduce_scatter": k}.get(coll)
    out = cp.empty(oshape, cp.float32) if given_out and oshape else None
    with s:
        call(coll, x, out)   # prepared (and its output's memory in the pool) before capture
        s.synchronize()
        s.begin_capture()
        res = call(coll, x, out)
        g = s.end_capture()
    for rep in range(1, 4):
        p = parts(n, rep, k)
        x[...] = cp.asarray(p[r])
        s.synchronize()
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_allclose(cp.asnumpy(res), expected(coll, p, r, k), rtol=1e-5, atol=1e-5)
    # the group goes on uncaptured
    p = parts(n, 9, k)
    x[...] = cp.asarray(p[r])
    with s:
        got = call(coll, x)
        s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(got), expected(coll, p, r, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("coll", COLLS)
def test_torch_graph_capture_and_replay(nccl, coll):
    torch = pytest.importorskip("torch")
    n, r, k = *nccl, 6
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.from_numpy(parts(n, 0, k)[r]).to(dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as torch.cuda.graph's docs ask
        call(coll, x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = call(coll, x)
    for rep in range(1, 4):
        p = parts(n, rep, k)
        x.copy_(torch.from_numpy(p[r]).to(dev))
        g.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(res.cpu().numpy(), expected(coll, p, r, k), rtol=1e-5, atol=1e-5)


def test_async_work_in_a_capture(nccl):
    """async_op=True in a capture: wait() orders nothing on the host (the replay's stream
    orders what follows); the result is right on every replay."""
    torch = pytest.importorskip("torch")
    n, r, k = *nccl, 4
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.from_numpy(parts(n, 0, k)[r]).to(dev)
    mpicomm.all_reduce(x.clone())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w = mpicomm.all_reduce(x, out=x, async_op=True)
        w.wait()
        y = x * 2
    for rep in range(1, 3):
        p = parts(n, rep, k)
        x.copy_(torch.from_numpy(p[r]).to(dev))
        g.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(y.cpu().numpy(), 2 * np.sum(p, axis=0), rtol=1e-5, atol=1e-5)


def test_host_array_in_a_capture_raises(nccl):
    """A host array's call runs on the host at once (over MPI): a replay would not repeat
    it, so it is refused during a capture, on every rank alike."""
    torch = pytest.importorskip("torch")
    n, r = nccl
    h = np.random.default_rng([3, r]).standard_normal(4)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(mpicomm.InvalidArgumentError, match="captur"):
        with torch.cuda.graph(g):
            mpicomm.all_reduce(h)
    # the group goes on
    hs = [np.random.default_rng([4, q]).standard_normal(4) for q in range(n)]
    np.testing.assert_allclose(mpicomm.all_reduce(hs[r]), np.sum(hs, axis=0), rtol=1e-12)


def test_sizes_auto_in_a_capture_raises(nccl):
    """sizes='auto' exchanges the sizes on the host once: refused during a capture; explicit
    sizes are captured and replay."""
    import cupy as cp

    n, r = nccl
    s = cp.cuda.Stream(non_blocking=True)
    sizes = [q + 1 for q in range(n)]
    x = cp.asarray(np.random.default_rng([5, r]).standard_normal((sizes[r], 2)).astype(np.float32))
    with s:
        mpicomm.all_gather(x, sizes=sizes)
        s.synchronize()
        s.begin_capture()
        try:
            with pytest.raises(mpicomm.InvalidArgumentError, match="capture"):
                mpicomm.all_gather(x, sizes="auto")
            res = mpicomm.all_gather(x, sizes=sizes)
        finally:
            g = s.end_capture()
    for rep in range(1, 3):
        p = [np.random.default_rng([5 + rep, q]).standard_normal((sizes[q], 2)).astype(np.float32) for q in range(n)]
        x[...] = cp.asarray(p[r])
        s.synchronize()
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_allclose(cp.asnumpy(res), np.concatenate(p), rtol=1e-6)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_replay_through_mpicomm_is_counted_and_checked(nccl, kind):
    """mpicomm.replay(graph) replays as graph.replay()/launch() does (results checked), counts
    this rank's replays in its progress window (what the watchdog compares when one does not
    complete), and refuses what is not a graph or a stream of the graph's kind."""
    from mpicomm._reliability.progress import REPLAYS
    from mpicomm._state import CTX

    n, r, k = *nccl, 5
    m = CTX.reliability.progress.m
    if kind == "torch":
        torch = pytest.importorskip("torch")
        dev = torch.device("cuda", torch.cuda.current_device())
        x = torch.from_numpy(parts(n, 0, k)[r]).to(dev)
        mpicomm.all_reduce(x.clone())
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res = mpicomm.all_reduce(x)
        put = lambda a: x.copy_(torch.from_numpy(a).to(dev))   # noqa: E731
        get = lambda: res.cpu().numpy()                          # noqa: E731
        sync, stream, wrong = torch.cuda.synchronize, torch.cuda.Stream(), __import__("cupy").cuda.Stream()
    else:
        import cupy as cp

        s = cp.cuda.Stream(non_blocking=True)
        x = cp.asarray(parts(n, 0, k)[r])
        out = cp.empty(k * n, cp.float32)
        with s:
            mpicomm.all_reduce(x, out=out)
            s.synchronize()
            s.begin_capture()
            mpicomm.all_reduce(x, out=out)
            g = s.end_capture()

        def put(a):
            x[...] = cp.asarray(a)
            s.synchronize()
        get = lambda: cp.asnumpy(out)   # noqa: E731
        sync, stream, wrong = s.synchronize, s, None
    for rep in range(1, 4):
        p = parts(n, rep, k)
        put(p[r])
        before = m[REPLAYS]
        mpicomm.replay(g, stream if rep == 3 else None)
        assert m[REPLAYS] == before + 1
        sync()
        if rep == 3 and kind == "torch":
            stream.synchronize()
        np.testing.assert_allclose(get(), np.sum(p, axis=0), rtol=1e-5, atol=1e-5)
    with pytest.raises(mpicomm.InvalidArgumentError, match="graph"):
        mpicomm.replay(object())
    if wrong is not None:
        with pytest.raises(mpicomm.InvalidArgumentError, match="stream"):
            mpicomm.replay(g, wrong)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_capture_names_its_collectives(nccl, kind):
    """mpicomm.capture (torch.cuda.graph, or a CuPy stream capture) notes the collectives it
    captured, alike on every rank (the key), and mpicomm.replay publishes that key with its
    count; each replay's results are checked (rank-seeded data). A rank that stops replaying
    such a graph: test_faults.py::test_rank_that_stops_replaying_is_named_with_the_graphs_collective."""
    from mpicomm._reliability.progress import REPLAY_KEY, REPLAYS
    from mpicomm._state import CTX

    n, r, k = *nccl, 3
    m = CTX.reliability.progress.m
    if kind == "torch":
        torch = pytest.importorskip("torch")
        dev = torch.device("cuda", torch.cuda.current_device())
        x = torch.from_numpy(parts(n, 0, k)[r]).to(dev)
        mpicomm.all_reduce(x.clone())
        mpicomm.all_gather(x.clone())
        torch.cuda.synchronize()
        seq = CTX.world.disp.seq
        with mpicomm.capture(torch.cuda.CUDAGraph()) as cap:
            red = mpicomm.all_reduce(x)
            gat = mpicomm.all_gather(x)
        put = lambda a: x.copy_(torch.from_numpy(a).to(dev))   # noqa: E731
        get = lambda t: t.cpu().numpy()                          # noqa: E731
        sync, stream = torch.cuda.synchronize, None
    else:
        import cupy as cp

        s = cp.cuda.Stream(non_blocking=True)
        with s:
            x = cp.asarray(parts(n, 0, k)[r])
            red, gat = cp.empty(k * n, cp.float32), cp.empty(k * n * n, cp.float32)
            mpicomm.all_reduce(x, out=red)
            mpicomm.all_gather(x, out=gat)
            s.synchronize()
        seq = CTX.world.disp.seq
        with mpicomm.capture(stream=s) as cap:
            mpicomm.all_reduce(x, out=red)
            mpicomm.all_gather(x, out=gat)

        def put(a):
            with s:
                x[...] = cp.asarray(a)
        get, sync, stream = cp.asnumpy, s.synchronize, s
    assert [c.split(" (")[0] for c in cap.collectives] == [f"all_reduce sequence {seq + 1} on group 'world'",
                                                          f"all_gather sequence {seq + 2} on group 'world'"], cap.collectives
    assert all(f"shape ({k * n},), dtype float32" in c for c in cap.collectives), cap.collectives
    keys = mpicomm.all_gather(np.array([cap.key], np.int64))
    assert cap.key > 0 and (keys == cap.key).all(), keys
    for rep in range(1, 4):
        p = parts(n, rep, k)
        put(p[r])
        before = int(m[REPLAYS])
        mpicomm.replay(cap.graph, stream)
        assert int(m[REPLAYS]) == before + 1 and int(m[REPLAY_KEY]) == cap.key
        sync()
        np.testing.assert_allclose(get(red), np.sum(p, axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(get(gat), np.concatenate(p), rtol=1e-5, atol=1e-5)
