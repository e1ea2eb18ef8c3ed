"""Hostfiles and ``-H`` host lists: parse, validate, and check that ``-n`` ranks fit.

Two line forms are accepted, one host per line, ``#`` starting a comment:

- Open MPI's: ``node1 slots=8 max_slots=16`` (``max_slots`` optional);
- MPICH's and Horovod's: ``node1:8``.

A bare ``node1`` counts as Open MPI counts it: as many slots as that host has cores.
For this machine (``localhost``, its host name, ``127.*``) that number is known here
(:func:`local_cores`); for another host it is not, and :class:`Host` keeps ``slots=None``.

A host on several lines is refused when any of those lines gives a slot count (Open
MPI 5 refuses such a file); a host repeated on bare lines gets one slot per line, the
one-line-per-slot form of PBS node files, as Open MPI counts it.

In ``-H`` lists a bare name is 1 slot and repeated names add up, as in Open MPI's
``--host``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket

from mpicomm.errors import InvalidArgumentError

__all__ = ["Host", "HostfileError", "parse_hostfile", "parse_hostfile_text",
           "parse_host_list", "check_capacity", "format_host_list", "local_cores",
           "is_local_host", "resolve_local_slots", "check_host_name"]

RIGHT_FORM = ('"host slots=N [max_slots=M]" or "host:N" '
              '(e.g. "node1 slots=8" or "node1:8")')

# Host names and IPv4 addresses: letters, digits, '.', '-', '_'; not starting or
# ending with '.' or '-'.
_HOST_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_KEYS = {"slots": "slots", "max_slots": "max_slots", "max-slots": "max_slots"}
_LOCAL_NAMES = ("localhost", "localhost.localdomain")


class HostfileError(InvalidArgumentError):
    """A hostfile line or ``-H`` entry is malformed, or the ranks do not fit the slots."""


@dataclasses.dataclass
class Host:
    """One host and its slot counts.

    ``slots`` is None when the hostfile gives no count for a host other than this one
    (Open MPI then counts the cores there); ``max_slots`` is None when not limited.
    """

    name: str
    slots: int | None
    max_slots: int | None = None


def local_cores():
    """The number of cores this process may run on, as Open MPI counts slots by default.

    Physical cores (hardware threads of one core count once) among the CPUs in this
    process's affinity mask; the number of CPUs in the mask where the topology is not
    readable.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "physical_package_id") as f:
                package = f.read().strip()
            with open(base + "core_id") as f:
                core = f.read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def is_local_host(name):
    """True for names that mean this machine: localhost, 127.*, its host name."""
    if name in _LOCAL_NAMES or name.startswith("127."):
        return True
    here = socket.gethostname()
    return name in (here, here.split(".", 1)[0])


def resolve_local_slots(hosts, cores=None):
    """Return ``hosts`` with the slot count of this machine filled in where not given."""
    if cores is None and any(h.slots is None and is_local_host(h.name) for h in hosts):
        cores = local_cores()
    return [dataclasses.replace(h, slots=cores) if h.slots is None and is_local_host(h.name)
            else h for h in hosts]


def _positive_int(text, what, where):
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise HostfileError(f"{where}: {what}={text!r} is not a positive integer; "
                            f"expected {RIGHT_FORM}")
    return int(text)


def check_host_name(name, where, expected=RIGHT_FORM, error=HostfileError):
    """Raise ``error`` unless ``name`` is a valid host name or IPv4 address."""
    if not _HOST_RE.match(name):
        raise error(f"{where}: host name {name!r} is not a valid host name "
                            f"(letters, digits, '.', '-', '_'); expected {expected}")


def _parse_entry(text, where, bare_slots):
    """Parse one host entry (a hostfile line without comment).

    Returns (Host, counted): counted is False for a bare name, which gets ``bare_slots``.
    """
    # Tolerate "slots = 4" by gluing the '=' to its key.
    text = re.sub(r"\s*=\s*", "=", text.strip())
    tokens = text.split()
    first = tokens[0]
    if "=" in first:
        raise HostfileError(f"{where}: line starts with {first!r} instead of a host name; "
                            f"expected {RIGHT_FORM}")
    if ":" in first:
        if len(tokens) > 1:
            raise HostfileError(f"{where}: unexpected {' '.join(tokens[1:])!r} after "
                                f"{first!r}; expected {RIGHT_FORM}")
        name, _, count = first.partition(":")
        check_host_name(name, where)
        return Host(name, _positive_int(count, "slots", where)), True
    check_host_name(first, where)
    values = {}
    for tok in tokens[1:]:
        key, eq, value = tok.partition("=")
        if not eq:
            raise HostfileError(f"{where}: unexpected {tok!r} (not key=value); "
                                f"expected {RIGHT_FORM}")
        if key not in _KEYS:
            raise HostfileError(f"{where}: unknown key {key!r}; allowed keys are slots "
                                f"and max_slots; expected {RIGHT_FORM}")
        if _KEYS[key] in values:
            raise HostfileError(f"{where}: {key} given twice; expected {RIGHT_FORM}")
        values[_KEYS[key]] = _positive_int(value, key, where)
    max_slots = values.get("max_slots")
    if "slots" not in values and max_slots is None:
        return Host(first, bare_slots), False
    slots = values.get("slots", bare_slots)
    if max_slots is not None and slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is less than slots={slots}; "
                            f"max_slots must be >= slots")
    return Host(first, slots, max_slots), True


def _merge(entries):
    """Merge repeated hosts (slots add up), keeping first-seen order: the -H rule."""
    merged = {}
    for host in entries:
        seen = merged.get(host.name)
        if seen is None:
            merged[host.name] = dataclasses.replace(host)
            continue
        seen.slots += host.slots
        # A limit survives only if every entry for the host gives one.
        if seen.max_slots is None or host.max_slots is None:
            seen.max_slots = None
        else:
            seen.max_slots += host.max_slots
    return list(merged.values())


def parse_hostfile_text(text, source="<hostfile>"):
    """Parse hostfile text; ``source`` names it in error messages.

    A bare host name has ``slots=None`` (the cores of that host; see
    :func:`resolve_local_slots`), or one slot per line when it is repeated on bare lines.
    Raises HostfileError naming the source, the line number(s) and the right form.
    """
    lines = {}   # name -> [(lineno, Host, counted)], in first-seen order
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            host, counted = _parse_entry(line, f"{source}, line {lineno}", None)
            lines.setdefault(host.name, []).append((lineno, host, counted))
    if not lines:
        raise HostfileError(f"{source}: names no host (only blank lines and comments); "
                            f"expected lines like {RIGHT_FORM}")
    hosts = []
    for name, seen in lines.items():
        if len(seen) == 1:
            hosts.append(seen[0][1])
            continue
        if any(counted for _, _, counted in seen):
            first, second = seen[0][0], seen[1][0]
            raise HostfileError(
                f"{source}: host {name!r} is listed twice (lines {first} and {second}); "
                f"give each host one line with its slot count, e.g. \"{name} slots=N\" "
                f"(bare repeated lines, without counts, mean one slot per line)")
        hosts.append(Host(name, len(seen)))
    return hosts


def parse_hostfile(path):
    """Read and parse the hostfile at ``path`` (see the module docstring for the forms).

    Raises HostfileError if the file cannot be read or a line is malformed.
    """
    text = read_text(path, f"--hostfile {str(path)!r}", HostfileError)
    return parse_hostfile_text(text, source=str(path))


def read_text(path, where, error):
    """The text of the file at ``path``; ``error(message)`` naming ``where`` if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise error(f"{where}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not a text file ({exc})") from exc


def parse_host_list(text):
    """Parse a ``-H`` value: ``host[:slots],host[:slots],...`` (no slots means 1).

    Raises HostfileError naming the bad entry.
    """
    if not text.strip():
        raise HostfileError("-H/--host '': give hosts as host:slots,... (e.g. node1:8,node2:8)")
    entries = []
    for i, item in enumerate(text.split(","), start=1):
        item = item.strip()
        where = f"-H/--host {text!r}, entry {i}"
        if not item or " " in item or "=" in item:
            raise HostfileError(f"{where} ({item!r}): expected host or host:slots, "
                                f"comma-separated (e.g. node1:8,node2:8)")
        entries.append(_parse_entry(item, where, 1)[0])
    return _merge(entries)


def format_host_list(hosts, unknown="*"):
    """The ``host:slots,...`` form that both Open MPI's --host and MPICH's -hosts take.

    A host without a known count is written ``host:<unknown>``; ``unknown=None`` writes
    the bare name instead.
    """
    def one(h):
        if h.slots is not None:
            return f"{h.name}:{h.slots}"
        return h.name if unknown is None else f"{h.name}:{unknown}"

    return ",".join(one(h) for h in hosts)


def check_capacity(hosts, nprocs, oversubscribe, source):
    """Raise HostfileError unless ``nprocs`` ranks fit on ``hosts``.

    More ranks than slots needs ``oversubscribe``; even then no host may exceed its
    ``max_slots`` (when every host has one, their sum is a hard limit). Hosts whose slot
    count is not known here (``slots=None``) are not checked.
    """
    if any(h.slots is None for h in hosts):
        return
    total = sum(h.slots for h in hosts)
    listing = ", ".join(f"{h.name}: {h.slots}" for h in hosts)
    if nprocs <= total:
        return
    if not oversubscribe:
        raise HostfileError(
            f"-n {nprocs} asks for more ranks than the {total} slots in {source} "
            f"({listing}); lower -n, add slots, or pass --oversubscribe")
    if all(h.max_slots is not None for h in hosts):
        cap = sum(h.max_slots for h in hosts)
        if nprocs > cap:
            limits = ", ".join(f"{h.name}: {h.max_slots}" for h in hosts)
            raise HostfileError(
                f"-n {nprocs} exceeds the max_slots of every host in {source} "
                f"(total {cap}: {limits}), even with --oversubscribe; lower -n or raise "
                f"max_slots")
