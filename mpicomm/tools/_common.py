"""What the command-line tools share."""
import sys

from .._mpi import load
from ..errors import BackendUnavailableError


def exit_cleanly(code):
    """Finalise mpicomm and MPI, then exit with ``code`` (every rank agrees on it).

    Ending MPI first keeps a non-zero exit under ``python -m mpi4py`` (how mpicomm-run
    starts scripts) from being turned into MPI_Abort.
    """
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError):  # no MPI library: nothing to end
        sys.exit(code)
    if not MPI.Is_finalized():
        try:
            import mpicomm

            mpicomm.finalize()
        except Exception:
            pass
        MPI.Finalize()
    sys.exit(code)


def load_mpi(tool):
    """mpi4py's MPI module, or None after printing why it cannot load and how to fix it."""
    try:
        return load()
    except BackendUnavailableError as e:
        print(f"{tool}: {e}", file=sys.stderr)
        return None
