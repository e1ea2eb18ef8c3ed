"""The crash report: a fatal signal in a rank (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints
which of mpicomm's calls the rank was in, or its last one, and marks the rank's progress
window as left with status 128 + the signal (peers that go on waiting name it), before the
handler that was there before runs. The handler is C (mpicomm/_native/crash.c: it runs in
the signal's context, where Python cannot); Python's own stacks come from faulthandler,
enabled with it where the program has not enabled it. Without the compiled module, only
faulthandler's stacks are printed."""
from __future__ import annotations

import faulthandler
import sys

from .. import _native
from .._ops import NAMES

_state = {"faulthandler": False}


def watch(progress, rank):
    """Report fatal signals from ``progress`` (mpicomm._reliability.progress.Progress)."""
    from . import progress as pr

    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
            _state["faulthandler"] = True
        except (AttributeError, ValueError, OSError):   # no usable stderr (a closed or replaced one)
            pass
    mod = _native.crash
    if mod is None:
        return
    names = [NAMES.get(c, "") for c in range(16)]
    layout = {"HDR": pr.HDR, "F": pr.F, "ROWS": pr.ROWS, "GHASH": pr.GHASH, "ENTERED": pr.ENTERED, "DONE": pr.DONE,
              "TDONE": pr.TDONE, "EXITED": pr.EXITED, "XSTATUS": pr.XSTATUS}
    mod.crash_watch(progress.m, int(rank), layout, names)
    for gh, name in progress.names.items():
        mod.crash_name(gh, name)


def name(gh, group_name):
    """The group of hash ``gh`` is called ``group_name`` in the report."""
    mod = _native.crash
    if mod is not None:
        mod.crash_name(int(gh), str(group_name))


def unwatch():
    """The handlers that were there before (called before the window goes)."""
    mod = _native.crash
    if mod is not None:
        mod.crash_unwatch()
    if _state["faulthandler"]:
        _state["faulthandler"] = False
        faulthandler.disable()
