"""PyTorch integration: a data-parallel wrapper for ``torch.nn.Module`` and the
``torch.distributed`` bootstrap from an ``mpirun`` world.

Imported only when used (``import mpicomm`` does not import PyTorch)::

    import mpicomm.torch as mt

    model = mt.DistributedDataParallel(model)   # parameters and buffers from rank 0
    loss_fn(model(x), y).backward()             # buckets reduced during backward
    opt.step()
"""
from ._ddp import DistributedDataParallel
from ._dist import init_process_group

__all__ = ["DistributedDataParallel", "init_process_group"]
