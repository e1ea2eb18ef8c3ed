"""mpicomm: collective communication for data-parallel training and HPC jobs.

This module defines the public API. Importing it does not initialise MPI, touch a
GPU, install hooks or print: call :func:`init` first, under ``mpirun``.
"""
from typing import Any

from ._collectives import (all_gather, all_reduce, all_to_all, barrier, broadcast, recv, reduce, reduce_scatter,
                           send)
from ._collectives import P2POp, batch, batch_isend_irecv, gather, scatter, sendrecv
from ._operators import AllGather, AllGatherV, AllReduce, AlltoAll, Broadcast, ReduceScatter, ReduceScatterV
from ._backends.base import Work
from ._objects import (all_gather_object, broadcast_object, gather_object, recv_object, scatter_object,
                       send_object)
from ._reliability.flight import dump_flight_record
from ._replay import Captured, capture, replay
from ._world import (create_group, destroy_group, finalize, get_backend, get_group_rank_from_world_rank,
                     get_group_size, get_local_rank, get_local_rank_size, get_local_size, get_process_group_ranks,
                     get_rank, get_world_rank_from_group_rank, init, is_initialized, release)
from .errors import (BackendUnavailableError, CollectiveMismatchError, CollectiveTimeoutError,
                     CommunicationError, InvalidArgumentError, MpicommError, NotInitializedError)
from ._ops import ReduceOp

__version__ = "0.1.0"

# mindspore.communication's names for the world group (any group= argument takes them)
NCCL_WORLD_COMM_GROUP = "nccl_world_group"
HCCL_WORLD_COMM_GROUP = "hccl_world_group"

# Data-parallel training helpers, imported on first use (mpicomm.DistributedGradReducer, ...).
_LAZY = {
    "DistributedGradReducer": "training.reducer", "all_reduce_coalesced": "training.fused",
    "broadcast_parameters": "training.fused", "average": "training.averaging",
    "save_on_rank0": "training.checkpoint", "load_on_rank0": "training.checkpoint",
    "set_auto_parallel_context": "training.context", "get_auto_parallel_context": "training.context",
    "reset_auto_parallel_context": "training.context",
    "ParallelMode": "training.context", "GlobalComm": "training.context",
    "DistributedSampler": "training.sampler", "DistributedBatchSampler": "training.sampler",
}

_NO_MODES = ("has no counterpart: mpicomm has no execution modes, and the device follows the backend "
             "init() takes; leave the line out")
# MindSpore names that a script ported with `import mpicomm as ms` may still use
_NOT_HERE = {
    "set_context": _NO_MODES, "GRAPH_MODE": _NO_MODES, "PYNATIVE_MODE": _NO_MODES,
    "set_seed": ("has no counterpart: mpicomm owns no random generators; seed your framework as before, "
                 "and start every rank from rank 0's weights with set_auto_parallel_context("
                 "parameter_broadcast=True) or mpicomm.broadcast_parameters(params)"),
    "Tensor": "has no counterpart: mpicomm owns no tensors; pass NumPy or CuPy arrays or PyTorch tensors",
    "value_and_grad": "has no counterpart: autograd stays your framework's",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "ops":  # MindSpore-style operators: mpicomm.ops.AllGather, as mindspore.ops
        return importlib.import_module(f"{__name__}.ops")
    mod = _LAZY.get(name)
    if mod is None:
        hint = _NOT_HERE.get(name)
        raise AttributeError(f"module 'mpicomm' has no attribute {name!r}"
                             + (f": MindSpore's {name} {hint} (docs/PORTING.md)" if hint else ""))
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


def __dir__() -> list[str]:   # the names loaded on first use too (tab completion, dir(mpicomm))
    return sorted(set(globals()) | set(_LAZY) | {"ops"})


__all__ = [
    "init", "finalize", "release", "is_initialized", "get_backend",
    "get_rank", "get_group_size", "get_local_rank", "get_local_size", "get_local_rank_size",
    "create_group", "destroy_group", "get_world_rank_from_group_rank", "get_group_rank_from_world_rank",
    "get_process_group_ranks",
    "NCCL_WORLD_COMM_GROUP", "HCCL_WORLD_COMM_GROUP", "ReduceOp", "Work",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
    "send", "recv", "barrier", "dump_flight_record", "replay", "capture", "Captured",
    "gather", "scatter", "sendrecv", "batch", "P2POp", "batch_isend_irecv", "AllGatherV", "ReduceScatterV",
    "all_gather_object", "broadcast_object", "gather_object", "scatter_object", "send_object", "recv_object",
    "AllReduce", "AllGather", "ReduceScatter", "Broadcast", "AlltoAll",
    "MpicommError", "NotInitializedError", "BackendUnavailableError", "InvalidArgumentError",
    "CommunicationError", "CollectiveTimeoutError", "CollectiveMismatchError",
    *_LAZY,
]
