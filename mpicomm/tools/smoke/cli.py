"""``mpicomm-smoke``'s command line: arguments, the run on every rank, the verdict."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .._common import load_mpi
from .cases import BREAK_ENV, COLLECTIVES, DTYPES, plan
from .expected import compare, np_dtype
from .report import print_report
from .runner import Runner


def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-smoke",
        description="Check every collective x op x dtype on this job's ranks (run under mpirun).")
    p.add_argument("--quick", action="store_true", help="small counts only: a few seconds")
    p.add_argument("--backend", choices=("mpi", "nccl"), default=None,
                   help="backend to init (default: what mpicomm.init picks)")
    p.add_argument("--dtypes", default=None, help="comma-separated subset of " + ",".join(DTYPES))
    p.add_argument("--collectives", default=None, help="comma-separated subset of " + ",".join(COLLECTIVES))
    p.add_argument("--no-subgroup", action="store_true", help="test the world only")
    p.add_argument("-v", "--verbose", action="store_true", help="print every failure, not the first 20")
    return p


def _supported_dtypes(xp, names):
    """The dtypes this rank's array library can hold (bfloat16 needs a CuPy that knows it)."""
    ok = []
    for name in names:
        try:
            dt = np_dtype(name)
            if xp is not np:
                xp.asarray(np.zeros(1, dt))
        except Exception:
            continue
        ok.append(name)
    return ok


def _selection(args):
    """(dtypes, collectives) the arguments ask for, or None after printing what is unknown."""
    dtypes = DTYPES if not args.dtypes else tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    colls = COLLECTIVES if not args.collectives else tuple(
        c.strip() for c in args.collectives.split(",") if c.strip())
    for d in dtypes:
        if d not in DTYPES:
            print(f"mpicomm-smoke: unknown dtype {d!r}; expected some of {', '.join(DTYPES)}", file=sys.stderr)
            return None
    for c in colls:
        if c not in COLLECTIVES:
            print(f"mpicomm-smoke: unknown collective {c!r}; expected some of {', '.join(COLLECTIVES)}",
                  file=sys.stderr)
            return None
    return dtypes, colls


def _groups(mc, n, rank, no_subgroup):
    """name -> (size, this rank's group rank or None, mpicomm group argument): the world, and
    unless ``no_subgroup`` the sub-group n-1, n-2, ..., 1 (at 2 ranks: [1, 0]). Collective."""
    groups = {"world": (n, rank, None)}
    if n > 1 and not no_subgroup:
        sub = list(range(n - 1, 0, -1)) if n > 2 else [1, 0]
        mc.create_group("smoke_sub", sub)
        groups["sub" + str(sub).replace(" ", "")] = (len(sub), sub.index(rank) if rank in sub else None,
                                                     "smoke_sub")
    return groups


def _classic(mc, runner, rank, n, breaks):
    """The classic check: each rank's [[rank]], gathered along axis 0. (result, failure or None)"""
    x = runner.xp.asarray(np.array([[rank]], np.float32))
    classic = runner.host(mc.all_gather(x))
    classic_ok = compare(classic, np.arange(n, dtype=np.float32).reshape(n, 1), np.dtype(np.float32))
    if "all_gather" in breaks and rank == n - 1:
        classic = classic.copy()
        classic[-1, 0] += 1
        classic_ok = "corrupted (" + BREAK_ENV + ")"
    return classic, classic_ok


def main(argv=None):
    """Run the smoke test on every rank; return 0 if every check passed on every rank."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return exc.code
    chosen = _selection(args)
    if chosen is None:
        return 2
    dtypes, colls = chosen
    breaks = {b.strip() for b in os.environ.get(BREAK_ENV, "").split(",") if b.strip()}

    import mpicomm as mc

    MPI = load_mpi("mpicomm-smoke")
    if MPI is None:
        return 2
    t_start = time.perf_counter()
    mc.init(args.backend)
    comm = MPI.COMM_WORLD
    rank, n = mc.get_rank(), mc.get_group_size()
    backend = mc.get_backend()
    if backend == "nccl":
        import cupy as xp
    else:
        xp = np
    # every rank tests the same dtypes (agree first: a dtype skipped on one rank only would hang)
    mine = _supported_dtypes(xp, dtypes)
    common = [d for d in dtypes if all(d in s for s in comm.allgather(mine))]
    skipped = [d for d in dtypes if d not in common]

    groups = _groups(mc, n, rank, args.no_subgroup)
    all_cases = plan(common, list(groups), args.quick, n=n, backend=backend)
    cases = [c for c in all_cases if c.coll in colls]
    runner = Runner(mc, xp, groups, breaks)
    times = {}
    for c in cases:
        t0 = time.perf_counter()
        runner.run(c)
        times[c.coll] = times.get(c.coll, 0.0) + time.perf_counter() - t0

    classic, classic_ok = _classic(mc, runner, rank, n, breaks)
    mine_fail = [(k, d, rank) for k, d in runner.failures]
    if classic_ok is not None:
        mine_fail.append((("all_gather", "float32", "-", 1, "world", "classic [[rank]]"), classic_ok, rank))
    gathered = comm.gather((mine_fail, runner.checks), root=0)
    status = 0
    if rank == 0:
        failures = [f for fs, _ in gathered for f in fs]
        checks = sum(c for _, c in gathered)
        status = 1 if failures else 0
        lib = MPI.Get_library_version().replace("\0", "").split(",")[0].strip()
        gtext = "; ".join(f"{name}: {size} rank(s)" for name, (size, _, _) in groups.items())
        print(f"mpicomm-smoke: {n} rank(s), backend {backend}, {lib}; mpi4py "
              f"{__import__('mpi4py').__version__}; groups {gtext}"
              + ("; quick" if args.quick else ""))
        if skipped:
            print(f"skipped dtypes (not supported by this rank's array library on every rank): "
                  f"{', '.join(skipped)}")
        if breaks:
            print(f"{BREAK_ENV}={','.join(sorted(breaks))}: corrupting those results on purpose "
                  "(self-test of the checker)")
        print_report(cases, times, failures, classic, checks, n, time.perf_counter() - t_start, args.verbose)
        sys.stdout.flush()
    return comm.bcast(status, root=0)
