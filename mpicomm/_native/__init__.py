"""mpicomm's call path compiled: ``callpath`` is the C module (mpicomm/_native/_callpath.c), or
None where it is not built, was built from another version of the source, or
``MPICOMM_NATIVE=0`` is set (the sources: _callpath.c, the module, and the files it names).

It holds the common case of ``Dispatcher.call`` and the NCCL transport's run of a blocking
collective on CuPy arrays or PyTorch tensors, each the Python it replaces written out in C
(the Python stays, and runs whatever the C path hands back to it). ``pip install`` builds
it where a C compiler and Python's headers are (it is optional: without them mpicomm runs
its Python path); in a source tree, ``python -m mpicomm._native`` builds it in place.
``MPICOMM_NATIVE=1`` makes a missing or stale build an error instead of the Python path.

The same module holds the crash report (crash.c; ``crash`` here, whatever the call path):
a fatal signal in a rank names the call the rank was in (mpicomm._reliability.crash).
"""
from __future__ import annotations

import hashlib
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["_callpath.c", "dispatch.c", "nccl_run.c", "public.c", "crash.c"]   # the module's files (and callpath.h)


def source_hash() -> str:
    """The hash a build of these sources carries (SOURCE in the module); '' without them
    (setup.py computes the same)."""
    h = hashlib.sha256()
    try:
        for name in sorted(SOURCES + ["callpath.h"]):
            with open(os.path.join(HERE, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    except OSError:   # an installed wheel carries the build, not the sources
        return ""
    return h.hexdigest()[:16]


def _built():
    """(the built module, None), or (None, why not: not built, or built from other sources)."""
    try:
        from . import _callpath as mod   # type: ignore[attr-defined]
    except ImportError as e:
        built = any(f.startswith("_callpath.") and f.endswith((".so", ".pyd")) for f in os.listdir(HERE))
        # without a build Python says "cannot import name ... (most likely due to a circular import)"
        return None, (f"not built ({e})" if built else
                      f"not built in {HERE} (python -m mpicomm._native in the source tree builds it)")
    want = source_hash()
    if want and getattr(mod, "SOURCE", None) != want:
        return None, f"built from another version of its sources in {HERE} (rebuild: python -m mpicomm._native)"
    return mod, None


def _load():
    mode = os.environ.get("MPICOMM_NATIVE", "").strip()
    if mode not in ("", "0", "1"):
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"invalid MPICOMM_NATIVE={mode!r}: '1' (the compiled call path, which must be "
                                   "built), '0' (the Python call path) or unset (compiled where built)")
    if mode == "0":
        return None, "MPICOMM_NATIVE=0"
    mod, why = _built()
    if mod is None and mode == "1":
        raise ImportError(f"MPICOMM_NATIVE=1 but mpicomm's compiled call path is {why}: pip install mpicomm "
                          "where a C compiler is, or run python -m mpicomm._native in the source tree")
    return mod, why


callpath, why_not = _load()


def _crash_module():
    """The compiled module for the crash report (crash.c), also under ``MPICOMM_NATIVE=0``
    (which chooses the call path only); None where it is not built, or built from other
    sources."""
    return callpath if callpath is not None else _built()[0]


crash = _crash_module()


def active() -> bool:
    """True when the compiled call path is in use."""
    return callpath is not None
