"""The auto-parallel context: MindSpore's data-parallel settings, process-wide.

``set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)``
as in MindSpore. Every key does something or says why not:

- :class:`mpicomm.DistributedGradReducer` reads, when it is made, ``gradients_mean``
  (when ``mean=None``), ``all_reduce_fusion_config`` (when ``fusion_config=None``),
  ``gradient_fp32_sync`` (when ``fp32_sync=None``; True by default, as MindSpore's) and
  ``parameter_broadcast`` (True: the parameters given to it are overwritten with group
  rank 0's, one fused broadcast); it checks ``device_num`` and ``global_rank`` against
  the world, and warns when ``parallel_mode="stand_alone"`` was set for more than one rank.
- ``device_num`` and ``global_rank`` must be the world's size and this process's rank
  (set while mpicomm is initialised, they are checked at once).
- The model-parallel modes and MindSpore's auto-parallel keys raise, saying that mpicomm
  does data parallelism only; ``full_batch=False`` and ``enable_parallel_optimizer=False``
  (what mpicomm does anyway) warn and are not stored.
"""
from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np

from .._state import CTX, WORLD
from ..errors import InvalidArgumentError, invalid

PARALLEL_MODES = ("stand_alone", "data_parallel")


class ParallelMode:
    """MindSpore's parallel-mode names: the strings ``parallel_mode`` takes.

    mpicomm does data parallelism only: STAND_ALONE and DATA_PARALLEL are accepted;
    SEMI_AUTO_PARALLEL, AUTO_PARALLEL and HYBRID_PARALLEL (operators or layers split
    across devices) raise InvalidArgumentError.
    """

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODE_LIST = [STAND_ALONE, DATA_PARALLEL, HYBRID_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL]


class _GlobalCommType(type):
    @property
    def BACKEND(cls):
        """"mpi" or "nccl" once mpicomm is initialised, else "undefined" (MindSpore's
        Backend.UNDEFINED)."""
        return CTX.backend_name if CTX.initialized else "undefined"

    @property
    def INITED(cls):
        """Whether mpicomm is initialised (:func:`mpicomm.is_initialized`)."""
        return bool(CTX.initialized)

    def __repr__(cls):
        return f"GlobalComm(BACKEND={cls.BACKEND!r}, WORLD_COMM_GROUP={cls.WORLD_COMM_GROUP!r}, INITED={cls.INITED})"


class GlobalComm(metaclass=_GlobalCommType):
    """MindSpore's ``GlobalComm``, read-only: ``BACKEND`` ("mpi" or "nccl" after
    :func:`mpicomm.init`, else "undefined"), ``WORLD_COMM_GROUP`` (the world group's
    name, for any ``group=`` argument; MindSpore's "nccl_world_group" and
    "hccl_world_group", and None, name it too) and ``INITED``."""

    WORLD_COMM_GROUP = WORLD


_DATA_PARALLEL_ONLY = ("mpicomm does data parallelism only: every rank holds the whole model and "
                       "DistributedGradReducer sums or averages the gradients")
# MindSpore keys from its auto-parallel guide that mpicomm has no counterpart for:
# key -> (the value that is what mpicomm does anyway, or _NONE; why)
_NONE = object()
_NOT_HERE = {
    "full_batch": (False, "each rank reads its own shard of the data set (mpicomm.DistributedSampler"
                          "(len(dataset)), or num_shards=get_group_size(), shard_id=get_rank()); every rank "
                          "reading all of it (full_batch=True) belongs to MindSpore's auto-parallel modes, "
                          "and mpicomm does data parallelism only"),
    "enable_parallel_optimizer": (False, "every rank keeps the whole optimizer state and applies the reduced "
                                         "gradients itself; mpicomm has no optimizer sharding"),
    "auto_parallel_search_mode": (_NONE, "it picks auto_parallel's sharding strategies; " + _DATA_PARALLEL_ONLY),
    "search_mode": (_NONE, "it picks auto_parallel's sharding strategies; " + _DATA_PARALLEL_ONLY),
    "strategy_ckpt_load_file": (_NONE, "sharding strategies belong to (semi_)auto_parallel; "
                                       f"{_DATA_PARALLEL_ONLY}, so a checkpoint is the whole model"),
    "strategy_ckpt_save_file": (_NONE, "sharding strategies belong to (semi_)auto_parallel; "
                                       f"{_DATA_PARALLEL_ONLY}, so a checkpoint is the whole model"),
}
# read by DistributedGradReducer when it is made
_READ_BY_REDUCER = ("gradients_mean", "all_reduce_fusion_config", "parameter_broadcast", "gradient_fp32_sync")

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
_SET = set()                    # keys set since the last reset (not their defaults)
_REDUCERS = weakref.WeakSet()   # the DistributedGradReducers alive, made under some setting


# parameter_broadcast=True with no DistributedGradReducer (nor broadcast_parameters) to act
# on it: mpicomm.ops.AllReduce's first call warns, once (see warn_unbroadcast)
broadcast_pending = False
_BROADCAST_DONE = False


def parameters_broadcast():
    """Note that parameters were broadcast from a root (broadcast_parameters ran)."""
    global broadcast_pending, _BROADCAST_DONE
    _BROADCAST_DONE = True
    broadcast_pending = False


def warn_unbroadcast(what):
    """Warn (world rank 0, once) that parameter_broadcast=True is set but nothing has been
    broadcast: MindSpore broadcasts rank 0's parameters at the start of training, mpicomm
    only where it is given the parameters (a DistributedGradReducer, broadcast_parameters)."""
    global broadcast_pending
    if not broadcast_pending:
        return
    broadcast_pending = False
    if CTX.initialized and CTX.world.rank == 0:
        warnings.warn(f"set_auto_parallel_context(parameter_broadcast=True) is set, but no parameters have been "
                      f"broadcast before this {what}: mpicomm broadcasts rank 0's parameters when a "
                      "DistributedGradReducer is made over them (MindSpore does it at the start of training); "
                      "a loop without a reducer must call mpicomm.broadcast_parameters(params) first, or its "
                      "ranks train from different weights", UserWarning, stacklevel=3)


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
        if isinstance(v, str) and v.lower() in PARALLEL_MODES:   # "DATA_PARALLEL" as "data_parallel"
            v = v.lower()
        if v not in PARALLEL_MODES:
            why = (f" ({v!r} splits the model across devices in MindSpore; {_DATA_PARALLEL_ONLY}: use "
                   "'data_parallel')" if v in ParallelMode.MODE_LIST else " (mpicomm implements data parallelism only)")
            raise invalid(key, v, "one of " + ", ".join(repr(m) for m in PARALLEL_MODES) + why)
        return v
    if key in ("gradients_mean", "parameter_broadcast", "gradient_fp32_sync"):
        return _bool(key, v)
    if key == "all_reduce_fusion_config":
        return check_fusion_config(v, key)
    if key == "device_num":
        return _int_in(key, v, 1, 4096)
    if key == "global_rank":
        return _int_in(key, v, 0, 4095)
    if key in _NOT_HERE:
        same, why = _NOT_HERE[key]
        if same is not _NONE and isinstance(v, (bool, np.bool_)) and bool(v) == same:
            return _NONE   # what mpicomm does anyway: warned about, not stored
        if same is _NONE:
            raise InvalidArgumentError(f"set_auto_parallel_context({key}={v!r}) is not supported: {why}")
        raise invalid(key, v, f"{same!r} or nothing: {why}")
    raise invalid("key", key, "one of " + ", ".join(sorted(_DEFAULTS))
                  + f" (MindSpore's model-parallel settings have no counterpart: {_DATA_PARALLEL_ONLY})")


def check_world(dn, gr):
    """Raise InvalidArgumentError when device_num ``dn`` or global_rank ``gr`` (None: not
    set) is not the world's size or this process's rank; nothing before init()."""
    if not CTX.initialized:
        return
    n, r = CTX.world.size, CTX.world.rank
    if dn is not None and dn != n:
        raise invalid("device_num", dn, f"{n}, the number of processes in this job: mpicomm's device count "
                      "is the world size that mpicomm-run -n (or mpirun -n) starts; leave device_num unset "
                      "to take it")
    if gr is not None and gr != r:
        raise invalid("global_rank", gr, f"{r}, this process's rank: the launcher numbers the processes, "
                      "and mpicomm cannot renumber them; leave global_rank unset to take it")


def set_auto_parallel_context(**kwargs):
    """Set data-parallel settings: parallel_mode ("stand_alone" or "data_parallel"),
    gradients_mean, all_reduce_fusion_config (split points, e.g. [20, 35]),
    parameter_broadcast, gradient_fp32_sync (bools), device_num (1..4096), global_rank
    (0..4095).

    ``parallel_mode`` also takes :class:`ParallelMode`'s names; the model-parallel modes
    raise. ``device_num`` and ``global_rank``, once mpicomm is initialised, must be the
    world's size and this process's rank. MindSpore's auto-parallel keys raise, saying
    why; ``full_batch=False`` and ``enable_parallel_optimizer=False`` warn (mpicomm does
    that anyway) and are not stored. DistributedGradReducer reads the settings when it
    is made: changing one of them while reducers exist warns that those keep theirs.

    All or nothing: raises InvalidArgumentError, changing nothing, for an unknown key or
    a value out of range, saying what is allowed.
    """
    new = {k: _check(k, v) for k, v in kwargs.items()}
    dn = new.get("device_num", _VALUES["device_num"])
    gr = new.get("global_rank", _VALUES["global_rank"])
    if dn is not None and gr is not None and gr >= dn:
        raise invalid("global_rank", gr, f"a rank below device_num={dn} (0..{dn - 1})")
    check_world(new.get("device_num"), new.get("global_rank"))   # (those set before init(): by the reducer)
    for k in [k for k, v in new.items() if v is _NONE]:
        del new[k]
        warnings.warn(f"set_auto_parallel_context({k}={kwargs[k]!r}) is not stored, as it is what mpicomm "
                      f"does anyway: {_NOT_HERE[k][1]}", UserWarning, stacklevel=2)
    changed = sorted(k for k in new if k in _READ_BY_REDUCER and new[k] != _VALUES[k])
    if changed and len(_REDUCERS):
        gc.collect()   # reducers of dropped models (DDP's hooks make cycles) are not counted
    if changed and len(_REDUCERS):
        warnings.warn(f"set_auto_parallel_context: {', '.join(changed)} changed after {len(_REDUCERS)} "
                      "DistributedGradReducer(s) were made; those keep the settings they were made with "
                      "(the context is read when a reducer is made)", UserWarning, stacklevel=2)
    _VALUES.update(new)
    _SET.update(new)
    global broadcast_pending
    broadcast_pending = bool(_VALUES["parameter_broadcast"]) and not _BROADCAST_DONE


def get_auto_parallel_context(key):
    """The value of one setting (see :func:`set_auto_parallel_context` for the keys).

    ``full_batch`` and ``enable_parallel_optimizer`` read False: what mpicomm does (each
    rank reads its own shard and keeps the whole optimizer state), as MindSpore's default."""
    if isinstance(key, str) and key in _NOT_HERE and _NOT_HERE[key][0] is not _NONE:
        return _NOT_HERE[key][0]
    if not isinstance(key, str) or key not in _DEFAULTS:
        readable = sorted([*_DEFAULTS, *(k for k, (same, _) in _NOT_HERE.items() if same is not _NONE)])
        raise invalid("key", key, "one of " + ", ".join(readable))
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
    global broadcast_pending, _BROADCAST_DONE
    _VALUES.clear()
    _VALUES.update(_DEFAULTS)
    _SET.clear()
    broadcast_pending = _BROADCAST_DONE = False


def reducer_settings(mean, fp32_sync):
    """What a DistributedGradReducer being made takes from the context:
    ``(mean, fp32_sync, parameter_broadcast)``. ``mean=None``: gradients_mean;
    ``fp32_sync=None``: gradient_fp32_sync (True by default, as MindSpore's: what
    ``get_auto_parallel_context("gradient_fp32_sync")`` says is what the reducer does). Raises InvalidArgumentError when device_num or
    global_rank disagrees with the world."""
    check_world(_VALUES["device_num"], _VALUES["global_rank"])
    if mean is None:
        mean = _VALUES["gradients_mean"]
    if fp32_sync is None:
        fp32_sync = _VALUES["gradient_fp32_sync"]
    return mean, fp32_sync, _VALUES["parameter_broadcast"]


def reducer_made(reducer, group_size):
    """Note a new DistributedGradReducer; warn where parallel_mode="stand_alone" was set
    and the reducer reduces over more than one rank anyway."""
    _REDUCERS.add(reducer)
    if group_size > 1 and "parallel_mode" in _SET and _VALUES["parallel_mode"] == "stand_alone":
        warnings.warn(f"parallel_mode='stand_alone' is set, but this DistributedGradReducer reduces the "
                      f"gradients of {group_size} ranks: mpicomm's reducer always does (it is data "
                      "parallelism); set parallel_mode='data_parallel' to say so, or make no reducer to "
                      "train each rank alone", UserWarning, stacklevel=3)


__all__ = ["set_auto_parallel_context", "get_auto_parallel_context", "reset_auto_parallel_context",
           "ParallelMode", "GlobalComm", "InvalidArgumentError"]
