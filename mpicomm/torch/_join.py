"""``DistributedDataParallel.join()``: training with uneven inputs, as torch DDP's.

Inside the block every forward of a rank that still has inputs begins with one host
exchange (``all_gather_small``) of each rank's state: still training or not, whether this
forward's backward synchronises (gradients on, not under ``no_sync``), whether its buffers
are broadcast first. A rank that has left its loop (``__exit__``) answers that exchange
with "done" and, for each round in which some rank still trains, makes the calls those
ranks make: the buffer broadcast (from the highest rank still training, as torch DDP
under join takes its buffers from there) and, where they synchronise, every bucket's
all_reduce of zeros in plan order through the same reducer (so the calls, their sizes and
dtypes are theirs), the unused-parameter exchange, and the bucket re-plan's broadcast.
When no rank trains any more, every rank takes the parameters and buffers of the highest
rank among those that finished last (torch's ``_sync_final_model``).

The mean divides by the group size (torch's ``divide_by_initial_world_size=True``) or by
the number of ranks still training (False: the reducer's ``divisor``, set at each forward);
a registered torch communication hook divides by the group size either way, as torch's
hooks do.
"""
from __future__ import annotations

import torch

from .._objects import all_gather_small
from .._state import get_group
from ..errors import InputsExhaustedError, invalid
from ..training.fused import broadcast_parameters

ACTIVE, SYNC, BUFFERS, FIRST = 1, 2, 4, 8   # a rank's state in a round's exchange


class Join:
    """The state of one ``with model.join(...)`` block on this rank."""

    def __init__(self, ddp, divide_by_initial_world_size, throw_on_early_termination):
        self.ddp = ddp
        self.divide_initial = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.saved = None   # this rank's gradients as they were when it ran out of inputs

    def _exchange(self, code):
        return all_gather_small(code, group=self.ddp.group)

    # ------------------------------------------------------------- a rank still training
    def forward(self, sync, buffers):
        """One forward of a rank with inputs: the round's exchange; returns the rank the
        buffers come from (the highest one still training)."""
        codes = self._exchange(ACTIVE | (SYNC if sync else 0) | (BUFFERS if buffers else 0))
        active = [r for r, c in enumerate(codes) if c & ACTIVE]
        if self.throw and len(active) < len(codes):
            done = [r for r, c in enumerate(codes) if not c & ACTIVE]
            raise InputsExhaustedError(
                f"Detected at least one rank that exhausted inputs. Throwing across all ranks: rank(s) {done} "
                "of the group ran out of inputs inside DistributedDataParallel.join(throw_on_early_termination="
                "True), so every rank stops here")
        ddp = self.ddp
        ddp.reducer.divisor = None if self.divide_initial or ddp._comm_hook is not None else len(active)
        return max(active)

    # ------------------------------------------------------------- a rank out of inputs
    def finish(self):
        """This rank has left its loop: shadow the others' rounds until none trains, then
        take the final model from the highest of the ranks that finished last."""
        ddp = self.ddp
        first = True
        while True:
            codes = self._exchange(FIRST if first else 0)
            active = [r for r, c in enumerate(codes) if c & ACTIVE]
            if not active:
                break
            rank = get_group(ddp.group).rank
            if self.throw:
                raise InputsExhaustedError(
                    f"Rank {rank} exhausted all inputs inside DistributedDataParallel.join("
                    f"throw_on_early_termination=True) while rank(s) {active} still train: every rank stops here")
            first = False
            if any(c & BUFFERS for c in codes):
                ddp._buffer_sync(max(active))
            sync = any(c & SYNC for c in codes)
            if sync:
                self._shadow_backward()
            ddp._buffers_due = sync   # (what the forward of the ranks still training set)
        last = [r for r, c in enumerate(codes) if c & FIRST]
        self.restore()
        with torch.no_grad():
            every = list(ddp.module.parameters()) + (ddp._bufs if ddp.broadcast_buffers else [])
            if every and ddp._size > 1:
                broadcast_parameters(every, root=max(last), group=ddp.group)

    def _shadow_backward(self):
        """The calls of a synchronised backward of the ranks still training, with zeros:
        every bucket's all_reduce in plan order, the unused-parameter exchange (this rank
        used nothing), the one-time bucket re-plan. This rank's gradients are kept aside
        and put back when the block ends."""
        ddp = self.ddp
        red = ddp.reducer
        if self.saved is None:
            self.saved = [None if p.grad is None else p.grad.detach().clone() for p in ddp._params]
        hook = red.bucket_hook
        red.set_bucket_hook(None)   # (overlap_step: no optimizer update here)
        try:
            with torch.no_grad():
                for v in ddp._views:
                    v.zero_()
            for bucket in red.buckets:
                for i in bucket:
                    red.mark_ready(i)
            if ddp.find_unused_parameters and ddp._size > 1:
                all_gather_small(list(range(len(ddp._params))), group=ddp.group)
            red.wait()
        finally:
            red.set_bucket_hook(hook)
        if ddp._order is not None:
            ddp._order = []
            ddp._replan([])

    def restore(self):
        """This rank's gradients as they were before it shadowed the others' backwards."""
        ddp = self.ddp
        ddp.reducer.divisor = None
        saved, self.saved = self.saved, None
        if saved is None:
            return
        with torch.no_grad():
            for p, v, g in zip(ddp._params, ddp._views, saved):
                if g is None:
                    p.grad = None
                else:
                    v.copy_(g)
                    p.grad = v


def check_join_arguments(divide_by_initial_world_size, enable, throw_on_early_termination):
    """join()'s flags, each True or False; raises InvalidArgumentError naming the first bad one."""
    for name, v in (("divide_by_initial_world_size", divide_by_initial_world_size), ("enable", enable),
                    ("throw_on_early_termination", throw_on_early_termination)):
        if not isinstance(v, bool):
            raise invalid(name, v, "True or False")

