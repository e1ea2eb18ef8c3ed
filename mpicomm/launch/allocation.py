"""The hosts of a batch job's allocation: Slurm's and PBS's environment.

Inside an allocation, and when neither ``--hostfile`` nor ``-H`` is given, mpicomm-run
places ranks on the allocated hosts:

- Slurm: ``SLURM_JOB_NODELIST`` (``node[01-03,07],gpu1``), with the slots of each host
  from ``SLURM_TASKS_PER_NODE`` (``4(x3),2``), else ``SLURM_NTASKS_PER_NODE`` (one number
  for every host);
- PBS / Torque: the file named by ``PBS_NODEFILE``, one line per slot.
"""
from __future__ import annotations

import dataclasses
import re

from mpicomm.launch.hostfile import Host, HostfileError, check_host_name, read_text

__all__ = ["Allocation", "AllocationError", "expand_nodelist", "parse_tasks_per_node",
           "from_slurm", "from_pbs", "from_env"]

_NODELIST_FORM = "host names and ranges, e.g. node[01-03,07],gpu1"
_TASKS_FORM = "counts with repeats, e.g. 4(x3),2"


class AllocationError(HostfileError):
    """The batch system's variables or node file cannot be read as a host list."""


@dataclasses.dataclass
class Allocation:
    """Hosts from a batch system: ``kind`` ("Slurm" or "PBS") and where they came from."""

    kind: str
    hosts: list
    source: str


def _split_top(text, where):
    """Split at commas outside brackets; raise on unbalanced or nested brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise AllocationError(f"{where}: nested '[' at position {i}; "
                                      f"expected {_NODELIST_FORM}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise AllocationError(f"{where}: ']' without '[' at position {i}; "
                                      f"expected {_NODELIST_FORM}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise AllocationError(f"{where}: '[' without ']'; expected {_NODELIST_FORM}")
    parts.append(text[start:])
    return parts


def _expand_ranges(body, where):
    values = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise AllocationError(f"{where}: range {part!r} in [{body}] is not N or N-M; "
                                  f"expected {_NODELIST_FORM}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise AllocationError(f"{where}: range {part!r} in [{body}] runs backwards; "
                                  f"expected {_NODELIST_FORM}")
        width = len(lo)  # node[01-10]: node01 ... node10
        values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return values


def _expand_item(item, where):
    m = re.search(r"\[([^\[\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    return [head + value + rest for value in _expand_ranges(m.group(1), where)
            for rest in _expand_item(tail, where)]


def expand_nodelist(text, where="SLURM_JOB_NODELIST"):
    """Expand a Slurm host list (``node[01-03,07],login1``) into host names, in order.

    Raises AllocationError naming ``where``, the value and the expected form.
    """
    where = f"{where}={text!r}"
    if not text.strip():
        raise AllocationError(f"{where}: names no host; expected {_NODELIST_FORM}")
    names = []
    for item in _split_top(text.strip(), where):
        item = item.strip()
        if not item:
            raise AllocationError(f"{where}: empty entry; expected {_NODELIST_FORM}")
        for name in _expand_item(item, where):
            check_host_name(name, where, _NODELIST_FORM, AllocationError)
            names.append(name)
    return names


def parse_tasks_per_node(text, nhosts, where="SLURM_TASKS_PER_NODE"):
    """Expand ``SLURM_TASKS_PER_NODE`` (``4(x3),2``) into one count per host.

    Raises AllocationError unless it gives exactly ``nhosts`` positive counts.
    """
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise AllocationError(f"{where}={text!r}: {part!r} is not a count N or N(xK) "
                                  f"with N, K >= 1; expected {_TASKS_FORM}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) != nhosts:
        raise AllocationError(f"{where}={text!r} gives {len(counts)} count(s) for "
                              f"{nhosts} host(s) of the node list; expected one per host")
    return counts


def from_slurm(env):
    """The Slurm allocation in ``env``, or None outside one. Raises AllocationError."""
    name = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
    nodelist = env.get(name)
    if nodelist is None:
        return None
    names = expand_nodelist(nodelist, name)
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise AllocationError(f"{name}={nodelist!r} names {twice!r} twice; expected "
                              f"each host once")
    if env.get("SLURM_TASKS_PER_NODE"):
        per = env["SLURM_TASKS_PER_NODE"]
        counts = parse_tasks_per_node(per, len(names))
        source = f"{name}={nodelist}, SLURM_TASKS_PER_NODE={per}"
    elif env.get("SLURM_NTASKS_PER_NODE"):
        per = env["SLURM_NTASKS_PER_NODE"]
        if not re.fullmatch(r"\s*[0-9]+\s*", per) or int(per) < 1:
            raise AllocationError(f"SLURM_NTASKS_PER_NODE={per!r} is not a positive "
                                  f"integer")
        counts = [int(per)] * len(names)
        source = f"{name}={nodelist}, SLURM_NTASKS_PER_NODE={per.strip()}"
    else:
        raise AllocationError(
            f"{name}={nodelist!r} is set but neither SLURM_TASKS_PER_NODE nor "
            f"SLURM_NTASKS_PER_NODE is, so the slots per host are unknown; set one, or "
            f"give the hosts with --hostfile or -H")
    return Allocation("Slurm", [Host(n, c) for n, c in zip(names, counts)], source)


def from_pbs(env):
    """The PBS allocation in ``env`` (PBS_NODEFILE), or None outside one."""
    path = env.get("PBS_NODEFILE")
    if not path:
        return None
    where = f"PBS_NODEFILE={path!r}"
    text = read_text(path, where, AllocationError)
    counts = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        name = raw.split("#", 1)[0].strip()
        if name:
            check_host_name(name, f"{where}, line {lineno}", "one host name per line",
                            AllocationError)
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise AllocationError(f"{where}: names no host; expected one host name per line "
                              f"(a host once per slot)")
    return Allocation("PBS", [Host(n, c) for n, c in counts.items()], f"PBS_NODEFILE={path}")


def from_env(env):
    """The Slurm allocation in ``env``, else the PBS one, else None."""
    return from_slurm(env) or from_pbs(env)
