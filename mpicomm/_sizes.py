"""The checks made before a collective reaches its group's dispatcher, and per-rank sizes.

``early`` runs one such check and publishes a refusal as the group's next call, so that
the members whose arguments passed do not wait in it. ``sized`` and ``splits`` make the
Sized arg of the calls with per-rank sizes (gather, scatter, all_gather and
reduce_scatter with ``sizes=``, all_to_all with ``in_splits``/``out_splits``): explicit
sizes are checked here; ``"auto"`` (and every call in debug mode) exchanges each rank's
call descriptor first and raises CollectiveMismatchError on every rank where they differ.
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import numpy as np

from ._callspec import dtype_id, dtype_of_id
from ._ops import ALL_TO_ALL, GATHER, NAMES, REDUCE_SCATTER, SCATTER, ReduceOp, Sized
from ._state import CTX
from ._arrays import list_hint
from .errors import CollectiveMismatchError, InvalidArgumentError, RefusedElsewhereError, TypeOf, invalid


def raise_(e):
    raise e


def early(g, code, fn, *args):
    """``fn(*args)``, a check of collective ``code``'s arguments before the group's
    dispatcher sees the call; when it raises, the refusal is published as the group's next
    call (mpicomm._reliability.agreement), so that members whose arguments passed do not
    wait in it, then raised."""
    try:
        return fn(*args)
    except Exception as e:
        d = g.disp
        if d is not None and d.check and g.size > 1:
            d.refuse_early(code, e)   # raises e
        raise


def root_of(g, root):
    if isinstance(root, (int, np.integer)) and not isinstance(root, bool) and 0 <= root < g.size:
        return int(root)
    raise invalid("root", root, f"a group rank in 0..{g.size - 1}")


_CHECKED: set[Any] = set()   # (group size, sizes, their types) found valid: a repeated call skips the checks


def _check_sizes(g, sizes, arg="sizes"):
    """``sizes`` as a tuple of ints, one non-negative int per rank of the group."""
    n = g.size
    if sizes.__class__ is list or sizes.__class__ is tuple:
        t = tuple(sizes)
        try:   # the types too: True == 1 and 1.0 == 1, but neither is a size
            if (n, t, tuple(map(type, t))) in _CHECKED:
                return t
        except TypeError:   # an unhashable entry: refused below
            pass
    try:
        # a 1-D array of sizes (NumPy, PyTorch: Horovod's int32 splits tensor, CuPy) by its values:
        # a tensor's elements are 0-d tensors, no ints; floats and bools stay refused below
        t = tuple(sizes.tolist() if getattr(sizes, "ndim", None) == 1 and hasattr(sizes, "tolist") else sizes)
    except TypeError:
        t = None
    if t is None or len(t) != n or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                           and v >= 0 for v in t):
        raise invalid(arg, sizes, f"'auto' or a sequence of {n} non-negative ints (one axis-0 length per "
                      f"rank of group {g.name!r})")
    kinds = tuple(map(type, t))
    if all(k is int for k in kinds):   # plain ints: what a hit returns as it is
        if len(_CHECKED) > 1024:
            _CHECKED.clear()
        _CHECKED.add((n, t, kinds))
    return tuple(int(v) for v in t)


def _not_captured(arg):
    """'auto' exchanges the sizes on the host, once: refused while a CUDA graph is being
    captured (a replay would reuse the sizes of the capture)."""
    from ._backends.capture import current_capturing

    if current_capturing():
        raise invalid(arg, "auto", "explicit sizes during a CUDA graph capture ('auto' exchanges them on the "
                      "host once, at capture, and a replay would reuse them)")


def sized(g, code, x, base, sizes):
    """The Sized arg of a call: explicit sizes checked here; 'auto' (and every call in debug
    mode) exchanged with each rank's call signature. scatter's, after an exchange, is its
    ScatterFacts."""
    if code in (GATHER, SCATTER):
        base = root_of(g, base)
    auto = isinstance(sizes, str)
    if auto and sizes != "auto":
        raise invalid("sizes", sizes, f"'auto' or a sequence of {g.size} non-negative ints")
    if not auto and sizes is not None:
        sizes = _check_sizes(g, sizes)
    if not auto and not CTX.debug:
        return Sized(base, sizes)
    if auto:
        _not_captured("sizes")
    allv = _exchange(g, code, x, base, sizes)
    if code == SCATTER:
        return _scatter_facts(g, allv, base, sizes, auto)
    if auto:
        own = allv[:, _OWN]
        if (own < 0).any():
            bad = [r for r in range(g.size) if own[r] < 0]
            raise invalid("x", "a 0-d array (no axis 0)", f"an array with an axis 0 on every rank "
                          f"({NAMES[code]} with sizes='auto'; ranks {bad} gave none)")
        sizes = tuple(int(v) for v in own)
    return Sized(base, sizes)


def splits(g, x, out, in_splits, out_splits):
    """all_to_all's Sized arg (None, in_splits, out_splits).

    The splits pair up between ranks (rank i's in_splits[j] rows go to rank j, which expects
    its out_splits[i]), so no rank can check them alone: with the agreement check on (the
    default), in debug mode and for out_splits='auto', each rank's rows to and from every
    peer are exchanged first, and where a pair differs every rank raises
    CollectiveMismatchError naming both ranks and values (MPI would leave rows of the
    result unwritten, or fail on one rank only). A rank's own invalid splits are raised there
    after the exchange, and as a refusal elsewhere."""
    n = g.size
    auto = isinstance(out_splits, str)
    if not auto and not CTX.debug and not CTX.check:
        if in_splits is not None:
            in_splits = _check_sizes(g, in_splits, "in_splits")
        if out_splits is not None:
            out_splits = _check_sizes(g, out_splits, "out_splits")
        return Sized(None, in_splits, out_splits)
    own = None   # this rank's InvalidArgumentError, raised after the exchange (the others refuse)
    try:
        if auto and out_splits != "auto":
            raise invalid("out_splits", out_splits, f"'auto' or a sequence of {n} non-negative ints")
        if auto:
            _not_captured("out_splits")
        if in_splits is not None:
            in_splits = _check_sizes(g, in_splits, "in_splits")
        if not auto and out_splits is not None:
            out_splits = _check_sizes(g, out_splits, "out_splits")
        ins, outs = _rows(g, x, out, in_splits, None if auto else out_splits, auto)
        row = (2 if auto else 1,) + ins + outs   # (0: refused here; 1: splits; 2: out_splits='auto')
    except InvalidArgumentError as e:
        own, row = e, (0,) + (-1,) * (2 * n)
    # (with the call's descriptor: dtype and trailing shape compared there too)
    allv = _exchange(g, ALL_TO_ALL, x, None, None, row)[:, _HDR:]
    if own is not None:
        raise own
    how = allv[:, 0]
    if not (how == row[0]).all():
        bad = [q for q in range(n) if how[q] == 0]
        if bad:
            raise RefusedElsewhereError(
                f"{_who(g, bad[0])} refused all_to_all on group {g.name!r}: InvalidArgumentError: its in_splits, "
                "out_splits or x.shape are invalid there (that rank raised the error naming them)")
        named = ", ".join(_who(g, q) for q in range(n) if how[q] == 2)
        raise CollectiveMismatchError(
            f"all_to_all with splits on group {g.name!r}: out_splits='auto' on {named}, a list or None on "
            "the others: every rank passes out_splits='auto', or none does")
    sent = allv[:, 1:1 + n]                  # sent[i, j]: the rows rank i sends to rank j
    if auto:
        return Sized(None, in_splits, tuple(int(v) for v in sent[:, g.rank]))
    want = allv[:, 1 + n:]                   # want[j, i]: the rows rank j expects from rank i
    if not (sent == want.T).all():
        pairs = [(i, j) for i in range(n) for j in range(n) if sent[i, j] != want[j, i]]
        said = "; ".join(f"{_who(g, i)} sends {_rows_of(sent[i, j])} to {_who(g, j)} (in_splits[{j}] = "
                         f"{sent[i, j]} there), which expects {want[j, i]} (out_splits[{i}] = {want[j, i]} there)"
                         for i, j in pairs[:4])
        more = f"; and {len(pairs) - 4} more pairs" if len(pairs) > 4 else ""
        raise CollectiveMismatchError(
            f"all_to_all with splits on group {g.name!r}: the ranks' splits do not pair up: {said}{more}. "
            "in_splits[j] on rank i must equal out_splits[i] on rank j (out_splits=None: n equal parts of "
            "out's axis 0, or of x's; out_splits='auto' takes them from the senders)")
    return Sized(None, in_splits, out_splits)


def _rows_of(v):
    return f"{v} row" if v == 1 else f"{v} rows"


def _who(g, q):
    """'rank q', with its world rank in a group that is not the world."""
    return f"rank {q}" if g.name == "world" else f"rank {q} (world rank {g.ranks[q]})"


def _rows(g, x, out, ins, outs, auto):
    """(rows sent to each rank, rows expected from each) of this rank's all_to_all, checked as
    the transport checks them (None: n equal parts of x's axis 0 / of out='s, else x's);
    ``auto``: nothing expected yet (-1 each)."""
    n = g.size
    shape = getattr(x, "shape", None)
    shape = tuple(shape) if shape is not None else _facts(x)[0]
    if not shape:
        raise invalid("x.shape", shape, "an array with an axis 0 (all_to_all splits or joins along it)")
    d0, trail = shape[0], shape[1:]
    if ins is None:
        if d0 % n:
            raise invalid("x.shape", shape, f"a first axis divisible by the group size {n}, or in_splits"
                          + (" (out_splits='auto')" if auto else ""))
        ins = (d0 // n,) * n
    elif sum(ins) != d0:
        raise invalid("in_splits", list(ins), f"sizes that add up to x.shape[0] = {d0} (on rank {g.rank})")
    if auto:
        return ins, (-1,) * n
    if outs is None:   # the output split evenly: out='s axis 0, else x's (as the transports)
        oshape0 = getattr(out, "shape", None) if out is not None and out is not x else None
        o0 = int(oshape0[0]) if oshape0 else d0
        if o0 % n:
            raise invalid("out.shape", (o0,) + tuple(trail), f"a first axis divisible by the group size {n}, "
                          "or out_splits (a list, or 'auto')")
        outs = (o0 // n,) * n
    return ins, outs


# the exchanged descriptor: collective, dtype, array kind, ndim, trailing shape (6 dims, or a
# hash), op or root, own axis-0 length, a hash of the explicit sizes; then any per-rank values
_KINDS = ("a host array", "a CuPy/GPU array", "a PyTorch CPU tensor", "a PyTorch CUDA tensor")
_OPS = tuple(ReduceOp)
_OWN, _SZ, _HDR = 11, 12, 13
_SAME = [*range(_OWN), _SZ]   # the fields that are alike on every rank where nothing differs


def _facts(x):
    """(shape, dtype name, kind index) of an array, or (None, None, -1) for None."""
    if x is None:
        return None, None, -1
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        kind = 3 if x.is_cuda else 2
    elif mod == "cupy" or hasattr(x, "__cuda_array_interface__"):
        kind = 1
    else:
        kind = 0
    if shape is None or dtype is None:
        try:
            a = np.asarray(memoryview(x))
            shape, dtype = a.shape, a.dtype
        except TypeError:
            raise invalid("x", TypeOf(x), "an array (NumPy, CuPy, PyTorch, or the buffer protocol)" + list_hint(x)) from None
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).replace("torch.", "")
    return tuple(int(s) for s in shape), name, kind


_NAMES: dict[Any, str] = {}   # dtype object -> its name (str() of a NumPy dtype costs microseconds)


def _exchange(g, code, x, base, sizes, extra=()):
    """Allgather each rank's call descriptor; raise CollectiveMismatchError on every rank where
    the collective, dtype, trailing shape, op/root or explicit sizes differ. Returns the table."""
    from mpi4py import MPI

    shape, dtype, kind = _facts(x)
    h = [-1] * _HDR   # (a list, made an array once: cheaper than setting an array's items)
    h[0] = code
    if dtype is not None:
        h[1] = dtype_id(dtype)   # (the CallSpec's dtype word: mpicomm._callspec)
        h[2] = kind
        h[3] = len(shape)
        trail = shape[1:]
        if len(trail) <= 6:
            h[4:4 + len(trail)] = trail
        else:
            h[4] = zlib.crc32(repr(trail).encode()) | 1 << 40
        h[_OWN] = shape[0] if shape else -1
    if base is not None:
        h[10] = _OPS.index(base) if isinstance(base, ReduceOp) else base
    h[_SZ] = zlib.crc32(repr(sizes).encode()) if sizes is not None else -1
    v = np.array(h + list(extra), np.int64)
    allv = np.empty((g.size, len(v)), np.int64)
    g.disp.watched(code, lambda: g.mpi_comm.Allgather([v, MPI.INT64_T], [allv, MPI.INT64_T]))
    # scatter: only the root's x is known; ranks without an out= give no dtype (-1: any)
    if (allv[:, _SAME] == v[_SAME]).all():   # (the common case: every field alike on every rank)
        return allv
    known = allv[:, 1] != -1
    fields = {"collective": [0], "dtype": [1], "trailing shape": list(range(3, 10)), "op or root": [10],
              "sizes": [_SZ]}
    diff = []
    for name, idx in fields.items():
        rows = allv[:, idx] if name in ("collective", "op or root", "sizes") else allv[known][:, idx]
        if len(rows) and (rows != rows[0]).any():
            diff.append(name)
    if diff:
        lines = "\n".join(f"  rank {r} (world rank {g.ranks[r]}): {_describe(allv[r])}" for r in range(g.size))
        raise CollectiveMismatchError(
            f"{NAMES[code]} with per-rank sizes on group {g.name!r}: the ranks' calls differ in "
            f"{', '.join(diff)}:\n{lines}\n  every rank must make the same call (same collective, dtype, "
            "trailing shape, op or root, and sizes)")
    return allv


def _describe(d):
    parts = [NAMES.get(int(d[0]), f"collective#{int(d[0])}")]
    if d[1] != -1:
        c = int(d[1])
        parts.append(f"dtype={dtype_of_id(c) or '#%d' % c}")
        nd = int(d[3])
        if nd >= 1 and nd - 1 <= 6:
            parts.append(f"trailing shape={tuple(int(s) for s in d[4:4 + nd - 1])}")
        elif nd == 0:
            parts.append("shape=()")
    if d[10] != -1:
        parts.append(f"op/root={int(d[10])}" if int(d[0]) not in (REDUCE_SCATTER,) else
                     f"op={_OPS[int(d[10])].value}")
    if d[_SZ] != -1:
        parts.append("sizes given")
    return " ".join(parts)


class ScatterFacts(NamedTuple):
    """scatter's arg after its exchange: the ``root``, the ``sizes`` (None: even parts), and
    this rank's ``out`` made from the root's facts (sizes='auto' away from the root; else None)."""

    root: int
    sizes: Any
    out: Any


def _scatter_facts(g, allv, root, sizes, auto):
    """ScatterFacts after scatter's exchange."""
    r = allv[root]
    if r[1] == -1 or r[3] < 1:
        raise invalid("x", "no array with an axis 0 on the root", f"the array to scatter on the root {root}")
    if not auto:
        missing = [q for q in range(g.size) if q != root and allv[q, 1] == -1]
        if missing:   # every rank knows it here: all raise, none waits in the scatter
            raise invalid("out", None, f"an array of its part of the root's x on every rank but the root {root}, "
                          f"or sizes='auto' on every rank (ranks {missing} gave no out=)")
        return ScatterFacts(root, sizes, None)
    n, d0 = g.size, int(r[_OWN])
    if d0 % n:
        raise invalid("x.shape", f"axis 0 of {d0} on the root", f"a first axis divisible by the group size {n} "
                      "(scatter with sizes='auto' gives each rank an equal part; pass sizes for unequal ones)")
    dt = dtype_of_id(int(r[1]))
    if dt is None or r[3] - 1 > 6:
        raise invalid("x", "the root's array", "a dtype and shape scatter can describe to the other ranks")
    shape = (d0 // n,) + tuple(int(s) for s in r[4:4 + int(r[3]) - 1])
    return ScatterFacts(root, None, _alloc(int(r[2]), shape, dt) if g.rank != root else None)


def _alloc(kind, shape, dtype):
    """A new array of ``kind`` (_KINDS) for scatter's received part on a non-root rank."""
    if kind in (2, 3):
        import torch

        dev = f"cuda:{CTX.device_id}" if kind == 3 and CTX.device_id is not None else ("cuda" if kind == 3 else "cpu")
        return torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    if kind == 1:
        import cupy

        return cupy.empty(shape, dtype)
    from ._dtypes import BFLOAT16

    return np.empty(shape, BFLOAT16 if dtype == "bfloat16" else dtype)
