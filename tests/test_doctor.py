"""mpicomm-doctor: its diagnosis on made-up ranks, and a real run under mpirun.

The GPU cases are checked here on made-up rows; on a machine with 2 GPUs, run
``CUDA_VISIBLE_DEVICES=0 mpicomm-run -n 2 -m mpicomm.tools.doctor`` (it must exit 1
and name both ranks on one GPU).
"""
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from launch_support import (ROOT, clean_mpi_env, have_mpirun, netns_refused, require, run_cli, spawns_mpirun,
                            world_size_from_env)
from mpicomm.tools import doctor

BUS = ["0000:18:00.0", "0000:2A:00.0"]


def rank_row(rank, host, local_rank, *, cvd=None, visible=BUS, gpu=None, nccl="2.28.9",
             cupy="14.2.0", mpi="Open MPI v5.0.11", euid=1000):
    """A rank's facts as doctor.collect() would report them on a GPU host."""
    if gpu is None and visible:
        gpu = local_rank % len(visible)
    return {"host": host, "rank": rank, "local_rank": local_rank, "local_size": 2,
            "euid": euid, "python": "3.11.7", "mpi4py": "4.1.2", "mpi_library": mpi,
            "cuda_aware": "no", "cuda_visible_devices": cvd, "mpicomm": "0.1.0",
            "cupy": cupy, "gpu_count": len(visible), "gpu": gpu if visible else None,
            "pci_bus_id": visible[gpu] if visible else None,
            "visible_bus_ids": list(visible), "nccl": nccl,
            "nccl_error": None if nccl else "ImportError: libnccl.so.2: cannot open",
            "backend": "nccl" if visible and nccl else "mpi"}


def healthy():
    return [rank_row(0, "n1", 0), rank_row(1, "n1", 1), rank_row(2, "n2", 0),
            rank_row(3, "n2", 1)]


def test_healthy_cluster_has_no_problem():
    assert doctor.diagnose(healthy()) == ([], [])


def test_one_visible_gpu_per_rank_is_fine():
    # The per-rank CUDA_VISIBLE_DEVICES pattern: each sees "GPU 0", but they differ.
    rows = [rank_row(0, "n1", 0, cvd="0", visible=[BUS[0]]),
            rank_row(1, "n1", 1, cvd="1", visible=[BUS[1]])]
    assert doctor.diagnose(rows) == ([], [])


def test_two_ranks_on_one_gpu():
    rows = [rank_row(0, "n1", 0, cvd="0", visible=[BUS[0]]),
            rank_row(1, "n1", 1, cvd="0", visible=[BUS[0]]),
            rank_row(2, "n2", 0), rank_row(3, "n2", 1)]
    problems, _ = doctor.diagnose(rows)
    assert len(problems) == 2
    assert problems[0].startswith(f"two or more ranks on one GPU: ranks 0, 1 on host n1 all "
                                  f"use the GPU at PCI {BUS[0]} (CUDA_VISIBLE_DEVICES=0)")
    assert problems[1].startswith("more ranks than GPUs on host n1: 2 ranks (0, 1) but 1 "
                                  "GPU(s) visible; run at most 1 ranks")


def test_version_skew_between_hosts():
    rows = healthy()
    rows[2]["nccl"] = rows[3]["nccl"] = "2.21.5"
    problems, _ = doctor.diagnose(rows)
    assert problems == ["version skew in NCCL: 2.21.5 on n2; 2.28.9 on n1; install the same "
                        "version on every host"]


def test_gpus_without_nccl_and_mixed_backends():
    rows = healthy()
    rows[3] = rank_row(3, "n2", 1, nccl=None)
    problems, _ = doctor.diagnose(rows)
    assert any(p.startswith("GPUs without NCCL: rank 3 on host n2 sees 2 GPU(s) but CuPy's "
                            "NCCL is missing (ImportError: libnccl.so.2") for p in problems)
    assert "ranks would pick different backends (mpi on ranks 3; nccl on ranks 0, 1, 2)" \
        in " ".join(problems)
    assert any(p.startswith("version skew in NCCL: 2.28.9 on n1, n2; none on n2") for p in problems)


def test_root_is_a_warning_only():
    rows = healthy()
    rows[0]["euid"] = 0
    problems, warnings = doctor.diagnose(rows)
    assert problems == []
    assert warnings == ["running as root on n1: fine in a container; Open MPI then needs "
                        "--allow-run-as-root (mpicomm-run adds it)"]


def _bound(rows, machine, cpus_of, total=16):
    for row in rows:
        row.update(machine_id=machine(row), cpus=cpus_of(row), machine_cpus=total)
    return rows


def test_two_hosts_of_one_machine_bound_to_one_core_is_a_warning():
    # The rehearsal's hosts before --bind-to none: each launcher put its first rank on core 0.
    rows = _bound([rank_row(0, "gpuhost1", 0), rank_row(1, "gpuhost2", 0)],
                  lambda r: "boot-a", lambda r: [0])
    problems, warnings = doctor.diagnose(rows)
    assert problems == []
    assert warnings == [
        "ranks 0, 1 are all bound to CPU 0 of one machine (hosts gpuhost1, gpuhost2 share its "
        "boot id: each host's launcher bound its ranks as if it were alone): 2 ranks on "
        "1 CPU(s); ranks that busy-poll for messages on a shared CPU wait for the scheduler on "
        "every message (milliseconds each); launch with --bind-to none (mpicomm-run --bind-to "
        "none) or give each rank its own cores"]


def test_bindings_that_fit_are_fine():
    one_core_each = _bound(healthy(), lambda r: "boot-" + r["host"], lambda r: [r["local_rank"]])
    socket_wide = _bound(healthy(), lambda r: "boot-" + r["host"], lambda r: list(range(8)))
    unbound = _bound(healthy(), lambda r: "boot-a", lambda r: list(range(16)))
    # Two real machines each binding its rank 0 to core 0: different boot ids.
    two_machines = _bound([rank_row(0, "n1", 0), rank_row(1, "n2", 0)],
                          lambda r: "boot-" + r["host"], lambda r: [0])
    for rows in (one_core_each, socket_wide, unbound, two_machines):
        assert doctor.diagnose(rows) == ([], [])
    assert doctor._cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_table_shows_dash_for_missing_gpu_fields():
    row = rank_row(0, "cpu1", 0, visible=[], nccl=None, cupy=None)
    lines = doctor.format_table([row]).splitlines()
    assert lines[0].split() == ["host", "rank", "local", "backend", "gpu", "pci", "bus", "id",
                                "mpi", "cuda-aware", "nccl", "cupy"]
    assert lines[1].split() == ["cpu1", "0", "0", "mpi", "-", "-", "Open", "MPI", "v5.0.11",
                                "no", "-", "-"]


@pytest.mark.parametrize("code, text", [(22809, "2.28.9"), (21805, "2.18.5"), (2708, "2.7.8")])
def test_nccl_version_decoding(code, text):
    assert doctor._nccl_version_string(code) == text


def _mpirun_version():
    from mpicomm.launch import mpirun as mr

    return mr.detect_flavour(mr.find_mpirun())


@spawns_mpirun
@pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")
def test_doctor_under_mpirun_two_ranks():
    proc = subprocess.run(run_cli("-n", "2", "-m", "mpicomm.tools.doctor", "--json"),
                          env=clean_mpi_env({"CUDA_VISIBLE_DEVICES": ""}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = report["ranks"]
    assert [r["rank"] for r in rows] == [0, 1]
    assert {r["host"] for r in rows} == {socket.gethostname()}
    assert sorted(r["local_rank"] for r in rows) == [0, 1]
    assert all(r["local_size"] == 2 for r in rows)
    assert all(r["gpu"] is None and r["pci_bus_id"] is None and r["backend"] == "mpi"
               for r in rows)
    flavour = _mpirun_version()
    if flavour.family == "openmpi":
        want = "Open MPI v" + ".".join(map(str, flavour.version))
        assert all(r["mpi_library"] == want for r in rows)
    assert report["problems"] == [] and report["status"] == 0
    assert len(report["warnings"]) == (1 if os.geteuid() == 0 else 0)


@spawns_mpirun
@pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")
def test_doctor_table_without_gpu():
    proc = subprocess.run(run_cli("-n", "2", "-m", "mpicomm.tools.doctor"),
                          env=clean_mpi_env({"CUDA_VISIBLE_DEVICES": ""}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    host = socket.gethostname()
    assert lines[0] == "mpicomm-doctor: 2 rank(s) on 1 host(s)"
    body = [l.split() for l in lines[2:4]]
    assert [b[:6] for b in body] == [[host, "0", "0", "mpi", "-", "-"],
                                    [host, "1", "1", "mpi", "-", "-"]]
    assert lines[-1] == "ok: no problems found"


def _gpu_count():
    probe = subprocess.run([sys.executable, "-c",
                            "import cupy; print(cupy.cuda.runtime.getDeviceCount())"],
                           capture_output=True, text=True, timeout=120)
    return int(probe.stdout) if probe.returncode == 0 and probe.stdout.strip().isdigit() else 0


GPUS = _gpu_count() if world_size_from_env() == 1 else 0


def _doctor_json(n, extra_env):
    proc = subprocess.run(run_cli("-n", str(n), "--oversubscribe", "-m", "mpicomm.tools.doctor",
                                  "--json"), env=clean_mpi_env(extra_env),
                          capture_output=True, text=True, timeout=300)
    return proc, json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])


@pytest.mark.gpu
@spawns_mpirun
@pytest.mark.skipif(GPUS < 1, reason="needs a GPU that CuPy sees")
def test_doctor_two_ranks_forced_onto_one_gpu():
    proc, report = _doctor_json(2, {"CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 1, proc.stderr
    rows = report["ranks"]
    assert [r["gpu"] for r in rows] == [0, 0] and rows[0]["pci_bus_id"] == rows[1]["pci_bus_id"]
    assert any(p.startswith("two or more ranks on one GPU: ranks 0, 1 on host ")
               for p in report["problems"])
    assert any(p.startswith("more ranks than GPUs on host ") for p in report["problems"])


@pytest.mark.gpu
@spawns_mpirun
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs that CuPy sees")
def test_doctor_one_rank_per_gpu_is_healthy():
    proc, report = _doctor_json(2, {})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = report["ranks"]
    assert [r["gpu"] for r in rows] == [0, 1]
    assert len({r["pci_bus_id"] for r in rows}) == 2
    assert all(r["backend"] == "nccl" and r["nccl"] and r["cupy"] for r in rows)
    assert report["problems"] == []


# ------------------------------------------------------------------------- --net

def _net_rows(layout):
    """Made-up facts for ranks laid out as [(host, ranks on it), ...], MPI backend."""
    rows, rank = [], 0
    for host, count in layout:
        for local in range(count):
            rows.append(rank_row(rank, host, local, visible=[], nccl=None, cupy=None))
            rank += 1
    return rows


def test_net_pairs_every_host_pair_and_each_hosts_first_two_ranks():
    rows = _net_rows([("a", 2), ("b", 1), ("c", 3)])
    rows.reverse()  # the order of the rows must not matter, only the ranks
    assert doctor.net_pairs(rows) == [("a", "a", 0, 1), ("a", "b", 0, 2), ("a", "c", 0, 3),
                                      ("b", "c", 2, 3), ("c", "c", 3, 4)]
    assert doctor.net_pairs(_net_rows([("solo", 1)])) == []
    assert doctor.net_pairs(_net_rows([("one", 4)])) == [("one", "one", 0, 1)]


def _entry(a, b, ranks, mpi_gbs, nccl_gbs=None, transport=None, **extra):
    e = {"host_a": a, "host_b": b, "ranks": ranks, "mpi_latency_us": 20.0,
         "mpi_gbs": mpi_gbs, "mpi_intact": True}
    if nccl_gbs is not None:
        e.update(nccl_latency_us=40.0, nccl_gbs=nccl_gbs, nccl_intact=True,
                 nccl_transport=transport)
    e.update(extra)
    return e


def test_net_diagnosis_of_a_healthy_two_host_gpu_job():
    net = [_entry("n1", "n1", [0, 1], 9.0, 150.0, ["P2P/CUMEM"]),
           _entry("n1", "n2", [0, 2], 2.0, 2.5, ["NET/Socket"]),
           _entry("n2", "n2", [2, 3], 9.5, 148.0, ["P2P/CUMEM"])]
    assert doctor.diagnose_net(net) == ([], [])


def test_net_diagnosis_names_the_bad_pairs():
    net = [_entry("n1", "n2", [0, 2], 2.0, 2.5, ["NET/Socket"], mpi_intact=False),
           _entry("n1", "n3", [0, 4], 2.1, 2.4, ["P2P/CUMEM", "NET/Socket"]),
           {"host_a": "n2", "host_b": "n3", "ranks": [2, 4],
            "error": "NcclError: NCCL_ERROR_SYSTEM_ERROR: unhandled system error"}]
    problems, warnings = doctor.diagnose_net(net)
    assert problems == [
        "n1 (rank 0) - n2 (rank 2): the MPI payload arrived changed; the link or the "
        "transport corrupts data",
        "n1 (rank 0) - n3 (rank 4): NCCL joins these hosts by P2P/CUMEM, a transport within "
        "one machine: NCCL takes them for one host (same host name or NCCL_HOSTID?)",
        "n2 (rank 2) - n3 (rank 4): the measurement failed: NcclError: "
        "NCCL_ERROR_SYSTEM_ERROR: unhandled system error"]
    assert warnings == []


def test_net_diagnosis_flags_a_slow_host_pair():
    # Four hosts: six pairs; n4's links run at a tenth (a wrong interface, say).
    rng = np.random.default_rng(5)
    hosts = ["n1", "n2", "n3", "n4"]
    net = []
    for i, a in enumerate(hosts):
        for b in hosts[i + 1:]:
            gbs = 10.0 + rng.uniform(-1, 1)
            net.append(_entry(a, b, [i, hosts.index(b)], gbs / 10 if "n4" in (a, b) else gbs))
    slow = [e for e in net if "n4" in (e["host_a"], e["host_b"])]
    values = sorted(e["mpi_gbs"] for e in net)
    median = (values[2] + values[3]) / 2
    problems, warnings = doctor.diagnose_net(net)
    assert problems == []
    assert len(warnings) == 3  # the three links of n4, none of the others
    for e, w in zip(slow, warnings):
        assert w.startswith(f"slow link {e['host_a']} - {e['host_b']}: MPI {e['mpi_gbs']:.2f} GB/s, "
                            f"under 0.5 x the median host pair ({median:.2f} GB/s)")


def test_net_table():
    net = [_entry("gpuhost1", "gpuhost1", [0, 1], 9.04, 151.25, ["P2P/CUMEM"]),
           _entry("gpuhost1", "gpuhost2", [0, 2], 1.5, None),
           {"host_a": "gpuhost2", "host_b": "gpuhost2", "ranks": [2, 3], "error": "boom"}]
    lines = doctor.format_net(net, 64 << 20).splitlines()
    assert [l.split("  ")[0] for l in lines] == ["host a", "gpuhost1", "gpuhost1", "gpuhost2"]
    assert lines[0].split() == ["host", "a", "host", "b", "ranks", "MPI", "8", "B", "us", "MPI",
                                "64", "MiB", "GB/s", "NCCL", "8", "B", "us", "NCCL", "64", "MiB",
                                "GB/s", "NCCL", "transport"]
    assert lines[1].split() == ["gpuhost1", "gpuhost1", "0-1", "20.0", "9.04", "40.0", "151.25",
                                "P2P/CUMEM"]
    assert lines[2].split() == ["gpuhost1", "gpuhost2", "0-2", "20.0", "1.50", "-", "-", "-"]
    assert lines[3].split() == ["gpuhost2", "gpuhost2", "2-3", "failed:", "boom"]
    assert doctor.format_net(net[:1], 1000).splitlines()[0].split()[10:12] == ["1000", "B"]


def test_nccl_transports_from_info_lines():
    log = ("host1:123:140 [0] NCCL INFO Channel 00/1 : 0[0] -> 1[2] [send] via NET/Socket/0\n"
           "host1:123:140 [0] NCCL INFO Channel 01/1 : 1[2] -> 0[0] [receive] via NET/Socket/1\n"
           "host1:123:141 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
           "host1:123:141 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct\n"
           "host1:123:141 [0] NCCL INFO Connected all rings\n")
    assert doctor.nccl_transports(log) == ["NET/Socket", "P2P/CUMEM", "SHM/direct"]
    assert doctor.nccl_transports("") == []


@pytest.mark.parametrize("args, message", [
    (["--net", "--net-bytes", "4"], "invalid --net-bytes '4': expected a size from 8 bytes to 1G"),
    (["--net", "--net-bytes", "2G"], "invalid --net-bytes '2G': expected a size from 8 bytes to 1G"),
    (["--net", "--net-bytes", "lots"], "invalid --net-bytes 'lots'"),
    (["--net", "--net-iters", "0"], "invalid --net-iters '0': expected an integer >= 1"),
    (["--net", "--net-reps", "-3"], "invalid --net-reps '-3': expected an integer >= 1"),
])
def test_net_options_refused_before_mpi_starts(args, message):
    proc = subprocess.run([sys.executable, "-m", "mpicomm.tools.doctor", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def _net_report(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])


def _check_measured(entry, nbytes):
    assert entry["mpi_intact"] is True
    assert 0 < entry["mpi_latency_us"] < 1e6
    # 2 messages of nbytes took at least a microsecond and at most the test's time limit.
    assert 2 * nbytes / 300 / 1e9 < entry["mpi_gbs"] < 2 * nbytes / 1e-6 / 1e9
    assert "nccl_gbs" not in entry and "error" not in entry


NET_ARGS = ("--net", "--net-bytes", "1M", "--net-iters", "50", "--net-reps", "2", "--json")


@spawns_mpirun
@pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")
@pytest.mark.parametrize("n", [2, 3])
def test_doctor_net_on_one_host(n):
    """One host: its first two ranks are the one pair measured, whatever the rank count."""
    proc = subprocess.run(run_cli("-n", str(n), "-m", "mpicomm.tools.doctor", *NET_ARGS),
                          env=clean_mpi_env({"CUDA_VISIBLE_DEVICES": ""}),
                          capture_output=True, text=True, timeout=300)
    report = _net_report(proc)
    host = socket.gethostname()
    assert [(e["host_a"], e["host_b"], e["ranks"]) for e in report["net"]] == [(host, host, [0, 1])]
    _check_measured(report["net"][0], 1 << 20)
    assert report["net_bytes"] == 1 << 20 and report["problems"] == []


REHEARSAL = os.path.join(ROOT, "scripts", "gpu_cluster_rehearsal.sh")
REHEARSAL_STATE = "/run/mpicomm-rehearsal-test"


def _why_no_namespaces():
    if world_size_from_env() > 1:
        return None   # spawns_mpirun skips it there
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (uid {os.geteuid()})"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"no '{tool}' (apt-get install -y util-linux)"
    if not have_mpirun():
        return "no mpirun on PATH"
    return netns_refused()


NO_NAMESPACES = _why_no_namespaces()


def _rehearsal(*args, timeout=120):
    env = dict(clean_mpi_env({"CUDA_VISIBLE_DEVICES": ""}),
               MPICOMM_REHEARSAL_STATE=REHEARSAL_STATE, PY=sys.executable, NGPU="0")
    return subprocess.run(["bash", REHEARSAL, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _holders():
    """Pids of processes whose network namespace differs from ours and that run 'sleep infinity'."""
    mine = os.readlink("/proc/self/ns/net")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if cmd[:2] == [b"sleep", b"infinity"] and os.readlink(f"/proc/{pid}/ns/net") != mine:
                found.append(int(pid))
        except OSError:
            pass
    return found


@spawns_mpirun
@pytest.mark.timeout(600)
def test_doctor_net_between_two_namespace_hosts():
    """Two real hosts (own network, address and host name) joined by a veth pair: the matrix
    measures both hosts' first two ranks and the pair of host leaders, ranks 0 and 2."""
    require(NO_NAMESPACES)
    before = set(_holders())
    try:
        up = _rehearsal("up")
        assert up.returncode == 0, up.stdout + up.stderr
        hostfile = up.stdout.strip().splitlines()[-1]
        assert open(hostfile).read().split("\n")[1:3] == ["gpuhost1 slots=2", "gpuhost2 slots=2"]
        proc = _rehearsal("exec", "gpuhost1", *run_cli("--hostfile", hostfile, "-n", "4",
                                                       "--timeout", "240", "-m",
                                                       "mpicomm.tools.doctor", *NET_ARGS),
                          timeout=300)
        report = _net_report(proc)
        assert [r["host"] for r in report["ranks"]] == ["gpuhost1", "gpuhost1", "gpuhost2",
                                                        "gpuhost2"]
        assert [r["local_rank"] for r in report["ranks"]] == [0, 1, 0, 1]
        assert [(e["host_a"], e["host_b"], e["ranks"]) for e in report["net"]] == [
            ("gpuhost1", "gpuhost1", [0, 1]), ("gpuhost1", "gpuhost2", [0, 2]),
            ("gpuhost2", "gpuhost2", [2, 3])]
        for entry in report["net"]:
            _check_measured(entry, 1 << 20)
        assert report["problems"] == []

        # The table form, as the rehearsal prints it.
        table = _rehearsal("exec", "gpuhost1", *run_cli("--hostfile", hostfile, "-n", "4",
                                                        "--timeout", "240", "-m",
                                                        "mpicomm.tools.doctor", *NET_ARGS[:-1]),
                           timeout=300)
        assert table.returncode == 0, table.stdout[-3000:] + table.stderr[-3000:]
        lines = table.stdout.splitlines()
        at = lines.index(next(l for l in lines if l.startswith("network: 3 pair(s)")))
        assert [l.split()[:3] for l in lines[at + 2:at + 5]] == [
            ["gpuhost1", "gpuhost1", "0-1"], ["gpuhost1", "gpuhost2", "0-2"],
            ["gpuhost2", "gpuhost2", "2-3"]]
    finally:
        down = _rehearsal("down")
        assert down.returncode == 0, down.stderr
        assert not os.path.exists(REHEARSAL_STATE)
        assert set(_holders()) <= before


@pytest.mark.gpu
@spawns_mpirun
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs that CuPy sees")
def test_doctor_net_gpu_to_gpu_on_one_host():
    """Two ranks, two GPUs of one host: the pair is also timed over NCCL, the payload
    arrives intact, and NCCL names a transport within the machine (P2P or SHM)."""
    proc = subprocess.run(run_cli("-n", "2", "-m", "mpicomm.tools.doctor", *NET_ARGS),
                          env=clean_mpi_env({}), capture_output=True, text=True, timeout=300)
    report = _net_report(proc)
    assert all(r["backend"] == "nccl" for r in report["ranks"])
    (entry,) = report["net"]
    host = report["ranks"][0]["host"]
    assert (entry["host_a"], entry["host_b"], entry["ranks"]) == (host, host, [0, 1])
    assert entry["mpi_intact"] is True and entry["nccl_intact"] is True
    assert 0 < entry["nccl_latency_us"] < 1e6
    assert 2 * (1 << 20) / 300 / 1e9 < entry["nccl_gbs"] < 2 * (1 << 20) / 1e-6 / 1e9
    assert entry["nccl_transport"] and all(t.split("/")[0] in ("P2P", "SHM")
                                           for t in entry["nccl_transport"]), entry
    assert report["problems"] == []
