"""scripts/tcp_probe.py on this host's loopback: the probe the two-host rehearsal prints
beside the doctor's MPI/NCCL matrix (plain TCP, no MPI)."""
import json
import os
import socket
import subprocess
import sys

from conftest import ROOT

PROBE = os.path.join(ROOT, "scripts", "tcp_probe.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_blocking_polling_and_pinned():
    port = str(_free_port())
    server = subprocess.Popen([sys.executable, PROBE, "serve", "127.0.0.1", port, "--timeout", "60"])
    try:
        out = subprocess.run([sys.executable, PROBE, "client", "127.0.0.1", port, "--bytes", "1M",
                              "--iters", "50", "--reps", "2", "--poll", "--pin", "0", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()
    report = json.loads(out.stdout)
    assert report["bytes"] == 1 << 20
    assert [r["how"] for r in report["rows"]] == ["blocking", "busy-poll", "busy-poll, both on CPU 0"]
    for row in report["rows"]:
        assert row["intact"] and row["latency_us"] > 0 and row["gbs"] > 0


def test_probe_reports_no_server():
    out = subprocess.run([sys.executable, PROBE, "client", "127.0.0.1", str(_free_port()),
                          "--connect-timeout", "0.3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "tcp_probe.py client: ConnectionRefusedError" in out.stderr


def test_facts_of_loopback():
    out = subprocess.run([sys.executable, PROBE, "facts", "lo", "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["cores"] >= 1 and 1 <= facts["affinity"] <= facts["cores"]
    assert facts["mtu"] == 65536 and facts["ifname"] == "lo"
    assert isinstance(facts["throttling"], dict) and facts["cpu_quota"]
