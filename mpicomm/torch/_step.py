"""The optimizer step overlapped with the gradients' reduction (DistributedDataParallel(...,
optimizer=opt, overlap_step=True)).

Each bucket's parameters are updated as soon as that bucket's reduction has landed, while
the later buckets are still being reduced (and, on GPUs, backward goes on): the update of
the last buckets is what is left after backward, not the whole model's. This is what
torch's ``_apply_optimizer_in_backward`` and DDP's fused-optimizer comm hook do, with the
user's own optimizer: for every bucket an optimizer of the same class is made over that
bucket's parameters, with the user's param groups' options, and the user's per-parameter
state (momentum buffers, Adam moments and step counts) is shared with it, so
``optimizer.state_dict()`` / ``load_state_dict()`` and LR schedulers work on the user's
optimizer as usual (the groups' options are read again at every synchronised backward).
The update of a parameter is the same arithmetic as ``optimizer.step()`` after the full
reduction (the optimizers supported update each parameter from its own gradient and state
only), so the parameters are the same as with the unfused step.

On GPUs a bucket's update is queued on the stream its reduction ran on, right after it (so
it needs no wait of its own, and the current stream's wait for the reductions at the end of
backward covers it). A stream of its own for the updates was slower on 2 x H200 (ResNet-50
30.42 ms against 29.10 a step, no communication 28.74, in one interleaved run, 2026-11-28).
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, TypeOf, invalid

# the optimizers whose update of a parameter reads only that parameter's gradient and state
PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "Rprop",
                 "ASGD")


class OverlappedStep:
    """The per-bucket optimizers over ``params`` (the wrapper's trainable parameters, in its
    index order) for the user's ``optimizer``."""

    def __init__(self, optimizer, params, names):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise invalid("optimizer", TypeOf(optimizer), "a torch.optim.Optimizer over the wrapped "
                          "model's parameters (with overlap_step=True)")
        cls = type(optimizer)
        if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in PER_PARAMETER:
            raise invalid("optimizer", cls.__name__, "an optimizer whose update of a parameter reads only that "
                          "parameter's gradient and state, which overlap_step applies bucket by bucket: torch.optim."
                          + ", torch.optim.".join(PER_PARAMETER) + " (or overlap_step=False)")
        index = {id(p): i for i, p in enumerate(params)}
        self.group_of = {}   # wrapper index -> the optimizer's param group it is in
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                i = index.get(id(p))
                if i is None and not p.requires_grad:
                    continue   # frozen: no gradient, so torch's step() would skip it too
                if i is None:
                    raise invalid("optimizer", f"an optimizer with a parameter of shape {tuple(p.shape)} (group {gi}) "
                                  "that the wrapper does not reduce", "an optimizer over the wrapped model's "
                                  "trainable parameters only (with overlap_step=True each bucket's parameters are "
                                  "updated as its reduction lands; a parameter the wrapper does not reduce never is)")
                self.group_of[i] = gi
        self.opt = optimizer
        self.params = params
        self.names = names
        # a bucket's indices (as a set: the reducer hands them in its buffer's order, which puts
        # big directly reduced gradients last) -> (its optimizer, [(its group, the user's
        # group)]), or None where no parameter of the bucket is in the optimizer
        self.subs = {}
        self._handle = optimizer.register_step_pre_hook(self._refuse)

    @staticmethod
    def _refuse(optimizer, args, kwargs):
        raise InvalidArgumentError(
            f"{type(optimizer).__name__}.step() on the optimizer given to DistributedDataParallel(optimizer=..., "
            "overlap_step=True): backward has already updated every parameter, bucket by bucket, as its "
            "gradients' reduction landed; a second step would apply the update twice. Leave optimizer.step() "
            "out of the loop (zero_grad() stays), or pass overlap_step=False")

    def close(self):
        self._handle.remove()

    def plan(self, buckets):
        """Make the optimizers for the buckets ``buckets`` (lists of indices, the reducer's plan)."""
        opt, subs = self.opt, {}
        for idx in buckets:
            by = {}
            for i in idx:
                gi = self.group_of.get(i)
                if gi is not None:   # (a parameter not in the optimizer is not updated, as by its step)
                    by.setdefault(gi, []).append(self.params[i])
            if not by:
                subs[frozenset(idx)] = None
                continue
            pairs = [({**{k: v for k, v in opt.param_groups[gi].items() if k != "params"}, "params": ps},
                      opt.param_groups[gi]) for gi, ps in by.items()]
            sub = type(opt)([g for g, _ in pairs])
            for p in (p for ps in by.values() for p in ps):
                sub.state[p] = opt.state[p]   # one state: the user's optimizer holds it
            subs[frozenset(idx)] = (sub, list(zip(sub.param_groups, [pg for _, pg in pairs])))
        self.subs = subs

    def begin(self):
        """A synchronised backward starts: the groups' options as the user's are now (an LR
        scheduler changes those)."""
        for sub, pairs in filter(None, self.subs.values()):
            for sg, pg in pairs:
                for k, v in pg.items():
                    if k != "params":
                        sg[k] = v

    def __call__(self, indices, stream):
        """The reducer's bucket hook: bucket ``indices`` is reduced (on ``stream``'s order)."""
        key = frozenset(indices)
        if key not in self.subs:   # (a bucket the plan does not have: its update would be lost)
            raise RuntimeError(f"mpicomm.torch: the reducer reported a bucket of gradients {sorted(key)[:10]} that "
                               "the overlapped step has no optimizer for; please report this as a bug")
        entry = self.subs[key]
        if entry is None:
            return
        sub = entry[0]
        if stream is None:
            sub.step()
            return
        with torch.cuda.stream(stream):   # after the bucket's reduction, on its stream
            sub.step()
