"""mpicomm.replay and mpicomm.capture where no CUDA graph can be: before init, and on the MPI backend (its calls are
never captured), refused on every rank with an error naming the argument. The replays
themselves run on GPUs: tests/test_gpu_capture.py and test_faults.py (a rank that replays
fewer graphs is named)."""
import subprocess
import sys

import pytest

import mpicomm


def test_replay_before_init_says_init_first():
    r = subprocess.run([sys.executable, "-c", "import mpicomm; mpicomm.replay(object())"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "NotInitializedError: mpicomm.replay() needs mpicomm.init() first" in r.stderr, r.stderr


@pytest.mark.mpi
def test_replay_on_the_mpi_backend_is_refused(comm):
    if mpicomm.get_backend() != "mpi":
        pytest.skip("the NCCL backend replays graphs: tests/test_gpu_capture.py")
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"invalid graph=<object>.*mpi backend"):
        mpicomm.replay(object())
    mpicomm.barrier()   # nothing was entered: the group goes on


@pytest.mark.mpi
def test_capture_on_the_mpi_backend_is_refused(comm):
    if mpicomm.get_backend() != "mpi":
        pytest.skip("the NCCL backend captures: tests/test_gpu_capture.py, test_nccl_double.py")
    with pytest.raises(mpicomm.InvalidArgumentError, match=r"invalid graph=<NoneType>.*mpi backend"):
        with mpicomm.capture():
            pass
    mpicomm.barrier()
