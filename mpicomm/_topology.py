"""Node-local rank and size, and GPU selection from them."""
from __future__ import annotations


def local_comm(comm):
    """Split ``comm`` into the ranks that share this host (MPI's shared-memory split)."""
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def gpu_count():
    """Number of GPUs CuPy sees (0 when CuPy or a driver is missing)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def select_gpu(local_rank):
    """Make GPU ``local_rank % device_count`` current, before NCCL binds to it."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    dev = local_rank % n
    cupy.cuda.Device(dev).use()
    return dev
