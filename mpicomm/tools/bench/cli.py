"""The command line: arguments, the run's shared state, the loop over sizes, ``main``."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import socket
import sys
import time
import types

import numpy as np

from .._common import load_mpi
from ..smoke import ops_for
from . import report
from .arrays import ARRAYS, CupyFamily, NumpyFamily, TorchFamily, check_importable, np_dtype
from .buckets import SHAPES_FILE, find_shapes_file, run_buckets
from .cases import Case, CaseV, counts_for
from .raw import RawMPI, RawNCCL
from .timing import CHUNKED, COLLS, REDUCING, ROOTED, TRIAL_ENV, TRIAL_MAX_BYTES, VCOLLS, Clock, trial, variant

PERCALL_COLLS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# nccl-tests' type names, and the names -d accepts for each dtype
TYPE_NAMES = {"bool": "bool", "int8": "int8", "uint8": "uint8", "int16": "int16", "uint16": "uint16", "int32": "int32", "uint32": "uint32", "int64": "int64",
              "uint64": "uint64", "float16": "half", "bfloat16": "bfloat16", "float32": "float",
              "float64": "double", "complex64": "complex64", "complex128": "complex128"}
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32",
                 "double": "float64", "fp64": "float64", "bf16": "bfloat16", "char": "int8",
                 "int": "int32", "uint": "uint32"}
OPS = ("sum", "prod", "min", "max", "avg")
# (sweep, --percall) defaults of the options whose default depends on the mode
MODE_DEFAULTS = {"iters": (20, 20000), "warmup": (5, 1000), "rounds": (4, 10), "stat": ("mean", "median")}
ENV_SHOWN = ("MPICOMM_BACKEND", "MPICOMM_DEBUG", "MPICOMM_SHM_THRESHOLD", "MPICOMM_SHM_PIECE", "MPICOMM_BENCH_TRIAL")


# ---------------------------------------------------------------- sizes

def parse_size(text):
    """Bytes from "8", "64K", "1M", "1G", "512KiB", "2MB" (K/M/G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: expected a number of bytes with an optional "
                         "K, M or G suffix (e.g. 8, 64K, 1M, 1G)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    v = float(m.group(1)) * mult
    if v != int(v):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(v)


def size_steps(minbytes, maxbytes, factor=2.0, step=None):
    """The sizes from ``minbytes`` to ``maxbytes``: times ``factor``, or plus ``step`` bytes."""
    if minbytes < 0 or maxbytes < minbytes:
        raise ValueError(f"invalid size range -b {minbytes} -e {maxbytes}: need 0 <= -b <= -e")
    if step is None and factor <= 1:
        raise ValueError(f"invalid step factor -f {factor}: need > 1 (or give -i STEP)")
    if step is not None and step <= 0:
        raise ValueError(f"invalid step -i {step}: need > 0")
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(int(s))
        if step is not None:
            s += step
        else:
            nxt = s * factor if s else 1
            s = int(nxt) if int(nxt) > s else s + 1
    return out


def percall_size(coll, minbytes, itemsize, n):
    """The size --percall times: ``-b`` bytes, at least one element per rank."""
    return max(minbytes, itemsize * (n if coll in CHUNKED else 1))


# ---------------------------------------------------------------- arguments

def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-bench",
        description="nccl-tests style benchmark of mpicomm's collectives (run under mpirun).",
        epilog=f"{TRIAL_ENV}=1: a trial run (sizes up to 64 KiB, one round, at most 3 iterations) that "
               "shows a command works, not what it measures.")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size in bytes (K/M/G suffixes; default 8)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest size in bytes (default 32M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor between steps (default 2)")
    p.add_argument("-i", "--stepbytes", default=None, help="size increment instead of -f")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed iterations per size (default 20, --percall 20000; 0: about --target-time s "
                        "per size)")
    p.add_argument("-w", "--warmup", "--warmup_iters", dest="warmup", type=int, default=None,
                   help="warm-up iterations (default 5, --percall 1000)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check results (default 1)")
    p.add_argument("-d", "--datatype", dest="dtype", default="float32",
                   help="dtype: float32 (float), float16 (half), bfloat16, float64 (double), int8, uint8, "
                        "int16, uint16, int32, uint32, int64, uint64, complex64, complex128, bool")
    p.add_argument("-o", "--op", default="sum", help="reduction: sum, prod, min, max, avg")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)")
    p.add_argument("--coll", default=None, choices=COLLS + ("buckets",),
                   help="the collective (default all_reduce; --percall: all_reduce, all_gather, "
                        "reduce_scatter and broadcast). all_gatherv and all_to_allv: all_gather(sizes=) and "
                        "all_to_all(in_splits=, out_splits=) with unequal parts; gather, scatter, sendrecv (a ring)")
    p.add_argument("--backend", choices=("mpi", "nccl"), default=None, help="default: what mpicomm.init picks")
    p.add_argument("--array", choices=ARRAYS, default=None,
                   help="arrays given to mpicomm: numpy, cupy or torch (PyTorch tensors: CUDA on NCCL, CPU "
                        "on MPI). Default: numpy on MPI, cupy on NCCL. The raw baseline keeps its own "
                        "(NumPy for mpi4py, CuPy for NCCL)")
    p.add_argument("--compare", action="store_true", help="also time raw mpi4py / raw CuPy NCCL")
    p.add_argument("--fresh", action="store_true",
                   help="new input and output arrays every call (as a training loop has), for mpicomm and "
                        "raw alike: a pool of --fresh-pool buffer pairs used in turn")
    p.add_argument("--fresh-pool", type=int, default=None, metavar="K",
                   help="buffer pairs in the --fresh pool (default 8; implies --fresh)")
    p.add_argument("--percall", action="store_true",
                   help="the per-call cost at the smallest size (-b, at least one element per rank): "
                        "mpicomm against raw, us per call, median of interleaved rounds (implies --compare)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds the iterations are split into (default 4, --percall 10)")
    p.add_argument("--stat", choices=("mean", "median", "min"), default=None,
                   help="per-call time from the rounds: mean (nccl-tests' average, the default), median "
                        "(--percall's default) or min of the rounds (robust to noise from other processes)")
    p.add_argument("--target-time", type=float, default=0.25, help="seconds per size and variant with -n 0")
    p.add_argument("--shm-threshold", default=None, metavar="BYTES|off",
                   help="set MPICOMM_SHM_THRESHOLD for this run: the size from which the MPI backend takes "
                        "its one-host shared-memory path (K/M/G suffixes; 0: always; off: never)")
    p.add_argument("--shm-piece", default=None, metavar="BYTES",
                   help="set MPICOMM_SHM_PIECE: the shared-memory path's pipelining piece (0: whole messages)")
    p.add_argument("--check-cost", action="store_true",
                   help="--percall: also time mpicomm with its agreement check (on by default) turned "
                        "off, in the same rounds (the check's cost per call)")
    p.add_argument("--debug", action="store_true",
                   help="mpicomm.init(debug=True): every collective first compares its arguments across ranks")
    p.add_argument("--shapes", default=None, help=f"gradient shapes for --coll buckets (default {SHAPES_FILE})")
    p.add_argument("--bucket-cap-mb", default=None, metavar="MIB[,MIB...]",
                   help="--coll buckets: the reducer's bucket cap (default: DistributedGradReducer's); each "
                        "further cap adds a row of its grad-view buckets (0: one all_reduce per tensor)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row to FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw busbw against size into FILE.png (needs matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def _check_env_size(opt, value):
    if value.strip().lower() == "off":
        return
    try:
        parse_size(value)
    except ValueError:
        raise ValueError(f"invalid {opt} {value!r}: expected a number of bytes (K/M/G suffixes) or off") from None


def _validate(args):
    """Check and normalise the arguments (the same on every rank: no MPI needed)."""
    d = DTYPE_ALIASES.get(args.dtype.lower(), args.dtype.lower())
    if d not in TYPE_NAMES:
        raise ValueError(f"invalid -d {args.dtype!r}: expected one of {', '.join(TYPE_NAMES)} "
                         f"(or {', '.join(DTYPE_ALIASES)})")
    args.dtype = d
    op = args.op.lower()
    if op not in OPS:
        raise ValueError(f"invalid -o {args.op!r}: expected one of {', '.join(OPS)}")
    args.op = op
    if args.percall:
        if args.coll == "buckets":
            raise ValueError("--percall times the collectives at one size: not with --coll buckets")
        if args.plot:
            raise ValueError("--plot draws busbw against size: not with --percall (use --json)")
        args.colls = list(PERCALL_COLLS) if args.coll is None else [args.coll]
        args.compare = True
    else:
        args.colls = [args.coll or "all_reduce"]
    args.coll = args.colls[0] if len(args.colls) == 1 else ",".join(args.colls)
    for k, (sweep, percall) in MODE_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, percall if args.percall else sweep)
    if any(c in REDUCING for c in args.colls):
        allowed = ops_for(np_dtype(d))
        if op not in allowed:
            raise ValueError(f"invalid -o {op!r} for -d {d}: expected one of {', '.join(allowed)}")
    if args.coll == "buckets" and d != "float32":
        raise ValueError(f"invalid -d {d} with --coll buckets: the gradient set is float32")
    if args.iters < 0 or args.warmup < 0 or args.rounds < 1:
        raise ValueError("invalid -n/-w/--rounds: need -n >= 0, -w >= 0, --rounds >= 1")
    if args.fresh_pool is not None:
        if args.fresh_pool < 1:
            raise ValueError(f"invalid --fresh-pool {args.fresh_pool}: need >= 1 buffer pairs")
        args.fresh = True
    args.pool = (args.fresh_pool or 8) if args.fresh else 1
    args.bucket_caps = None
    if args.bucket_cap_mb is not None:
        try:
            args.bucket_caps = [float(v) for v in args.bucket_cap_mb.split(",")]
        except ValueError:
            raise ValueError(f"invalid --bucket-cap-mb {args.bucket_cap_mb!r}: expected MiB, or several "
                             "comma-separated (e.g. 25,4,0)") from None
        if any(c < 0 for c in args.bucket_caps):
            raise ValueError(f"invalid --bucket-cap-mb {args.bucket_cap_mb!r}: need caps >= 0")
    for opt, v in (("--shm-threshold", args.shm_threshold), ("--shm-piece", args.shm_piece)):
        if v is not None:
            _check_env_size(opt, v)
    if args.plot:
        try:  # before the run, not after it
            report.pyplot()
        except ImportError as e:
            raise ValueError(str(e)) from None
    if args.array is not None:
        check_importable(args.array)
        if args.array == "cupy" and d == "bfloat16":
            raise ValueError("CuPy has no bfloat16: use --array torch (or numpy) with -d bfloat16")
    args.min_b = parse_size(args.minbytes)
    args.max_b = parse_size(args.maxbytes)
    step = parse_size(args.stepbytes) if args.stepbytes is not None else None
    if trial():
        args.max_b = min(args.max_b, TRIAL_MAX_BYTES)
        args.min_b = min(args.min_b, args.max_b)
        args.rounds = 1
        args.target_time = min(args.target_time, 0.01)
        args.iters = min(args.iters, 3)
        args.warmup = min(args.warmup, 1)
    args.sizes = size_steps(args.min_b, args.max_b, args.stepfactor, step)


# ---------------------------------------------------------------- the run's state

class Bench:
    """What every size of a run shares: mpicomm, the bench's own communicator, the array
    family, the stream and clock, the raw baseline."""

    def __init__(self, args):
        import mpicomm as mc
        from mpi4py import MPI

        kw = {"debug": True} if args.debug else {}
        if getattr(args, "check_cost", False):
            kw["check"] = True   # timed on, and off around its own blocks
        mc.init(args.backend, **kw)
        self.mc = mc
        self.args = args
        self.backend = mc.get_backend()
        self.n, self.rank = mc.get_group_size(), mc.get_rank()
        self.comm = MPI.COMM_WORLD.Dup()   # for the bench's own barriers, maxima and raw MPI
        self.dt = np_dtype(args.dtype)
        self.op, self.root, self.pool = args.op, args.root, args.pool
        self.stream = self.raw = self.device = None
        self.array = args.array or ("cupy" if self.backend == "nccl" else "numpy")

    def setup(self):
        """The arrays, stream, clock and raw baseline; ValueError (alike on every rank) when
        this backend, --array and -d do not go together."""
        a = self.args
        check_importable(self.array)
        sync = None
        if self.backend == "nccl" or self.array == "cupy":
            import cupy

            if self.backend == "nccl":
                self.device = cupy.cuda.runtime.getDevice()  # init made this rank's GPU current
            else:  # CuPy arrays on the MPI backend (staged through the host by mpicomm)
                try:
                    ngpu = cupy.cuda.runtime.getDeviceCount()
                except Exception as e:
                    raise ValueError(f"--array cupy needs a GPU: CUDA says {e}") from None
                self.device = self.mc.get_local_rank() % ngpu
            cupy.cuda.Device(self.device).use()
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.stream.use()  # mpicomm enqueues on the current stream: the same one as raw
            sync = self.stream.synchronize if self.backend == "nccl" else cupy.cuda.runtime.deviceSynchronize
        if self.array == "numpy":
            self.family = NumpyFamily()
        elif self.array == "cupy":
            self.family = CupyFamily()
            self.family.zeros(0, self.dt)  # raises for dtypes CuPy lacks
        else:
            if self.backend == "nccl":
                import torch

                torch.cuda.set_device(self.device)
                # mpicomm enqueues PyTorch tensors on PyTorch's current stream: make it the bench's
                torch.cuda.set_stream(torch.cuda.ExternalStream(self.stream.ptr, device=self.device))
                self.family = TorchFamily(torch.device("cuda", self.device))
            else:
                self.family = TorchFamily("cpu")
            self.family.tdtype(self.dt)
        if self.backend == "nccl":
            self.raw_family = self.family if self.array == "cupy" else CupyFamily(bytes_only=True)
        else:
            self.raw_family = self.family if self.array == "numpy" else NumpyFamily()
        self.clock = Clock(self.comm, sync)
        if a.compare:
            if self.backend == "nccl":
                self.raw = RawNCCL(self.comm, self.dt, self.op, self.root, self.n, self.rank, self.device,
                                   self.stream.ptr, fresh=a.fresh)
            else:
                self.raw = RawMPI(self.comm, self.dt, self.op, self.root, self.n, self.rank)

    def synchronize(self):
        if self.clock.sync is not None:
            self.clock.sync()

    def iters_for(self, f):
        """-n, or with -n 0 enough calls for --target-time seconds (agreed over ranks)."""
        a = self.args
        if a.iters > 0:
            return a.iters
        per = self.clock.probe(f, max(a.warmup, 1))
        return int(min(max(a.target_time / max(per, 1e-9), 5), 200000))

    def warmup(self):
        """-w; with --fresh at least one call per pool entry, so none is first touched while timed."""
        return max(self.args.warmup, self.pool) if self.pool > 1 else self.args.warmup

    def close(self):
        if self.raw is not None and hasattr(self.raw, "close"):
            self.raw.close()
        self.comm.Free()

    def versions(self):
        from mpi4py import MPI

        v = {"mpicomm": self.mc.__version__, "mpi4py": __import__("mpi4py").__version__,
             "mpi": MPI.Get_library_version().replace("\0", "").split(",")[0].strip(),
             "numpy": np.__version__, "python": platform.python_version()}
        if self.device is not None:
            import cupy

            v["cupy"] = cupy.__version__
            if self.backend == "nccl":
                try:
                    c = cupy.cuda.nccl.get_version()
                    v["nccl"] = f"{c // 10000}.{c % 10000 // 100}.{c % 100}" if c >= 10000 else str(c)
                except Exception:
                    pass
            try:
                v["gpu"] = cupy.cuda.runtime.getDeviceProperties(self.device)["name"].decode()
            except Exception:
                pass
        if self.array == "torch":
            v["torch"] = self.family.torch.__version__
        return v


# ---------------------------------------------------------------- the loops

def measure(b, coll, req):
    """Time one collective at ``req`` bytes: mpicomm and raw, out-of-place and in-place,
    interleaved; check the results with -c 1. Returns the row (on every rank)."""
    a, n = b.args, b.n
    count, size = counts_for(coll, req, b.dt.itemsize, n)
    case = (CaseV if coll in VCOLLS else Case)(b, coll, count)
    fns = [case.oop, case.raw_oop, case.ip, case.raw_ip]
    if getattr(a, "check_cost", False):
        fns.append(_unchecked(case.oop or case.ip))
    b.clock.warm(fns, b.warmup())
    iters = b.iters_for(case.oop or case.ip)
    t_oop, t_roop, t_ip, t_rip, *t_off = b.clock.time(fns, iters, a.rounds, a.stat)
    row = {"coll": coll, "size": size, "count": count, "type": TYPE_NAMES[a.dtype],
           "redop": a.op if coll in REDUCING else "none", "root": b.root if coll in ROOTED else -1,
           "iters": iters}
    for key, t, f, chk in (("oop", t_oop, case.oop, case.check_oop), ("ip", t_ip, case.ip, case.check_ip)):
        if f is None:
            row[key] = None
            continue
        wrong = None
        if a.check:
            wrong = b.comm.allreduce(int(chk()))  # summed over ranks
        row[key] = variant(coll, size, t, n, wrong)
    if t_off:
        row["unchecked"] = variant(coll, size, t_off[0], n)
        del row["unchecked"]["wrong"]
        row["checked_col"] = "oop" if case.oop is not None else "ip"
    for key, t in (("raw_oop", t_roop), ("raw_ip", t_rip)):
        row[key] = None
        if t is not None:
            row[key] = variant(coll, size, t, n)
            del row[key]["wrong"]
    return row


def _unchecked(f):
    """``f`` run with the world's agreement check off (turned off and on around each block)."""
    from mpicomm._reliability.agreement import set_checking

    # the same callable as the checked variant: only the setting differs between the two
    return types.SimpleNamespace(fn=f, around=lambda start: set_checking(not start))


def run_sizes(b, progress):
    """Every size of -b..-e for the one collective; rank 0 prints the table."""
    a = b.args
    coll = a.colls[0]
    rows = []
    t_start = time.perf_counter()
    if b.rank == 0:
        print("\n".join(report.header(a.compare)), flush=True)
    for i, req in enumerate(a.sizes):
        row = measure(b, coll, req)
        rows.append(row)
        if b.rank == 0:
            print(report.format_row(row, a.compare), flush=True)
            if progress:
                print(f"[mpicomm-bench] {coll} {i + 1}/{len(a.sizes)}: {row['size']} B x {row['iters']} iters, "
                      f"{time.perf_counter() - t_start:.1f} s so far", file=sys.stderr, flush=True)
    if b.rank == 0:
        print("\n".join(report.summary_lines(rows, a.compare)) + "\n", flush=True)
    return rows


def run_percall(b, progress):
    """Each collective at its smallest size, mpicomm against raw; rank 0 prints us per call."""
    a = b.args
    rows = []
    if b.rank == 0:
        print("\n".join(report.percall_header(a.rounds, a.iters or "auto", a.stat)), flush=True)
    for coll in a.colls:
        row = measure(b, coll, percall_size(coll, a.min_b, b.dt.itemsize, b.n))
        rows.append(row)
        if b.rank == 0:
            print("\n".join(report.percall_lines(row)), flush=True)
            if progress:
                print(f"[mpicomm-bench] --percall {coll} done ({row['iters']} iters)", file=sys.stderr, flush=True)
    if b.rank == 0:
        print(report.summary_lines(rows, False)[0] + "\n", flush=True)
    return rows


def _preamble(b, infos):
    a = b.args
    what = ("--percall " if a.percall else "") + a.coll
    mode = f"new arrays every call (pool of {b.pool})" if a.fresh else "the same arrays every call"
    lines = [f"# mpicomm-bench {what}: {b.n} rank(s), backend {b.backend}, array {b.array}, dtype {a.dtype}, "
             f"op {a.op}, iters {a.iters or 'auto'}, warmup {a.warmup}, check {a.check}, "
             f"{a.stat} of {a.rounds} interleaved rounds, {mode}"
             + (", debug" if a.debug else "")
             + (", --compare (raw " + ("CuPy NCCL" if b.backend == "nccl" else "mpi4py") + ")"
                if a.compare else "")]
    lines.append("# " + ", ".join(f"{k} {val}" for k, val in b.versions().items()))
    env = [f"{k}={os.environ[k]}" for k in ENV_SHOWN if k in os.environ]
    if env:
        lines.append("# " + " ".join(env))
    if trial():
        lines.append(f"# a trial run ({TRIAL_ENV}=1): sizes up to {TRIAL_MAX_BYTES} bytes, one round, "
                     "at most 3 iterations: it shows the command works, not what it measures")
    lines.append("#")
    for r, (host, pid, dev) in enumerate(infos):
        lines.append(f"#  Rank {r:2d} Pid {pid:7d} on {host:>12s}" + (f" device {dev}" if dev is not None else ""))
    lines.append("#")
    return lines


def main(argv=None):
    """Run the benchmark on every rank; rank 0 prints the table. Returns 0, 1 if a check
    failed, 2 for invalid arguments (alike on every rank)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code
    try:
        _validate(args)
    except ValueError as e:
        print(f"mpicomm-bench: {e}", file=sys.stderr)
        return 2
    if load_mpi("mpicomm-bench") is None:
        return 2
    # before init, which reads them; every rank sets the same values
    if args.shm_threshold is not None:
        os.environ["MPICOMM_SHM_THRESHOLD"] = args.shm_threshold
    if args.shm_piece is not None:
        os.environ["MPICOMM_SHM_PIECE"] = args.shm_piece
    # repeated in-place sums overflow to inf by design (as in nccl-tests): no warnings
    with np.errstate(all="ignore"):
        return _run(args, argv)


def _run(args, argv):
    b = Bench(args)
    problem = None
    if not 0 <= args.root < b.n:
        problem = f"invalid -r {args.root}: expected a rank in 0..{b.n - 1}"
    elif args.coll == "buckets":
        try:  # the same files on every rank of a job: every rank fails alike, none hangs
            find_shapes_file(args.shapes)
        except FileNotFoundError as e:
            problem = str(e)
    if problem is None:
        try:
            b.setup()
        except (ValueError, ImportError) as e:
            problem = str(e)
    if problem is not None:
        if b.rank == 0:
            print(f"mpicomm-bench: {problem}", file=sys.stderr)
        b.close()
        return 2
    progress = not args.quiet
    infos = b.comm.gather((socket.gethostname(), os.getpid(), b.device), root=0)
    meta = {"coll": args.coll, "colls": args.colls, "backend": b.backend, "array": b.array, "nranks": b.n,
            "dtype": args.dtype, "op": args.op, "root": args.root, "iters": args.iters, "warmup": args.warmup,
            "rounds": args.rounds, "stat": args.stat, "check": args.check, "compare": args.compare,
            "fresh": args.fresh, "fresh_pool": b.pool if args.fresh else None, "percall": args.percall,
            "debug": args.debug, "env": {k: os.environ[k] for k in ENV_SHOWN if k in os.environ},
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpus": os.cpu_count(), "argv": argv, "versions": b.versions()}
    if b.rank == 0:
        print("\n".join(_preamble(b, infos)), flush=True)
    if args.percall:
        rows = run_percall(b, progress)
    elif args.coll == "buckets":
        rows = run_buckets(b, progress, lambda line: print(line, flush=True))
    else:
        rows = run_sizes(b, progress)
    status = 1 if report.count_wrong(rows)[0] else 0
    if b.rank == 0:
        if args.json:
            report.write_json(args.json, meta, rows)
        if args.plot:
            title = (f"mpicomm {args.coll}, {b.n} ranks, {b.backend}, {b.array}, {args.dtype}"
                     + (f" {args.op}" if args.coll in REDUCING else "") + (", fresh arrays" if args.fresh else ""))
            report.plot(rows, args.plot, title, buckets=args.coll == "buckets")
    status = b.comm.bcast(status, root=0)
    b.close()
    return status
