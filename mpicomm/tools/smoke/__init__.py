"""``mpicomm-smoke``: check every collective on this cluster, the way a real job runs.

Run it under the launcher the job will use, e.g. ``mpirun -n 4 mpicomm-smoke`` (or
``mpirun -n 4 python -m mpicomm.tools.smoke``). It initialises mpicomm with the
backend ``init()`` picks (NCCL with CuPy arrays where a GPU is seen, else MPI with
NumPy; ``--backend`` or MPICOMM_BACKEND override), then runs every collective x op x
dtype over counts from 0 and 1 element, odd counts, up to 12 MiB per buffer, on
the world and on a sub-group, sync and async. Every rank checks its own result against
a closed-form expectation (exact for integers, within a tolerance for floats); the
failures are gathered on rank 0, which prints a table (collective, dtypes, ops, counts,
time, PASS/FAIL), the classic AllGather check (each rank's ``[[rank]]`` as float32,
gathered), and one line per failure naming collective, dtype, op, count, group, mode
and the world ranks that disagreed. Every rank exits 0 only if everything passed.

``--quick`` keeps to small counts (a few seconds at 4 ranks on a 2-core machine).

The sub-group is world ranks n-1, n-2, ..., 1 in that order (at 2 ranks: [1, 0]), so
group ranks differ from world ranks and, from 3 ranks on, rank 0 is not a member; at 1
rank the world is the only group.

Self-test of the checker: ``MPICOMM_SMOKE_BREAK=all_gather`` (any collective name, or
several, comma-separated) corrupts that collective's result on the last rank of each
group before it is checked; the smoke must then exit non-zero and name it.

Modules: ``cli`` (arguments, the run, ``main``), ``cases`` (what a run covers, the plan),
``expected`` (each rank's data, the closed-form results, the comparison), ``runner`` (one
case's calls and checks), ``report`` (rank 0's table and failure lines).
"""
from .cases import (BIG_BYTES, BIG_DTYPES, BIG_DTYPES_NEW, BREAK_ENV, CHUNKED, COLLECTIVES, DTYPES, FULL_COUNTS,
                    NEW, OPS, QUICK_COUNTS, REDUCING, Case, ops_for, plan)
from .cli import main
from .expected import (PERIOD, compare, count_wrong, make_data, np_dtype, pattern, reduce_keys, tolerance,
                       wrong_mask)
from .report import failure_line, format_table, merge_failures, summary_rows
from .runner import Runner

__all__ = ["main", "BIG_BYTES", "BIG_DTYPES", "BIG_DTYPES_NEW", "BREAK_ENV", "CHUNKED", "COLLECTIVES", "DTYPES",
           "FULL_COUNTS", "NEW", "OPS", "QUICK_COUNTS", "REDUCING", "Case", "ops_for", "plan", "PERIOD", "compare",
           "count_wrong", "make_data", "np_dtype", "pattern", "reduce_keys", "tolerance", "wrong_mask",
           "failure_line", "format_table", "merge_failures", "summary_rows", "Runner"]
