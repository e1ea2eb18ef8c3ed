"""Helpers for the tests that start their own mpirun (launcher, doctor, two-host job), and
``require``/``require_module`` for any test's prerequisites."""
import contextlib
import importlib
import os
import shlex
import shutil
import subprocess
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


# CI sets MPICOMM_TEST_STRICT=1 (.ci/run installs every prerequisite): there a missing
# prerequisite fails the test instead of skipping it. On a user's machine (no sshd, no
# network namespaces) such tests skip, with the reason in pytest's summary.
STRICT = os.environ.get("MPICOMM_TEST_STRICT", "0") not in ("", "0")


def require(why):
    """In a test body or at a test module's top level: skip with ``why`` where it is not None
    (fail under MPICOMM_TEST_STRICT=1)."""
    if why is None:
        return
    if STRICT:
        pytest.fail(f"prerequisite missing under MPICOMM_TEST_STRICT=1: {why}", pytrace=False)
    pytest.skip(f"{why} (MPICOMM_TEST_STRICT=1 fails instead)", allow_module_level=True)


TORCH = "PyTorch is not installed (scripts/_env.sh installs the CPU build)"
SKLEARN = "scikit-learn is not installed (in the test extra: pip install -e '.[test]')"
MATPLOTLIB = "matplotlib is not installed (in the test extra: pip install -e '.[test]')"


def require_module(name, why):
    """The module ``name``, imported; where it cannot be, ``require(why)``: a skip, or a
    failure under MPICOMM_TEST_STRICT=1 (CI installs PyTorch and the test extra)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require(f"{why}: {e}")


def clean_mpi_env(extra=None, drop=()):
    """conftest's clean environment, less MPICOMM_* and NCCL_* (except NCCL_NVLS_ENABLE),
    so that forwarding tests see only what they set, and less SLURM_* and PBS_*, so that
    mpicomm-run places the ranks on this host even inside a batch job."""
    from conftest import clean_mpi_env as base

    return base(extra, drop=drop, drop_prefixes=("MPICOMM_", "NCCL_", "SLURM_", "PBS_"),
                oversubscribe=False)


def have_mpirun():
    return shutil.which("mpirun") is not None or \
        os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpirun"))


def run_cli(*args):
    """argv for ``python -m mpicomm.launch ARGS``."""
    return [sys.executable, "-m", "mpicomm.launch", *args]


def netns_refused():
    """None where this process can create network namespaces (``unshare --net``), else why not."""
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    return None


@contextlib.contextmanager
def netns_lock():
    """Held while a test makes the network-namespace hosts of scripts/netns_cluster.sh (their
    names are fixed): tests in other pytest-xdist processes wait for it."""
    import fcntl

    with open("/tmp/mpicomm-netns-tests.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def launcher_failing_first(tmp_path, times, message):
    """A launcher that prints ``message`` and exits 213 on its first ``times`` job starts
    (as Open MPI 5's prterun does when its PMIx listener thread fails to start), then is the
    real mpirun; ``--version`` is always the real one's. Returns (its path, the file that
    counts its starts)."""
    from mpicomm.launch.mpirun import find_mpirun

    real = find_mpirun()
    count = tmp_path / "starts"
    fake = tmp_path / "mpirun"
    fake.write_text(f"""#!/bin/sh
if [ "$1" != --version ]; then
    echo x >> {shlex.quote(str(count))}
    if [ "$(wc -l < {shlex.quote(str(count))})" -le {times} ]; then
        printf '%s\\n' '--------------------------------------------------------------------------' \\
            {shlex.quote(message)} 'continue.' >&2
        exit 213
    fi
fi
exec {shlex.quote(real)} "$@"
""")
    fake.chmod(0o755)
    return fake, count
