"""PyTorch integration: a data-parallel wrapper for ``torch.nn.Module`` and the
``torch.distributed`` bootstrap from an ``mpirun`` world.

Imported only when used (``import mpicomm`` does not import PyTorch); without PyTorch,
importing it raises ModuleNotFoundError naming the ``pip install`` that brings it::

    import mpicomm.torch as mt

    model = mt.DistributedDataParallel(model)   # parameters and buffers from rank 0
    loss_fn(model(x), y).backward()             # buckets reduced during backward
    opt.step()
"""
import importlib

try:
    importlib.import_module("torch")
except ImportError as e:
    raise ModuleNotFoundError(
        f"mpicomm.torch needs PyTorch, which cannot be imported here ({type(e).__name__}: {e}): "
        "pip install '.[torch]' in mpicomm's source tree (or pip install torch; on a machine without a GPU, PyTorch's "
        "smaller CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)",
        name="torch") from None

from ._ddp import DistributedDataParallel  # noqa: E402
from ._dist import init_process_group  # noqa: E402

__all__ = ["DistributedDataParallel", "init_process_group"]
