"""mpicomm.torch.DistributedDataParallel on the kinds of models users bring from torch DDP:
branches that no rank or only some ranks use (find_unused_parameters), nn.Embedding with
sparse=True, a frozen layer in the optimizer of the overlapped step. Each is trained a few
steps and compared with one process computing the same loss (the mean of the ranks' losses)
on every rank's data: the parameters must be the same, and a parameter no rank used keeps
.grad None, as autograd and DDP leave it. A batch-norm model is compared with torch's own DDP
(gloo): parameters, buffers and an evaluation after training. CPU tensors in float64 over MPI."""
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402

pytestmark = pytest.mark.mpi

torch.set_num_threads(1)  # the ranks share two cores

D, B, STEPS = 6, 4, 4


@pytest.fixture(autouse=True)
def _cpu_tensors_need_mpi(request):
    if "comm" in request.fixturenames and request.getfixturevalue("comm").get_backend() != "mpi":
        pytest.skip("CPU tensors need the MPI backend: run with MPICOMM_BACKEND=mpi")


class Branches(torch.nn.Module):
    """A trunk every rank uses; ``sometimes``, used in even steps only (on every rank);
    ``rank0``, used by rank 0 only; ``never``, used by no rank."""

    def __init__(self, seed):
        super().__init__()
        self.trunk = torch.nn.Linear(D, D).double()
        self.sometimes = torch.nn.Linear(D, D).double()
        self.rank0 = torch.nn.Linear(D, D).double()
        self.never = torch.nn.Linear(D, D).double()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x, step, rank):
        h = torch.tanh(self.trunk(x))
        if step % 2 == 0:
            h = h + torch.tanh(self.sometimes(h))
        if rank == 0:
            h = h * torch.sigmoid(self.rank0(h))
        return h


def data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, D, generator=g, dtype=torch.float64)


def make_opt(which, params):
    if which == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap_step"])
@pytest.mark.parametrize("which", ["sgd", "adamw"])
def test_branches_no_rank_or_some_ranks_use(comm, which, overlap):
    """find_unused_parameters=True: a branch used by some ranks gets their gradient averaged
    over every rank (zeros from the others); a branch no rank used in a step keeps .grad None,
    so momentum and weight decay leave it alone there, as with DDP and in one process."""
    n, r = comm.get_group_size(), comm.get_rank()
    m = Branches(seed=10 + r)   # different on every rank: the wrapper takes rank 0's
    ref = Branches(seed=10)
    never0 = ref.never.weight.detach().clone()
    if overlap:
        opt = make_opt(which, m.parameters())
        model = mt.DistributedDataParallel(m, find_unused_parameters=True, optimizer=opt, overlap_step=True)
    else:
        model = mt.DistributedDataParallel(m, find_unused_parameters=True)
        opt = make_opt(which, model.parameters())
    ref_opt = make_opt(which, ref.parameters())
    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        x, y = data(k, r)
        torch.nn.functional.mse_loss(model(x, k, r), y).backward()
        sum(torch.nn.functional.mse_loss(ref(*data(k, q)[:1], k, q), data(k, q)[1]) for q in range(n)).div(n) \
            .backward()
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is None:   # no rank used it in this step
                assert p.grad is None, f"step {k}: {nm} has a gradient where no rank used it"
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
        if not overlap:
            opt.step()
        ref_opt.step()
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
    assert torch.equal(m.never.weight, never0) and m.never.weight.grad is None
    assert m.rank0.weight.grad is not None and float(m.rank0.weight.grad.abs().max()) > 0
    moved = float((m.sometimes.weight.detach() - Branches(seed=10).sometimes.weight.detach()).abs().max())
    assert moved > 1e-3   # (the comparison above can fail: the branch trains)


class SparseLM(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.emb = torch.nn.Embedding(50, D, sparse=True).double()
        self.head = torch.nn.Linear(D, 3).double()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("zero_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_sparse_embedding(comm, zero_to_none):
    """nn.Embedding(sparse=True): its sparse gradient is reduced as its dense values (every
    step, also after zero_grad(set_to_none=True), where autograd hands a new sparse tensor);
    the parameters follow one process's SGD with the sparse gradients."""
    n, r = comm.get_group_size(), comm.get_rank()
    m = SparseLM(seed=20 + r)
    ref = SparseLM(seed=20)
    model = mt.DistributedDataParallel(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

    def batch(k, q):
        g = torch.Generator().manual_seed(77 * k + q)
        return torch.randint(0, 50, (B, 5), generator=g), torch.randint(0, 3, (B,), generator=g)

    for k in range(STEPS):
        opt.zero_grad(set_to_none=zero_to_none)
        ref_opt.zero_grad(set_to_none=True)
        ids, y = batch(k, r)
        torch.nn.functional.cross_entropy(model(ids), y).backward()
        sum(torch.nn.functional.cross_entropy(ref(batch(k, q)[0]), batch(k, q)[1]) for q in range(n)).div(n) \
            .backward()
        assert ref.emb.weight.grad.is_sparse
        torch.testing.assert_close(m.emb.weight.grad, ref.emb.weight.grad.to_dense(), rtol=1e-10, atol=1e-12,
                                   msg=f"step {k}")
        opt.step()
        ref_opt.step()
    for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=nm)
    assert float((m.emb.weight.detach() - SparseLM(seed=20).emb.weight.detach()).abs().max()) > 1e-3


def test_overlapped_step_with_a_frozen_layer_in_the_optimizer(comm):
    """overlap_step=True with the usual SGD(model.parameters()) where a layer is frozen: the
    frozen parameters get no gradient and are skipped, as optimizer.step() skips them; the
    others follow one process."""
    n, r = comm.get_group_size(), comm.get_rank()

    def build(seed):
        b = Branches(seed)
        b.trunk.requires_grad_(False)
        return b

    m, ref = build(30 + r), build(30)
    frozen0 = ref.trunk.weight.detach().clone()
    opt = make_opt("sgd", m.parameters())   # the frozen trunk included
    model = mt.DistributedDataParallel(m, find_unused_parameters=True, optimizer=opt, overlap_step=True)
    ref_opt = make_opt("sgd", ref.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = data(k, r)   # (step 0's branches every step: a trainable one on every rank)
        torch.nn.functional.mse_loss(model(x, 0, r), y).backward()
        sum(torch.nn.functional.mse_loss(ref(*data(k, q)[:1], 0, q), data(k, q)[1]) for q in range(n)).div(n) \
            .backward()
        ref_opt.step()
    for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=nm)
    assert torch.equal(m.trunk.weight, frozen0) and m.trunk.weight.grad is None


def _train(model, opt, steps, r, start=0, stepped=True):
    for k in range(start, start + steps):
        opt.zero_grad()
        x, y = data(k, r)
        torch.nn.functional.mse_loss(model(x, 0, r), y).backward()
        if stepped:
            opt.step()


def _same(a, b):
    for (nm, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=nm)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_the_wrapper_trains_like_it(comm, how):
    """copy.deepcopy(wrapper) and torch.save/torch.load of the whole wrapper (on every rank):
    the copy reduces its own gradients (its hooks and buckets made again at its first
    training forward), so trained on the same data it stays equal to the original, and the
    same on every rank."""
    import copy
    import io

    r = comm.get_rank()
    m = Branches(seed=40 + r)
    model = mt.DistributedDataParallel(m, find_unused_parameters=True)
    opt = make_opt("sgd", model.parameters())
    _train(model, opt, 1, r)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert isinstance(twin, mt.DistributedDataParallel) and "a copy" in repr(twin)
    twin_opt = make_opt("sgd", twin.parameters())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # (loaded as is, its tensors would be shared)
    _train(model, opt, 2, r, start=1)
    _train(twin, twin_opt, 2, r, start=1)
    _same(twin.module, m)
    assert twin.parameter_names == model.parameter_names and twin.buckets == model.buckets
    # the same on every rank: rank 0's copy compared with every rank's
    mine = torch.cat([p.detach().flatten() for p in twin.parameters()])
    for other in mpicomm.all_gather_object(mine):
        assert torch.equal(other, mine)


def test_a_copy_with_the_overlapped_step(comm):
    """A copy of a wrapper with overlap_step=True carries a copy of the optimizer (its
    parameters the copy's): backward updates the copy's parameters only, as the original's."""
    import copy

    r = comm.get_rank()
    m = Branches(seed=50 + r)
    opt = make_opt("adamw", m.parameters())
    model = mt.DistributedDataParallel(m, find_unused_parameters=True, optimizer=opt, overlap_step=True)
    _train(model, opt, 1, r, stepped=False)
    twin = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    _train(twin, twin._ctor["optimizer"], 2, r, start=1, stepped=False)
    _train(model, opt, 2, r, start=1, stepped=False)
    _same(twin.module, m)
    assert any(not torch.equal(p, q) for p, q in zip(m.parameters(), before))


def test_one_rank_evaluates_a_copy_alone(comm):
    """A copy made and run on one rank only, with gradients off (evaluation, a kept best
    model): its module's forward, no collective, so the other ranks are not waited for."""
    import copy

    r = comm.get_rank()
    m = Branches(seed=60 + r)
    model = mt.DistributedDataParallel(m, find_unused_parameters=True)
    x, _ = data(0, r)
    if r == 0:
        twin = copy.deepcopy(model)
        twin.eval()
        with torch.no_grad():
            got = twin(x, 0, 0)
        torch.testing.assert_close(got, m(x, 0, 0).detach(), rtol=0, atol=0)
        assert twin.training is False and "a copy" in repr(twin)
    comm.barrier()


class Deep(torch.nn.Module):
    def __init__(self, seed, layers=12):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D).double() for _ in range(layers))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def test_new_gradients_are_copied_into_their_bucket_in_one_launch(comm):
    """After zero_grad(set_to_none=True) autograd hands every gradient as a tensor of its
    own; the wrapper copies a bucket's small ones in one multi-tensor copy as the bucket
    starts (one launch per bucket, where each copy would cost a launch on the training
    stream), and the gradients are one process's on every rank's data."""
    from torch.profiler import ProfilerActivity, profile

    n, r = comm.get_group_size(), comm.get_rank()
    m, ref = Deep(seed=70 + r), Deep(seed=70)
    model = mt.DistributedDataParallel(m, bucket_cap_mb=D * (D + 1) * 8 * 6 / 2 ** 20)   # 4 layers a bucket
    assert len(model.buckets) == 2
    for k in range(3):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x, y = data(k, r)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.nn.functional.mse_loss(model(x), y).backward()
        sum(torch.nn.functional.mse_loss(ref(data(k, q)[0]), data(k, q)[1]) for q in range(n)).div(n).backward()
        evs = prof.events()
        assert [e.name for e in evs].count("aten::_foreach_copy_") == 2, sorted({e.name for e in evs})

        # no copy of its own per gradient (copy_ called by itself; on the CPU the multi-tensor
        # copy and addmm run copy_ inside them)
        alone = [e for e in evs if e.name == "aten::copy_" and e.cpu_parent is None]
        assert not alone, len(alone)
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
            assert p.grad.data_ptr() == model._views[model.parameter_names.index(nm)].data_ptr()


class Layers(torch.nn.Module):
    """Four residual layers; which ones a forward goes through is given to it (``use``)."""

    NAMES = ("l0", "l1", "l2", "l3")

    def __init__(self, seed):
        super().__init__()
        for nm in self.NAMES:
            setattr(self, nm, torch.nn.Linear(D, D).double())
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x, use):
        for nm in self.NAMES:
            if nm in use:
                x = x + torch.tanh(getattr(self, nm)(x))
        return x


def synced_use(k, q):
    """The layers rank ``q`` uses in step ``k``'s synchronised backward: in even steps rank 0
    uses every layer (it misses no parameter, the others miss some); l1 alternates between the
    ranks; l2 is rank 0's only (the others use none of it); l3 is rank 0's in even steps and
    no rank's in odd steps."""
    use = {"l0"}
    if (q + k) % 2 == 0:
        use.add("l1")
    if q == 0:
        use.add("l2")
        if k % 2 == 0:
            use.add("l3")
    return use


def local_use(k, q):
    """The layers rank ``q`` uses in the micro-batch accumulated under no_sync() before step
    ``k``'s synchronised one: rank 0 also goes through l3 (which in odd steps no rank uses in
    the synchronised backward: rank 0's accumulated gradient must still be reduced, everywhere)."""
    return {"l0", "l3"} if q == 0 else {"l0"}


@pytest.mark.parametrize("accumulate", [False, True], ids=["", "no_sync"])
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap_step"])
@pytest.mark.parametrize("cap", [0, D * (D + 1) * 8 * 1.5 / 2 ** 20, 25.0], ids=["cap0", "cap2", "cap25"])
def test_ranks_that_miss_different_parameters(comm, cap, overlap, accumulate):
    """find_unused_parameters=True where the ranks differ in which parameters get no gradient,
    one rank missing none (Horovod's test_force_allreduce): every rank's step completes, in
    every bucket plan; a parameter some rank used gets the average over the ranks (zeros from
    the others); one no rank used keeps .grad None (and AdamW's weight decay leaves it alone),
    as DDP; with no_sync(), a gradient accumulated there counts as used (DDP's local_used_map).
    Compared with one process over every rank's batch; the same parameters on every rank."""
    n, r = comm.get_group_size(), comm.get_rank()
    m, ref = Layers(seed=80 + r), Layers(seed=80)
    if overlap:
        opt = make_opt("adamw", m.parameters())
        model = mt.DistributedDataParallel(m, find_unused_parameters=True, bucket_cap_mb=cap, optimizer=opt,
                                           overlap_step=True)
    else:
        model = mt.DistributedDataParallel(m, find_unused_parameters=True, bucket_cap_mb=cap)
        opt = make_opt("adamw", model.parameters())
    ref_opt = make_opt("adamw", ref.parameters())

    def batch(k, q, micro):
        g = torch.Generator().manual_seed(7919 * k + 31 * q + micro)
        return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, D, generator=g,
                                                                                 dtype=torch.float64)

    def loss(net, k, q, micro, use):
        x, y = batch(k, q, micro)
        return torch.nn.functional.mse_loss(net(x, use), y)

    for k in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        total = 0
        if accumulate:
            with model.no_sync():
                loss(model, k, r, 1, local_use(k, r)).backward()
            total = sum(loss(ref, k, q, 1, local_use(k, q)) for q in range(n))
        loss(model, k, r, 0, synced_use(k, r)).backward()
        (total + sum(loss(ref, k, q, 0, synced_use(k, q)) for q in range(n))).div(n).backward()
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            if q.grad is None:   # no rank used it in this step
                assert p.grad is None, f"step {k}: {nm} has a gradient where no rank used it"
            else:
                assert p.grad is not None, f"step {k}: {nm} has no gradient where some rank used it"
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
        if not overlap:
            opt.step()
        ref_opt.step()
        for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
        mine = torch.cat([p.detach().flatten() for p in m.parameters()])
        for q, other in enumerate(mpicomm.all_gather_object(mine)):
            assert torch.equal(other, mine), f"step {k}: rank {q}'s parameters differ from rank {r}'s"
    # (the comparisons above can fail: the layers some rank uses train, the rest stays put)
    start = Layers(seed=80)
    assert float((m.l2.weight.detach() - start.l2.weight.detach()).abs().max()) > 1e-3


class ConvBN(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = torch.nn.Conv2d(2, 4, 3).double()
        self.bn = torch.nn.BatchNorm2d(4).double()
        self.head = torch.nn.Linear(4 * 4 * 4, 3).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_batch_norm_buffers_as_torch_ddp(comm, accumulate):
    """Against torch's own DDP over gloo, on the same data (rank-dependent): a batch-norm model
    trained 3 steps (with 2 micro-steps, the first under no_sync, where accumulating) and then
    evaluated under torch.no_grad(). DDP broadcasts rank 0's buffers before the forward that
    follows a synchronised one, whatever it is (the first micro-step, the evaluation): the
    parameters, the running statistics on every rank and the evaluation's output must be
    DDP's (float64: only the summation order may differ)."""
    r = comm.get_rank()
    mt.init_process_group(timeout=120)

    def run(wrap):
        m = ConvBN(seed=20 + r)   # different on every rank: both wrappers take rank 0's
        model = wrap(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for k in range(3):
            g = torch.Generator().manual_seed(100 * k + r)
            xs = [torch.randn(4, 2, 6, 6, generator=g, dtype=torch.float64) * (1 + r) + r for _ in range(2)]
            if accumulate:
                with model.no_sync():
                    model(xs[0]).pow(2).mean().backward()
            model(xs[1]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            out = model(torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(9 + r), dtype=torch.float64))
        return out, m.state_dict()

    out, sd = run(mt.DistributedDataParallel)
    want_out, want_sd = run(torch.nn.parallel.DistributedDataParallel)
    assert list(sd) == list(want_sd)
    for k in sd:
        torch.testing.assert_close(sd[k], want_sd[k], rtol=1e-10, atol=1e-12, msg=f"{k} on rank {r}")
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    assert int(sd["bn.num_batches_tracked"]) == 3 * (1 + accumulate)
