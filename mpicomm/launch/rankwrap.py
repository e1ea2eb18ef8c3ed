"""In front of each rank's program: ``python -m mpicomm.launch.rankwrap [--report ADDR]
[--log-dir DIR] -- PROGRAM...``.

``--report ADDR``: tell mpicomm-run (listening at host:port ADDR) that this rank has
started, before anything else (mpicomm-run's start-up watch of multi-host jobs), over a
connection the program inherits and holds until its process ends.

``--log-dir DIR``: mpicomm-run puts this in front of the program when ``--log-dir`` is given. Each rank
writes its output to ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr``; rank 0's output
also goes on to the terminal. Ranks other than 0 redirect and ``exec`` the program, so
nothing stands between mpirun and them; rank 0 runs the program as a child and copies
its two streams to both places.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def rank_from_env(env=None):
    """This process's rank as mpirun told it; raises RuntimeError when none is set."""
    env = os.environ if env is None else env
    for name in RANK_VARIABLES:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    raise RuntimeError(f"rankwrap: none of {', '.join(RANK_VARIABLES)} is set: "
                       f"run it under mpirun (mpicomm-run --log-dir does)")


def _copy(src_fd, outputs):
    """Copy src_fd to every fd in outputs until EOF; a closed output is dropped."""
    outputs = list(outputs)
    while True:
        try:
            chunk = os.read(src_fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        for fd in list(outputs):
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:
                outputs.remove(fd)
    os.close(src_fd)


def _die_with_parent():
    # If rank 0's wrapper is killed outright, its program must not outlive it.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _tee_and_wait(program, out_fd, err_fd):
    import subprocess

    proc = subprocess.Popen(program, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
    threads = [threading.Thread(target=_copy, args=(proc.stdout.fileno(), (out_fd, 1))),
               threading.Thread(target=_copy, args=(proc.stderr.fileno(), (err_fd, 2)))]
    for t in threads:
        t.start()
    code = proc.wait()
    for t in threads:
        t.join()
    return 128 - code if code < 0 else code


def main(argv=None):
    """Redirect this rank's output into the log directory, then run the program."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = {}
    while len(argv) >= 2 and argv[0] in ("--log-dir", "--report") and argv[0] not in opts:
        opts[argv[0]] = argv[1]
        argv = argv[2:]
    if not opts or len(argv) < 2 or argv[0] != "--":
        print("usage: python -m mpicomm.launch.rankwrap [--report HOST:PORT] [--log-dir DIR] -- "
              "PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    program = argv[1:]
    rank = rank_from_env()
    if "--report" in opts:
        from .startup import report

        # held open until this rank's process ends: the program exec'd below inherits it
        held = report(opts["--report"], rank)
        if held is not None:
            os.set_inheritable(held.fileno(), True)
    log_dir = opts.get("--log-dir")
    if log_dir is None:
        try:
            os.execvp(program[0], program)
        except OSError as exc:
            print(f"rankwrap: cannot run {program[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127
    rank_dir = os.path.join(log_dir, f"rank.{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out_fd = os.open(os.path.join(rank_dir, "stdout"), flags, 0o644)
    err_fd = os.open(os.path.join(rank_dir, "stderr"), flags, 0o644)
    if rank == 0:
        return _tee_and_wait(program, out_fd, err_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        print(f"rankwrap: cannot run {program[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
