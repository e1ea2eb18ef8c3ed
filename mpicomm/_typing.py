"""Names for the public API's type hints (read by type checkers and people; none is
checked when a function runs).

``ArrayLike``: a NumPy, CuPy or PyTorch array, or any array with DLPack or
``__cuda_array_interface__``. Which of these a call accepts depends on the backend and is
checked at the call (with an error that names the argument), so the hint says no more
than ``Any``. A collective returns an array of the input's kind, or a :class:`mpicomm.Work`
with ``async_op=True``: hinted ``Any`` too, so that ``all_reduce(x).sum()`` type-checks.
"""
from __future__ import annotations

from typing import Any

ArrayLike = Any
Stream = Any   # a cupy.cuda.Stream, a torch.cuda.Stream, or a raw cudaStream_t (int)
