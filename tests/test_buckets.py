"""Gradient fusion: bucket plans (pure, unmarked), DistributedGradReducer, all_reduce_coalesced
and broadcast_parameters over MPI (marked), and their GPU variants (CuPy, PyTorch on NCCL)."""
import math
import warnings

import numpy as np
import pytest
from conftest import rank_rng
from launch_support import TORCH, require_module

import mpicomm
from mpicomm import InvalidArgumentError
from mpicomm._arrays import BFLOAT16
from mpicomm.training.planner import plan_buckets

MIB = 1 << 20


# ---------------------------------------------------------------- plans (no MPI)

@pytest.mark.parametrize("sizes, cap, want", [
    ([1, 1, 1, 1, 1], 2, [[3, 4], [1, 2], [0]]),                  # exact fits close at the cap
    ([1, 1, 1, 1, 1], 2.5, [[3, 4], [1, 2], [0]]),                # closed before passing the cap
    ([1, 1, 1, 1, 1], 3, [[2, 3, 4], [0, 1]]),
    ([1, 5, 1, 1], 2, [[2, 3], [1], [0]]),                        # oversized: a bucket of its own
    ([1, 1, 5, 1], 3, [[3], [2], [0, 1]]),                        # ...closing the open one first
    ([0.5, 0.25, 0.5, 0.25], 0, [[3], [2], [1], [0]]),            # 0: one per tensor
    ([0.5, 0.25, 0.5, 0.25], None, [[0, 1, 2, 3]]),               # None: one bucket
    ([0.5, 0.25, 0.5, 0.25], math.inf, [[0, 1, 2, 3]]),
    ([], 25, []),
])
def test_plan_caps(sizes, cap, want):
    assert plan_buckets([int(s * MIB) for s in sizes], bucket_cap_mb=cap) == want


def test_plan_default_cap_is_25_mib():
    sizes = [10 * MIB] * 6
    assert plan_buckets(sizes) == [[4, 5], [2, 3], [0, 1]]  # 30 MiB would pass 25
    assert plan_buckets([25 * MIB, 1, 25 * MIB]) == [[2], [1], [0]]


def test_plan_mixed_dtypes_never_share_a_bucket():
    keys = ["f32", "f16", "f32", "f16", "f32", "f16"]
    got = plan_buckets([MIB] * 6, keys, bucket_cap_mb=2)
    assert got == [[3, 5], [2, 4], [1], [0]]
    for b in got:
        assert len({keys[i] for i in b}) == 1
    assert plan_buckets([MIB] * 6, keys, bucket_cap_mb=None) == [[1, 3, 5], [0, 2, 4]]


@pytest.mark.parametrize("fc, n, want", [
    ([1, 3], 6, [[4, 5], [2, 3], [0, 1]]),
    ([20, 35], 40, [list(range(36, 40)), list(range(21, 36)), list(range(0, 21))]),
    ([1, 4], 5, [[2, 3, 4], [0, 1]]),         # the last split at the end: no empty segment
    ([0], 3, [[1, 2], [0]]),
    ([], 3, [[0, 1, 2]]),                     # no split points: one segment
])
def test_plan_fusion_config(fc, n, want):
    # the cap is not used with fusion_config: 1 MiB tensors, cap 0
    assert plan_buckets([MIB] * n, bucket_cap_mb=0, fusion_config=fc) == want


def test_plan_fusion_config_splits_by_dtype_inside_a_segment():
    keys = ["a", "a", "a", "b", "b", "a"]
    assert plan_buckets([8] * 6, keys, fusion_config=[2]) == [[5], [3, 4], [0, 1, 2]]


def test_plan_fusion_config_past_the_end_warns():
    with pytest.warns(UserWarning, match=r"split point\(s\) \[5, 9\] >= the number of gradients \(5\)"):
        got = plan_buckets([8] * 5, fusion_config=[2, 5, 9])
    assert got == [[3, 4], [0, 1, 2]]


@pytest.mark.parametrize("fc, msg", [
    ([3, 3], "3 does not follow 3"),
    ([5, 2], "2 does not follow 5"),
    ([-1, 2], "bad entry: -1"),
    ([1.5], "bad entry: 1.5"),
    ([True], "bad entry: True"),
    ("20,35", "strictly increasing"),
    (20, "strictly increasing"),
])
def test_plan_bad_fusion_config(fc, msg):
    with pytest.raises(InvalidArgumentError, match="fusion_config") as e:
        plan_buckets([8] * 4, fusion_config=fc)
    assert msg in str(e.value) and "e.g. [20, 35]" in str(e.value)


@pytest.mark.parametrize("cap", [-1, -0.5, float("nan"), "25", True, [25]])
def test_plan_bad_cap(cap):
    with pytest.raises(InvalidArgumentError, match=r"bucket_cap_mb=.*expected a number of MiB >= 0"):
        plan_buckets([8] * 4, bucket_cap_mb=cap)


# ---------------------------------------------------------------- helpers

SHAPES = [(6, 5), (5,), (5, 4, 3), (4,), (3, 2), (2,), (1,), (7, 3)]


def grads_of(rank, name, shapes, dtypes):
    g = rank_rng(rank, name)
    return [g.standard_normal(s).astype(dt) for s, dt in zip(shapes, dtypes)]


def total(name, shapes, dtypes, n):
    """Every rank's gradients summed in float64 (the expectation, computed independently)."""
    out = [np.zeros(s) for s in shapes]
    for r in range(n):
        for o, g in zip(out, grads_of(r, name, shapes, dtypes)):
            o += g.astype(np.float64)
    return out


def cap_for(nbytes):
    return nbytes / MIB


PLANS = {
    "default": dict(),
    "per_tensor": dict(bucket_cap_mb=0),
    "single": dict(bucket_cap_mb=None),
    "small_cap": dict(bucket_cap_mb=cap_for(300)),
    "fusion": dict(fusion_config=[1, 4]),
}


# ---------------------------------------------------------------- the reducer over MPI

@pytest.mark.mpi
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("mode", ["call", "reduce_", "views", "overlap"])
@pytest.mark.parametrize("mean", [False, True])
def test_reducer_sums_every_rank(comm, plan, mode, mean, request):
    n, r = comm.get_group_size(), comm.get_rank()
    name = request.node.name
    dtypes = [np.float64, np.float32] * 4  # mixed dtypes: never in one bucket
    params = [np.zeros(s, dt) for s, dt in zip(SHAPES, dtypes)]
    red = comm.DistributedGradReducer(params, mean=mean, **PLANS[plan])
    for b in red.buckets:
        assert len({np.dtype(dtypes[i]) for i in b}) == 1
    want = [w / n if mean else w for w in total(name, SHAPES, dtypes, n)]
    for step in range(2):  # the persistent buffers are reused
        grads = grads_of(r, name, SHAPES, dtypes)
        before = [g.copy() for g in grads]
        if mode == "call":
            out = red(grads)
            for g, b0 in zip(grads, before):
                np.testing.assert_array_equal(g, b0)  # left as it was
        elif mode == "reduce_":
            out = red.reduce_(grads)
            assert out is grads
        elif mode == "views":
            views = red.grad_views()
            for v, g in zip(views, grads):
                v[...] = g
            out = red.reduce_(views)
            assert all(o is v for o, v in zip(out, views))
        else:  # backward order differs by rank: buckets still start in plan order
            order = list(range(len(SHAPES)))
            rank_rng(r, f"order{step}").shuffle(order)
            for i in order:
                red.mark_ready(i, grads[i])
            out = red.wait()
            assert all(o is g for o, g in zip(out, grads))  # written back in place
        for o, w, dt in zip(out, want, dtypes):
            assert o.dtype == dt and o.shape == w.shape
            np.testing.assert_allclose(o, w, rtol=1e-5 if dt == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.mpi
def test_reducer_views_are_the_buckets(comm):
    params = [np.zeros(s) for s in SHAPES]
    red = comm.DistributedGradReducer(params, bucket_cap_mb=None)
    views = red.grad_views()
    flat = views[0].base if views[0].base is not None else views[0]
    assert all(np.shares_memory(v, flat) for v in views)
    assert [v.shape for v in views] == SHAPES
    # mark_ready without a grad reduces what the view holds
    for i in reversed(range(len(views))):
        views[i][...] = i + 1
        red.mark_ready(i)
    out = red.wait()
    for i, o in enumerate(out):
        assert o is views[i]
        np.testing.assert_array_equal(o, (i + 1) * comm.get_group_size())


@pytest.mark.mpi
def test_reducer_mean_from_context(comm):
    params = [np.zeros(3)]
    try:
        comm.set_auto_parallel_context(gradients_mean=True, all_reduce_fusion_config=[0])
        red = comm.DistributedGradReducer(params * 2)
        assert red.mean is True and red.buckets == [[1], [0]]
        comm.reset_auto_parallel_context()
        assert comm.DistributedGradReducer(params).mean is False  # MindSpore's default
        assert comm.DistributedGradReducer(params, mean=True).mean is True
    finally:
        comm.reset_auto_parallel_context()


@pytest.mark.mpi
@pytest.mark.parametrize("compression, eps", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
@pytest.mark.parametrize("mean", [False, True])
def test_compression_within_half_precision(comm, compression, eps, mean, request):
    n, r = comm.get_group_size(), comm.get_rank()
    name = request.node.name
    shapes, dtypes = SHAPES, [np.float32] * len(SHAPES)
    red = comm.DistributedGradReducer([np.zeros(s, np.float32) for s in shapes], mean=mean,
                                      compression=compression, bucket_cap_mb=cap_for(200))
    out = red(grads_of(r, name, shapes, dtypes))
    want = total(name, shapes, dtypes, n)
    absum = [np.zeros(s) for s in shapes]
    for q in range(n):
        for a, g in zip(absum, grads_of(q, name, shapes, dtypes)):
            a += np.abs(g)
    for o, w, a in zip(out, want, absum):
        assert o.dtype == np.float32
        scale = 1.0 / n if mean else 1.0
        # each rank's value rounded once, then each partial sum rounded once (sum in float32 on MPI)
        bound = (2 * eps * a + 4 * eps * np.abs(w)) * scale + 1e-30
        err = np.abs(o - w * scale)
        assert np.all(err <= bound), (compression, float(np.max(err / bound)))
    if compression == "fp16":  # the result differs from the uncompressed one: it was sent in fp16
        plain = comm.DistributedGradReducer([np.zeros(s, np.float32) for s in shapes], mean=mean)
        exact = plain(grads_of(r, name, shapes, dtypes))
        assert any(not np.array_equal(o, e) for o, e in zip(out, exact))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fp32_sync", [False, True])
def test_half_precision_gradients(comm, dtype, fp32_sync, request):
    n, r = comm.get_group_size(), comm.get_rank()
    name = request.node.name
    dt = np.dtype(np.float16) if dtype == "float16" else BFLOAT16
    eps = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    shapes = SHAPES[:4]
    red = comm.DistributedGradReducer([np.zeros(s, dt) for s in shapes], mean=True, fp32_sync=fp32_sync)
    grads = grads_of(r, name, shapes, [dt] * len(shapes))
    out = red(grads)
    want = total(name, shapes, [dt] * len(shapes), n)
    absum = [np.zeros(s) for s in shapes]
    for q in range(n):
        for a, g in zip(absum, grads_of(q, name, shapes, [dt] * len(shapes))):
            a += np.abs(g.astype(np.float64))
    for o, w, a in zip(out, want, absum):
        assert o.dtype == dt
        err = np.abs(o.astype(np.float64) - w / n)
        # pre-scaling rounds each value once more (unless fp32_sync), the result once
        bound = (eps * a * (0 if fp32_sync else 2) + 2 * eps * np.abs(w)) / n + 1e-7
        assert np.all(err <= bound)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["float16", "fp16_compression"])
def test_large_values_do_not_overflow(comm, case):
    """float16 values near 60000 summed over the ranks with mean=True stay finite."""
    n, r = comm.get_group_size(), comm.get_rank()
    vals = 60000.0 - 100.0 * r - np.arange(32)
    if case == "float16":
        params = [np.zeros(32, np.float16)]
        g = vals.astype(np.float16)
        red = comm.DistributedGradReducer(params, mean=True)
    else:
        params = [np.zeros(32, np.float32)]
        g = vals.astype(np.float32)
        red = comm.DistributedGradReducer(params, mean=True, compression="fp16")
    want = np.mean([(60000.0 - 100.0 * q - np.arange(32)).astype(g.dtype).astype(np.float64)
                    for q in range(n)], axis=0)
    for mode in ("call", "overlap"):
        if mode == "call":
            out = red([g])[0]
        else:
            red.mark_ready(0, g.copy())
            out = red.wait()[0]
        assert np.all(np.isfinite(out)), out
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=2 * 2.0 ** -11)


# ---------------------------------------------------------------- bad input, every rank alike

@pytest.mark.mpi
@pytest.mark.parametrize("kwargs, match", [
    (dict(bucket_cap_mb=-1), r"bucket_cap_mb=-1.*a number of MiB >= 0"),
    (dict(bucket_cap_mb=float("nan")), r"bucket_cap_mb=nan"),
    (dict(fusion_config=[3, 2]), r"fusion_config=\[3, 2\].*strictly increasing"),
    (dict(fusion_config="1,2"), r"fusion_config='1,2'"),
    (dict(compression="int8"), r"compression='int8'.*None, 'fp16' or 'bf16'"),
    (dict(fp32_sync="yes"), r"fp32_sync='yes'.*True or False"),
    (dict(mean="true"), r"mean='true'.*True, False or None"),
    (dict(parameters=np.zeros(3)), r"parameters=<numpy.ndarray>.*a list or tuple of arrays"),
    (dict(parameters=[np.zeros(3), [1.0, 2.0]]), r"parameters\[1\]=<list>.*NumPy array"),
    (dict(parameters=[np.zeros(3, np.int32)]), r"parameters\[0\].dtype='int32'.*floating or complex"),
    (dict(group="nope"), r"group='nope'"),
])
def test_reducer_bad_arguments(comm, kwargs, match):
    kw = dict(parameters=[np.zeros(3), np.zeros((2, 2))])
    kw.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        comm.DistributedGradReducer(**kw)


@pytest.mark.mpi
def test_reducer_bad_grads(comm):
    params = [np.zeros(3), np.zeros((2, 2), np.float32)]
    red = comm.DistributedGradReducer(params)
    ok = [np.ones(3), np.ones((2, 2), np.float32)]
    cases = [
        (ok[:1], r"grads='a list of 1 arrays'.*2 arrays, one per parameter"),
        (ok + ok[:1], r"grads='a list of 3 arrays'.*2 arrays"),
        (np.ones(3), r"grads=<numpy.ndarray>.*a list or tuple of 2 arrays"),
        ([np.ones(4), ok[1]], r"grads\[0\].shape=\(4,\).*\(3,\), the shape of parameters\[0\]"),
        ([ok[0], np.ones((2, 2))], r"grads\[1\].dtype='float64'.*float32, the dtype of parameters\[1\]"),
        ([[1.0, 1.0, 1.0], ok[1]], r"grads\[0\]=<list>.*a numpy array like parameters\[0\]"),
    ]
    for grads, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            red(grads)
        with pytest.raises(InvalidArgumentError, match=match):
            red.reduce_(grads)
    with pytest.raises(InvalidArgumentError, match=r"invalid i=2.*a gradient index in 0..1"):
        red.mark_ready(2, ok[0])
    with pytest.raises(InvalidArgumentError, match=r"grad.shape=\(3,\).*\(2, 2\)"):
        red.mark_ready(1, ok[0])
    with pytest.raises(InvalidArgumentError, match=r"missing 2 of 2 \(indices \[0, 1\]\)"):
        red.wait()
    red.mark_ready(1, ok[1])
    with pytest.raises(InvalidArgumentError, match=r"invalid i=1.*not yet marked ready"):
        red.mark_ready(1, ok[1])
    with pytest.raises(InvalidArgumentError, match=r"missing 1 of 2 \(indices \[0\]\)"):
        red.wait()
    with pytest.raises(InvalidArgumentError, match=r"during a step started with mark_ready"):
        red(ok)
    red.mark_ready(0, ok[0])
    out = red.wait()  # the step still completes after the errors
    np.testing.assert_array_equal(out[0], np.full(3, comm.get_group_size()))


@pytest.mark.mpi
def test_reducer_bad_torch_grads(comm):
    """PyTorch gradients are checked in one fast pass; whatever it rejects is named as for
    NumPy: the index, the attribute, the value and the parameter's."""
    torch = require_module("torch", TORCH)
    dev = "cpu"
    if comm.get_backend() == "nccl":  # CUDA tensors there (CPU ones go to the MPI backend)
        if not torch.cuda.is_available():
            pytest.skip("the NCCL backend with a PyTorch that sees no GPU")
        dev = f"cuda:{torch.cuda.current_device()}"
    params = [torch.zeros(3, dtype=torch.float64, device=dev), torch.zeros(2, 2, device=dev)]
    red = comm.DistributedGradReducer(params)
    ok = [torch.ones(3, dtype=torch.float64, device=dev), torch.ones(2, 2, device=dev)]
    cases = [
        ([torch.ones(4, dtype=torch.float64, device=dev), ok[1]],
         r"grads\[0\].shape=\(4,\).*\(3,\), the shape of parameters\[0\]"),
        ([ok[0], torch.ones(2, 2, dtype=torch.float64, device=dev)],
         r"grads\[1\].dtype='float64'.*float32, the dtype of parameters\[1\]"),
        ([ok[0], torch.ones(4, device=dev)], r"grads\[1\].shape=\(4,\).*\(2, 2\)"),
        ([np.ones(3), ok[1]], r"grads\[0\]=<numpy.ndarray>.*a torch array like parameters\[0\]"),
        ([None, ok[1]], r"grads\[0\]=<NoneType>"),
    ]
    for grads, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            red(grads)
        with pytest.raises(InvalidArgumentError, match=match):
            red.reduce_(grads)
    n, r = comm.get_group_size(), comm.get_rank()

    def mine_of(q):
        g = rank_rng(q, "bad_torch_grads")
        return g.standard_normal(3), g.standard_normal((2, 2)).astype(np.float32)

    a, b = mine_of(r)
    # a transposed (non-contiguous) gradient is fine
    out = red([torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev).t()])
    np.testing.assert_allclose(out[0].cpu().numpy(), np.sum([mine_of(q)[0] for q in range(n)], 0), rtol=1e-12)
    np.testing.assert_allclose(out[1].cpu().numpy(), np.sum([mine_of(q)[1] for q in range(n)], 0).T, rtol=1e-5)


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_models_all_raise(comm):
    r = comm.get_rank()
    params = [np.zeros(3), np.zeros(4 if r == 1 else 5)]
    with pytest.raises(InvalidArgumentError, match=r"same parameters .* rank\(s\) \[1\] differ"):
        comm.DistributedGradReducer(params)


@pytest.mark.mpi(min_size=2)
def test_bad_argument_on_one_rank_raises_everywhere(comm):
    r = comm.get_rank()
    with pytest.raises(InvalidArgumentError, match=r"bucket_cap_mb=-1"):
        comm.DistributedGradReducer([np.zeros(3)], bucket_cap_mb=-1 if r == 1 else 25)


# ---------------------------------------------------------------- coalesced, broadcast

@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_all_reduce_coalesced(comm, op, request):
    n, r = comm.get_group_size(), comm.get_rank()
    name = request.node.name
    dts = [np.float32, np.float64, np.int64, np.float32, np.float64]

    def arrays(q):
        g = rank_rng(q, name)
        out = []
        for i, dt in enumerate(dts):
            a = g.standard_normal((i + 1, 3)) * 10
            out.append(a.astype(dt))
        return out

    if op == "avg":
        dts[2] = np.float32
    mine = arrays(r)
    out = comm.all_reduce_coalesced(mine, op=op)
    every = [arrays(q) for q in range(n)]
    for i, o in enumerate(out):
        stack = np.stack([e[i].astype(np.float64) for e in every])
        want = {"sum": stack.sum(0), "max": stack.max(0), "avg": stack.mean(0)}[op]
        assert o.dtype == mine[i].dtype and o.shape == mine[i].shape
        np.testing.assert_allclose(o, want, rtol=1e-5)
    assert comm.all_reduce_coalesced([]) == []
    with pytest.raises(InvalidArgumentError, match=r"op='median'"):
        comm.all_reduce_coalesced(mine, op="median")
    with pytest.raises(InvalidArgumentError, match=r"arrays\[0\]=<list>"):
        comm.all_reduce_coalesced([[1, 2]])


@pytest.mark.mpi
@pytest.mark.parametrize("as_dict", [False, True])
def test_broadcast_parameters(comm, as_dict, request):
    n, r = comm.get_group_size(), comm.get_rank()
    root = n - 1
    shapes = [(3, 2), (4,), (2, 2, 2)]
    dts = [np.float32, np.float64, np.float32]

    def params(q):
        g = rank_rng(q, request.node.name)
        return [g.standard_normal(s).astype(dt) for s, dt in zip(shapes, dts)]

    mine = params(r)
    ids = [id(p) for p in mine]
    arg = {f"p{i}": p for i, p in enumerate(mine)} if as_dict else mine
    assert comm.broadcast_parameters(arg, root=root) is arg
    assert [id(p) for p in mine] == ids  # in place
    for p, w in zip(mine, params(root)):
        np.testing.assert_array_equal(p, w)
    for bad in (n, -1, 1.0, True):
        with pytest.raises(InvalidArgumentError, match=rf"root={bad!r}.*a rank of the group in 0..{n - 1}"):
            comm.broadcast_parameters(mine, root=bad)


# ---------------------------------------------------------------- GPU (NCCL): CuPy and PyTorch

@pytest.fixture(scope="module")
def nccl(comm):
    if comm.get_backend() != "nccl":
        pytest.skip("needs the NCCL backend (a GPU and CuPy)")
    return comm


def _family(which):
    if which == "cupy":
        import cupy

        return (lambda a: cupy.asarray(a)), (lambda a: cupy.asnumpy(a))
    torch = require_module("torch", TORCH)

    def to(a):
        if a.dtype == BFLOAT16:
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).cuda()
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def host(t):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().numpy()

    return to, host


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["cupy", "torch"])
@pytest.mark.parametrize("plan", ["default", "per_tensor", "small_cap", "fusion"])
@pytest.mark.parametrize("mode", ["call", "reduce_", "views", "overlap"])
def test_gpu_reducer(nccl, which, plan, mode, request):
    to, host = _family(which)
    n, r = nccl.get_group_size(), nccl.get_rank()
    name = request.node.name
    dtypes = [np.float64, np.float32] * 4
    red = nccl.DistributedGradReducer([to(np.zeros(s, dt)) for s, dt in zip(SHAPES, dtypes)], mean=True,
                                      **PLANS[plan])
    want = [w / n for w in total(name, SHAPES, dtypes, n)]
    for step in range(2):
        grads = [to(g) for g in grads_of(r, name, SHAPES, dtypes)]
        if mode == "call":
            out = red(grads)
        elif mode == "reduce_":
            out = red.reduce_(grads)
            assert out is grads
        elif mode == "views":
            views = red.grad_views()
            assert type(views[0]) is type(grads[0])
            for v, g in zip(views, grads):
                v[...] = g
            out = red.reduce_(views)
        else:
            for i in reversed(range(len(SHAPES))):
                red.mark_ready(i, grads[i])
            out = red.wait()
        for o, w, dt in zip(out, want, dtypes):
            assert type(o) is type(grads[0])
            np.testing.assert_allclose(host(o), w, rtol=1e-5 if dt == np.float32 else 1e-12, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("which, compression", [("cupy", "fp16"), ("torch", "fp16"), ("torch", "bf16")])
def test_gpu_compression_and_fp32_sync(nccl, which, compression, request):
    to, host = _family(which)
    n, r = nccl.get_group_size(), nccl.get_rank()
    name = request.node.name
    shapes = SHAPES[:4]
    eps = 2.0 ** -11 if compression == "fp16" else 2.0 ** -8
    red = nccl.DistributedGradReducer([to(np.zeros(s, np.float32)) for s in shapes], mean=True,
                                      compression=compression)
    out = red([to(g) for g in grads_of(r, name, shapes, [np.float32] * 4)])
    for o, w in zip(out, total(name, shapes, [np.float32] * 4, n)):
        np.testing.assert_allclose(host(o), w / n, atol=8 * eps * max(1.0, float(np.abs(w).max())))
    half = np.float16 if compression == "fp16" else BFLOAT16
    red16 = nccl.DistributedGradReducer([to(np.zeros(32, half))], mean=True, fp32_sync=True)
    big = (60000.0 - 100.0 * r - np.arange(32)).astype(half)
    o = host(red16([to(big)])[0])
    assert np.all(np.isfinite(o))
    want = np.mean([(60000.0 - 100.0 * q - np.arange(32)).astype(half).astype(np.float64) for q in range(n)], 0)
    np.testing.assert_allclose(o, want, rtol=4 * eps)


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["cupy", "torch"])
def test_gpu_coalesced_and_broadcast(nccl, which, request):
    to, host = _family(which)
    n, r = nccl.get_group_size(), nccl.get_rank()
    name = request.node.name
    dts = [np.float32, np.float64, np.float32]
    shapes = [(3, 2), (4,), (5,)]
    out = nccl.all_reduce_coalesced([to(g) for g in grads_of(r, name, shapes, dts)])
    for o, w in zip(out, total(name, shapes, dts, n)):
        np.testing.assert_allclose(host(o), w, rtol=1e-5)
    mine = [to(g) for g in grads_of(r, name, shapes, dts)]
    if which == "torch":
        for p in mine:
            p.requires_grad_(True)  # leaves that require grad are written under no_grad
    nccl.broadcast_parameters(mine, root=n - 1)
    for p, w in zip(mine, grads_of(n - 1, name, shapes, dts)):
        np.testing.assert_array_equal(host(p), w)


def test_no_warnings_from_a_plain_plan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_buckets([8] * 5, fusion_config=[1, 3])


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["cupy", "torch"])
@pytest.mark.parametrize("launch", ["group", "one-by-one"])
def test_gpu_blocking_step_several_buckets_compressed(nccl, which, launch, request):
    """A blocking step over several fp16-compressed buckets, issued in one NCCL group or one
    by one: the unscale and copy-back after each all-reduce must see the reduced data, in
    place and as new arrays."""
    to, host = _family(which)
    n, r = nccl.get_group_size(), nccl.get_rank()
    name = request.node.name
    dts = [np.float32] * len(SHAPES)
    red = nccl.DistributedGradReducer([to(np.zeros(s, np.float32)) for s in SHAPES], mean=True,
                                      compression="fp16", bucket_cap_mb=cap_for(300))
    assert len(red.buckets) >= 3
    red.group_launch = launch == "group"
    for step in range(4):
        given = [to(g) for g in grads_of(r, name + str(step), SHAPES, dts)]
        out = red.reduce_(given) if step % 2 == 0 else red(given)
        assert (out is given) == (step % 2 == 0)
        for o, w in zip(out, total(name + str(step), SHAPES, dts, n)):
            np.testing.assert_allclose(host(o), w / n, atol=2.0 ** -11 * 8 * max(1.0, float(np.abs(w).max())))


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["overlap", "views"])
def test_gpu_reducer_keeps_the_callers_stream(nccl, mode, request):
    """A stream chosen with cupy Stream.use() is still current after mark_ready/wait and
    reduce_, and the results are ready for it."""
    import cupy

    n, r = nccl.get_group_size(), nccl.get_rank()
    name = request.node.name
    dts = [np.float32] * len(SHAPES)
    mine = cupy.cuda.Stream(non_blocking=True)
    prev = cupy.cuda.get_current_stream()
    mine.use()
    try:
        red = nccl.DistributedGradReducer([cupy.zeros(s, np.float32) for s in SHAPES], mean=False,
                                          bucket_cap_mb=cap_for(300))
        views = red.grad_views()
        for v, g in zip(views, grads_of(r, name, SHAPES, dts)):
            v[...] = cupy.asarray(g)
        if mode == "overlap":
            for i in reversed(range(len(SHAPES))):
                red.mark_ready(i)
            out = red.wait()
        else:
            out = red.reduce_(views)
        assert cupy.cuda.get_current_stream().ptr == mine.ptr
        got = [cupy.asnumpy(o, stream=mine) for o in out]
        mine.synchronize()
    finally:
        prev.use()
    for o, w in zip(got, total(name, SHAPES, dts, n)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("plan", ["default", "small_cap", "per_tensor"])
def test_call_results_are_new_arrays_that_outlive_the_next_step(comm, plan, request):
    """reducer(grads) packs each bucket in one call and returns views into one new buffer
    per bucket: they must not alias the persistent buckets, so a later step leaves them."""
    n, r = comm.get_group_size(), comm.get_rank()
    name = request.node.name
    dts = [np.float32] * len(SHAPES)
    red = comm.DistributedGradReducer([np.zeros(s, np.float32) for s in SHAPES], mean=False, **PLANS[plan])
    first = red(grads_of(r, name + "a", SHAPES, dts))
    second = red(grads_of(r, name + "b", SHAPES, dts))
    views = red.grad_views()
    for got, want in ((first, total(name + "a", SHAPES, dts, n)), (second, total(name + "b", SHAPES, dts, n))):
        for o, w, s in zip(got, want, SHAPES):
            assert o.shape == s and o.dtype == np.float32
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)
            assert not any(np.shares_memory(o, v) for v in views)


@pytest.mark.mpi
@pytest.mark.parametrize("value, want", [("0", False), ("off", False), ("1", True), ("TRUE", True), ("", True)])
def test_bucket_group_environment(comm, monkeypatch, value, want):
    monkeypatch.setenv("MPICOMM_BUCKET_GROUP", value)
    assert comm.DistributedGradReducer([np.zeros(3), np.zeros(4)]).group_launch is want


@pytest.mark.mpi
def test_bucket_group_environment_bad_value_raises_on_every_rank(comm, monkeypatch):
    monkeypatch.setenv("MPICOMM_BUCKET_GROUP", "maybe")
    with pytest.raises(InvalidArgumentError, match=r"MPICOMM_BUCKET_GROUP='maybe'.*1, on, true or yes; 0, off"):
        comm.DistributedGradReducer([np.zeros(3)])
