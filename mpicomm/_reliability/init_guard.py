"""Watching init() and finalize() themselves, before the progress window exists (or after
it is gone): a stage that does not end within the timeout is named and the job aborted.

MPI's own start (MPI_Init, inside mpi4py's import) returns only once every rank of the job
has started MPI, and holds Python's GIL while it waits: no thread of this process can run
then. :class:`StartGuard` watches it from a small helper process instead."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from .abort import abort_job, rank_prefix
from .._timing import TIMING

class InitGuard:
    """Watches init() itself, before the progress window exists: if a stage does not end
    within the timeout (each stage has the whole timeout), prints which stage and aborts
    the job. Every rank must reach each stage; which rank did not cannot be read yet
    (nothing is published before the window), so the report says what the stage waits for."""

    STAGES = {
        "start": "starting MPI (MPI_Init, in mpi4py's import): it returns once every rank of the job "
                 "has started MPI, so a rank that calls init() later than the timeout, or never, keeps "
                 "the others here",
        "join": "joining the other ranks (MPI_Comm_dup of the world): every rank must call init()",
        "agree": "agreeing on the backend with the other ranks",
        "backend": "starting the backend on this rank (under NCCL: importing CuPy, creating the CUDA "
                   "context of the selected GPU)",
        "transport": "creating the world's transport (under NCCL: ncclCommInitRank, NCCL's own "
                     "bootstrap over the network; every rank has passed the backend agreement just before)",
        "window": "creating the progress window (MPI_Win_allocate on every rank)",
        "free": "freeing the communicators (under NCCL, ncclCommDestroy waits for the work still queued "
                "on them, which a stuck peer never completes)",
    }

    def __init__(self, timeout, rank, call="init()", first="join"):
        self.timeout = timeout
        self.rank = rank
        self.call = call
        self._t = None
        self.set(first)

    def set(self, stage):
        """Enter ``stage``: its own timeout starts now."""
        self.done()
        self.stage = stage
        if self.timeout > 0:
            self._t = threading.Timer(self.timeout, self._fire)
            self._t.daemon = True
            self._t.name = "mpicomm-init-guard"
            self._t.start()

    def _fire(self):
        why = ("A rank that never calls init() cannot be named here (progress is published from the end "
               "of init on)." if self.call == "init()" else "")
        sys.stderr.write(f"{rank_prefix()}CollectiveTimeoutError: rank {self.rank}: {self.call} did not complete "
                         f"within {self.timeout:g} s; stage: {self.STAGES.get(self.stage, self.stage)}. {why}\n"
                         f"{rank_prefix()}  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {self.timeout:g} s)\n"
                         f"{rank_prefix()}aborting the job\n")
        sys.stderr.flush()
        abort_job(grace=TIMING.grace)

    def done(self):
        t, self._t = self._t, None
        if t is not None:
            t.cancel()


# The helper of StartGuard (python -I -S -c): waits up to the timeout for its stdin to close
# or speak (init got past MPI's start, or its process is gone); else writes the report to
# the rank's stderr and ends the rank (SIGTERM, then SIGKILL TIMING.term_wait s later), which
# ends the job.
_WATCH = r"""
import os, select, signal, sys, time
t, pid, msg, term = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
if select.select([0], [], [], t)[0]:
    sys.exit(0)
os.write(2, msg.encode())
try:
    os.kill(pid, signal.SIGTERM)
    for _ in range(round(term / 0.1)):
        time.sleep(0.1)
        os.kill(pid, 0)
    os.kill(pid, signal.SIGKILL)
except OSError:
    pass
"""

# where launchers publish a rank before MPI has started (Open MPI, PMIx, MPICH/Hydra, MVAPICH)
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


class StartGuard:
    """Watches MPI's start in init() (see the module docstring) with the whole timeout: a
    helper process reports the stage and ends the rank where MPI has not started by then.
    Without a timeout (0), or where no helper can be started, nothing is watched."""

    def __init__(self, timeout):
        self.p = None
        if not timeout > 0:
            return
        rank = next((os.environ[k] for k in _RANK_VARS if os.environ.get(k, "").isdigit()), "?")
        p = f"[mpicomm rank {rank}] "
        msg = (f"{p}CollectiveTimeoutError: rank {rank}: init() did not complete within {timeout:g} s; stage: "
               f"{InitGuard.STAGES['start']}. Which rank has not started MPI cannot be read here.\n"
               f"{p}  (timeout: init(timeout=...) or MPICOMM_TIMEOUT, now {timeout:g} s)\n"
               f"{p}aborting the job\n")
        try:
            self.p = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCH, repr(float(timeout)),
                                       str(os.getpid()), msg, repr(float(TIMING.term_wait))], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        except (OSError, ValueError, TypeError):   # (no interpreter to start: unwatched)
            self.p = None

    def done(self):
        """MPI has started (or init() failed before): the helper exits."""
        p, self.p = self.p, None
        if p is None:
            return
        try:
            p.stdin.close()
        except Exception:
            p.kill()
        # reaped in the background: init() does not wait for the helper's own start to end
        threading.Thread(target=p.wait, name="mpicomm-start-guard", daemon=True).start()

