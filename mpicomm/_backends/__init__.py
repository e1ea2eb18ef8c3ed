"""The backend registry: ``init(backend=NAME)`` looks NAME up here."""
from ..errors import invalid

_REGISTRY = {
    "mpi": ("mpicomm._backends.mpi", "MPIBackend"),
    "nccl": ("mpicomm._backends.nccl", "NCCLBackend"),
}


def names():
    return sorted(_REGISTRY)


def get_backend_class(name):
    """The backend class registered as ``name``; InvalidArgumentError listing the names."""
    try:
        mod, cls = _REGISTRY[name]
    except (KeyError, TypeError):
        raise invalid("backend", name, "one of " + ", ".join(repr(n) for n in names())
                      + " or None (NCCL where CuPy sees a GPU, else MPI)") from None
    import importlib

    return getattr(importlib.import_module(mod), cls)
