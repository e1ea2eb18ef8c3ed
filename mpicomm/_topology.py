"""Node-local rank and size, and GPU selection from them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

# What a user runs to give mpicomm NCCL, as README installs it (from the source tree)
CUPY_INSTALL = ("pip install '.[cuda12]' in mpicomm's source tree (CUDA 12 drivers; '.[cuda13]' for CUDA 13), "
                "or pip install cupy-cuda12x")


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



def shared_gpus(lcomm, device_id, world_ranks):
    """None where every rank of this host (``lcomm``, collective over it) has a GPU of its own,
    else what is shared, in words: NCCL refuses two ranks on one GPU. GPUs are told apart by
    PCI bus id, so ranks that each see their own GPU as device 0 (CUDA_VISIBLE_DEVICES per
    rank) do not share one."""
    import socket

    import cupy

    try:
        me = str(cupy.cuda.Device(device_id).pci_bus_id)
    except Exception:   # noqa: BLE001 - no bus id to be had: the device number
        me = f"device {device_id}"
    ids = lcomm.allgather(me)
    on = {}
    for r, i in zip(world_ranks, ids):
        on.setdefault(i, []).append(r)
    shared = [(i, rs) for i, rs in on.items() if len(rs) > 1]
    if not shared:
        return None
    i, rs = shared[0]
    return (f"on host {socket.gethostname()}, {len(ids)} ranks have {len(on)} GPU{'s' if len(on) > 1 else ''} "
            f"between them: ranks {', '.join(map(str, rs))} share one ({i}), and NCCL needs a GPU of its own "
            "for each rank")

def gpu_seen():
    """Why this process looks as if it has an NVIDIA GPU, found without CuPy, or None.

    In order: ``CUDA_VISIBLE_DEVICES`` non-empty (and not "-1" or "NoDevFiles"), PyTorch
    (where the program imported it) seeing CUDA, ``nvidia-smi -L`` (found on PATH) listing
    a GPU. Used where CuPy sees none, to say that NCCL is being left out.
    """
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if cvd and cvd not in ("-1", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={cvd}"
    torch = sys.modules.get("torch")   # (not imported here: that takes seconds)
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return "torch.cuda.is_available() is True"
        except Exception:  # noqa: BLE001 - a broken CUDA set-up is no GPU here
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.SubprocessError):
            return None
        first = next((ln.strip() for ln in out.stdout.splitlines() if ln.strip().startswith("GPU ")), None)
        if out.returncode == 0 and first:
            return f"nvidia-smi -L lists {first!r}"
    return None


def no_nccl_reason():
    """Why CuPy cannot give NCCL here: not installed, or installed and seeing no GPU."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"CuPy cannot be imported ({type(e).__name__}: {e})"
    return "CuPy is installed but sees no GPU (check its CUDA version against the driver's: nvidia-smi)"
