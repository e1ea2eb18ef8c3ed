"""Helpers for the tests that start their own mpirun (launcher, doctor, two-host job)."""
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def world_size_from_env():
    """The size of the MPI job this pytest runs in (1 when not under mpirun)."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


# Same answer on every rank: these tests run once, in the serial (or 1-rank) pass.
spawns_mpirun = pytest.mark.skipif(world_size_from_env() > 1,
                                   reason="spawns its own mpirun; runs in the 1-rank pass")


def clean_mpi_env(extra=None, drop=()):
    """Environment for a child mpirun: no inherited MPI job, the repo on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_",
                                "MPI_LOCALRANKID", "MPICOMM_", "NCCL_"))
           and k not in drop}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    bindir = os.path.dirname(sys.executable)
    if bindir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if extra:
        env.update(extra)
    return env


def have_mpirun():
    return shutil.which("mpirun") is not None or \
        os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpirun"))


def run_cli(*args):
    """argv for ``python -m mpicomm.run ARGS``."""
    return [sys.executable, "-m", "mpicomm.run", *args]
