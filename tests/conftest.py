"""Shared fixtures. MPI tests are marked ``@pytest.mark.mpi`` and run under mpirun at
1, 2, 3 and 4 ranks (scripts/test.sh); unmarked tests run once, without mpirun."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_report_header(config):
    try:
        from mpi4py import MPI

        if not MPI.Is_initialized():
            return None
        c = MPI.COMM_WORLD
        lib = MPI.Get_library_version().splitlines()[0].strip()
        return f"mpicomm tests: rank {c.Get_rank()} of {c.Get_size()}; {lib}; mpi4py {__import__('mpi4py').__version__}"
    except Exception:
        return None


def pytest_runtest_logreport(report):
    """With MPICOMM_TEST_REPORT_NOW=1 (scripts/stress.sh sets it) a failure is printed the moment
    it happens, so a rank whose job is ended by another rank's abort still shows why it failed
    (pytest prints its FAILURES section only at the end of the session)."""
    if report.failed and os.environ.get("MPICOMM_TEST_REPORT_NOW") == "1":
        sys.stderr.write(f"\n==== FAILED NOW: {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        for name, text in report.sections:
            sys.stderr.write(f"---- {name}\n{text[-4000:]}\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def comm():
    """mpicomm initialised once for the session (backend from MPICOMM_BACKEND or auto)."""
    import mpicomm

    mpicomm.init()
    yield mpicomm
    # finalize is left to interpreter exit: other tests may still hold groups


@pytest.fixture
def rng(request):
    """A generator seeded by rank and test name: different data on every rank."""
    import zlib

    import mpicomm

    rank = mpicomm.get_rank() if mpicomm.is_initialized() else 0
    return np.random.default_rng([rank, zlib.crc32(request.node.name.encode())])


def rank_rng(rank, name):
    """The generator a given rank's ``rng`` fixture would give (for computing expectations)."""
    import zlib

    return np.random.default_rng([rank, zlib.crc32(name.encode())])


def sub_ranks(n):
    """World ranks [n-1, ..., 1] of a sub-group in reversed order, so that group rank != world
    rank (at 2 ranks [1, 0], at 1 rank [0])."""
    return list(range(n - 1, 0, -1)) if n > 2 else list(range(n - 1, -1, -1))


def reversed_group(name):
    """Create the group ``name`` of sub_ranks(world size) once (mpicomm initialised); its world ranks."""
    import mpicomm

    ranks = sub_ranks(mpicomm.get_group_size())
    if name not in mpicomm._state.CTX.groups:
        mpicomm.create_group(name, ranks)
    return ranks



def ring_pass(x, out):
    """Blocking send of ``x`` to the next rank of the world and receive of the previous one's
    into ``out``: even ranks send first, odd ones receive first (no rank waits on a send that
    no one receives). Returns ``out``."""
    import mpicomm

    n, me = mpicomm.get_group_size(), mpicomm.get_rank()
    dst, src = (me + 1) % n, (me - 1) % n
    if me % 2 == 0:
        mpicomm.send(x, dst)
        mpicomm.recv(out, src)
    else:
        mpicomm.recv(out, src)
        mpicomm.send(x, dst)
    return out

def shm_of(group=None):
    """The group's shared-memory strategy (under NCCL, that of the MPI transport host arrays take)."""
    import mpicomm

    t = mpicomm._state.get_group(group).transport
    return getattr(t, "host", t).shm


def shm_groups(name, threshold):
    """For a module's ``groups`` fixture (``yield from``): this rank's groups of the world and the
    reversed sub-group ``name`` (None: the world), their shared-memory threshold ``threshold``
    bytes until the module ends (then the defaults, and the default piece size)."""
    import mpicomm

    mine = [None] + ([name] if mpicomm.get_rank() in reversed_group(name) else [])
    for g in mine:
        shm_of(g).configure({"MPICOMM_SHM_THRESHOLD": str(threshold)})
    yield mine
    for g in mine:
        shm_of(g).configure()
        if shm_of(g).group is not None:
            shm_of(g).group.set_piece()


_JOB_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "MPI_LOCALRANKID")
_CONFIG_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_")  # settings of the machine (e.g. plm=isolated): kept


_OVERSUBSCRIBE = {"OMPI_MCA_rmaps_base_oversubscribe": "1", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def clean_mpi_env(extra=None, drop=(), drop_prefixes=(), oversubscribe=True):
    """Environment for a child mpirun started from inside a test: no inherited MPI job
    (but the machine's MCA settings), the repo on PYTHONPATH, NCCL_NVLS_ENABLE=0 kept.
    ``oversubscribe=False`` leaves rank placement to the hostfile (the launcher's tests)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(_JOB_PREFIXES) and not k.startswith(_CONFIG_PREFIXES))
           and not (drop_prefixes and k.startswith(drop_prefixes)) and k not in drop
           and k not in _OVERSUBSCRIBE}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["NCCL_NVLS_ENABLE"] = "0"
    bindir = os.path.dirname(sys.executable)
    if bindir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    if oversubscribe:
        env.update(_OVERSUBSCRIBE)
    if extra:
        env.update(extra)
    return env


def mpirun_argv(n, *args):
    """argv for ``mpirun -n N python ARGS`` with the flags this machine needs."""
    import shutil

    mpirun = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    return [mpirun, "--oversubscribe", "-n", str(n), sys.executable, *args]


# Open MPI 5's launcher (prterun) writes one byte past the end of its help messages, the
# "MPI_ABORT was invoked" banner among them: a NUL, now and then another byte (PRRTE fixed it
# upstream in openpmix/prrte#1905). The byte lands before whatever line a rank prints next.
_LAUNCHER_STRAY = re.compile(rb"(?m)(^-{20,}\n)[\x00\x80-\xff](?=[\x00-\x7f]|\Z)")


def job_text(raw):
    """A job's output bytes as text, without the launcher's stray byte after its banners."""
    return _LAUNCHER_STRAY.sub(rb"\1", raw).decode("utf-8", errors="replace")


def run_job(argv, env, timeout, cwd=None, tries=3):
    """Run an mpirun job in a session of its own: (CompletedProcess with text, seconds).
    A job past ``timeout`` is killed whole (mpirun and every rank) and raises TimeoutExpired,
    so no rank of a failed case lives on into the next one. A job whose launcher failed on its
    own before starting any rank (mpicomm.launch.mpirun.START_FAILURES) runs again, up to
    ``tries`` times in all, as mpicomm-run does."""
    from mpicomm.launch.mpirun import failed_to_start

    for _ in range(tries - 1):
        proc, secs = _run_job_once(argv, env, timeout, cwd)
        if proc.returncode == 0 or not failed_to_start(proc.stderr + proc.stdout):
            return proc, secs
    return _run_job_once(argv, env, timeout, cwd)


def _run_job_once(argv, env, timeout, cwd):
    t0 = time.monotonic()
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True, cwd=cwd) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, output=job_text(out), stderr=job_text(err)) from None
    return subprocess.CompletedProcess(argv, proc.returncode, job_text(out), job_text(err)), time.monotonic() - t0


def left_behind(pattern, within=30.0):
    """The processes (``pgrep -af`` lines) whose command line matches ``pattern`` that are
    still running after up to ``within`` s of waiting for them to go, "" when none are: a
    job's ranks and daemons may take a moment to exit after its launcher has returned."""
    deadline = time.monotonic() + within
    while True:
        left = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.strip()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
