"""mpicomm.torch.DistributedDataParallel against torch's own DDP (gloo, in the same job) where
torch DDP scripts use more than the forward/backward: ``join()`` for uneven inputs,
``register_comm_hook`` with torch's default hooks, and the refusal of a model with nothing to
train. Each rank's data is random, seeded by its rank; torch DDP over gloo computes the
expectation from the same data. CPU tensors over MPI (float64 where the values must agree to
summation order, float32 for the half-precision hooks)."""
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm.errors import InputsExhaustedError, InvalidArgumentError, RefusedElsewhereError  # noqa: E402

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


# ------------------------------------------------------------------ join()

class ConvBN(torch.nn.Module):
    def __init__(self, seed, dtype=torch.float64):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.head = torch.nn.Linear(3 * 4 * 4, 3)
        seeded(self, seed, dtype)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def count(r):
    return 3 + r   # rank r has 3 + r batches: uneven at every rank count above 1


def train_uneven(wrap, kind, r, accumulate=False, join_kw=None, overlap=False):
    m = (MLP if kind == "mlp" else ConvBN)(seed=40 + r)   # different per rank: both wrappers take rank 0's
    if overlap:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        model = wrap(m, optimizer=opt, overlap_step=True)
    else:
        model = wrap(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join(**(join_kw or {})):
        for k in range(count(r)):
            opt.zero_grad()
            if accumulate:
                with model.no_sync():
                    model(batch(kind, k, r, 1)).pow(2).mean().backward()
            model(batch(kind, k, r)).pow(2).mean().backward()
            if not overlap:
                opt.step()
    return m


def reference(kind, n, divide, accumulate):
    """The same training in one process, from rank 0's model: step k averages the losses of
    the ranks that still have batch k, divided by n (divide_by_initial_world_size=True) or by
    how many ranks that is (False). Batch norm's running statistics are left to the torch
    DDP comparison."""
    ref = MLP(seed=40)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for k in range(count(n - 1)):
        live = [q for q in range(n) if k < count(q)]
        opt.zero_grad()
        total = 0
        for q in live:
            total = total + ref(batch(kind, k, q)).pow(2).mean()
            if accumulate:
                total = total + ref(batch(kind, k, q, 1)).pow(2).mean()
        (total / (n if divide else len(live))).backward()
        opt.step()
    return ref


@pytest.mark.parametrize("divide", [True, False], ids=["divide_initial", "divide_live"])
@pytest.mark.parametrize("kind", ["mlp", "bn"])
def test_join_uneven_inputs_as_torch_ddp(comm, torch_dist, kind, divide):
    """Rank r trains 3 + r batches inside join(): the parameters (and batch norm's buffers) on
    every rank after the block are torch DDP's with the same join() (float64: only the
    summation order may differ), and, for the MLP, one process's on the same batches."""
    n, r = comm.get_group_size(), comm.get_rank()
    kw = dict(divide_by_initial_world_size=divide)
    got = train_uneven(mt.DistributedDataParallel, kind, r, join_kw=kw)
    want = train_uneven(torch.nn.parallel.DistributedDataParallel, kind, r, join_kw=kw)
    sd, want_sd = got.state_dict(), want.state_dict()
    assert list(sd) == list(want_sd)
    for k in sd:
        torch.testing.assert_close(sd[k], want_sd[k], rtol=1e-10, atol=1e-12, msg=f"{k} on rank {r}")
    if kind == "mlp":
        for (nm, p), q in zip(got.named_parameters(), reference(kind, n, divide, False).parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=f"{nm} on rank {r}")
    mine = torch.cat([t.flatten().double() for t in sd.values()])
    for q, other in enumerate(mpicomm.all_gather_object(mine)):
        assert torch.equal(other, mine), f"rank {q}'s model differs from rank {r}'s after join()"
    # (the comparisons can fail: the model trains)
    start = (MLP if kind == "mlp" else ConvBN)(seed=40).state_dict()
    assert max(float((sd[k].double() - start[k].double()).abs().max()) for k in sd) > 1e-2


@pytest.mark.parametrize("how", ["no_sync", "overlap_step", "unused"])
def test_join_with_accumulation_overlap_and_unused(comm, how):
    """join() with gradient accumulation (a no_sync micro-step before each synchronised one),
    with the optimizer applied in backward (overlap_step=True), and with
    find_unused_parameters=True: against one process on the same batches (MLP, float64)."""
    n, r = comm.get_group_size(), comm.get_rank()
    if how == "unused":
        wrap = lambda m: mt.DistributedDataParallel(m, find_unused_parameters=True)  # noqa: E731
    else:
        wrap = mt.DistributedDataParallel
    m = train_uneven(wrap, "mlp", r, accumulate=how == "no_sync", overlap=how == "overlap_step")
    ref = reference("mlp", n, True, how == "no_sync")
    for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=f"{nm} on rank {r}")
    assert float((m.l1.weight.detach() - MLP(seed=40).l1.weight.detach()).abs().max()) > 1e-2


class EmbLM(torch.nn.Module):
    """A tied table (lookup and output head): its lookup's rows are gathered at every step."""

    def __init__(self, seed):
        super().__init__()
        self.emb = torch.nn.Embedding(30, D)
        self.mid = torch.nn.Linear(D, D)
        seeded(self, seed, torch.float64)

    def forward(self, ids):
        return torch.tanh(self.mid(self.emb(ids).mean(1))) @ self.emb.weight.t()


def test_join_with_gathered_embeddings_as_torch_ddp(comm, torch_dist):
    """embedding_grads="all_gather" (outside join a tied table's lookup rows are gathered at
    every step): inside join() the table is reduced densely, and the model after uneven
    inputs is torch DDP's."""
    r = comm.get_rank()

    def run(wrap):
        m = EmbLM(seed=90 + r)
        model = wrap(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with model.join():
            for k in range(count(r)):
                g = torch.Generator().manual_seed(500 * r + k)
                opt.zero_grad()
                model(torch.randint(0, 30, (4, 3), generator=g)).pow(2).mean().backward()
                opt.step()
        return m

    got = run(lambda m: mt.DistributedDataParallel(m, embedding_grads="all_gather"))
    want = run(torch.nn.parallel.DistributedDataParallel)
    for (nm, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg=f"{nm} on rank {r}")
    assert float((got.emb.weight.detach() - EmbLM(seed=90).emb.weight.detach()).abs().max()) > 1e-2


def test_join_keeps_a_finished_ranks_gradients_and_trains_on_after(comm):
    """A rank that ran out of inputs keeps the gradients of its last step (the shadowed
    reductions do not land in its .grad, as torch DDP's zero buckets do not); after the
    block the wrapper trains on with every rank in step (a plain synchronised step)."""
    n, r = comm.get_group_size(), comm.get_rank()
    m = MLP(seed=40 + r)
    model = mt.DistributedDataParallel(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = None
    with model.join():
        for k in range(count(r)):
            opt.zero_grad()
            model(batch("mlp", k, r)).pow(2).mean().backward()
            last = [p.grad.clone() for p in m.parameters()]
            opt.step()
    for p, g in zip(m.parameters(), last):
        assert torch.equal(p.grad, g)
    ref = reference("mlp", n, True, False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    # (reference() used momentum; compare the step after the block from the same parameters)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), m.parameters()):
            p.copy_(q)
    opt.zero_grad()
    model(batch("mlp", 99, r)).pow(2).mean().backward()
    opt.step()
    ref_opt.zero_grad()
    (sum(ref(batch("mlp", 99, q)).pow(2).mean() for q in range(n)) / n).backward()
    ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12)


def test_join_throw_on_early_termination(comm):
    """throw_on_early_termination=True: once the rank with the fewest batches (rank 0) has run
    out, every rank raises InputsExhaustedError (a RuntimeError, as torch's): rank 0 as it
    leaves its loop, the others at their next forward; nothing is left half done, so the ranks
    go on in step. At 1 rank nothing is uneven: the loop runs to its end."""
    n, r = comm.get_group_size(), comm.get_rank()
    m = MLP(seed=40 + r)
    model = mt.DistributedDataParallel(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    outcome = "finished"
    try:
        with model.join(throw_on_early_termination=True):
            for k in range(count(r)):
                opt.zero_grad()
                model(batch("mlp", k, r)).pow(2).mean().backward()
                opt.step()
                steps += 1
    except RuntimeError as e:
        assert isinstance(e, InputsExhaustedError)
        outcome = str(e)
    outcomes = mpicomm.all_gather_object((steps, outcome))
    if n == 1:
        assert outcomes == [(count(0), "finished")]
        return
    for q, (s, o) in enumerate(outcomes):
        assert s == count(0), f"rank {q} took {s} steps"
        if q == 0:
            assert o.startswith("Rank 0 exhausted all inputs"), o
        else:
            assert o.startswith("Detected at least one rank that exhausted inputs"), o
            assert "rank(s) [0]" in o
    # every rank in step: a synchronised step after the error gives the same parameters everywhere
    opt.zero_grad()
    model(batch("mlp", 50, r)).pow(2).mean().backward()
    opt.step()
    mine = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert all(torch.equal(o, mine) for o in mpicomm.all_gather_object(mine))


def test_join_disabled_and_bad_arguments(comm):
    """enable=False: the block is a plain loop (here with even inputs, against one process);
    a flag that is not a bool, or differs between ranks, raises InvalidArgumentError on every
    rank as the block is entered."""
    n, r = comm.get_group_size(), comm.get_rank()
    m = MLP(seed=40 + r)
    model = mt.DistributedDataParallel(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join(enable=False):
        for k in range(3):
            opt.zero_grad()
            model(batch("mlp", k, r)).pow(2).mean().backward()
            opt.step()
    ref = MLP(seed=40)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for k in range(3):
        ref_opt.zero_grad()
        (sum(ref(batch("mlp", k, q)).pow(2).mean() for q in range(n)) / n).backward()
        ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12)
    with pytest.raises(InvalidArgumentError, match=r"throw_on_early_termination='yes'.*True or False"
                       if r == 0 else r"rank 0 refused join\(\)'s arguments"):
        with model.join(throw_on_early_termination="yes" if r == 0 else False):
            pass
    if n > 1:
        with pytest.raises(InvalidArgumentError, match=r"divide_by_initial_world_size=.*the same value on every "
                           r"rank \(rank 0 gives True, rank 1 False\)"):
            with model.join(divide_by_initial_world_size=r != 1):
                pass
    with model.join():   # in step after the refusals
        opt.zero_grad()
        model(batch("mlp", 7, r)).pow(2).mean().backward()


def test_join_with_fp16_hook_divides_by_the_group_size(comm, torch_dist):
    """A registered torch hook divides by the group size inside join() whatever
    divide_by_initial_world_size says, as torch's hooks do: against torch DDP (float32 with
    fp16_compress_hook, within float16's rounding)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    r = comm.get_rank()

    def run(cls):
        m = MLP(seed=70 + r, dtype=torch.float32)
        model = cls(m)
        model.register_comm_hook(None, dh.fp16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join(divide_by_initial_world_size=False):
            for k in range(count(r)):
                opt.zero_grad()
                model(batch("mlp", k, r, dtype=torch.float32)).pow(2).mean().backward()
                opt.step()
        return m

    got, want = run(mt.DistributedDataParallel), run(torch.nn.parallel.DistributedDataParallel)
    start = MLP(seed=70, dtype=torch.float32)
    for p, q, s in zip(got.parameters(), want.parameters(), start.parameters()):
        moved = float((q - s).detach().abs().max())
        assert moved > 1e-3
        torch.testing.assert_close(p, q, rtol=0, atol=moved * 2 ** -7)
