"""mpicomm.torch's DDP wrapper never drops a gradient (issue 24): every trainable parameter
that backward reaches is reduced, and waited for, before backward() returns, whichever path
its gradient takes -- a parameter's hook into its bucket (mark_ready), a new tensor after
zero_grad(set_to_none=True) reduced from where autograd left it (ready_from, the direct
reduction on NCCL), or an embedding's gathered rows -- also where an embedding of 4 MiB or
more (gathered by embedding_grads="auto") is the only trainable parameter reached: a frozen
head, a loss straight from the lookup, a tied table. Each step is compared with one process
on the global batch; and the unused-parameter error's advice fits a layer frozen before or
after wrapping. CPU tensors over MPI (the ``check_*`` functions take a device)."""
import pytest

from launch_support import TORCH, require_module

torch = require_module("torch", TORCH)

import mpicomm  # noqa: E402
import mpicomm.torch as mt  # noqa: E402
from mpicomm import InvalidArgumentError  # noqa: E402

pytestmark = pytest.mark.mpi

torch.set_num_threads(1)  # the ranks share two cores

# 8192 x 64 float64 = 4 MiB: the smallest table embedding_grads="auto" gathers
V, D, C, T = 8192, 64, 5, 3
GLOBAL_B, STEPS, LR = 12, 3, 0.5  # 12 sequences a step divide by 1..4 ranks; 36 ids, far under V
PAD = 1


@pytest.fixture(autouse=True)
def _cpu_tensors_need_mpi(request):
    if "comm" in request.fixturenames and request.getfixturevalue("comm").get_backend() != "mpi":
        pytest.skip("CPU tensors need the MPI backend: run with MPICOMM_BACKEND=mpi")


def _init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return module


class FrozenHead(torch.nn.Module):
    """A lookup under a frozen head: the table is the only trainable parameter."""

    only_lookup = True

    def __init__(self, seed, spare=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D).double()
        self.head = torch.nn.Linear(D, C).double()
        if spare:  # trainable, never used
            self.spare = torch.nn.Linear(D, C).double()
        _init(self, seed)
        self.head.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def lookup(seed):
    """A bare ``nn.Embedding`` (with a padding row): the loss is computed straight from the
    lookup. (Only ``nn.Embedding`` itself is gathered, not a subclass.)"""
    return _init(torch.nn.Embedding(V, D, padding_idx=PAD, dtype=torch.float64), seed)


lookup.only_lookup = True


class TiedFrozen(torch.nn.Module):
    """A tied table (lookup and output head) around a frozen layer: one trainable parameter,
    reached by the head's hook and by the lookup's gathered rows."""

    only_lookup = False

    def __init__(self, seed):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D).double()
        self.mid = torch.nn.Linear(D, D).double()
        _init(self, seed)
        self.mid.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.mid(self.emb(x))) @ self.emb.weight.t()


class WithHead(torch.nn.Module):
    """A table under a trainable head: small gradients by the hook, the table's gathered."""

    only_lookup = True

    def __init__(self, seed):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D).double()
        self.head = torch.nn.Linear(D, C).double()
        _init(self, seed)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


CASES = {"frozen_head": FrozenHead, "lookup_loss": lookup, "tied_frozen": TiedFrozen, "with_head": WithHead}


def batch(k, n_classes, device="cpu"):
    """The global batch of step k: ids (one repeated in every sequence, so that rows meet
    within and across ranks; the padding id), class labels and regression targets."""
    g = torch.Generator().manual_seed(4000 + k)
    x = torch.randint(0, V, (GLOBAL_B, T), generator=g)
    x[:, 0] = 7 + k
    x[::4, 1] = PAD
    y = torch.randint(0, n_classes, (GLOBAL_B, T), generator=g)
    target = torch.randn(GLOBAL_B, T, D, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device), target.to(device)


def loss_of(case, out, y, target):
    if case == "lookup_loss":
        return torch.nn.functional.mse_loss(out, target)
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def my_slice(n, r):
    per = GLOBAL_B // n
    return slice(r * per, (r + 1) * per)


def _cut(seen):
    return ["Cut" in s for s in seen]


def check_never_drops(device, case, mode, zero_to_none, accumulate=False):
    """STEPS steps of SGD with momentum; after each backward every trainable parameter's
    gradient equals one process's on the global batch (no_sync first: plus one on the
    previous global batch), nothing is left in flight, and the paths taken are the expected ones."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    cls = CASES[case]
    n_classes = V if case == "tied_frozen" else C
    m = cls(seed=100 + r).to(device)  # different on every rank: the wrapper takes rank 0's
    model = mt.DistributedDataParallel(m, embedding_grads=mode)
    ref = cls(seed=100)
    names = model.parameter_names
    emb_name = "weight" if case == "lookup_loss" else "emb.weight"
    ei = names.index(emb_name)
    seen, direct = [], []
    table_mod = m if case == "lookup_loss" else m.emb
    table_mod.register_forward_hook(lambda mod, a, out: seen.append(type(out.grad_fn).__name__))
    ready_from = model.reducer.ready_from
    model.reducer.ready_from = lambda i, g: (direct.append(i), ready_from(i, g))[1]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    s = my_slice(n, r)
    took = []
    for k in range(STEPS):
        opt.zero_grad(set_to_none=zero_to_none)
        ref_opt.zero_grad()
        if accumulate:  # a micro-batch without synchronisation first
            x, y, t = batch(100 + k, n_classes, device)
            with model.no_sync():
                loss_of(case, model(x[s]), y[s], t[s]).backward()
            assert model.buckets_started == 0 and not model._emb.launched
            x, y, t = batch(100 + k, n_classes)
            loss_of(case, ref(x), y, t).backward()
        del direct[:]
        before = len(seen)
        x, y, t = batch(k, n_classes, device)
        loss_of(case, model(x[s]), y[s], t[s]).backward()
        x, y, t = batch(k, n_classes)
        loss_of(case, ref(x), y, t).backward()
        ref_named = dict(ref.named_parameters())
        for nm, p in m.named_parameters():
            q = ref_named[nm]
            if not q.requires_grad:
                assert p.grad is None, nm
                continue
            assert p.grad is not None, f"step {k}: {nm} got no gradient"
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-10, atol=1e-12, msg=f"step {k} {nm}")
            assert p.grad.data_ptr() == model._views[names.index(nm)].data_ptr(), nm
        # backward returned: every reduction and gather finished, the step's state reset
        assert not model.reducer._active and model.buckets_started == 0
        assert not model._emb.launched
        gathered = _cut(seen[before:])[-1]
        took.append(("gathered" if gathered else "dense") + ("+direct" if ei in direct else ""))
        assert float(ref_named[emb_name].grad.abs().max()) > 0  # the reference moves
        opt.step()
        ref_opt.step()
    for (nm, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-10, atol=1e-12, msg=nm)
    return model, took


def expected_paths(n, mode, case, zero_to_none):
    """The table's path in each step: gathered (its lookup's rows; the first step only where
    it gets no other gradient: dense afterwards) or dense, and "+direct" where a gradient of
    its own (after set_to_none, and in the first step) reached the reducer from where autograd
    made it."""
    gather = n > 1 and mode in ("auto", "all_gather")  # 36 ids under 8192 rows, a 4 MiB table
    out = []
    for k in range(STEPS):
        g = gather and (k == 0 or not CASES[case].only_lookup)
        own = not (g and CASES[case].only_lookup)  # an autograd gradient: the head's or the dense lookup's
        # (before the first backward .grad is None, as the wrapper leaves it: a tensor of its own too)
        out.append(("gathered" if g else "dense") + ("+direct" if own and (zero_to_none or k == 0) else ""))
    return out


@pytest.mark.parametrize("zero_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("mode", ["auto", "all_gather", "all_reduce"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_is_reduced(comm, case, mode, zero_to_none):
    n = comm.get_group_size()
    model, took = check_never_drops("cpu", case, mode, zero_to_none)
    assert took == expected_paths(n, mode, case, zero_to_none), took
    ei = model.parameter_names.index("weight" if case == "lookup_loss" else "emb.weight")
    only = CASES[case].only_lookup and n > 1 and mode != "all_reduce"
    assert model._emb.dense == ({ei} if only else set())


@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_is_reduced_after_no_sync(comm, case):
    n = comm.get_group_size()
    _, took = check_never_drops("cpu", case, "auto", True, accumulate=True)
    assert took == expected_paths(n, "auto", case, True), took


# ---------------------------------------------------------------- unused parameters and frozen layers

def _frozen_head_step(device, model, r, n):
    x, y, t = batch(0, C, device)
    s = my_slice(n, r)
    loss_of("frozen_head", model(x[s]), y[s], t[s]).backward()


def _frozen_head_reference(seed=100):
    ref = FrozenHead(seed=seed, spare=True)
    x, y, t = batch(0, C)
    loss_of("frozen_head", ref(x), y, t).backward()
    return ref


def check_unused_with_gathered_table(device):
    """A trainable layer that is never used, beside a table reached only through its
    gathered rows: the error fires (naming the layer, not the table), after a finished step."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    ref = _frozen_head_reference()
    m = FrozenHead(seed=100 + r, spare=True).to(device)
    model = mt.DistributedDataParallel(m)
    assert model.parameter_names == ["emb.weight", "spare.weight", "spare.bias"]
    with pytest.raises(InvalidArgumentError, match=r"^2 trainable parameter\(s\) got no gradient in this "
                       r"backward: spare.weight, spare.bias; pass find_unused_parameters=True to reduce them "
                       r"as zeros, or set requires_grad=False on them before wrapping the model$"):
        _frozen_head_step(device, model, r, n)
    torch.testing.assert_close(m.emb.weight.grad.cpu(), ref.emb.weight.grad, rtol=1e-10, atol=1e-12)
    assert not model.reducer._active and not model._emb.launched
    # find_unused_parameters=True: no error; the layer no rank used keeps .grad None, as DDP
    # leaves it (and as one process's backward does)
    m2 = FrozenHead(seed=100 + r, spare=True).to(device)
    model2 = mt.DistributedDataParallel(m2, find_unused_parameters=True)
    _frozen_head_step(device, model2, r, n)
    torch.testing.assert_close(m2.emb.weight.grad.cpu(), ref.emb.weight.grad, rtol=1e-10, atol=1e-12)
    assert ref.spare.weight.grad is None and m2.spare.weight.grad is None and m2.spare.bias.grad is None


def test_unused_parameter_beside_a_gathered_table(comm):
    check_unused_with_gathered_table("cpu")


def check_frozen_after_wrapping(device):
    """A layer frozen after the model was wrapped is still among the parameters the wrapper
    reduces: the error says so, and that freezing before wrapping is the remedy (which works)."""
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    ref = _frozen_head_reference()
    m = FrozenHead(seed=100 + r, spare=True).to(device)
    m.head.requires_grad_(True)
    model = mt.DistributedDataParallel(m, find_unused_parameters=False)
    m.head.requires_grad_(False)  # frozen after wrapping, as the spare layer is unused
    with pytest.raises(InvalidArgumentError) as e:
        _frozen_head_step(device, model, r, n)
    msg = str(e.value)
    assert msg.startswith("4 trainable parameter(s) got no gradient in this backward: head.weight, head.bias, "
                          "spare.weight, spare.bias; pass find_unused_parameters=True to reduce them as zeros, "
                          "or set requires_grad=False on spare.weight, spare.bias before wrapping the model; "
                          "head.weight, head.bias were frozen (requires_grad=False) after the model was wrapped, "
                          "but the wrapper reduces every parameter that was trainable when it was built: "), msg
    assert msg.endswith("freeze layers before wrapping the model, or pass find_unused_parameters=True "
                        "to reduce them as zeros"), msg
    torch.testing.assert_close(m.emb.weight.grad.cpu(), ref.emb.weight.grad, rtol=1e-10, atol=1e-12)
    # only the frozen layer: no advice to freeze what is frozen already
    m1 = FrozenHead(seed=100 + r).to(device)
    m1.head.requires_grad_(True)
    model1 = mt.DistributedDataParallel(m1)
    m1.head.requires_grad_(False)
    with pytest.raises(InvalidArgumentError, match=r"^2 trainable parameter\(s\) got no gradient in this "
                       r"backward: head.weight, head.bias; they were frozen \(requires_grad=False\) after the "
                       r"model was wrapped, but the wrapper reduces every parameter that was trainable when it "
                       r"was built: freeze layers before wrapping the model, or pass find_unused_parameters=True "
                       r"to reduce them as zeros$") as e:
        _frozen_head_step(device, model1, r, n)
    assert "set requires_grad=False on" not in str(e.value)
    # the advice followed: frozen, then wrapped
    m3 = FrozenHead(seed=100 + r).to(device)
    model3 = mt.DistributedDataParallel(m3)
    assert model3.parameter_names == ["emb.weight"]
    _frozen_head_step(device, model3, r, n)
    torch.testing.assert_close(m3.emb.weight.grad.cpu(), ref.emb.weight.grad, rtol=1e-10, atol=1e-12)


def test_layer_frozen_after_wrapping(comm):
    check_frozen_after_wrapping("cpu")


@pytest.mark.parametrize("case", ["frozen_head", "tied_frozen"])
def test_second_backward_of_a_retained_graph(comm, case):
    """backward(retain_graph=True) and backward again: the gathered lookup gathers again, and
    the gradient is the two backwards' sum, as in one process."""
    n, r = comm.get_group_size(), comm.get_rank()
    n_classes = V if case == "tied_frozen" else C
    m = CASES[case](seed=100 + r)
    model = mt.DistributedDataParallel(m)
    ref = CASES[case](seed=100)
    x, y, t = batch(0, n_classes)
    s = my_slice(n, r)
    loss = loss_of(case, model(x[s]), y[s], t[s])
    loss.backward(retain_graph=True)
    loss.backward()
    assert not model._emb.launched and not model.reducer._active
    ref_loss = loss_of(case, ref(x), y, t)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    torch.testing.assert_close(m.emb.weight.grad, ref.emb.weight.grad, rtol=1e-10, atol=1e-12)
