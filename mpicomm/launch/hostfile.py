"""Hostfiles and ``-H`` host lists: parse, validate, and check that ``-n`` ranks fit.

Two line forms are accepted, one host per line, ``#`` starting a comment:

- Open MPI's: ``node1 slots=8 max_slots=16`` (``max_slots`` optional; a bare ``node1``
  means 1 slot, as in MPICH's hostfiles, so the count never depends on the remote CPU);
- MPICH's and Horovod's: ``node1:8``.

A host named on several lines is **merged**: its slots add up (Open MPI does the same).
"""
from __future__ import annotations

import dataclasses
import re

from mpicomm.errors import InvalidArgumentError

__all__ = ["Host", "HostfileError", "parse_hostfile", "parse_hostfile_text",
           "parse_host_list", "check_capacity", "format_host_list"]

RIGHT_FORM = ('"host slots=N [max_slots=M]" or "host:N" '
              '(e.g. "node1 slots=8" or "node1:8")')

# Host names and IPv4 addresses: letters, digits, '.', '-', '_'; not starting or
# ending with '.' or '-'.
_HOST_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_KEYS = {"slots": "slots", "max_slots": "max_slots", "max-slots": "max_slots"}


class HostfileError(InvalidArgumentError):
    """A hostfile line or ``-H`` entry is malformed, or the ranks do not fit the slots."""


@dataclasses.dataclass
class Host:
    """One host and its slot counts; ``max_slots`` is None when not limited."""

    name: str
    slots: int
    max_slots: int | None = None


def _positive_int(text, what, where):
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise HostfileError(f"{where}: {what}={text!r} is not a positive integer; "
                            f"expected {RIGHT_FORM}")
    return int(text)


def _check_name(name, where):
    if not _HOST_RE.match(name):
        raise HostfileError(f"{where}: host name {name!r} is not a valid host name "
                            f"(letters, digits, '.', '-', '_'); expected {RIGHT_FORM}")


def _parse_entry(text, where):
    """Parse one host entry (a hostfile line without comment) into a Host."""
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
        _check_name(name, where)
        return Host(name, _positive_int(count, "slots", where))
    _check_name(first, where)
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
    slots = values.get("slots", 1)
    max_slots = values.get("max_slots")
    if max_slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is less than slots={slots}; "
                            f"max_slots must be >= slots")
    return Host(first, slots, max_slots)


def _merge(entries):
    """Merge repeated hosts (slots add up), keeping first-seen order."""
    merged = {}
    for host in entries:
        seen = merged.get(host.name)
        if seen is None:
            merged[host.name] = dataclasses.replace(host)
            continue
        seen.slots += host.slots
        # A limit survives only if every line for the host gives one.
        if seen.max_slots is None or host.max_slots is None:
            seen.max_slots = None
        else:
            seen.max_slots += host.max_slots
    return list(merged.values())


def parse_hostfile_text(text, source="<hostfile>"):
    """Parse hostfile text; ``source`` names it in error messages.

    Raises HostfileError naming the source, the line number and the right form.
    """
    entries = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            entries.append(_parse_entry(line, f"{source}, line {lineno}"))
    if not entries:
        raise HostfileError(f"{source}: names no host (only blank lines and comments); "
                            f"expected lines like {RIGHT_FORM}")
    return _merge(entries)


def parse_hostfile(path):
    """Read and parse the hostfile at ``path`` (see the module docstring for the forms).

    Raises HostfileError if the file cannot be read or a line is malformed.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise HostfileError(f"--hostfile {str(path)!r}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise HostfileError(f"--hostfile {str(path)!r}: not a text file ({exc})") from exc
    return parse_hostfile_text(text, source=str(path))


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
        entries.append(_parse_entry(item, where))
    return _merge(entries)


def format_host_list(hosts):
    """The ``host:slots,...`` form that both Open MPI's --host and MPICH's -hosts take."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def check_capacity(hosts, nprocs, oversubscribe, source):
    """Raise HostfileError unless ``nprocs`` ranks fit on ``hosts``.

    More ranks than slots needs ``oversubscribe``; even then no host may exceed its
    ``max_slots`` (when every host has one, their sum is a hard limit).
    """
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
