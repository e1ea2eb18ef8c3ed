"""Data-parallel training helpers, built on the collectives of :mod:`mpicomm`.

- :mod:`~mpicomm.training.reducer`: :class:`DistributedGradReducer`, gradients reduced in
  persistent fused buckets, over the bucket plan of :mod:`~mpicomm.training.planner`
  (``plan_buckets``), the buckets of :mod:`~mpicomm.training.layout`, the array families of
  :mod:`~mpicomm.training.families` and the CUDA copy kernel of
  :mod:`~mpicomm.training.copy_kernel`.
- :mod:`~mpicomm.training.fused`: one-off fused calls (:func:`all_reduce_coalesced`,
  :func:`broadcast_parameters`).
- :mod:`~mpicomm.training.context`: the auto-parallel context, MindSpore's process-wide
  data-parallel settings (:func:`set_auto_parallel_context` and its get and reset).
- :mod:`~mpicomm.training.averaging` (:func:`average`, a loss or metric over the ranks) and
  :mod:`~mpicomm.training.checkpoint` (:func:`save_on_rank0`, :func:`load_on_rank0`).
- :mod:`~mpicomm.training.sampler`: :class:`DistributedSampler` (MindSpore's) and
  :class:`DistributedBatchSampler` (Paddle's), each rank's share of a data set's indices.

The same names are reachable as ``mpicomm.DistributedGradReducer`` and so on; ``import
mpicomm`` loads this package only when one of them is first used.
"""
from .averaging import average
from .checkpoint import load_on_rank0, save_on_rank0
from .fused import all_reduce_coalesced, broadcast_parameters
from .reducer import DistributedGradReducer
from .context import get_auto_parallel_context, reset_auto_parallel_context, set_auto_parallel_context
from .sampler import DistributedBatchSampler, DistributedSampler

__all__ = ["DistributedGradReducer", "all_reduce_coalesced", "broadcast_parameters",
           "set_auto_parallel_context", "get_auto_parallel_context", "reset_auto_parallel_context",
           "DistributedSampler", "DistributedBatchSampler", "average", "save_on_rank0", "load_on_rank0"]
