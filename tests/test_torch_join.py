"""mpicomm.torch.DistributedDataParallel against torch's own DDP (gloo, in the same job) where
torch DDP scripts use more than the forward/backward: ``register_comm_hook`` with torch's
default hooks, and the refusal of a model with nothing to train. Each rank's data is random,
seeded by its rank; torch DDP over gloo computes the expectation from the same data. CPU
tensors over MPI (float64 where the values must agree to summation order, float32 for the
half-precision hooks)."""
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm.errors import InvalidArgumentError, RefusedElsewhereError  # noqa: E402

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


# ------------------------------------------------------------------ register_comm_hook

def hook_grads(wrap, r, dtype, hook, steps=2, state=None):
    """The gradient of each of ``steps`` steps (every rank's batches even), with ``hook``
    registered before the first backward; ``wrap`` None: this rank's own gradient, from rank
    0's model (what the wrappers start from)."""
    m = MLP(seed=60 + (r if wrap else 0), dtype=dtype)
    model = wrap(m) if wrap else m
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for k in range(steps):
        opt.zero_grad()
        model(batch("mlp", k, r, dtype=dtype)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        opt.step()
    return grads, m


def test_register_fp16_compress_hook_as_torch_ddp(comm, torch_dist):
    """fp16_compress_hook (its state torch's world group, as scripts pass it): the gradients
    are torch DDP's with the same hook within float16's rounding (torch casts then divides by
    the group size, mpicomm divides then casts: the sum's rounding differs by an ulp of
    float16), every value a float16 one, and near the float32 mean."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    n, r = comm.get_group_size(), comm.get_rank()
    world = torch_dist.group.WORLD
    got, _ = hook_grads(mt.DistributedDataParallel, r, torch.float32, dh.fp16_compress_hook, state=world)
    want, _ = hook_grads(torch.nn.parallel.DistributedDataParallel, r, torch.float32, dh.fp16_compress_hook,
                         state=world)
    exact, _ = hook_grads(torch.nn.parallel.DistributedDataParallel, r, torch.float32, None)
    for k in range(2):
        for g, w, e in zip(got[k], want[k], exact[k]):
            assert torch.equal(g, g.half().float()), "a gradient value is not a float16 one"
            scale = float(e.abs().max())
            torch.testing.assert_close(g, w, rtol=0, atol=scale * 2 ** -9)
            torch.testing.assert_close(g, e, rtol=0, atol=scale * 2 ** -8)
    if n > 1:   # (at 1 rank float16 rounding may leave the gradients as they are)
        assert any(not torch.equal(g, e) for g, e in zip(got[0], exact[0]))


def test_register_bf16_and_allreduce_hooks(comm, torch_dist):
    """bf16_compress_hook (torch DDP runs it only on NCCL): every gradient value a bfloat16
    one, within bfloat16's rounding of the exact mean (each rank's gradient divided by the
    group size, rounded to bfloat16, summed, rounded). allreduce_hook: torch DDP's with the
    same hook (float64)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    n, r = comm.get_group_size(), comm.get_rank()
    got, _ = hook_grads(mt.DistributedDataParallel, r, torch.float32, dh.bf16_compress_hook, steps=1)
    exact, _ = hook_grads(torch.nn.parallel.DistributedDataParallel, r, torch.float32, None, steps=1)
    ranks = mpicomm.all_gather_object(hook_grads(None, r, torch.float32, None, steps=1)[0][0])
    for i, (g, e) in enumerate(zip(got[0], exact[0])):
        assert torch.equal(g, g.bfloat16().float()), "a gradient value is not a bfloat16 one"
        emulated = sum((rk[i] / n).bfloat16().float() for rk in ranks).bfloat16().float()
        scale = float(e.abs().max())
        torch.testing.assert_close(g, emulated, rtol=0, atol=scale * 2 ** -8)
        torch.testing.assert_close(g, e, rtol=0, atol=scale * 2 ** -6)
    got, m = hook_grads(mt.DistributedDataParallel, r, torch.float64, dh.allreduce_hook)
    want, w = hook_grads(torch.nn.parallel.DistributedDataParallel, r, torch.float64, dh.allreduce_hook)
    for k in range(2):
        for g, h in zip(got[k], want[k]):
            torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)
    for p, q in zip(m.parameters(), w.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_register_comm_hook_refusals(comm):
    """Other hooks (a function of your own, PowerSGD), a second registration, one after a
    backward, a hook against the constructor's compression or gradients_mean=False, and ranks
    registering different hooks: InvalidArgumentError on every rank naming the hook and what
    is supported; the wrapper then trains on as before."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    n, r = comm.get_group_size(), comm.get_rank()

    def my_hook(state, bucket):
        return None

    def fresh(**kw):
        return mt.DistributedDataParallel(MLP(seed=80 + r, dtype=torch.float32), **kw)

    model = fresh()
    with pytest.raises(InvalidArgumentError, match=r"invalid hook=.*my_hook: expected one of torch's default "
                       r"hooks .*allreduce_hook .*fp16_compress_hook .*bf16_compress_hook"):
        model.register_comm_hook(None, my_hook)
    with pytest.raises(InvalidArgumentError, match=r"invalid hook=torch\.distributed\.algorithms\.ddp_comm_hooks"
                       r"\.powerSGD_hook\.powerSGD_hook: expected"):
        model.register_comm_hook(None, ps.powerSGD_hook)
    with pytest.raises(InvalidArgumentError, match=r"invalid state=<list>"):
        model.register_comm_hook([1], dh.fp16_compress_hook)
    model.register_comm_hook(None, dh.fp16_compress_hook)
    with pytest.raises(InvalidArgumentError, match=r"called a second time \(.*fp16_compress_hook is registered"):
        model.register_comm_hook(None, dh.fp16_compress_hook)
    model2 = fresh()
    model2(batch("mlp", 0, r, dtype=torch.float32)).sum().backward()
    with pytest.raises(InvalidArgumentError, match=r"after a backward: register the hook before the first"):
        model2.register_comm_hook(None, dh.allreduce_hook)
    with pytest.raises(InvalidArgumentError, match=r"agrees with compression='bf16'"):
        fresh(compression="bf16").register_comm_hook(None, dh.fp16_compress_hook)
    with pytest.raises(InvalidArgumentError, match=r"gradients_mean=False"):
        fresh(gradients_mean=False).register_comm_hook(None, dh.allreduce_hook)
    model3 = fresh()
    if n > 1:
        # rank 1 gives a function of its own: it names that, the others name rank 1's refusal
        with pytest.raises(InvalidArgumentError, match=r"my_hook" if r == 1 else
                           r"rank 1 refused register_comm_hook.*my_hook"):
            model3.register_comm_hook(None, my_hook if r == 1 else dh.fp16_compress_hook)
        with pytest.raises(InvalidArgumentError, match=r"the same hook on every rank \(rank 0 registers .*"
                           r"fp16_compress_hook, rank 1 .*allreduce_hook\)"):
            model3.register_comm_hook(None, dh.fp16_compress_hook if r != 1 else dh.allreduce_hook)
        assert isinstance(RefusedElsewhereError("x"), InvalidArgumentError)
    # still trains, uncompressed (float64 would show any compression), in step on every rank
    model3.register_comm_hook(None, dh.allreduce_hook)
    model3(batch("mlp", 1, r, dtype=torch.float32)).pow(2).mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model3.module.parameters()])
    assert all(torch.equal(o, grads) for o in mpicomm.all_gather_object(grads))
