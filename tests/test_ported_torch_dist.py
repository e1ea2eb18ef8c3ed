"""torch.distributed's collective and DDP tests, ported onto mpicomm (CPU tensors, MPI backend).

Upstream: pytorch/pytorch torch/testing/_internal/distributed/distributed_test.py
(DistributedTest._DistTestBase), test/distributed/test_c10d_common.py and test_c10d_gloo.py
(ProcessGroupGlooTest). tests/test_ported.py has the in-place and *_object tests already.
Each rank's data is random, seeded by its group rank; every expectation is computed here from
every rank's data (NumPy), never read back from mpicomm. Each test name -> mpicomm's call:

- test_all_reduce_{sum,product,min,max}[_complex], _group_*, _full_group_*, *_async, _sum_twice
  -> mpicomm.all_reduce(x, op, group=g[, async_op=True -> Work.wait()], out=x for in place):
  test_all_reduce. test_all_reduce_complex_unsupported_ops -> InvalidArgumentError on every
  rank for PROD/MIN/MAX of complex (torch: ValueError): test_all_reduce_complex_unsupported_ops.
- test_all_reduce_coalesced_* -> mpicomm.all_reduce_coalesced(list, op) (new tensors, not in
  place as torch's) and ``with mpicomm.batch(coalesce=True)``: test_all_reduce_coalesced.
- test_reduce_{sum,product,min,max}, _group_*, _full_group_*, _sum_twice -> mpicomm.reduce
  (result on root, None elsewhere, the input left alone): test_reduce.
- test_broadcast, _group, _full_group (every root, every dtype) -> mpicomm.broadcast: test_broadcast.
- test_all_gather[_complex, _group, _full_group], all_gather_into_tensor, test_all_gather_v
  -> mpicomm.all_gather (a tensor (n*d0, ...), torch's list is ``list(res.chunk(n))``;
  ``out=``; uneven ``sizes=``): test_all_gather.
- test_gather[_group, _full_group], test_scatter[_complex, _group, _full_group]
  -> mpicomm.gather / mpicomm.scatter (``out=`` on the other ranks or ``sizes="auto"``;
  uneven ``sizes=``): test_gather, test_scatter.
- test_all_to_all_single_{equal,unequal}_split[_complex] -> mpicomm.all_to_all(x, in_splits=,
  out_splits=): test_all_to_all_single.
- test_reduce_scatter_tensor (c10d gloo), reduce_scatter (uneven) -> mpicomm.reduce_scatter(x,
  op[, sizes=]): test_reduce_scatter_tensor.
- test_barrier[_group, _full_group] -> mpicomm.barrier (torch sleeps and compares clocks; here
  every rank writes a file before it and finds all of them after it): test_barrier.
- test_send_recv, test_send_recv_with_tag, test_isend, test_irecv -> mpicomm.send / recv
  (``tag=``, ``async_op=True``): test_send_recv, test_send_recv_with_tag, test_isend_irecv.
  test_send_recv_any_source: mpicomm has no ANY_SOURCE (recv's src=None is refused):
  test_recv_any_source_is_refused.
- test_batch_isend_irecv_{ring_exchange,self,no_rank_zero,op_err,op_list_err,tensor_err}
  -> mpicomm.batch_isend_irecv([P2POp(...)]) and ``with mpicomm.batch():`` mixing
  collectives: test_batch_isend_irecv*.
- new_group / get_rank(group) / a rank outside the group -> mpicomm.create_group and the
  collectives on it; a non-member's call raises InvalidArgumentError (torch warns and returns
  None; get_rank gives -1): test_new_group_semantics.
- c10d gloo test_allgather_noncontiguous_input and the non-contiguous cases: every collective
  on transposed, strided and offset views (copied in, results right), broadcast into a
  non-contiguous view (filled in place), ``out=`` non-contiguous (refused on every rank),
  write targets whose elements share memory (expand(): refused on every rank), conj views:
  test_noncontiguous_*, test_self_overlapping_*, test_conj_views.
- tensors of other dtypes/shapes/kinds per rank -> CollectiveMismatchError or
  InvalidArgumentError on every rank, the next call in step: test_calls_that_differ_per_rank,
  test_unsupported_tensor_on_one_rank.
- DDP (mpicomm.torch.DistributedDataParallel): test_DistributedDataParallel (+ torch.save /
  load of the wrapper mid-training: _test_DDP_niter's test_save), test_accumulate_gradients_no_sync
  [_grad_is_view], find_unused_parameters (test_ddp_unused_params*, test_find_unused_parameters_kwarg),
  buffers from rank 0 (test_ddp_broadcast_buffer), gradient_as_bucket_view, state_dict.
  Uneven inputs (DDP's join()) and register_comm_hook: tests/test_torch_join.py, against torch DDP.
"""
import copy
import io
import os
import zlib

import numpy as np
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm import CollectiveMismatchError, InvalidArgumentError, ReduceOp  # noqa: E402
from mpicomm.errors import RefusedElsewhereError  # noqa: E402
from conftest import reversed_group  # noqa: E402

pytestmark = pytest.mark.mpi
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cpu_tensors_need_mpi(request):
    """CPU tensors go through the MPI backend (as in test_torch.py): where mpicomm chose NCCL,
    run with MPICOMM_BACKEND=mpi."""
    if "comm" in request.fixturenames and request.getfixturevalue("comm").get_backend() != "mpi":
        pytest.skip("CPU tensors need the MPI backend: run with MPICOMM_BACKEND=mpi")


@pytest.fixture(scope="module")
def groups(comm):
    """(group, its world ranks) for the world and a reversed sub-group (torch's _group and
    _full_group variants), where this rank is a member."""
    sub = reversed_group("ptd_rev")
    n = mpicomm.get_group_size()
    return [(None, list(range(n)))] + ([("ptd_rev", sub)] if mpicomm.get_rank() in sub else [])


DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
          "int64": torch.int64, "bool": torch.bool, "complex64": torch.complex64,
          "complex128": torch.complex128}
NP = {"float32": np.float32, "float64": np.float64, "float16": np.float32, "bfloat16": np.float32,
      "int8": np.int8, "uint8": np.uint8, "int32": np.int32, "int64": np.int64, "bool": np.bool_,
      "complex64": np.complex64, "complex128": np.complex128}


def ops_of(name):
    if name.startswith("complex"):
        return [ReduceOp.SUM, ReduceOp.AVG]
    if name.startswith(("float", "bfloat")):
        return [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
    return [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]


def vals(r, key, shape, name, op=None):
    """Group rank r's values as NumPy (small integers: sums and products exact in every dtype,
    half precision included)."""
    g = np.random.default_rng([r, zlib.crc32(key.encode())])
    if name == "bool":
        return g.integers(0, 2, shape).astype(bool)
    lo = 0 if name == "uint8" else -30
    if op is ReduceOp.PROD:
        v = g.choice([1, 2] if name == "uint8" else [1, 2, -1], shape)
    else:
        v = g.integers(lo, 31, shape)
    if name.startswith("complex"):
        v = v + 1j * (g.choice([1, 2, -1], shape) if op is ReduceOp.PROD else g.integers(-30, 31, shape))
    return v.astype(NP[name])


def tens(a, name):
    return torch.from_numpy(np.array(a, order="C")).to(DTYPES[name])   # (0-d stays 0-d)


def as_np(t):
    return (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).numpy()


def reduce_np(arrs, op, name):
    s = np.stack(arrs)
    if name == "bool":
        return (np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and).reduce(s, axis=0)
    wide = s.astype(np.complex128 if s.dtype.kind == "c" else np.float64 if s.dtype.kind == "f" else np.int64)
    r = {ReduceOp.SUM: wide.sum(0), ReduceOp.PROD: wide.prod(0), ReduceOp.MIN: wide.min(0),
         ReduceOp.MAX: wide.max(0), ReduceOp.AVG: wide.sum(0) / len(arrs)}[op]
    return r


def check(got, want, name, op=None):
    assert isinstance(got, torch.Tensor) and got.dtype == DTYPES[name], (type(got), getattr(got, "dtype", None))
    w = tens(np.asarray(want), name) if name not in ("float16", "bfloat16") else \
        torch.from_numpy(np.asarray(want, np.float64)).to(DTYPES[name])
    if op is ReduceOp.AVG:   # a division: rounded once in the dtype (half precision: from float32)
        torch.testing.assert_close(got, w, rtol=1e-2 if name in ("float16", "bfloat16") else 1e-6, atol=0)
    else:
        torch.testing.assert_close(got, w, rtol=0, atol=0)


# ---------------------------------------------------------------- all_reduce

@pytest.mark.parametrize("name", list(DTYPES))
def test_all_reduce(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for op in ops_of(name):
            key = f"ar{g}{name}{op}"
            mine = vals(r, key, (2, 3), name, op)
            want = reduce_np([vals(j, key, (2, 3), name, op) for j in range(n)], op, name)
            x = tens(mine, name)
            keep = x.clone()
            check(mpicomm.all_reduce(x, op, group=g), want, name, op)
            assert torch.equal(x, keep)                           # out of place: x unchanged
            w = mpicomm.all_reduce(x, op, group=g, async_op=True)   # test_all_reduce_sum_async
            check(w.wait(), want, name, op)
            assert w.is_completed()
            assert mpicomm.all_reduce(x, op, out=x, group=g) is x    # torch's in-place form
            check(x, want, name, op)
        if name in ("float32", "int64"):   # test_all_reduce_sum_twice: the in-place result reduced again
            key = f"twice{g}{name}"
            x = tens(vals(r, key, (4,), name), name)
            mpicomm.all_reduce(x, out=x, group=g)
            mpicomm.all_reduce(x, out=x, group=g)
            check(x, n * reduce_np([vals(j, key, (4,), name) for j in range(n)], ReduceOp.SUM, name), name)


@pytest.mark.parametrize("op", [ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX])
def test_all_reduce_complex_unsupported_ops(groups, op):
    for g, ranks in groups:
        x = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
        with pytest.raises(InvalidArgumentError, match=rf"op='{op.value}'.*SUM or AVG for complex"):
            mpicomm.all_reduce(x, op, group=g)
        torch.testing.assert_close(mpicomm.all_reduce(x, group=g), x * len(ranks))   # in step after it


def test_all_reduce_coalesced(groups):
    """torch's cases: tensors of several shapes (a 0-d one) and dtypes in one call."""
    shapes = [((2,), "float32"), ((), "int64"), ((3, 2), "float64"), ((5,), "int32")]
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for op in [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]:
            key = f"co{g}{op}"
            xs = [tens(vals(r, f"{key}{i}", s, d, op), d) for i, (s, d) in enumerate(shapes)]
            got = mpicomm.all_reduce_coalesced(xs, op, group=g)
            for i, (s, d) in enumerate(shapes):
                check(got[i], reduce_np([vals(j, f"{key}{i}", s, d, op) for j in range(n)], op, d), d)
            with mpicomm.batch(group=g, coalesce=True):   # torch's _coalescing_manager
                works = [mpicomm.all_reduce(x, op, group=g, async_op=True) for x in xs]
            for i, ((s, d), w) in enumerate(zip(shapes, works)):
                check(w.wait(), reduce_np([vals(j, f"{key}{i}", s, d, op) for j in range(n)], op, d), d)


# ---------------------------------------------------------------- reduce, broadcast

@pytest.mark.parametrize("name", ["float32", "int64", "bfloat16", "complex128", "bool", "uint8"])
def test_reduce(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            for op in ops_of(name):
                key = f"red{g}{root}{name}{op}"
                x = tens(vals(r, key, (3, 2), name, op), name)
                keep = x.clone()
                res = mpicomm.reduce(x, op, root=root, group=g)
                assert torch.equal(x, keep)
                if r == root:
                    check(res, reduce_np([vals(j, key, (3, 2), name, op) for j in range(n)], op, name), name, op)
                else:
                    assert res is None
            if name == "float32":   # test_reduce_sum_twice, in place on the root
                key = f"red2{g}{root}"
                x = tens(vals(r, key, (4,), name), name)
                mine = x.clone()
                mpicomm.reduce(x, root=root, out=x, group=g)
                mpicomm.reduce(x, root=root, out=x, group=g)
                tot = reduce_np([vals(j, key, (4,), name) for j in range(n)], ReduceOp.SUM, name)
                if r == root:   # the root's second input is the first sum; the others' their own
                    check(x, tot + tot - vals(r, key, (4,), name), name)
                else:
                    assert torch.equal(x, mine)


@pytest.mark.parametrize("name", list(DTYPES))
def test_broadcast(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            for shape in [(), (5,), (2, 3, 4), (0, 3)]:
                key = f"bc{g}{root}{name}{shape}"
                x = tens(vals(r, key, shape, name), name)
                assert mpicomm.broadcast(x, root=root, group=g) is x
                check(x, vals(root, key, shape, name), name)
                y = tens(vals(r, key + "a", shape, name), name)
                assert mpicomm.broadcast(y, root=root, group=g, async_op=True).wait() is y
                check(y, vals(root, key + "a", shape, name), name)


# ---------------------------------------------------------------- gathers and scatters

@pytest.mark.parametrize("name", ["float32", "int32", "complex64", "bool", "bfloat16"])
def test_all_gather(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        key = f"ag{g}{name}"
        res = mpicomm.all_gather(tens(vals(r, key, (2, 3), name), name), group=g)
        parts = list(res.chunk(n))       # torch's tensor_list
        assert len(parts) == n
        for j in range(n):
            check(parts[j], vals(j, key, (2, 3), name), name)
        out = torch.empty(2 * n, 3, dtype=DTYPES[name])   # all_gather_into_tensor
        assert mpicomm.all_gather(tens(vals(r, key, (2, 3), name), name), out=out, group=g) is out
        check(out, np.concatenate([vals(j, key, (2, 3), name) for j in range(n)]), name)
        # uneven (torch's all_gather_v / tensor_list of different sizes): rank j has j + 1 rows
        want = np.concatenate([vals(j, key + "v", (j + 1, 3), name) for j in range(n)])
        mine = tens(vals(r, key + "v", (r + 1, 3), name), name)
        for sizes in ([j + 1 for j in range(n)], "auto"):
            check(mpicomm.all_gather(mine, sizes=sizes, group=g), want, name)


def test_gather(groups):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            key = f"ga{g}{root}"
            res = mpicomm.gather(tens(vals(r, key, (2, 2), "float64"), "float64"), root=root, group=g)
            if r == root:
                check(res, np.concatenate([vals(j, key, (2, 2), "float64") for j in range(n)]), "float64")
            else:
                assert res is None
            res = mpicomm.gather(tens(vals(r, key + "v", (r,), "int64"), "int64"), root=root, sizes="auto", group=g)
            if r == root:
                check(res, np.concatenate([vals(j, key + "v", (j,), "int64") for j in range(n)]), "int64")
            else:
                assert res is None


@pytest.mark.parametrize("name", ["float32", "complex64", "int64"])
def test_scatter(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            key = f"sc{g}{root}{name}"
            full = vals(root, key, (2 * n, 3), name)
            x = tens(full, name) if r == root else None
            out = torch.full((2, 3), 7, dtype=DTYPES[name])   # torch's output tensor
            res = mpicomm.scatter(x, root=root, out=None if r == root else out, group=g)
            check(res, full[2 * r:2 * r + 2], name)
            if r != root:
                assert res is out
            check(mpicomm.scatter(x, root=root, sizes="auto", group=g), full[2 * r:2 * r + 2], name)
            # uneven parts: rank j gets j + 1 rows
            sizes = [j + 1 for j in range(n)]
            fullv = vals(root, key + "v", (sum(sizes), 3), name)
            off = sum(sizes[:r])
            res = mpicomm.scatter(tens(fullv, name) if r == root else None, root=root, sizes=sizes,
                                  out=None if r == root else torch.empty(r + 1, 3, dtype=DTYPES[name]), group=g)
            check(res, fullv[off:off + r + 1], name)


@pytest.mark.parametrize("name", ["float32", "complex128", "int32"])
def test_all_to_all_single(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        key = f"a2a{g}{name}"
        # equal split: chunk j of rank i's input goes to rank j
        res = mpicomm.all_to_all(tens(vals(r, key, (3 * n, 2), name), name), group=g)
        check(res, np.concatenate([vals(j, key, (3 * n, 2), name)[3 * r:3 * r + 3] for j in range(n)]), name)
        # unequal split, torch's: rank i sends i + 1 + j rows to rank j
        ins = [r + 1 + j for j in range(n)]
        outs = [j + 1 + r for j in range(n)]
        x = tens(vals(r, key + "u", (sum(ins), 2), name), name)

        def part(j):   # what rank j sends to this rank
            sj = [j + 1 + k for k in range(n)]
            return vals(j, key + "u", (sum(sj), 2), name)[sum(sj[:r]):sum(sj[:r]) + sj[r]]
        want = np.concatenate([part(j) for j in range(n)])
        check(mpicomm.all_to_all(x, in_splits=ins, out_splits=outs, group=g), want, name)
        check(mpicomm.all_to_all(x, in_splits=ins, out_splits="auto", group=g), want, name)
        out = torch.empty(sum(outs), 2, dtype=DTYPES[name])
        assert mpicomm.all_to_all(x, out=out, in_splits=ins, out_splits=outs, group=g) is out
        check(out, want, name)


@pytest.mark.parametrize("name", ["float32", "int64", "float16"])
def test_reduce_scatter_tensor(groups, name):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for op in ops_of(name):
            key = f"rs{g}{name}{op}"
            tot = reduce_np([vals(j, key, (2 * n, 3), name, op) for j in range(n)], op, name)
            check(mpicomm.reduce_scatter(tens(vals(r, key, (2 * n, 3), name, op), name), op, group=g),
                  tot[2 * r:2 * r + 2], name, op)
        sizes = [j % 2 + 1 for j in range(n)]   # uneven chunks (torch's reduce_scatter of a list)
        key = f"rsv{g}{name}"
        tot = reduce_np([vals(j, key, (sum(sizes), 2), name) for j in range(n)], ReduceOp.SUM, name)
        off = sum(sizes[:r])
        check(mpicomm.reduce_scatter(tens(vals(r, key, (sum(sizes), 2), name), name), sizes=sizes, group=g),
              tot[off:off + sizes[r]], name)


# ---------------------------------------------------------------- barrier

def test_barrier(groups, tmp_path_factory):
    """No rank leaves a barrier before every rank of the group has entered it: each writes
    a file just before it, and after it every file of the group is there."""
    root = mpicomm.broadcast_object(str(tmp_path_factory.mktemp("barrier")) if mpicomm.get_rank() == 0 else None)
    me = mpicomm.get_rank()
    for k, (g, ranks) in enumerate(groups):
        for how in ("sync", "async"):
            d = os.path.join(root, f"{k}{how}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, str(me)), "w") as f:
                f.write("in")
            if how == "sync":
                assert mpicomm.barrier(group=g) is None
            else:
                mpicomm.barrier(group=g, async_op=True).wait()
            assert sorted(os.listdir(d)) == sorted(str(w) for w in ranks)


# ---------------------------------------------------------------- point to point

def test_send_recv(comm):
    """test_send_recv: each rank in turn sends to every other rank."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for src in range(n):
        for dst in range(n):
            if dst == src:
                continue
            key = f"sr{src}{dst}"
            if r == src:
                mpicomm.send(torch.from_numpy(vals(src, key, (3, 2), "float64")), dst)
            elif r == dst:
                out = torch.full((3, 2), -1.0, dtype=torch.float64)
                assert mpicomm.recv(out, src) is out
                check(out, vals(src, key, (3, 2), "float64"), "float64")


def test_send_recv_with_tag(comm):
    """test_send_recv_with_tag: messages of several tags, received in the reverse order."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    if n == 1:
        return
    works = [mpicomm.send(torch.from_numpy(vals(r, f"tag{t}", (4,), "int64")), nxt, tag=t, async_op=True)
             for t in range(1, 4)]
    for t in (3, 2, 1):
        out = torch.zeros(4, dtype=torch.int64)
        mpicomm.recv(out, prv, tag=t)
        check(out, vals(prv, f"tag{t}", (4,), "int64"), "int64")
    for w in works:
        w.wait()


def test_recv_any_source_is_refused(comm):
    """torch's recv(src=None) takes any source; mpicomm has no wildcard and refuses it, and a
    negative tag (MPI's ANY_TAG) too, before anything is sent."""
    with pytest.raises(InvalidArgumentError, match=r"invalid src=None: expected a group rank in 0\.\."):
        mpicomm.recv(torch.zeros(1), None)
    with pytest.raises(InvalidArgumentError, match=r"invalid tag=-1.*never a wildcard"):
        mpicomm.recv(torch.zeros(1), 0, tag=-1)


def test_isend_irecv(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    out = torch.zeros(5)
    rw = mpicomm.recv(out, prv, async_op=True)
    sw = mpicomm.send(torch.from_numpy(vals(r, "isend", (5,), "float32")), nxt, async_op=True)
    assert rw.wait() is out
    sw.wait()
    assert rw.is_completed() and sw.is_completed()
    check(out, vals(prv, "isend", (5,), "float32"), "float32")


def test_batch_isend_irecv_ring_and_self(groups):
    """test_batch_isend_irecv_ring_exchange, _self, _no_rank_zero (the reversed sub-group
    leaves world rank 0 out from 3 ranks on)."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        nxt, prv = (r + 1) % n, (r - 1) % n
        a, b, me = torch.zeros(3), torch.zeros(3), torch.zeros(3)
        ops = [mpicomm.P2POp(mpicomm.send, torch.from_numpy(vals(r, f"bn{g}", (3,), "float32")), nxt, group=g),
               mpicomm.P2POp(mpicomm.send, torch.from_numpy(vals(r, f"bp{g}", (3,), "float32")), prv, group=g),
               mpicomm.P2POp(mpicomm.recv, a, prv, group=g),
               mpicomm.P2POp(mpicomm.recv, b, nxt, group=g),
               mpicomm.P2POp("isend", torch.from_numpy(vals(r, f"bs{g}", (3,), "float32")), r, group=g),
               mpicomm.P2POp("irecv", me, r, group=g)]
        works = mpicomm.batch_isend_irecv(ops)
        assert len(works) == len(ops) and all(w.is_completed() for w in works)
        check(a, vals(prv, f"bn{g}", (3,), "float32"), "float32")
        check(b, vals(nxt, f"bp{g}", (3,), "float32"), "float32")
        check(me, vals(r, f"bs{g}", (3,), "float32"), "float32")


def test_batch_mixed_with_collectives(groups):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        buf = torch.zeros(4, dtype=torch.int64)
        with mpicomm.batch(group=g) as bt:
            mpicomm.recv(buf, (r - 1) % n, group=g)
            w = mpicomm.all_reduce(torch.from_numpy(vals(r, f"bm{g}", (2,), "int64")), group=g)
            mpicomm.send(torch.from_numpy(vals(r, f"bx{g}", (4,), "int64")), (r + 1) % n, group=g)
        assert len(bt.works) == 3
        check(buf, vals((r - 1) % n, f"bx{g}", (4,), "int64"), "int64")
        check(w.wait(), reduce_np([vals(j, f"bm{g}", (2,), "int64") for j in range(n)], ReduceOp.SUM, "int64"),
              "int64")


@pytest.mark.parametrize("ops, msg", [
    ([], r"invalid ops=\[\]: expected a non-empty list of mpicomm.P2POp"),
    ("send", r"expected a non-empty list of mpicomm.P2POp"),
    ([1], r"expected a non-empty list of mpicomm.P2POp"),
])
def test_batch_isend_irecv_op_list_err(comm, ops, msg):
    with pytest.raises(InvalidArgumentError, match=msg):
        mpicomm.batch_isend_irecv(ops)


def test_batch_isend_irecv_op_err(comm):
    with pytest.raises(InvalidArgumentError, match=r"invalid op=<built-in function print>|invalid op="):
        mpicomm.P2POp(print, torch.zeros(1), 0)
    with pytest.raises(InvalidArgumentError, match=r"invalid op='broadcast'"):
        mpicomm.P2POp("broadcast", torch.zeros(1), 0)


# ---------------------------------------------------------------- new_group

def test_new_group_semantics(comm):
    """Groups of several rank sets (in any order), made by every rank with the same arguments
    (torch's new_group rule). A member's collectives reduce over the members only, in group
    rank order; a rank outside the group is refused (torch: a warning, and None / -1)."""
    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    sets = {"ptd_all": list(range(n)), "ptd_first": [0], "ptd_last": [n - 1],
            "ptd_even": list(range(0, n, 2)), "ptd_odd_rev": list(range(n - 1, 0, -2)) or [0],
            "ptd_perm": [(2 * k + 1) % n for k in range(n)] if n % 2 else list(range(n))[::-1]}
    for name, ranks in sets.items():
        if name not in mpicomm._state.CTX.groups:   # (once: the test may run again in one job)
            mpicomm.create_group(name, ranks)
    for name, ranks in sets.items():
        if me in ranks:
            gr = ranks.index(me)
            assert mpicomm.get_rank(name) == gr and mpicomm.get_group_size(name) == len(ranks)
            assert [mpicomm.get_world_rank_from_group_rank(name, i) for i in range(len(ranks))] == ranks
            assert mpicomm.get_group_rank_from_world_rank(me, name) == gr
            key = f"ng{name}"
            got = mpicomm.all_reduce(torch.from_numpy(vals(me, key, (3,), "int64")), group=name)
            check(got, reduce_np([vals(w, key, (3,), "int64") for w in ranks], ReduceOp.SUM, "int64"), "int64")
            got = mpicomm.all_gather(torch.from_numpy(vals(me, key, (1,), "int64")), group=name)
            check(got, np.concatenate([vals(w, key, (1,), "int64") for w in ranks]), "int64")   # group rank order
            b = torch.from_numpy(vals(me, key + "b", (2,), "int64"))
            mpicomm.broadcast(b, root=len(ranks) - 1, group=name)
            check(b, vals(ranks[-1], key + "b", (2,), "int64"), "int64")
        else:
            with pytest.raises(InvalidArgumentError, match=rf"invalid group='{name}': expected a group this "
                               rf"rank belongs to \(world rank {me} is not in"):
                mpicomm.all_reduce(torch.ones(1), group=name)
            with pytest.raises(InvalidArgumentError, match="expected a group this rank belongs to"):
                mpicomm.get_rank(name)
    # the world still in step
    check(mpicomm.all_reduce(torch.ones(2, dtype=torch.int64)), np.full(2, n), "int64")


# ---------------------------------------------------------------- non-contiguous tensors

def views(a):
    """Non-contiguous views of tensor ``a``'s values (shape (R, C)): a transpose of a copy, a
    strided slice of a larger tensor, and an offset slice of rows."""
    R, C = a.shape
    t = a.t().contiguous().t()                   # same values, column-major
    big = torch.zeros(R, 2 * C, dtype=a.dtype)
    big[:, ::2] = a
    s = big[:, ::2]                              # every other column
    pad = torch.zeros(R + 2, C + 1, dtype=a.dtype)
    pad[1:R + 1, 1:] = a
    o = pad[1:R + 1, 1:]                         # storage offset, row stride C + 1
    for v in (t, s, o):
        assert not v.is_contiguous() and torch.equal(v, a)
    return {"transposed": t, "strided": s, "offset": o}


@pytest.mark.parametrize("kind", ["transposed", "strided", "offset"])
def test_noncontiguous_input(groups, kind):
    """c10d gloo's test_allgather_noncontiguous_input, for every collective: the input's
    values are used (torch's gloo copies them too), and the input is not changed."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        key = f"nc{g}{kind}"
        every = [vals(j, key, (2 * n, 3), "float32") for j in range(n)]
        x = views(tens(every[r], "float32"))[kind]
        keep = x.clone()
        tot = reduce_np(every, ReduceOp.SUM, "float32")
        check(mpicomm.all_reduce(x, group=g), tot, "float32")
        check(mpicomm.all_gather(x, group=g), np.concatenate(every), "float32")
        check(mpicomm.reduce_scatter(x, group=g), tot[2 * r:2 * r + 2], "float32")
        check(mpicomm.all_to_all(x, group=g), np.concatenate([e[2 * r:2 * r + 2] for e in every]), "float32")
        for root in range(n):
            res = mpicomm.reduce(x, root=root, group=g)
            if r == root:
                check(res, tot, "float32")
            res = mpicomm.gather(x, root=root, group=g)
            if r == root:
                check(res, np.concatenate(every), "float32")
            check(mpicomm.scatter(x, root=root, sizes="auto", group=g), every[root][2 * r:2 * r + 2], "float32")
        assert torch.equal(x, keep)
        if n > 1:
            out = torch.zeros(2 * n, 3)
            check(mpicomm.sendrecv(x, (r + 1) % n, out=out, src=(r - 1) % n, group=g), every[(r - 1) % n],
                  "float32")


@pytest.mark.parametrize("kind", ["transposed", "strided", "offset"])
def test_noncontiguous_write_targets(groups, kind):
    """broadcast into a non-contiguous view and all_reduce/reduce in place (out=x) on one
    fill that view (the rest of its storage untouched); a non-contiguous out= other than x
    is refused on every rank, before anything moves."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            key = f"ncw{g}{kind}{root}"
            base = torch.from_numpy(vals(r, key + "base", (6, 8), "float32"))
            keep = base.clone()
            v = {"transposed": base[:4, :3].t(), "strided": base[:3, ::2], "offset": base[1:4, 2:6]}[kind]
            v.copy_(tens(vals(r, key, tuple(v.shape), "float32"), "float32"))
            mask = torch.ones_like(base, dtype=torch.bool)
            {"transposed": lambda: mask[:4, :3].fill_(False), "strided": lambda: mask[:3, ::2].fill_(False),
             "offset": lambda: mask[1:4, 2:6].fill_(False)}[kind]()
            assert mpicomm.broadcast(v, root=root, group=g) is v
            check(v, vals(root, key, tuple(v.shape), "float32"), "float32")
            assert torch.equal(base[mask], keep[mask])
        key = f"ncw{g}{kind}ar"
        base = torch.zeros(6, 8)
        v = {"transposed": base[:4, :3].t(), "strided": base[:3, ::2], "offset": base[1:4, 2:6]}[kind]
        v.copy_(tens(vals(r, key, tuple(v.shape), "float32"), "float32"))
        assert mpicomm.all_reduce(v, out=v, group=g) is v
        check(v, reduce_np([vals(j, key, tuple(v.shape), "float32") for j in range(n)], ReduceOp.SUM, "float32"),
              "float32")
        x = torch.ones(4, 3)
        with pytest.raises(InvalidArgumentError, match=r"invalid out='non-contiguous tensor': expected a "
                           r"contiguous tensor"):
            mpicomm.all_reduce(x, out=torch.zeros(3, 4).t(), group=g)
        with pytest.raises(InvalidArgumentError, match=r"invalid out='non-contiguous tensor'"):
            mpicomm.all_gather(x, out=torch.zeros(3, 4 * n).t(), group=g)
        check(mpicomm.all_reduce(x, group=g), np.full((4, 3), n, np.float32), "float32")   # in step


def test_self_overlapping_write_targets_are_refused_everywhere(groups):
    """A write target whose elements share memory (torch's expand(), NumPy's writable
    as_strided) cannot hold a result: broadcast into one, or all_reduce in place on one, is
    refused with InvalidArgumentError on every rank, before anything moves (torch's gloo
    refuses it as non-contiguous). Before, broadcast wrote into it on the root's peers only
    and failed there after the call (torch) or kept one value per location (NumPy), and the
    job ended."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            e = torch.from_numpy(vals(r, f"ov{g}{root}", (2, 1), "float32")).expand(2, 3)
            with pytest.raises(InvalidArgumentError, match=r"invalid x=\"a tensor whose elements share memory "
                               r"\(stride 0 along an axis of length > 1.*strides \(1, 0\)\)\": expected an array "
                               r"with one memory location per element"):
                mpicomm.broadcast(e, root=root, group=g)
        with pytest.raises(InvalidArgumentError, match=r"invalid out=\"a tensor whose elements share memory"):
            mpicomm.all_reduce(e, out=e, group=g)
        # the values of an expanded tensor are fine as input
        check(mpicomm.all_reduce(e, group=g),
              np.repeat(reduce_np([vals(j, f"ov{g}{n - 1}", (2, 1), "float32") for j in range(n)], ReduceOp.SUM,
                                  "float32"), 3, axis=1), "float32")
        # on one rank only (the root, so that no rank has returned): that rank's error there,
        # RefusedElsewhereError naming it on the others; the group goes on in step
        for root in range(n):
            a = torch.from_numpy(vals(r, f"ov1{g}{root}", (3,), "float32"))
            if r == root:
                bad = np.lib.stride_tricks.as_strided(a.numpy(), shape=(2, 3), strides=(0, 4))
                with pytest.raises(InvalidArgumentError, match=r"invalid x=\"a view whose elements share memory"):
                    mpicomm.broadcast(bad, root=root, group=g)
            else:
                with pytest.raises(RefusedElsewhereError, match=rf"^rank {ranks[root]}( \(rank {root} of group '{g}'\))? refused broadcast"):
                    mpicomm.broadcast(np.zeros((2, 3), np.float32), root=root, group=g)
            check(mpicomm.all_reduce(torch.ones(2), group=g), np.full(2, n, np.float32), "float32")


def test_conj_views(groups):
    """A conjugate view (x.conj()) is its values, as input and as broadcast's target; a
    negative view (.imag of a conjugate) as input. torch.distributed raises for both (its
    view_as_real refuses them); mpicomm used to raise torch's RuntimeError."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        every = [vals(j, f"cj{g}", (4,), "complex64") for j in range(n)]
        x = torch.from_numpy(every[r])
        check(mpicomm.all_reduce(x.conj(), group=g), np.conj(sum(e.astype(np.complex128) for e in every)),
              "complex64")
        check(mpicomm.all_reduce(x.conj().imag, group=g), -sum(e.imag.astype(np.float64) for e in every), "float32")
        for root in range(n):
            y = torch.from_numpy(vals(r, f"cjb{g}{root}", (4,), "complex64"))
            v = y.conj()
            mpicomm.broadcast(v, root=root, group=g)   # the root's view's values: conj(y_root)
            check(v, np.conj(vals(root, f"cjb{g}{root}", (4,), "complex64")), "complex64")
            check(y, vals(root, f"cjb{g}{root}", (4,), "complex64"), "complex64")
        with pytest.raises(InvalidArgumentError, match=r"invalid out='a tensor with its conjugate bit set'"):
            mpicomm.all_reduce(x, out=torch.zeros(4, dtype=torch.complex64).conj(), group=g)


# ---------------------------------------------------------------- calls that differ per rank

def test_calls_that_differ_per_rank(comm):
    """Tensors of another dtype (of the same size) on one rank (torch: undefined, often a hang or
    garbage): CollectiveMismatchError on every rank, naming both calls; the next call in step."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    dt = torch.int32 if r == 0 else torch.float32   # the same bytes: only the check can tell
    calls = {"all_reduce": lambda: mpicomm.all_reduce(torch.ones(2 * n, dtype=dt)),
             "all_gather": lambda: mpicomm.all_gather(torch.ones(2 * n, dtype=dt)),
             "reduce_scatter": lambda: mpicomm.reduce_scatter(torch.ones(2 * n, dtype=dt)),
             "all_to_all": lambda: mpicomm.all_to_all(torch.ones(2 * n, dtype=dt))}
    # (not here: calls of another byte count on one rank, whose MPI call may wait: the job ends
    # with the difference named, as docs/RELIABILITY.md says; nor root-based calls, where a rank
    # may leave before the difference is found)
    for name, call in calls.items():
        if n == 1:
            call()
            continue
        with pytest.raises(CollectiveMismatchError, match=r"the ranks called differently: .*differs in dtype"):
            call()
        check(mpicomm.all_reduce(torch.ones(3)), np.full(3, n, np.float32), "float32")


@pytest.mark.parametrize("kind, msg", [
    ("meta", r"invalid x='a tensor on device meta': expected a CPU tensor"),
    ("sparse", r"invalid x='a sparse_coo tensor': expected a dense \(torch.strided\) tensor"),
    ("float8", r"invalid x='a tensor of dtype float8_e4m3fn.*expected a tensor of one of the dtypes int8"),
])
def test_unsupported_tensor_on_one_rank(comm, kind, msg):
    """A tensor mpicomm cannot send (another device, sparse, a dtype it has no row for) on the
    last rank only: InvalidArgumentError naming x there, RefusedElsewhereError naming that rank
    on the others (torch's own error type before, on that rank)."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    bad = {"meta": lambda: torch.ones(2, device="meta"), "sparse": lambda: torch.ones(2).to_sparse(),
           "float8": lambda: torch.ones(2).to(torch.float8_e4m3fn)}[kind]
    if r == n - 1:
        with pytest.raises(InvalidArgumentError, match=msg):
            mpicomm.all_reduce(bad())
    else:
        with pytest.raises(RefusedElsewhereError, match=rf"rank {n - 1} refused all_reduce .*{msg}"):
            mpicomm.all_reduce(torch.ones(2))
    check(mpicomm.all_reduce(torch.ones(3)), np.full(3, n, np.float32), "float32")
    with pytest.raises(InvalidArgumentError, match=msg.replace("invalid x=", "invalid out=")):
        mpicomm.sendrecv(torch.ones(2), r, out=bad())


# ---------------------------------------------------------------- DistributedDataParallel

LOCAL_B, ITERS = 4, 6


class TorchNet(torch.nn.Module):
    """distributed_test's _FC2/Net: fc1 2->10, fc2 10->50 (bias off), fc3 50->4, softmax."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(2, 10, bias=False)
        self.fc2 = torch.nn.Linear(10, 50, bias=True)
        self.fc2.bias.requires_grad_(True)
        self.fc3 = torch.nn.Linear(50, 4, bias=False)
        self.no_grad_param = torch.nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.is_floating_point():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.softmax(self.fc3(x), dim=1)


def _batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ITERS, n * LOCAL_B, 2, generator=g)
    y = torch.randn(ITERS, n * LOCAL_B, 4, generator=g)
    perms = [torch.randperm(n * LOCAL_B, generator=g) for _ in range(ITERS)]   # _test_DDP_niter's shuffle
    return x, y, perms


def _params_equal(a, b, **tol):
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=k, **(tol or dict(rtol=1e-6, atol=1e-7)))


def test_DistributedDataParallel(comm):
    """_test_DDP_niter: each iteration DDP on this rank's slice of a shuffled global batch
    equals one process on the whole batch (MSE loss, SGD); the wrapper saved with torch.save
    and loaded again mid-run (test_save) goes on alike."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    torch.manual_seed(0)
    model = mt.DistributedDataParallel(TorchNet(seed=40 + r), bucket_cap_mb=1e-4)   # rank 0's weights
    ref = TorchNet(seed=40)
    _params_equal(model.module, ref, rtol=0, atol=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    x, y, perms = _batches(n)
    for k in range(ITERS):
        if k == 2:   # test_save: a copy through torch.save/torch.load trains on from here
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            model = torch.load(buf, weights_only=False)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        xs, ys = x[k][perms[k]], y[k][perms[k]]
        s = slice(r * LOCAL_B, (r + 1) * LOCAL_B)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[s]), ys[s]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
        _params_equal(model.module, ref)
    assert torch.equal(model.module.no_grad_param, torch.tensor([2, 2]))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulate_gradients_no_sync(comm, set_to_none):
    """_test_accumulate_gradients_no_sync (and _grad_is_view): 2 iterations of 3 microbatches,
    the first two under no_sync: the gradients are this rank's own sums there, the third
    backward reduces the mean over ranks of the accumulated sums; p.grad stays a view of its
    bucket all along."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    model = mt.DistributedDataParallel(TorchNet(seed=50))
    x, y, _ = _batches(n, seed=6)
    loss = torch.nn.functional.mse_loss

    def grads(q, steps):   # rank q's local accumulated gradients, independently
        m = TorchNet(seed=50)
        for k in steps:
            s = slice(q * LOCAL_B, (q + 1) * LOCAL_B)
            loss(m(x[k][s]), y[k][s]).backward()
        return [p.grad.clone() for p in m.parameters() if p.requires_grad]

    ptrs = None
    for it in range(2):
        model.zero_grad(set_to_none=set_to_none)
        steps = [3 * it, 3 * it + 1, 3 * it + 2]
        s = slice(r * LOCAL_B, (r + 1) * LOCAL_B)
        with model.no_sync():
            for k in steps[:2]:
                loss(model(x[k][s]), y[k][s]).backward()
        for p, want in zip([p for p in model.module.parameters() if p.requires_grad], grads(r, steps[:2])):
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-8)
        loss(model(x[steps[2]][s]), y[steps[2]][s]).backward()
        every = [grads(q, steps) for q in range(n)]
        params = [p for p in model.module.parameters() if p.requires_grad]
        for i, p in enumerate(params):
            torch.testing.assert_close(p.grad, sum(e[i] for e in every) / n, rtol=1e-6, atol=1e-8)
        now = [p.grad.data_ptr() for p in params]
        views = [model._views[model.parameter_names.index(k)].data_ptr()
                 for k, p in model.module.named_parameters() if p.requires_grad]
        assert now == views   # gradient_as_bucket_view: the grads are the buckets' views
        if ptrs is not None and not set_to_none:
            assert now == ptrs
        ptrs = now


class Branchy(torch.nn.Module):
    """A trunk and two heads; a step uses one head per rank, and ``spare`` never."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.trunk = torch.nn.Linear(3, 6)
        self.a = torch.nn.Linear(6, 2)
        self.b = torch.nn.Linear(6, 2)
        self.spare = torch.nn.Linear(6, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.head = "a"

    def forward(self, x):
        return getattr(self, self.head)(torch.tanh(self.trunk(x)))


def test_find_unused_parameters(comm):
    """test_ddp_unused_params / test_find_unused_parameters_kwarg: with find_unused_parameters
    a parameter some ranks leave out gets the mean of the others' gradients (as zeros from
    the ranks that left it out); one no rank used keeps .grad None, so SGD with momentum and
    weight decay leaves it untouched. 3 steps against one process simulating every rank."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    model = mt.DistributedDataParallel(Branchy(seed=60), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref = Branchy(seed=60)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(3, n * 2, 3, generator=g), torch.randn(3, n * 2, 2, generator=g)

    def head(q, k):   # step 0: every rank uses a; then rank q uses a or b by (q + k) % 2
        return "a" if k == 0 else "ab"[(q + k) % 2]
    spare0 = [p.detach().clone() for p in model.module.spare.parameters()]
    for k in range(3):
        model.module.head = head(r, k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[k, 2 * r:2 * r + 2]), y[k, 2 * r:2 * r + 2]).backward()
        opt.step()
        # the reference: every rank's local gradient from the reference's weights, meaned
        sums, used = {}, set()
        for q in range(n):
            m = copy.deepcopy(ref)
            m.zero_grad(set_to_none=True)
            m.head = head(q, k)
            torch.nn.functional.mse_loss(m(x[k, 2 * q:2 * q + 2]), y[k, 2 * q:2 * q + 2]).backward()
            for name, p in m.named_parameters():
                if p.grad is not None:
                    used.add(name)
                    sums[name] = sums.get(name, 0) + p.grad
        ref_opt.zero_grad(set_to_none=True)
        for name, p in ref.named_parameters():
            p.grad = sums[name] / n if name in used else None
        ref_opt.step()
        for name, p in model.module.named_parameters():
            assert (p.grad is None) == (name not in used), name
        _params_equal(model.module, ref)
    for p, q in zip(model.module.spare.parameters(), spare0):
        assert torch.equal(p.detach(), q)


def test_buffers_broadcast_from_rank_0(comm):
    """test_ddp_broadcast_buffer / BatchNorm running stats: every forward that will be
    synchronised starts from rank 0's buffers (taken at construction too), then updates them
    with this rank's batch; broadcast_buffers=False keeps each rank's own. As in DDP, the first
    forward after a synchronised one broadcasts whatever it is (an evaluation under no_grad
    sees rank 0's statistics), and a forward after an unsynchronised one does not."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    mom = 0.1

    def make(q):
        torch.manual_seed(70)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, momentum=mom))
        with torch.no_grad():   # rank-dependent stats before wrapping
            m[1].running_mean.copy_(torch.arange(4.) + 10 * q)
            m[1].running_var.fill_(1.0 + q)
        return m

    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, n * 5, 3, generator=g)
    lin = make(0)[0]

    def stats(prev_mean, prev_var, q, k):   # BN's update with rank q's batch k, in NumPy
        h = lin(x[k, 5 * q:5 * q + 5]).detach().double().numpy()
        return ((1 - mom) * prev_mean + mom * h.mean(0), (1 - mom) * prev_var + mom * h.var(0, ddof=1))

    for bcast in (True, False):
        m = make(r)
        model = mt.DistributedDataParallel(m, broadcast_buffers=bcast)
        mean0, var0 = np.arange(4.), np.ones(4)           # rank 0's, taken by everyone
        own_m, own_v = mean0, var0
        for k in range(3):
            with torch.no_grad():
                m[0].weight.copy_(lin.weight)
                m[0].bias.copy_(lin.bias)
            model(x[k, 5 * r:5 * r + 5])
            if bcast:
                want = stats(mean0, var0, r, k)
                mean0, var0 = stats(mean0, var0, 0, k)
            else:
                want = own_m, own_v = stats(own_m, own_v, r, k)
            np.testing.assert_allclose(m[1].running_mean.double().numpy(), want[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(m[1].running_var.double().numpy(), want[1], rtol=1e-5, atol=1e-6)
            assert int(m[1].num_batches_tracked) == k + 1
        before = m[1].running_mean.clone()
        m.eval()
        with torch.no_grad():
            model(x[0, :2])   # eval: no update; after a synchronised forward, rank 0's buffers first
        if bcast:
            np.testing.assert_allclose(m[1].running_mean.double().numpy(), mean0, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(m[1].running_var.double().numpy(), var0, rtol=1e-5, atol=1e-6)
            assert n == 1 or r == 0 or not torch.equal(m[1].running_mean, before)
        else:
            assert torch.equal(m[1].running_mean, before)
        with torch.no_grad():   # rank r's own statistics again: the next forward follows an
            m[1].running_mean.copy_(before)   # unsynchronised one, so nothing is broadcast
            model(x[0, :2])
        assert torch.equal(m[1].running_mean, before)


def test_gradient_as_bucket_view_keyword(comm):
    """DDP(..., gradient_as_bucket_view=True) is torch's call form: accepted (mpicomm's
    gradients are always views of their buckets), and a value that is not a bool refused."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for flag in (True, False):
        model = mt.DistributedDataParallel(TorchNet(seed=80), gradient_as_bucket_view=flag)
        x, y, _ = _batches(n, seed=9)
        s = slice(r * LOCAL_B, (r + 1) * LOCAL_B)
        torch.nn.functional.mse_loss(model(x[0][s]), y[0][s]).backward()
        ref = TorchNet(seed=80)
        torch.nn.functional.mse_loss(ref(x[0]), y[0]).backward()
        for (k, p), q in zip(model.module.named_parameters(), ref.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)   # (float32 sums)
                assert p.grad.data_ptr() == model._views[model.parameter_names.index(k)].data_ptr()
    with pytest.raises(InvalidArgumentError, match=r"invalid gradient_as_bucket_view='yes': expected True or False"):
        mt.DistributedDataParallel(TorchNet(seed=80), gradient_as_bucket_view="yes")


def test_state_dict(comm):
    """DDP's state_dict: the module's under the prefix ``module.``, the same tensors; after
    training, bit for bit the same on every rank; loads into a plain model (after
    consume_prefix_in_state_dict_if_present) and into another wrapper."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    model = mt.DistributedDataParallel(TorchNet(seed=90 + r))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y, _ = _batches(n, seed=10)
    s = slice(r * LOCAL_B, (r + 1) * LOCAL_B)
    for k in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[k][s]), y[k][s]).backward()
        opt.step()
    sd, inner = model.state_dict(), model.module.state_dict()
    assert list(sd) == ["module." + k for k in inner]
    for k, v in inner.items():
        assert sd["module." + k].data_ptr() == v.data_ptr()
    flat = torch.cat([v.double().flatten() for v in sd.values()])
    every = mpicomm.all_gather(flat.unsqueeze(0))
    for q in range(n):
        assert torch.equal(every[q], flat)
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    plain = TorchNet(seed=1)
    plain.load_state_dict(sd)
    torch.testing.assert_close(plain(x[0]), model.module(x[0]), rtol=0, atol=0)
    other = mt.DistributedDataParallel(TorchNet(seed=2))
    other.load_state_dict(model.state_dict())
    _params_equal(other.module, model.module, rtol=0, atol=0)
