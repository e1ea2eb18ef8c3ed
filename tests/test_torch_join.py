"""mpicomm.torch.DistributedDataParallel against torch's own DDP (gloo, in the same job) where
torch DDP scripts use more than the forward/backward: the refusal of a model with nothing to
train. CPU tensors over MPI."""
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm.errors import InvalidArgumentError  # noqa: E402

pytestmark = pytest.mark.mpi

torch.set_num_threads(1)  # the ranks share two cores

D = 5


@pytest.fixture(autouse=True)
def _cpu_tensors_need_mpi(request):
    if "comm" in request.fixturenames and request.getfixturevalue("comm").get_backend() != "mpi":
        pytest.skip("CPU tensors need the MPI backend: run with MPICOMM_BACKEND=mpi")


@pytest.fixture
def torch_dist(comm):
    mt.init_process_group("gloo", timeout=120)
    import torch.distributed as dist

    return dist


def seeded(module, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
    return module


class MLP(torch.nn.Module):
    def __init__(self, seed, dtype=torch.float64):
        super().__init__()
        self.l1 = torch.nn.Linear(D, 8)
        self.l2 = torch.nn.Linear(8, 3)
        seeded(self, seed, dtype)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def batch(kind, k, r, micro=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(10000 * r + 100 * k + micro)
    shape = (4, D) if kind == "mlp" else (4, 2, 6, 6)
    return torch.randn(shape, generator=g, dtype=dtype) * (1 + r) + r


# ------------------------------------------------------------------ nothing to train

@pytest.mark.parametrize("which", ["frozen", "no_parameters", "frozen_on_rank_1"])
def test_a_model_with_nothing_to_train_raises_on_every_rank(comm, torch_dist, which):
    """torch DDP refuses a module without a parameter that requires a gradient (RuntimeError);
    the wrapper raises InvalidArgumentError on every rank naming ``module``, with torch's
    reason; where only rank 1's model is frozen, rank 1 says so and the others name rank 1."""
    n, r = comm.get_group_size(), comm.get_rank()
    if which == "frozen_on_rank_1" and n == 1:
        which = "frozen"
    mine = which != "frozen_on_rank_1" or r == 1
    m = torch.nn.ReLU() if which == "no_parameters" else MLP(seed=1).requires_grad_(not mine)
    expect = (r"invalid module=<.*>: expected a model with at least one parameter that requires a gradient "
              r"\(it has (4 parameters, all with requires_grad=False|no parameters)")
    with pytest.raises(InvalidArgumentError, match=expect if mine else
                       r"rank 1 refused DistributedDataParallel's arguments.*requires a gradient"):
        mt.DistributedDataParallel(m)
    if which != "frozen_on_rank_1":
        with pytest.raises(RuntimeError, match="DistributedDataParallel is not needed when a module doesn't "
                                               "have any parameter that requires a gradient"):
            torch.nn.parallel.DistributedDataParallel(m)
    # in step afterwards
    assert mpicomm.all_gather_object(r) == list(range(n))
