"""Launching jobs: hostfiles and batch allocations, mpirun discovery and argv building.

The command-line front end is :mod:`mpicomm.launch.cli` (``mpicomm-run``, or
``python -m mpicomm.launch``); :mod:`mpicomm.launch.rankwrap` runs in front of each rank
when ``--log-dir`` is given.
"""
from mpicomm.launch.allocation import (Allocation, AllocationError, expand_nodelist,
                                       parse_tasks_per_node)
from mpicomm.launch.hostfile import (Host, HostfileError, check_capacity, local_cores,
                                     parse_host_list, parse_hostfile, parse_hostfile_text)
from mpicomm.launch.mpirun import (Flavour, MpirunNotFoundError, UnknownMpiError,
                                   build_command, detect_flavour, find_mpirun,
                                   parse_version_output)

__all__ = ["Allocation", "AllocationError", "expand_nodelist", "parse_tasks_per_node",
           "Host", "HostfileError", "check_capacity", "local_cores", "parse_host_list",
           "parse_hostfile", "parse_hostfile_text", "Flavour", "MpirunNotFoundError",
           "UnknownMpiError", "build_command", "detect_flavour", "find_mpirun",
           "parse_version_output"]
