"""What the command-line tools share."""
import sys


def exit_cleanly(code):
    """Finalise mpicomm and MPI, then exit with ``code`` (every rank agrees on it).

    Ending MPI first keeps a non-zero exit under ``python -m mpi4py`` (how mpicomm-run
    starts scripts) from being turned into MPI_Abort.
    """
    from mpi4py import MPI

    if not MPI.Is_finalized():
        try:
            import mpicomm

            mpicomm.finalize()
        except Exception:
            pass
        MPI.Finalize()
    sys.exit(code)
