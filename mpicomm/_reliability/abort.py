"""Ending the whole job: abort the NCCL communicators, then MPI; abort on an uncaught exception."""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback



def rank_prefix():
    try:
        from mpi4py import MPI

        return f"[mpicomm rank {MPI.COMM_WORLD.Get_rank()}] "
    except Exception:  # pragma: no cover
        return "[mpicomm] "


def abort_job(transports=(), grace=0.0, code=1):
    """Abort the given transports (NCCL communicators), then the whole MPI job with exit
    status ``code`` (never returns)."""
    for t in transports:
        try:
            t.abort()
        except Exception:
            pass
    if grace:
        time.sleep(grace)
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


class ExceptHooks:
    """``sys.excepthook`` and ``threading.excepthook`` that print the traceback with the rank
    and abort the job (mpi4py's ``python -m mpi4py`` does the same)."""

    def __init__(self, transports):
        self.transports = transports   # () -> the live transports
        self.prev = None

    def install(self):
        if self.prev is None:
            self.prev = (sys.excepthook, threading.excepthook)
        sys.excepthook = self._excepthook
        threading.excepthook = self._thread_excepthook

    def uninstall(self):
        if self.prev is None:
            return
        if sys.excepthook == self._excepthook:
            sys.excepthook = self.prev[0]
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self.prev[1]
        self.prev = None

    def _excepthook(self, tp, val, tb):
        p = rank_prefix()
        text = "".join(traceback.format_exception(tp, val, tb))
        sys.stderr.write(f"{p}uncaught exception; aborting the job "
                         "(init(abort_on_exception=False) turns this off):\n"
                         + "".join(p + line for line in text.splitlines(True)))
        sys.stderr.flush()
        abort_job(self.transports())

    def _thread_excepthook(self, args):
        if args.exc_type is SystemExit:
            return
        p = rank_prefix()
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        name = args.thread.name if args.thread is not None else "?"
        sys.stderr.write(f"{p}uncaught exception in thread {name}; aborting the job:\n"
                         + "".join(p + line for line in text.splitlines(True)))
        sys.stderr.flush()
        abort_job(self.transports())


def _status_of(code):
    """The process exit status that ``sys.exit(code)`` gives."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    return 1   # a message (printed), or any other object


def _main_code():
    """The code object of the script's own top level (the outermost frame that runs the
    ``__main__`` module's globals), or None (called from a thread, or an embedded Python)."""
    main = getattr(sys.modules.get("__main__"), "__dict__", None)
    found, f = None, sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "<module>" and f.f_globals is main:
            found = f.f_code
        f = f.f_back
    return found


class ExitStatus:
    """Learns this process's exit status for the peers: ``sys.exit``, ``exit`` and ``quit``
    record theirs; an uncaught exception is 1 (Python sets ``sys.last_value``). On Python
    3.12 and later, ``sys.monitoring`` also sees the script's top level end: a return
    (status 0) or an exception leaving it (``raise SystemExit(n)``: n). Before 3.12 a
    return and a bare ``raise SystemExit(n)`` look alike at exit: unknown."""

    TOOL_NAME = "mpicomm-exit"

    def __init__(self):
        self.code = None
        self.prev = None
        self.tool = None

    def _watch_main(self):
        mon = getattr(sys, "monitoring", None)
        code = _main_code() if mon is not None else None
        if code is None:
            return
        tool = next((t for t in (4, 3) if mon.get_tool(t) is None), None)  # ids no standard tool takes
        if tool is None:
            return
        mon.use_tool_id(tool, self.TOOL_NAME)
        E = mon.events

        def unwind(c, offset, exc):
            # a global event (it cannot be set on one code object): filtered here
            if c is code and self.code is None:
                self.code = (_status_of(exc.code) if isinstance(exc, SystemExit) else
                             130 if isinstance(exc, KeyboardInterrupt) else 1)
                mon.set_events(tool, 0)   # the script has ended: stop listening

        def returned(c, offset, value):
            if self.code is None:
                self.code = 0

        mon.register_callback(tool, E.PY_UNWIND, unwind)
        mon.register_callback(tool, E.PY_RETURN, returned)
        mon.set_events(tool, E.PY_UNWIND)
        mon.set_local_events(tool, code, E.PY_RETURN)
        self.tool = tool

    def _unwatch_main(self):
        if self.tool is None:
            return
        mon = sys.monitoring
        if mon.get_tool(self.tool) == self.TOOL_NAME:
            mon.set_events(self.tool, 0)
            mon.register_callback(self.tool, mon.events.PY_UNWIND, None)
            mon.register_callback(self.tool, mon.events.PY_RETURN, None)
            mon.free_tool_id(self.tool)
        self.tool = None

    def install(self):
        import builtins

        if self.prev is not None:
            return
        self.prev = (sys.exit, getattr(builtins, "exit", None), getattr(builtins, "quit", None))
        real = self.prev[0]

        def exit(status=None):
            self.code = _status_of(status)
            real(status)

        def wrap(q):
            if q is None:
                return None

            class Quitter(type(q)):
                def __call__(qself, code=None):
                    self.code = _status_of(code)
                    return q(code)
            try:
                return Quitter(q.name, q.eof)
            except Exception:
                return q

        exit.__doc__ = real.__doc__
        sys.exit = exit
        try:
            self._watch_main()
        except Exception:  # pragma: no cover - monitoring is a help, never a failure
            self.tool = None
        if self.prev[1] is not None:
            builtins.exit = wrap(self.prev[1])
        if self.prev[2] is not None:
            builtins.quit = wrap(self.prev[2])

    def uninstall(self):
        import builtins

        self._unwatch_main()
        if self.prev is None:
            return
        sys.exit = self.prev[0]
        if self.prev[1] is not None:
            builtins.exit = self.prev[1]
        if self.prev[2] is not None:
            builtins.quit = self.prev[2]
        self.prev = None

    def status(self):
        """The exit status (at exit), or None when it cannot be known."""
        if self.code is not None:
            return self.code
        last = getattr(sys, "last_value", None)
        if last is not None and not isinstance(last, SystemExit):
            return 1
        return None


def quiet(fn):
    """Run fn with fd 2 silenced: Open MPI's PyPI build prints a harmless osc/ucx component
    message on every window creation on hosts without UCX devices."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except Exception:  # pragma: no cover
        return fn()
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        return fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
