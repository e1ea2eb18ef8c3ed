"""Gradient fusion, by job (this module re-exports the names it held before the split):

- :mod:`~mpicomm.training.families`: the NumPy, CuPy and PyTorch array families;
- :mod:`~mpicomm.training.streams`: CUDA stream helpers (PyTorch's stream for CuPy kernels);
- :mod:`~mpicomm.training.copy_kernel`: the CUDA kernel that packs a bucket in one launch;
- :mod:`~mpicomm.training.planner`: which gradients share a bucket (``plan_buckets``);
- :mod:`~mpicomm.training.layout`: one bucket's buffers, wire dtype, mean and direct gradients;
- :mod:`~mpicomm.training.checks`: the checks of the gradients handed to the reducer;
- :mod:`~mpicomm.training.results`: ``reducer(grads)``'s result buffers, reused once dropped;
- :mod:`~mpicomm.training.reducer`: :class:`DistributedGradReducer`;
- :mod:`~mpicomm.training.fused`: :func:`all_reduce_coalesced`, :func:`broadcast_parameters`.
"""
from .families import CUPY, NUMPY, TORCH  # noqa: F401 (re-exported)
from .fused import all_reduce_coalesced, broadcast_parameters
from .planner import MIB, check_bucket_cap_mb, plan_buckets  # noqa: F401 (re-exported)
from .reducer import COMPRESSIONS, DistributedGradReducer  # noqa: F401 (re-exported)

__all__ = ["DistributedGradReducer", "all_reduce_coalesced", "broadcast_parameters", "plan_buckets"]
