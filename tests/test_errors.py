"""Every bad input gets a clear error on every rank (run under mpirun at 1, 2 and 4 ranks).

Each case checks that the message names the argument, the value and what is allowed,
and that every rank raised (an allgather after the call: a rank that did not raise would
have entered a collective, and the others would hang). Errors that need their own
``init`` (before init, unknown backend, NCCL without a GPU, debug-mode mismatches,
timeouts) are in tests/test_faults.py, which starts its own mpirun.
"""
import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp

pytestmark = pytest.mark.mpi


def raises_everywhere(exc, fn, *fragments):
    """Call fn, expect ``exc`` with every fragment in its message, on every rank."""
    from mpi4py import MPI

    msg = None
    try:
        fn()
    except exc as e:
        msg = str(e)
    flags = MPI.COMM_WORLD.allgather(msg is not None)
    assert all(flags), f"raised on ranks {[r for r, f in enumerate(flags) if f]} only"
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def _xp():
    if mpicomm.get_backend() == "nccl":
        import cupy

        return cupy
    return np


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request, comm):
    """NumPy arrays; CuPy arrays on the NCCL backend (skipped elsewhere, alike on all ranks)."""
    if request.param == "cupy":
        if comm.get_backend() != "nccl":
            pytest.skip("needs the NCCL backend")
        import cupy

        return cupy
    return np


def data(xp, rng, shape, dtype=np.float32):
    return xp.asarray(rng.standard_normal(shape).astype(dtype))


# ---------------------------------------------------------------- ranks and ops

def test_root_out_of_range(comm, rng, xp):
    n = comm.get_group_size()
    x = data(xp, rng, 4)
    for root in (n, -1, 2 ** 40):
        raises_everywhere(InvalidArgumentError, lambda: comm.broadcast(x, root=root),
                          f"invalid root={root}", f"a group rank in 0..{n - 1}")
        raises_everywhere(InvalidArgumentError, lambda: comm.reduce(x, root=root),
                          f"invalid root={root}", f"0..{n - 1}")
    raises_everywhere(InvalidArgumentError, lambda: comm.broadcast(x, root="0"), "invalid root='0'")
    raises_everywhere(InvalidArgumentError, lambda: comm.broadcast(x, root=1.0), "invalid root=1.0")


def test_src_dst_out_of_range_and_self(comm, rng, xp):
    n, r = comm.get_group_size(), comm.get_rank()
    x = data(xp, rng, 4)
    raises_everywhere(InvalidArgumentError, lambda: comm.send(x, dst=n), f"invalid dst={n}", f"0..{n - 1}")
    raises_everywhere(InvalidArgumentError, lambda: comm.recv(x, src=-1), "invalid src=-1", f"0..{n - 1}")
    raises_everywhere(InvalidArgumentError, lambda: comm.send(x, dst=r), f"invalid dst={r}",
                      "another rank of the group")
    raises_everywhere(InvalidArgumentError, lambda: comm.recv(x, src=r), f"invalid src={r}",
                      "another rank of the group")


def test_unknown_op(comm, rng, xp):
    x = data(xp, rng, 3)
    for op in ("median", 7, None):
        raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, op=op), f"invalid op={op!r}",
                          "one of ReduceOp.SUM, PROD, MIN, MAX, AVG")
    raises_everywhere(InvalidArgumentError, lambda: comm.AllReduce(op="mode"), "invalid op='mode'")


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8"])
def test_avg_on_integers(comm, rng, xp, dtype):
    x = xp.asarray(rng.integers(0, 100, 5).astype(dtype))
    for f in (lambda: comm.all_reduce(x, op=ReduceOp.AVG), lambda: comm.reduce(x, op="avg"),
              lambda: comm.reduce_scatter(xp.asarray(rng.integers(0, 100, 2 * comm.get_group_size())
                                                     .astype(dtype)), op="avg")):
        raises_everywhere(InvalidArgumentError, f, "invalid op='avg'", f"integer dtype {dtype}",
                          "AVG needs a floating dtype")


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_order_ops_on_complex(comm, rng, xp, op):
    x = xp.asarray((rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64))
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, op=op), f"invalid op='{op}'",
                      "SUM or AVG for complex dtype complex64")


def test_unsupported_dtype(comm, rng):
    """Strings, Python objects, float128 and datetimes are refused, naming the supported dtypes
    (bool, int16 and uint16 are supported: tests/test_bool_int16.py)."""
    xs = [np.array(["a", "bc"]), np.array([{}, 1], dtype=object), np.array(["2024-01-01"], dtype="datetime64[D]")]
    if np.dtype(np.longdouble).itemsize > 8:   # float128 (x86) or float96, not a float64 alias
        xs.append(np.ones(3, np.longdouble))
    for x in xs:
        name = x.dtype.name   # str64, object, datetime64[D], float128
        for f in (lambda: comm.all_reduce(x), lambda: comm.broadcast(x, root=0)):
            raises_everywhere(InvalidArgumentError, f, f"invalid x.dtype='{name}'",
                              "expected one of int8, uint8, int16, uint16, int32", "complex128, bool")


def test_avg_on_bool(comm, rng, xp):
    """bool reduces as logical OR (SUM, MAX) and AND (PROD, MIN); AVG is refused, as torch does."""
    n = comm.get_group_size()
    x = xp.asarray(rng.integers(0, 2, 2 * n).astype(bool))
    for f in (lambda: comm.all_reduce(x, op=ReduceOp.AVG), lambda: comm.reduce(x, op="avg"),
              lambda: comm.reduce_scatter(x, op="mean")):
        raises_everywhere(InvalidArgumentError, f, "invalid op='avg'", "expected SUM or MAX (logical OR), "
                          "PROD or MIN (logical AND) for dtype bool", "AVG needs a floating dtype")


def test_other_byte_order_says_how_to_convert(comm, rng):
    x = data(np, rng, 4).astype(">f4")
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x),
                      "invalid x.dtype='big-endian float32 (>f4)'", "convert with x.astype('<f4')")
    # converted as the message says, it works
    from mpi4py import MPI

    y = x.astype("<f4")
    want = np.sum(MPI.COMM_WORLD.allgather(y), axis=0, dtype=np.float32)
    np.testing.assert_allclose(comm.all_reduce(y), want, rtol=1e-5)


# ---------------------------------------------------------------- out=

def test_out_wrong_shape_or_dtype(comm, rng, xp):
    n = comm.get_group_size()
    x = data(xp, rng, (2 * n, 3))
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, out=xp.empty((2 * n, 4), np.float32)),
                      f"invalid out.shape=({2 * n}, 4)", f"shape ({2 * n}, 3)")
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, out=xp.empty((2 * n, 3), np.float64)),
                      "invalid out.dtype='float64'", "dtype float32")
    raises_everywhere(InvalidArgumentError, lambda: comm.all_gather(x, out=xp.empty((2 * n + 1, 3), np.float32)),
                      "invalid out.shape", f"shape ({2 * n * n}, 3)")
    raises_everywhere(InvalidArgumentError, lambda: comm.reduce_scatter(x, out=xp.empty((2 * n + 1, 3), np.float32)),
                      "invalid out.shape", "shape (2, 3)")
    raises_everywhere(InvalidArgumentError, lambda: comm.all_to_all(x, out=xp.empty((1,), np.float32)),
                      "invalid out.shape=(1,)")
    # reduce validates out on every rank, not only on the root
    raises_everywhere(InvalidArgumentError, lambda: comm.reduce(x, out=xp.empty(3, np.float32)),
                      "invalid out.shape=(3,)")


def test_out_non_contiguous_or_read_only(comm, rng):
    x = data(np, rng, 8)
    strided = np.empty((8, 2), np.float32)[:, 0]
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, out=strided),
                      "invalid out='non-contiguous array (shape (8,), strides (8,))'", "a C-contiguous array")
    ro = np.empty(8, np.float32)
    ro.flags.writeable = False
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, out=ro),
                      "invalid out='read-only array'", "a writable array")
    raises_everywhere(InvalidArgumentError, lambda: comm.broadcast(ro), "read-only array",
                      "broadcast fills x in place")
    # a non-contiguous view is filled through a contiguous copy (every rank gets root's values)
    from mpi4py import MPI

    base = rng.standard_normal((4, 2)).astype(np.float32)
    want = MPI.COMM_WORLD.bcast(base[:, 1].copy(), root=0)
    view = base[:, 1]
    assert comm.broadcast(view) is view
    np.testing.assert_array_equal(base[:, 1], want)


def test_non_contiguous_input_is_copied(comm, rng):
    # documented choice: non-contiguous input works (one copy), only out= must be contiguous
    n = comm.get_group_size()
    base = rng.standard_normal((6, 2)).astype(np.float32)
    got = comm.all_reduce(base[:, 0])
    from mpi4py import MPI

    want = np.sum(MPI.COMM_WORLD.allgather(np.ascontiguousarray(base[:, 0])), axis=0, dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5 * n)


# ---------------------------------------------------------------- shapes that must divide

@pytest.mark.mpi(min_size=2)
def test_first_axis_not_divisible(comm, rng, xp):
    n = comm.get_group_size()
    x = data(xp, rng, (n + 1, 2))
    raises_everywhere(InvalidArgumentError, lambda: comm.reduce_scatter(x), f"invalid x.shape=({n + 1}, 2)",
                      f"a first axis divisible by the group size {n}")
    raises_everywhere(InvalidArgumentError, lambda: comm.all_to_all(x), f"invalid x.shape=({n + 1}, 2)",
                      f"divisible by the group size {n}")


def test_zero_dimensional_scatter(comm, rng, xp):
    x = xp.asarray(np.float32(rng.standard_normal()))
    raises_everywhere(InvalidArgumentError, lambda: comm.reduce_scatter(x), "invalid x.shape=()",
                      "a first axis divisible")
    raises_everywhere(InvalidArgumentError, lambda: comm.all_to_all(x), "invalid x.shape=()")


# ---------------------------------------------------------------- groups

def test_unknown_group(comm, rng):
    x = data(np, rng, 2)
    raises_everywhere(InvalidArgumentError, lambda: comm.all_reduce(x, group="no_such_group"),
                      "invalid group='no_such_group'", "a group made by create_group")
    raises_everywhere(InvalidArgumentError, lambda: comm.get_rank(group=3), "invalid group=3",
                      "a group name (str)")
    raises_everywhere(InvalidArgumentError, lambda: comm.destroy_group("no_such_group"),
                      "invalid group='no_such_group'")
    raises_everywhere(InvalidArgumentError, lambda: comm.destroy_group("world"),
                      "the world cannot be destroyed")


def test_bad_group_names(comm):
    n = comm.get_group_size()
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("", [0]), "invalid group=''",
                      "a non-empty string")
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group(None, [0]), "invalid group=None")
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("world", [0]), "invalid group='world'",
                      "a name other than the world's")
    comm.create_group("rel_dup", list(range(n)))
    try:
        raises_everywhere(InvalidArgumentError, lambda: comm.create_group("rel_dup", [0]),
                          "invalid group='rel_dup'", "a name not in use")
    finally:
        comm.destroy_group("rel_dup")


def test_bad_rank_lists(comm):
    n = comm.get_group_size()
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("rel_bad", []),
                      "invalid rank_ids=[]", "a non-empty list")
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("rel_bad", [0, 0]),
                      "invalid rank_ids=[0, 0]", "distinct world ranks (duplicated: [0])")
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("rel_bad", [0, n]),
                      f"invalid rank_ids=[0, {n}]", f"world ranks in 0..{n - 1} (out of range: [{n}])")
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("rel_bad", [-1]),
                      "out of range: [-1]")
    raises_everywhere(InvalidArgumentError, lambda: comm.create_group("rel_bad", ["a"]),
                      "invalid rank_ids=['a']", "a list of world ranks")
    raises_everywhere(InvalidArgumentError, lambda: comm.get_world_rank_from_group_rank("world", n),
                      f"invalid group_rank_id={n}", f"0..{n - 1}")


@pytest.mark.mpi(min_size=2)
def test_group_op_by_non_member(comm, rng):
    from mpi4py import MPI

    r, n = comm.get_rank(), comm.get_group_size()
    comm.create_group("rel_only0", [0])
    try:
        x = data(np, rng, 3)
        msg = None
        if r == 0:  # the member: its one-rank group works
            np.testing.assert_array_equal(comm.all_reduce(x, group="rel_only0"), x)
        else:
            try:
                comm.all_reduce(x, group="rel_only0")
            except InvalidArgumentError as e:
                msg = str(e)
        got = MPI.COMM_WORLD.allgather(msg)
        for k in range(1, n):  # every non-member raised
            assert got[k] is not None
            assert "invalid group='rel_only0'" in got[k] and f"world rank {k} is not in [0]" in got[k]
    finally:
        comm.destroy_group("rel_only0")


# ---------------------------------------------------------------- IEEE values

def test_nan_and_inf_propagate(comm, rng, xp):
    from mpi4py import MPI

    r, n = comm.get_rank(), comm.get_group_size()
    x = rng.standard_normal(6)
    if r == n - 1:
        x[0] = np.nan       # NaN + anything = NaN
        x[1] = np.inf       # inf + finite = inf
    if r == 0:
        x[2] = -np.inf
    if r == n - 1:
        x[2] = np.inf if n > 1 else -np.inf  # inf + -inf = NaN (only with 2+ ranks)
    allx = np.array(MPI.COMM_WORLD.allgather(x))
    got = comm.all_reduce(xp.asarray(x))
    got = got.get() if xp is not np else got
    assert np.isnan(got[0])
    assert got[1] == np.inf
    if n > 1:
        assert np.isnan(got[2])
    else:
        assert got[2] == -np.inf
    np.testing.assert_allclose(got[3:], allx[:, 3:].sum(0))
    # MAX/MIN with a NaN: MPI uses C comparisons, so whether NaN wins depends on which rank
    # holds it and the reduction order (not IEEE maximum); every rank gets the same answer
    y = rng.standard_normal(3)
    if r == 0:
        y[0] = np.nan
    mx = comm.all_reduce(xp.asarray(y), op="max")
    mx = mx.get() if xp is not np else mx
    ally = np.array(MPI.COMM_WORLD.allgather(y))
    assert np.isnan(mx[0]) or mx[0] == np.nanmax(ally[:, 0])
    np.testing.assert_array_equal(mx[1:], ally[:, 1:].max(0))
    same = MPI.COMM_WORLD.allgather(mx.tobytes())
    assert all(s == same[0] for s in same)
