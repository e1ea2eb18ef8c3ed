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


class JoinState:
    """One ``with model.join(...)`` block on this rank: its arguments, and this rank's gradients
    as they were when it ran out of inputs (put back when the block ends)."""

    def __init__(self, divide_by_initial_world_size, throw_on_early_termination):
        self.divide_initial = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.saved = None


class JoinSteps:
    """DistributedDataParallel's side of ``join()`` (mixed into the wrapper: ``self`` is the
    wrapper, ``self._join`` its JoinState inside the block)."""

    def _join_exchange(self, code):
        return all_gather_small(code, group=self.group)

    # ------------------------------------------------------------- a rank still training
    def _join_forward(self, sync, buffers):
        """One forward of a rank with inputs: the round's exchange; returns the rank the
        buffers come from (the highest one still training)."""
        codes = self._join_exchange(ACTIVE | (SYNC if sync else 0) | (BUFFERS if buffers else 0))
        active = [r for r, c in enumerate(codes) if c & ACTIVE]
        if self._join.throw and len(active) < len(codes):
            done = [r for r, c in enumerate(codes) if not c & ACTIVE]
            raise InputsExhaustedError(
                f"Detected at least one rank that exhausted inputs. Throwing across all ranks: rank(s) {done} "
                "of the group ran out of inputs inside DistributedDataParallel.join(throw_on_early_termination="
                "True), so every rank stops here")
        self.reducer.divisor = None if self._join.divide_initial or self._comm_hook is not None else len(active)
        return max(active)

    # ------------------------------------------------------------- a rank out of inputs
    def _join_finish(self):
        """This rank has left its loop: shadow the others' rounds until none trains, then
        take the final model from the highest of the ranks that finished last."""
        first = True
        while True:
            codes = self._join_exchange(FIRST if first else 0)
            active = [r for r, c in enumerate(codes) if c & ACTIVE]
            if not active:
                break
            rank = get_group(self.group).rank
            if self._join.throw:
                raise InputsExhaustedError(
                    f"Rank {rank} exhausted all inputs inside DistributedDataParallel.join("
                    f"throw_on_early_termination=True) while rank(s) {active} still train: every rank stops here")
            first = False
            if any(c & BUFFERS for c in codes):
                self._buffer_sync(max(active))
            sync = any(c & SYNC for c in codes)
            if sync:
                self._join_shadow_backward()
            self._buffers_due = sync   # (what the forward of the ranks still training set)
        last = [r for r, c in enumerate(codes) if c & FIRST]
        self._join_restore()
        with torch.no_grad():
            every = list(self.module.parameters()) + (self._bufs if self.broadcast_buffers else [])
            if every and self._size > 1:
                broadcast_parameters(every, root=max(last), group=self.group)

    def _join_shadow_backward(self):
        """The calls of a synchronised backward of the ranks still training, with zeros:
        every bucket's all_reduce in plan order, the unused-parameter exchange (this rank
        used nothing), the one-time bucket re-plan. This rank's gradients are kept aside
        and put back when the block ends."""
        red = self.reducer
        if self._join.saved is None:
            self._join.saved = [None if p.grad is None else p.grad.detach().clone() for p in self._params]
        hook = red.bucket_hook
        red.set_bucket_hook(None)   # (overlap_step: no optimizer update here)
        try:
            with torch.no_grad():
                for v in self._views:
                    v.zero_()
            for bucket in red.buckets:
                for i in bucket:
                    red.mark_ready(i)
            if self.find_unused_parameters and self._size > 1:
                all_gather_small(list(range(len(self._params))), group=self.group)
            red.wait()
        finally:
            red.set_bucket_hook(hook)
        if self._order is not None:
            self._order = []
            self._replan([])

    def _join_restore(self):
        """This rank's gradients as they were before it shadowed the others' backwards."""
        self.reducer.divisor = None
        saved, self._join.saved = self._join.saved, None
        if saved is None:
            return
        with torch.no_grad():
            for p, v, g in zip(self._params, self._views, saved):
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

