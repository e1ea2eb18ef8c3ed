"""Cases ported onto mpicomm's API from the test suites of the libraries users come from.

- mpi4py's test/test_cco_buf.py (TestCCOBufBase, TestCCOBufInplaceBase): Bcast, Allgather,
  Alltoall, Reduce and Allreduce on array.array and NumPy buffers of typecodes h (int16),
  i, l, f, d and, on NumPy only (array.array has no bool), ? (bool: SUM and MAX are logical
  OR, PROD and MIN logical AND, as torch.distributed reduces bool), for every root, with
  counts that depend on the root (zero included), and their in-place forms (MPI.IN_PLACE:
  Allgather, Reduce on the root, Allreduce). mpi4py fills buffers with constants and
  range(size); here each rank's data is random and seeded by its rank, and the expectation
  is computed from every rank's data. A typecode mpicomm does not support (long double 'g',
  unicode 'u') must be refused on every rank.
- torch.distributed's in-place tests (test_c10d_common / distributed_test): all_reduce in
  place, all_gather_into_tensor with the input a slice of the output, reduce_scatter_tensor
  into a slice of the input; and the *_object collectives on the objects torch uses (dicts,
  strings, nested lists, None, an instance of a user class).
Run on the world and on a reversed sub-group.
"""
import array
import zlib

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp
from conftest import reversed_group

pytestmark = pytest.mark.mpi

TYPECODES = {"h": np.int16, "i": np.int32, "l": np.int64, "f": np.float32, "d": np.float64, "?": np.bool_}
OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN]


@pytest.fixture(scope="module")
def groups(comm):
    sub = reversed_group("port_rev")
    return [(None, list(range(mpicomm.get_group_size())))] + ([("port_rev", sub)] if mpicomm.get_rank() in sub else [])


def vals(r, key, count, tc, op=ReduceOp.SUM):
    """Group rank r's values: small integers (sums and products exact in every typecode)."""
    g = np.random.default_rng([r, zlib.crc32(key.encode())])
    if tc == "?":   # True and False, whatever the op
        return g.integers(0, 2, count).astype(bool)
    v = g.choice([1, 2, -1], count) if op is ReduceOp.PROD else g.integers(-30, 31, count)
    return v.astype(TYPECODES[tc])


def make(kind, tc, v):
    return array.array(tc, v.tolist()) if kind == "array" else np.array(v, dtype=TYPECODES[tc])


def as_np(kind, tc, a):
    return np.frombuffer(a, dtype=TYPECODES[tc]) if kind == "array" else a


def reduce_all(arrs, op):
    s = np.stack(arrs)
    if s.dtype == np.bool_:   # logical OR (SUM, MAX) and AND (PROD, MIN)
        return (np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and).reduce(s, axis=0)
    return {ReduceOp.SUM: s.sum(0), ReduceOp.PROD: s.prod(0), ReduceOp.MAX: s.max(0),
            ReduceOp.MIN: s.min(0)}[op].astype(arrs[0].dtype)


KINDS = ["array", "numpy"]
KIND_TC = [(k, tc) for k in KINDS for tc in TYPECODES if not (k == "array" and tc == "?")]   # no array('?')


def other(tc, v):
    """What a receiver's buffer starts as: -1 (mpi4py's), for bool the opposite of v."""
    return ~v if tc == "?" else np.full(len(v), -1, TYPECODES[tc])


# ----------------------------------------------------------- mpi4py: TestCCOBufBase

@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_bcast(groups, kind, tc):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            key = f"bc{g}{root}"
            buf = make(kind, tc, vals(root, key, root, tc) if r == root else other(tc, vals(root, key, root, tc)))
            res = mpicomm.broadcast(buf, root=root, group=g)
            assert res is buf
            np.testing.assert_array_equal(as_np(kind, tc, buf), vals(root, key, root, tc))


@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_allgather(groups, kind, tc):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):        # count = root, as mpi4py's (0 at root 0)
            key = f"ag{g}{root}"
            res = mpicomm.all_gather(make(kind, tc, vals(r, key, root, tc)), group=g)
            exp = np.concatenate([vals(j, key, root, tc) for j in range(n)])
            np.testing.assert_array_equal(np.asarray(res).reshape(-1), exp)


@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_alltoall(groups, kind, tc):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):        # count = root * size
            key = f"a2a{g}{root}"
            res = mpicomm.all_to_all(make(kind, tc, vals(r, key, root * n, tc)), group=g)
            exp = np.concatenate([vals(j, key, root * n, tc)[r * root:(r + 1) * root] for j in range(n)])
            np.testing.assert_array_equal(np.asarray(res).reshape(-1), exp)


@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_reduce(groups, kind, tc):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            for op in OPS:
                key = f"red{g}{root}{op}"
                x = make(kind, tc, vals(r, key, n, tc, op))
                res = mpicomm.reduce(x, op, root=root, group=g)
                if r == root:
                    exp = reduce_all([vals(j, key, n, tc, op) for j in range(n)], op)
                    np.testing.assert_array_equal(np.asarray(res).reshape(-1), exp)
                else:
                    assert res is None
                np.testing.assert_array_equal(as_np(kind, tc, x), vals(r, key, n, tc, op))  # input kept


@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_allreduce(groups, kind, tc):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for op in OPS:
            key = f"ar{g}{op}"
            res = mpicomm.all_reduce(make(kind, tc, vals(r, key, n, tc, op)), op, group=g)
            exp = reduce_all([vals(j, key, n, tc, op) for j in range(n)], op)
            np.testing.assert_array_equal(np.asarray(res).reshape(-1), exp)


@pytest.mark.parametrize("kind", KINDS)
def test_unsupported_typecode_refused_everywhere(comm, kind):
    """A typecode mpicomm has no dtype for: unicode ('u', array.array) and long double ('g',
    NumPy's float128 where it is wider than float64); refused on every rank, naming the
    dtype and the supported ones (mpi4py's 'h' and '?' are ported above)."""
    from test_errors import raises_everywhere

    if kind == "array":
        x = array.array("u", "abc")
    elif np.dtype(np.longdouble).itemsize > 8:
        x = np.array([1, 2, 3], np.longdouble)
    else:  # pragma: no cover - long double is float64 here
        pytest.skip("long double is float64 on this platform")
    name = np.asarray(memoryview(x)).dtype.name if kind == "array" else x.dtype.name
    for f in (lambda: mpicomm.all_reduce(x), lambda: mpicomm.broadcast(x, root=0)):
        raises_everywhere(InvalidArgumentError, f, f"invalid x.dtype='{name}'", "int16, uint16", "bool")


# ----------------------------------------------------------- mpi4py: TestCCOBufInplaceBase

@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_allgather_in_place(groups, kind, tc):
    """Allgather(MPI.IN_PLACE, buf): this rank's part already in buf -> all_gather(part, out=buf)."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for count in range(1, 10):
            key = f"agi{g}{count}"
            init = other(tc, np.concatenate([vals(j, key, count, tc) for j in range(n)]))
            init[r * count:(r + 1) * count] = vals(r, key, count, tc)
            buf = make(kind, tc, init)
            part = as_np(kind, tc, buf)[r * count:(r + 1) * count]   # a view of buf's memory
            assert mpicomm.all_gather(part, out=buf, group=g) is buf
            np.testing.assert_array_equal(as_np(kind, tc, buf),
                                          np.concatenate([vals(j, key, count, tc) for j in range(n)]))


@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_reduce_in_place_on_root(groups, kind, tc):
    """Reduce(MPI.IN_PLACE, buf) on the root, ordinary buffers elsewhere."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for root in range(n):
            for op in OPS:
                key = f"redi{g}{root}{op}"
                x = make(kind, tc, vals(r, key, n, tc, op))
                res = mpicomm.reduce(x, op, root=root, out=x if r == root else None, group=g)
                if r == root:
                    assert res is x
                    np.testing.assert_array_equal(as_np(kind, tc, x),
                                                  reduce_all([vals(j, key, n, tc, op) for j in range(n)], op))
                else:
                    assert res is None


@pytest.mark.parametrize("kind,tc", KIND_TC)
def test_allreduce_in_place(groups, kind, tc):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for op in OPS:
            key = f"ari{g}{op}"
            x = make(kind, tc, vals(r, key, n, tc, op))
            assert mpicomm.all_reduce(x, op, out=x, group=g) is x
            np.testing.assert_array_equal(as_np(kind, tc, x),
                                          reduce_all([vals(j, key, n, tc, op) for j in range(n)], op))


# ----------------------------------------------------------- torch.distributed's in-place forms

def test_torch_style_in_place_tensor_ops(groups):
    """all_reduce in place (torch's only form), all_gather_into_tensor(out, out[r*c:(r+1)*c]),
    reduce_scatter_tensor(x[r*c:(r+1)*c], x), for float32 and int64, c = 1 and 5."""
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        for dt in (np.float32, np.int64):
            tc = "f" if dt is np.float32 else "l"
            for c in (1, 5):
                key = f"t{g}{c}{tc}"
                x = vals(r, key, c * n, tc)
                assert mpicomm.all_reduce(x, out=x, group=g) is x
                np.testing.assert_array_equal(x, reduce_all([vals(j, key, c * n, tc) for j in range(n)],
                                                            ReduceOp.SUM))
                out = np.zeros(c * n, dt)
                out[r * c:(r + 1) * c] = vals(r, key + "g", c, tc)
                assert mpicomm.all_gather(out[r * c:(r + 1) * c], out=out, group=g) is out
                np.testing.assert_array_equal(out, np.concatenate([vals(j, key + "g", c, tc) for j in range(n)]))
                y = vals(r, key + "rs", c * n, tc)
                part = y[r * c:(r + 1) * c]
                assert mpicomm.reduce_scatter(y, out=part, group=g) is part
                total = reduce_all([vals(j, key + "rs", c * n, tc) for j in range(n)], ReduceOp.SUM)
                np.testing.assert_array_equal(part, total[r * c:(r + 1) * c])


# ----------------------------------------------------------- torch.distributed's *_object tests

class Foo:
    """torch's test class for object collectives (an attribute compared by ==)."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Foo and self.x == other.x


def torch_objects(seed):
    """torch's COLLECTIVES_OBJECT_TEST_LIST, with a value that depends on the seed."""
    k = int(np.random.default_rng(seed).integers(1000))
    return [{"key1": 3 + k, "key2": 4}, Foo(k), [1, 2, True, "string", [4, 5, "nested"], k], f"foo{k}", None]


def test_torch_object_collectives(groups):
    for g, ranks in groups:
        n, r = len(ranks), mpicomm.get_rank(g)
        objs = torch_objects([r, 1])
        gathered = mpicomm.all_gather_object(objs, group=g)
        assert gathered == [torch_objects([j, 1]) for j in range(n)]
        for root in range(n):
            got = mpicomm.gather_object(objs, root=root, group=g)
            assert got == ([torch_objects([j, 1]) for j in range(n)] if r == root else None)
            b = mpicomm.broadcast_object(objs if r == root else None, root=root, group=g)
            assert b == torch_objects([root, 1])
            s = mpicomm.scatter_object([torch_objects([root, 100 + j]) for j in range(n)] if r == root else None,
                                       root=root, group=g)
            assert s == torch_objects([root, 100 + r])
