"""What a smoke run covers: the collectives, dtypes, ops and counts, and the plan of
cases (the same order on every rank)."""
from __future__ import annotations

from .expected import dtype_kind, np_dtype

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
               "send_recv", "barrier", "all_gatherv", "all_to_allv", "reduce_scatterv", "gather", "scatter",
               "sendrecv", "batch")
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex64", "complex128")
OPS = ("sum", "prod", "min", "max", "avg")
REDUCING = ("all_reduce", "reduce_scatter", "reduce", "reduce_scatterv")
# the largest buffer is n chunks of the count for these
CHUNKED = ("all_gather", "reduce_scatter", "all_to_all", "all_gatherv", "all_to_allv", "reduce_scatterv",
           "gather", "scatter")
QUICK_COUNTS = (0, 1, 1001)
FULL_COUNTS = (0, 1, 2, 7, 127, 1001, 65537, (1 << 18) + 3)
# the largest buffer of the full run, per rank: over the largest piece the shared-memory path
# moves at once (8 MiB, shm_config.AUTO_PIECES), so that a call takes more than one; 12 MiB
# (not more: the whole run stays under a minute at 4 ranks on 2 CPU cores)
BIG_BYTES = 12 << 20
# the dtypes that run at BIG_BYTES: each MPI transport path (native, float16/bfloat16 upcast,
# 8-byte, complex) once
BIG_DTYPES = ("int8", "float16", "bfloat16", "float32", "float64", "complex64")
# the calls with per-rank sizes, gather, scatter, sendrecv and batch move data as the calls
# above do: at the large count one 4-byte dtype, and float16 (reduced in float32 on MPI)
BIG_DTYPES_NEW = ("float16", "float32")
NEW = ("all_gatherv", "all_to_allv", "reduce_scatterv", "gather", "scatter", "sendrecv", "batch")
BREAK_ENV = "MPICOMM_SMOKE_BREAK"


class Case:
    __slots__ = ("coll", "dtype", "op", "count", "group", "mode")

    def __init__(self, coll, dtype, op, count, group, mode):
        self.coll, self.dtype, self.op, self.count, self.group, self.mode = \
            coll, dtype, op, count, group, mode

    def key(self):
        return (self.coll, self.dtype, self.op or "-", self.count, self.group, self.mode)


def ops_for(dt, backend="mpi"):
    """The ops a reducing collective runs on ``dt``: bool reduces as torch.distributed does
    (SUM, MAX: OR; PROD, MIN: AND; no AVG); NCCL has no 16-bit integer reduction (mpicomm
    refuses it, as torch does), so on the NCCL backend int16 and uint16 only move."""
    kind = dtype_kind(dt)
    if kind == "b":
        return ("sum", "prod", "min", "max")
    if backend == "nccl" and dt.kind in "iu" and dt.itemsize == 2:
        return ()
    if kind == "c":
        return ("sum", "avg")
    if kind == "f":
        return OPS
    return ("sum", "prod", "min", "max")


def plan(dtypes, groups, quick, big_bytes=BIG_BYTES, n=1, backend="mpi"):
    """Every case of a run, in the same order on every rank.

    Every dtype and op runs at the small and medium counts (0 and 1 element, odd
    counts), sync and async, on every group, and all_reduce also in place. The full run
    adds one odd count of about ``big_bytes`` per rank (the largest buffer: ``n`` chunks
    of it for all_gather, reduce_scatter and all_to_all) for one dtype of each transport
    path (BIG_DTYPES; BIG_DTYPES_NEW for the calls of NEW), SUM and data movement, sync on
    every group and async on the first.
    """
    counts = QUICK_COUNTS if quick else FULL_COUNTS
    modes = ("sync", "async")
    cases = []
    for coll in COLLECTIVES:
        for gi, g in enumerate(groups):
            if coll == "barrier":
                for mode in modes:
                    cases.append(Case(coll, None, None, 0, g, mode))
                continue
            for name in dtypes:
                dt = np_dtype(name)
                ops = ops_for(dt, backend) if coll in REDUCING else (None,)
                for op in ops:
                    for count in counts:
                        for mode in modes:
                            cases.append(Case(coll, name, op, count, g, mode))
                        if coll == "all_reduce":
                            cases.append(Case(coll, name, op, count, g, "in-place"))
                    if quick or name not in (BIG_DTYPES_NEW if coll in NEW else BIG_DTYPES) \
                            or op not in (None, "sum"):
                        continue
                    per = big_bytes // dt.itemsize
                    if coll in CHUNKED:
                        per //= max(n, 1)
                    for mode in (modes if gi == 0 else modes[:1]):
                        cases.append(Case(coll, name, op, per | 1, g, mode))  # odd, 12 MiB
    return cases
