"""``mpicomm-bench``: an nccl-tests style benchmark of mpicomm's collectives.

Run under mpicomm-run, e.g. ``mpicomm-run -n 2 mpicomm-bench -b 8 -e 1G -f 2 --compare``
(or ``python -m mpicomm.tools.bench``). Flags follow nccl-tests: ``-b``/``-e`` the smallest
and largest size in bytes (K/M/G suffixes, powers of 1024), ``-f`` the step factor (or
``-i`` a step in bytes), ``-n`` iterations (0: enough for about ``--target-time``
seconds per size), ``-w`` warm-up iterations, ``-c`` check results (0/1), ``-d`` dtype,
``-o`` reduction op, ``-r`` root, ``--coll`` the collective.

The table has nccl-tests' columns (size, count, type, redop, root, then time, algbw,
busbw and #wrong, out-of-place and in-place), with its bus-bandwidth factors: all_reduce
2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1. Times
are per call, averaged over the iterations and the maximum over ranks. ``size`` is one
rank's largest buffer (the gathered output of all_gather, the input of reduce_scatter),
``count`` the elements per rank of nccl-tests' parameter count. As nccl-tests does,
mpicomm gets preallocated ``out=`` arrays. In place is nccl-tests' form: all_gather's
input is this rank's part of its output, reduce_scatter's output is this rank's part of
its input. Where mpicomm has no such form (broadcast is in place only, all_to_all has no
in-place form) the columns say N/A.

``--compare`` also times the raw library in the same run, on its own communicator and
the same buffers, interleaved with mpicomm per size (mpicomm, raw, raw, mpicomm, ... in
rounds, so machine noise hits both): mpi4py ``Comm.Allreduce`` & co on the MPI backend,
CuPy ``NcclCommunicator`` calls on NCCL. It adds, per variant, raw's time, the ratio
mpicomm busbw / raw busbw (1.00: as fast as raw) and the time mpicomm adds per call; the
summary names the worst ratio at >= 1 MiB over both columns. On GPUs, N calls are
launched and the stream synchronized once, then the host time is divided by N.

``--fresh`` gives every call new input and output arrays, as a training loop does: a
pool of ``--fresh-pool`` (8) buffer pairs used in turn, by mpicomm and raw alike.
``--array numpy|cupy|torch`` picks what mpicomm is handed (PyTorch: CUDA tensors on
NCCL, CPU tensors on MPI); the raw baseline keeps NumPy / CuPy. ``--percall`` prints
the per-call cost at the smallest size of all_reduce, all_gather, reduce_scatter and
broadcast (median of interleaved rounds). ``--shm-threshold``/``--shm-piece`` set
MPICOMM_SHM_THRESHOLD/MPICOMM_SHM_PIECE, ``--debug`` runs mpicomm in debug mode.

``--coll buckets`` times the ResNet-50 gradient set (``--shapes FILE``,
``$MPICOMM_GRAD_SHAPES``, else the set that ships in ``mpicomm/tools/bench/data``): one in-place all_reduce per tensor,
DistributedGradReducer's buckets (``--bucket-cap-mb``), and one flat buffer. ``--json
FILE`` writes every row; ``--plot FILE.png`` draws busbw against size (mpicomm and raw).

Modules: ``cli`` (arguments, the loops, ``main``), ``timing`` (clock, rounds,
bandwidths), ``arrays`` (the array families), ``cases`` (mpicomm's calls and the result
checks), ``raw`` (the mpi4py and CuPy NCCL baselines), ``buckets``, ``report`` (tables,
JSON, plot).
"""
from .cli import main

__all__ = ["main"]
