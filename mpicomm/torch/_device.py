"""Each rank's own GPU in PyTorch: device ``local_rank % device_count`` by default."""
from __future__ import annotations


def select_local_device(local_rank):
    """Make CUDA device ``local_rank % torch.cuda.device_count()`` current where CUDA is
    available and this process has not chosen a device: CUDA not yet used here (no tensor
    on a GPU, nothing queried) and the current device the default, 0. Returns the device
    index chosen, or None where nothing was changed.

    Without it every rank of a host would put its model on GPU 0 (``model.cuda()``,
    ``torch.device("cuda")``), as would NCCL's communicators made by torch.distributed.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    if torch.cuda.is_initialized() or torch.cuda.current_device() != 0:
        return None            # the program chose (or used) a device already: its choice
    dev = int(local_rank) % torch.cuda.device_count()
    if dev != 0:
        torch.cuda.set_device(dev)
    return dev
