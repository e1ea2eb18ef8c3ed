"""Each rank's own GPU in PyTorch by default (mpicomm.torch's DDP wrapper and its
torch.distributed bootstrap), and the OneFlow/PyTorch DDP wrapper's ``module.`` prefix in
``state_dict()`` keys with the one-liners of docs/PORTING.md.

The machine that runs this has no GPU: torch.cuda's answers (available, device count,
current device) are set for the device tests, and what is recorded is the device that
would be made current. On GPUs, tests/test_gpu_torch.py runs the real thing."""
import numpy as np
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
from mpicomm.torch import DistributedDataParallel  # noqa: E402
from mpicomm.torch._device import select_local_device  # noqa: E402


@pytest.fixture
def gpus(monkeypatch):
    """A PyTorch that sees ``count`` GPUs, none used yet; returns the devices set."""
    state = {"count": 4, "current": 0, "initialized": False, "set": []}

    def set_device(d):
        state["set"].append(int(d))
        state["current"] = int(d)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return state


@pytest.mark.parametrize("local_rank, count, want", [(0, 4, 0), (1, 4, 1), (5, 4, 1), (3, 2, 1), (2, 1, 0)])
def test_each_local_rank_takes_its_own_gpu(gpus, local_rank, count, want):
    gpus["count"] = count
    assert select_local_device(local_rank) == want
    assert gpus["set"] == ([want] if want else [])      # (0 is current already)


def test_a_device_the_program_chose_is_kept(gpus):
    gpus["current"] = 2                                  # torch.cuda.set_device(2) before
    assert select_local_device(1) is None and gpus["set"] == []
    gpus["current"], gpus["initialized"] = 0, True       # CUDA used already (a model on the GPU)
    assert select_local_device(1) is None and gpus["set"] == []


def test_no_cuda_no_change():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert select_local_device(3) is None


@pytest.mark.mpi
def test_the_wrapper_selects_the_local_ranks_gpu(comm, gpus):
    gpus["count"] = 2
    DistributedDataParallel(torch.nn.Linear(3, 2).double())          # a CPU model: only the device is set
    local = comm.get_local_rank()
    assert gpus["current"] == local % 2
    assert gpus["set"] == ([local % 2] if local % 2 else [])


# ---------------------------------------------------------------- the wrapper's state_dict keys (OneFlow, PyTorch)

@pytest.mark.mpi
def test_state_dict_keys_gain_module_and_the_documented_lines_drop_it(comm, tmp_path):
    r = comm.get_rank()
    torch.manual_seed(7 + r)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).double()
    m = DistributedDataParallel(net)                                 # rank 0's weights everywhere
    plain = list(net.state_dict())
    assert list(m.state_dict()) == ["module." + k for k in plain]    # as OneFlow's and PyTorch's DDP
    # PORTING.md: save the model without the prefix ...
    path = mpicomm.broadcast_object(str(tmp_path / "m.pt"), root=0)
    mpicomm.save_on_rank0(m.module.state_dict(), path, save=torch.save)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).double()
    fresh.load_state_dict(torch.load(path))                          # an unwrapped model takes it as it is
    # ... or drop it from a checkpoint saved with it
    sd = {k.removeprefix("module."): v for k, v in m.state_dict().items()}
    torch.manual_seed(7)                                             # rank 0's draw, made again here
    want = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).double()
    for k, v in want.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v) and torch.equal(sd[k], v)
    m.load_state_dict({"module." + k: v * 2 for k, v in sd.items()}) # the wrapper keeps its prefix
    np.testing.assert_array_equal(net[0].weight.detach().numpy(), 2 * want[0].weight.detach().numpy())
    mpicomm.barrier()
