"""In place on every collective and every accepted host array type, and ``out=`` that
overlaps ``x`` without being it.

- ``out=x`` (and ``out=`` a view of exactly x's memory) is in place: all_reduce, reduce (on
  root; x untouched elsewhere), all_to_all, with NumPy arrays, ``array.array`` and DLPack
  objects, on the ordinary and the shared-memory path (thresholds lowered alike).
- ``out=`` overlapping ``x`` otherwise (shifted views of one buffer) raises
  InvalidArgumentError on every rank, at any size (the shared-memory path's pieces too).
- ndarray subclasses follow np.ndarray's rules: broadcast into a non-contiguous view of an
  ``np.matrix`` / writable ``np.memmap`` fills it; into ``bytes``, a read-only memmap or a
  read-only array it raises on every rank before anyone communicates.
Expectations come from every rank's data, rebuilt from its seed.
"""
import array
import zlib

import numpy as np
import pytest

import mpicomm
from launch_support import TORCH, require_module
from mpicomm import InvalidArgumentError, ReduceOp

pytestmark = pytest.mark.mpi

OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
SIZES = {"small": 24, "shm": 6 * 4096}   # elements: the second takes the shared-memory path


def impl():
    t = mpicomm._state.CTX.world.transport
    return getattr(t, "host", t).shm


@pytest.fixture(scope="module")
def low_threshold(comm):
    """The shared-memory path from 1 KiB, pieces of 8 KiB, alike on every rank."""
    m = impl()
    m.configure({"MPICOMM_SHM_THRESHOLD": "1024"})
    if m.size > 1 and m.group is None:
        m.open()
    if m.group is not None:
        m.group.set_piece(8192)
    yield
    m.configure()
    if m.group is not None:
        m.group.set_piece()


def of(r, key, count, dt=np.float64):
    """Rank r's data: integers in float64 (sums, products and means exact), no zeros."""
    g = np.random.default_rng([r, zlib.crc32(key.encode())])
    v = g.integers(1, 4, count) * g.choice([-1, 1], count)
    return v.astype(dt)


def expect(key, count, op, n, dt=np.float64):
    arrs = [of(j, key, count, dt) for j in range(n)]
    s = np.stack(arrs)
    return {ReduceOp.SUM: s.sum(0), ReduceOp.PROD: s.prod(0), ReduceOp.MIN: s.min(0),
            ReduceOp.MAX: s.max(0), ReduceOp.AVG: s.sum(0) / n}[op].astype(dt)


class DLPackOnly:
    """A host array known only through DLPack (as a framework's CPU tensor is)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


KINDS = {
    "numpy": (lambda a: a, lambda x: x),
    "array.array": (lambda a: array.array("d", a), lambda x: np.frombuffer(x, np.float64)),
    "dlpack": (lambda a: DLPackOnly(a), lambda x: x.a),
}


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("op", OPS)
def test_all_reduce_in_place(low_threshold, kind, op, size):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    count = SIZES[size]
    key = f"ar{kind}{op}{size}"
    make, view = KINDS[kind]
    x = make(of(r, key, count))
    before = impl().group.calls["all_reduce"] if impl().group is not None else 0
    res = mpicomm.all_reduce(x, op, out=x)
    assert res is x
    np.testing.assert_array_equal(view(x), expect(key, count, op, n))
    if size == "shm" and n > 1:
        assert impl().group.calls["all_reduce"] == before + 1
    # a view of exactly x's memory is in place too
    a = of(r, key + "v", count)
    for out in (a.view(), a[:], a.reshape(count)):
        a[...] = of(r, key + "v", count)
        assert mpicomm.all_reduce(a, op, out=out) is out
        np.testing.assert_array_equal(a, expect(key + "v", count, op, n))


@pytest.mark.parametrize("kind", list(KINDS))
def test_reduce_in_place_every_root(low_threshold, kind):
    """reduce(x, out=x): the result in x on root; the other ranks' x untouched, None returned.
    (The first version raised MPI_ERR_ARG on root while the others were in the reduce.)"""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    make, view = KINDS[kind]
    for root in range(n):
        for op in OPS:
            key = f"red{kind}{root}{op}"
            x = make(of(r, key, 40))
            res = mpicomm.reduce(x, op, root=root, out=x)
            if r == root:
                assert res is x
                np.testing.assert_array_equal(view(x), expect(key, 40, op, n))
            else:
                assert res is None
                np.testing.assert_array_equal(view(x), of(r, key, 40))
    # the next calls see no stale message
    y = mpicomm.all_reduce(of(r, "after", 8))
    np.testing.assert_array_equal(y, expect("after", 8, ReduceOp.SUM, n))


@pytest.mark.parametrize("kind", ["numpy", "array.array", "dlpack"])
def test_all_to_all_in_place(low_threshold, kind):
    """all_to_all(x, out=x) at every size class, repeated (at 3 ranks Open MPI's in-place
    Alltoall gave wrong rows in about half of the calls of the first version)."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    make, view = KINDS[kind]
    for i, rows in enumerate([1, 3, 17, 1000, 6000] * 3):
        key = f"a2a{kind}{i}"
        x = make(of(r, key, n * rows))
        res = mpicomm.all_to_all(x, out=x)
        assert res is x
        exp = np.concatenate([of(j, key, n * rows)[r * rows:(r + 1) * rows] for j in range(n)])
        np.testing.assert_array_equal(view(x), exp)


def test_all_to_all_in_place_2d(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for i in range(10):
        x = of(r, f"a2d{i}", n * 2 * 3).reshape(n * 2, 3)
        assert mpicomm.all_to_all(x, out=x) is x
        exp = np.concatenate([of(j, f"a2d{i}", n * 6).reshape(n * 2, 3)[2 * r:2 * r + 2] for j in range(n)])
        np.testing.assert_array_equal(x, exp)


def test_reduce_scatter_and_all_gather_in_place_forms(low_threshold):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for count in (8, 3000):
        x = of(r, f"rs{count}", n * count)
        part = x[r * count:(r + 1) * count]
        assert mpicomm.reduce_scatter(x, out=part) is part
        np.testing.assert_array_equal(part, np.split(expect(f"rs{count}", n * count, ReduceOp.SUM, n), n)[r])
        o = np.zeros(n * count)
        o[r * count:(r + 1) * count] = of(r, f"ag{count}", count)
        res = mpicomm.all_gather(o[r * count:(r + 1) * count], out=o)
        assert res is o
        np.testing.assert_array_equal(o, np.concatenate([of(j, f"ag{count}", count) for j in range(n)]))


# ------------------------------------------------ reduce_scatter into the head of x (MPI's form)

def rs_cases():
    """Every dtype and every op it allows (test_collectives' tables)."""
    from test_collectives import DTYPES, allowed

    return [(dt, op) for dt in DTYPES for op in ReduceOp if allowed(op, dt)]


def rs_expect(key, shape, dt, op, n, k):
    """Chunk k of the reduction of every rank's ``data(rank, key, shape, dt, op)``."""
    from test_collectives import data, reduce_np

    c = shape[0] // n
    return reduce_np([data(j, key, shape, dt, op) for j in range(n)], op)[k * c:(k + 1) * c]


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("rows", [5, 3000])   # elements of a chunk (x 2): 3000 reaches the shm threshold
def test_reduce_scatter_into_head_of_x(low_threshold, rows, async_op):
    """reduce_scatter(x, out=x[:c]) on every rank, as MPI_IN_PLACE users of MPI_Reduce_scatter_block
    write it: rank r's chunk of the reduction lands at the start of x on every rank (rank 0 and
    the others alike), for every dtype and op; out is returned."""
    from test_collectives import close, data

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    shape = (n * rows, 2)
    for dt, op in rs_cases():
        key = f"rshead{rows}{np.dtype(dt).name}{op.value}"
        x = data(r, key, shape, dt, op)
        out = x[:rows]
        res = mpicomm.reduce_scatter(x, op, out=out, async_op=async_op)
        if async_op:
            res = res.wait()
        assert res is out
        close(out, rs_expect(key, shape, dt, op, n, r), dt)
    y = mpicomm.all_reduce(of(r, "rsheadafter", 7))   # nothing left pending
    np.testing.assert_array_equal(y, expect("rsheadafter", 7, ReduceOp.SUM, n))


def test_reduce_scatter_into_head_repeated(comm):
    """50 calls in a row, the same signature (the prepared call reused) and then others: each
    gives MPI's in-place result at the head of x on every rank."""
    from test_collectives import close, data

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for i in range(50):
        dt, op = [(np.float64, ReduceOp.SUM), (np.int32, ReduceOp.MAX), (np.float32, ReduceOp.MIN)][i // 20]
        key = f"rsrep{i}"
        x = data(r, key, (n * 4,), dt, op)
        assert mpicomm.reduce_scatter(x, op, out=x[:4]) is not None
        close(x[:4], rs_expect(key, (n * 4,), dt, op, n, r), dt)


def test_reduce_scatter_into_any_chunk_of_x(low_threshold):
    """out= any one of x's n chunks is accepted alike on every rank (the test is the same on
    every rank): the head (MPI's form), this rank's chunk (NCCL's), another one. The result is
    this rank's chunk of the reduction, written into out."""
    from test_collectives import close, data

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for rows in (3, 3000):
        for k in range(n):
            key = f"rschunk{rows}{k}"
            x = data(r, key, (n * rows,), np.float64)
            out = x[k * rows:(k + 1) * rows]
            assert mpicomm.reduce_scatter(x, out=out) is out
            close(out, rs_expect(key, (n * rows,), np.float64, ReduceOp.SUM, n, r), np.float64)


def test_reduce_scatter_sizes_into_head_of_x(comm):
    """With sizes=, out= the head of x (x[:sizes[rank]], MPI_Reduce_scatter's in-place form) or
    this rank's part of x: rank r's part of the reduction, on every rank."""
    from test_collectives import close, data, reduce_np

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    sizes = [2 + (j % 3) for j in range(n)]
    lo = sum(sizes[:r])
    for form in ("head", "part"):
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            key = f"rsv{form}{op.value}"
            shape = (sum(sizes), 3)
            x = data(r, key, shape, np.int64, op)
            out = x[:sizes[r]] if form == "head" else x[lo:lo + sizes[r]]
            assert mpicomm.reduce_scatter(x, op, out=out, sizes=sizes) is out
            exp = reduce_np([data(j, key, shape, np.int64, op) for j in range(n)], op)[lo:lo + sizes[r]]
            close(out, exp, np.int64)


@pytest.mark.parametrize("rows", [4, 3000])
def test_reduce_scatter_other_overlaps_refused_promptly(low_threshold, rows):
    """out= overlapping x but not one of its chunks (one element off the head, half a chunk
    in): InvalidArgumentError on every rank within 2 s each (no rank takes part, none waits),
    x untouched; the group goes on."""
    import time

    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for i, start in enumerate((1, rows // 2, n * rows - rows + 1)):
        buf = of(r, f"rsbad{rows}{i}", n * rows + rows + 2)   # (out has a chunk's length at any rank count)
        keep = buf.copy()
        x = buf[:n * rows]
        t0 = time.monotonic()
        with pytest.raises(InvalidArgumentError, match=OVERLAP_MSG):
            mpicomm.reduce_scatter(x, out=buf[start:start + rows])
        assert time.monotonic() - t0 < 2.0
        np.testing.assert_array_equal(buf, keep)
    x = of(r, "rsbadafter", n * rows)
    assert mpicomm.reduce_scatter(x, out=x[:rows]) is not None
    np.testing.assert_array_equal(x[:rows], np.split(expect("rsbadafter", n * rows, ReduceOp.SUM, n), n)[r])


# -------------------------------------------------------------------- overlap

OVERLAP_MSG = r"invalid out='an array that overlaps x': expected x itself or a view of exactly x's memory"


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("shift", [1, -1, "reversed", "half"])
def test_overlapping_out_raises_everywhere(low_threshold, size, shift):
    """out= a shifted (or reversed) view of x's buffer: InvalidArgumentError on every rank for
    every collective with out=, before anyone communicates; the buffer is left as it was."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    count = SIZES[size] * n
    buf = of(r, f"ov{size}{shift}", 2 * count + 2 * n)
    keep = buf.copy()
    if shift == "reversed":
        x, out = buf[:count], buf[:count][::-1]
    elif shift == "half":
        x, out = buf[:count], buf[count // 2:count // 2 + count]
    else:
        x, out = (buf[1:count + 1], buf[1 + shift:count + 1 + shift])
    calls = [lambda: mpicomm.all_reduce(x, out=out), lambda: mpicomm.reduce(x, out=out, root=n - 1),
             lambda: mpicomm.all_to_all(x, out=out)]
    if shift != "reversed":
        part = count // n
        calls += [lambda: mpicomm.reduce_scatter(x, out=buf[r * part + 2:(r + 1) * part + 2]),  # 1 off its part
                  lambda: mpicomm.all_gather(buf[:part], out=buf[1:count + 1])]
    # (a reversed view is refused first for not being C-contiguous)
    match = OVERLAP_MSG if shift != "reversed" else r"invalid out='non-contiguous array"
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=match):
            call()
    np.testing.assert_array_equal(buf, keep)
    y = mpicomm.all_reduce(of(r, "fine", 5))   # nothing pending
    np.testing.assert_array_equal(y, expect("fine", 5, ReduceOp.SUM, n))


# -------------------------------------------------------------------- subclasses, read-only

@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_broadcast_into_noncontiguous_subclass_views(comm, tmp_path):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for root in range(n):
        key = f"bm{root}"
        m = np.matrix(of(r, key, 24).reshape(4, 6))
        v = m[:, ::2]
        mpicomm.broadcast(v, root=root)
        exp = of(r, key, 24).reshape(4, 6)
        exp[:, ::2] = of(root, key, 24).reshape(4, 6)[:, ::2]
        np.testing.assert_array_equal(np.asarray(m), exp)

        mm = np.memmap(tmp_path / f"m{r}_{root}", dtype=np.float64, mode="w+", shape=(6, 4))
        mm[:] = of(r, key + "mm", 24).reshape(6, 4)
        v = mm[1::2, 1:]
        mpicomm.broadcast(v, root=root)
        exp = of(r, key + "mm", 24).reshape(6, 4)
        exp[1::2, 1:] = of(root, key + "mm", 24).reshape(6, 4)[1::2, 1:]
        np.testing.assert_array_equal(np.asarray(mm), exp)
        del mm


@pytest.mark.parametrize("what", ["bytes", "readonly_memmap", "readonly_array", "readonly_view"])
def test_broadcast_into_read_only_raises_everywhere(comm, tmp_path, what):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for root in range(n):
        if what == "bytes":
            x = bytes(of(r, "b", 8).astype(np.int8).view(np.uint8))
            match = r"invalid x='read-only bytes': expected a writable array \(broadcast fills x in place\)"
        elif what == "readonly_memmap":
            p = tmp_path / f"ro{r}_{root}"
            of(r, "ro", 12).tofile(p)
            x = np.memmap(p, dtype=np.float64, mode="r", shape=(12,))
            match = r"invalid x='read-only array': expected a writable array"
        else:
            x = of(r, "ro", 12)
            if what == "readonly_view":
                x = x[::2]
            x.flags.writeable = False
            match = r"invalid x='read-only array': expected a writable array"
        with pytest.raises(InvalidArgumentError, match=match):
            mpicomm.broadcast(x, root=root)
    y = mpicomm.all_reduce(of(r, "fine2", 5))   # nothing pending
    np.testing.assert_array_equal(y, expect("fine2", 5, ReduceOp.SUM, n))


@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_zero_length_dlpack_broadcast_and_in_place(comm, shape):
    """A zero-length buffer known only through DLPack: broadcast from every root fills it as it
    fills an empty NumPy array (nothing to write, so never refused as read-only, even where the
    export is marked read-only), on every rank; in-place all_reduce alike. The next call sees
    the group as it was."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for ro in (False, True):
        for root in range(n):
            a = np.zeros(shape, np.float32)
            a.flags.writeable = not ro
            d = DLPackOnly(a)
            assert mpicomm.broadcast(d, root=root) is d
            assert np.from_dlpack(d).shape == shape
            e = np.zeros(shape, np.float32)   # what NumPy's empty array does
            assert mpicomm.broadcast(e, root=root) is e
        a = np.zeros(shape, np.float64)
        a.flags.writeable = not ro
        d = DLPackOnly(a)
        assert mpicomm.all_reduce(d, out=d) is d
    y = mpicomm.all_reduce(of(r, "zlen", 6))
    np.testing.assert_array_equal(y, expect("zlen", 6, ReduceOp.SUM, n))


def test_read_only_dlpack_refused_everywhere(comm):
    """A DLPack object over read-only memory cannot take a result in place: refused on every
    rank before anyone communicates (not a silent copy that never reaches the object)."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    a = of(r, "rodl", 6)
    a.flags.writeable = False
    d = DLPackOnly(a)
    with pytest.raises(InvalidArgumentError, match=r"invalid out='read-only DLPackOnly'"):
        mpicomm.all_reduce(d, out=d)
    with pytest.raises(InvalidArgumentError, match=r"invalid x='read-only DLPackOnly'"):
        mpicomm.broadcast(d, root=0)
    np.testing.assert_array_equal(a, of(r, "rodl", 6))
    # as input only it is fine
    np.testing.assert_array_equal(mpicomm.all_reduce(d), expect("rodl", 6, ReduceOp.SUM, n))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_torch_cpu_in_place(comm, dtype):
    """PyTorch CPU tensors in place (all_reduce, reduce on every root, all_to_all), where torch
    is installed (the same on every rank)."""
    torch = require_module("torch", TORCH)
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    tdt = getattr(torch, dtype)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        x = torch.from_numpy(of(r, f"t{op}", 8)).to(tdt)
        assert mpicomm.all_reduce(x, op, out=x) is x
        np.testing.assert_array_equal(x.double().numpy(), expect(f"t{op}", 8, op, n))
        for root in range(n):
            x = torch.from_numpy(of(r, f"t{op}{root}", 8)).to(tdt)
            res = mpicomm.reduce(x, op, root=root, out=x)
            if r == root:
                assert res is x
                np.testing.assert_array_equal(x.double().numpy(), expect(f"t{op}{root}", 8, op, n))
            else:
                assert res is None
                np.testing.assert_array_equal(x.double().numpy(), of(r, f"t{op}{root}", 8))
    x = torch.from_numpy(of(r, "ta2a", 3 * n)).to(tdt)
    assert mpicomm.all_to_all(x, out=x) is x
    exp = np.concatenate([of(j, "ta2a", 3 * n)[3 * r:3 * r + 3] for j in range(n)])
    np.testing.assert_array_equal(x.double().numpy(), exp)
