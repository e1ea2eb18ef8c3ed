"""Python stacks on request: for a peer's timeout report, and on SIGUSR1.

The stacks are taken by ``faulthandler`` (every thread, also while the main thread is
blocked inside MPI or NCCL), written to ``MPICOMM_TRACE_DIR/mpicomm-stack.rank{R}.txt``
and printed on stderr with the rank's prefix. Two ways to ask:

* a peer whose call timed out puts a stamp into this rank's DUMP progress word (an RMA
  put, so it works across hosts); this rank's watchdog sees it on its next tick;
* ``kill -USR1`` of a rank (or of ``mpirun``, which passes SIGUSR1 on to every rank):
  faulthandler writes the stacks at once into an unnamed temporary file from the signal
  handler; the watchdog sees the file grow, prints it, and writes the flight record.

Both need the watchdog thread (a timeout > 0); a stopped process (SIGSTOP) answers
neither.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import threading

from .flight import DIR_ENV

SIGNAL = signal.SIGUSR1


def stack_path(rank):
    return os.path.abspath(os.path.join(os.environ.get(DIR_ENV) or os.getcwd(), f"mpicomm-stack.rank{rank}.txt"))


class Stacks:
    def __init__(self, rank, prefix):
        self.rank = rank
        self.prefix = prefix          # () -> "[mpicomm rank R] "
        self._sig = None              # the temporary file faulthandler writes into on SIGUSR1
        self._seen = 0

    def install_signal(self):
        """SIGUSR1 dumps the stacks (and the flight record), unless the program handles
        SIGUSR1 itself; only from the main thread (where signals are set)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            if signal.getsignal(SIGNAL) is not signal.SIG_DFL:
                return False
            f = tempfile.TemporaryFile()
            faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
        except Exception:
            return False
        self._sig, self._seen = f, 0
        return True

    def uninstall_signal(self):
        f, self._sig = self._sig, None
        if f is None:
            return
        try:
            faulthandler.unregister(SIGNAL)
        except Exception:
            pass
        try:
            f.close()
        except Exception:
            pass

    def signalled(self):
        """The stacks a SIGUSR1 wrote since the last look ('' if none)."""
        f = self._sig
        if f is None:
            return ""
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError:
            return ""
        if size <= self._seen:
            return ""
        f.seek(self._seen)
        text = f.read(size - self._seen).decode("utf-8", "replace")
        self._seen = size
        return text

    def take(self):
        """This process's stacks now (every thread), as text."""
        with tempfile.TemporaryFile() as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read().decode("utf-8", "replace")

    def publish(self, text, why):
        """Write ``text`` to this rank's stack file and print it on stderr; returns the path
        (None if it could not be written)."""
        path = stack_path(self.rank)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(f"# mpicomm rank {self.rank}, pid {os.getpid()}: Python stacks ({why})\n{text}")
        except OSError:
            path = None
        p = self.prefix()
        where = f" (also in {path})" if path else ""
        sys.stderr.write(f"{p}Python stacks of rank {self.rank} ({why}){where}:\n"
                         + "".join(p + line for line in text.splitlines(True)))
        if not text.endswith("\n"):
            sys.stderr.write("\n")
        sys.stderr.flush()
        return path
