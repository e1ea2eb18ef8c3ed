"""mpicomm.torch on CPU tensors over MPI: the DDP wrapper equals one process on the global
batch, buckets start during backward, no_sync, unused parameters, compression, bfloat16,
buffers, init_process_group against torch.distributed (gloo), and the reducer's fused
path on tensors. The same checks on CUDA tensors are in test_gpu_torch.py (they call the
``check_*`` functions here with device="cuda")."""
import contextlib

import numpy as np
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import ml_dtypes  # noqa: E402

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm import InvalidArgumentError  # noqa: E402

pytestmark = pytest.mark.mpi

@pytest.fixture(autouse=True)
def _cpu_tensors_need_mpi(request):
    """These tests put CPU tensors through mpicomm: the MPI backend's work. Where mpicomm
    chose NCCL (a GPU machine), run them with MPICOMM_BACKEND=mpi; test_gpu_torch.py runs
    the same checks on CUDA tensors over NCCL."""
    if "comm" in request.fixturenames and request.getfixturevalue("comm").get_backend() != "mpi":
        pytest.skip("CPU tensors need the MPI backend: run with MPICOMM_BACKEND=mpi")


GLOBAL_B, K, LR = 24, 4, 0.05  # 24 divides by 1, 2, 3 and 4 ranks
torch.set_num_threads(1)  # the ranks share two cores


class Net(torch.nn.Module):
    """A small conv net: conv -> relu -> linear -> relu -> linear (plus an unused layer)."""

    def __init__(self, seed, dtype=torch.float64, unused=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.fc1 = torch.nn.Linear(3 * 4 * 4, 10)
        self.fc2 = torch.nn.Linear(10, 4)
        if unused:
            self.spare = torch.nn.Linear(10, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
        self.to(dtype)
        self.use_spare = False

    def forward(self, x):
        h = torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1)))
        return (self.spare if self.use_spare else self.fc2)(h)


def global_data(seed=11, steps=K, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, GLOBAL_B, 2, 6, 6, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 4, (steps, GLOBAL_B), generator=g)
    return x, y


def my_slice(n, r):
    per = GLOBAL_B // n
    return slice(r * per, (r + 1) * per)


def reference(steps, zero_to_none=True, dtype=torch.float64, momentum=0.9):
    """One process, the whole global batch every step (computed on every rank alike)."""
    torch.manual_seed(0)
    m = Net(seed=0, dtype=dtype)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=momentum, weight_decay=1e-3)
    x, y = global_data(steps=steps, dtype=dtype)
    for k in range(steps):
        opt.zero_grad(set_to_none=zero_to_none)
        torch.nn.functional.cross_entropy(m(x[k]), y[k]).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


# ---------------------------------------------------------------- the wrapper equals one process

PLANS = {"default": {}, "per_tensor": {"bucket_cap_mb": 0}, "small": {"bucket_cap_mb": 600 / 2 ** 20},
         "fusion": {"fusion_config": [1, 3]}}


def check_equals_one_process(device, plan_kw, zero_to_none=True):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = Net(seed=100 + r).to(device)  # different on every rank: the wrapper takes rank 0's
    model = mt.DistributedDataParallel(m, **plan_kw)
    ref0 = Net(seed=100)
    for p, q in zip(m.parameters(), ref0.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
    # the reference starts from rank 0's model too
    ref_model = Net(seed=100)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
    x, y = global_data()
    s = my_slice(n, r)
    for k in range(K):
        opt.zero_grad(set_to_none=zero_to_none)
        torch.nn.functional.cross_entropy(model(x[k, s].to(device)), y[k, s].to(device)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref_model(x[k]), y[k]).backward()
        ref_opt.step()
    for (name, p), q in zip(m.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-9, atol=1e-12, msg=name)
        assert p.grad.data_ptr() == model._views[model.parameter_names.index(name)].data_ptr()
    return model


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("zero_to_none", [True, False])
def test_wrapper_equals_one_process_on_the_global_batch(comm, plan, zero_to_none):
    model = check_equals_one_process("cpu", PLANS[plan], zero_to_none)
    if plan == "per_tensor":
        assert len(model.buckets) == len(model.parameter_names) == 6


def test_reference_is_not_trivial(comm):
    """The reference moves: one step differs from the start, one rank's batch differs from it."""
    start = [p.detach() for p in Net(seed=0).parameters()]
    after = reference(1)
    assert all(not torch.equal(a, b) for a, b in zip(start, after))


# ---------------------------------------------------------------- overlap

def check_buckets_start_during_backward(device):
    m = Net(seed=5).to(device)
    model = mt.DistributedDataParallel(m, bucket_cap_mb=0)  # one bucket per parameter
    nb = len(model.buckets)
    assert nb == 6
    seen = []
    # the input's gradient is the last thing backward computes: by then the buckets of
    # the later layers have been issued, while the first layer's are still to come
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64, device=device, requires_grad=True)
    x.register_hook(lambda g: seen.append(model.buckets_started) or g)
    events = []
    model.module.fc1.register_full_backward_hook(lambda *a: events.append(("fc1", model.buckets_started)))
    model(x).square().sum().backward()
    assert len(seen) == 1
    assert 1 <= seen[0] < nb, seen
    # fc2 (the last layer: indices 4, 5) is reduced before backward reaches fc1
    assert events and events[0][1] >= 2, events
    assert model.buckets_started == 0  # the step finished: every bucket waited for, state reset


def test_buckets_start_during_backward(comm):
    check_buckets_start_during_backward("cpu")


# ---------------------------------------------------------------- no_sync

def check_no_sync(device):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    model = mt.DistributedDataParallel(Net(seed=7).to(device))
    ref = Net(seed=7)
    x, y = global_data(seed=3, steps=3)
    s = my_slice(n, r)
    loss = torch.nn.functional.cross_entropy
    with model.no_sync():
        for k in range(2):
            loss(model(x[k, s].to(device)), y[k, s].to(device)).backward()
            assert model.buckets_started == 0
    # still local: rank r's own gradient of its two micro-batches
    local = Net(seed=7)
    for k in range(2):
        loss(local(x[k, s]), y[k, s]).backward()
    for p, q in zip(model.module.parameters(), local.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-9, atol=1e-12)
    loss(model(x[2, s].to(device)), y[2, s].to(device)).backward()
    for k in range(3):  # the sum over micro-batches of the global-batch gradient
        loss(ref(x[k]), y[k]).backward()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-9, atol=1e-12)


def test_no_sync_accumulates_locally_then_reduces_the_sum(comm):
    check_no_sync("cpu")


# ---------------------------------------------------------------- unused parameters

def check_unused(device):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    x, y = global_data(seed=9, steps=1)
    s = my_slice(n, r)
    loss = torch.nn.functional.cross_entropy
    # reduced as zeros: only odd ranks use `spare` (instead of fc2) in this step
    m = Net(seed=8, unused=True).to(device)
    model = mt.DistributedDataParallel(m, find_unused_parameters=True)
    m.use_spare = r % 2 == 1
    loss(model(x[0, s].to(device)), y[0, s].to(device)).backward()
    sums = {k: torch.zeros_like(p, device="cpu") for k, p in Net(seed=8, unused=True).named_parameters()}
    for q in range(n):  # every rank's local gradient, computed here independently
        ref = Net(seed=8, unused=True)
        ref.use_spare = q % 2 == 1
        loss(ref(x[0, my_slice(n, q)]), y[0, my_slice(n, q)]).backward()
        for k, p in ref.named_parameters():
            if p.grad is not None:
                sums[k] += p.grad
    for k, p in m.named_parameters():
        if n == 1 and k.startswith("spare."):   # no rank used it: .grad stays None, as in DDP
            assert p.grad is None, k
            continue
        torch.testing.assert_close(p.grad.cpu(), sums[k] / n, rtol=1e-9, atol=1e-12, msg=k)
    # the default: the step completes on every rank, then each raises naming the parameters
    m2 = Net(seed=8, unused=True).to(device)
    model2 = mt.DistributedDataParallel(m2)
    with pytest.raises(InvalidArgumentError, match=r"2 trainable parameter\(s\) got no gradient in this "
                       r"backward: spare.weight, spare.bias; pass find_unused_parameters=True"):
        loss(model2(x[0, s].to(device)), y[0, s].to(device)).backward()
    # and the wrapper is usable again afterwards
    m2.spare.requires_grad_(False)
    assert model2.buckets_started == 0


def test_unused_parameters(comm):
    check_unused("cpu")


# ---------------------------------------------------------------- compression and bfloat16

def _nccl_tol(device, n, which):
    """MPI sums 16-bit floats in float32 and rounds once (exact here); NCCL rounds after
    each of its n - 1 additions: up to about n half-precision roundings."""
    if str(device) == "cpu":
        return 0.0
    return n * (2.0 ** -8 if which == "bf16" else 2.0 ** -11)


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _local_grads(seed, n, q, dtype, device="cpu"):
    x, y = global_data(seed=21, steps=1, dtype=dtype)
    m = Net(seed=seed, dtype=dtype).to(device)
    s = my_slice(n, q)
    torch.nn.functional.cross_entropy(m(x[0, s].to(device)).float(), y[0, s].to(device)).backward()
    return [p.grad.float().cpu().numpy() for p in m.parameters()]


def check_compression(device, which):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = Net(seed=31, dtype=torch.float32).to(device)
    model = mt.DistributedDataParallel(m, compression=which)
    x, y = global_data(seed=21, steps=1, dtype=torch.float32)
    s = my_slice(n, r)
    torch.nn.functional.cross_entropy(model(x[0, s].to(device)), y[0, s].to(device)).backward()
    half = (lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float32)) if which == "fp16" else _bf16
    each = [_local_grads(31, n, q, torch.float32, device) for q in range(n)]
    for i, p in enumerate(m.parameters()):
        # divided by n in half precision before the sum, summed in float32, rounded once
        want = half(sum(half(e[i] / np.float32(n)).astype(np.float64) for e in each))
        exact = sum(e[i].astype(np.float64) for e in each) / n
        got = p.grad.cpu().numpy()
        assert p.grad.dtype == torch.float32
        tol = _nccl_tol(device, n, which)
        np.testing.assert_allclose(got, want, rtol=max(tol, 1e-6), atol=max(tol * np.abs(want).max(), 1e-7))
        np.testing.assert_allclose(got, exact, rtol=2 ** -7, atol=1e-3 * np.abs(exact).max())


@pytest.mark.parametrize("which", ["fp16", "bf16"])
def test_compression(comm, which):
    check_compression("cpu", which)


def check_bf16_model(device):
    """A bfloat16 model: gradients reduced in bfloat16 (divided by n first), summed in float32."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = Net(seed=41, dtype=torch.bfloat16).to(device)
    model = mt.DistributedDataParallel(m)
    x, y = global_data(seed=21, steps=1, dtype=torch.bfloat16)
    s = my_slice(n, r)
    torch.nn.functional.cross_entropy(model(x[0, s].to(device)).float(), y[0, s].to(device)).backward()
    each = [_local_grads(41, n, q, torch.bfloat16, device) for q in range(n)]
    for i, p in enumerate(m.parameters()):
        assert p.grad.dtype == torch.bfloat16
        want = _bf16(sum(_bf16(e[i] / np.float32(n)).astype(np.float64) for e in each))
        tol = _nccl_tol(device, n, "bf16")
        np.testing.assert_allclose(p.grad.float().cpu().numpy(), want, rtol=max(tol, 1e-6),
                                   atol=max(tol * np.abs(want).max(), 1e-7))


def test_bf16_model(comm):
    check_bf16_model("cpu")


@pytest.mark.parametrize("form", ["new", "out", "inplace", "async", "param"])
def test_bf16_cpu_tensors_on_mpi(comm, rng, form):
    n, r = comm.get_group_size(), comm.get_rank()
    vals = [(np.random.default_rng([q, 5]).standard_normal(37) * (q + 1)).astype(np.float32) for q in range(n)]
    t = torch.from_numpy(vals[r]).to(torch.bfloat16)
    want = _bf16(sum(_bf16(v).astype(np.float64) for v in vals))
    if form == "new":
        got = mpicomm.all_reduce(t)
    elif form == "out":
        o = torch.empty_like(t)
        got = mpicomm.all_reduce(t, out=o)
        assert got is o
    elif form == "inplace":
        got = mpicomm.all_reduce(t, out=t)
        assert got is t
    elif form == "async":
        got = mpicomm.all_reduce(t, async_op=True).wait()
    else:
        p = torch.nn.Parameter(t.clone())
        got = mpicomm.all_reduce(p)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.float().numpy(), want)


def test_bf16_cpu_tensors_gather_and_broadcast(comm):
    n, r = comm.get_group_size(), comm.get_rank()
    vals = [(np.random.default_rng([q, 6]).standard_normal((2, 3)) + q).astype(np.float32) for q in range(n)]
    t = torch.from_numpy(vals[r]).to(torch.bfloat16)
    g = mpicomm.all_gather(t)
    np.testing.assert_array_equal(g.float().numpy(), np.concatenate([_bf16(v) for v in vals]))
    b = mpicomm.broadcast(t.clone(), root=n - 1)
    np.testing.assert_array_equal(b.float().numpy(), _bf16(vals[n - 1]))


# ---------------------------------------------------------------- buffers

def check_buffers(device):
    """broadcast_buffers=True broadcasts rank 0's buffers when torch DDP does (its
    require_forward_param_sync): before the first forward, and before every forward that
    follows a synchronised one (gradients on, not under no_sync), whatever that forward is."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    torch.manual_seed(r)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5)).double().to(device)
    model = mt.DistributedDataParallel(m)
    stats = [torch.from_numpy(np.random.default_rng([q, 8]).standard_normal(5) + q) for q in range(n)]
    m.eval()  # eval: forward reads the running statistics and leaves them
    x = torch.randn(3, 4, dtype=torch.float64, device=device)
    # (how the forward runs, whether rank 0's statistics are there after it)
    seq = [("no_grad", True),    # the first forward
           ("no_grad", False),   # after one that synchronises nothing
           ("no_sync", False),
           ("sync", False),      # after a no_sync forward
           ("sync", True),       # after a synchronised one
           ("no_sync", True),    # the first micro-step of an accumulation
           ("sync", False),
           ("no_grad", True)]    # an evaluation right after a training step
    for how, from_0 in seq:
        with torch.no_grad():
            m[1].running_mean.copy_(stats[r])
        with torch.no_grad() if how == "no_grad" else model.no_sync() if how == "no_sync" \
                else contextlib.nullcontext():
            model(x)
        torch.testing.assert_close(m[1].running_mean.cpu(), stats[0] if from_0 else stats[r], rtol=0, atol=0,
                                   msg=lambda s, how=how: f"{how} forward in {seq}: {s}")
    assert int(m[1].num_batches_tracked) == 0
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5)).double().to(device)
    with torch.no_grad():
        m2[1].running_mean.copy_(stats[r])
    model2 = mt.DistributedDataParallel(m2, broadcast_buffers=False)
    m2.eval()
    torch.testing.assert_close(m2[1].running_mean.cpu(), stats[0], rtol=0, atol=0)  # at construction
    with torch.no_grad():
        m2[1].running_mean.copy_(stats[r])
    model2(x)
    torch.testing.assert_close(m2[1].running_mean.cpu(), stats[r], rtol=0, atol=0)


def test_buffers_from_rank_0(comm):
    check_buffers("cpu")


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw, msg", [
    (dict(module="net"), r"invalid module=<str>.*expected a torch.nn.Module"),
    (dict(find_unused_parameters="yes"), r"invalid find_unused_parameters='yes'.*expected True or False"),
    (dict(broadcast_buffers=1), r"invalid broadcast_buffers=1.*expected True or False"),
    (dict(gradients_mean=None), r"invalid gradients_mean=None.*expected True or False"),
    (dict(compression="int8"), r"compression='int8'.*None, 'fp16' or 'bf16'"),
    (dict(bucket_cap_mb=-1), r"bucket_cap_mb=-1.*a number of MiB >= 0"),
    (dict(embedding_grads="sparse"), r"invalid embedding_grads='sparse'.*'auto' \(gather a step's rows "
     r"when the group's ids are no more than the table's rows\), 'all_gather' or 'all_reduce'"),
])
def test_bad_arguments_raise_on_every_rank(comm, kw, msg):
    module = kw.pop("module", None) or Net(seed=1)
    with pytest.raises(InvalidArgumentError, match=msg):
        mt.DistributedDataParallel(module, **kw)


def test_a_name_of_the_wrapped_model_says_where_it_is(comm):
    """OneFlow's tutorial reads m.lr on the wrapped model: the AttributeError says .module.lr;
    the model's parameters and submodules stay reachable as in PyTorch's DDP (m.module.w)."""
    net = Net(seed=3)
    net.lr = 0.125
    m = mt.DistributedDataParallel(net)
    assert m.module.lr == 0.125 and m.module is net
    with pytest.raises(AttributeError, match=r"no attribute 'lr'; the wrapped model has it: write \.module\.lr"):
        m.lr
    with pytest.raises(AttributeError, match=r"no attribute 'nothing_here'$"):
        m.nothing_here
    assert not hasattr(m, "lr") and getattr(m, "lr", None) is None


def test_models_that_differ_raise_on_every_rank(comm):
    n, r = comm.get_group_size(), comm.get_rank()
    if n == 1:
        pytest.skip("needs 2 ranks or more (one model cannot differ from itself)")
    m = torch.nn.Linear(4, 3 if r == 0 else 2).double()
    with pytest.raises(InvalidArgumentError, match=r"invalid module=.*weight is \(\(2, 4\), 'torch.float64'\) "
                       r"on rank 1.*the same model on every rank \(rank 0 has parameter weight \(\(3, 4\)"):
        mt.DistributedDataParallel(m)


def test_import_mpicomm_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, mpicomm; mpicomm.DistributedGradReducer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- init_process_group

def test_init_process_group_agrees_with_mpicomm(comm):
    import os

    import torch.distributed as dist

    n, r = comm.get_group_size(), comm.get_rank()
    with pytest.raises(InvalidArgumentError, match=r"invalid backend=3.*'nccl' or 'gloo'"):
        mt.init_process_group(3)
    with pytest.raises(InvalidArgumentError, match=r"invalid timeout=-1.*seconds > 0"):
        mt.init_process_group(timeout=-1)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    assert mt.init_process_group(timeout=120) == backend
    assert (dist.get_rank(), dist.get_world_size()) == (r, n)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(r), str(n))
    assert int(os.environ["LOCAL_RANK"]) == comm.get_local_rank()
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == comm.get_local_size()
    vals = [torch.from_numpy(np.random.default_rng([q, 4]).standard_normal(11)) for q in range(n)]
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    t = vals[r].clone().to(dev)
    dist.all_reduce(t)
    torch.testing.assert_close(t, mpicomm.all_reduce(vals[r].to(dev)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t.cpu(), sum(vals), rtol=1e-12, atol=1e-12)
    assert mt.init_process_group() == backend  # again: nothing happens


# ---------------------------------------------------------------- the reducer's fused path on tensors

@pytest.mark.parametrize("mode", ["call", "reduce_"])
@pytest.mark.parametrize("cap", [25.0, 0, 300 / 2 ** 20])
def test_reducer_on_cpu_tensors(comm, mode, cap):
    n, r = comm.get_group_size(), comm.get_rank()
    shapes = [(6, 5), (5,), (5, 4, 3), (4,), (3, 2), (7,)]

    def grads(q):
        g = np.random.default_rng([q, 12])
        return [torch.from_numpy(g.standard_normal(s)) for s in shapes]

    mine = grads(r)
    red = mpicomm.DistributedGradReducer([torch.zeros(s, dtype=torch.float64) for s in shapes], mean=True,
                                         bucket_cap_mb=cap)
    given = [g.clone() for g in mine]
    out = red(given) if mode == "call" else red.reduce_(given)
    for k in range(len(shapes)):
        want = sum(grads(q)[k] for q in range(n)) / n
        torch.testing.assert_close(out[k], want, rtol=1e-12, atol=1e-12)
        if mode == "call":
            torch.testing.assert_close(given[k], mine[k], rtol=0, atol=0)  # left as it was
        else:
            assert out[k] is given[k]


# ---------------------------------------------------------------- buckets in ready order

class HeadFirst(torch.nn.Module):
    """Registers its last layer first: reverse registration order is not backward's order."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.head = torch.nn.Linear(6, 3).double()
        self.body = torch.nn.Linear(5, 6).double()

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def check_buckets_follow_ready_order(device):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = HeadFirst(seed=4).to(device)
    model = mt.DistributedDataParallel(m, bucket_cap_mb=0)
    names = model.parameter_names
    assert names == ["head.weight", "head.bias", "body.weight", "body.bias"]
    assert model.buckets == [[3], [2], [1], [0]]  # reverse registration: body first
    seen = []
    # when backward reaches the body (its output's gradient is computed, its own not yet)
    m.body.register_forward_hook(lambda mod, a, out: out.register_hook(
        lambda g: seen.append(model.buckets_started)) and None)
    ref = HeadFirst(seed=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(77)
    xs = torch.randn(3, n, 4, 5, generator=g, dtype=torch.float64)
    for k in range(3):
        opt.zero_grad()
        model(xs[k, r].to(device)).square().sum().backward()
        opt.step()
        ref_opt.zero_grad()
        sum(ref(xs[k, q]).square().sum() for q in range(n)).div(n).backward()
        ref_opt.step()
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
            assert p.grad.data_ptr() == model._views[names.index(nm)].data_ptr()
    if n == 1:
        assert model.buckets == [[3], [2], [1], [0]] and seen == [0, 0, 0]
        return
    # after the first backward: the head's gradients (ready first) are the first buckets
    assert sorted(model.buckets[:2]) == [[0], [1]] and sorted(model.buckets[2:]) == [[2], [3]]
    # first step: the head's buckets waited for the body's; then they start before the body's backward
    assert seen[0] == 0 and seen[1] >= 2 and seen[2] >= 2, seen


def test_buckets_follow_ready_order(comm):
    check_buckets_follow_ready_order("cpu")


def test_plan_buckets_in_a_given_order():
    from mpicomm.training.planner import plan_buckets

    nb = [100, 200, 300, 400, 500]
    assert plan_buckets(nb, bucket_cap_mb=0) == [[4], [3], [2], [1], [0]]
    assert plan_buckets(nb, bucket_cap_mb=0, order=[0, 4, 2, 1, 3]) == [[0], [4], [2], [1], [3]]
    cap = 600 / 2 ** 20
    # greedy in the order: 0+4 fill the cap; 2+1 (500), 3 would pass it; 3 alone
    assert plan_buckets(nb, bucket_cap_mb=cap, order=[0, 4, 2, 1, 3]) == [[0, 4], [1, 2], [3]]
    assert plan_buckets(nb, bucket_cap_mb=cap) == [[4], [3], [0, 1, 2]]
    # a fusion_config's split points stay in registration order
    assert plan_buckets(nb, fusion_config=[1], order=[0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]
    for bad in ([0, 1, 2], [0, 1, 2, 3, 3], [0, 1, 2, 3, 5]):
        with pytest.raises(InvalidArgumentError, match=r"invalid order=.*every gradient index 0..4 once"):
            plan_buckets(nb, bucket_cap_mb=0, order=bad)


# ---------------------------------------------------------------- embedding gradients gathered

class TiedLM(torch.nn.Module):
    """A tied token table (lookup and output head), a position table and a layer between."""

    V, T, D = 40, 4, 6

    def __init__(self, seed, untied_pos=True):
        super().__init__()
        torch.manual_seed(seed)
        self.tok = torch.nn.Embedding(self.V, self.D, padding_idx=3).double()
        self.pos = torch.nn.Embedding(self.T, self.D).double()
        self.mid = torch.nn.Linear(self.D, self.D).double()

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.mid(torch.tanh(h)) @ self.tok.weight.t()


@pytest.fixture
def small_tables(monkeypatch):
    """embedding_grads="auto" considers tables of any size (4 MiB and up by default)."""
    from mpicomm.torch import _embedding

    monkeypatch.setattr(_embedding, "AUTO_MIN_TABLE_BYTES", 0)


def lm_batch(q, k, device="cpu"):
    """Rank q's batch of step k: 1 + q sequences (uneven over the ranks), padding ids included."""
    g = torch.Generator().manual_seed(900 + 17 * q + k)
    x = torch.randint(0, TiedLM.V, (1 + q, TiedLM.T), generator=g)
    x[0, 0] = 3
    return x.to(device), torch.randint(0, TiedLM.V, (1 + q, TiedLM.T), generator=g).to(device)


def _lm_loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")


def check_embedding_grads(device, mode, zero_to_none=True, accumulate=False):
    """The wrapper's gradients equal the mean over ranks of each rank's local gradient
    (computed here in one process), step after step, in every embedding_grads mode."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    m = TiedLM(seed=21 + r).to(device)
    model = mt.DistributedDataParallel(m, embedding_grads=mode, bucket_cap_mb=0)
    seen = []
    m.tok.register_forward_hook(lambda mod, a, out: seen.append(type(out.grad_fn).__name__))
    ref = TiedLM(seed=21)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for k in range(4):
        opt.zero_grad(set_to_none=zero_to_none)
        ref_opt.zero_grad()
        if accumulate:  # a micro-batch without synchronisation first
            with model.no_sync():
                _lm_loss(model, *lm_batch(r, 10 + k, device)).backward()
            sum(_lm_loss(ref, *lm_batch(q, 10 + k)) for q in range(n)).div(n).backward()
        _lm_loss(model, *lm_batch(r, k, device)).backward()
        sum(_lm_loss(ref, *lm_batch(q, k)) for q in range(n)).div(n).backward()
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-10, atol=1e-11, msg=f"step {k} {nm}")
        assert float(ref.tok.weight.grad[3].abs().max()) > 0  # the head's part of the padding row
        opt.step()
        ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-10, atol=1e-11)
    return model, [s for s in seen]


def _gathered(seen):
    return ["Cut" in s for s in seen]


@pytest.mark.parametrize("mode", ["auto", "all_gather", "all_reduce"])
@pytest.mark.parametrize("zero_to_none", [True, False])
def test_embedding_grads(comm, small_tables, mode, zero_to_none):
    n = comm.get_group_size()
    model, seen = check_embedding_grads("cpu", mode, zero_to_none)
    # auto: the group's ids (4 per sequence, n(n+1)/2 sequences) against the table's 40 rows
    gather = n > 1 and (mode == "all_gather" or (mode == "auto" and 4 * n * (n + 1) // 2 <= TiedLM.V))
    assert _gathered(seen) == [gather] * 4, seen
    # the untied position table got no gradient but its gathered rows: dense from step 2
    assert model._emb.dense == ({1} if n > 1 and mode == "all_gather" else set())
    if gather:  # the tied table's bucket (ready at the head, first in backward) goes first
        assert model.buckets[0] == [model.parameter_names.index("tok.weight")]


def test_embedding_grads_with_no_sync(comm):
    n = comm.get_group_size()
    model, seen = check_embedding_grads("cpu", "all_gather", accumulate=True)
    # the no_sync forwards look up densely (local accumulation), the synchronised ones gather
    assert _gathered(seen) == [False, n > 1] * 4, seen


@pytest.mark.parametrize("why", ["many_ids", "small_table"])
def test_embedding_grads_auto_stays_dense(comm, monkeypatch, why):
    """More ids in the group than rows in the table, or a table under 4 MiB: auto
    all-reduces the dense gradient."""
    n, r = comm.get_group_size(), comm.get_rank()
    if why == "many_ids":
        from mpicomm.torch import _embedding

        monkeypatch.setattr(_embedding, "AUTO_MIN_TABLE_BYTES", 0)
    m = TiedLM(seed=5)
    model = mt.DistributedDataParallel(m)
    seen = []
    m.tok.register_forward_hook(lambda mod, a, out: seen.append(type(out.grad_fn).__name__))
    rows = 11 if why == "many_ids" else 1  # 44 ids a rank against 40 rows
    x = torch.randint(0, TiedLM.V, (rows, TiedLM.T), generator=torch.Generator().manual_seed(r))
    model(x).sum().backward()
    assert seen == ["EmbeddingBackward0"], seen
    ref = TiedLM(seed=5)
    sum(ref(torch.randint(0, TiedLM.V, (rows, TiedLM.T), generator=torch.Generator().manual_seed(q))).sum()
        for q in range(n)).div(n).backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-11)
    assert len(model._emb.handles) == (0 if why == "small_table" or n == 1 else 2)  # tok and pos


# ---------------------------------------------------------------- frozen and tied parameters

class Tied(torch.nn.Module):
    """An embedding used twice (input and tied output head) and a frozen layer between."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(7, 4).double()
        self.frozen = torch.nn.Linear(4, 4).double().requires_grad_(False)
        self.mid = torch.nn.Linear(4, 4).double()

    def forward(self, idx):
        return self.mid(torch.tanh(self.frozen(self.emb(idx)))) @ self.emb.weight.t()


def test_frozen_and_tied_parameters(comm):
    n, r = comm.get_group_size(), comm.get_rank()
    m = Tied(seed=50 + r)
    model = mt.DistributedDataParallel(m)
    assert model.parameter_names == ["emb.weight", "mid.weight", "mid.bias"]  # tied once, frozen out
    ref = Tied(seed=50)
    for p, q in zip(m.parameters(), ref.parameters()):  # frozen ones too: rank 0's
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)

    def batch(q):
        g = torch.Generator().manual_seed(600 + q)
        return torch.randint(0, 7, (5, 3), generator=g), torch.randint(0, 7, (5, 3), generator=g)

    x, y = batch(r)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    sums = [torch.zeros_like(p) for p in ref.parameters() if p.requires_grad]
    for q in range(n):
        local = Tied(seed=50)
        xq, yq = batch(q)
        torch.nn.functional.cross_entropy(local(xq).flatten(0, 1), yq.flatten()).backward()
        for s, p in zip(sums, [p for p in local.parameters() if p.requires_grad]):
            s += p.grad
    for s, p in zip(sums, [p for p in m.parameters() if p.requires_grad]):
        torch.testing.assert_close(p.grad, s / n, rtol=1e-12, atol=1e-12)
    assert m.frozen.weight.grad is None
