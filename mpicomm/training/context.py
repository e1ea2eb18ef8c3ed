"""The auto-parallel context: MindSpore's data-parallel settings, process-wide.

``set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)`` as
in MindSpore; :class:`mpicomm.DistributedGradReducer` reads ``gradients_mean`` (when
``mean=None``) and ``all_reduce_fusion_config`` (when ``fusion_config=None``) from it.
"""
from __future__ import annotations

import numpy as np

from .._state import CTX
from ..errors import InvalidArgumentError, invalid

PARALLEL_MODES = ("stand_alone", "data_parallel")

# MindSpore's defaults; device_num and global_rank None mean "not set" (get returns the
# world's size and rank once mpicomm is initialised, else 1 and 0).
_DEFAULTS = {
    "parallel_mode": "stand_alone",
    "gradients_mean": False,
    "all_reduce_fusion_config": [],
    "parameter_broadcast": False,
    "gradient_fp32_sync": True,
    "device_num": None,
    "global_rank": None,
}
_VALUES = dict(_DEFAULTS)


def _int_in(key, v, lo, hi):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise invalid(key, v, f"an int in {lo}..{hi}")
    return int(v)


def _bool(key, v):
    if not isinstance(v, (bool, np.bool_)):
        raise invalid(key, v, "True or False")
    return bool(v)


def check_fusion_config(fc, arg="fusion_config"):
    """Validate MindSpore split points: strictly increasing 0-based ints; returns a list."""
    if fc is None:
        return None
    allowed = ("a strictly increasing list of 0-based gradient indices >= 0 (inclusive ends of "
               "the fused segments, in forward order), e.g. [20, 35]")
    if not isinstance(fc, (list, tuple)):
        raise invalid(arg, fc, allowed)
    out = []
    for v in fc:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise invalid(arg, list(fc), allowed + f" (bad entry: {v!r})")
        if out and v <= out[-1]:
            raise invalid(arg, list(fc), allowed + f" ({v} does not follow {out[-1]})")
        out.append(int(v))
    return out


def _check(key, v):
    if key == "parallel_mode":
        if v not in PARALLEL_MODES:
            raise invalid(key, v, "one of " + ", ".join(repr(m) for m in PARALLEL_MODES)
                          + " (mpicomm implements data parallelism only)")
        return v
    if key in ("gradients_mean", "parameter_broadcast", "gradient_fp32_sync"):
        return _bool(key, v)
    if key == "all_reduce_fusion_config":
        return check_fusion_config(v, key)
    if key == "device_num":
        return _int_in(key, v, 1, 4096)
    if key == "global_rank":
        return _int_in(key, v, 0, 4095)
    raise invalid("key", key, "one of " + ", ".join(sorted(_DEFAULTS)))


def set_auto_parallel_context(**kwargs):
    """Set data-parallel settings: parallel_mode ("stand_alone" or "data_parallel"),
    gradients_mean, all_reduce_fusion_config (split points, e.g. [20, 35]),
    parameter_broadcast, gradient_fp32_sync (bools), device_num (1..4096), global_rank
    (0..4095).

    All or nothing: raises InvalidArgumentError, changing nothing, for an unknown key or
    a value out of range, saying what is allowed.
    """
    new = {k: _check(k, v) for k, v in kwargs.items()}
    dn = new.get("device_num", _VALUES["device_num"])
    gr = new.get("global_rank", _VALUES["global_rank"])
    if dn is not None and gr is not None and gr >= dn:
        raise invalid("global_rank", gr, f"a rank below device_num={dn} (0..{dn - 1})")
    _VALUES.update(new)


def get_auto_parallel_context(key):
    """The value of one setting (see :func:`set_auto_parallel_context` for the keys)."""
    if not isinstance(key, str) or key not in _DEFAULTS:
        raise invalid("key", key, "one of " + ", ".join(sorted(_DEFAULTS)))
    v = _VALUES[key]
    if v is None:
        if key == "device_num":
            return CTX.world.size if CTX.initialized else 1
        return CTX.world.rank if CTX.initialized else 0
    if isinstance(v, list):
        return list(v)
    return v


def reset_auto_parallel_context():
    """Restore every setting to its default."""
    _VALUES.clear()
    _VALUES.update(_DEFAULTS)


__all__ = ["set_auto_parallel_context", "get_auto_parallel_context", "reset_auto_parallel_context",
           "InvalidArgumentError"]
