"""DistributedDataParallel(..., optimizer=opt, overlap_step=True): each bucket's optimizer
update applied as its reduction lands, on CPU tensors over MPI.

Every rank trains on its own slice of a seeded global batch (rank-dependent data). The
overlapped step must give exactly the parameters (and optimizer state) of the same wrapper
with ``optimizer.step()`` after the reduction (the same reduction, the same update
arithmetic), match one process on the global batch to rounding, and leave the same
parameters on every rank. test_gpu_torch.py calls the ``check_*`` functions with
device="cuda". The reducer's bucket hook is checked against sums computed here."""
import numpy as np
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm import InvalidArgumentError  # noqa: E402
from mpicomm.training import DistributedGradReducer  # noqa: E402
from test_torch import K, Net, global_data, my_slice  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def _cpu_tensors_need_mpi(request):
    if "comm" in request.fixturenames and request.getfixturevalue("comm").get_backend() != "mpi":
        pytest.skip("CPU tensors need the MPI backend: run with MPICOMM_BACKEND=mpi")


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.95), weight_decay=0.05),
    # two param groups with their own options (the biases without weight decay)
    "adamw_groups": lambda ps: torch.optim.AdamW(
        [{"params": [p for p in ps if p.dim() > 1]}, {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0,
                                                      "lr": 0.02}], lr=0.01, weight_decay=0.05),
}
PLANS = {"per_tensor": {"bucket_cap_mb": 0}, "small": {"bucket_cap_mb": 600 / 2 ** 20}, "one": {"bucket_cap_mb": None}}


def loss_of(model, x, y, device):
    return torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))


def check_overlapped_equals_unfused(device, which, plan_kw, zero_to_none=True, steps=K):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    make = OPTIMIZERS[which]
    # the overlapped wrapper and the unfused one, both from rank 0's model (each rank starts
    # from a different one: the wrappers take rank 0's)
    a = Net(seed=300 + r).to(device)
    opt_a = make(list(a.parameters()))
    ddp_a = mt.DistributedDataParallel(a, optimizer=opt_a, overlap_step=True, **plan_kw)
    b = Net(seed=300 + r).to(device)
    opt_b = make(list(b.parameters()))
    ddp_b = mt.DistributedDataParallel(b, **plan_kw)
    ref = Net(seed=300)   # one process on the global batch (the same on every rank)
    opt_r = make(list(ref.parameters()))
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt_a, opt_b, opt_r)]
    x, y = global_data(seed=17 + len(which), steps=steps)
    s = my_slice(n, r)
    for k in range(steps):
        opt_a.zero_grad(set_to_none=zero_to_none)
        loss_of(ddp_a, x[k, s], y[k, s], device).backward()   # the update is applied here
        opt_b.zero_grad(set_to_none=zero_to_none)
        loss_of(ddp_b, x[k, s], y[k, s], device).backward()
        opt_b.step()
        opt_r.zero_grad()
        loss_of(ref, x[k], y[k], "cpu").backward()
        opt_r.step()
        for sc in sched:
            sc.step()
    for (name, p), q, t in zip(a.named_parameters(), b.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), (name, (p - q).abs().max())
        torch.testing.assert_close(p.detach().cpu(), t.detach(), rtol=1e-9, atol=1e-12, msg=name)
        assert not torch.equal(p.detach().cpu(), Net(seed=300).state_dict()[name]), name   # it trained
        sa, sb = opt_a.state[p], opt_b.state[q]   # the optimizer's own state, the same
        assert sorted(sa) == sorted(sb), name
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (name, key)
    # the same parameters on every rank
    flat = torch.cat([p.detach().cpu().reshape(-1) for p in a.parameters()]).numpy()
    every = mpicomm.all_gather(flat[None])
    assert all(np.array_equal(every[0], every[q]) for q in range(n))
    with pytest.raises(InvalidArgumentError, match=r"step\(\) on the optimizer given to DistributedDataParallel"):
        opt_a.step()
    return ddp_a


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("which", list(OPTIMIZERS))
# (the user's optimizer.step() is never called with overlap_step: its LR scheduler warns so,
# and its schedule is followed all the same, as the comparison shows)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_overlapped_step_equals_the_unfused_step(comm, which, plan):
    check_overlapped_equals_unfused("cpu", which, PLANS[plan], zero_to_none=(plan != "small"))


def test_overlapped_step_after_no_sync(comm):
    """Two micro-batches accumulated in no_sync, then a synchronised one: one update, of
    the reduced sum, as the unfused step's."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    a, b = Net(seed=40).double(), Net(seed=40).double()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    ddp_a = mt.DistributedDataParallel(a, optimizer=opt_a, overlap_step=True, bucket_cap_mb=0)
    ddp_b = mt.DistributedDataParallel(b, bucket_cap_mb=0)
    x, y = global_data(seed=5, steps=6)
    s = my_slice(n, r)
    for ddp, opt, unfused in ((ddp_a, opt_a, False), (ddp_b, opt_b, True)):
        for k in range(0, 6, 3):
            opt.zero_grad()
            start = [p.detach().clone() for p in ddp.parameters()]
            with ddp.no_sync():
                loss_of(ddp, x[k, s], y[k, s], "cpu").backward()
                loss_of(ddp, x[k + 1, s], y[k + 1, s], "cpu").backward()
            assert all(torch.equal(p, q) for p, q in zip(start, ddp.parameters()))   # nothing applied yet
            loss_of(ddp, x[k + 2, s], y[k + 2, s], "cpu").backward()
            if unfused:
                opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_overlapped_step_takes_a_bucket_in_any_order(comm):
    """The reducer hands the bucket hook a bucket's indices in its buffer's order (on GPUs big
    directly reduced gradients come last), not the plan's: the overlapped step updates the
    bucket whatever the order (a lost update made it differ on GPUs), and a bucket it has no
    plan for is an error, never a silently skipped update."""
    r = mpicomm.get_rank()
    a, b = Net(seed=60), Net(seed=60)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    ddp = mt.DistributedDataParallel(a, optimizer=opt_a, overlap_step=True, bucket_cap_mb=None)
    (bucket,) = ddp.buckets
    g = torch.Generator().manual_seed(70 + r)
    for p, q in zip(a.parameters(), b.parameters()):
        q.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        p.grad = q.grad.clone()
    ddp._overlap(list(reversed(bucket)), None)   # (the reducer's hook call)
    opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert not torch.equal(p, Net(seed=60).state_dict()[[n for n, x in b.named_parameters() if x is q][0]])
    with pytest.raises(RuntimeError, match="no optimizer for"):
        ddp._overlap([len(bucket) + 5], None)


def test_reducer_bucket_hook_sees_each_bucket_reduced(comm, rng):
    """set_bucket_hook: called once per bucket of a mark_ready() step, with the bucket's
    indices, when its views hold the reduced sums (computed here from every rank's seeded
    gradients); never in a blocking step."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    shapes = [(5, 3), (7,), (2, 2, 2), (11,), (4, 4)]
    params = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    red = DistributedGradReducer(params, mean=False, bucket_cap_mb=100 / 2 ** 20)
    assert len(red.buckets) > 2, red.buckets
    views = red.grad_views()
    seen = []
    red.set_bucket_hook(lambda idx, stream: seen.append((list(idx), stream, [views[i].clone() for i in idx])))

    def grads(q, step):
        g = torch.Generator().manual_seed(1000 * step + q)
        return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    for step in range(3):
        mine = grads(r, step)
        want = [sum(gs) for gs in zip(*[grads(q, step) for q in range(n)])]
        seen.clear()
        for i in reversed(range(len(shapes))):
            red.mark_ready(i, mine[i])
        red.wait()
        assert sorted(i for idx, _, _ in seen for i in idx) == list(range(len(shapes))), seen
        assert sorted(tuple(idx) for idx, _, _ in seen) == sorted(tuple(b) for b in red.buckets)
        for idx, stream, vals in seen:
            assert stream is None
            for i, v in zip(idx, vals):
                torch.testing.assert_close(v, want[i], rtol=1e-12, atol=1e-12)
    seen.clear()
    red.reduce_([g.clone() for g in grads(r, 9)])
    assert seen == []
    with pytest.raises(InvalidArgumentError, match=r"invalid hook=<int>.*a callable hook\(indices, stream\), or None"):
        red.set_bucket_hook(3)
    red.set_bucket_hook(None)


@pytest.mark.parametrize("kw, msg", [
    ({"overlap_step": "yes"}, r"invalid overlap_step='yes'.*True or False"),
    ({"overlap_step": True}, r"invalid optimizer=None.*when overlap_step=True"),
    ({"optimizer": "sgd"}, r"invalid overlap_step=False.*True when optimizer= is given"),
    ({"optimizer": "other", "overlap_step": True}, r"invalid optimizer=.*does not reduce"),
    ({"optimizer": "lbfgs", "overlap_step": True}, r"invalid optimizer='LBFGS'.*torch.optim.SGD, torch.optim.Adam"),
    ({"optimizer": 3, "overlap_step": True}, r"invalid optimizer=<int>.*torch.optim.Optimizer"),
    ({"optimizer": "sgd", "overlap_step": True, "embedding_grads": "all_gather"},
     r"invalid embedding_grads='all_gather'.*'auto' or 'all_reduce' with overlap_step=True"),
])
def test_bad_overlap_arguments_raise_on_every_rank(comm, kw, msg):
    m = Net(seed=1)
    opts = {"sgd": lambda: torch.optim.SGD(m.parameters(), lr=0.1),
            "other": lambda: torch.optim.SGD(list(m.parameters()) + [torch.nn.Parameter(torch.zeros(3))], lr=0.1),
            "lbfgs": lambda: torch.optim.LBFGS(m.parameters())}
    kw = dict(kw)
    if isinstance(kw.get("optimizer"), str):
        kw["optimizer"] = opts[kw["optimizer"]]()
    with pytest.raises(InvalidArgumentError, match=msg):
        mt.DistributedDataParallel(m, **kw)
    mpicomm.barrier()   # every rank raised before any collective: the group goes on
