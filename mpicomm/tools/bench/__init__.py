"""``mpicomm-bench``: an nccl-tests style benchmark of mpicomm's collectives (see :mod:`.cli`)."""
from .cli import *  # noqa: F401,F403
from .cli import main

__all__ = ["main"]
