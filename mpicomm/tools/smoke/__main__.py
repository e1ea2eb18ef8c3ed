"""``python -m mpicomm.tools.smoke``: the same as ``mpicomm-smoke``."""
from .._common import exit_cleanly
from . import main

exit_cleanly(main())
