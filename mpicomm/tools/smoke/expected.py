"""The smoke test's data and its closed-form expectations: what rank k sends (a pattern
per op, dtype and key), the reduced result of several keys without running the
collective, and the comparison of a result with it (exact for integers, within a
tolerance for floats)."""
from __future__ import annotations

import functools

import numpy as np

# lcm(3, 5, 7, 11): every value pattern below repeats after this many elements
PERIOD = 1155


def np_dtype(name):
    """The NumPy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        from ..._dtypes import BFLOAT16

        if BFLOAT16 is None:
            raise ValueError("bfloat16 needs ml_dtypes")
        return BFLOAT16
    return np.dtype(name)


def dtype_kind(dt):
    if dt.kind in "iub":
        return dt.kind
    if dt.kind == "c":
        return "c"
    return "f"  # float16/32/64 and ml_dtypes' bfloat16 (kind 'V')


def _exact_limit(dt):
    """Largest magnitude the dtype holds exactly as an integer."""
    if dt.kind in "iu":
        return min(np.iinfo(dt).max, 1 << 23)
    return {2: 256 if dt.kind == "V" else 2048, 4: 1 << 24, 8: 1 << 24, 16: 1 << 24}[dt.itemsize] \
        if dt.kind != "c" else 1 << 24


@functools.lru_cache(maxsize=4096)
def pattern(op, dt, key):
    """One period of the data with ``key`` (a rank, or rank + n*chunk) for ``op``.

    Integer-valued, in int64 (float64/complex128 for complex), small enough that every
    reduction is exact in ``dt``: SUM/AVG values -2..4 (1..7 unsigned), PROD values
    +-1 and +-2, MIN/MAX -5..5 (0..10 unsigned). ``op=None`` (data movement) encodes
    the key itself, so a chunk from the wrong rank or place never matches.
    """
    k = np.arange(PERIOD, dtype=np.int64)
    kind = dtype_kind(dt)
    if kind == "b":   # True and False, a different sequence for each key and op
        salt = {None: 0, "sum": 1, "max": 1, "prod": 2, "min": 2}[op]
        v = ((k * (2 * key + 1) + 3 * key + salt) % 7 < 3) ^ ((k * (key + 1) + key + salt) % 11 < 5)
        if salt == 2:   # for AND mostly True, so that the result is not all False
            v |= (k + key) % 3 == 0
        v.flags.writeable = False
        return v
    signed = kind != "u"
    if op in ("sum", "avg"):
        v = (key * 3 + k) % 7 + 1 - (3 if signed else 0)
    elif op == "prod":
        v = np.where((key + k) % 3 == 0, 2, 1)
        if signed:
            v = v * np.where((key + 2 * k) % 5 == 0, -1, 1)
    elif op in ("min", "max"):
        v = (key * 5 + k * 3) % 11 - (5 if signed else 0)
    else:  # data movement: the key, visibly
        lim = _exact_limit(dt)
        m = max(1, (2 * lim if signed else lim) // 8 - 1)
        v = k % 7 + 1 + 8 * (key % m) - (lim - 1 if signed else 0)
    if kind == "c":
        v = v + 1j * pattern(op, np.dtype("float64"), key + 1)
    v.flags.writeable = False  # cached: shared by every caller
    return v


def make_data(op, dt, key, count, shape=None):
    """``count`` elements of ``pattern(op, dt, key)`` as a NumPy array of dtype ``dt``."""
    base = pattern(op, dt, key).astype(dt)
    a = np.resize(base, count) if count else np.empty(0, dt)
    return a.reshape(shape) if shape is not None else a


def reduce_keys(op, dt, keys, count):
    """The exact result of reducing ``make_data(op, dt, key, count)`` over ``keys`` with ``op``."""
    r = _reduced_period(op, dt, tuple(keys))
    return np.resize(r, count) if count else np.empty(0, dt)


@functools.lru_cache(maxsize=1024)
def _reduced_period(op, dt, keys):
    stack = np.stack([pattern(op, dt, key) for key in keys])
    if dt.kind == "b":   # SUM and MAX: logical OR; PROD and MIN: logical AND
        return (stack.any(axis=0) if op in ("sum", "max") else stack.all(axis=0)).astype(dt)
    if op in ("sum", "avg"):
        r = stack.sum(axis=0)
        if op == "avg":
            r = r / len(keys)
    elif op == "prod":
        r = stack.prod(axis=0)
    elif op == "min":
        r = stack.min(axis=0)
    else:
        r = stack.max(axis=0)
    if dt.kind in "iu":
        r = r.astype(np.int64).astype(dt)  # wraps like the transport's integer arithmetic
    else:
        r = r.astype(dt)
    return r


def tolerance(dt):
    """rtol (= atol, values are O(1..1000)) for comparing a float result."""
    if dt.kind == "V" or dtype_kind(dt) == "f" and dt.itemsize == 2:
        return 1e-2 if dt.kind == "V" else 2e-3
    if dt.itemsize <= 4 or dt == np.dtype("complex64"):
        return 1e-5
    return 1e-12


_CHUNK = 1 << 22  # elements compared at a time: bounded temporaries for GiB-sized results


def wrong_mask(got, exp, dt):
    """Boolean array: where ``got`` differs from ``exp`` (exactly for integers, else
    beyond :func:`tolerance`). Same shapes assumed."""
    if dt.kind in "iub":
        return got != exp
    wide = np.complex128 if dt.kind == "c" else np.float64
    g, e = got.astype(wide), exp.astype(wide)
    return ~(np.abs(g - e) <= tolerance(dt) * (1 + np.abs(e)))


def count_wrong(got, exp, dt):
    """(number of wrong elements, flat index of the first or None), in chunks."""
    g, e = np.asarray(got).reshape(-1), np.asarray(exp).reshape(-1)
    nbad, first = 0, None
    for i in range(0, e.size, _CHUNK):
        bad = wrong_mask(g[i:i + _CHUNK], e[i:i + _CHUNK], dt)
        k = int(np.count_nonzero(bad))
        if k and first is None:
            first = i + int(np.flatnonzero(bad)[0])
        nbad += k
    return nbad, first


def compare(got, exp, dt):
    """None if ``got`` matches ``exp``, else a short description of the first mismatch."""
    if got is None:
        return "no result (None)"
    got = np.asarray(got)
    if got.shape != exp.shape:
        return f"shape {got.shape}, expected {exp.shape}"
    if got.dtype != exp.dtype:
        return f"dtype {got.dtype}, expected {exp.dtype}"
    if exp.size == 0:
        return None
    nbad, i = count_wrong(got, exp, dt)
    if not nbad:
        return None
    return (f"{nbad} of {exp.size} element(s) wrong, first at [{i}]: got {got.ravel()[i]!r}, "
            f"expected {exp.ravel()[i]!r}")
