"""Horovod's PyTorch test suite (horovod/horovod, test/parallel/test_torch.py), ported onto
mpicomm's API: PyTorch CPU tensors over the MPI backend. Each rank's data is random and
seeded by its rank (Horovod fills tensors with the rank or one seed on every rank), and
every expectation is computed here with NumPy from every rank's data.

Horovod test -> mpicomm call ported here:

- test_horovod_allreduce, _average, _inplace: ``all_reduce(x, op)`` for SUM, AVG, MIN, MAX
  and PROD, uint8..int64, float16, bfloat16, float32, float64, 1-3 dims; ``out=x`` in place.
  Horovod's ``average=True`` on integer tensors has no equivalent: AVG needs a floating dtype
  and is refused on every rank (test_allreduce_average_of_integers_is_refused).
- test_horovod_allreduce_async_fused: ``all_reduce(x, async_op=True)`` for every case at once,
  then ``Work.wait()`` (Horovod's poll-is-false-once assertion is a timing one: not ported).
- test_horovod_grouped_allreduce, _average, _inplace: ``mpicomm.all_reduce_coalesced(tensors,
  op)`` (one fused call per dtype), and in place, ``with mpicomm.batch(coalesce=True):
  all_reduce(t, out=t)`` for each tensor.
- test_horovod_allgather, _variable_size, _async_fused: ``all_gather(x)``, ``all_gather(x,
  sizes=[...])`` and ``sizes="auto"``, ``async_op=True``.
- test_horovod_broadcast, _inplace: ``Broadcast(root)(x)`` (a new tensor, ``x`` unchanged) and
  ``broadcast(x, root)`` (in place), from every root.
- test_horovod_alltoall, _equal_split: ``all_to_all(x, in_splits=..., out_splits=...)`` (also
  ``out_splits="auto"``) and ``all_to_all(x)``.
- test_horovod_reducescatter (later Horovod versions): ``reduce_scatter(x, op)`` and with
  ``sizes``.
- Errors. Every rank must raise, and the group's next call must return the right result:
  test_horovod_allreduce_type_error, allgather_type_error, broadcast_type_error,
  alltoall_type_error, reducescatter_type_error (one dtype on even ranks, another on odd
  ones): ``CollectiveMismatchError`` (broadcast's root, whose call can be over before the
  report comes, in its next call of the group); test_horovod_allgather_error and
  alltoall_rank_error (another trailing shape on each rank) with ``sizes="auto"`` /
  ``out_splits="auto"``, which exchange the call first: ``CollectiveMismatchError``;
  alltoall_equal_split_length_error, alltoall_splits_error, alltoall_splits_type_error:
  ``InvalidArgumentError``. Horovod's splits are an int32 tensor: here a torch integer
  tensor, a NumPy integer array or a list.
  Not ported as in-process cases, because a call that moves another number of bytes on one
  rank can leave MPI unable to complete it, and then mpicomm's watchdog ends the job naming
  every rank's call (docs/RELIABILITY.md; tests/test_agreement_jobs.py): allgather_error and
  alltoall_rank_error without the exchange, broadcast_error, reducescatter_error,
  broadcast_rank_error (each rank its own root: it raises on every rank where no rank has gone
  on to its next call before the report, else the job ends), and allreduce_error's first half
  (17+rank rows on each rank: at 2 and 3 ranks Open MPI's own Allreduce corrupts the heap
  before any check can run; at 4 ranks it raises).
  allreduce_error's second half (the same element count in another shape) is no error in
  mpicomm (nor in torch.distributed): the flat element-wise reduction, each rank in its own
  shape (test_allreduce_of_the_same_count_in_other_shapes).
- test_broadcast_object, test_allgather_object: ``broadcast_object``, ``all_gather_object``.
- test_broadcast_state, _options, _no_grad: ``mpicomm.broadcast_parameters(state_dict)`` for
  the model and ``opt.load_state_dict(broadcast_object(opt.state_dict()))`` for the
  optimizer (mpicomm has no broadcast_optimizer_state).
- DistributedOptimizer (test_gradient_clipping, test_force_allreduce's model): the equivalent
  is ``mpicomm.torch.DistributedDataParallel``: gradients are averaged during backward, so a
  plain optimizer steps on them; compared with one process stepping on every rank's loss.
- test_force_allreduce (rank 0's loss leaves fc3 without a gradient, the others' use it):
  ``DistributedDataParallel(find_unused_parameters=True)``, over the optimizers above (Horovod
  loops over every torch.optim class), compared with one process; at one rank (Horovod skips
  it) fc3 keeps .grad None.

Not ported (no equivalent in mpicomm): prescale/postscale factors, the ``*_grad`` tests
(mpicomm's collectives are not autograd functions: a tensor that requires grad gives a
result without a graph), duplicate-name errors (calls have no names), join, the CPU/GPU
mixing errors (CPU only here), timeline, SyncBatchNorm, Adasum, compression classes and
DistributedOptimizer's named_parameters checks.
"""
import zlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpicomm
from mpicomm import CollectiveMismatchError, InvalidArgumentError, MpicommError, ReduceOp

pytestmark = pytest.mark.mpi

NP = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
      torch.int64: np.int64, torch.float16: np.float16, torch.bfloat16: np.float32,
      torch.float32: np.float32, torch.float64: np.float64}
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES = INTS + FLOATS
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]
DIMS = [1, 2, 3]


def nr():
    return mpicomm.get_group_size(), mpicomm.get_rank()


def values(rank, key, shape, dt, op=ReduceOp.SUM):
    """Rank ``rank``'s data (NumPy, in the dtype's NumPy stand-in): integers in [-100, 100)
    ([0, 100) unsigned), or -1, 1, 2 for PROD, so that float sums and products are exact."""
    g = np.random.default_rng([rank, zlib.crc32(key.encode())])
    unsigned = dt == torch.uint8
    if op is ReduceOp.PROD:
        v = g.choice([1, 2] if unsigned else [-1, 1, 2], size=shape)
    else:
        v = g.integers(0 if unsigned else -100, 100, size=shape)
    return v.astype(NP[dt])


def as_torch(a, dt):
    return torch.from_numpy(np.array(a, copy=True)).to(dt)   # (a copy: an in-place call must not change `a`)


def as_np(t):
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def reduced(arrs, op, dt):
    """The reduction of every rank's array, computed here (integer SUM/PROD wrap around as
    NumPy's arithmetic in the dtype; bfloat16 is summed in float32 and rounded once)."""
    s = np.stack(arrs)
    if op is ReduceOp.AVG:
        return s.astype(np.float64).sum(0) / len(arrs)
    r = {ReduceOp.SUM: lambda: s.sum(0, dtype=s.dtype), ReduceOp.PROD: lambda: s.prod(0, dtype=s.dtype),
         ReduceOp.MIN: lambda: s.min(0), ReduceOp.MAX: lambda: s.max(0)}[op]()
    return as_np(as_torch(r, dt)) if dt == torch.bfloat16 else r


def check(got, want, op, dt):
    assert got.dtype == dt
    g = as_np(got)
    if op is ReduceOp.AVG:   # one rounding in a half type, or the division's in float32/64
        rtol = 8e-3 if dt in (torch.float16, torch.bfloat16) else 1e-6
        np.testing.assert_allclose(g, want, rtol=rtol, atol=0)
    else:
        np.testing.assert_array_equal(g, want)


def ops_for(dt):
    return [op for op in OPS if not (op is ReduceOp.AVG and dt in INTS)]


# ------------------------------------------------------------------ allreduce

@pytest.mark.parametrize("op,dt", [(op, dt) for op in OPS for dt in DTYPES if op in ops_for(dt)],
                         ids=lambda v: v.name if isinstance(v, ReduceOp) else str(v))
def test_allreduce(comm, op, dt):
    """test_horovod_allreduce / _average: every op, dtype and 1-3 dims (AVG of integers:
    test_allreduce_average_of_integers_is_refused); the input unchanged."""
    n, r = nr()
    for dim in DIMS:
        shape = [17] * dim
        key = f"ar-{op.name}-{dt}-{dim}"
        arrs = [values(k, key, shape, dt, op) for k in range(n)]
        x = as_torch(arrs[r], dt)
        keep = x.clone()
        got = mpicomm.all_reduce(x, op=op)
        assert got.shape == x.shape and got is not x
        check(got, reduced(arrs, op, dt), op, dt)
        assert torch.equal(x, keep)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_allreduce_inplace(comm, dt):
    """test_horovod_allreduce_inplace: ``out=x`` (Horovod's allreduce_), every op."""
    n, r = nr()
    for op in ops_for(dt):
        for dim in DIMS:
            key = f"ari-{op.name}-{dt}-{dim}"
            arrs = [values(k, key, [17] * dim, dt, op) for k in range(n)]
            x = as_torch(arrs[r], dt)
            assert mpicomm.all_reduce(x, op=op, out=x) is x
            check(x, reduced(arrs, op, dt), op, dt)


def test_allreduce_average_of_integers_is_refused(comm):
    """Horovod averages integer tensors (dividing in the dtype); mpicomm refuses AVG on
    integers on every rank alike, saying what to do, and the group goes on."""
    n, r = nr()
    for dt in INTS:
        x = as_torch(values(r, "avgint", [5], dt), dt)
        with pytest.raises(InvalidArgumentError, match="AVG needs a floating dtype"):
            mpicomm.all_reduce(x, op=ReduceOp.AVG)
        _verify(f"avgint-{dt}")


def test_allreduce_async_fused(comm):
    """test_horovod_allreduce_async_fused: every dtype and dim started async_op=True, then waited."""
    n, r = nr()
    pending = []
    for dt in DTYPES:
        for dim in DIMS:
            key = f"arasync-{dt}-{dim}"
            arrs = [values(k, key, [17] * dim, dt) for k in range(n)]
            pending.append((mpicomm.all_reduce(as_torch(arrs[r], dt), async_op=True), reduced(arrs, ReduceOp.SUM, dt),
                            dt))
    for w, want, dt in pending:
        check(w.wait(), want, ReduceOp.SUM, dt)
        assert w.is_completed()


def test_allreduce_of_the_same_count_in_other_shapes(comm):
    """test_horovod_allreduce_error's second half: rank 0 passes (17, 23*57), the others (17, 23,
    57). Horovod raises; mpicomm, as torch.distributed, reduces the flat elements and gives each
    rank the result in its own shape (the agreement check compares element counts)."""
    n, r = nr()
    arrs = [values(k, "sameshape", [17, 23 * 57], torch.float32) for k in range(n)]
    mine = arrs[r] if r == 0 else arrs[r].reshape(17, 23, 57)
    got = mpicomm.all_reduce(as_torch(mine, torch.float32))
    assert tuple(got.shape) == mine.shape
    np.testing.assert_array_equal(got.numpy().reshape(17, -1), reduced(arrs, ReduceOp.SUM, torch.float32))


# ------------------------------------------------------------------ grouped allreduce

@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG], ids=lambda o: o.name)
def test_grouped_allreduce(comm, op):
    """test_horovod_grouped_allreduce / _average: five tensors per dtype and dim in one
    ``all_reduce_coalesced`` call, and all of them (every dtype at once: one fused call per
    dtype) in another."""
    n, r = nr()
    every, wants, dts = [], [], []
    for dt in DTYPES:
        if op is ReduceOp.AVG and dt in INTS:
            continue
        for dim in DIMS:
            per = [[values(k, f"grp-{op.name}-{dt}-{dim}-{i}", [17] * dim, dt) for k in range(n)] for i in range(5)]
            ts = [as_torch(p[r], dt) for p in per]
            keep = [t.clone() for t in ts]
            got = mpicomm.all_reduce_coalesced(ts, op=op)
            assert len(got) == 5
            for g, p in zip(got, per):
                assert g.shape == ts[0].shape
                check(g, reduced(p, op, dt), op, dt)
            assert all(torch.equal(t, k) for t, k in zip(ts, keep))
            every += ts
            wants += [reduced(p, op, dt) for p in per]
            dts += [dt] * 5
    for g, w, dt in zip(mpicomm.all_reduce_coalesced(every, op=op), wants, dts):
        check(g, w, op, dt)


def test_grouped_allreduce_inplace(comm):
    """test_horovod_grouped_allreduce_inplace: each tensor reduced into itself, the calls
    launched together (``batch(coalesce=True)``, Horovod's grouping)."""
    n, r = nr()
    for dt in DTYPES:
        for dim in DIMS:
            per = [[values(k, f"grpi-{dt}-{dim}-{i}", [17] * dim, dt) for k in range(n)] for i in range(5)]
            ts = [as_torch(p[r], dt) for p in per]
            with mpicomm.batch(coalesce=True):
                outs = [mpicomm.all_reduce(t, out=t) for t in ts]
            for t, o, p in zip(ts, outs, per):
                assert o is t
                check(t, reduced(p, ReduceOp.SUM, dt), ReduceOp.SUM, dt)


# ------------------------------------------------------------------ allgather

@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_allgather(comm, dt):
    """test_horovod_allgather: (17, ...) on every rank -> (17 n, ...), rank 0's rows first."""
    n, r = nr()
    for dim in DIMS:
        arrs = [values(k, f"ag-{dt}-{dim}", [17] * dim, dt) for k in range(n)]
        got = mpicomm.all_gather(as_torch(arrs[r], dt))
        assert list(got.shape) == [17 * n] + [17] * (dim - 1) and got.dtype == dt
        np.testing.assert_array_equal(as_np(got), as_np(as_torch(np.concatenate(arrs), dt)))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_allgather_variable_size(comm, dt):
    """test_horovod_allgather_variable_size: another first dimension on each rank (Horovod's
    17, 32, 81, 12, ...; one rank with none where there are several), given as ``sizes=``
    as a tensor, and exchanged (``sizes="auto"``)."""
    n, r = nr()
    sizes = ([17, 32, 81, 12, 15, 23, 22] * 5)[:n]
    if n > 1:
        sizes[1] = 0
    for dim in DIMS:
        arrs = [values(k, f"agv-{dt}-{dim}", [sizes[k]] + [17] * (dim - 1), dt) for k in range(n)]
        want = as_np(as_torch(np.concatenate(arrs), dt))
        for how in (sizes, torch.tensor(sizes), "auto"):
            got = mpicomm.all_gather(as_torch(arrs[r], dt), sizes=how)
            assert list(got.shape) == [sum(sizes)] + [17] * (dim - 1) and got.dtype == dt
            np.testing.assert_array_equal(as_np(got), want)


def test_allgather_async_fused(comm):
    """test_horovod_allgather_async_fused: every dtype and dim started async_op=True, then waited."""
    n, r = nr()
    pending = []
    for dt in DTYPES:
        for dim in DIMS:
            arrs = [values(k, f"agasync-{dt}-{dim}", [17] * dim, dt) for k in range(n)]
            pending.append((mpicomm.all_gather(as_torch(arrs[r], dt), async_op=True),
                            as_np(as_torch(np.concatenate(arrs), dt))))
    for w, want in pending:
        np.testing.assert_array_equal(as_np(w.wait()), want)


# ------------------------------------------------------------------ broadcast

@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_broadcast(comm, dt):
    """test_horovod_broadcast and _inplace, from every root: ``Broadcast(root)(x)`` returns the
    root's tensor and leaves ``x`` as it was; ``broadcast(x, root)`` fills ``x`` and returns it."""
    n, r = nr()
    for root in range(n):
        for dim in DIMS:
            arrs = [values(k, f"bc-{dt}-{dim}-{root}", [17] * dim, dt) for k in range(n)]
            want = as_np(as_torch(arrs[root], dt))
            x = as_torch(arrs[r], dt)
            keep = x.clone()
            got = mpicomm.Broadcast(root)(x)
            assert got is not x and got.dtype == dt
            np.testing.assert_array_equal(as_np(got), want)
            assert torch.equal(x, keep)
            assert mpicomm.broadcast(x, root) is x
            np.testing.assert_array_equal(as_np(x), want)


# ------------------------------------------------------------------ alltoall

def _rows(k, key, count, dim, dt):
    return values(k, key, [count] + [2] * (dim - 1), dt)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_alltoall(comm, dt):
    """test_horovod_alltoall: rank r sends r+1 rows to every rank, so it receives k+1 rows from
    rank k; its splits as a list, a NumPy array and an int32 tensor (Horovod's form), and the
    received sizes given or exchanged (``out_splits="auto"``)."""
    n, r = nr()
    for dim in DIMS:
        key = f"a2a-{dt}-{dim}"
        arrs = [_rows(k, key, n * (k + 1), dim, dt) for k in range(n)]
        want = np.concatenate([a[r * (k + 1):(r + 1) * (k + 1)] for k, a in enumerate(arrs)])
        ins = [r + 1] * n
        for in_splits, out_splits in [(ins, [k + 1 for k in range(n)]), (np.array(ins), "auto"),
                                      (torch.tensor(ins, dtype=torch.int32), "auto")]:
            got = mpicomm.all_to_all(as_torch(arrs[r], dt), in_splits=in_splits, out_splits=out_splits)
            assert got.numel() == n * (n + 1) // 2 * 2 ** (dim - 1) and got.dtype == dt
            np.testing.assert_array_equal(as_np(got), as_np(as_torch(want, dt)))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_alltoall_equal_split(comm, dt):
    """test_horovod_alltoall_equal_split: n equal chunks of axis 0, chunk j to rank j."""
    n, r = nr()
    for dim in DIMS:
        arrs = [_rows(k, f"a2ae-{dt}-{dim}", 3 * n, dim, dt) for k in range(n)]
        want = np.concatenate([a[3 * r:3 * (r + 1)] for a in arrs])
        got = mpicomm.all_to_all(as_torch(arrs[r], dt))
        np.testing.assert_array_equal(as_np(got), as_np(as_torch(want, dt)))


# ------------------------------------------------------------------ reducescatter

@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_reducescatter(comm, dt):
    """Horovod's test_horovod_reducescatter (later versions): rank i keeps chunk i of the
    reduction, for every op, even chunks and ``sizes`` (one rank's chunk empty)."""
    n, r = nr()
    uneven = [3 + k % 3 for k in range(n)]
    if n > 1:
        uneven[-1] = 0
    for op in ops_for(dt):
        for dim in DIMS:
            for sizes in (None, uneven):
                rows = 4 * n if sizes is None else sum(sizes)
                key = f"rs-{op.name}-{dt}-{dim}-{sizes is None}"
                arrs = [values(k, key, [rows] + [3] * (dim - 1), dt, op) for k in range(n)]
                full = reduced(arrs, op, dt)
                cut = [4] * n if sizes is None else sizes
                lo = sum(cut[:r])
                got = mpicomm.reduce_scatter(as_torch(arrs[r], dt), op=op, sizes=sizes)
                assert list(got.shape) == [cut[r]] + [3] * (dim - 1)
                check(got, full[lo:lo + cut[r]], op, dt)


# ------------------------------------------------------------------ errors

def _verify(key):
    """A correct call after an error: rank-dependent data, its sum computed here."""
    n, r = nr()
    arrs = [values(k, key, [6], torch.float64) for k in range(n)]
    got = mpicomm.all_reduce(as_torch(arrs[r], torch.float64))
    np.testing.assert_array_equal(got.numpy(), reduced(arrs, ReduceOp.SUM, torch.float64))


def _raises_everywhere(fn, exc, key, match=None, may_return=lambda res: False, again=None):
    """``fn()`` is wrong on some ranks. Every rank raises ``exc`` (matching ``match``), or, where
    ``may_return(result)`` (a broadcast root, whose call can be over before the report comes),
    returns and raises in one of its next two calls of the group; in each of those calls every
    rank raises or none does. Then a correct call (and ``again()``, the same collective called
    correctly) returns the right result on every rank."""
    try:
        res, err = fn(), None
    except MpicommError as e:
        res, err = None, e
    if err is None:
        assert may_return(res), f"rank {mpicomm.get_rank()} returned {res!r} without raising"
    else:
        assert isinstance(err, exc), repr(err)
        if match is not None:
            assert match in str(err), err
    errs = []
    for i in (1, 2):
        try:
            _verify(f"{key}-{i}")
            errs.append(None)
        except MpicommError as e:
            assert isinstance(e, CollectiveMismatchError), repr(e)
            errs.append(e)
    seen = MPI.COMM_WORLD.allgather((err is not None,) + tuple(e is not None for e in errs))  # (the test's own)
    for i in (1, 2):
        assert len({s[i] for s in seen}) == 1, f"call {i} after the case raised on some ranks only: {seen}"
    if all(s[0] for s in seen):
        assert not any(errs), "every rank raised in the call, and yet a later call raised"
    if err is None:
        assert any(errs), "this rank returned from the call and neither of its next two calls raised"
    _verify(f"{key}-3")
    if again is not None:
        again()


def _two_dtypes(r, shape, a=torch.int32, b=torch.float32):
    """Horovod's type-error tensors: ``a`` on even ranks, ``b`` on odd ones (same bytes)."""
    dt = a if r % 2 == 0 else b
    return as_torch(values(r, "types", shape, dt), dt)


@pytest.fixture
def multi(comm):
    if mpicomm.get_group_size() < 2:
        pytest.skip("ranks can only disagree where there are two")
    if not mpicomm._state.CTX.check or mpicomm._state.CTX.debug:
        pytest.skip("the agreement check is off (MPICOMM_CHECK=0), or debug mode compares first")
    return nr()


@pytest.mark.parametrize("pair", [(torch.int32, torch.float32), (torch.int64, torch.float64)], ids=str)
def test_allreduce_type_error(multi, pair):
    n, r = multi
    x = _two_dtypes(r, [17] * 3, *pair)
    _raises_everywhere(lambda: mpicomm.all_reduce(x), CollectiveMismatchError, "arte", match="dtype",
                       again=lambda: test_allreduce_inplace(None, torch.float32))


def test_allgather_type_error(multi):
    n, r = multi
    x = _two_dtypes(r, [17] * 3)
    _raises_everywhere(lambda: mpicomm.all_gather(x), CollectiveMismatchError, "agte", match="dtype")
    _raises_everywhere(lambda: mpicomm.all_gather(x, sizes="auto"), CollectiveMismatchError, "agte2", match="dtype",
                       again=lambda: test_allgather_variable_size(None, torch.int16))


def test_allgather_error(multi):
    """Another trailing dimension on each rank (10 (rank+1)); ``sizes="auto"`` compares the
    ranks' calls before any data moves, as Horovod's negotiation does."""
    n, r = multi
    x = torch.ones(17, 10 * (r + 1), 17) * r
    _raises_everywhere(lambda: mpicomm.all_gather(x, sizes="auto"), CollectiveMismatchError, "agerr",
                       match="trailing shape", again=lambda: test_allgather(None, torch.float32))


def test_broadcast_type_error(multi):
    n, r = multi
    x = _two_dtypes(r, [17] * 3)
    keep = x.clone()

    sent = _two_dtypes(0, [17] * 3)   # root 0's tensor, computed here

    def root_ok(res):   # root 0 returns its own tensor, untouched; a rank of root's dtype that got
        #               its data before the report came (a tree broadcast) returns root's values
        return (r == 0 and res is x and torch.equal(x, keep)) or \
            (r != 0 and res is x and x.dtype == sent.dtype and torch.equal(x, sent))

    _raises_everywhere(lambda: mpicomm.broadcast(x, 0), CollectiveMismatchError, "bcte", may_return=root_ok,
                       again=lambda: test_broadcast(None, torch.int32))


def test_alltoall_type_error(multi):
    n, r = multi
    x = _two_dtypes(r, [n])
    _raises_everywhere(lambda: mpicomm.all_to_all(x), CollectiveMismatchError, "a2ate", match="dtype",
                       again=lambda: test_alltoall_equal_split(None, torch.int32))


def test_alltoall_rank_error(multi):
    """Another second dimension on each rank; ``out_splits="auto"`` exchanges the calls first."""
    n, r = multi
    x = torch.ones(2 * n, 10 * (r + 1), 2 * n)
    _raises_everywhere(lambda: mpicomm.all_to_all(x, in_splits=[2] * n, out_splits="auto"), CollectiveMismatchError,
                       "a2are", match="trailing shape", again=lambda: test_alltoall(None, torch.float32))


def test_reducescatter_type_error(multi):
    n, r = multi
    x = _two_dtypes(r, [4 * n, 3])
    _raises_everywhere(lambda: mpicomm.reduce_scatter(x), CollectiveMismatchError, "rste", match="dtype",
                       again=lambda: test_reducescatter(None, torch.float64))


def test_alltoall_equal_split_length_error(comm):
    """A first axis (n+1) that does not divide into n chunks: InvalidArgumentError on every
    rank (at 1 rank it divides, and the call returns x)."""
    n, r = nr()
    x = torch.arange(float(n + 1))
    if n == 1:
        assert torch.equal(mpicomm.all_to_all(x), x)
        return
    with pytest.raises(InvalidArgumentError, match="divisible by the group size"):
        mpicomm.all_to_all(x)
    _verify("a2alen")


def test_alltoall_splits_error(comm):
    """Splits that add up to more rows than the tensor has: InvalidArgumentError on every rank."""
    n, r = nr()
    with pytest.raises(InvalidArgumentError, match="add up to"):
        mpicomm.all_to_all(torch.zeros(n - 1), in_splits=torch.ones(n, dtype=torch.int32))
    _verify("a2asplits")


@pytest.mark.parametrize("splits", [lambda n: torch.ones(n, dtype=torch.float32), lambda n: [1.0] * n,
                                    lambda n: np.ones(n, bool), lambda n: torch.ones(n, dtype=torch.bool),
                                    lambda n: torch.ones(n, 1, dtype=torch.int32)],
                         ids=["float-tensor", "float-list", "bool-array", "bool-tensor", "2-d-tensor"])
def test_alltoall_splits_type_error(comm, splits):
    """Splits that are not integers (Horovod: a tensor other than int32): InvalidArgumentError
    on every rank, naming in_splits."""
    n, r = nr()
    with pytest.raises(InvalidArgumentError, match="in_splits"):
        mpicomm.all_to_all(torch.zeros(n), in_splits=splits(n))
    _verify("a2asplitstype")


# ------------------------------------------------------------------ objects and state

def test_broadcast_object(comm):
    n, r = nr()
    expected = {"hello": 123, 0: [1, 2]}
    assert mpicomm.broadcast_object(expected if r == 0 else {}, root=0) == expected


def test_allgather_object(comm):
    n, r = nr()
    d = {"metric_val_1": r}
    if r == 1:
        d["metric_val_2"] = 42
    expected = [{"metric_val_1": i} for i in range(n)]
    if n > 1:
        expected[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert mpicomm.all_gather_object(d) == expected


D_IN, H, D_OUT = 20, 10, 5


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.ReLU(), torch.nn.Linear(H, D_OUT))


def _batch(seed, rows=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D_IN, generator=g), torch.randn(rows, D_OUT, generator=g)


OPTIMIZERS = {"SGD": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=0.1),
              "Adam": lambda p, lr: torch.optim.Adam(p, lr=lr, weight_decay=0.1),
              "RMSprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr, momentum=0.9, centered=True),
              "Adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr)}


def _trained(seed, name, lr):
    """A model of ``seed`` and its optimizer (learning rate ``lr``) after one step on batch ``seed``."""
    m = _model(seed)
    opt = OPTIMIZERS[name](m.parameters(), lr)
    x, y = _batch(seed)
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y, reduction="sum").backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_broadcast_state(comm, name):
    """test_broadcast_state and _options: each rank's model and optimizer after a step of its
    own (its own learning rate too); then the root's model (``broadcast_parameters`` of the
    state dict) and optimizer state and options (``broadcast_object`` of its state dict,
    loaded), compared with the root's, computed here; the ranks go on alike."""
    n, r = nr()
    for root in sorted({0, n - 1}):
        m, opt = _trained(100 + r, name, lr=0.1 * (r + 1))
        ref_m, ref_opt = _trained(100 + root, name, lr=0.1 * (root + 1))
        sd = m.state_dict()
        assert mpicomm.broadcast_parameters(sd, root=root) is sd
        for (k, v), (k2, v2) in zip(m.state_dict().items(), ref_m.state_dict().items()):
            assert k == k2 and torch.equal(v, v2), k
        opt.load_state_dict(mpicomm.broadcast_object(opt.state_dict(), root=root))
        got, want = opt.state_dict(), ref_opt.state_dict()
        assert got["param_groups"] == want["param_groups"]   # options: lr, momentum, betas...
        assert len(got["state"]) == len(want["state"]) == 4
        for i in want["state"]:
            for k, v in want["state"][i].items():
                assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)
        # a step more: identical on every rank (their new parameters gathered and compared)
        x, y = _batch(7)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        flat = torch.cat([p.detach().flatten() for p in m.parameters()])
        every = mpicomm.all_gather(flat[None])
        assert all(torch.equal(row, flat) for row in every)


def test_broadcast_state_no_grad(comm):
    """test_broadcast_state_no_grad: an int32 parameter without gradient beside a float one
    (one fused broadcast per dtype), filled with the root's values."""
    n, r = nr()

    class ModelNoGrad(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a = torch.nn.Parameter(a.int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    def make(k):
        g = torch.Generator().manual_seed(300 + k)
        return ModelNoGrad(torch.randint(0, 4, (2,), generator=g), torch.rand(4, generator=g))

    m, ref = make(r), make(0)
    mpicomm.broadcast_parameters(m.state_dict(), root=0)
    assert m.a.dtype == torch.int32 and torch.equal(m.a, ref.a) and torch.equal(m.b, ref.b)
    assert m.a.grad is None


# ------------------------------------------------------------------ DistributedOptimizer

class Net2(torch.nn.Module):
    """test_force_allreduce's network: two outputs."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(D_IN, H)
        self.fc2 = torch.nn.Linear(H, D_OUT)
        self.fc3 = torch.nn.Linear(D_OUT, D_OUT)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x1 = self.fc2(x)
        return x1, self.fc3(torch.relu(x1))


def _loss(net, k, step):
    """Rank k's loss in a step, on its own batch: both outputs, weighted by rank."""
    x, y = _batch(1000 * step + k)
    y1, y2 = net(x)
    f = torch.nn.functional.mse_loss
    return f(y1, y) + (k + 1) * f(y2, y)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_distributed_optimizer_and_clipping(comm, name):
    """DistributedOptimizer (test_force_allreduce's model, test_gradient_clipping), with
    DistributedDataParallel standing in: every rank's gradients are the average of every
    rank's, clipped after backward (Horovod's synchronize() then clip_grad_norm_), and the
    parameters after three steps equal one process's that computes every rank's loss,
    averages their gradients, clips and steps; they are the same on every rank."""
    import mpicomm.torch as mt

    n, r = nr()
    model = mt.DistributedDataParallel(Net2(seed=40 + r))   # rank 0's parameters
    opt = OPTIMIZERS[name](model.parameters(), 0.05)
    ref = Net2(seed=40)
    ref_opt = OPTIMIZERS[name](ref.parameters(), 0.05)
    for step in range(3):
        opt.zero_grad()
        _loss(model, r, step).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        ref_opt.zero_grad()
        for k in range(n):   # the sum of every rank's gradients, then / n
            _loss(ref, k, step).backward()
        for p in ref.parameters():
            p.grad /= n
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
        before = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        ref_before = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        torch.testing.assert_close(before, ref_before, rtol=1e-5, atol=1e-6)
        assert before > 0.1   # the clipping changed something
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert all(torch.equal(row, flat) for row in mpicomm.all_gather(flat[None]))


def _force_loss(net, k, step):
    """test_force_allreduce's losses: rank 0's uses the first output only (fc3 gets no
    gradient there), the other ranks' the second (every parameter); each on its own batch."""
    x, y = _batch(2000 * step + k)
    y1, y2 = net(x.double())
    return torch.nn.functional.mse_loss(y1 if k == 0 else y2, y.double(), reduction="sum")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_force_allreduce(comm, name):
    """test_force_allreduce: rank 0 leaves fc3 without a gradient, the other ranks use it;
    with find_unused_parameters=True every rank's step completes (rank 0 reduces fc3 as
    zeros, as DDP), fc3's gradient is the others' sum / n, and after three steps the
    parameters equal one process's on every rank's loss, on every rank. At one rank no rank
    uses fc3: its .grad stays None and the optimizer leaves it alone (Horovod skips one rank).
    In float64 (the losses are sums: RMSprop magnifies float32's other summation order)."""
    import mpicomm.torch as mt

    n, r = nr()
    model = mt.DistributedDataParallel(Net2(seed=50 + r).double(), find_unused_parameters=True, bucket_cap_mb=0)
    opt = OPTIMIZERS[name](model.parameters(), 0.05)
    ref = Net2(seed=50).double()
    ref_opt = OPTIMIZERS[name](ref.parameters(), 0.05)
    fc3 = ref.fc3.weight.detach().clone()
    for step in range(3):
        opt.zero_grad()
        _force_loss(model, r, step).backward()
        ref_opt.zero_grad()
        sum(_force_loss(ref, k, step) for k in range(n)).div(n).backward()
        for (nm, p), q in zip(model.module.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert n == 1 and nm.startswith("fc3.") and p.grad is None, nm
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-9, msg=f"step {step} {nm}")
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-9)
    assert torch.equal(model.module.fc3.weight.detach(), fc3) == (n == 1)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert all(torch.equal(row, flat) for row in mpicomm.all_gather(flat[None]))
