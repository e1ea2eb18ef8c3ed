"""Per-rank sizes: all_gather(sizes=), all_to_all(in_splits=, out_splits=), reduce_scatter(sizes=),
gather and scatter, on the world and a sub-group, with zero-length ranks, checked against
expectations computed with NumPy from every rank's rank-seeded data; bad sizes and calls
that differ between ranks raise on every rank."""
import zlib

import numpy as np
import pytest

import mpicomm
from launch_support import TORCH, require_module
from mpicomm import ReduceOp
from mpicomm._ops import ALL_GATHER
from test_collectives import BF16, close, data, in_group, members, outside, pick, reduce_np, run, subgroup  # noqa: F401

pytestmark = pytest.mark.mpi

DTYPES = [np.int8, np.uint8, np.int64, np.float16, BF16, np.float32, np.float64, np.complex64]
GROUPS = ["world", "sub"]
TRAIL = (3, 2)


def sizes_of(n, salt=0):
    """Uneven axis-0 lengths with zeros among them: [1, 0, 3, 2, ...] shifted by salt."""
    return [(3 * r + 1 + salt) % 4 for r in range(n)]


def splits_of(n):
    """S[i][j]: rows rank i sends rank j (zeros included)."""
    return [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]


def ctx(which, subgroup):
    g = pick(which, subgroup)
    ranks = members(g)
    return g, ranks, len(ranks), (ranks.index(mpicomm.get_rank()) if in_group(g) else None)


# -------------------------------------------------------------------- all_gather

@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["list", "auto"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_gather_sizes(comm, subgroup, dt, which, how, async_op, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return outside(g, lambda x, group: mpicomm.all_gather(x, group=group, sizes=[1] * n))
    sizes = sizes_of(n)
    key = request.node.name
    x = data(ranks[me], key, (sizes[me],) + TRAIL, dt)
    got = run(mpicomm.all_gather, async_op, x, group=g, sizes=sizes if how == "list" else "auto")
    want = np.concatenate([data(ranks[r], key, (sizes[r],) + TRAIL, dt) for r in range(n)])
    close(got, want, dt)


@pytest.mark.parametrize("which", GROUPS)
def test_all_gather_sizes_out_and_in_place(comm, subgroup, which, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    sizes = sizes_of(n, 1)
    key = request.node.name
    want = np.concatenate([data(ranks[r], key, (sizes[r], 5), np.float32) for r in range(n)])
    x = data(ranks[me], key, (sizes[me], 5), np.float32)
    out = np.full((sum(sizes), 5), -7, np.float32)
    assert mpicomm.all_gather(x, out=out, group=g, sizes=sizes) is out
    close(out, want, np.float32)
    # in place: x is this rank's part of out
    out2 = np.full((sum(sizes), 5), -7, np.float32)
    lo = sum(sizes[:me])
    out2[lo:lo + sizes[me]] = x
    assert mpicomm.all_gather(out2[lo:lo + sizes[me]], out=out2, group=g, sizes=sizes) is out2
    close(out2, want, np.float32)
    # a non-contiguous input is copied first; a repeated call reuses the prepared one
    wide = np.repeat(x, 2, axis=1)
    for _ in range(2):
        close(mpicomm.all_gather(wide[:, ::2], group=g, sizes=sizes), want, np.float32)


def test_all_gather_sizes_reuses_its_prepared_call(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    d = mpicomm._state.CTX.world.disp
    sizes = sizes_of(n, 2)
    key = request.node.name
    want = np.concatenate([data(q, key, (sizes[q],), np.int32) for q in range(n)])
    mpicomm.all_gather(data(r, key, (sizes[r],), np.int32), sizes=sizes)
    p = d.last[ALL_GATHER]
    for _ in range(3):
        close(mpicomm.all_gather(data(r, key, (sizes[r],), np.int32), sizes=sizes), want, np.int32)
        assert d.last[ALL_GATHER] is p or mpicomm._state.CTX.debug
    # other sizes: a new prepared call, and the right answer
    s2 = sizes_of(n, 3)
    got = mpicomm.all_gather(data(r, key, (s2[r],), np.int32), sizes=s2)
    close(got, np.concatenate([data(q, key, (s2[q],), np.int32) for q in range(n)]), np.int32)


def test_all_gather_all_zero_and_torch_cpu(comm, request):
    torch = require_module("torch", TORCH)
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    got = mpicomm.all_gather(np.zeros((0, 4), np.float64), sizes=[0] * n)
    assert got.shape == (0, 4)
    sizes = sizes_of(n)
    key = request.node.name
    x = torch.from_numpy(data(r, key, (sizes[r], 2), np.float32))
    got = mpicomm.all_gather(x, sizes="auto")
    assert isinstance(got, torch.Tensor)
    close(got.numpy(), np.concatenate([data(q, key, (sizes[q], 2), np.float32) for q in range(n)]), np.float32)


# -------------------------------------------------------------------- all_to_all

@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["list", "auto"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.int8, np.int64, BF16, np.float32, np.complex128], ids=lambda d: np.dtype(d).name)
def test_all_to_all_splits(comm, subgroup, dt, which, how, async_op, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    S = splits_of(n)
    key = request.node.name
    xs = [data(ranks[i], key, (sum(S[i]), 2), dt) for i in range(n)]
    outs = [S[j][me] for j in range(n)] if how == "list" else "auto"
    got = run(mpicomm.all_to_all, async_op, xs[me], group=g, in_splits=S[me], out_splits=outs)
    want = np.concatenate([xs[i][sum(S[i][:me]):sum(S[i][:me + 1])] for i in range(n)])
    close(got, want, dt)


def test_all_to_all_splits_out_in_place_and_even_in(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    # every rank sends 2 rows to every rank: even in_splits, out_splits 'auto'
    xs = [data(q, key, (2 * n, 3), np.float64) for q in range(n)]
    want = np.concatenate([xs[i][2 * r:2 * r + 2] for i in range(n)])
    close(mpicomm.all_to_all(xs[r], out_splits="auto"), want, np.float64)
    out = np.empty_like(xs[r])
    assert mpicomm.all_to_all(xs[r], out=out, in_splits=[2] * n, out_splits=[2] * n) is out
    close(out, want, np.float64)
    x = xs[r].copy()
    assert mpicomm.all_to_all(x, out=x, in_splits=[2] * n, out_splits=[2] * n) is x
    close(x, want, np.float64)


# -------------------------------------------------------------------- reduce_scatter

@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt,op", [(np.int32, ReduceOp.SUM), (np.int64, ReduceOp.MAX), (np.float16, ReduceOp.SUM),
                                   (BF16, ReduceOp.AVG), (np.float32, ReduceOp.MIN), (np.float64, ReduceOp.AVG),
                                   (np.complex64, ReduceOp.SUM), (np.uint8, ReduceOp.PROD)],
                         ids=lambda v: getattr(v, "value", None) or np.dtype(v).name)
def test_reduce_scatter_sizes(comm, subgroup, dt, op, which, async_op, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    sizes = sizes_of(n)
    key = request.node.name
    xs = [data(ranks[r], key, (sum(sizes), 2), dt, op) for r in range(n)]
    got = run(mpicomm.reduce_scatter, async_op, xs[me], op, group=g, sizes=sizes)
    lo = sum(sizes[:me])
    close(got, reduce_np(xs, op)[lo:lo + sizes[me]], dt)


def test_reduce_scatter_sizes_out_and_in_place(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    sizes = sizes_of(n, 1)
    key = request.node.name
    xs = [data(q, key, (sum(sizes), 4), np.float32) for q in range(n)]
    lo = sum(sizes[:r])
    want = reduce_np(xs, ReduceOp.SUM)[lo:lo + sizes[r]]
    out = np.empty((sizes[r], 4), np.float32)
    assert mpicomm.reduce_scatter(xs[r], out=out, sizes=sizes) is out
    close(out, want, np.float32)
    x = xs[r].copy()
    part = x[lo:lo + sizes[r]]
    assert mpicomm.reduce_scatter(x, out=part, sizes=sizes) is part
    close(part, want, np.float32)


# -------------------------------------------------------------------- gather, scatter

@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["even", "list", "auto"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.int8, np.float16, BF16, np.float32, np.complex128], ids=lambda d: np.dtype(d).name)
def test_gather(comm, subgroup, dt, which, how, async_op, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return outside(g, lambda x, group: mpicomm.gather(x, group=group))
    key = request.node.name
    sizes = [2] * n if how == "even" else sizes_of(n)
    root = n - 1
    x = data(ranks[me], key, (sizes[me],) + TRAIL, dt)
    got = run(mpicomm.gather, async_op, x, root, group=g,
              sizes={"even": None, "list": sizes, "auto": "auto"}[how])
    if me != root:
        assert got is None
    else:
        close(got, np.concatenate([data(ranks[r], key, (sizes[r],) + TRAIL, dt) for r in range(n)]), dt)


def test_gather_out_in_place_and_scalars(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    sizes = sizes_of(n)
    want = np.concatenate([data(q, key, (sizes[q], 3), np.int64) for q in range(n)])
    out = np.empty((sum(sizes), 3), np.int64) if r == 0 else None
    x = data(r, key, (sizes[r], 3), np.int64)
    res = mpicomm.gather(x, 0, out=out, sizes=sizes)
    if r == 0:
        assert res is out
        close(out, want, np.int64)
        out = np.zeros_like(want)
        out[:sizes[0]] = x
        x = out[:sizes[0]]   # in place: x is the root's part of out
    assert mpicomm.gather(x, 0, out=out, sizes=sizes) is (out if r == 0 else None)
    if r == 0:
        close(out, want, np.int64)
    # a non-contiguous input is copied first
    wide = np.repeat(data(r, key, (sizes[r], 3), np.int64), 2, axis=1)
    res = mpicomm.gather(wide[:, ::2], 0, sizes=sizes)
    if r == 0:
        close(res, want, np.int64)
    full = np.repeat(want, 2, axis=1) if r == 0 else None
    part = mpicomm.scatter(full[:, ::2] if r == 0 else None, 0, out=np.empty((sizes[r], 3), np.int64), sizes=sizes)
    lo = sum(sizes[:r])
    close(part, want[lo:lo + sizes[r]], np.int64)
    # 0-d inputs gather into a vector (even sizes)
    res = mpicomm.gather(np.float64(r + 0.5) * np.ones(()), 0)
    if r == 0:
        close(res, np.arange(n) + 0.5, np.float64)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", ["even", "list", "auto"])
@pytest.mark.parametrize("which", GROUPS)
@pytest.mark.parametrize("dt", [np.uint8, np.int64, BF16, np.float32, np.complex64], ids=lambda d: np.dtype(d).name)
def test_scatter(comm, subgroup, dt, which, how, async_op, request):
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    key = request.node.name
    root = n // 2
    sizes = [3] * n if how != "list" else sizes_of(n)
    full = data(ranks[root], key, (sum(sizes),) + TRAIL, dt)
    lo = sum(sizes[:me])
    want = full[lo:lo + sizes[me]]
    x = full if me == root else None
    if how == "auto":
        got = run(mpicomm.scatter, async_op, x, root, group=g, sizes="auto")
    else:
        out = np.empty((sizes[me],) + TRAIL, dt) if me != root else None
        got = run(mpicomm.scatter, async_op, x, root, out=out, group=g, sizes=None if how == "even" else sizes)
        if out is not None:
            assert got is out
    close(got, want, dt)


def test_scatter_out_on_root_and_torch(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    sizes = sizes_of(n, 2)
    full = data(0, key, (sum(sizes), 2), np.float32)
    lo = sum(sizes[:r])
    out = np.empty((sizes[r], 2), np.float32)
    assert mpicomm.scatter(full if r == 0 else None, 0, out=out, sizes=sizes) is out
    close(out, full[lo:lo + sizes[r]], np.float32)
    if r == 0:   # in place on the root: out is the root's part of x
        x = full.copy()
        part = x[:sizes[0]]
        assert mpicomm.scatter(x, 0, out=part, sizes=sizes) is part
        close(part, full[:sizes[0]], np.float32)
    else:
        mpicomm.scatter(None, 0, out=out, sizes=sizes)
    torch = require_module("torch", TORCH)
    t = torch.from_numpy(full) if r == 0 else None
    got = mpicomm.scatter(t, 0, sizes="auto") if sum(sizes) % n == 0 else None
    if got is not None:
        assert isinstance(got, torch.Tensor)
        k = sum(sizes) // n
        close(got.numpy(), full[r * k:(r + 1) * k], np.float32)


# -------------------------------------------------------------------- MindSpore forms

def test_mindspore_allgatherv_reducescatterv_alltoall(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    sizes = sizes_of(n)
    x = data(r, key, (sizes[r],), np.float32)
    got = mpicomm.ops.AllGatherV()(x, sizes)
    close(got, np.concatenate([data(q, key, (sizes[q],), np.float32) for q in range(n)]), np.float32)
    xs = [data(q, key + "rs", (sum(sizes),), np.int32) for q in range(n)]
    lo = sum(sizes[:r])
    close(mpicomm.ops.ReduceScatterV(ReduceOp.MAX)(xs[r], sizes), reduce_np(xs, ReduceOp.MAX)[lo:lo + sizes[r]],
          np.int32)
    # AlltoAll(split_count, split_dim, concat_dim): split axis 1 in n, concatenate along axis 0
    ys = [data(q, key + "a2a", (2, 3 * n, 2 * n), np.float64) for q in range(n)]
    got = mpicomm.ops.AlltoAll(n, 1, 0)(ys[r])
    want = np.concatenate([ys[i][:, 3 * r:3 * r + 3] for i in range(n)], axis=0)
    close(got, want, np.float64)
    got = mpicomm.ops.AlltoAll(split_count=n, split_dim=-1, concat_dim=1)(ys[r])
    close(got, np.concatenate([ys[i][:, :, 2 * r:2 * r + 2] for i in range(n)], axis=1), np.float64)
    # the old form still works
    zs = [data(q, key + "old", (2 * n,), np.int64) for q in range(n)]
    close(mpicomm.ops.AlltoAll()(zs[r]), np.concatenate([zs[i][2 * r:2 * r + 2] for i in range(n)]), np.int64)


def test_mindspore_alltoall_bad_arguments(comm):
    n = mpicomm.get_group_size()
    with pytest.raises(mpicomm.InvalidArgumentError, match="split_count"):
        mpicomm.ops.AlltoAll(n + 1, 0, 0)(np.ones((n * (n + 1),)))
    with pytest.raises(mpicomm.InvalidArgumentError, match="split_count"):
        mpicomm.ops.AlltoAll(0, 0, 0)
    with pytest.raises(mpicomm.InvalidArgumentError, match="split_dim"):
        mpicomm.ops.AlltoAll(n, 3, 0)(np.ones((n, n)))


@pytest.mark.parametrize("off", [1, -1], ids=["more", "fewer"])
@pytest.mark.parametrize("which", GROUPS)
def test_all_to_all_splits_that_do_not_pair_up_raise_everywhere(comm, subgroup, which, off, request):
    """Rank j expects from rank i another number of rows than rank i sends (in_splits[j] there
    != out_splits[i] here): CollectiveMismatchError on every rank, naming both ranks and both
    values, before any data moves (never rows left unwritten); the group goes on."""
    g, ranks, n, me = ctx(which, subgroup)
    if me is None:
        return
    if not (mpicomm._state.CTX.check or mpicomm._state.CTX.debug):
        pytest.skip("explicit splits are compared with the agreement check on (MPICOMM_CHECK=0 here)")
    key = request.node.name
    rng = np.random.default_rng(zlib.crc32(key.encode()))   # the same on every rank: which pair
    S = (rng.integers(1, 4, (n, n))).tolist()
    i, j = int(rng.integers(n)), int(rng.integers(n))
    outs = [S[q][me] for q in range(n)]
    if me == j:
        outs[i] += off
    x = data(ranks[me], key, (sum(S[me]), 2), np.float32)
    with pytest.raises(mpicomm.CollectiveMismatchError, match="do not pair up") as e:
        mpicomm.all_to_all(x, group=g, in_splits=S[me], out_splits=outs)
    msg = str(e.value)
    assert f"rank {i}" in msg and f"rank {j}" in msg, msg
    assert f"in_splits[{j}] = {S[i][j]} there" in msg and f"out_splits[{i}] = {S[i][j] + off} there" in msg, msg
    # in_splits alone: out's axis 0 split evenly, which rank j's in_splits do not match
    if n > 1:
        ins = [2] * n
        if me == i:
            ins = [2 + (q == j) - (q == (j + 1) % n) for q in range(n)]
        with pytest.raises(mpicomm.CollectiveMismatchError, match="do not pair up"):
            mpicomm.all_to_all(data(ranks[me], key + "e", (2 * n, 2), np.float32), group=g, in_splits=ins)
    # the group goes on: a matching call returns every rank's rows
    xs = [data(ranks[q], key + "ok", (sum(S[q]), 2), np.float32) for q in range(n)]
    got = mpicomm.all_to_all(xs[me], group=g, in_splits=S[me], out_splits=[S[q][me] for q in range(n)])
    close(got, np.concatenate([xs[q][sum(S[q][:me]):sum(S[q][:me + 1])] for q in range(n)]), np.float32)


def test_all_to_all_splits_refused_on_one_rank_raise_everywhere(comm, request):
    """One rank's splits are invalid there (in_splits that do not add up to its x, out_splits
    'auto' against lists): it raises InvalidArgumentError naming them, the others a refusal
    naming that rank, at once (no one waits in the call); the group goes on."""
    import time

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    if not (mpicomm._state.CTX.check or mpicomm._state.CTX.debug):
        pytest.skip("explicit splits are compared with the agreement check on (MPICOMM_CHECK=0 here)")
    key = request.node.name
    x = data(r, key, (2 * n, 2), np.float64)
    ins = [2] * n
    if r == n - 1:
        ins[0] = 3
    t0 = time.monotonic()
    with pytest.raises(mpicomm.InvalidArgumentError, match=("add up to x.shape" if r == n - 1 else
                                                            f"rank {n - 1} refused all_to_all")):
        mpicomm.all_to_all(x, in_splits=ins, out_splits=[2] * n)
    assert time.monotonic() - t0 < 2.0
    if n > 1:
        with pytest.raises(mpicomm.CollectiveMismatchError, match=f"out_splits='auto' on rank {n - 1}"):
            mpicomm.all_to_all(x, in_splits=[2] * n, out_splits="auto" if r == n - 1 else [2] * n)
    xs = [data(q, key + "ok", (2 * n, 2), np.float64) for q in range(n)]
    got = mpicomm.all_to_all(xs[r], in_splits=[2] * n, out_splits="auto")
    close(got, np.concatenate([xs[q][2 * r:2 * r + 2] for q in range(n)]), np.float64)


# -------------------------------------------------------------------- bad input

@pytest.mark.parametrize("sizes", ["bad-len", "negative", "bool", "float", "word", "not-a-sequence"])
def test_bad_sizes_refused_on_every_rank(comm, sizes):
    n = mpicomm.get_group_size()
    s = {"bad-len": [1] * (n + 1), "negative": [-1] + [1] * (n - 1), "bool": [True] * n, "float": [1.0] * n,
         "word": "even", "not-a-sequence": 3}[sizes]
    x = np.ones((1, 2), np.float32)
    for call in (lambda: mpicomm.all_gather(x, sizes=s), lambda: mpicomm.gather(x, sizes=s),
                 lambda: mpicomm.reduce_scatter(np.ones((n, 2)), sizes=s),
                 lambda: mpicomm.all_to_all(x, in_splits=s, out_splits=[1] * n),
                 lambda: mpicomm.all_to_all(x, in_splits=[1] * n, out_splits=s)):
        with pytest.raises(mpicomm.InvalidArgumentError, match="sizes|splits") as e:
            call()
        assert repr(s) in str(e.value) or "even" in str(e.value)


def test_local_size_errors_name_the_argument(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"x.shape.*sizes\[%d\]" % r):
        mpicomm.all_gather(np.ones((5, 2)), sizes=[4] * n)
    with pytest.raises(mpicomm.InvalidArgumentError, match="add up to x.shape"):
        mpicomm.reduce_scatter(np.ones((n + 1, 2)), sizes=[1] * n)
    with pytest.raises(mpicomm.InvalidArgumentError, match="in_splits"):
        mpicomm.all_to_all(np.ones((n + 1, 2)), in_splits=[1] * n, out_splits=[1] * n)
    with pytest.raises(mpicomm.InvalidArgumentError, match="sizes"):
        mpicomm.reduce_scatter(np.ones((n, 2)), sizes="auto")
    with pytest.raises(mpicomm.InvalidArgumentError, match="root"):
        mpicomm.gather(np.ones(2), root=n)
    with pytest.raises(mpicomm.InvalidArgumentError, match="root"):
        mpicomm.scatter(np.ones(2 * n), root=-1)


def test_scatter_without_out_away_from_root(comm, request):
    """Without sizes='auto' the other ranks must say what they receive (the root takes no
    part in this failing call, so nothing is left unmatched)."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    if n == 1:   # only the root: nothing is missing, and any axis 0 divides by 1: x comes back
        x = data(0, request.node.name, (n + 1, 2), np.float64)
        close(mpicomm.scatter(x, 0, sizes=[n + 1]), x, np.float64)
        close(mpicomm.scatter(x, 0, out=None, sizes=None), x, np.float64)
        return
    if mpicomm._state.CTX.debug:   # debug mode exchanges every call's facts: every rank raises
        x = np.arange(2.0 * n).reshape(n, 2)
        with pytest.raises(mpicomm.InvalidArgumentError, match="out=None.*sizes='auto'"):
            mpicomm.scatter(x if r == 0 else None, 0, sizes=[1] * n)
        return
    if r != 0:
        with pytest.raises(mpicomm.InvalidArgumentError, match="out=None.*sizes='auto'"):
            mpicomm.scatter(None, 0, sizes=[1] * n)
    else:
        with pytest.raises(mpicomm.InvalidArgumentError, match="divisible"):
            mpicomm.scatter(np.ones((n + 1, 2)), 0, out=None, sizes=None)


def test_auto_mismatch_raises_on_every_rank(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    x = np.ones((r % 2 + 1, 3), np.float32 if r == 0 else np.float64)
    if n == 1:
        assert mpicomm.all_gather(x, sizes="auto").shape == (1, 3)
        return
    with pytest.raises(mpicomm.CollectiveMismatchError, match="differ in dtype") as e:
        mpicomm.all_gather(x, sizes="auto")
    assert "rank 1" in str(e.value) and "float64" in str(e.value)
    y = np.ones((2, 3 + (r == n - 1)), np.int32)   # the last rank's trailing shape differs
    with pytest.raises(mpicomm.CollectiveMismatchError, match="trailing shape"):
        mpicomm.all_to_all(y, in_splits=[2] + [0] * (n - 1), out_splits="auto")
    z = np.ones((2, 2), np.float32)
    with pytest.raises(mpicomm.CollectiveMismatchError, match="op or root"):
        mpicomm.gather(z, root=r % 2, sizes="auto")
    # the group still works afterwards
    close(mpicomm.all_gather(np.full((1,), r, np.int32), sizes="auto"), np.arange(n, dtype=np.int32), np.int32)


def test_sizes_as_numpy_and_out_splits_from_out(comm, request):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    key = request.node.name
    sizes = sizes_of(n, 1)
    x = data(r, key, (sizes[r], 2), np.int32)
    want = np.concatenate([data(q, key, (sizes[q], 2), np.int32) for q in range(n)])
    close(mpicomm.all_gather(x, sizes=np.array(sizes)), want, np.int32)              # a NumPy array
    close(mpicomm.all_gather(x, sizes=[np.int64(v) for v in sizes]), want, np.int32)  # NumPy ints
    # in_splits given, out_splits None: out's axis 0 split evenly (torch's all_to_all_single)
    ins = [3] * n   # every rank sends 3 rows to every rank
    xs = [data(q, key + "a", (3 * n, 2), np.float32) for q in range(n)]
    out = np.empty((3 * n, 2), np.float32)
    assert mpicomm.all_to_all(xs[r], out=out, in_splits=ins) is out
    close(out, np.concatenate([xs[i][3 * r:3 * r + 3] for i in range(n)]), np.float32)
    if n > 1:   # without out_splits, out's axis 0 must divide by the group size
        with pytest.raises(mpicomm.InvalidArgumentError, match="out.shape"):
            mpicomm.all_to_all(xs[r], out=np.empty((3 * n + 1, 2), np.float32), in_splits=ins)
