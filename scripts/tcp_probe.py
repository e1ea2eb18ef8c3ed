#!/usr/bin/env python3
"""Plain TCP between two hosts, measured as ``mpicomm-doctor --net`` measures MPI and NCCL.

Used by scripts/gpu_cluster_rehearsal.sh to tell a slow network stack (the kernel's TCP on
the veth pair, the VM's scheduler) from a slow MPI or NCCL over it: if plain TCP between the
two namespaces is as slow as MPI and NCCL are, mpicomm and the libraries are not the cause.
Only the Python standard library; no iperf.

    tcp_probe.py serve ADDR PORT [--timeout S]
        accept one client on ADDR:PORT, answer its probe, exit
    tcp_probe.py client ADDR PORT [--bytes SIZE] [--iters N] [--reps N] [--poll] [--pin CPU]
                        [--spin K] [--json]
        latency = half an 8-byte round trip (mean of N), bandwidth = SIZE sent one way REPS
        times, the clock stopped by the receiver's acknowledgement (as the doctor's --net
        measures); TCP_NODELAY on, as MPI and NCCL set it. First with blocking sockets (each
        end sleeps until data arrives), then as asked:
        --poll     both ends busy-poll non-blocking sockets, as MPI's and NCCL's progress
                   loops do
        --pin CPU  busy-polling with both ends pinned to one CPU: what two ranks that share
                   a core see (two "hosts" on one machine whose launchers each bind their
                   first rank to core 0)
        --spin K   blocking again, with K busy-looping processes on the machine
    tcp_probe.py facts [IFNAME]
        what decides how fast the path can be: cores (and this process's affinity), the
        CPU quota of its cgroup and how often it was throttled, load, IFNAME's MTU and
        offloads (through the ethtool ioctl; no ethtool needed), the kernel

Exit status 1 when the probe fails (no connection, short read, wrong payload).
"""
import argparse
import array
import fcntl
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import time

HELLO = b"mpicomm-tcp-probe/2\n"
HEADER = "!IQIBi"   # iters, bytes, reps, busy-poll (0/1), CPU to pin to (-1: none)


def _size(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    unit = t[-1:] if t[-1:] in units and not t[-1:].isdigit() else ""
    return int(float(t[:len(t) - len(unit)]) * units[unit])


def _recv_exact(sock, view):
    """Fill view from sock; on a non-blocking socket, by polling (as MPI and NCCL progress)."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            continue
        if not n:
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n


class _mode:
    """For one round: busy-poll (non-blocking socket, sendall still blocks) and/or pin to a CPU."""

    def __init__(self, sock, poll, cpu):
        self.sock, self.poll, self.cpu = sock, poll, cpu

    def __enter__(self):
        self.affinity = os.sched_getaffinity(0)
        if self.cpu >= 0:
            os.sched_setaffinity(0, {self.cpu})
        if self.poll:
            self.sock.settimeout(0)
        return self

    def __exit__(self, *exc):
        self.sock.settimeout(120)
        os.sched_setaffinity(0, self.affinity)


def _sendall(sock, data):
    """sendall that also works on a non-blocking socket (polls while the buffer is full)."""
    view = memoryview(data).cast("B")
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            continue


def _nodelay(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def serve(addr, port, timeout):
    with socket.socket() as lsock:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((addr, port))
        lsock.listen(1)
        lsock.settimeout(timeout)
        conn, _ = lsock.accept()
    with conn:
        conn.settimeout(timeout)
        _nodelay(conn)
        hello = bytearray(len(HELLO) + struct.calcsize(HEADER))
        _recv_exact(conn, memoryview(hello))
        if bytes(hello[:len(HELLO)]) != HELLO:
            raise ConnectionError("not a tcp_probe client")
        while True:  # one round per (iters, nbytes, reps) header; iters == 0 ends
            iters, nbytes, reps, poll, cpu = struct.unpack(HEADER, hello[len(HELLO):])
            if iters == 0:
                return 0
            with _mode(conn, poll, cpu):
                small = memoryview(bytearray(8))
                for _ in range(iters + max(1, iters // 10)):
                    _recv_exact(conn, small)
                    _sendall(conn, small)
                buf = memoryview(bytearray(nbytes))
                for _ in range(reps):
                    _recv_exact(conn, buf)
            ok = all(buf[i] == (i * 131 + 7) % 256 for i in range(0, nbytes, max(1, nbytes // 997)))
            conn.sendall(b"\1" if ok else b"\0")
            _recv_exact(conn, memoryview(hello))


def _spinners(k):
    code = "import time\nt = time.time() + 120\nwhile time.time() < t: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(k)]


def _round(conn, iters, nbytes, reps, poll=False, cpu=-1):
    buf = bytearray(nbytes)
    pattern = bytes((i * 131 + 7) % 256 for i in range(256))
    for i in range(0, nbytes, 256):
        buf[i:i + 256] = pattern[:min(256, nbytes - i)]
    view = memoryview(buf)
    conn.sendall(HELLO + struct.pack(HEADER, iters, nbytes, reps, int(poll), cpu))
    small = memoryview(bytearray(8))

    def ping(n):
        for _ in range(n):
            _sendall(conn, small)
            _recv_exact(conn, small)

    with _mode(conn, poll, cpu):
        ping(max(1, iters // 10))
        t0 = time.perf_counter()
        ping(iters)
        latency = (time.perf_counter() - t0) / (2 * iters)
        t0 = time.perf_counter()
        for _ in range(reps):
            _sendall(conn, view)
        ack = bytearray(1)
        _recv_exact(conn, memoryview(ack))
        elapsed = time.perf_counter() - t0
    return {"latency_us": latency * 1e6, "gbs": reps * nbytes / elapsed / 1e9, "intact": ack[0] == 1}


def client(addr, port, nbytes, iters, reps, spin, connect_s, poll=False, pin=None):
    deadline = time.monotonic() + connect_s
    while True:  # the server may still be starting
        try:
            conn = socket.create_connection((addr, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    rows = []
    with conn:
        _nodelay(conn)
        conn.settimeout(120)
        rows.append({"how": "blocking", **_round(conn, iters, nbytes, reps)})
        if poll:
            rows.append({"how": "busy-poll", **_round(conn, iters, nbytes, reps, poll=True)})
        if pin is not None:
            rows.append({"how": f"busy-poll, both on CPU {pin}",
                         **_round(conn, iters, nbytes, reps, poll=True, cpu=pin)})
        if spin:
            procs = _spinners(spin)
            try:
                time.sleep(0.2)   # let them start spinning
                rows.append({"how": f"blocking, {spin} busy processes",
                             **_round(conn, iters, nbytes, reps)})
            finally:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait()
        conn.sendall(HELLO + struct.pack(HEADER, 0, 0, 0, 0, -1))
    return rows


# ------------------------------------------------------------------------------ facts
SIOCETHTOOL, SIOCGIFMTU = 0x8946, 0x8921
# ethtool's legacy "get" commands, each answered as struct ethtool_value {u32 cmd, u32 data}
_OFFLOADS = [("rx-checksumming", 0x14), ("tx-checksumming", 0x16), ("scatter-gather", 0x18),
             ("tcp-segmentation-offload", 0x1e), ("generic-segmentation-offload", 0x23),
             ("generic-receive-offload", 0x2b)]


def offloads(ifname):
    """{name: bool} through the ethtool ioctl, as `ethtool -k IFNAME` shows them."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name, cmd in _OFFLOADS:
            value = array.array("I", [cmd, 0])
            addr, _ = value.buffer_info()
            ifreq = struct.pack("16sP", ifname.encode()[:15], addr) + b"\0" * 16
            try:
                fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
            except OSError:
                continue
            found[name] = bool(value[1])
    return found


def mtu(ifname):
    """IFNAME's MTU through SIOCGIFMTU (/sys/class/net shows the namespace that mounted /sys)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), SIOCGIFMTU, struct.pack("16si12x", ifname.encode()[:15], 0))
        except OSError as exc:
            return f"unknown ({exc.strerror})"
    return struct.unpack("16si12x", got)[1]


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_quota():
    """(quota text, {nr_periods, nr_throttled, throttled_usec}) of this process's cgroup."""
    v2 = v1 = None
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0":
            v2 = path
        elif "cpu" in ctrls.split(","):
            v1 = path
    stat = {}
    if v2 is not None and _read(f"/sys/fs/cgroup{v2}/cpu.max"):
        quota = _read(f"/sys/fs/cgroup{v2}/cpu.max")
        q, _, period = quota.partition(" ")
        text = "none (max)" if q == "max" else f"{int(q) / int(period):.2f} CPUs ({quota})"
        raw = _read(f"/sys/fs/cgroup{v2}/cpu.stat") or ""
    elif v1 is not None:
        base = f"/sys/fs/cgroup/cpu{v1}" if os.path.isdir("/sys/fs/cgroup/cpu") else \
            f"/sys/fs/cgroup/cpu,cpuacct{v1}"
        q, period = _read(f"{base}/cpu.cfs_quota_us"), _read(f"{base}/cpu.cfs_period_us")
        if q is None:
            text = "unknown (no cpu.cfs_quota_us)"
        else:
            text = "none (-1)" if q == "-1" else f"{int(q) / int(period):.2f} CPUs ({q}/{period} us)"
        raw = _read(f"{base}/cpu.stat") or ""
    else:
        return "unknown (no cgroup cpu controller)", stat
    for line in raw.splitlines():
        key, _, value = line.partition(" ")
        if key in ("nr_periods", "nr_throttled", "throttled_usec", "throttled_time"):
            stat[key] = int(value)
    return text, stat


def facts(ifname=None):
    quota, stat = cpu_quota()
    f = {
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_quota": quota,
        "throttling": stat,
        "loadavg": (_read("/proc/loadavg") or "").split()[:3],
        "kernel": platform.release(),
        "virtualized": _read("/sys/class/dmi/id/sys_vendor") or _read("/sys/hypervisor/type"),
    }
    if ifname:
        f["ifname"] = ifname
        f["mtu"] = mtu(ifname)
        f["offloads"] = offloads(ifname)
    return f


def format_facts(f):
    lines = [f"cores {f['cores']} (this process may run on {f['affinity']}), cgroup CPU quota "
             f"{f['cpu_quota']}, throttled {f['throttling'].get('nr_throttled', '?')} of "
             f"{f['throttling'].get('nr_periods', '?')} periods, load {' '.join(f['loadavg'])}, "
             f"kernel {f['kernel']}" + (f", {f['virtualized']}" if f["virtualized"] else "")]
    if "ifname" in f:
        off = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in f["offloads"].items()) or "unknown"
        lines.append(f"{f['ifname']}: MTU {f['mtu']}; offloads: {off}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="tcp_probe.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("addr")
    s.add_argument("port", type=int)
    s.add_argument("--timeout", type=float, default=60)
    c = sub.add_parser("client")
    c.add_argument("addr")
    c.add_argument("port", type=int)
    c.add_argument("--bytes", type=_size, default=64 << 20)
    c.add_argument("--iters", type=int, default=1000)
    c.add_argument("--reps", type=int, default=5)
    c.add_argument("--spin", type=int, default=0)
    c.add_argument("--poll", action="store_true")
    c.add_argument("--pin", type=int, default=None, metavar="CPU")
    c.add_argument("--connect-timeout", type=float, default=20)
    c.add_argument("--json", action="store_true")
    x = sub.add_parser("facts")
    x.add_argument("ifname", nargs="?")
    x.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        if args.cmd == "serve":
            return serve(args.addr, args.port, args.timeout)
        if args.cmd == "facts":
            f = facts(args.ifname)
            print(json.dumps(f) if args.json else format_facts(f))
            return 0
        rows = client(args.addr, args.port, args.bytes, args.iters, args.reps, args.spin,
                      args.connect_timeout, args.poll, args.pin)
    except (OSError, ConnectionError, ValueError) as exc:
        print(f"tcp_probe.py {args.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"bytes": args.bytes, "rows": rows}))
    else:
        mib = args.bytes / (1 << 20)
        print(f"plain TCP to {args.addr}: latency = half an 8-byte round trip, bandwidth one way "
              f"({mib:g} MiB x {args.reps}), TCP_NODELAY")
        print(f"{'how':<30}{'TCP 8 B us':<13}{f'TCP {mib:g} MiB GB/s':<20}intact")
        for r in rows:
            print(f"{r['how']:<30}{r['latency_us']:<13.1f}{r['gbs']:<20.2f}{'yes' if r['intact'] else 'NO'}")
    return 0 if all(r["intact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
