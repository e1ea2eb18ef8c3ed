"""Timeouts that name the missing rank, mismatch detection, and abort on failure.

Made by :func:`mpicomm.init`, split by concern:

* ``progress``: this rank's published progress (an MPI RMA window) and reading the peers';
* ``watchdog``: the thread that notices a call pending past the timeout and diagnoses it;
* ``debug``: the cross-rank argument check of ``init(debug=True)``;
* ``abort``: ending the whole job, and abort on an uncaught exception.

The dispatcher (mpicomm._dispatch) publishes progress inline; nothing here writes into
a transport.
"""
from __future__ import annotations

import atexit

from .._backends.base import complete_dropped
from .abort import ExceptHooks
from .debug import Checked
from .progress import Progress
from .watchdog import Watchdog


class Reliability:
    """The reliability machinery of one initialised context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.progress = Progress(ctx.world.mpi_comm, ctx.world.rank)
        self.watchdog = Watchdog(self.progress, self.groups, ctx.timeout, ctx.world,
                                 ctx.device_id if ctx.backend_name == "nccl" else None)
        self.hooks = ExceptHooks(self.transports) if ctx.abort_on_exception else None
        self._checked = []

    def groups(self):
        ctx = self.ctx
        return [g for g in [ctx.world, *ctx.groups.values()] if g is not None]

    def transports(self):
        return [g.transport for g in self.groups() if g.transport is not None]

    def start(self):
        if self.hooks is not None:
            self.hooks.install()
        self.watchdog.start()
        atexit.register(self._atexit)

    def row(self, g):
        """The progress row of a new group (every rank learns every group's name)."""
        return self.progress.add(g)

    def name(self, g):
        self.progress.name(g)

    def wrap(self, transport, g):
        """The transport the dispatcher uses: in debug mode, wrapped by the argument check."""
        if not self.ctx.debug:
            return transport
        c = Checked(transport, g, g.mpi_comm.Dup(), lambda: self.watchdog.fired)
        self._checked.append(c)
        return c

    def forget(self, g):
        self.progress.remove(g)
        d = getattr(g, "disp", None)
        if d is not None and isinstance(d.transport, Checked):
            d.transport.close()
            self._checked.remove(d.transport)

    def _atexit(self):
        self.progress.mark_exited()
        complete_dropped()   # before MPI is finalised: dropped work still writes into its buffers
        self.close(free=False)

    def close(self, free):
        self.watchdog.stop()
        if self.hooks is not None:
            self.hooks.uninstall()
        try:
            atexit.unregister(self._atexit)
        except Exception:  # pragma: no cover
            pass
        self.progress.close(free)
        if free:
            for c in self._checked:
                c.close()
            self._checked = []
