"""After a reported disagreement, whether the group starts on a fresh communicator
(docs/RELIABILITY.md, "Agreement check"): only where the calls could leave a message behind.
Every deciding rank applies this one rule (mpicomm._dispatch_checks._clean) to the same
descriptions, so all decide alike; here the rule itself, call by call, against what MPI
matches: messages of the same byte count pair up whatever their dtype or op."""
from __future__ import annotations

import numpy as np
import pytest

from mpicomm import ReduceOp
from mpicomm._callspec import ASYNC, CallSpec, PeerSpec, plain_spec, same_bytes, spec_of, standable
from mpicomm._dispatch_checks import _clean
from mpicomm._dtypes import dtype_of
from mpicomm._ops import ALL_GATHER, ALL_REDUCE, BARRIER, BROADCAST, GATHER, REDUCE, Sized

N, ME = 4, 1


def peer(code, x, arg=None, started=False):
    """What a member publishes for its call: decoded as another rank reads it."""
    w = spec_of(code, x, None, arg, N, ME).words()
    if started:
        w = (w[0] | ASYNC,) + w[1:]
    return PeerSpec(w)


def rows(dtype, n=6, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype_of(dtype))


SUM, MAX = ReduceOp.SUM, ReduceOp.MAX


@pytest.mark.parametrize("a, b, clean", [
    # same byte count on every rank: every message matched, nothing left (no fresh start)
    ((ALL_REDUCE, "float32", SUM), (ALL_REDUCE, "int32", SUM), True),
    ((ALL_REDUCE, "float64", SUM), (ALL_REDUCE, "float64", MAX), True),
    ((ALL_REDUCE, "float16", SUM), (ALL_REDUCE, "int16", SUM), True),
    ((ALL_REDUCE, "bfloat16", SUM), (ALL_REDUCE, "float16", SUM), True),
    ((ALL_GATHER, "int64", None), (ALL_GATHER, "float64", None), True),
    ((REDUCE, "uint32", (SUM, 2)), (REDUCE, "float32", (MAX, 2)), True),
    # other byte counts, another root, another collective: messages can be left behind
    ((ALL_REDUCE, "float32", SUM), (ALL_REDUCE, "float64", SUM), False),
    ((ALL_REDUCE, "bfloat16", SUM), (ALL_REDUCE, "float32", SUM), False),
    ((BROADCAST, "float64", 0), (BROADCAST, "float64", 2), False),
    ((REDUCE, "float32", (SUM, 0)), (REDUCE, "float32", (SUM, 1)), False),
    ((ALL_REDUCE, "float64", SUM), (ALL_GATHER, "float64", None), False),
])
def test_calls_of_the_same_bytes_leave_nothing(a, b, clean):
    specs = [peer(a[0], rows(a[1]), a[2]), peer(b[0], rows(b[1]), b[2])]
    assert same_bytes(specs[0], specs[1]) is clean
    assert same_bytes(specs[1], specs[0]) is clean
    assert _clean(specs, refused=False) is clean
    assert _clean(specs[::-1], refused=False) is clean


def test_another_count_leaves_messages():
    specs = [peer(ALL_REDUCE, rows("float32", 6), SUM), peer(ALL_REDUCE, rows("int32", 7), SUM)]
    assert not same_bytes(*specs)
    assert not _clean(specs, refused=False)


def test_a_started_host_request_may_stay_pending():
    x = rows("float64")
    host = [peer(ALL_REDUCE, x, SUM, started=True), peer(ALL_REDUCE, x, MAX)]
    assert not _clean(host, refused=False)
    assert _clean([peer(ALL_REDUCE, x, SUM), peer(ALL_REDUCE, x, MAX)], refused=False)
    gpu = PeerSpec((ALL_REDUCE | 0x100 | ASYNC,) + peer(ALL_REDUCE, x, SUM).words()[1:])
    assert gpu.gpu and gpu.started
    assert _clean([gpu], refused=False)   # NCCL runs started and blocking calls alike


def test_a_refusing_member_stands_in_only_where_scratch_arrays_can():
    x = rows("float32")
    even = peer(ALL_REDUCE, x, SUM)
    assert standable(even) and _clean([even], refused=True)
    barrier = PeerSpec(plain_spec(BARRIER).words())
    assert standable(barrier) and _clean([barrier], refused=True)
    sized = peer(GATHER, x, Sized(0, (6, 6, 6, 6), None))
    assert not standable(sized) and not _clean([sized], refused=True)
    assert _clean([sized], refused=False)
    objects = PeerSpec(CallSpec(0).words())   # an object collective: no dtype, no array
    assert not standable(objects) and not _clean([objects], refused=True)
    assert _clean([], refused=True)           # no member entered the call


def test_a_dtype_this_process_cannot_name_is_not_taken_for_the_same_bytes():
    a = peer(ALL_REDUCE, rows("float32"), SUM)
    w = list(a.words())
    w[1] = 12345   # an id no name stands for here
    assert not same_bytes(a, PeerSpec(w))
    assert not _clean([a, PeerSpec(w)], refused=False)
