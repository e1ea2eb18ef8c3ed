"""mpicomm-doctor: its diagnosis on made-up ranks, and a real run under mpirun.

The GPU cases are checked here on made-up rows; on a machine with 2 GPUs, run
``CUDA_VISIBLE_DEVICES=0 mpicomm-run -n 2 -m mpicomm.tools.doctor`` (it must exit 1
and name both ranks on one GPU).
"""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from launch_support import (clean_mpi_env, have_mpirun, run_cli, spawns_mpirun,
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
