"""A GPU host without CuPy: init() picks the MPI backend (GPU arrays through host memory)
and each host's first rank says so once, with the install line; mpicomm-doctor says it
too. Driven on the CPU through the environment: CUDA_VISIBLE_DEVICES, or an
``nvidia-smi`` on PATH that lists a GPU (what the probe runs)."""
import json
import os
import stat
import subprocess

import pytest

from launch_support import clean_mpi_env, run_cli, spawns_mpirun
from mpicomm.tools import doctor


def _cupy_sees_a_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = [spawns_mpirun,
              pytest.mark.skipif(_cupy_sees_a_gpu(), reason="CuPy sees a GPU here: init() picks NCCL")]

SAYS = "but CuPy cannot be imported"
INIT = "import mpicomm; mpicomm.init(); print('backend', mpicomm.get_backend(), flush=True)"


def _fake_smi(tmp_path):
    """An nvidia-smi that lists one GPU, as the real one's -L does."""
    path = tmp_path / "bin" / "nvidia-smi"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0000)'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path.parent)


def _run(n, extra, code=INIT, drop=()):
    env = clean_mpi_env(extra, drop=("MPICOMM_BACKEND", *drop))
    p = subprocess.run(run_cli("-n", str(n), "python", "-c", code), env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("backend mpi") == n
    return p.stderr


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cuda_visible_devices_without_cupy_is_said_once_per_host(n):
    err = _run(n, {"CUDA_VISIBLE_DEVICES": "0"})
    assert err.count(SAYS) == 1, err                      # one host here: its first rank only
    line = next(ln for ln in err.splitlines() if SAYS in ln)
    assert "CUDA_VISIBLE_DEVICES=0" in line and "chose the MPI backend" in line
    assert "pip install '.[cuda12]'" in line and "init('mpi')" in line


def test_nvidia_smi_listing_a_gpu_is_a_gpu(tmp_path):
    path = _fake_smi(tmp_path) + os.pathsep + os.environ["PATH"]
    err = _run(2, {"CUDA_VISIBLE_DEVICES": "", "PATH": path})
    assert err.count(SAYS) == 1 and "nvidia-smi -L lists 'GPU 0: NVIDIA H200" in err, err


@pytest.mark.parametrize("extra, code", [
    ({"CUDA_VISIBLE_DEVICES": ""}, INIT),                                         # no GPU: nothing to say
    ({"CUDA_VISIBLE_DEVICES": "-1"}, INIT),                                       # GPUs hidden on purpose
    ({"CUDA_VISIBLE_DEVICES": "0", "MPICOMM_BACKEND": "mpi"}, INIT),              # MPI chosen: no word
    ({"CUDA_VISIBLE_DEVICES": "0"}, INIT.replace("init()", "init('mpi')")),
    ({"CUDA_VISIBLE_DEVICES": "0"}, INIT.replace("init()", "init(backend_name='mpi')")),
])
def test_no_word_without_a_gpu_or_where_mpi_was_chosen(extra, code):
    assert SAYS not in _run(2, extra, code)


def test_doctor_says_it_too(tmp_path):
    env = clean_mpi_env({"CUDA_VISIBLE_DEVICES": "0"}, drop=("MPICOMM_BACKEND",))
    p = subprocess.run(run_cli("-n", "2", "-m", "mpicomm.tools.doctor", "--json"), env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout[p.stdout.index("{"):p.stdout.rindex("}") + 1])
    said = [w for w in report["warnings"] if w.startswith("a GPU without NCCL")]
    assert len(said) == 1, report["warnings"]
    assert "rank(s) 0, 1" in said[0] and "CUDA_VISIBLE_DEVICES=0" in said[0] and "pip install '.[cuda12]'" in said[0]
    assert report["problems"] == []


def test_doctor_diagnosis_of_made_up_rows():
    rows = [{"host": h, "rank": r, "backend": "mpi", "gpu_count": 0, "gpu_seen": seen,
             "no_nccl": "CuPy cannot be imported (ModuleNotFoundError: No module named 'cupy')" if seen else None}
            for r, (h, seen) in enumerate([("n1", "CUDA_VISIBLE_DEVICES=0,1"), ("n1", "CUDA_VISIBLE_DEVICES=0,1"),
                                           ("n2", None), ("n2", None)])]
    problems, warnings = doctor.diagnose(rows)
    said = [w for w in warnings if w.startswith("a GPU without NCCL")]
    assert said == [w for w in said if "on host n1: rank(s) 0, 1" in w] and len(said) == 1
    assert problems == []


# ------------------------------------------------ more ranks on a host than it has GPUs
# Driven through the CPU double of CuPy (tests/fakecupy; FAKECUPY_DEVICES GPUs a host).
FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakecupy")
CHOSE = "so init() chose the MPI backend"
SHOW = ("import mpicomm\ntry:\n    mpicomm.init({arg})\nexcept mpicomm.BackendUnavailableError as e:\n"
        "    print('refused:', e, flush=True)\nelse:\n    print('backend', mpicomm.get_backend(), flush=True)")


def _double(n, devices, arg=""):
    env = clean_mpi_env({"PYTHONPATH": FAKE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                         "FAKECUPY_DEVICES": str(devices), "CUDA_VISIBLE_DEVICES": ""}, drop=("MPICOMM_BACKEND",))
    p = subprocess.run(run_cli("-n", str(n), "python", "-c", SHOW.format(arg=arg)), env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout, p.stderr


@pytest.mark.parametrize("n, devices, shared", [(2, 1, "ranks 0, 1 share one (device 0)"),
                                                (3, 2, "ranks 0, 2 share one (device 0)"),
                                                (4, 3, "ranks 0, 3 share one (device 0)")])
def test_ranks_sharing_a_gpu_get_the_mpi_backend_from_init_said_once_per_host(n, devices, shared):
    """NCCL refuses two ranks on one GPU (NCCL_ERROR_INVALID_USAGE on every rank, from the
    communicator's creation): init() picking the backend itself takes MPI instead, and each
    host's first rank says why, naming the ranks that share a GPU."""
    out, err = _double(n, devices)
    assert out.count("backend mpi") == n, out + err
    assert err.count(CHOSE) == 1, err
    line = next(ln for ln in err.splitlines() if CHOSE in ln)
    assert f"{n} ranks have {devices} GPU" in line and shared in line, line
    assert "MPICOMM_BACKEND=mpi" in line and SAYS not in err


@pytest.mark.parametrize("arg", ["'nccl'", "backend_name='nccl'"])
def test_ranks_sharing_a_gpu_asked_for_nccl_are_refused_on_every_rank(arg):
    out, err = _double(3, 2, arg)
    said = [ln for ln in out.splitlines() if ln.startswith("refused:")]
    assert len(said) == 3 and len(set(said)) == 1, out + err
    assert "backend 'nccl' cannot run these ranks" in said[0] and "ranks 0, 2 share one (device 0)" in said[0]
    assert "one rank per GPU" in said[0] and "init('mpi') or MPICOMM_BACKEND=mpi" in said[0]
    assert CHOSE not in err


def test_a_gpu_for_each_rank_is_nccl_and_no_word():
    out, err = _double(3, 3)
    assert out.count("backend nccl") == 3, out + err
    assert CHOSE not in err and SAYS not in err
