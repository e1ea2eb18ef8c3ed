"""mpicomm.torch on CUDA tensors over NCCL: the checks of test_torch.py with device="cuda"
(the wrapper equals one process on the global batch, buckets issued during backward,
no_sync, unused parameters, compression, a bfloat16 model, buffers, join() with uneven inputs), and the reducer's
fused path on CUDA tensors. Skipped (on every rank alike) where the backend is not NCCL
or PyTorch sees no GPU; run by scripts/gpu_suite.sh torch."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import mpicomm  # noqa: E402
import test_torch as tt  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


@pytest.fixture(scope="module")
def cuda(comm):
    if mpicomm.get_backend() != "nccl" or not torch.cuda.is_available():
        pytest.skip("needs the NCCL backend and a GPU that PyTorch sees")
    dev = mpicomm.get_local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    # the references run the same kernels: no TF32, no nondeterministic algorithm choice
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return f"cuda:{dev}"


@pytest.mark.parametrize("plan", list(tt.PLANS))
def test_wrapper_equals_one_process_cuda(cuda, plan):
    model = tt.check_equals_one_process(cuda, tt.PLANS[plan])
    assert all(p.grad.is_cuda for p in model.parameters())


def test_buckets_start_during_backward_cuda(cuda):
    tt.check_buckets_start_during_backward(cuda)


def test_no_sync_cuda(cuda):
    tt.check_no_sync(cuda)


def test_unused_parameters_cuda(cuda):
    tt.check_unused(cuda)


@pytest.mark.parametrize("which", ["fp16", "bf16"])
def test_compression_cuda(cuda, which):
    tt.check_compression(cuda, which)


def test_bf16_model_cuda(cuda):
    tt.check_bf16_model(cuda)


def test_buffers_cuda(cuda):
    tt.check_buffers(cuda)


@pytest.mark.parametrize("mode", ["call", "reduce_"])
@pytest.mark.parametrize("cap", [25.0, 0, 300 / 2 ** 20])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reducer_fused_on_cuda_tensors(cuda, mode, cap, dtype):
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    shapes = [(6, 5), (5,), (5, 4, 3), (4,), (3, 2), (7,), (33, 3)]
    dt = getattr(torch, dtype)

    def grads(q):
        g = np.random.default_rng([q, 13])
        return [torch.from_numpy(g.standard_normal(s).astype(np.float32)).to(dt) for s in shapes]

    mine = [g.to(cuda) for g in grads(r)]
    red = mpicomm.DistributedGradReducer([torch.zeros(s, dtype=dt, device=cuda) for s in shapes], mean=False,
                                         bucket_cap_mb=cap)
    given = [g.clone() for g in mine]
    out = red(given) if mode == "call" else red.reduce_(given)
    for k in range(len(shapes)):
        want = sum(grads(q)[k].double() for q in range(n))
        tol = 1e-6 if dtype == "float32" else n * 2.0 ** -7  # NCCL rounds bf16 after each addition
        torch.testing.assert_close(out[k].double().cpu(), want, rtol=tol, atol=tol * float(want.abs().max()))
        assert out[k].is_cuda and out[k].dtype == dt
        if mode == "call":
            torch.testing.assert_close(given[k], mine[k], rtol=0, atol=0)
        else:
            assert out[k] is given[k]


@pytest.fixture
def direct_low(monkeypatch):
    """Gradients of 64 bytes or more take the direct path (reduced from where autograd or
    the caller leaves them, not copied into the bucket), so these small models use it."""
    from mpicomm.training import layout

    monkeypatch.setattr(layout, "_DIRECT_MIN_BYTES", 64)


@pytest.mark.parametrize("plan", list(tt.PLANS))
@pytest.mark.parametrize("zero_to_none", [True, False])
def test_wrapper_direct_path_cuda(cuda, direct_low, plan, zero_to_none):
    model = tt.check_equals_one_process(cuda, tt.PLANS[plan], zero_to_none)
    assert any(b.direct for b in model.reducer._buckets)


@pytest.mark.parametrize("check", ["check_buckets_start_during_backward", "check_no_sync", "check_unused"])
def test_direct_path_cuda(cuda, direct_low, check):
    getattr(tt, check)(cuda)


@pytest.mark.parametrize("mode", ["call", "reduce_"])
@pytest.mark.parametrize("low", [False, True], ids=["4MiB", "64B"])
@pytest.mark.parametrize("mean", [False, True])
def test_big_gradients_reduced_where_they_are_cuda(cuda, mean, low, mode, monkeypatch, request):
    from test_fused_reducer import check_direct

    def to_dev(h):
        return torch.from_numpy(h).to(cuda)

    check_direct(torch, to_dev, lambda a: a.cpu().numpy(), request.node.name, mean, low, monkeypatch, mode)


def test_buckets_follow_ready_order_cuda(cuda):
    tt.check_buckets_follow_ready_order(cuda)


@pytest.mark.parametrize("mode", ["auto", "all_gather", "all_reduce"])
@pytest.mark.parametrize("zero_to_none", [True, False])
def test_embedding_grads_cuda(cuda, mode, zero_to_none, monkeypatch):
    from mpicomm.torch import _embedding

    monkeypatch.setattr(_embedding, "AUTO_MIN_TABLE_BYTES", 0)
    n = mpicomm.get_group_size()
    model, seen = tt.check_embedding_grads(cuda, mode, zero_to_none)
    gather = n > 1 and (mode == "all_gather" or (mode == "auto" and 4 * n * (n + 1) // 2 <= tt.TiedLM.V))
    assert tt._gathered(seen) == [gather] * 4, seen


def test_embedding_grads_with_no_sync_cuda(cuda):
    n = mpicomm.get_group_size()
    _, seen = tt.check_embedding_grads(cuda, "all_gather", accumulate=True)
    assert tt._gathered(seen) == [False, n > 1] * 4, seen


def test_embedding_grads_direct_path_cuda(cuda, direct_low):
    """The tied table's gradient taken from autograd's tensor (direct path), rows gathered."""
    model, seen = tt.check_embedding_grads(cuda, "all_gather")
    assert any(b.direct for b in model.reducer._buckets)


@pytest.mark.parametrize("plan", ["per_tensor", "small", "one"])
@pytest.mark.parametrize("which", ["sgd_momentum", "adamw_groups"])
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_overlapped_step_equals_the_unfused_step_cuda(cuda, direct_low, which, plan):
    """DistributedDataParallel(optimizer=opt, overlap_step=True) on a GPU: the parameters
    and optimizer state of optimizer.step() after the reduction, exactly; with the direct
    path (big gradients reduced from autograd's tensors and placed last in their bucket's
    buffer, so the reducer hands a bucket's indices in another order than its plan's)."""
    import test_torch_step as ts

    model = ts.check_overlapped_equals_unfused(cuda, which, ts.PLANS[plan], zero_to_none=(plan != "small"))
    assert any(b.direct for b in model.reducer._buckets)


@pytest.mark.parametrize("divide", [True, False], ids=["by_group_size", "by_ranks_training"])
@pytest.mark.parametrize("direct", [False, True], ids=["packed", "direct"])
def test_join_uneven_inputs_cuda(cuda, divide, direct, monkeypatch):
    """join() on CUDA tensors over NCCL: rank r has 2 + r batches (several buckets; with
    ``direct`` the big gradients are reduced where autograd leaves them). After the block every
    rank's parameters equal one process's replay of the rounds: each step's gradient is the sum
    over the ranks still training, divided by the group size or by their number."""
    import mpicomm.torch as mt

    if direct:
        from mpicomm.training import layout

        monkeypatch.setattr(layout, "_DIRECT_MIN_BYTES", 64)
    n, r = mpicomm.get_group_size(), mpicomm.get_rank()
    counts = [2 + q for q in range(n)]

    def make():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()

    def data(q, k):
        return torch.from_numpy(np.random.default_rng([q, k, 77]).standard_normal((4, 6)))

    ref = make()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(max(counts)):
        active = [q for q in range(n) if k < counts[q]]
        grads = []
        for q in active:
            ref.zero_grad()
            ref(data(q, k)).square().sum().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        d = n if divide else len(active)
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / d
        opt_ref.step()
    w = mt.DistributedDataParallel(make().to(cuda), bucket_cap_mb=300 / 2 ** 20)
    assert len(w.buckets) > 1
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    with w.join(divide_by_initial_world_size=divide):
        for k in range(counts[r]):
            opt.zero_grad()
            w(data(r, k).to(cuda)).square().sum().backward()
            opt.step()
    torch.cuda.synchronize()
    for p, q in zip(w.module.parameters(), ref.parameters()):
        assert p.is_cuda
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-10, atol=1e-12)
