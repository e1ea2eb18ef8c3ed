"""``python -m mpicomm.tools.bench``: the same as ``mpicomm-bench``."""
from .._common import exit_cleanly
from . import main

exit_cleanly(main())
