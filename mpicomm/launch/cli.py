"""``mpicomm-run``: start a Python program on N ranks through mpirun.

    mpicomm-run -n N [--hostfile FILE | -H host:slots,...] [--oversubscribe]
                [-x NAME[=VALUE]]... [--log-dir DIR] [--timeout SECONDS] [--dry-run]
                [--mpirun PATH] [--] (script.py | -m module) [args...]

Also ``python -m mpicomm.launch``. The hostfile is checked before anything starts, the
mpirun command is built for the MPI that is installed (Open MPI 4/5 or MPICH), and
every rank gets ``MPICOMM_*``, ``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, ``PYTHONPATH``,
``LD_LIBRARY_PATH``, ``PATH`` (with this virtual environment first) and each ``-x``.
Ranks run under ``python -m mpi4py``, so an uncaught exception on one rank ends the job
instead of leaving the others waiting. See docs/LAUNCH.md.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys

from mpicomm.errors import MpicommError
from mpicomm.launch import hostfile as _hostfile
from mpicomm.launch import mpirun as _mpirun

# Options that take a value, so the program's first word can be told from them.
_VALUE_OPTIONS = {"-n", "-np", "--np", "--hostfile", "-H", "--host", "-x", "--log-dir",
                  "--timeout", "--mpirun"}
_FORWARD_PREFIXES = ("MPICOMM_", "NCCL_")
_FORWARD_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "LD_LIBRARY_PATH", "PATH",
                  "VIRTUAL_ENV")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TIMEOUT_EXIT = 124  # as coreutils' timeout
_GRACE_S = 10.0


class UsageError(MpicommError, ValueError):
    """A command-line argument is wrong; the message names it and what is allowed."""


def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-run",
        usage="mpicomm-run -n N [options] [--] (script.py | -m module) [args...]",
        description="Start a Python program on N ranks through mpirun.",
        epilog="Example: mpicomm-run -n 4 --hostfile hostfiles/localhost train.py --lr 0.1")
    p.add_argument("-n", "-np", "--np", dest="n", required=True, metavar="N",
                   help="number of ranks")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hostfile", metavar="FILE",
                       help='hosts, one per line: "host slots=N [max_slots=M]" or "host:N"')
    where.add_argument("-H", "--host", metavar="HOST:SLOTS,...",
                       help="hosts on the command line, e.g. node1:8,node2:8")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than slots")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="pass this environment variable to every rank (repeatable)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--timeout", metavar="SECONDS",
                   help="end the whole job after this many seconds (exit status 124)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the mpirun command and exit")
    p.add_argument("--mpirun", metavar="PATH", help="the mpirun to use (default: PATH)")
    return p


def split_argv(argv):
    """Split argv into (launcher options, program part) at the program's first word."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], argv[i + 1:]
        if tok == "-m":
            return argv[:i], argv[i:]
        if not tok.startswith("-") or tok == "-":
            return argv[:i], argv[i:]
        if tok in _VALUE_OPTIONS:
            i += 2
        else:
            i += 1
    return argv, []


def _positive_number(text, option, kind):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        value = None
    if value is None or value <= 0:
        what = "an integer >= 1" if kind is int else "a number of seconds > 0"
        raise UsageError(f"{option} {text!r}: expected {what}")
    return value


def _program(words, python):
    """The argv every rank runs, from the program part of the command line."""
    if not words:
        raise UsageError("no program given: expected script.py [args...] or -m module "
                         "[args...] after the options (e.g. mpicomm-run -n 2 train.py)")
    if words[0] == "-m":
        if len(words) < 2 or not words[1] or words[1].startswith("-"):
            raise UsageError("-m: expected a module name after -m (e.g. -m mpicomm.tools.doctor)")
        return [python, "-m", "mpi4py", "-m", words[1], *words[2:]]
    script = words[0]
    if not os.path.isfile(script):
        raise UsageError(f"script {script!r} does not exist (looked in {os.getcwd()}); "
                         f"expected a Python file, or -m module")
    # Absolute, so ranks that start in another directory still find it.
    return [python, "-m", "mpi4py", os.path.abspath(script), *words[1:]]


def _environment(env, extra):
    """Return (environment for mpirun, names to forward, (name, value) pairs to set)."""
    env = dict(env)
    venv_bin = os.path.join(sys.prefix, "bin")
    if sys.prefix != sys.base_prefix:
        parts = env.get("PATH", "").split(os.pathsep)
        if not parts or parts[0] != venv_bin:
            env["PATH"] = os.pathsep.join([venv_bin] + [p for p in parts if p and p != venv_bin])
    forward = sorted(n for n in env
                     if n.startswith(_FORWARD_PREFIXES) or n in _FORWARD_NAMES)
    set_env = []
    for item in extra:
        name, eq, value = item.partition("=")
        if not _NAME_RE.match(name):
            raise UsageError(f"-x {item!r}: {name!r} is not a variable name "
                             f"(letters, digits, '_', not starting with a digit)")
        if eq:
            forward = [n for n in forward if n != name]
            set_env = [(n, v) for n, v in set_env if n != name] + [(name, value)]
        elif name not in env:
            raise UsageError(f"-x {name}: {name} is not set in this environment; set it, "
                             f"or give its value with -x {name}=VALUE")
        elif name not in forward:
            forward.append(name)
    return env, forward, set_env


def _run(argv, env, timeout):
    """Run mpirun; return its exit status (124 if it was ended by the timeout)."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True)

    def forward(signum, frame):
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"mpicomm-run: the job ran longer than --timeout {timeout:g} s; "
                  f"ending it", file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGTERM)  # mpirun passes it on to every rank
            try:
                proc.wait(timeout=_GRACE_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            return TIMEOUT_EXIT
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def main(argv=None):
    """Parse the command line, check it, and run the job; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    options, words = split_argv(argv)
    try:
        args = _parser().parse_args(options)
    except SystemExit as exc:  # argparse printed usage (or --help); hand back its status
        return exc.code
    try:
        nprocs = _positive_number(args.n, "-n", int)
        timeout = None if args.timeout is None else \
            _positive_number(args.timeout, "--timeout", float)
        hosts = None
        if args.hostfile is not None:
            hosts = _hostfile.parse_hostfile(args.hostfile)
            _hostfile.check_capacity(hosts, nprocs, args.oversubscribe,
                                     f"hostfile {args.hostfile!r}")
        elif args.host is not None:
            hosts = _hostfile.parse_host_list(args.host)
            _hostfile.check_capacity(hosts, nprocs, args.oversubscribe,
                                     f"-H {args.host!r}")
        python = sys.executable
        program = _program(words, python)
        env, forward, set_env = _environment(os.environ, args.env)
        if args.log_dir is not None:
            log_dir = os.path.abspath(args.log_dir)
            if not args.dry_run:
                try:
                    os.makedirs(log_dir, exist_ok=True)
                except OSError as exc:
                    raise UsageError(f"--log-dir {args.log_dir!r}: cannot create it "
                                     f"({exc.strerror})") from exc
            program = [python, "-m", "mpicomm.launch.rankwrap", "--log-dir", log_dir,
                       "--", *program]
        mpirun = _mpirun.find_mpirun(args.mpirun)
        flavour = _mpirun.detect_flavour(mpirun)
        as_root = os.geteuid() == 0 and flavour.family == "openmpi"
        command = _mpirun.build_command(flavour, mpirun, nprocs, program, hosts=hosts,
                                        oversubscribe=args.oversubscribe,
                                        forward=forward, set_env=set_env,
                                        as_root=as_root)
    except MpicommError as exc:
        print(f"mpicomm-run: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(command))
        return 0
    if as_root:
        print("mpicomm-run: running as root: added --allow-run-as-root "
              "(Open MPI refuses root without it)", file=sys.stderr, flush=True)
    return _run(command, env, timeout)


if __name__ == "__main__":
    sys.exit(main())
