"""Embedding gradients by all_gather: the rows a step looked up, not the whole table.

An ``nn.Embedding``'s gradient is zero outside the rows its input ids name. When the
group's ids in a step are fewer than the table's rows, gathering (ids, gradient rows)
from every rank and adding them into the reduced gradient moves less data than
all-reducing the dense table, as Horovod does for sparse gradients.

It matters most for a tied embedding (GPT-2's token table, also its output head): the
head's gradient is ready at the start of backward, the lookup's only at its end, so a
dense all_reduce of the whole table waits for the end and nothing hides it. With the
lookup's part gathered, the weight's autograd gradient is the head's alone: its bucket
is reduced during backward, and only the (smaller) gather is left at the end.

How: a forward hook on the embedding module returns the same values through a function
that cuts the lookup's edge to the weight and, in backward, gathers the ids and the
output's gradient (on the reducer's side stream on NCCL, asynchronously on MPI), and
queues the wrapper's end-of-backward callback (no parameter hook may fire in this
backward: a frozen head, a loss straight from the lookup); that callback adds them into
``weight.grad`` after the step's all-reduces (``index_add_``, divided by the group size
for a mean) before backward returns. A weight that gets no other gradient (an untied
embedding) is reduced as zeros in that first step and keeps the dense path afterwards.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from .. import all_gather
from .._backends.capture import current_capturing
from .._objects import all_gather_small
from .._state import CTX
from ..errors import invalid
from ..training.families import TORCH

MODES = ("auto", "all_gather", "all_reduce")
# "auto" leaves tables smaller than this on the dense path: all-reducing them costs little,
# and each gathered lookup costs a host exchange of the ranks' id counts per step
AUTO_MIN_TABLE_BYTES = 4 << 20


def check_mode(mode):
    if mode not in MODES:
        raise invalid("embedding_grads", mode, "'auto' (gather a step's rows when the group's ids are "
                      "no more than the table's rows), 'all_gather' or 'all_reduce'")
    return mode


class _Cut(torch.autograd.Function):
    """The lookup's values with no edge to the weight; backward hands the output's
    gradient to ``call``."""

    @staticmethod
    def forward(ctx, anchor, value, call):
        ctx.call = call
        return value.clone()  # a tensor of its own (a view could not be modified in place)

    @staticmethod
    def backward(ctx, grad):
        call = ctx.call  # (kept: a second backward of a retained graph gathers again)
        # the gathered rows are added (and waited for) by the wrapper's end-of-backward
        # callback: queued here too, as no parameter hook fires where the lookup is the only
        # path to a trainable parameter (a frozen head, a loss straight from the lookup)
        call.owner.ctx.queue_end()
        call.launch(grad)
        return None, None, None


class _Call:
    """One gathered lookup of one step: its ids and, after backward, the gathered rows."""

    __slots__ = ("owner", "index", "module", "ids", "counts", "works", "all_ids", "all_rows")

    def __init__(self, owner, index, module, ids, counts):
        self.owner, self.index, self.module, self.ids, self.counts = owner, index, module, ids, counts
        self.works, self.all_ids, self.all_rows = (), None, None

    def launch(self, grad):
        ctx = self.owner.ctx
        w = self.module.weight
        d = w.shape[1]
        ids = self.ids.reshape(-1)
        rows = grad.reshape(-1, d)
        if rows.dtype != w.dtype:
            rows = rows.to(w.dtype)
        pad = self.module.padding_idx
        if pad is not None:  # the padding row gets no gradient, as in nn.Embedding
            rows = rows.masked_fill((ids == pad).unsqueeze(1), 0)
        ids, rows = ids.contiguous(), rows.contiguous()
        total = sum(self.counts)
        sizes = None if len(set(self.counts)) == 1 else list(self.counts)
        # NCCL: ordered on the reducer's side stream after its all-reduces; MPI: async, waited in add_into
        side = ctx.side_stream(str(w.device)) \
            if rows.is_cuda and CTX.backend_name == "nccl" else None
        if side is not None:
            TORCH.side_waits_current(side)
        with TORCH.on(side) if side is not None else contextlib.nullcontext():
            self.all_ids = torch.empty(total, dtype=ids.dtype, device=w.device)
            self.all_rows = torch.empty(total, d, dtype=rows.dtype, device=w.device)
            works = [all_gather(a, out=o, group=ctx.group, async_op=side is None, stream=side,
                                            sizes=sizes) for a, o in ((ids, self.all_ids), (rows, self.all_rows))]
        if side is None:
            self.works = works
        else:
            ids.record_stream(side)
            rows.record_stream(side)
            # read on the current stream after wait(): not to be reused before that is done
            cur = torch.cuda.current_stream(w.device)
            self.all_ids.record_stream(cur)
            self.all_rows.record_stream(cur)
        self.owner.launched.append(self)

    def add_into(self, grad, scale):
        for w in self.works:
            w.wait()
        self.works = ()
        if grad.is_cuda:
            # index_add_ on a GPU adds the rows of one id atomically, in no fixed order: the
            # ranks would end with parameters that differ in their last bits. PyTorch's
            # deterministic index_add_ (the same gathered rows give the same bits on every rank)
            mode, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                grad.index_add_(0, self.all_ids, self.all_rows, alpha=scale)
            finally:
                torch.use_deterministic_algorithms(mode, warn_only=warn)
        else:
            grad.index_add_(0, self.all_ids, self.all_rows, alpha=scale)
        self.all_ids = self.all_rows = None


class GatherContext(NamedTuple):
    """What the gathered embeddings see of the wrapper (DistributedDataParallel)."""

    module: nn.Module          # the wrapped model, whose nn.Embedding modules are hooked
    params: list               # the reduced parameters, in the reducer's index order
    group: str | None
    size: int                  # the group's size
    side_stream: Callable[[str], Any]   # device -> the reducer's side stream of the step there
    queue_end: Callable[[], None]       # make sure the wrapper's end-of-backward work runs
    gathering: Callable[[], bool]       # inside a forward whose backward synchronises


class EmbeddingGather:
    """The wrapper's gathered embeddings: forward hooks on the eligible ``nn.Embedding``
    modules, the step's launched gathers, and which weights stay dense."""

    def __init__(self, ctx, mode):
        self.ctx = ctx       # a GatherContext: what this sees of the wrapper
        self.mode = mode  # (checked by the wrapper)
        self.launched = []   # _Call objects whose gathers were issued in this backward
        self.dense = set()   # parameter indices kept on the dense path (no other gradient)
        self._anchors = {}
        self.handles = []
        if mode == "all_reduce" or ctx.size == 1:
            return
        index = {id(p): i for i, p in enumerate(ctx.params)}
        for mod in ctx.module.modules():
            # max_norm renormalises rows in the lookup, scale_grad_by_freq divides by local
            # counts, sparse=True makes its own gradient: those keep autograd's path
            w = mod.weight if type(mod) is nn.Embedding else None
            if w is not None and id(w) in index and mod.max_norm is None \
                    and not mod.scale_grad_by_freq and not mod.sparse \
                    and (mode == "all_gather" or w.numel() * w.element_size() >= AUTO_MIN_TABLE_BYTES):
                self.handles.append(mod.register_forward_hook(
                    functools.partial(self._hook, index[id(mod.weight)]), with_kwargs=True))

    def _anchor(self, device):
        a = self._anchors.get(device)
        if a is None:
            a = self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return a

    def _hook(self, i, mod, args, kwargs, out):
        ctx = self.ctx
        if not ctx.gathering() or i in self.dense or not torch.is_grad_enabled() \
                or not out.requires_grad:
            return None
        ids = args[0] if args else kwargs.get("input")
        if current_capturing():
            raise invalid("embedding_grads", repr(self.mode), '"all_reduce" for a step captured in a CUDA '
                          "graph: gathering the rows exchanges the step's id counts on the host, which a "
                          "replay would not repeat")
        # every rank decides alike: from the group's id counts, exchanged on the host
        counts = all_gather_small(int(ids.numel()), group=ctx.group)
        if self.mode == "auto" and sum(counts) > mod.num_embeddings:
            return None
        call = _Call(self, i, mod, ids.detach(), counts)
        return _Cut.apply(self._anchor(out.device), out.detach(), call)

    def finish(self, grads, scale):
        """Add the step's gathered rows into the reduced gradients (after the reducer's
        wait); returns the parameter indices that got gathered rows."""
        done = set()
        calls, self.launched = self.launched, []
        with torch.no_grad():
            for c in calls:
                c.add_into(grads[c.index], scale)
                done.add(c.index)
        return done
