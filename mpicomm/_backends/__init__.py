"""The backend registry: ``init(backend=NAME)`` looks NAME up here."""
import importlib

from ..errors import invalid

_REGISTRY = {
    "mpi": ("mpicomm._backends.mpi", "MPIBackend"),
    "nccl": ("mpicomm._backends.nccl", "NCCLBackend"),
}


def names():
    return sorted(_REGISTRY)


# MindSpore's backend names, and what to use instead
_OTHERS = {"hccl": "Ascend's HCCL is MindSpore's; mpicomm runs on NVIDIA GPUs with 'nccl' and on "
                   "CPUs with 'mpi'"}


def get_backend_class(name):
    """The backend class registered as ``name``; InvalidArgumentError listing the names."""
    try:
        mod, cls = _REGISTRY[name]
    except (KeyError, TypeError):
        hint = _OTHERS.get(name.lower()) if isinstance(name, str) else None
        raise invalid("backend", name, "one of " + ", ".join(repr(n) for n in names())
                      + " or None (NCCL where CuPy sees a GPU, else MPI)"
                      + (f"; {hint}" if hint else "")) from None
    return getattr(importlib.import_module(mod), cls)
