"""``mpicomm-doctor``: check a job's ranks, hosts, GPUs and library versions.

Run it the way the real job runs, e.g. ``mpicomm-run -n 16 --hostfile hosts -m
mpicomm.tools.doctor`` (or ``mpirun ... python -m mpicomm.tools.doctor``). Rank 0
prints one row per rank (host, rank, local rank, backend, GPU and its PCI bus id, MPI
library, CUDA-aware MPI, NCCL and CuPy versions), then the problems found.

Exit status 1 on a serious problem: two ranks on one GPU, more ranks on a host than
GPUs, versions that differ between hosts, ranks that would pick different backends,
GPUs without NCCL. Running as root is only a warning, and so are more ranks than CPUs bound
to the same CPUs of one machine (e.g. two "hosts" in namespaces or containers of one machine,
each of whose launchers bound its first rank to core 0). ``--json`` prints the same as one
JSON object.

``--net`` adds a timed matrix between every pair of hosts: the lowest rank of each host
(its leader) exchanges messages with every other host's leader, one pair at a time, over
MPI (8-byte ping-pong latency, one-way bandwidth of ``--net-bytes``, default 64 MiB) and,
when every rank has a GPU with NCCL, GPU to GPU over NCCL, naming the transport NCCL
chose (``NET/Socket``, ``NET/IB``, ``P2P/...``, ``SHM``). Within a host, its first two ranks
are measured the same way, for comparison. A pair whose payload arrives changed, or that
NCCL joins by a same-host transport across hosts (the hosts look like one to NCCL), is a
problem; a host pair far slower than the others is a warning.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys

from .._topology import CUPY_INSTALL, gpu_seen, no_nccl_reason
from ._common import exit_cleanly, load_mpi
from .doctor_net import (_count, _net_size, diagnose_net, format_net, nccl_transports,  # noqa: F401 (as before)
                         net_matrix, net_pairs)

# Fields that must agree on every host, and how the report names them.
VERSION_FIELDS = (("mpi_library", "MPI library"), ("mpi4py", "mpi4py"),
                  ("python", "Python"), ("cupy", "CuPy"), ("nccl", "NCCL"),
                  ("mpicomm", "mpicomm"))
COLUMNS = (("host", "host"), ("rank", "rank"), ("local_rank", "local"),
           ("backend", "backend"), ("gpu", "gpu"), ("pci_bus_id", "pci bus id"),
           ("mpi_library", "mpi"), ("cuda_aware", "cuda-aware"), ("nccl", "nccl"),
           ("cupy", "cupy"))


def _nccl_version_string(code):
    # NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older ones major*1000 + ...
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _gpu_facts(local_rank):
    """CuPy version, GPUs seen, the one this rank would use, NCCL version or why not."""
    facts = {"cupy": None, "gpu_count": 0, "gpu": None, "pci_bus_id": None,
             "visible_bus_ids": [], "nccl": None, "nccl_error": None}
    try:
        import cupy
    except Exception:  # no CuPy: a CPU-only rank, unless the host has a GPU all the same
        facts["gpu_seen"] = gpu_seen()
        facts["no_nccl"] = no_nccl_reason() if facts["gpu_seen"] else None
        return facts
    facts["cupy"] = cupy.__version__
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    facts["gpu_count"] = count
    if not count:
        facts["gpu_seen"] = gpu_seen()
        facts["no_nccl"] = no_nccl_reason() if facts["gpu_seen"] else None
    if count:
        # The same choice as mpicomm._topology.select_gpu.
        facts["gpu"] = local_rank % count
        facts["visible_bus_ids"] = [cupy.cuda.Device(i).pci_bus_id for i in range(count)]
        facts["pci_bus_id"] = facts["visible_bus_ids"][facts["gpu"]]
    try:
        from cupy.cuda import nccl

        facts["nccl"] = _nccl_version_string(int(nccl.get_version()))
    except Exception as exc:
        facts["nccl_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def _cuda_aware(MPI):
    """'yes', 'no' or 'unknown': whether this MPI can take GPU buffers."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return "yes" if query() else "no"
        except Exception:
            pass
    if "Open MPI" not in MPI.Get_library_version():
        return "unknown"
    ompi_info = shutil.which("ompi_info") or os.path.join(os.path.dirname(sys.executable),
                                                          "ompi_info")
    try:
        out = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    # Open MPI 4 names it mpi_built_with_cuda_support, 5 also opal_built_with_cuda_support.
    values = re.findall(r":(?:mpi|opal)_built_with_cuda_support:value:(\w+)", out)
    if not values:
        return "unknown"
    return "yes" if "true" in values else "no"


def _read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _cpu_list(cpus):
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def shared_binding(rows):
    """Warnings for ranks of one machine bound to fewer CPUs than there are ranks on them.

    Ranks with the same machine id (the kernel's boot id: two host names in namespaces or
    containers of one machine share it) and the same CPU set, smaller than the machine's
    CPUs (a binding), more ranks than CPUs in it.
    """
    groups = {}
    for row in rows:
        cpus, machine, total = row.get("cpus"), row.get("machine_id"), row.get("machine_cpus")
        if not cpus or not machine or not total or len(cpus) >= total:
            continue
        groups.setdefault((machine, tuple(cpus)), []).append(row)
    warnings = []
    for (_, cpus), group in groups.items():
        if len(group) <= len(cpus):
            continue
        hosts = sorted({r["host"] for r in group})
        where = (f"on host {hosts[0]}" if len(hosts) == 1 else
                 f"of one machine (hosts {', '.join(hosts)} share its boot id: each host's "
                 f"launcher bound its ranks as if it were alone)")
        warnings.append(
            f"ranks {_ranks(group)} are all bound to CPU {_cpu_list(list(cpus))} {where}: "
            f"{len(group)} ranks on {len(cpus)} CPU(s); ranks that busy-poll for messages on "
            f"a shared CPU wait for the scheduler on every message (milliseconds each); "
            f"launch with --bind-to none (mpicomm-run --bind-to none) or give each rank its "
            f"own cores")
    return warnings


def collect(comm=None):
    """This rank's facts as a dict (call on every rank; uses a shared-memory split)."""
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    # ompi_info takes a while: ask once per host.
    cuda_aware = _cuda_aware(MPI) if local_rank == 0 else None
    cuda_aware = local.bcast(cuda_aware, root=0)
    local.Free()
    try:
        import mpicomm

        mpicomm_version = getattr(mpicomm, "__version__", None)
    except Exception:
        mpicomm_version = None
    facts = {
        "host": socket.gethostname(),
        "rank": comm.Get_rank(),
        "local_rank": local_rank,
        "local_size": local_size,
        "euid": os.geteuid(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0]
        .split(",")[0].strip(),
        "cuda_aware": cuda_aware,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "mpicomm": mpicomm_version,
        # Which machine (two host names can be one machine: namespaces, containers) and the
        # CPUs this rank may run on (its binding).
        "machine_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "machine_cpus": os.cpu_count(),
    }
    facts.update(_gpu_facts(local_rank))
    facts["backend"] = "nccl" if facts["gpu_count"] and facts["nccl"] else "mpi"
    return facts


def _ranks(rows):
    return ", ".join(str(r["rank"]) for r in rows)


def diagnose(rows):
    """Return (problems, warnings), two lists of messages, from every rank's facts."""
    problems, warnings = [], []
    by_host = {}
    for row in rows:
        by_host.setdefault(row["host"], []).append(row)

    for host, hrows in by_host.items():
        users = {}
        for row in hrows:
            if row.get("pci_bus_id"):
                users.setdefault(row["pci_bus_id"], []).append(row)
        for bus, sharing in users.items():
            if len(sharing) > 1:
                cvd = {r.get("cuda_visible_devices") for r in sharing}
                problems.append(
                    f"two or more ranks on one GPU: ranks {_ranks(sharing)} on host {host} "
                    f"all use the GPU at PCI {bus} (CUDA_VISIBLE_DEVICES="
                    f"{', '.join(sorted(str(c) for c in cvd))}); give each rank its own GPU: "
                    f"leave CUDA_VISIBLE_DEVICES unset or different per rank, or run fewer "
                    f"ranks per host")
        visible = set()
        for row in hrows:
            visible.update(row.get("visible_bus_ids") or ())
        if visible and len(hrows) > len(visible):
            problems.append(
                f"more ranks than GPUs on host {host}: {len(hrows)} ranks "
                f"({_ranks(hrows)}) but {len(visible)} GPU(s) visible; run at most "
                f"{len(visible)} ranks on it (slots={len(visible)} in the hostfile)")
        for row in hrows:
            if row.get("gpu_count") and not row.get("nccl"):
                problems.append(
                    f"GPUs without NCCL: rank {row['rank']} on host {host} sees "
                    f"{row['gpu_count']} GPU(s) but CuPy's NCCL is missing "
                    f"({row.get('nccl_error') or 'not available'}); install it "
                    f"(pip install nvidia-nccl-cu12, or the cupy wheel for your CUDA)")

    for host, hrows in by_host.items():
        seen = [r for r in hrows if r.get("gpu_seen") and not r.get("gpu_count")]
        if seen:
            warnings.append(
                f"a GPU without NCCL on host {host}: rank(s) {_ranks(seen)} see a GPU "
                f"({seen[0]['gpu_seen']}) but {seen[0].get('no_nccl') or 'CuPy sees none'}, so "
                f"mpicomm.init() picks the MPI backend there (GPU arrays through host memory, an order "
                f"of magnitude slower than NCCL); for NCCL: {CUPY_INSTALL}")

    for field, label in VERSION_FIELDS:
        per_host = {}
        for row in rows:
            per_host.setdefault(str(row.get(field) or "none"), set()).add(row["host"])
        if len(per_host) > 1:
            detail = "; ".join(f"{value} on {', '.join(sorted(hosts))}"
                               for value, hosts in sorted(per_host.items()))
            problems.append(f"version skew in {label}: {detail}; install the same version "
                            f"on every host")

    backends = {}
    for row in rows:
        backends.setdefault(row["backend"], []).append(row)
    if len(backends) > 1:
        detail = "; ".join(f"{b} on ranks {_ranks(r)}" for b, r in sorted(backends.items()))
        problems.append(f"ranks would pick different backends ({detail}); give every rank "
                        f"a GPU with NCCL, or choose the backend explicitly "
                        f"(mpicomm.init(backend='mpi'))")

    warnings.extend(shared_binding(rows))
    root_hosts = sorted({r["host"] for r in rows if r.get("euid") == 0})
    if root_hosts:
        warnings.append(f"running as root on {', '.join(root_hosts)}: fine in a container; "
                        f"Open MPI then needs --allow-run-as-root (mpicomm-run adds it)")
    return problems, warnings


def _cell(value):
    return "-" if value is None or value == "" else str(value)


def format_table(rows):
    """The per-rank table as text; missing values show as '-'."""
    header = [label for _, label in COLUMNS]
    body = [[_cell(row.get(key)) for key, _ in COLUMNS] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
             for line in [header] + body]
    return "\n".join(lines)

# ------------------------------------------------------------------------- --net

def _parser():
    p = argparse.ArgumentParser(
        prog="mpicomm-doctor",
        description="Check every rank's host, GPU and library versions (run under mpirun).")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ranks, problems, warnings) instead of a table")
    p.add_argument("--net", action="store_true",
                   help="also time every pair of hosts: MPI (and NCCL, GPU to GPU) 8-byte "
                        "latency and one-way bandwidth, one leader rank per host")
    p.add_argument("--net-bytes", type=_net_size, default=64 << 20, metavar="SIZE",
                   help="message size of the bandwidth test (default 64M; 8 to 1G)")
    p.add_argument("--net-iters", type=lambda t: _count(t, "--net-iters"), default=1000,
                   metavar="N", help="ping-pong round trips of the latency test (default 1000)")
    p.add_argument("--net-reps", type=lambda t: _count(t, "--net-reps"), default=5,
                   metavar="N", help="messages timed in the bandwidth test (default 5)")
    return p


def main(argv=None):
    """Gather every rank's facts on rank 0, report, and return 1 on serious problems."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse printed usage (or --help); hand back its status
        return exc.code
    MPI = load_mpi("mpicomm-doctor")
    if MPI is None:
        return 2
    comm = MPI.COMM_WORLD
    rows = comm.allgather(collect(comm))
    net = net_matrix(comm, rows, nbytes=args.net_bytes, iters=args.net_iters,
                     reps=args.net_reps) if args.net else None
    status = 0
    if comm.Get_rank() == 0:
        problems, warnings = diagnose(rows)
        if net is not None:
            more_problems, more_warnings = diagnose_net(net)
            problems, warnings = problems + more_problems, warnings + more_warnings
        status = 1 if problems else 0
        if args.json:
            report = {"ranks": rows, "problems": problems, "warnings": warnings,
                      "status": status}
            if net is not None:
                report["net"] = net
                report["net_bytes"] = args.net_bytes
            print(json.dumps(report, indent=1), flush=True)
        else:
            hosts = sorted({r["host"] for r in rows})
            print(f"mpicomm-doctor: {len(rows)} rank(s) on {len(hosts)} host(s)")
            print(format_table(rows))
            if net is not None:
                print(f"network: {len(net)} pair(s), one at a time; latency = half an 8-byte "
                      f"round trip, bandwidth one way")
                print(format_net(net, args.net_bytes) if net else
                      "(one rank: no pair to measure)")
            for w in warnings:
                print(f"warning: {w}")
            for p in problems:
                print(f"PROBLEM: {p}")
            print("ok: no problems found" if not problems
                  else f"{len(problems)} problem(s) found", flush=True)
    # Every rank exits alike, so mpirun reports the verdict whichever rank it looks at.
    return comm.bcast(status, root=0)


if __name__ == "__main__":
    exit_cleanly(main())
