"""DistributedGradReducer: a model's gradients reduced in a few fused all_reduce calls.

A bucket holds gradients of one array family (NumPy, CuPy, PyTorch), one dtype and
one device, laid out one after another in a flat buffer allocated once. Buckets are
reduced in a fixed order (the plan's), the same on every rank, so that ranks that
finish their gradients in different orders still issue the same collectives in the
same order.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np

from .. import all_gather_object, all_reduce, batch
from .._dtypes import FLOAT_NAMES
from .._ops import ReduceOp
from .._state import CTX, env_bool, get_group
from ..errors import InvalidArgumentError, TypeOf, invalid
from . import context as _context
from .context import check_fusion_config, get_auto_parallel_context
from .checks import _GradChecks
from .copy_kernel import _multi_copy, _torch_multi_copy
from .families import CUPY, TORCH, _as_list, _contiguous, _key_plan
from .fused import broadcast_parameters
from .layout import _make_bucket
from .planner import check_bucket_cap_mb, plan_buckets
from .results import _out_slot
from .streams import _Null, _on_cupy_device

COMPRESSIONS = (None, "fp16", "bf16")
_FLOAT_NAMES = FLOAT_NAMES   # the dtypes gradients may have


class _Step(NamedTuple):
    """How one step issues its all-reduces, decided once as it starts.

    overlap: a mark_ready() step: each bucket launched as its last gradient is ready (on a
        side stream on NCCL, else a non-blocking request that wait() completes); False: a
        blocking reduce_() or reducer(grads).
    direct: big gradients of direct buckets reduced where they are, out of place from the
        caller's arrays (see _ops); False: every bucket reduced packed, in place.
    nccl_group: True when every bucket's all-reduces are launched as one coalesced block (a
        blocking step on NCCL with several buckets and group_launch on; see _nccl_group), or None;
        the post-steps (unscale, copy out of the wire buffer) then follow the group's end.
    """
    overlap: bool
    direct: bool
    nccl_group: bool | None = None


_OVERLAP_PACKED = _Step(overlap=True, direct=False)
_OVERLAP_DIRECT = _Step(overlap=True, direct=True)


def _agree(g, sig, err, params):
    """Compare the arguments' signature ``sig`` over group ``g``: every rank raises alike
    (its own ``err``, or the first rank's that has one), and ranks with different models
    are caught here, not in a hang."""
    allv = all_gather_object((repr(sig), None if err is None else str(err)), group=g.name)
    if err is not None:
        raise err
    bad = [(r, e) for r, (_, e) in enumerate(allv) if e]
    if bad:
        raise InvalidArgumentError(f"DistributedGradReducer arguments rejected on rank {bad[0][0]}: "
                                   f"{bad[0][1]}")
    diff = [r for r, (s, _) in enumerate(allv) if s != allv[0][0]]
    if diff:
        raise invalid("parameters", f"{len(params)} arrays", "the same parameters (shapes, dtypes) "
                      f"and options on every rank of the group; rank(s) {diff} differ from rank 0")


class DistributedGradReducer:
    """Reduce a model's gradients over a group in a few fused all_reduce calls.

    ``reducer(grads)`` returns new reduced gradients (same types, shapes and order);
    ``reducer.reduce_(grads)`` reduces them in place. For overlap with the backward
    pass, call ``reducer.mark_ready(i, grad)`` as each gradient is final (a bucket's
    all_reduce starts once all of its gradients are ready, buckets in plan order) and
    ``reducer.wait()`` at the end. Filling ``reducer.grad_views()`` directly avoids
    the packing copy.

    MindSpore's positional order: ``DistributedGradReducer(parameters, mean, degree)``;
    everything after ``degree`` is a keyword.

    parameters: the model's arrays (NumPy, CuPy or PyTorch), in registration order;
        the gradients have their shapes, dtypes and devices. With the auto-parallel
        context's ``parameter_broadcast=True`` they are overwritten here with group rank
        0's (pass the parameters themselves, not copies).
    mean: divide by the group size (None: the auto-parallel context's gradients_mean,
        False by default as in MindSpore: the gradients are summed).
        Half-precision buckets are divided before the sum, so the sum cannot overflow.
    degree: MindSpore's degree, the number of ranks the gradients come from: None or
        the group's size (anything else raises; mpicomm takes it from the group).
    bucket_cap_mb: MiB per bucket (0: one all_reduce per tensor; None: one per dtype).
    fusion_config: MindSpore split points, e.g. [20, 35], used instead of the cap
        (None: the context's all_reduce_fusion_config when set, else the cap).
    compression: "fp16" or "bf16" sends float32 gradients in half precision.
    fp32_sync: reduce float16/bfloat16 gradients in float32 (None: the context's
        gradient_fp32_sync, True by default as in MindSpore).
    group: the group to reduce over (None: the world).

    Raises InvalidArgumentError naming the argument, the value and what is allowed,
    alike on every rank (ranks compare their arguments once, here).
    """

    def __init__(self, parameters, mean=None, degree=None, *, bucket_cap_mb=25.0, fusion_config=None,
                 compression=None, fp32_sync=None, group=None):
        g = get_group(group)
        self.group = group
        self.size = g.size
        err, sig, params = None, None, None
        try:
            if degree is not None and (isinstance(degree, (bool, np.bool_)) or not isinstance(degree, (int, np.integer))
                                       or degree != g.size):
                raise invalid("degree", degree, f"None or {g.size}, the group's size (MindSpore's degree: the number "
                              "of ranks whose gradients are reduced; mpicomm takes it from the group). "
                              "bucket_cap_mb, fusion_config and the later arguments are keywords: "
                              "DistributedGradReducer(parameters, mean, bucket_cap_mb=...)")
            mean, fp32_sync, bcast = _context.reducer_settings(mean, fp32_sync)
            params = _as_list(parameters, "parameters")
            specs, keys = _key_plan(params, "parameters")
            for i, (fam, shape, dt, dev, nb) in enumerate(specs):
                if fam.dtype_name(dt) not in _FLOAT_NAMES:
                    raise invalid(f"parameters[{i}].dtype", fam.dtype_name(dt),
                                  "a floating or complex dtype (" + ", ".join(_FLOAT_NAMES) + ")")
            if not isinstance(mean, (bool, np.bool_)):
                raise invalid("mean", mean, "True, False or None (the context's gradients_mean)")
            cap = check_bucket_cap_mb(bucket_cap_mb)
            if fusion_config is None:
                fusion_config = get_auto_parallel_context("all_reduce_fusion_config") or None
            fc = check_fusion_config(fusion_config)
            if compression not in COMPRESSIONS:
                raise invalid("compression", compression, "None, 'fp16' or 'bf16'")
            if not isinstance(fp32_sync, (bool, np.bool_)):
                raise invalid("fp32_sync", fp32_sync, "True or False (None: the context's gradient_fp32_sync, "
                              "True by default)")
            group_launch = env_bool("MPICOMM_BUCKET_GROUP", True)
            plan = plan_buckets([s[4] for s in specs], keys, cap, fc)
            sig = ([(s[1], k[0], k[1]) for s, k in zip(specs, keys)], plan, bool(mean), compression,
                   bool(fp32_sync), bool(bcast))
        except InvalidArgumentError as e:
            err = e
        _agree(g, sig, err, params)
        if bcast:   # the context's parameter_broadcast: every rank starts from group rank 0's model
            broadcast_parameters(params, root=0, group=group)
        _context.reducer_made(self, g.size)
        self.mean = bool(mean)
        self.bucket_cap_mb = cap
        self.fusion_config = fc
        self.compression = compression
        self.fp32_sync = bool(fp32_sync)
        self._specs = specs
        self._checks = _GradChecks(specs)
        self._plan = plan
        self._keys = keys
        # mark_ready steps (overlap) use the direct structure (_ops) too: set by
        # mpicomm.torch.DistributedDataParallel, whose every rank takes the same path
        self.direct_overlap = False
        # called as bucket_hook(indices, stream) once a bucket of a mark_ready() step is
        # reduced (see set_bucket_hook); None: nothing
        self.bucket_hook = None
        # what a mean divides by (None: the group size); DistributedDataParallel.join() sets
        # the number of ranks still training where divide_by_initial_world_size=False
        self.divisor = None
        self._build(plan, specs)
        self._reset_step()
        self._sides = {}
        self._accumulating = False   # inside no_sync()
        self._acc = None             # the gradients summed inside no_sync(), per parameter
        # Blocking reductions (reduce_ / __call__) on NCCL issue every bucket's all-reduce
        # inside one NCCL group (ncclGroupStart/End): NCCL schedules them together instead
        # of one after the other, so small buckets lose little to one big buffer.
        # MPICOMM_BUCKET_GROUP=0 (or setting this attribute to False) issues them one by one.
        self.group_launch = group_launch

    # ----------------------------------------------------------- setup
    def _build(self, plan, specs):
        nccl = CTX.backend_name == "nccl"
        n = len(specs)
        self._views = [None] * n
        self._bucket_of = [0] * n
        self._pos = [0] * n          # gradient index -> its place in its bucket's members
        self._buckets = []
        for bi, idx in enumerate(plan):
            b = _make_bucket(idx, specs, self.compression, self.fp32_sync, self.mean, nccl)
            for j, (i, v) in enumerate(zip(b.indices, b.views)):
                self._views[i] = v
                self._bucket_of[i] = bi
                self._pos[i] = j
            self._buckets.append(b)

    def _reset_step(self):
        self._ready = [False] * len(self._specs)
        for b in self._buckets:
            b.remaining = len(b.indices)
            b.work = None
            b.srcs = None
            b.later = None
        self._next = 0
        self._given = {}
        self._active = False
        self._used_sides = []
        self._step = None  # this step's _Step, made as it starts
        self._keep = []    # sources read on a side stream, held until the step ends

    def replan(self, order):
        """Re-plan the buckets for gradients that become ready in ``order`` (every index
        once), as DDP rebuilds its buckets after the first backward; only between steps,
        and only where the cap made the plan (a fusion_config is kept). The caller passes
        the same order on every rank. New buffers: grad_views() must be taken again.
        Returns whether the plan changed."""
        self._check_idle("re-planning the buckets")
        if self.fusion_config is not None:
            return False
        plan = plan_buckets([s[4] for s in self._specs], self._keys, self.bucket_cap_mb, order=order)
        if plan == self._plan:
            return False
        self._plan = plan
        self._build(plan, self._specs)
        self._reset_step()
        return True

    def set_compression(self, compression):
        """Send float32 gradients in ``compression`` (None, "fp16" or "bf16") from the next
        step on; only between steps. The plan is kept, the buckets are made again (new
        buffers: grad_views() must be taken again). The caller does it on every rank alike.
        Returns whether anything changed."""
        self._check_idle("changing the compression")
        if compression not in COMPRESSIONS:
            raise invalid("compression", compression, "None, 'fp16' or 'bf16'")
        if compression == self.compression:
            return False
        for fam, _, _, _, _ in self._specs:
            if compression is not None:
                fam.half(compression)   # (raises for a family without that dtype: CuPy's bf16)
        self.compression = compression
        self._build(self._plan, self._specs)
        self._reset_step()
        return True

    @property
    def buckets(self):
        """The plan: lists of gradient indices, in the order their all_reduce runs."""
        return [list(b) for b in self._plan]

    # ----------------------------------------------------------- the step API
    # What a framework wrapper (mpicomm.torch.DistributedDataParallel) drives a step with,
    # besides mark_ready() and wait(): direct_overlap (set before the first step), the
    # gradients still pending, how many buckets have been launched, ready_from(), replan()
    # between steps, and the side stream its own calls of the step are ordered on.

    def pending(self):
        """The indices of the gradients not marked ready in the current step."""
        return [i for i, r in enumerate(self._ready) if not r]

    @property
    def launched(self):
        """How many buckets of the current step have had their all_reduce issued."""
        return self._next

    def set_bucket_hook(self, hook):
        """Call ``hook(indices, stream)`` as each bucket of a mark_ready() step has its reduced
        gradients in its grad_views() (``indices``: the bucket's gradient indices), so that a
        wrapper can apply that bucket's optimizer update while the later buckets are still
        being reduced. ``stream``: on NCCL, the side stream the reduction was enqueued on (the
        values are there in that stream's order, not yet on the host); None otherwise (the
        values are in place). Buckets come in plan order on NCCL; over MPI, as their
        requests complete (mark_ready() polls them), every one by the end of wait(). None
        removes the hook. Blocking steps (reduce_, reducer(grads)) never call it."""
        if hook is not None and not callable(hook):
            raise invalid("hook", TypeOf(hook), "a callable hook(indices, stream), or None")
        self.bucket_hook = hook

    def grad_views(self):
        """Arrays shaped like the parameters that are views into the persistent buckets.

        Writing the gradients into them (e.g. ``np.matmul(a, b, out=views[i])``) saves the
        packing copy; pass them to mark_ready / reduce_, which then copy nothing.
        """
        return list(self._views)

    # ----------------------------------------------------------- checks
    def _check_idle(self, what):
        if self._active:
            missing = self.pending()
            raise InvalidArgumentError(f"{what} during a step started with mark_ready() (gradients "
                                       f"{missing[:10]}{'...' if len(missing) > 10 else ''} not ready yet); "
                                       "finish it with wait() first")

    # ----------------------------------------------------------- reduction
    def _launch(self, b, step):
        fam, n = b.fam, self.size
        if b.later:   # the copies ready_from put off: one multi-tensor copy for the bucket
            dsts, srcs = zip(*b.later)
            b.later = None
            fam.copy_out(dsts, srcs)
        side = None
        if b.stream_mode and step.overlap:
            side = self._side(b)
            fam.side_waits_current(side)
            ctx = fam.on(side)
        else:
            ctx = _Null
        with ctx:
            if b.numel:
                if b.prescale:
                    fam.scale(b.wire, b.flat, self.divisor or n)
                elif b.wire is not b.flat:
                    fam.copy(b.wire, b.flat)
                if b.stream_mode or not step.overlap:
                    # enqueued on the stream (ordered, nothing to wait for on the host), or a
                    # blocking step on the host: a blocking call, which may take the
                    # shared-memory path
                    ops = self._ops(b, step.direct)
                    # one NCCL launch for the bucket's calls (nested in _launch_all's)
                    with batch(self.group, coalesce=True) if len(ops) > 1 and b.stream_mode else _Null:
                        for src, dst in ops:
                            all_reduce(src, b.op, out=dst, group=self.group, stream=side)
                    if b.srcs:
                        if side is not None:
                            # the sources are read on the side stream: PyTorch's allocator must
                            # not hand their memory out before that is done; CuPy's is held
                            for src, _ in b.srcs.values():
                                if fam is TORCH:
                                    src.record_stream(side)
                                else:
                                    self._keep.append(src)
                        b.srcs = None
                    if step.nccl_group is None:  # (else after the group: _launch_all)
                        self._post(b)
                        if step.overlap and self.bucket_hook is not None:
                            self.bucket_hook(b.indices, side)
                else:
                    b.work = all_reduce(b.wire, b.op, out=b.wire, group=self.group,
                                                    async_op=True)

    def _ops(self, b, direct):
        """(source, destination) of each all_reduce of bucket ``b``: the whole bucket in
        place, or, for a direct step on a bucket with big gradients, its packed small
        gradients in place and then one all_reduce per big gradient, from ``b.srcs[j]``
        where one is given (out of place, no copy) or in place in the bucket. Every rank
        issues the same calls (their number and sizes depend on the plan alone)."""
        if not (direct and b.direct):
            return ((b.wire, b.wire),)
        srcs = b.srcs or {}
        ops = []
        if b.small_numel:
            ops.append((b.small, b.small))  # (the result slot's in a reducer(grads) call)
        for j in range(b.nsmall, len(b.indices)):
            ops.append(srcs.get(j) or (b.views[j], b.views[j]))
        return ops

    def _post(self, b):
        d = self.divisor or self.size
        if b.postscale:
            b.fam.scale(b.flat, b.wire, d)
        elif b.wire is not b.flat:
            b.fam.copy(b.flat, b.wire)
        elif b.op is ReduceOp.AVG and d != self.size:   # (NCCL divided by the group size)
            b.fam.scale(b.flat, b.flat, d / self.size)

    def _side(self, b):
        return self.side_stream(b.fam, b.device)

    def side_stream(self, fam, device):
        """The side stream the step's all-reduces run on for (family, device); wait() makes
        the current stream wait for it."""
        key = (fam.name, device)
        s = self._sides.get(key)
        if s is None:
            s = self._sides[key] = fam.new_stream(device)
        if key not in self._used_sides:
            self._used_sides.append(key)
        return s

    def _launch_ready(self, step):
        bs = self._buckets
        while self._next < len(bs) and bs[self._next].remaining == 0:
            self._launch(bs[self._next], step)
            self._next += 1

    def _nccl_group(self):
        """True when every bucket goes to NCCL and there are several (one launch for all), else None."""
        bs = [b for b in self._buckets if b.numel]
        if not self.group_launch or len(bs) < 2 or not all(b.stream_mode for b in bs):
            return None
        return True

    def _launch_all(self, step):
        """Blocking step: launch every bucket (in one NCCL group where the step has one)."""
        if step.nccl_group is None:
            self._launch_ready(step)
            return
        # The post-steps (unscale, copy out of a compressed wire buffer) must follow the
        # all-reduces on the stream, and NCCL enqueues those only at the block's end.
        with batch(self.group, coalesce=True):
            self._launch_ready(step)
        for b in self._buckets:
            if b.numel:
                self._post(b)

    def _landed(self, b):
        """Bucket ``b``'s request has completed: its values into place, then the hook."""
        b.work = None
        self._post(b)
        if self.bucket_hook is not None:
            self.bucket_hook(b.indices, None)

    def _finish(self):
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
                self._landed(b)
        for key in self._used_sides:
            s = self._sides[key]
            fam = CUPY if key[0] == "cupy" else TORCH
            fam.current_waits_side(s)

    def _run(self, grads, into=None, into_views=None, into_small=None):
        """Reduce ``grads``; ``into``: a new flat buffer per bucket to pack into and reduce
        in place (the buckets' own buffers otherwise), with its views (``into_views``) and
        the view of its small-gradient range (``into_small``); big gradients on NCCL are
        then reduced straight from ``grads`` into their views (see _ops)."""
        self._check_idle("reducing")
        ptrs = None
        listed = isinstance(grads, (list, tuple)) and len(grads) == len(self._specs)
        if into is not None and self._checks.cupy is not None and listed:
            ptrs = self._checks.cupy_pointers(grads, self._views)
        elif self._checks.torch is not None and listed:
            if (into is not None or grads[0] is not self._views[0]) and self._buckets \
                    and all(b.stream_mode for b in self._buckets):
                ptrs = self._checks.torch_pointers(grads, self._views)   # CUDA tensors: packed by the CuPy copy kernel
            else:
                self._checks.torch_check(grads, self._views)
        else:
            self._checks.grads(grads, self._views)
        # blocking; direct where the results go to new buffers (big gradients reduced from
        # ``grads`` into them); grouped where _nccl_group allows
        step = self._step = _Step(overlap=False, direct=into is not None, nccl_group=self._nccl_group())
        saved = None
        if into is not None:
            saved = [(b.flat, b.wire, b.small) for b in self._buckets]
            for b, new, sm in zip(self._buckets, into, into_small):
                b.wire = new if b.wire is b.flat else b.wire
                b.flat, b.small = new, sm
        try:
            for bi, b in enumerate(self._buckets):
                given = [grads[i] for i in b.indices]
                ns = len(given)
                if step.direct and b.direct:
                    ns = b.nsmall
                    tv = into_views[bi]
                    srcs = b.srcs = {}
                    for j in range(ns, len(given)):
                        g = given[j]
                        if (ptrs[b.indices[j]] is not None) if ptrs is not None else _contiguous(g):
                            srcs[j] = (g, tv[j])
                        else:  # not contiguous: into its place first, then in place there
                            b.fam.copy(tv[j], g)
                            srcs[j] = (tv[j], tv[j])
                    if not ns:
                        continue
                    given = given[:ns]
                fresh = into is not None or all(g is not v for g, v in zip(given, b.views))
                src = None if ptrs is None else [ptrs[i] for i in b.indices[:ns]]
                if src is not None and None not in src and fresh \
                        and (b.fam is not TORCH or _on_cupy_device(b.device)):
                    # the pointers are at hand: one launch, no second pass over the arrays
                    sizes = b.sizes if ns == len(b.indices) else b.sizes[:ns]
                    if b.fam is TORCH:
                        _torch_multi_copy(b.device, src, b.flat.data_ptr(), sizes, True, sizes_key=sizes)
                    else:
                        _multi_copy(CUPY.lib(), src, b.flat.data.ptr, sizes, True, sizes_key=sizes)
                elif into_views is not None and b.fam is TORCH:
                    # one multi-tensor copy (_foreach_copy_)
                    TORCH.copy_out(into_views[bi][:ns] if ns < len(b.indices) else into_views[bi], given)
                elif fresh and (len(given) > 1 or into is not None):
                    # a constant number of launches per bucket
                    b.fam.pack(b.flat if ns == len(b.indices) else b.small, given)
                else:
                    for g, v in zip(given, b.views):
                        if g is not v:
                            b.fam.copy(v, g)
            for b in self._buckets:
                b.remaining = 0
            self._launch_all(step)
            self._finish()
        finally:
            if saved is not None:
                for b, (flat, wire, sm) in zip(self._buckets, saved):
                    b.flat, b.wire, b.small = flat, wire, sm
            self._reset_step()

    # ----------------------------------------------------------- gradient accumulation
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over several steps with no communication (what
        ``DistributedDataParallel.no_sync()`` does for a wrapped model).

        Inside the block, ``reducer(grads)`` and ``reducer.reduce_(grads)`` add ``grads`` into
        the reducer's own sum and return them unreduced; the first ``reducer(grads)``,
        ``reduce_(grads)`` or ``mark_ready()`` step after it reduces that sum plus its own
        gradients, once. Every rank must run the same steps inside and outside the block.
        mark_ready() inside it raises InvalidArgumentError.
        """
        self._check_idle("no_sync()")
        old = self._accumulating
        self._accumulating = True
        try:
            yield self
        finally:
            self._accumulating = old

    def _accumulate(self, grads):
        self._checks.grads(grads, [None] * len(self._specs))
        if self._acc is None:
            self._acc = [g.clone() if hasattr(g, "clone") else g.copy() for g in grads]
        else:
            for a, g in zip(self._acc, grads):
                a += g

    def _with_accumulated(self, grads, in_place):
        """``grads`` plus the sum accumulated inside no_sync() (then forgotten): new arrays,
        or added into ``grads`` where ``in_place``."""
        self._checks.grads(grads, self._views)
        acc, self._acc = self._acc, None
        if in_place:
            for g, a in zip(grads, acc):
                g += a
            return grads
        return [g + a for g, a in zip(grads, acc)]

    def __call__(self, grads):
        """Return the reduced gradients as new arrays (``grads`` is left as it is).

        Each bucket's gradients are packed into one new buffer (one copy launch per
        bucket, not one per gradient), reduced in place there, and returned as views of
        it, as PyTorch's ``_unflatten_dense_tensors`` gives them: no copy back.
        Inside :meth:`no_sync`: added to the accumulated sum and returned as given.
        """
        if self._accumulating:
            self._accumulate(grads)
            return list(grads)
        if self._acc is not None:
            grads = self._with_accumulated(grads, in_place=False)
        out = [None] * len(self._views)
        if isinstance(grads, (list, tuple)) and any(g is v for g, v in zip(grads, self._views)):
            self._run(grads)  # some gradients already live in the buckets: reduce there, then copy
            for b in self._buckets:
                flat = b.fam.clone(b.flat)
                for i, off, sz, shape in b.layout:
                    out[i] = b.fam.view(flat, off, sz, shape)
            return out
        slots = [_out_slot(b) for b in self._buckets]
        self._run(grads, into=[sl[0] for sl in slots], into_views=[sl[1] for sl in slots],
                  into_small=[sl[3] for sl in slots])
        for b, sl in zip(self._buckets, slots):
            for (i, _, _, _), v in zip(b.layout, sl[1]):
                out[i] = v
        return out

    def reduce_(self, grads):
        """Reduce ``grads`` in place and return it (no copies when they are grad_views()).
        Inside :meth:`no_sync`: added to the accumulated sum and left as they are."""
        if self._accumulating:
            self._accumulate(grads)
            return grads
        if self._acc is not None:
            self._with_accumulated(grads, in_place=True)
        self._run(grads)
        for b in self._buckets:
            pairs = [(grads[i], v, nb) for i, v, nb in zip(b.indices, b.views, b.sizes or b.indices)
                     if grads[i] is not v]
            if not pairs:
                continue
            if b.fam is TORCH and b.stream_mode and _on_cupy_device(b.device):
                # CUDA tensors: one launch of the CuPy copy kernel on PyTorch's stream
                dst = [d.data_ptr() if d.is_contiguous() else None for d, _, _ in pairs]
                if None not in dst:
                    _torch_multi_copy(b.device, dst, [v.data_ptr() for _, v, _ in pairs],
                                      [nb for _, _, nb in pairs], False)
                    continue
            b.fam.copy_out([d for d, _, _ in pairs], [v for _, v, _ in pairs])
        return grads

    def mark_ready(self, i, grad=None):
        """Record that gradient ``i`` is final; start its bucket's all_reduce once complete.

        grad: the gradient (copied into the bucket unless it is ``grad_views()[i]``, and
            written back by wait()); None when grad_views()[i] already holds it.
        """
        n = len(self._specs)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < n:
            raise invalid("i", i, f"a gradient index in 0..{n - 1}")
        i = int(i)
        if self._accumulating:
            raise InvalidArgumentError("mark_ready() inside no_sync(): accumulate with reducer(grads) or "
                                       "reduce_(grads) there, and overlap the step after the block")
        if self._ready[i]:
            raise invalid("i", i, "a gradient not yet marked ready in this step (call wait() to "
                          "finish the step before marking it again)")
        if grad is not None:
            self._checks.grad(i, grad, "grad", self._views[i])
            v = self._views[i]
            if grad is not v:
                self._specs[i][0].copy(v, grad)
                self._given[i] = grad
        if self._acc is not None and self._acc[i] is not None:   # what no_sync() accumulated
            v = self._views[i]
            v += self._acc[i]
            self._acc[i] = None
            if all(a is None for a in self._acc):
                self._acc = None
        if not self._active:
            self._begin_overlapped()
        self._ready[i] = True
        b = self._buckets[self._bucket_of[i]]
        b.remaining -= 1
        if b.remaining == 0:
            self._launch_ready(self._step)
        for b in self._buckets[:self._next]:  # let MPI progress the transfers in flight
            if b.work is not None and b.work.is_completed() and self.bucket_hook is not None:
                b.work.wait()
                self._landed(b)   # (the update overlaps the later buckets' transfers)

    def _begin_overlapped(self):
        """Start a mark_ready() step: overlapped, and direct where DistributedDataParallel
        set direct_overlap."""
        self._step = _OVERLAP_DIRECT if self.direct_overlap else _OVERLAP_PACKED
        self._active = True

    def ready_from(self, i, g):
        """Gradient ``i`` is final in ``g``, a tensor of its own (mpicomm.torch's DDP after
        ``zero_grad(set_to_none=True)``): a big gradient of a direct step is reduced from
        ``g`` straight into ``grad_views()[i]``; any other is copied there (a PyTorch one
        together with the bucket's other such gradients, in one multi-tensor copy on the
        current stream as the bucket launches)."""
        direct = self._step.direct if self._active else self.direct_overlap  # (what the step will be)
        direct = direct and self._acc is None   # (an accumulated sum is added in the bucket)
        b = self._buckets[self._bucket_of[i]]
        j = self._pos[i]
        v = self._views[i]
        if direct and b.direct and j >= b.nsmall and _contiguous(g):
            if b.srcs is None:
                b.srcs = {}
            b.srcs[j] = (g, v)
        elif self._acc is None and b.fam is TORCH and g.dtype == v.dtype and g.device == v.device:
            # copied with the bucket's other such gradients as it launches: one multi-tensor
            # kernel on the current stream instead of one copy per gradient
            if b.later is None:
                b.later = []
            b.later.append((v, g))
        else:
            self._specs[i][0].copy(v, g)
        self.mark_ready(i)

    def wait(self):
        """Finish the step: wait for every bucket and return the reduced gradients.

        The arrays given to mark_ready hold the reduced values afterwards; the list has
        them (or the grad views) in the parameters' order. Raises InvalidArgumentError
        when some gradient was not marked ready.
        """
        missing = self.pending()
        if missing:
            raise InvalidArgumentError(
                f"wait() before every gradient was marked ready: missing {len(missing)} of "
                f"{len(self._ready)} (indices {missing[:20]}{'...' if len(missing) > 20 else ''}); "
                "call mark_ready(i, grad) for each")
        self._finish()
        out = list(self._views)
        for i, g in self._given.items():
            self._specs[i][0].copy(g, self._views[i])
            out[i] = g
        self._reset_step()
        return out

    def __repr__(self):
        return (f"DistributedGradReducer({len(self._specs)} gradients in {len(self._plan)} buckets, "
                f"mean={self.mean}, bucket_cap_mb={self.bucket_cap_mb}, fusion_config={self.fusion_config}, "
                f"compression={self.compression!r}, fp32_sync={self.fp32_sync}, group={self.group!r})")
