"""Timeouts that name the missing rank, mismatch detection, and abort on failure.

Made by :func:`mpicomm.init`, split by concern:

* ``progress``: this rank's published progress (an MPI RMA window) and reading the peers';
* ``watchdog``: the thread that notices a call pending past the timeout and diagnoses it;
* ``debug``: the cross-rank argument check of ``init(debug=True)``;
* ``abort``: ending the whole job, and abort on an uncaught exception;
* ``flight``: the flight recorder (each group's last calls), written on a report;
* ``agreement``: the always-on check that every rank makes the same call.

The dispatcher (mpicomm._dispatch) publishes progress inline; nothing here writes into
a transport.
"""
from __future__ import annotations

import atexit
import sys
import time

from .. import _timing
from .._backends.base import complete_dropped
from .._timing import TIMING
from ..errors import CollectiveTimeoutError, InvalidArgumentError
from . import agreement, crash
from .abort import ExceptHooks, ExitStatus, abort_job, rank_prefix
from .debug import Checked
from .flight import FlightRecorder, size_from_env
from .progress import EXITED, Progress
from .watchdog import Watchdog


class Reliability:
    """The reliability machinery of one initialised context."""

    def __init__(self, ctx):
        self.ctx = ctx
        # per group (id): a duplicate of its communicator that carries no traffic, from which
        # resync makes the fresh one (the old one may hold requests of the failed call that
        # would take the duplication's own messages)
        self._spares = {}
        size = _from_env(ctx)
        self.progress = Progress(ctx.world.mpi_comm, ctx.world.rank)
        self.rings = agreement.HostRings(ctx.local_comm, ctx.world.rank, ctx.check and ctx.world.size > 1)
        self.flight = FlightRecorder(size, self.groups, self.progress, ctx.world.rank, ctx.world.size)
        self.watchdog = Watchdog(self.progress, self.groups, ctx.timeout, ctx.world,
                                 ctx.device_id if ctx.backend_name == "nccl" else None, flight=self.flight)
        self.hooks = ExceptHooks(self.transports) if ctx.abort_on_exception else None
        self.exit = ExitStatus()
        self._checked = []

    def groups(self):
        ctx = self.ctx
        return [g for g in [ctx.world, *ctx.groups.values()] if g is not None]

    def transports(self):
        return [g.transport for g in self.groups() if g.transport is not None]

    def start(self):
        if self.hooks is not None:
            self.hooks.install()
        self.exit.install()
        crash.watch(self.progress, self.ctx.world.rank)
        self.watchdog.start()
        atexit.register(self._atexit)

    def row(self, g):
        """The progress row of a new group (every rank learns every group's name)."""
        return self.progress.add(g)

    def name(self, g):
        self.progress.name(g)

    def attach(self, g):
        """Collective over member group ``g``: its agreement check learns the members' rows."""
        agreement.attach(g.disp, self.rings, self.progress, g.mpi_comm, self.ctx.world.rank)
        if g.size > 1 and self.ctx.check:
            self._spares[id(g)] = g.mpi_comm.Dup()

    def meeting_comm(self, g):
        """The communicator on which member group ``g`` meets before its first exchange of
        objects (mpicomm._objects._meet): the spare, where there is one, which no call of the
        program's can match (a barrier on the group's own communicator met a peer's
        ``barrier()`` and let that rank's ``all_gather_object`` go on into pkl5's
        communicator duplication, which waited there for it holding the GIL, unwatched)."""
        spare = self._spares.get(id(g))
        return spare if spare is not None else g.mpi_comm

    def resync(self, g):
        """Give member group ``g`` a fresh communicator and transport (collective over its
        members, who all call it at their next call after a disagreement or refusal that
        some member took part in: what the failed call left unmatched stays in the old one)."""
        old_t = g.transport
        spare = self._spares.get(id(g))
        new = (spare if spare is not None else g.mpi_comm).Dup()
        g.mpi_comm = new
        d = g.disp
        from .._backends.base import NEVER

        d.last = [NEVER] * len(d.last)
        d.known.clear()
        if hasattr(old_t, "fresh_host"):   # NCCL: host arrays' MPI transport afresh, the NCCL
            old_t.fresh_host(new)          # communicator kept
            return
        g.transport = self.ctx.backend.make_transport(new)
        d.transport = self.wrap(g.transport, g)
        try:
            old_t.close()
        except Exception:
            pass

    def wrap(self, transport, g):
        """The transport the dispatcher uses: in debug mode, wrapped by the argument check."""
        if not self.ctx.debug:
            return transport
        c = Checked(transport, g, g.mpi_comm.Dup(), lambda: self.watchdog.fired)
        self._checked.append(c)
        return c

    def forget(self, g):
        self.progress.remove(g)
        spare = self._spares.pop(id(g), None)
        if spare is not None:
            try:
                spare.Free()
            except Exception:
                pass
        d = getattr(g, "disp", None)
        if d is not None and isinstance(d.transport, Checked):
            d.transport.close()
            self._checked.remove(d.transport)

    def _atexit(self):
        status = self.exit.status()
        if self.ctx.world is not None and self.ctx.world.size > 1:
            self.watchdog.final_check()   # (ends the job if the last calls differ between hosts)
        self.progress.mark_exited(status)
        try:
            complete_dropped()   # before MPI is finalised: dropped work still writes into its buffers
        except CollectiveTimeoutError:   # reported where it timed out: the job cannot end cleanly
            abort_job(self.transports(), code=status or 1)
        if self.ctx.world is not None and self.ctx.world.size > 1:
            self._leave(status)
        self.close(free=False)

    def _leave(self, status):
        """Wait (at most ``TIMING.leave_wait`` s) for the peers to leave too, or to report this rank's
        exit and abort the job, before MPI_Finalize: Open MPI's prterun was seen to crash
        (SIGSEGV, the status lost) when the abort came while a rank was inside MPI_Finalize.
        With a non-zero status the job ends with it: if the peers have neither left nor
        aborted by then, this rank aborts the job itself (MPI_Finalize would wait for them,
        and mpirun would then report 1, or 0)."""
        peers = [r for r in range(self.ctx.world.size) if r != self.ctx.world.rank]
        deadline = time.monotonic() + TIMING.leave_wait
        while time.monotonic() < deadline:
            states = self.progress.read_peers(peers)
            # a peer that does not answer is taken as gone (across hosts, one waiting inside
            # MPI_Finalize may not serve reads): waiting for it would only delay the exit
            if all(st is None or st[EXITED] for st in states.values()):
                return
            time.sleep(min(0.25, TIMING.leave_wait / 10))   # (reading the peers again)
        if not status:
            return
        left = [r for r, st in self.progress.read_peers(peers).items() if st is None or not st[EXITED]]
        sys.stderr.write(f"{rank_prefix()}this rank exits with status {status} while rank"
                         f"{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} still run: "
                         f"ending the job with exit status {status}\n")
        sys.stderr.flush()
        abort_job(self.transports(), code=status)

    def close(self, free):
        crash.unwatch()
        self.watchdog.stop()
        if free:
            self.flight.close()
        if self.hooks is not None:
            self.hooks.uninstall()
        self.exit.uninstall()
        try:
            atexit.unregister(self._atexit)
        except Exception:  # pragma: no cover
            pass
        self.progress.close(free)
        self.rings.close(free)
        if free:
            for c in self._checked:
                c.close()
            self._checked = []


def _from_env(ctx):
    """MPICOMM_TIMING (applied by init() already: here only checked) and the flight
    recorder's size (MPICOMM_FLIGHT_RECORDER), agreed over the world: a bad value on any rank
    raises on every rank (after releasing what init made so far), so none waits in the next
    step."""
    rank = ctx.world.rank
    mine = []   # (variable, error) of this rank
    try:
        _timing.from_env(rank)
    except InvalidArgumentError as e:
        mine.append((_timing.ENV, e))
    size = None
    try:
        size = size_from_env(rank)
    except InvalidArgumentError as e:
        mine.append(("MPICOMM_FLIGHT_RECORDER", e))
    errs = ctx.world.mpi_comm.allgather([(var, str(e)) for var, e in mine])
    if not any(errs):
        return size
    _release(ctx)
    if mine:
        raise mine[0][1]
    var, text = next(e[0] for e in errs if e)
    bad = [r for r, e in enumerate(errs) if any(v == var for v, _ in e)]
    where = f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}, not on rank {rank}"
    if var == _timing.ENV:   # (its values may differ between ranks: each rank's own waits)
        raise InvalidArgumentError(f"{text}; {var} is invalid on {where}")
    raise InvalidArgumentError(f"{text}; set {var} alike on every rank (invalid on {where})")


def _release(ctx):
    """Undo init's steps before the reliability machinery (init failed)."""
    for step in (lambda: ctx.world.transport.close(), lambda: ctx.world.mpi_comm.Free(),
                 lambda: ctx.local_comm.Free(), lambda: ctx.backend.close()):
        try:
            step()
        except Exception:
            pass
    ctx.reset()
