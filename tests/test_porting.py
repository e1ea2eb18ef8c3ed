"""Porting from MindSpore, OneFlow and Paddle (docs/PORTING.md): the MindSpore names
(ParallelMode, GlobalComm), what every auto-parallel context key does, the reducer's
MindSpore signature, init's backend names, and the three example scripts, each of which
must train to what one process computes on the global batch.

The expectations are computed here, not by the scripts: one process, every global batch
whole, with PyTorch's autograd and optimizers (MindSpore and Paddle examples) or the
closed-form gradient (OneFlow's linear model). Only the data sets and the starting
weights (rank 0's draw) come from the scripts.
"""
import importlib.util
import inspect
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import ROOT, clean_mpi_env
from launch_support import TORCH, require_module

import mpicomm
from mpicomm import InvalidArgumentError
from mpicomm.training import context
from mpicomm.training.context import (GlobalComm, ParallelMode, get_auto_parallel_context,
                                      reset_auto_parallel_context, set_auto_parallel_context)

SCRIPTS = os.path.join(ROOT, "scripts")
EXAMPLES = ("port_mindspore", "port_oneflow_ddp", "port_paddle")
# the tests below set the context while reducers of earlier steps are alive, on purpose;
# test_changing_the_context_after_a_reducer_warns checks that warning
pytestmark = pytest.mark.filterwarnings("ignore:set_auto_parallel_context. .* changed after")


@pytest.fixture(autouse=True)
def _fresh():
    reset_auto_parallel_context()
    yield
    reset_auto_parallel_context()


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_porting_{name}", os.path.join(SCRIPTS, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines functions only: main() runs under __main__
    return mod


def _rel(got, want):
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) / max(float(np.max(np.abs(w))), 1e-300)
               for g, w in zip(got, want))


# ---------------------------------------------------------------- references: one process, global batch

def _global_batches(n_samples, epoch, batch, seed, drop_last):
    """The global batches of one epoch: the order one shard of the sampler gives, cut into
    batches of ``batch`` (each rank's local batches together are exactly one of these)."""
    s = mpicomm.DistributedSampler(n_samples, num_shards=1, shard_id=0, shuffle=True, seed=seed)
    s.set_epoch(epoch)
    order = s.indices()
    stop = len(order) - len(order) % batch if drop_last else len(order)
    return [order[i:i + batch] for i in range(0, stop, batch)]


def _mlp_reference(mod, n, epochs, local_batch, seed, make_opt, drop_last, x, y, batches=None):
    torch = require_module("torch", TORCH)
    params = [torch.tensor(p, requires_grad=True) for p in mod.init_params(seed)]  # rank 0's draw
    opt = make_opt(torch, params)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for epoch in range(epochs):
        for s in (batches or _global_batches)(len(x), epoch, local_batch * n, seed, drop_last):
            s = torch.from_numpy(s)
            w1, b1, w2, b2 = params
            logits = torch.relu(xt[s] @ w1 + b1) @ w2 + b2
            loss = torch.nn.functional.cross_entropy(logits, yt[s])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [p.detach().numpy() for p in params]


def mindspore_reference(mod, n, epochs=2, batch=8, lr=0.1, seed=0):
    x, y = mod.create_dataset(seed)
    return _mlp_reference(mod, n, epochs, batch, seed, lambda torch, ps: torch.optim.SGD(ps, lr),
                          False, x, y)


def _paddle_global_batches(n_samples, epoch, batch, n):
    """Paddle's DistributedBatchSampler(shuffle=True, drop_last=True) over n ranks, as one
    process sees it: 0..N-1 padded from its start to a multiple of n, shuffled by
    numpy.random.RandomState(epoch), cut into rounds of batch * n (each rank's batch is a
    block of one round); the short last round gives each rank less than a batch: dropped."""
    order = list(range(n_samples))
    order += order[:-(-n_samples // n) * n - n_samples]
    np.random.RandomState(epoch).shuffle(order)
    g = batch * n
    return [np.array(order[i:i + g]) for i in range(0, len(order) - g + 1, g)]


def paddle_reference(mod, n, epochs=2, batch=8, lr=0.01, seed=0):
    (x, y), _ = mod.create_datasets(seed)
    batches = lambda n_samples, epoch, global_batch, seed, drop_last: \
        _paddle_global_batches(n_samples, epoch, global_batch // n, n)
    return _mlp_reference(mod, n, epochs, batch, seed,
                          lambda torch, ps: torch.optim.Adam(ps, lr, betas=(0.9, 0.999), eps=1e-8), True, x, y,
                          batches=batches)


def oneflow_reference(mod, n, iters=30, seed=0):
    """DDP averages the ranks' gradients of their sum losses: the gradient of the global
    batch's sum loss divided by the number of ranks."""
    data = [mod.rank_data(r, seed) for r in range(n)]
    x = np.vstack([d[0].numpy() for d in data])
    y = np.vstack([d[1].numpy() for d in data])
    w = np.zeros((2, 1))
    for _ in range(iters):
        w = w - 0.01 * (2 * x.T @ (x @ w - y) / n)
    return w


# ---------------------------------------------------------------- the examples, in this job (1..4 ranks)

def _same_everywhere(comm, arrays):
    mine = np.concatenate([np.asarray(a).ravel() for a in arrays])
    allv = np.empty((comm.get_group_size(), mine.size))
    comm.all_gather(mine[None, :], out=allv)
    return all(np.array_equal(allv[0], row) for row in allv)


@pytest.mark.mpi
def test_mindspore_example_equals_one_process(comm):
    mod = _script("port_mindspore")
    n = comm.get_group_size()
    want = mindspore_reference(mod, n)
    got = mod.main(["--epochs", "2"])
    assert get_auto_parallel_context("parameter_broadcast") is True
    assert _same_everywhere(comm, got)   # parameter_broadcast: every rank started from rank 0's draw
    assert _rel(got, want) <= 1e-9
    assert _rel(got, mod.init_params(0)) > 1e-2  # training moved the weights


@pytest.mark.mpi
def test_oneflow_example_equals_one_process(comm):
    require_module("torch", TORCH)
    mod = _script("port_oneflow_ddp")
    n = comm.get_group_size()
    got = mod.main(["--iters", "30"])
    want = oneflow_reference(mod, n, 30)
    assert _same_everywhere(comm, [got])
    assert _rel([got], [want]) <= 1e-9
    assert not np.allclose(want, [[2.0], [3.0]], atol=1e-3)  # not yet converged: the path is compared


@pytest.mark.mpi
def test_oneflow_ddp_keywords(comm):
    """OneFlow's DistributedDataParallel(module, *, broadcast_buffers, broadcast_parameters,
    bucket_size, use_bucket): its defaults are what the wrapper does, and the values it
    cannot do raise on every rank, naming what to write instead."""
    torch = require_module("torch", TORCH)
    from mpicomm.torch import DistributedDataParallel as ddp
    rank = comm.get_rank()
    torch.manual_seed(100 + rank)
    m = torch.nn.Linear(3, 2)
    torch.manual_seed(100)
    want = [p.detach().clone() for p in torch.nn.Linear(3, 2).parameters()]   # rank 0's draw
    w = ddp(m, broadcast_buffers=True, broadcast_parameters=True, use_bucket=True)
    assert all(torch.equal(p, q) for p, q in zip(w.module.parameters(), want))
    for kw, says in ((dict(broadcast_parameters=False), "always starts every rank from rank 0's parameters"),
                     (dict(use_bucket=False), "give bucket_cap_mb=0"),
                     (dict(bucket_size=10), "bucket_cap_mb=25.0 by default"),
                     (dict(use_bucket=1), "True or False")):
        with pytest.raises(InvalidArgumentError, match=f"invalid {next(iter(kw))}=") as info:
            ddp(torch.nn.Linear(3, 2), **kw)
        assert says in str(info.value)
    comm.barrier()


@pytest.mark.mpi
def test_torch_ddp_keywords(comm):
    """torch DDP's keywords that a ported script passes (dim, static_graph, init_sync,
    process_group, check_reduction, mixed_precision=None, ...): accepted where they ask for
    what the wrapper does, init_sync=False keeps each rank's own parameters, and the values
    it cannot do raise on every rank, naming what to write instead."""
    torch = require_module("torch", TORCH)
    import torch.distributed as dist
    import mpicomm.torch as mt
    from mpicomm.torch import DistributedDataParallel as ddp
    rank, n = comm.get_rank(), comm.get_group_size()
    mt.init_process_group("gloo")

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Linear(3, 2)

    want = [p.detach().clone() for p in model(100).parameters()]   # rank 0's draw
    w = ddp(model(100 + rank), dim=0, static_graph=True, check_reduction=False, mixed_precision=None,
            process_group=dist.group.WORLD, init_sync=True, skip_all_reduce_unused_params=False)
    assert all(torch.equal(p, q) for p, q in zip(w.module.parameters(), want))
    own = [p.detach().clone() for p in model(100 + rank).parameters()]
    w = ddp(model(100 + rank), init_sync=False)
    assert all(torch.equal(p, q) for p, q in zip(w.module.parameters(), own))
    assert n == 1 or rank == 0 or not all(torch.equal(p, q) for p, q in zip(own, want))
    for kw, says in ((dict(static_graph=1), "True or False"),
                     (dict(init_sync="yes"), "True or False"),
                     (dict(dim=1.5), "an int"),
                     (dict(mixed_precision=object()), "compression='bf16'"),
                     (dict(device_mesh=object()), "group="),
                     (dict(check_reduction=True), "find_unused_parameters"),
                     (dict(process_group=dist.group.WORLD, group="world"), "mpicomm.create_group")):
        with pytest.raises(InvalidArgumentError, match=f"invalid {next(iter(kw))}=") as info:
            ddp(model(1), **kw)
        assert says in str(info.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_cap'"):
        ddp(model(1), bucket_cap=25)
    sub = dist.new_group([0])   # (collective: every rank makes it)
    if n > 1:   # a group of rank 0 alone is not the world: refused on every rank, naming group=
        with pytest.raises(InvalidArgumentError, match="invalid process_group=") as info:
            ddp(model(1), process_group=sub)
        assert "mpicomm.create_group(name, ranks)" in str(info.value)
    comm.barrier()


@pytest.mark.mpi
def test_ddp_bad_keyword_on_one_rank_raises_on_every_rank(comm):
    """A keyword only one rank gets wrong (a script that branches on the rank) raises on every
    rank at once: that rank its own error naming the value, the others RefusedElsewhereError
    naming that rank and the same words; none waits for the others, and the next wrapper works."""
    torch = require_module("torch", TORCH)
    from mpicomm.errors import RefusedElsewhereError
    from mpicomm.torch import DistributedDataParallel as ddp
    rank, n = comm.get_rank(), comm.get_group_size()
    if n == 1:
        pytest.skip("needs 2 ranks or more (one rank that differs from the others)")
    bad = n - 1   # the last rank: not rank 0, whose values every rank takes
    cases = ((dict(static_graph="yes"), InvalidArgumentError, "invalid static_graph='yes'"),
             (dict(bucket_size=20), InvalidArgumentError, "invalid bucket_size=20"),
             (dict(mixed_precision=object()), InvalidArgumentError, "compression='bf16'"),
             (dict(bucket_cap=25), TypeError, "unexpected keyword argument 'bucket_cap'"))
    for kw, kind, says in cases:
        # (the others raise RefusedElsewhereError at once: waiting for the refusing rank would
        # end in the timeout's CollectiveTimeoutError, which fails the check below)
        with pytest.raises((kind, RefusedElsewhereError)) as info:
            ddp(torch.nn.Linear(4, 3), **(kw if rank == bad else {}))
        if rank == bad:
            assert type(info.value) is kind and says in str(info.value)
        else:
            assert isinstance(info.value, RefusedElsewhereError), repr(info.value)
            assert f"rank {bad} refused DistributedDataParallel" in str(info.value) and says in str(info.value)
    # the ranks are still in step: a good wrapper trains, its gradient the ranks' mean
    torch.manual_seed(100 + rank)
    w = ddp(torch.nn.Linear(4, 3))
    x = torch.as_tensor(np.random.default_rng(40 + rank).standard_normal((5, 4)), dtype=torch.float32)
    plain = torch.nn.Linear(4, 3)
    plain.load_state_dict(w.module.state_dict())
    plain(x).square().sum().backward()
    w(x).square().sum().backward()
    own = plain.weight.grad.double().numpy()
    allv = np.empty((n,) + own.shape)
    comm.all_gather(own[None], out=allv)
    np.testing.assert_allclose(w.module.weight.grad.double().numpy(), allv.mean(axis=0), rtol=1e-5, atol=1e-6)
    comm.barrier()

@pytest.mark.mpi
def test_paddle_example_equals_one_process(comm):
    mod = _script("port_paddle")
    n = comm.get_group_size()
    want = paddle_reference(mod, n)
    got = mod.main(["--epochs", "2"])
    assert _same_everywhere(comm, got)
    assert _rel(got, want) <= 1e-8
    assert _rel(got, mod.init_params(0)) > 1e-2


# ---------------------------------------------------------------- the examples as documented (mpicomm-run)

# (port_oneflow_ddp.py is not run here as well: PyTorch's import in every rank costs more
# than the rest of this file; the tests above train it at 1..4 ranks, and tests/test_docs.py
# runs the guide's mpicomm-run command for it)
def _run_example(name, args, tmp_path):
    out = str(tmp_path / "w.npz")
    cmd = [sys.executable, "-m", "mpicomm.launch", "-n", "2", "python", os.path.join(SCRIPTS, name + ".py"),
           *args, "--save", out]
    p = subprocess.run(cmd, env=clean_mpi_env({"MPICOMM_BACKEND": "mpi"}), capture_output=True, text=True,
                       timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with np.load(out) as f:
        return p.stdout, [f[f"arr_{i}"] for i in range(len(f.files))]


def test_mindspore_example_runs_under_mpicomm_run(tmp_path):
    mod = _script("port_mindspore")
    want = mindspore_reference(mod, 2)
    out, got = _run_example("port_mindspore", ["--epochs", "2"], tmp_path)
    assert "mpicomm mpi, 2 rank(s)" in out and "epoch: 1, step: 0, loss is " in out
    assert _rel(got, want) <= 1e-9


def test_paddle_example_runs_under_mpicomm_run(tmp_path):
    mod = _script("port_paddle")
    want = paddle_reference(mod, 2)
    out, got = _run_example("port_paddle", ["--epochs", "2"], tmp_path)
    assert out.count("[validation] accuracy/loss: ") == 2
    assert _rel(got, want) <= 1e-8


def test_the_guide_shows_every_example():
    guide = open(os.path.join(ROOT, "docs", "PORTING.md"), encoding="utf-8").read()
    for name in EXAMPLES:
        assert f"mpicomm-run -n 2 python scripts/{name}.py" in guide, name


def test_the_guide_shows_what_every_gpu_and_checkpoint_user_needs():
    """Each framework's per-rank device line, the DDP wrapper's module. prefix with the
    lines that save and load without it, the helpers of tests/test_training_helpers.py,
    the Slurm script, and each example's changed lines next to the tutorial's."""
    guide = open(os.path.join(ROOT, "docs", "PORTING.md"), encoding="utf-8").read()
    for line in ("torch.cuda.set_device(mpicomm.get_local_rank() % torch.cuda.device_count())",
                 'paddle.set_device(f"gpu:{mpicomm.get_local_rank() % paddle.device.cuda.device_count()}")',
                 "cupy.cuda.Device(mpicomm.get_local_rank() % cupy.cuda.runtime.getDeviceCount()).use()",
                 "torch.save(m.module.state_dict(), path)", '{k.removeprefix("module."): v for k, v in sd.items()}',
                 "mpicomm.average(loss.item())", "with grad_reducer.no_sync():",
                 'mpicomm.save_on_rank0(model.state_dict(), "ckpt.pt", save=torch.save)',
                 'mpicomm.load_on_rank0("ckpt.pt", load=torch.load)', "sbatch scripts/slurm_job.sh",
                 "| the data-parallel tutorial | `scripts/port_mindspore.py` |",
                 "| OneFlow's `ddp_train.py` | `scripts/port_oneflow_ddp.py` |",
                 "| Paddle's fleet quick start | `scripts/port_paddle.py` |",
                 "DistributedBatchSampler(cifar10_train, 32, shuffle=True, drop_last=True)",
                 'init(backend_name="nccl")', 'get_auto_parallel_context("full_batch")'):
        assert line in guide, line
    assert os.path.exists(os.path.join(ROOT, "scripts", "slurm_job.sh"))


# ---------------------------------------------------------------- MindSpore's names

def test_parallel_mode_is_mindspores():
    assert (ParallelMode.STAND_ALONE, ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL,
            ParallelMode.AUTO_PARALLEL, ParallelMode.HYBRID_PARALLEL) == \
        ("stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel", "hybrid_parallel")
    assert ParallelMode.MODE_LIST == ["stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel",
                                      "auto_parallel"]
    assert mpicomm.ParallelMode is ParallelMode and mpicomm.GlobalComm is GlobalComm
    set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL)
    assert get_auto_parallel_context("parallel_mode") == ParallelMode.DATA_PARALLEL


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel", "hybrid_parallel"])
def test_model_parallel_modes_raise(mode):
    with pytest.raises(InvalidArgumentError, match=rf"parallel_mode='{mode}'.*'stand_alone', 'data_parallel' "
                                                   r"\(.*mpicomm does data parallelism only"):
        set_auto_parallel_context(parallel_mode=mode, gradients_mean=True)
    assert get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert get_auto_parallel_context("gradients_mean") is False  # all or nothing


def test_global_comm_before_init():
    if mpicomm.is_initialized():
        pytest.skip("mpicomm is initialised in this process")
    assert GlobalComm.BACKEND == "undefined" and GlobalComm.INITED is False
    assert GlobalComm.WORLD_COMM_GROUP == "world"


@pytest.mark.mpi
def test_global_comm_after_init(comm):
    assert GlobalComm.BACKEND == comm.get_backend() and GlobalComm.INITED is True
    n = comm.get_group_size()
    assert comm.get_group_size(GlobalComm.WORLD_COMM_GROUP) == n
    x = np.ones(3)
    comm.all_reduce(x, out=x, group=GlobalComm.WORLD_COMM_GROUP)
    np.testing.assert_array_equal(x, n)


# ---------------------------------------------------------------- init's backend names (before MPI starts)

def test_init_hccl_is_refused_saying_what_to_use():
    with pytest.raises(InvalidArgumentError, match=r"invalid backend='hccl'.*'mpi', 'nccl'.*Ascend.*"
                                                   r"NVIDIA GPUs with 'nccl' and on CPUs with 'mpi'"):
        mpicomm.init("hccl")
    with pytest.raises(InvalidArgumentError, match=r"invalid backend='mccl'.*CPU collective library.*'mpi'"):
        mpicomm.init("mccl")


def test_init_takes_mindspores_backend_name_keyword():
    """MindSpore's init(backend_name=...): the same names and refusals, named as written;
    refused before MPI starts, on every rank alike."""
    with pytest.raises(InvalidArgumentError, match=r"invalid backend_name='hccl'.*'mpi', 'nccl'.*Ascend"):
        mpicomm.init(backend_name="hccl")
    with pytest.raises(InvalidArgumentError, match=r"invalid backend_name='mccl'.*CPU collective library.*'mpi'"):
        mpicomm.init(backend_name="mccl")
    with pytest.raises(InvalidArgumentError, match=r"invalid backend_name='gloo'.*one of 'mpi', 'nccl'"):
        mpicomm.init(backend_name="gloo")
    with pytest.raises(InvalidArgumentError, match=r"invalid backend_name='nccl'.*the same as backend='mpi'"):
        mpicomm.init("mpi", backend_name="nccl")
    assert "backend_name" in inspect.signature(mpicomm.init).parameters


@pytest.mark.mpi
def test_init_backend_name_is_the_backend(comm):
    """Called again with backend_name= naming the backend in use: nothing happens, as for
    init(backend) with the same arguments."""
    from mpicomm._state import CTX

    name, timeout, debug, abort, check = CTX.init_key
    mpicomm.init(backend_name=name.upper(), timeout=timeout, debug=debug, abort_on_exception=abort, check=check)
    assert mpicomm.get_backend() == name
    other = "nccl" if name == "mpi" else "mpi"
    with pytest.raises(InvalidArgumentError, match=rf"invalid init arguments=.*'backend': '{other}'"):
        mpicomm.init(backend_name=other, timeout=timeout, debug=debug, abort_on_exception=abort, check=check)


@pytest.mark.parametrize("name", ["nccl", "NCCL", "Mpi"])   # (an id "mpi" reads as the marker)
def test_init_takes_the_gpu_tutorials_name(name):
    from mpicomm._world import _pick_backend

    assert _pick_backend(name) == name.lower()   # init("nccl"): the backend's own checks follow


# ---------------------------------------------------------------- the context's other MindSpore keys

@pytest.mark.parametrize("key, value", [
    ("auto_parallel_search_mode", "dynamic_programming"), ("strategy_ckpt_load_file", "./"),
    ("strategy_ckpt_save_file", "./"), ("full_batch", True), ("enable_parallel_optimizer", True),
])
def test_auto_parallel_keys_raise_saying_why(key, value):
    with pytest.raises(InvalidArgumentError, match=rf"{key}.*(data parallelism only|no optimizer sharding)"):
        set_auto_parallel_context(gradients_mean=True, **{key: value})
    assert get_auto_parallel_context("gradients_mean") is False


@pytest.mark.parametrize("key, says", [("full_batch", "each rank reads its own shard"),
                                       ("enable_parallel_optimizer", "whole optimizer state")])
def test_what_mpicomm_does_anyway_warns(key, says):
    with pytest.warns(UserWarning, match=rf"{key}=False\) is not stored.*{says}"):
        set_auto_parallel_context(gradients_mean=True, **{key: False})
    assert get_auto_parallel_context("gradients_mean") is True
    assert get_auto_parallel_context(key) is False   # what mpicomm does, read back (seed 002 reads full_batch)


def test_get_full_batch_reads_false_and_unknown_keys_still_raise():
    """MindSpore's guide calls get_auto_parallel_context("full_batch"): False (each rank
    reads its own shard), as enable_parallel_optimizer; the auto-parallel keys that have no
    value here, and unknown keys, still raise, listing the keys that can be read."""
    assert get_auto_parallel_context("full_batch") is False
    assert get_auto_parallel_context("enable_parallel_optimizer") is False
    for key in ("strategy_ckpt_load_file", "no_such_key", 3):
        with pytest.raises(InvalidArgumentError, match=r"invalid key=.*one of .*full_batch.*gradients_mean"):
            get_auto_parallel_context(key)


def test_device_num_and_global_rank_before_init_are_kept():
    if mpicomm.is_initialized():
        pytest.skip("mpicomm is initialised in this process")
    set_auto_parallel_context(device_num=8, global_rank=3)   # checked when mpicomm is used
    assert get_auto_parallel_context("device_num") == 8


# ---------------------------------------------------------------- each key's effect on the reducer (MPI)

def _rank_values(comm, shapes=((3,), (2, 2))):
    r = comm.get_rank()
    return [np.full(s, float(r + 1) * (i + 1)) for i, s in enumerate(shapes)]


@pytest.mark.mpi
def test_gradients_mean_is_the_reducers_default(comm):
    n = comm.get_group_size()
    total = n * (n + 1) / 2
    params = [np.zeros(3), np.zeros((2, 2))]
    red = comm.DistributedGradReducer(params)         # MindSpore's default: the sum
    assert red.mean is False
    out = red(_rank_values(comm))
    np.testing.assert_allclose(out[1], 2 * total)
    set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
    red = comm.DistributedGradReducer(params)
    assert red.mean is True
    np.testing.assert_allclose(red(_rank_values(comm))[1], 2 * total / n)
    assert comm.DistributedGradReducer(params, mean=False).mean is False   # an explicit mean wins


@pytest.mark.mpi
def test_parameter_broadcast_gives_every_rank_rank_0s_parameters(comm):
    r = comm.get_rank()
    params = [np.full(3, float(r)), np.full((2, 2), 10.0 + r, np.float32)]
    comm.DistributedGradReducer(params)               # default False: untouched
    assert params[0][0] == r and params[1][0, 0] == 10 + r
    set_auto_parallel_context(parameter_broadcast=True)
    red = comm.DistributedGradReducer(params)
    np.testing.assert_array_equal(params[0], 0.0)     # overwritten in place
    np.testing.assert_array_equal(params[1], 10.0)
    assert red.grad_views()[0].shape == (3,)


@pytest.mark.mpi
def test_parameter_broadcast_without_a_reducer_warns_at_the_first_allreduce(comm):
    """MindSpore broadcasts rank 0's parameters at the start of training; mpicomm does it
    where it is given the parameters. A loop with AllReduce and no reducer is told, once,
    on rank 0, at its first mpicomm.ops.AllReduce call; the sum is unchanged."""
    n, r = comm.get_group_size(), comm.get_rank()
    each = [np.random.default_rng([5, q]).standard_normal(6) for q in range(n)]
    set_auto_parallel_context(parameter_broadcast=True)
    allreduce = mpicomm.ops.AllReduce()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = allreduce(each[r])
        allreduce(each[r])
    said = [str(x.message) for x in w if "parameter_broadcast=True" in str(x.message)]
    # broadcast first (what the warning asks for): no word
    reset_auto_parallel_context()
    set_auto_parallel_context(parameter_broadcast=True)
    params = [np.random.default_rng([6, r]).standard_normal(3)]
    mpicomm.broadcast_parameters(params)
    with warnings.catch_warnings(record=True) as w2:
        warnings.simplefilter("always")
        allreduce(each[r])
    # (checked after every collective: a failure on one rank leaves no other waiting)
    np.testing.assert_allclose(got, sum(each), rtol=1e-12)
    if r == 0:
        assert len(said) == 1 and "mpicomm.broadcast_parameters(params)" in said[0], said
    else:
        assert said == []
    np.testing.assert_array_equal(params[0], np.random.default_rng([6, 0]).standard_normal(3))
    assert not [x for x in w2 if "parameter_broadcast" in str(x.message)]


@pytest.mark.mpi
def test_parameter_broadcast_with_torch_parameters(comm):
    torch = require_module("torch", TORCH)
    r = comm.get_rank()
    lin = torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        lin.weight.fill_(r)
    set_auto_parallel_context(parameter_broadcast=True, gradients_mean=True)
    red = comm.DistributedGradReducer(list(lin.parameters()))
    assert float(lin.weight.detach().abs().max()) == 0.0 and red.mean is True


@pytest.mark.mpi
def test_all_reduce_fusion_config_plans_the_buckets(comm):
    set_auto_parallel_context(all_reduce_fusion_config=[1, 3])
    assert comm.DistributedGradReducer([np.zeros(2)] * 6).buckets == [[4, 5], [2, 3], [0, 1]]


@pytest.mark.mpi
def test_gradient_fp32_sync_default_is_what_get_says(comm):
    """MindSpore's default gradient_fp32_sync=True: get_ says True and the reducer does it:
    half-precision gradients averaged in float32 (no division in float16 first)."""
    n, r = comm.get_group_size(), comm.get_rank()
    assert get_auto_parallel_context("gradient_fp32_sync") is True
    shape = (257,)
    red = comm.DistributedGradReducer([np.zeros(shape, np.float16)], mean=True)
    assert red.fp32_sync is True
    each = [np.random.default_rng([11, q]).standard_normal(shape).astype(np.float16) for q in range(n)]
    got = red([each[r].copy()])[0]
    assert got.dtype == np.float16
    exact = sum(e.astype(np.float64) for e in each) / n
    # summed and divided in float32, rounded to float16 once: within one float16 rounding
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=2.0 ** -11, atol=2.0 ** -25)


@pytest.mark.mpi
def test_gradient_fp32_sync_where_set(comm):
    params = [np.zeros(4, np.float16)]
    set_auto_parallel_context(gradient_fp32_sync=True)
    red = comm.DistributedGradReducer(params)
    assert red.fp32_sync is True
    n = comm.get_group_size()
    out = red([np.full(4, 60000.0 / n, np.float16)])                   # summed in float32, then float16
    np.testing.assert_allclose(out[0].astype(np.float64), 60000.0, rtol=1e-3)
    assert comm.DistributedGradReducer(params, fp32_sync=False).fp32_sync is False
    set_auto_parallel_context(gradient_fp32_sync=False)
    assert comm.DistributedGradReducer(params).fp32_sync is False


@pytest.mark.mpi
def test_device_num_is_the_world_size(comm):
    n = comm.get_group_size()
    set_auto_parallel_context(device_num=n, parallel_mode="data_parallel")
    assert get_auto_parallel_context("device_num") == n
    with pytest.raises(InvalidArgumentError, match=rf"invalid device_num={n + 1}: expected {n}, the number of "
                                                   r"processes in this job.*mpicomm-run -n"):
        set_auto_parallel_context(device_num=n + 1, gradients_mean=True)
    assert get_auto_parallel_context("gradients_mean") is False and get_auto_parallel_context("device_num") == n


@pytest.mark.mpi
def test_device_num_set_before_init_is_checked_by_the_reducer(comm, monkeypatch):
    n = comm.get_group_size()
    monkeypatch.setitem(context._VALUES, "device_num", n + 1)   # as set_auto_parallel_context before init()
    with pytest.raises(InvalidArgumentError, match=rf"device_num={n + 1}: expected {n}"):
        comm.DistributedGradReducer([np.zeros(3)])             # every rank raises alike


@pytest.mark.mpi
def test_global_rank_is_this_rank(comm):
    r = comm.get_rank()
    set_auto_parallel_context(global_rank=r)
    assert get_auto_parallel_context("global_rank") == r
    with pytest.raises(InvalidArgumentError, match=rf"invalid global_rank={r + 1}: expected {r}, this process's "
                                                   r"rank.*leave global_rank unset"):
        set_auto_parallel_context(global_rank=r + 1)
    assert get_auto_parallel_context("global_rank") == r


@pytest.mark.mpi
def test_global_rank_set_before_init_is_checked_by_the_reducer(comm, monkeypatch):
    r = comm.get_rank()
    monkeypatch.setitem(context._VALUES, "global_rank", 1 if r == 0 else r)   # wrong on rank 0 alone
    with pytest.raises(InvalidArgumentError, match=r"global_rank=1"):
        comm.DistributedGradReducer([np.zeros(3)])             # ...and every rank raises


@pytest.mark.mpi
def test_stand_alone_with_a_reducer_over_several_ranks_warns(comm):
    n = comm.get_group_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comm.DistributedGradReducer([np.zeros(3)])             # the default, never set: silent
        set_auto_parallel_context(parallel_mode="data_parallel")
        comm.DistributedGradReducer([np.zeros(3)])
    set_auto_parallel_context(parallel_mode=ParallelMode.STAND_ALONE)
    if n == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            comm.DistributedGradReducer([np.zeros(3)])
    else:
        with pytest.warns(UserWarning, match=rf"parallel_mode='stand_alone' is set.*gradients of {n} ranks"):
            comm.DistributedGradReducer([np.zeros(3)])


@pytest.mark.mpi
def test_changing_the_context_after_a_reducer_warns(comm):
    red = comm.DistributedGradReducer([np.zeros(3)])
    with pytest.warns(UserWarning, match=r"gradients_mean changed after \d+ DistributedGradReducer.*keep"):
        set_auto_parallel_context(gradients_mean=True)
    assert red.mean is False


# ---------------------------------------------------------------- the reducer's MindSpore signature

def test_reducer_signature_is_mindspores():
    sig = inspect.signature(mpicomm.DistributedGradReducer)
    names = list(sig.parameters)
    assert names[:3] == ["parameters", "mean", "degree"]
    assert sig.parameters["mean"].default is None and sig.parameters["degree"].default is None
    assert all(p.kind is p.KEYWORD_ONLY for p in list(sig.parameters.values())[3:])
    assert sig.parameters["bucket_cap_mb"].default == 25.0


@pytest.mark.mpi
def test_reducer_takes_mindspores_positional_order(comm):
    n = comm.get_group_size()
    params = [np.zeros(3), np.zeros((2, 2))]
    red = comm.DistributedGradReducer(params, True, n)          # nn.DistributedGradReducer(params, mean, degree)
    assert red.mean is True and red.bucket_cap_mb == 25.0
    np.testing.assert_allclose(red(_rank_values(comm))[0], (n + 1) / 2)
    assert comm.DistributedGradReducer(params, False, degree=n, bucket_cap_mb=0).buckets == [[1], [0]]


@pytest.mark.mpi
@pytest.mark.parametrize("degree", ["other", 8.0, True, "size"])
def test_reducer_degree_must_be_the_group_size(comm, degree):
    n = comm.get_group_size()
    if degree == "other":
        degree = n + 1
    elif degree == "size":
        degree = np.int64(n)
        assert comm.DistributedGradReducer([np.zeros(3)], True, degree).mean is True
        return
    with pytest.raises(InvalidArgumentError, match=rf"invalid degree={degree!r}: expected None or {n}, the group's "
                                                   r"size.*bucket_cap_mb.*keywords"):
        comm.DistributedGradReducer([np.zeros(3)], True, degree)


@pytest.mark.mpi
def test_reducer_bucket_cap_is_a_keyword(comm):
    with pytest.raises(TypeError):
        comm.DistributedGradReducer([np.zeros(3)], True, None, 25.0)
    assert comm.DistributedGradReducer([np.zeros(3)], bucket_cap_mb=1).bucket_cap_mb == 1.0


@pytest.mark.parametrize("name, says", [("set_context", "leave the line out"), ("GRAPH_MODE", "no execution modes"),
                                        ("set_seed", "parameter_broadcast=True"), ("Tensor", "owns no tensors"),
                                        ("value_and_grad", "autograd stays your framework's")])
def test_mindspore_names_without_a_counterpart_say_so(name, says):
    # `import mindspore as ms` -> `import mpicomm as ms` leaves ms.set_context(mode=ms.GRAPH_MODE), ms.set_seed(1)
    with pytest.raises(AttributeError, match=f"^module 'mpicomm' has no attribute '{name}': MindSpore's {name} ") as info:
        getattr(mpicomm, name)
    assert says in str(info.value) and str(info.value).endswith("(docs/PORTING.md)")
    assert not hasattr(mpicomm, name)
    with pytest.raises(AttributeError, match=r"^module 'mpicomm' has no attribute 'no_such_name'$"):
        mpicomm.no_such_name
