"""``torch.distributed`` started from the mpirun world: ranks, local ranks and a
rendezvous agreed over MPI, so that a script launched by mpirun/mpicomm-run can use
both mpicomm and torch.distributed (FSDP, DDP, its own collectives)."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

from ..errors import invalid
from ._device import select_local_device


def _world_comm():
    """An MPI communicator over every rank: mpicomm's world when initialised, else COMM_WORLD."""
    from .._state import CTX

    if CTX.initialized and CTX.world is not None and CTX.world.mpi_comm is not None:
        return CTX.world.mpi_comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _address(comm, local_size):
    """Rank 0's address for the others: loopback when every rank is on its host."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if local_size == comm.Get_size():
        return "127.0.0.1"
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def init_process_group(backend=None, *, timeout=None, set_device=True, **kwargs):
    """Start ``torch.distributed`` over the ranks of this mpirun job.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
    the environment (what torchrun would), agreed over MPI: rank 0 opens the rendezvous
    store on a free port (or $MASTER_PORT) at its address (or $MASTER_ADDR; 127.0.0.1
    when the whole job is on one host) and broadcasts it. Works whether or not
    ``mpicomm.init()`` was called.

    backend: "nccl", "gloo", ... or None: "nccl" where CUDA is available, else "gloo".
    timeout: seconds (or a timedelta) for torch.distributed's operations (default: its own).
    set_device: select CUDA device ``LOCAL_RANK % device_count`` first, where CUDA is and
        the program has not chosen a device (used CUDA, or set a device other than 0).
    kwargs: passed on to ``torch.distributed.init_process_group``.

    Returns the backend's name. Nothing happens when torch.distributed is already
    initialised. Raises InvalidArgumentError for a backend that is not a string, or a
    timeout that is not a positive number.
    """
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    if backend is not None and not isinstance(backend, str):
        raise invalid("backend", backend, "None (nccl where CUDA is, else gloo) or a torch.distributed "
                      "backend name such as 'nccl' or 'gloo'")
    if timeout is not None and not isinstance(timeout, timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise invalid("timeout", timeout, "a number of seconds > 0, a datetime.timedelta, or None")
        timeout = timedelta(seconds=float(timeout))
    if dist.is_initialized():
        return dist.get_backend()
    comm = _world_comm()
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if cuda and set_device:
        select_local_device(local_rank)
    addr = _address(comm, local_size) if rank == 0 else None
    want_port = int(os.environ.get("MASTER_PORT", "0") or 0)
    store = err = None
    if rank == 0:
        try:  # the store binds the port itself: no window between choosing a port and using it
            store = dist.TCPStore(addr, want_port, size, True, wait_for_workers=False,
                                  **({"timeout": timeout} if timeout else {}))
            port = store.port
        except Exception as e:  # noqa: BLE001 - told to every rank below
            port, err = None, f"{type(e).__name__}: {e}"
    else:
        port = None
    addr, port, err = comm.bcast((addr, port, err), root=0)
    if err is not None:
        raise RuntimeError(f"mpicomm.torch.init_process_group: rank 0 could not open the rendezvous store "
                           f"at {addr}:{want_port or '(any port)'}: {err}")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR=str(addr), MASTER_PORT=str(port))
    if store is None:
        store = dist.TCPStore(addr, port, size, False, **({"timeout": timeout} if timeout else {}))
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
    return dist.get_backend()
