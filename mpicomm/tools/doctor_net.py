"""``mpicomm-doctor --net``: the timed matrix between every pair of hosts.

The lowest rank of each host (its leader) exchanges messages with every other host's
leader, one pair at a time, over MPI (8-byte ping-pong latency, one-way bandwidth) and,
when every rank has a GPU with NCCL, GPU to GPU over NCCL, naming the transport NCCL chose;
within a host, its first two ranks are measured the same way, for comparison.
mpicomm.tools.doctor runs it and prints its table.
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
import time

NET_TAG = 7301          # MPI tag of the doctor's own messages (on COMM_WORLD)
SLOW_FRACTION = 0.5     # a host pair below this fraction of the median host pair is slow
_LOCAL_TRANSPORTS = ("P2P", "SHM")  # NCCL transports that work only within one machine


def net_pairs(rows):
    """The rank pairs to measure: [(host_a, host_b, rank_a, rank_b)].

    Every pair of hosts (their lowest ranks), hosts in the order of their lowest rank, and
    for each host with two or more ranks its first two ranks (host_a == host_b).
    """
    by_host = {}
    for row in sorted(rows, key=lambda r: r["rank"]):
        by_host.setdefault(row["host"], []).append(row["rank"])
    hosts = list(by_host)
    pairs = []
    for i, a in enumerate(hosts):
        if len(by_host[a]) > 1:
            pairs.append((a, a, by_host[a][0], by_host[a][1]))
        for b in hosts[i + 1:]:
            pairs.append((a, b, by_host[a][0], by_host[b][0]))
    return pairs


def _payload(nbytes, seed):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _seed(a, b, salt):
    return 1000003 * (min(a, b) + 1) + max(a, b) + salt


def _agree(comm, peer, ok):
    """Both ranks of a pair learn whether both saw their payload arrive intact."""
    return bool(comm.sendrecv(ok, peer, NET_TAG, source=peer, recvtag=NET_TAG)) and ok


def _mpi_pair(comm, me, peer, first, nbytes, iters, reps):
    """8-byte ping-pong latency and one-way bandwidth between this rank and ``peer``.

    The payload is random from a seed both sides know; the receiver compares what arrived
    with its own copy. Returns the numbers on the pair's first rank, None on the other.
    """
    import numpy as np

    small = np.zeros(8, np.uint8)

    def ping(n):
        for _ in range(n):
            if first:
                comm.Send(small, peer, NET_TAG)
                comm.Recv(small, peer, NET_TAG)
            else:
                comm.Recv(small, peer, NET_TAG)
                comm.Send(small, peer, NET_TAG)

    def stream(buf, n):
        for _ in range(n):
            if first:
                comm.Send(buf, peer, NET_TAG)
            else:
                comm.Recv(buf, peer, NET_TAG)
        # The receiver's acknowledgement stops the sender's clock once everything arrived.
        if first:
            comm.Recv(small, peer, NET_TAG)
        else:
            comm.Send(small, peer, NET_TAG)

    ping(max(1, iters // 10))
    t0 = time.perf_counter()
    ping(iters)
    latency = (time.perf_counter() - t0) / (2 * iters)
    seed = _seed(me, peer, 0)
    buf = _payload(nbytes, seed) if first else np.empty(nbytes, np.uint8)
    stream(buf, 1)
    intact = True if first else bool(np.array_equal(buf, _payload(nbytes, seed)))
    ping(1)   # both ready again (the receiver's check took a while): the clock starts together
    t0 = time.perf_counter()
    stream(buf, reps)
    elapsed = time.perf_counter() - t0
    intact = _agree(comm, peer, intact)
    if not first:
        return None
    return {"mpi_latency_us": latency * 1e6, "mpi_gbs": reps * nbytes / elapsed / 1e9,
            "mpi_intact": intact}


def _read_from(path, offset):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def nccl_transports(text):
    """The transports that NCCL INFO lines name ("... via NET/Socket/0" -> "NET/Socket")."""
    found = set()
    for via in re.findall(r"\bvia (\S+)", text):
        parts = [p for p in via.split("/") if p and not p.isdigit()]
        found.add("/".join(parts[:2]))
    return sorted(found)


def _nccl_pair(comm, me, peer, first, gpu, nbytes, iters, reps, log_path):
    """The same measurement GPU to GPU, through a two-rank NCCL communicator."""
    import cupy
    from cupy.cuda import nccl

    u8 = getattr(nccl, "NCCL_UINT8", 1)
    cupy.cuda.Device(gpu).use()
    if first:
        uid = nccl.get_unique_id()
        comm.send(uid, peer, NET_TAG)
    else:
        uid = comm.recv(source=peer, tag=NET_TAG)
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    nc = nccl.NcclCommunicator(2, uid, 0 if first else 1)
    other = 1 - (0 if first else 1)
    st = cupy.cuda.Stream(non_blocking=True)
    small = cupy.zeros(8, cupy.uint8)

    def ping(n):
        for _ in range(n):
            if first:
                nc.send(small.data.ptr, 8, u8, other, st.ptr)
                nc.recv(small.data.ptr, 8, u8, other, st.ptr)
            else:
                nc.recv(small.data.ptr, 8, u8, other, st.ptr)
                nc.send(small.data.ptr, 8, u8, other, st.ptr)
        st.synchronize()

    def stream(buf, n):
        for _ in range(n):
            if first:
                nc.send(buf.data.ptr, nbytes, u8, other, st.ptr)
            else:
                nc.recv(buf.data.ptr, nbytes, u8, other, st.ptr)
        if first:
            nc.recv(small.data.ptr, 8, u8, other, st.ptr)
        else:
            nc.send(small.data.ptr, 8, u8, other, st.ptr)
        st.synchronize()

    try:
        ping(max(1, iters // 10))
        t0 = time.perf_counter()
        ping(iters)
        latency = (time.perf_counter() - t0) / (2 * iters)
        seed = _seed(me, peer, 17)
        buf = cupy.asarray(_payload(nbytes, seed)) if first else cupy.empty(nbytes, cupy.uint8)
        # the upload above is on CuPy's current stream, which does not order ``st``
        cupy.cuda.Device().synchronize()
        stream(buf, 1)
        intact = True if first else bool(cupy.array_equal(buf, cupy.asarray(_payload(nbytes, seed))))
        ping(1)   # both ready again (the receiver's check took a while): the clock starts together
        t0 = time.perf_counter()
        stream(buf, reps)
        elapsed = time.perf_counter() - t0
    finally:
        if hasattr(nc, "destroy"):
            nc.destroy()
    intact = _agree(comm, peer, intact)
    if not first:
        return None
    return {"nccl_latency_us": latency * 1e6, "nccl_gbs": reps * nbytes / elapsed / 1e9,
            "nccl_intact": intact, "nccl_transport": nccl_transports(_read_from(log_path, offset))}


def _quiet_barrier(comm):
    """A barrier that sleeps while it waits, leaving the cores to the pair being timed."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def net_matrix(comm, rows, *, nbytes=64 << 20, iters=1000, reps=5):
    """Measure every pair of :func:`net_pairs` on every rank's call; rank 0 gets the list.

    ``rows`` are all ranks' facts (the same list on every rank). Under NCCL (every rank has
    a GPU and NCCL) each pair is also measured GPU to GPU, and NCCL's INFO log (written to
    a temporary file per rank) names the transport it chose. Returns a list of dicts on
    rank 0 (host_a, host_b, ranks, numbers or an error), None elsewhere.
    """
    me = comm.Get_rank()
    use_nccl = all(r["backend"] == "nccl" for r in rows)
    mine = rows[me]
    log_path = None
    if use_nccl:
        # NCCL reads these once, at its first use in the process: before any communicator.
        log_path = os.path.join(tempfile.gettempdir(), f"mpicomm-doctor-nccl.{os.getpid()}.log")
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ["NCCL_DEBUG_SUBSYS"] = "INIT"   # the "Channel ... via TRANSPORT" lines
        os.environ["NCCL_DEBUG_FILE"] = log_path
    results = []
    try:
        for host_a, host_b, a, b in net_pairs(rows):
            if me in (a, b):
                first, peer = me == a, b if me == a else a
                entry = {"host_a": host_a, "host_b": host_b, "ranks": [a, b]}
                try:
                    got = _mpi_pair(comm, me, peer, first, nbytes, iters, reps)
                    if use_nccl:
                        more = _nccl_pair(comm, me, peer, first, mine["gpu"], nbytes,
                                          max(1, iters // 5), reps, log_path)
                        got = None if got is None else {**got, **more}
                except Exception as exc:  # reported, and the other pairs still run
                    got = {"error": f"{type(exc).__name__}: {exc}"} if first else None
                if first:
                    results.append({**entry, **got})
            _quiet_barrier(comm)   # one pair at a time: no two pairs share a link while timed
    finally:
        if log_path and os.path.exists(log_path):
            os.unlink(log_path)
    gathered = comm.gather(results, root=0)
    if me != 0:
        return None
    merged = [e for part in gathered for e in part]
    order = {(a, b): i for i, (_, _, a, b) in enumerate(net_pairs(rows))}
    return sorted(merged, key=lambda e: order[tuple(e["ranks"])])


def diagnose_net(entries):
    """(problems, warnings) from the matrix: failed or corrupting pairs, hosts NCCL joins
    as one machine, and host pairs far below the median host pair's bandwidth."""
    problems, warnings = [], []
    for e in entries:
        where = f"{e['host_a']} (rank {e['ranks'][0]}) - {e['host_b']} (rank {e['ranks'][1]})"
        if e.get("error"):
            problems.append(f"{where}: the measurement failed: {e['error']}")
            continue
        for key, label in (("mpi_intact", "MPI"), ("nccl_intact", "NCCL")):
            if e.get(key) is False:
                problems.append(f"{where}: the {label} payload arrived changed; the link or "
                                f"the transport corrupts data")
        local = [t for t in e.get("nccl_transport") or () if t.split("/")[0] in _LOCAL_TRANSPORTS]
        if e["host_a"] != e["host_b"] and local:
            problems.append(f"{where}: NCCL joins these hosts by {', '.join(local)}, a transport "
                            f"within one machine: NCCL takes them for one host (same host name "
                            f"or NCCL_HOSTID?)")
    across = [e for e in entries if e["host_a"] != e["host_b"] and not e.get("error")]
    for key, label in (("mpi_gbs", "MPI"), ("nccl_gbs", "NCCL")):
        values = sorted(e[key] for e in across if e.get(key))
        if len(values) < 2:
            continue
        median = values[len(values) // 2] if len(values) % 2 else \
            (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
        for e in across:
            if e.get(key) and e[key] < SLOW_FRACTION * median:
                warnings.append(f"slow link {e['host_a']} - {e['host_b']}: {label} "
                                f"{e[key]:.2f} GB/s, under {SLOW_FRACTION:g} x the median host "
                                f"pair ({median:.2f} GB/s); check the interface it uses "
                                f"(NCCL_SOCKET_IFNAME, OMPI_MCA_btl_tcp_if_include)")
    return problems, warnings


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def format_net(entries, nbytes):
    """The matrix as a table: one line per measured pair."""
    size = f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes} B"
    header = ["host a", "host b", "ranks", "MPI 8 B us", f"MPI {size} GB/s",
              "NCCL 8 B us", f"NCCL {size} GB/s", "NCCL transport"]
    body = []
    for e in entries:
        if e.get("error"):
            body.append([e["host_a"], e["host_b"], "-".join(map(str, e["ranks"])),
                         "failed: " + e["error"], "", "", "", ""])
            continue
        body.append([e["host_a"], e["host_b"], "-".join(map(str, e["ranks"])),
                     _num(e.get("mpi_latency_us"), ".1f"), _num(e.get("mpi_gbs"), ".2f"),
                     _num(e.get("nccl_latency_us"), ".1f"), _num(e.get("nccl_gbs"), ".2f"),
                     ", ".join(e.get("nccl_transport") or ()) or "-"])
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
                     for line in [header] + body)


def _net_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    value = int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()] \
        if m else 0
    if not 8 <= value <= 1 << 30:
        raise argparse.ArgumentTypeError(f"invalid --net-bytes {text!r}: expected a size from 8 "
                                         f"bytes to 1G (K/M/G suffixes, e.g. 64M)")
    return value


def _count(text, option):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid {option} {text!r}: expected an integer >= 1")
    return int(text)
