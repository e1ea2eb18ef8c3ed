"""average: a loss or a metric averaged over the ranks, for logging."""
from __future__ import annotations

import numpy as np

from .. import all_reduce
from .._ops import ReduceOp
from .._state import get_group
from ..errors import TypeOf, invalid


def average(x, group=None):
    """The mean of ``x`` over the group's ranks (every rank gets it), for logging a loss or
    a metric: ``mpicomm.average(loss.item())`` or ``mpicomm.average(loss)``.

    x: a Python or NumPy number (returns a float), or an array: NumPy, CuPy, or a PyTorch
        tensor (detached first: a loss that requires grad is fine). Integer arrays are
        averaged as float64 (PyTorch: its default float dtype). Returns a new array.
    group: the group to average over (None: the world).

    Raises InvalidArgumentError for anything else (a bool, a string, a list), naming it.
    """
    if isinstance(x, (bool, np.bool_)) or not (
            isinstance(x, (int, float, np.integer, np.floating, np.ndarray))
            or hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")):
        raise invalid("x", TypeOf(x), "a number (int, float, NumPy scalar) or an array (NumPy, CuPy, "
                      "PyTorch tensor) to average over the ranks")
    n = get_group(group).size
    if isinstance(x, (int, float, np.integer, np.floating)):
        buf = np.array([float(x)])
        all_reduce(buf, ReduceOp.SUM, out=buf, group=group)
        return float(buf[0]) / n
    if hasattr(x, "detach"):            # a PyTorch tensor
        x = x.detach()
        if not x.is_floating_point() and not x.is_complex():
            x = x.to(dtype=__import__("torch").get_default_dtype())
    elif getattr(x, "dtype", None) is not None and np.dtype(x.dtype).kind not in "fc":
        x = x.astype(np.float64)
    return all_reduce(x, ReduceOp.AVG, group=group)


__all__ = ["average"]
