"""When a group's collective takes the shared-memory path (mpicomm._backends.shm), and in
pieces of what size: the thresholds and pieces, with MPICOMM_SHM_THRESHOLD and
MPICOMM_SHM_PIECE read from the environment."""
from __future__ import annotations

import os
import sys

from ..errors import invalid

NEVER = sys.maxsize        # a threshold no message reaches: the path is off
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")   # those with a shared-memory path

# Smallest message (bytes: the input of all_reduce / reduce_scatter / broadcast, the
# *output* of all_gather) that takes the shared-memory path, measured on the 2-core
# machine at 2 and 4 ranks (docs/BENCHMARKS.md, "CPU shared-memory path"): below
# 128-256 KiB the barriers cost more than Open MPI's eager copies. all_gather and
# broadcast are off by default: Open MPI moves them with one copy per byte, the shared
# window needs two, and it measured slower (2 ranks: 3-4x; 4 ranks: 0.4-1.6x, noisy);
# MPICOMM_SHM_THRESHOLD turns them on.
DEFAULT_THRESHOLD = {"all_reduce": 256 << 10, "all_gather": NEVER,
                     "reduce_scatter": 256 << 10, "broadcast": NEVER}
# all_reduce when the ranks outnumber their cores (4 ranks on 2 cores): measured even
# with Open MPI at 256 KiB, ahead from 512 KiB
CROWDED_THRESHOLD = 512 << 10
# Without MPICOMM_SHM_PIECE, all_reduce chooses between these pieces (bytes of one buffer
# of a segment) as it runs (ShmGroup._tune): on the 2-core VM 2 MiB is fastest most of
# the time at 2 ranks but, in spells of seconds, 2-3x slower than 8 MiB; at 4 ranks on 2
# cores 2 MiB won at 16 MiB and 8 MiB from 32 MiB (docs/BENCHMARKS.md).
AUTO_PIECES = (2 << 20, 8 << 20)
DEFAULT_PIECE = AUTO_PIECES[0]   # the piece before any tuning
WHOLE = 1 << 60            # a piece size that means "the whole message"
_OFF = ("off", "no", "false", "never", "none", "disable", "disabled")


def _bytes(name, text):
    """Parse '262144', '256K', '4M', '1G' (binary units) from environment variable ``name``."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if s and s[-1] in "KMG":
        mult = 1 << (10 * ("KMG".index(s[-1]) + 1))
        s = s[:-1]
    try:
        v = int(s) * mult
    except ValueError:
        v = -1
    if v < 0:
        raise invalid(name, text, "a size in bytes >= 0 (e.g. 262144, 256K, 4M), or 'off'")
    return v


def thresholds(size, env=os.environ, crowded=False):
    """Per collective, the smallest message in bytes that takes the shared-memory path
    (NEVER for a group of one rank or with MPICOMM_SHM_THRESHOLD=off).

    MPICOMM_SHM_THRESHOLD=BYTES sets all four (0: every non-empty message), at
    any group size. ``crowded`` (the ranks outnumber their cores; known once the
    group's window is open) raises the default all_reduce threshold.
    """
    v = env.get("MPICOMM_SHM_THRESHOLD", "").strip()
    if size < 2 or v.lower() in _OFF:
        return dict.fromkeys(COLLECTIVES, NEVER)
    if v == "":
        t = dict(DEFAULT_THRESHOLD)
        if crowded:
            t["all_reduce"] = CROWDED_THRESHOLD
        return t
    return dict.fromkeys(COLLECTIVES, max(1, _bytes("MPICOMM_SHM_THRESHOLD", v)))


def piece_bytes(env=os.environ):
    """The piece (bytes of one buffer of a segment) that MPICOMM_SHM_PIECE fixes, else DEFAULT_PIECE."""
    v = env.get("MPICOMM_SHM_PIECE", "").strip()
    if v == "":
        return DEFAULT_PIECE
    p = _bytes("MPICOMM_SHM_PIECE", v)
    if p == 0:
        return WHOLE           # 0: one piece per message (the window grows to the message)
    return max(p, 64 << 10)
