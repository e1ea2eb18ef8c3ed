"""``python -m mpicomm.launch ARGS``: the same as ``mpicomm-run ARGS`` (see :mod:`mpicomm.launch.cli`)."""
import sys

from mpicomm.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
