"""Collectives and point-to-point of Python objects (mpicomm._objects), on the world and a
sub-group in reversed order, against each rank's object rebuilt independently from its seed;
every bad input raises InvalidArgumentError on every rank that takes part."""
import zlib

import numpy as np
import pytest

import mpicomm
from conftest import reversed_group

pytestmark = pytest.mark.mpi


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses pickling")


def obj_of(rank, key, big=False):
    """Rank ``rank``'s object: a dict of a string, a float, a small and (big=True) a 1 MiB
    array (which travels out of band), a tuple, a nested list; all from the rank's seed."""
    g = np.random.default_rng([rank, zlib.crc32(key.encode())])
    o = {"name": f"rank{rank}-{g.integers(1 << 30)}", "x": float(g.standard_normal()),
         "small": g.standard_normal(int(g.integers(1, 50))).astype(np.float32),
         "t": (int(g.integers(-1000, 1000)), None, b"\x00" + bytes(g.integers(0, 256, 7, dtype=np.uint8))),
         "nested": [[int(v) for v in g.integers(0, 99, 3)], {"k": str(g.integers(9))}]}
    if big:
        o["big"] = g.standard_normal((512, 256))            # 1 MiB of float64
        o["view"] = o["big"][::3, 1::2]                     # non-contiguous: in-band copy
    return o


def same(a, b):
    """Deep equality with arrays compared by dtype, shape and value."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def groups(comm):
    return {None: list(range(mpicomm.get_group_size())), "objrev": reversed_group("objrev")}


def cases(groups):
    """(group, its world ranks, this rank's group rank) for the groups this rank is in."""
    me = mpicomm.get_rank()
    return [(g, ranks, ranks.index(me)) for g, ranks in groups.items() if me in ranks]


@pytest.mark.parametrize("big", [False, True])
def test_all_gather_object(groups, big):
    for g, ranks, r in cases(groups):
        key = f"ag{big}{g}"
        res = mpicomm.all_gather_object(obj_of(ranks[r], key, big), group=g)
        assert isinstance(res, list) and len(res) == len(ranks)
        for i, w in enumerate(ranks):
            assert same(res[i], obj_of(w, key, big)), (i, w)
        if big:   # received out of band: a writable array of its own
            assert res[0]["big"].flags.writeable and res[0]["big"].flags.c_contiguous


@pytest.mark.parametrize("big", [False, True])
def test_broadcast_object(groups, big):
    for g, ranks, r in cases(groups):
        for root in range(len(ranks)):
            key = f"bc{big}{g}{root}"
            mine = obj_of(ranks[r], key, big) if r == root else ("ignored", r)
            res = mpicomm.broadcast_object(mine, root=root, group=g)
            assert same(res, obj_of(ranks[root], key, big))
    # the default arguments: obj=None on non-roots, root 0
    res = mpicomm.broadcast_object(obj_of(0, "dflt") if mpicomm.get_rank() == 0 else None)
    assert same(res, obj_of(0, "dflt"))


def test_gather_object(groups):
    for g, ranks, r in cases(groups):
        for root in range(len(ranks)):
            key = f"ga{g}{root}"
            res = mpicomm.gather_object(obj_of(ranks[r], key, big=root == 0), root=root, group=g)
            if r == root:
                assert len(res) == len(ranks)
                for i, w in enumerate(ranks):
                    assert same(res[i], obj_of(w, key, big=root == 0))
            else:
                assert res is None


def test_scatter_object(groups):
    for g, ranks, r in cases(groups):
        for root in range(len(ranks)):
            key = f"sc{g}{root}"
            objs = [obj_of(100 + i, key, big=i == 0) for i in range(len(ranks))] if r == root else None
            res = mpicomm.scatter_object(objs, root=root, group=g)
            assert same(res, obj_of(100 + r, key, big=r == 0))
    # a tuple works as a list does
    n = mpicomm.get_group_size()
    objs = tuple(("item", i, np.arange(i + 3) * 1.5) for i in range(n)) if mpicomm.get_rank() == 0 else None
    res = mpicomm.scatter_object(objs)
    assert same(res, ("item", mpicomm.get_rank(), np.arange(mpicomm.get_rank() + 3) * 1.5))


def test_send_recv_object(groups):
    for g, ranks, r in cases(groups):
        n = len(ranks)
        if n < 2:
            continue
        key = f"p2p{g}"
        # every rank sends to the next and receives from the previous; even ranks send
        # first, odd ranks receive first (blocking calls, any message size)
        nxt, prv = (r + 1) % n, (r - 1) % n
        for tag in (0, 7):
            mine = obj_of(ranks[r], key + str(tag), big=tag == 7)
            if r % 2 == 0:
                mpicomm.send_object(mine, nxt, group=g, tag=tag)
                got = mpicomm.recv_object(prv, group=g, tag=tag)
            else:
                got = mpicomm.recv_object(prv, group=g, tag=tag)
                mpicomm.send_object(mine, nxt, group=g, tag=tag)
            # at an odd n the last rank (even) and rank 0 both send first: small (eager) or
            # large, pkl5's send completes once the receive is posted, which the other
            # rank's following recv does
            assert same(got, obj_of(ranks[prv], key + str(tag), big=tag == 7))


def test_tags_keep_messages_apart(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    if n < 2:
        return
    if r == 0:
        mpicomm.send_object(("tag", 5), 1, tag=5)
        mpicomm.send_object(("tag", 3), 1, tag=3)
    elif r == 1:
        assert mpicomm.recv_object(0, tag=3) == ("tag", 3)
        assert mpicomm.recv_object(0, tag=5) == ("tag", 5)


# -------------------------------------------------------------------- bad input, on every rank

@pytest.mark.parametrize("root", [-1, "n", 1.0, True, "0", None])
def test_bad_root(comm, root):
    n = mpicomm.get_group_size()
    root = n if root == "n" else root
    for fn, args in ((mpicomm.broadcast_object, ("x",)), (mpicomm.gather_object, ("x",)),
                     (mpicomm.scatter_object, (["x"] * n,))):
        with pytest.raises(mpicomm.InvalidArgumentError, match=rf"root={root!r}.*a group rank in 0\.\.{n - 1}"):
            fn(*args, root=root)
    assert mpicomm.all_gather_object(mpicomm.get_rank()) == list(range(n))   # nothing left behind


def test_unpicklable_all_gather_raises_everywhere(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    bad = n - 1
    with pytest.raises(mpicomm.InvalidArgumentError,
                       match=rf"invalid obj=.*Unpicklable.*refuses pickling.*\(rank {bad}\).*picklable"):
        mpicomm.all_gather_object(Unpicklable() if r == bad else {"ok": r})
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"invalid obj=.*function.*\(rank 0\)"):
        mpicomm.all_gather_object((lambda: 1) if r == 0 else r)
    assert mpicomm.all_gather_object(r * 2) == [2 * i for i in range(n)]


def test_unpicklable_broadcast_gather_raise_everywhere(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    root = n - 1
    with pytest.raises(mpicomm.InvalidArgumentError, match=rf"invalid obj=.*Unpicklable.*\(rank {root}\)"):
        mpicomm.broadcast_object(Unpicklable() if r == root else None, root=root)
    # gather: a non-root's object fails; root and every other rank raise too
    bad = 0 if n == 1 else 1
    with pytest.raises(mpicomm.InvalidArgumentError, match=rf"invalid obj=.*Unpicklable.*\(rank {bad}\)"):
        mpicomm.gather_object(Unpicklable() if r == bad else r, root=0)
    assert mpicomm.broadcast_object([r, "after"] if r == root else None, root=root) == [root, "after"]


@pytest.mark.parametrize("objs", ["short", "long", "none", "str", "unpicklable"])
def test_bad_scatter_list_raises_everywhere(comm, objs):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    root = n // 2
    given = {"short": list(range(n - 1)), "long": list(range(n + 1)), "none": None, "str": "x" * n,
             "unpicklable": [Unpicklable()] * n}[objs]
    if objs == "unpicklable":
        match = rf"invalid objs\[0\]=.*Unpicklable.*\(rank {root}\)"
    else:
        match = rf"invalid objs=.*\(rank {root}\): expected a list \(or tuple\) of {n} objects on root {root}"
    with pytest.raises(mpicomm.InvalidArgumentError, match=match):
        mpicomm.scatter_object(given if r == root else ["ignored"] * n, root=root)
    assert mpicomm.scatter_object([i * 3 for i in range(n)] if r == root else None, root=root) == 3 * r


def test_bad_peer_and_tag(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    for fn, arg, args in ((mpicomm.send_object, "dst", ("x",)), (mpicomm.recv_object, "src", ())):
        with pytest.raises(mpicomm.InvalidArgumentError, match=rf"{arg}={r}.*not this rank {r}"):
            fn(*args, r)
        for peer in (-1, n, "1", None, True):
            with pytest.raises(mpicomm.InvalidArgumentError, match=rf"{arg}={peer!r}.*0\.\.{n - 1}"):
                fn(*args, peer)
        other = (r + 1) % n
        if n > 1:
            for tag in (-1, 1 << 20, "a", 1.0):
                with pytest.raises(mpicomm.InvalidArgumentError, match=rf"tag={tag!r}.*0\.\.32767"):
                    fn(*args, other, tag=tag)


def test_unpicklable_send_raises_on_both(comm):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    if n < 2:
        return
    if r == 0:
        with pytest.raises(mpicomm.InvalidArgumentError, match=r"invalid obj=.*Unpicklable.*\(rank 0\)"):
            mpicomm.send_object(Unpicklable(), 1, tag=11)
        mpicomm.send_object("next", 1, tag=11)
    elif r == 1:
        with pytest.raises(mpicomm.InvalidArgumentError, match=r"invalid obj=.*Unpicklable.*\(rank 0\)"):
            mpicomm.recv_object(0, tag=11)
        assert mpicomm.recv_object(0, tag=11) == "next"


def test_out_of_band_is_not_copied_into_the_pickle(comm):
    """A 4 MiB array inside an object: the message rank 0 builds holds it as an out-of-band
    buffer of its own memory (no copy), and the receivers get it exactly."""
    from mpicomm import _objects

    r = mpicomm.get_rank()
    a = np.random.default_rng([r, 5]).standard_normal(1 << 19)
    msg = _objects._dump({"a": a, "r": r}, r)
    data, bufs = msg
    assert len(bufs) == 1 and bufs[0].raw().nbytes == a.nbytes and len(data.raw()) < 4096
    assert np.shares_memory(np.frombuffer(bufs[0].raw(), a.dtype), a)
    got = mpicomm.broadcast_object({"a": a, "r": r}, root=0)
    assert got["r"] == 0 and np.array_equal(got["a"], np.random.default_rng([0, 5]).standard_normal(1 << 19))


def test_objects_are_watched(comm):
    """The collective object calls advance the group's sequence (the watchdog sees them)."""
    d = mpicomm._state.CTX.world.disp
    s = d.seq
    mpicomm.all_gather_object(1)
    mpicomm.broadcast_object(2)
    mpicomm.gather_object(3)
    mpicomm.scatter_object([4] * mpicomm.get_group_size() if mpicomm.get_rank() == 0 else None)
    assert d.seq == s + 4


@pytest.mark.mpi
def test_bytes_that_do_not_unpickle_are_a_disagreement(comm):
    """Inside an object collective, bytes that do not unpickle (pkl5's ValueError on another
    call's message, as an array broadcast met by broadcast_object gives) raise
    CollectiveMismatchError naming the call, not the foreign exception. On a group of this
    rank alone (no member to tell): the error, then the group goes on."""
    from mpicomm._callspec import CallSpec
    from mpicomm._ops import BROADCAST
    from mpicomm._state import get_group

    r = mpicomm.get_rank()
    name = f"alone{r}"
    mpicomm.create_group(name, [r])
    try:
        d = get_group(name).disp

        def received_garbage():
            raise ValueError("expecting non-negative size")

        with pytest.raises(mpicomm.CollectiveMismatchError,
                           match=rf"broadcast sequence {d.seq + 1} on group '{name}': the message this rank "
                                 r"received is not an object collective's \(ValueError: expecting non-negative size\)"):
            d.watched(BROADCAST, received_garbage, spec=CallSpec(BROADCAST, root=0))
        obj = {"r": r, "v": np.random.default_rng(r).standard_normal(3)}
        got = mpicomm.broadcast_object(obj, group=name)
        assert got["r"] == r and np.array_equal(got["v"], obj["v"])
    finally:
        mpicomm.destroy_group(name)


@pytest.mark.mpi
def test_no_stand_in_for_an_object_collective(comm):
    """A member that refuses a call stands in for the members inside it with scratch arrays,
    and keeps the group's communicator only where it did. An object collective it cannot make
    in another's place: said so (False), so that the group starts afresh rather than keep the
    root's bytes for this rank in the communicator (its next broadcast returned them). An array
    broadcast it can: made (True), on a group of this rank alone here."""
    from mpicomm._callspec import CallSpec, PeerSpec
    from mpicomm._ops import BROADCAST
    from mpicomm._state import get_group

    r = mpicomm.get_rank()
    name = f"stand{r}"
    mpicomm.create_group(name, [r])
    try:
        d = get_group(name).disp
        assert d._stand_in(BROADCAST, PeerSpec(CallSpec(BROADCAST, root=0).words())) is False
        assert d._stand_in(BROADCAST, PeerSpec(CallSpec(BROADCAST, "float32", 16, root=0).words())) is True
        x = np.random.default_rng(r).standard_normal(5)
        np.testing.assert_array_equal(mpicomm.broadcast(x.copy(), group=name), x)   # nothing left behind
    finally:
        mpicomm.destroy_group(name)
