"""Watching init() and finalize() themselves, before the progress window exists (or after
it is gone): a stage that does not end within the timeout is named and the job aborted."""
from __future__ import annotations

import sys
import threading

from .abort import abort_job, rank_prefix
from .watchdog import GRACE

class InitGuard:
    """Watches init() itself, before the progress window exists: if a stage does not end
    within the timeout (each stage has the whole timeout), prints which stage and aborts
    the job. Every rank must reach each stage; which rank did not cannot be read yet
    (nothing is published before the window), so the report says what the stage waits for."""

    STAGES = {
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
        abort_job(grace=GRACE)

    def done(self):
        t, self._t = self._t, None
        if t is not None:
            t.cancel()
