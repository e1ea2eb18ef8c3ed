"""``DistributedDataParallel``: data-parallel training of a ``torch.nn.Module`` over
mpicomm, with each bucket's all_reduce started during backward.

How it works: the trainable parameters are bucketed by mpicomm's
``DistributedGradReducer`` (reverse registration order, 25 MiB by default, as DDP);
every parameter's ``.grad`` is a view of its bucket, so backward accumulates straight
into the buckets (after ``zero_grad(set_to_none=True)``, a gradient of 4 MiB or more is
reduced on NCCL from the tensor autograd made straight into its bucket, no copy); a
post-accumulate-grad hook on every parameter marks it ready, and a bucket's all_reduce
starts as soon as its last gradient is in, while backward goes on
with the earlier layers; a callback queued on the autograd engine finishes the
remaining buckets when backward ends, so ``loss.backward(); opt.step()`` needs nothing
more. It is queued wherever a gradient reaches the wrapper first: a parameter's hook, or
a gathered embedding lookup's backward (where that lookup is the only path to a trainable
parameter, no hook fires at all). After the first backward the buckets follow the order
the gradients became ready in. Embedding lookups may have their gradient rows gathered instead (``_embedding.py``).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .. import all_gather_object, broadcast, broadcast_object
from .._objects import all_gather_small
from .._state import CTX, get_group
from ..errors import InvalidArgumentError, RefusedElsewhereError, TypeOf, invalid
from ..training.families import TORCH
from ..training.fused import broadcast_parameters as _broadcast_parameters
from ._device import select_local_device
from ..training.reducer import DistributedGradReducer
from ._embedding import EmbeddingGather, GatherContext, check_mode
from ._join import JoinState, JoinSteps, check_join_arguments
from ._step import OverlappedStep


def _flag(name, v):
    if not isinstance(v, bool):
        raise invalid(name, v, "True or False")
    return v


def _same_model_everywhere(module, group, err=None):
    """Raise on every rank alike when a rank refused its arguments (``err``: its own error,
    ``module`` None then) or when the ranks' models differ (before any broadcast, which would
    fail or hang on buffers of different sizes). One exchange over ``group``."""
    def sig(kind, items):
        return [(kind, n, tuple(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False)))
                for n, t in items]

    mine = None if module is None else \
        sig("parameter", module.named_parameters()) + sig("buffer", module.named_buffers())
    verdict = None if err is None else f"{type(err).__name__}: {err}"
    allv = all_gather_object((mine, verdict), group=group)
    if err is not None:
        raise err
    refused = [(r, v) for r, (_, v) in enumerate(allv) if v is not None]
    if refused:
        r, v = refused[0]
        raise RefusedElsewhereError(f"rank {r} refused DistributedDataParallel's arguments, so no rank goes "
                                    f"on: {v}")
    allv = [m for m, _ in allv]
    for r, other in enumerate(allv):
        if other != allv[0]:
            diff = next((a, b) for a, b in zip(allv[0] + [None] * len(other), other + [None] * len(allv[0]))
                        if a != b)
            raise invalid("module", f"a model whose {diff[1][0] + ' ' + diff[1][1] if diff[1] else 'end'} "
                          f"is {diff[1][2:4] if diff[1] else 'missing'} on rank {r}",
                          f"the same model on every rank (rank 0 has "
                          f"{diff[0][0] + ' ' + diff[0][1] + ' ' + str(diff[0][2:4]) if diff[0] else 'nothing more'})")


class _Named:
    """A function shown by its name in a message."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def _hook_name(hook):
    mod, q = getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)
    if q is None:
        return repr(TypeOf(hook)) if not callable(hook) else repr(hook)
    return f"{mod}.{q}" if mod else q


_HOOK_OF = {None: "allreduce_hook", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}


def _hook_compression(hook, name):
    """The compression one of torch's default DDP hooks stands for (None: allreduce_hook);
    InvalidArgumentError naming any other hook and what is supported."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    except Exception:   # (a torch built without torch.distributed)
        dh = None
    for c, attr in _HOOK_OF.items():
        if dh is not None and hook is getattr(dh, attr, None):
            return c
    raise invalid("hook", _Named(name), "one of torch's default hooks (torch.distributed.algorithms."
                  "ddp_comm_hooks.default_hooks): allreduce_hook (the default reduction), fp16_compress_hook "
                  "(the same as compression=\"fp16\") or bf16_compress_hook (compression=\"bf16\"); other hooks "
                  "(PowerSGD, fp16_compress_wrapper, your own function) do not run on mpicomm's buckets: train "
                  "those with torch.nn.parallel.DistributedDataParallel (mpicomm.torch.init_process_group starts "
                  "torch.distributed from the mpirun job)")


def _check_hook_state(state, group):
    """A default hook's state: None, or torch's process group over the ranks the model trains on."""
    if state is None:
        return
    ranks = None
    try:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(state)
    except Exception:
        pass
    if ranks != list(get_group(group).ranks):
        raise invalid("state", TypeOf(state), "None, or torch's process group over the ranks the model trains on "
                      "(torch's default hooks take the process group as their state)")


def _other_tensor(g, v):
    """True when gradient ``g`` is not the bucket view ``v`` (nor shares its storage)."""
    return g is not v and (g.is_sparse or g.data_ptr() != v.data_ptr())


def _dense(g):
    """A gradient as dense values (nn.Embedding(sparse=True) makes sparse ones)."""
    return g.to_dense() if g.is_sparse else g


class _BufferSync:
    """Rank 0's (or ``root``'s) buffers (batch-norm statistics) to every rank: one broadcast
    per (dtype, device), through flat buffers allocated once."""

    def __init__(self, buffers, group):
        self.group = group
        by = {}
        for b in buffers:
            by.setdefault((b.dtype, b.device), []).append(b)
        self.parts = []
        for (dt, dev), bs in by.items():
            flat = torch.empty(sum(b.numel() for b in bs), dtype=dt, device=dev)
            views, off = [], 0
            for b in bs:
                views.append(flat[off:off + b.numel()].view(b.shape))
                off += b.numel()
            self.parts.append((bs, flat, views))

    def __call__(self, root=0):
        me = get_group(self.group).rank == root
        with torch.no_grad():
            for bs, flat, views in self.parts:
                if me:
                    TORCH.pack(flat, bs)
                broadcast(flat, root, group=self.group)
                if not me:
                    TORCH.copy_out(bs, views)


def _oneflow_keywords(broadcast_parameters, use_bucket, bucket_size):
    """OneFlow's DistributedDataParallel(module, *, broadcast_buffers, broadcast_parameters,
    bucket_size, use_bucket): accept what this wrapper does, refuse the rest saying what to write."""
    if not _flag("broadcast_parameters", broadcast_parameters):
        raise invalid("broadcast_parameters", False, "True or left out: the wrapper always starts every rank "
                      "from rank 0's parameters (OneFlow's broadcast_parameters=True, PyTorch's DDP)")
    if not _flag("use_bucket", use_bucket):
        raise invalid("use_bucket", False, "True or left out; for one all_reduce per parameter (OneFlow's "
                      "use_bucket=False) give bucket_cap_mb=0")
    if bucket_size is not None:
        raise invalid("bucket_size", bucket_size, "left out: OneFlow's bucket_size counts parameters per "
                      "bucket, mpicomm sizes buckets in MiB: bucket_cap_mb=25.0 by default (0: one "
                      "all_reduce per parameter)")


# torch DDP's keywords that change nothing here, each with the value that asks for nothing
# more (accepted), and what to write instead of any other value
_TORCH_ONLY = {
    "check_reduction": (False, "False or left out (deprecated in torch; the wrapper names a parameter that "
                        "got no gradient itself: find_unused_parameters)"),
    "mixed_precision": (None, "None or left out; for gradients that travel in half precision give "
                        "compression='bf16' or 'fp16'"),
    "device_mesh": (None, "None or left out; train a sub-group with group= (a name from mpicomm.create_group)"),
    "delay_all_reduce_named_params": (None, "None or left out (every bucket's all_reduce starts during backward)"),
    "param_to_hook_all_reduce": (None, "None or left out (every bucket's all_reduce starts during backward)"),
    "skip_all_reduce_unused_params": (False, "False or left out; see find_unused_parameters"),
}


def _torch_keywords(dim, init_sync, static_graph, rest):
    """torch DDP's keywords (dim, init_sync, static_graph and the rare ones in _TORCH_ONLY):
    accept what this wrapper does, refuse the rest saying what to write."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise invalid("dim", dim, "an int (torch DDP scatters inputs along it between a process's devices; "
                      "here each rank has one device, so it is not used)")
    _flag("init_sync", init_sync)
    _flag("static_graph", static_graph)
    for k, v in rest.items():
        if k not in _TORCH_ONLY:
            raise TypeError(f"DistributedDataParallel() got an unexpected keyword argument {k!r}")
        default, allowed = _TORCH_ONLY[k]
        if v is not default and v != default:
            raise invalid(k, v, allowed)


def _process_group(process_group, group):
    """torch DDP's process_group (after init): None or torch's world group over every rank in
    order is the world (group None); anything else is refused, naming group=."""
    if process_group is None:
        return group
    import torch.distributed as dist

    try:
        ranks = dist.get_process_group_ranks(process_group)
    except Exception:
        ranks = None
    if group is not None or ranks != list(range(CTX.world.size)):
        raise invalid("process_group", process_group,
                      "None, or torch's world group over every rank in order (mpicomm.torch.init_process_group's); "
                      "for a sub-group give group= the name of an mpicomm.create_group(name, ranks)")
    return None


class DistributedDataParallel(JoinSteps, nn.Module):
    """Wrap ``module`` for data-parallel training over mpicomm's group.

    At construction, where CUDA is available and the program has not chosen a device, GPU
    ``local_rank % device_count`` becomes current (each rank its own GPU; PyTorch's default
    is GPU 0 everywhere). Every rank takes rank 0's parameters and buffers (one fused
    broadcast per dtype and device). During each backward, a bucket's all_reduce starts
    as soon as its gradients are ready (buckets in reverse parameter order); backward
    returns once every bucket is reduced (on GPUs: once the reductions are queued before
    any later work on the current stream). ``param.grad`` is a view of its bucket.

    device_ids, output_device: accepted for torch DDP's call form and not used (the
        module's parameters decide the devices).
    dim, static_graph, check_reduction: accepted for torch DDP's call form, no effect
        (each rank has one device; the buckets follow the gradients' order after the first
        backward whatever static_graph says). init_sync=False leaves out the broadcast of
        rank 0's parameters and buffers at construction (the ranks must already agree).
        process_group: None or torch's world group (init_process_group's); a sub-group is
        an mpicomm group name, ``group=``. mixed_precision, device_mesh,
        delay_all_reduce_named_params, param_to_hook_all_reduce and
        skip_all_reduce_unused_params: only their defaults (InvalidArgumentError says what
        to write instead, e.g. ``compression="bf16"``).
    gradient_as_bucket_view: accepted (True or False) for torch DDP's call form: the
        gradients are always views of their buckets, as torch's True makes them (with
        False they would be tensors of their own: the values are the same).
    bucket_cap_mb: MiB per bucket (0: one all_reduce per parameter; None: one bucket).
    gradients_mean: average the gradients (True, as DDP) or sum them (False).
    compression: None, "fp16" or "bf16": float32 gradients travel in half precision
        (divided by the group size before the sum, so the sum cannot overflow).
    find_unused_parameters: what happens to a trainable parameter that gets no gradient
        in a step: True reduces it as zeros (its ``.grad`` is then the other ranks'
        average; where no rank gave it a gradient, its ``.grad`` stays None, as DDP leaves
        it, so that the optimizer skips it; one accumulated under no_sync() counts); False (default) finishes the step the same way, so no rank waits, and
        then raises InvalidArgumentError naming the parameters. The parameters are those
        trainable at construction: freeze layers (requires_grad=False) before wrapping.
    broadcast_buffers: broadcast rank 0's buffers before the first forward and before
        every forward that follows a synchronised one (grad on, not under no_sync), as DDP
        (its default): an evaluation under no_grad right after a training step is then a
        collective (every rank runs it), and sees rank 0's buffers.
    fusion_config: MindSpore split points, used instead of bucket_cap_mb.
    embedding_grads: how an ``nn.Embedding``'s lookup gradient is reduced: "auto"
        (default) gathers the step's ids and gradient rows from every rank and adds them
        into the reduced gradient when the table is 4 MiB or more and the group's ids are
        no more than its rows, else all-reduces the dense table; "all_gather" always
        gathers; "all_reduce" always all-reduces (DDP's way). The values are the same
        either way. Deciding costs one host exchange of the ranks' id counts per lookup
        and step. (Modules with max_norm, scale_grad_by_freq or sparse=True keep
        autograd's path.)
    group: the mpicomm group to train over (None: the world).
    broadcast_parameters, use_bucket, bucket_size: OneFlow's DDP keywords. True (their
        default) for the first two is what this wrapper does; ``broadcast_parameters=False``,
        ``use_bucket=False`` and any ``bucket_size`` (OneFlow counts parameters per bucket)
        raise InvalidArgumentError saying what to write instead (``bucket_cap_mb``).
    optimizer, overlap_step: with ``overlap_step=True``, ``optimizer`` (a torch.optim
        optimizer over the model's trainable parameters: SGD, Adam, AdamW and the other
        per-parameter ones) is applied by backward itself, bucket by bucket, as each
        bucket's reduction lands, overlapped with the reduction of the later buckets
        (torch's ``_apply_optimizer_in_backward`` / fused-optimizer DDP hook, with your
        optimizer): the parameters are the same as with ``optimizer.step()`` after the
        reduction. Call ``optimizer.zero_grad()`` as usual and leave ``optimizer.step()``
        out (it raises InvalidArgumentError). The optimizer's state stays its own
        (state_dict, LR schedulers work). Not with ``embedding_grads="all_gather"`` (a
        gathered gradient is complete only after the last bucket; "auto" reduces
        embeddings densely then), nor with steps that need every gradient first
        (gradient clipping by the global norm, GradScaler's unscale).
    register_comm_hook(state, hook): torch DDP's, for torch's default hooks
        (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): ``allreduce_hook``
        is the wrapper's own reduction, ``fp16_compress_hook`` and ``bf16_compress_hook``
        are ``compression="fp16"`` and ``"bf16"``. Once, before the first backward, on every
        rank; other hooks (PowerSGD, a function of your own) raise InvalidArgumentError.
    join(divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        torch DDP's context manager for uneven inputs: ``with model.join(): for x in
        my_batches: ...`` where ranks have different numbers of batches. A rank that has
        run out makes the others' calls (with zero gradients) until every rank is done; the
        mean divides by the group size (True) or by the ranks still training (False); then
        every rank takes the model of the last rank to finish. With
        throw_on_early_termination=True every rank raises InputsExhaustedError (a
        RuntimeError) once one rank has run out.

    A model without a parameter that requires a gradient is refused (InvalidArgumentError
    naming ``module``, on every rank; torch DDP raises RuntimeError there).

    After the first synchronised backward the buckets are planned again in the order the
    gradients became ready (rank 0's order on every rank), as DDP rebuilds its buckets;
    ``buckets`` shows the new plan. A fusion_config is kept as given.

    Calls ``mpicomm.init()`` first where mpicomm is not initialised. Raises
    InvalidArgumentError (alike on every rank) for a bad argument or when the ranks'
    models differ.
    """

    def __init__(self, module, device_ids=None, output_device=None, *, bucket_cap_mb=25.0,
                 gradients_mean=True, compression=None, find_unused_parameters=False,
                 broadcast_buffers=True, fusion_config=None, embedding_grads="auto", group=None, optimizer=None,
                 overlap_step=False, gradient_as_bucket_view=True, broadcast_parameters=True, use_bucket=True,
                 bucket_size=None, dim=0, init_sync=True, static_graph=False, process_group=None, **torch_ddp):
        super().__init__()
        # what a copy (copy.deepcopy, pickle) is rebuilt from (__getstate__)
        self._ctor = dict(bucket_cap_mb=bucket_cap_mb, gradients_mean=gradients_mean, compression=compression,
                          find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers,
                          fusion_config=fusion_config, embedding_grads=embedding_grads, group=group,
                          optimizer=optimizer, overlap_step=overlap_step,
                          gradient_as_bucket_view=gradient_as_bucket_view)
        self._lazy = False
        # every argument is checked here first and the verdicts exchanged with the model's
        # description, so that a bad argument on one rank raises on every rank at once (the
        # others would otherwise wait for it in the first collective)
        try:
            _oneflow_keywords(broadcast_parameters, use_bucket, bucket_size)
            _torch_keywords(dim, init_sync, static_graph, torch_ddp)
            if not isinstance(module, nn.Module):
                raise invalid("module", TypeOf(module), "a torch.nn.Module")
            _flag("gradients_mean", gradients_mean)
            _flag("gradient_as_bucket_view", gradient_as_bucket_view)
            check_mode(embedding_grads)
            _flag("overlap_step", overlap_step)
            if overlap_step and optimizer is None:
                raise invalid("optimizer", None, "a torch.optim.Optimizer over the model's parameters when "
                              "overlap_step=True (the optimizer backward applies bucket by bucket)")
            if optimizer is not None and not overlap_step:
                raise invalid("overlap_step", overlap_step, "True when optimizer= is given (the wrapper only "
                              "takes an optimizer to apply it bucket by bucket during backward; without it, "
                              "call optimizer.step() yourself and leave optimizer= out)")
            if overlap_step and embedding_grads == "all_gather":
                raise invalid("embedding_grads", embedding_grads, "'auto' or 'all_reduce' with overlap_step=True "
                              "(a gathered embedding gradient is complete only after the last bucket, so its "
                              "bucket could not be updated early)")
            self.find_unused_parameters = _flag("find_unused_parameters", find_unused_parameters)
            self.broadcast_buffers = _flag("broadcast_buffers", broadcast_buffers)
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            if not named:
                k = sum(1 for _ in module.parameters())
                raise invalid("module", TypeOf(module),
                              "a model with at least one parameter that requires a gradient (it has "
                              f"{f'{k} parameters, all with requires_grad=False' if k else 'no parameters'}; "
                              "as torch DDP says: DistributedDataParallel is not needed when a module doesn't "
                              "have any parameter that requires a gradient)")
            for n, p in named:
                if p.is_sparse:
                    raise invalid(f"parameter {n!r}", "a sparse tensor", "dense parameters")
            self._overlap = OverlappedStep(optimizer, [p for _, p in named], [n for n, _ in named]) \
                if overlap_step else None
            err = None
        except (InvalidArgumentError, TypeError) as e:
            err = e
        if not CTX.initialized:
            from .. import init

            init()
        # each rank's own GPU where the program chose none (PyTorch's default is GPU 0 on every rank)
        select_local_device(CTX.local_rank)
        try:
            group = _process_group(process_group, group)
        except InvalidArgumentError as e:
            err = err or e
        _same_model_everywhere(module if err is None else None, group, err)
        self._ctor["group"] = group
        if overlap_step:
            embedding_grads = "all_reduce"
        self.module = module
        self.group = group
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._bufs = [b for b in module.buffers()]
        self.overlap_step = overlap_step   # backward applies the optimizer: leave optimizer.step() out
        with torch.no_grad():
            every = list(module.parameters()) + self._bufs
            if every and init_sync:
                _broadcast_parameters(every, root=0, group=group)
        self.reducer = DistributedGradReducer(self._params, mean=gradients_mean, bucket_cap_mb=bucket_cap_mb,
                                              fusion_config=fusion_config, compression=compression, group=group,
                                              fp32_sync=False)   # (PyTorch's DDP: in the gradients' dtype)
        # big gradients reduced from where autograd leaves them, not copied into the buckets
        # first (the same calls on every rank: the plan decides them)
        self.reducer.direct_overlap = True
        if self._overlap is not None:
            self._overlap.plan(self.reducer.buckets)
            self.reducer.set_bucket_hook(self._overlap)
        self._views = self.reducer.grad_views()
        # a gradient already there moves into its bucket; a parameter without one keeps
        # .grad None until backward gives it one (as DDP: an unused parameter's stays None)
        with torch.no_grad():
            for p, v in zip(self._params, self._views):
                if p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = v
        self._buffer_sync = _BufferSync(self._bufs, group) if self._bufs else None
        self._size = get_group(group).size
        self._sync_enabled = True     # False inside no_sync()
        self._sync_step = True        # decided at forward time, as DDP does
        # DDP's require_forward_param_sync: rank 0's buffers are broadcast before the first
        # forward and before every forward that follows a synchronised one (grad on, not under
        # no_sync), whatever that forward is: an evaluation under no_grad after a training step
        # sees rank 0's statistics, and the first micro-step under no_sync gets them
        self._buffers_due = True
        self._in_backward = False
        self._comm_hook = None        # the name of the torch hook register_comm_hook() took
        self._backward_seen = False   # a backward reached the wrapper (register_comm_hook before it)
        self._join = None             # the join() block this rank is in (see _join.py)
        self._in_forward = False
        # the order gradients become ready in, recorded in the first synchronised backward
        # to re-plan the buckets once (as DDP does); not where a fusion_config fixes them
        self._order = [] if self.reducer.fusion_config is None and self._size > 1 else None
        # what the gathered embeddings see of the wrapper
        self._emb = EmbeddingGather(GatherContext(
            module=module, params=self._params, group=group, size=self._size,
            side_stream=lambda device: self.reducer.side_stream(TORCH, device),
            queue_end=self._queue_end,
            gathering=lambda: self._in_forward and self._sync_step and self._join is None), embedding_grads)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                       for i, p in enumerate(self._params)]

    def __getattr__(self, name):
        """nn.Module's lookup (parameters, buffers, submodules); a name the wrapped model has
        but the wrapper does not (OneFlow's tutorial's ``m.lr``) says where it is."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and not name.startswith("__") and hasattr(module, name):
                raise AttributeError(f"'DistributedDataParallel' object has no attribute {name!r}; the wrapped "
                                     f"model has it: write .module.{name} (the wrapper keeps the model in "
                                     ".module, as PyTorch's and OneFlow's DDP do)") from None
            raise

    # ----------------------------------------------------------- copies
    def __getstate__(self):
        """A copy (copy.deepcopy, pickle, torch.save of the whole wrapper) holds the module,
        the constructor's arguments (the optimizer copied along) and the train/eval mode; its
        buckets, hooks and communication are made again at its first forward with gradients
        on (a collective: on every rank alike, as training does). Until then it runs its
        module's forward alone, so that one rank may evaluate a copy by itself."""
        return {"module": self.module, "_ctor": self._ctor, "training": self.training,
                "_comm_hook": self._comm_hook}

    def __setstate__(self, state):
        nn.Module.__init__(self)
        self.module = state["module"]
        self._ctor = state["_ctor"]
        self.training = state["training"]
        self.overlap_step = self._ctor["overlap_step"]
        self.find_unused_parameters = self._ctor["find_unused_parameters"]
        self.broadcast_buffers = self._ctor["broadcast_buffers"]
        self._sync_enabled = True
        self._lazy = True
        self._comm_hook = state.get("_comm_hook")
        self._join = None

    def _build(self):
        """A copy's first training forward: made as the original was (its module's
        parameters and buffers taken from rank 0, the buckets planned)."""
        sync, training, hook = self._sync_enabled, self.training, self._comm_hook
        DistributedDataParallel.__init__(self, self.module, **self._ctor)
        self._sync_enabled = sync
        self._comm_hook = hook   # (its compression is in _ctor)
        self.train(training)

    # ----------------------------------------------------------- forward / no_sync
    def forward(self, *args, **kwargs):
        if self._lazy:
            if not torch.is_grad_enabled():
                return self.module(*args, **kwargs)
            self._build()
        self._sync_step = self._sync_enabled
        due = self.broadcast_buffers and self._buffer_sync is not None and self._size > 1 and self._buffers_due
        root = 0
        if self._join is not None:   # (torch under join: the buffers of the highest rank still training)
            root = self._join_forward(self._sync_enabled and torch.is_grad_enabled(), due)
        if due:
            self._buffer_sync(root)
        self._in_forward = True
        try:
            out = self.module(*args, **kwargs)
        finally:
            self._in_forward = False
        self._buffers_due = self._sync_enabled and torch.is_grad_enabled()
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backward passes of
        the forwards run inside; the first synchronised backward after it reduces the sum."""
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    # ----------------------------------------------------------- torch DDP's comm hooks
    def register_comm_hook(self, state, hook):
        """torch DDP's ``register_comm_hook(state, hook)`` for torch's default hooks
        (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): ``allreduce_hook``
        is the wrapper's own reduction, ``fp16_compress_hook`` / ``bf16_compress_hook`` are
        ``compression="fp16"`` / ``"bf16"`` (float32 gradients divided by the group size,
        summed in half precision, cast back). ``state``: None or torch's process group over
        the ranks the model trains on. Once, before the first backward, on every rank alike
        (the ranks compare what they registered: one host exchange). Any other hook
        (PowerSGD, the compress wrappers, a function of your own) raises InvalidArgumentError
        naming it and what is supported, as do a second call, a call after a backward and a
        hook that contradicts the constructor's ``compression`` or ``gradients_mean=False``."""
        if self._lazy:
            self._build()
        name, choice, err = _hook_name(hook), None, None
        try:
            if self._comm_hook is not None:
                raise InvalidArgumentError(
                    f"register_comm_hook() called a second time ({self._comm_hook} is registered; now {name}): "
                    "a DistributedDataParallel takes one communication hook, as torch DDP does")
            if self._backward_seen:
                raise InvalidArgumentError(
                    f"register_comm_hook(state, {name}) after a backward: register the hook before the first "
                    "backward (torch DDP's rule), right after wrapping the model")
            choice = _hook_compression(hook, name)
            _check_hook_state(state, self.group)
            if not self.reducer.mean:
                raise invalid("hook", _Named(name), "no hook with gradients_mean=False: torch's default hooks "
                              "average the gradients (divide by the group size); for a sum leave the hook out")
            given = self._ctor["compression"]
            if given is not None and given != choice:
                raise invalid("hook", _Named(name), f"a hook that agrees with compression={given!r} given to the "
                              f"constructor ({_HOOK_OF[given]}), or compression left out")
        except InvalidArgumentError as e:
            err = e
        allv = all_gather_object((name, choice, None if err is None else f"{type(err).__name__}: {err}"),
                                 group=self.group)
        if err is not None:
            raise err
        refused = [(r, v) for r, (_, _, v) in enumerate(allv) if v is not None]
        if refused:
            raise RefusedElsewhereError(f"rank {refused[0][0]} refused register_comm_hook, so no rank "
                                        f"registers it: {refused[0][1]}")
        differ = [r for r, (n, _, _) in enumerate(allv) if n != allv[0][0]]
        if differ:
            raise invalid("hook", _Named(name), f"the same hook on every rank (rank 0 registers {allv[0][0]}, "
                          f"rank {differ[0]} {allv[differ[0]][0]})")
        if self.reducer.set_compression(choice):
            self._take_views()
        self._comm_hook = name
        self._ctor["compression"] = choice

    # ----------------------------------------------------------- uneven inputs
    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """torch DDP's ``join()``: train with a different number of batches on each rank.

        ``with model.join(): for batch in my_batches: ...`` Each forward inside begins with
        a host exchange of the ranks' state; a rank whose loop has ended makes, for every
        step the others still take, the calls they make (their buffer broadcast, each
        bucket's all_reduce with zeros, ...), until no rank has inputs left; then every rank
        takes the parameters and buffers of the highest-numbered rank among those that
        finished last. Inside the block the buffers are broadcast from the highest rank
        still training (torch's rule there), embeddings are reduced densely, and one forward
        goes with each backward.

        divide_by_initial_world_size: True: the mean divides by the group size (a finished
            rank adds zeros); False: by the number of ranks still training. (With a
            registered torch hook: by the group size either way, as torch's hooks divide.)
        enable: False makes the block do nothing more than check the arguments.
        throw_on_early_termination: True: as soon as one rank has run out of inputs, every
            rank raises InputsExhaustedError (a RuntimeError, as torch's), the others at their
            next forward.

        Entering the block is a collective (the ranks compare the arguments: a bad or
        different one raises InvalidArgumentError on every rank).
        """
        if self._lazy:
            self._build()
        err = None
        try:
            check_join_arguments(divide_by_initial_world_size, enable, throw_on_early_termination)
            if self._join is not None:
                raise InvalidArgumentError("join() inside a join() block of the same model")
        except InvalidArgumentError as e:
            err = e
        args = (divide_by_initial_world_size, enable, throw_on_early_termination)
        allv = all_gather_small((args, None if err is None else f"{type(err).__name__}: {err}"), group=self.group)
        if err is not None:
            raise err
        refused = [(r, v) for r, (_, v) in enumerate(allv) if v is not None]
        if refused:
            raise RefusedElsewhereError(f"rank {refused[0][0]} refused join()'s arguments, so no rank "
                                        f"enters the block: {refused[0][1]}")
        differ = [r for r, (a, _) in enumerate(allv) if a != allv[0][0]]
        if differ:
            names = ("divide_by_initial_world_size", "enable", "throw_on_early_termination")
            k = next(k for k in range(3) if allv[differ[0]][0][k] != allv[0][0][k])
            raise invalid(names[k], args[k], f"the same value on every rank (rank 0 gives {allv[0][0][k]}, rank "
                          f"{differ[0]} {allv[differ[0]][0][k]})")
        if not enable:
            yield
            return
        self._join = JoinState(divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
            self._join_finish()
        finally:
            self.reducer.divisor = None
            self._join = None

    @property
    def buckets(self):
        """The bucket plan: lists of indices into :attr:`parameter_names`, in launch order."""
        if self._lazy:
            self._build()
        return self.reducer.buckets

    @property
    def parameter_names(self):
        """The names of the trainable parameters, in the order the bucket indices use."""
        if self._lazy:
            self._build()
        return list(self._names)

    @property
    def buckets_started(self):
        """How many buckets of the current backward have had their all_reduce issued."""
        if self._lazy:
            self._build()
        return self.reducer.launched

    # ----------------------------------------------------------- backward
    def _queue_end(self):
        """Make sure the end-of-backward work (every bucket reduced, the gathered embedding
        rows added, the unused-parameter check) runs when this backward ends: called from
        every place a gradient reaches the wrapper (a parameter's hook, a gathered lookup's
        backward), so that none is left out when only one of them fires."""
        if not self._in_backward:
            self._in_backward = True
            self._backward_seen = True
            if self._overlap is not None:
                self._overlap.begin()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, i, p):
        self._backward_seen = True
        if not self._sync_step:
            return
        self._queue_end()
        if self._order is not None:
            self._order.append(i)
        v = self._views[i]
        g = p.grad
        if _other_tensor(g, v):
            # a new tensor (after zero_grad(set_to_none=True)): a big one is reduced from
            # where it is into the bucket, a small one copied there first (a sparse one, from
            # nn.Embedding(sparse=True), as its dense values)
            p.grad = v
            with torch.no_grad():
                self.reducer.ready_from(i, _dense(g))
            return
        self.reducer.mark_ready(i)

    def _end_backward(self):
        self._in_backward = False
        red = self.reducer
        missing = red.pending()
        # No gradient this step: reduced as zeros (or as what no_sync() accumulated), in
        # bucket order, BEFORE any exchange: a rank that missed nothing has launched every
        # bucket during backward, so every rank must launch its remaining buckets first to
        # issue the same collectives in the same order (as DDP, whose used-parameter bitmap
        # is reduced after the last bucket).
        none = {i for i in missing if self._params[i].grad is None}   # (no_sync() gave the rest one)
        held = []
        hold = self._overlap is not None and bool(none) and self.find_unused_parameters
        if hold:
            # the overlapped updates of the buckets landing meanwhile wait until it is known
            # which parameters no rank used (those keep .grad None, so the optimizer skips them)
            red.set_bucket_hook(lambda idx, stream: held.append((idx, stream)))
        try:
            with torch.no_grad():
                for i in missing:
                    p, v = self._params[i], self._views[i]
                    if i in none:
                        v.zero_()
                    elif _other_tensor(p.grad, v):
                        v.copy_(_dense(p.grad))
                    p.grad = v
                    red.mark_ready(i)
            # parameters no rank gave a gradient keep .grad None, as DDP leaves them (an
            # optimizer then skips them); one some rank used gets the reduced gradient everywhere
            if self.find_unused_parameters:
                for i in self._unused_everywhere(sorted(none)):
                    self._params[i].grad = None
        finally:
            if hold:
                red.set_bucket_hook(self._overlap)
        for idx, stream in held:
            self._overlap(idx, stream)
        red.wait()   # (on GPUs also for the overlapped updates: queued on the reductions' streams)
        gathered = self._emb.finish(self._views, 1.0 / self._size if red.mean else 1.0)
        if missing and gathered:
            # gathered embeddings with no other gradient (untied): dense from the next step
            self._emb.dense.update(i for i in missing if i in gathered)
            missing = [i for i in missing if i not in gathered]
        if self._order is not None:
            self._replan(missing)
        if missing and not self.find_unused_parameters:
            raise InvalidArgumentError(self._unused_message(missing))

    def _unused_everywhere(self, missing):
        """The parameters that got no gradient on any rank this step (a host exchange of
        each rank's list, every synchronised backward with find_unused_parameters, as DDP's
        bitmap all_reduce, after every bucket is launched); gathered embedding rows count as
        a gradient. ``missing``: this rank's parameters with no gradient (``.grad`` None)."""
        gathered = {c.index for c in self._emb.launched}
        mine = [i for i in missing if i not in gathered]
        if self._size == 1:
            return set(mine)
        lists = all_gather_small(mine, group=self.group)
        return set(lists[0]).intersection(*lists[1:])

    def _unused_message(self, missing):
        """The unused-parameter error, with advice that fits what the user did: parameters
        frozen (requires_grad=False) after the wrapper was built are still among the ones
        it reduces, so freezing them is no remedy there; freezing before wrapping is."""
        def listed(idx):
            names = [self._names[i] for i in idx]
            return f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"

        frozen = [i for i in missing if not self._params[i].requires_grad]
        live = [i for i in missing if self._params[i].requires_grad]
        msg = f"{len(missing)} trainable parameter(s) got no gradient in this backward: {listed(missing)}"
        if live:
            msg += ("; pass find_unused_parameters=True to reduce them as zeros, or set requires_grad=False on "
                    f"{listed(live) if frozen else 'them'} before wrapping the model")
        if frozen:
            who = listed(frozen) if live else ("it" if len(frozen) == 1 else "they")
            msg += (f"; {who} {'was' if len(frozen) == 1 else 'were'} frozen (requires_grad=False) after the "
                    "model was wrapped, but the wrapper reduces every parameter that was trainable when it was "
                    "built: freeze layers before wrapping the model, or pass find_unused_parameters=True to "
                    "reduce them as zeros")
        return msg

    def _replan(self, missing):
        """Once, after the first synchronised backward: buckets in the order the gradients
        became ready (rank 0's order on every rank, as DDP), so that a bucket whose
        gradients come early (a tied embedding's head, layers registered out of use order)
        is reduced early. Parameters with no gradient go last."""
        order, self._order = list(dict.fromkeys(self._order)), None
        seen = set(order)
        order += [i for i in range(len(self._params) - 1, -1, -1) if i not in seen]
        order = broadcast_object(order, root=0, group=self.group)
        if self.reducer.replan(order):
            self._take_views()

    def _take_views(self):
        """The reducer's buckets were made again: every gradient moves into its new view."""
        if self._overlap is not None:
            self._overlap.plan(self.reducer.buckets)
        views = self.reducer.grad_views()
        with torch.no_grad():
            for p, v in zip(self._params, views):
                if p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = v
        self._views = views

    def __repr__(self):
        if self._lazy:
            return ("mpicomm.torch.DistributedDataParallel(a copy, made at its first forward with gradients on)\n"
                    f"  module: {self.module!r}")
        return (f"mpicomm.torch.DistributedDataParallel({len(self._params)} parameters in "
                f"{len(self.reducer.buckets)} buckets, group size {self._size})\n  module: {self.module!r}")
