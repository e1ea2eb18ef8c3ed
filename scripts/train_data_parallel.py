#!/usr/bin/env python
"""Data-parallel training of an MLP classifier with mpicomm.

    mpicomm-run -n 2 python scripts/train_data_parallel.py            # scikit-learn's digits
    DATA_PATH=~/mnist mpicomm-run -n 4 python scripts/train_data_parallel.py --hidden 256

NumPy on the MPI backend, CuPy on NCCL. The forward and backward passes are written
by hand; each rank trains on its shard of every global batch (DistributedSampler),
the backward pass writes the gradients straight into the reducer's buckets and marks
each one ready as soon as it is final, so the fused all_reduce of the last layers
runs while the first layers' gradients are still being computed. The parameters are
broadcast from rank 0 first, so every rank starts from the same model.

Rank 0 prints ``epoch: E step: S, loss is L`` and the held-out accuracy.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

# datasets.py sits next to this script (and finds mpicomm in a checkout that is not installed);
# put its folder first also when the script is loaded by path (tests) rather than run, so a
# `datasets` package elsewhere does not win.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from datasets import finish, load_digits, load_mnist, local_batch_size, training_parser  # noqa: E402

import mpicomm  # noqa: E402


# ---------------------------------------------------------------- the model

def init_params(sizes, seed, xp=np, dtype=np.float64):
    """[W1, b1, W2, b2, ...] for layer sizes [d, h1, ..., classes] (He initialisation)."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append(xp.asarray(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in), dtype=dtype))
        params.append(xp.asarray(rng.standard_normal(fan_out) * 0.01, dtype=dtype))
    return params


def forward(params, x, xp=np):
    """Logits and the activations the backward pass needs."""
    acts = [x]
    h = x
    nl = len(params) // 2
    for layer in range(nl):
        z = h @ params[2 * layer] + params[2 * layer + 1]
        h = xp.maximum(z, 0) if layer < nl - 1 else z
        acts.append(h)
    return h, acts


def loss_and_grads(params, x, y, grads, xp=np, ready=None):
    """Mean softmax cross-entropy over the batch; writes d loss / d params into ``grads``.

    grads: arrays shaped like params (e.g. a reducer's grad_views()), written in place
        in backward order, last layer first. ready(i) is called as soon as grads[i] is final.
    Returns the loss (a 0-d array of xp).
    """
    logits, acts = forward(params, x, xp)
    m = x.shape[0]
    z = logits - logits.max(axis=1, keepdims=True)
    ez = xp.exp(z)
    s = ez.sum(axis=1, keepdims=True)
    rows = xp.arange(m)
    loss = (xp.log(s[:, 0]) - z[rows, y]).mean()
    d = ez / s
    d[rows, y] -= 1
    d /= m
    for layer in reversed(range(len(params) // 2)):
        iw, ib = 2 * layer, 2 * layer + 1
        xp.sum(d, axis=0, out=grads[ib])
        if ready is not None:
            ready(ib)
        xp.matmul(acts[layer].T, d, out=grads[iw])
        if ready is not None:
            ready(iw)
        if layer:
            d = (d @ params[iw].T) * (acts[layer] > 0)
    return loss


class SGD:
    """SGD with momentum: v = momentum * v + g; p -= lr * v."""

    def __init__(self, params, lr, momentum=0.9, xp=np):
        self.params, self.lr, self.momentum = params, lr, momentum
        self.vel = [xp.zeros_like(p) for p in params]

    def step(self, grads):
        for p, v, g in zip(self.params, self.vel, grads):
            v *= self.momentum
            v += g
            p -= self.lr * v


def correct_count(params, x, y, xp=np, batch=1024):
    n = 0
    for i in range(0, x.shape[0], batch):
        logits, _ = forward(params, x[i:i + batch], xp)
        n += int((logits.argmax(axis=1) == y[i:i + batch]).sum())
    return n


# ---------------------------------------------------------------- training

def parse_args(argv=None):
    p = training_parser(__doc__.split("\n\n")[0])
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--no-overlap", action="store_true", help="reduce after the backward pass")
    p.add_argument("--data-path", default=os.environ.get("DATA_PATH"),
                   help="directory of MNIST IDX files (default: $DATA_PATH; unset: sklearn's digits)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    mpicomm.init()
    rank, n = mpicomm.get_rank(), mpicomm.get_group_size()
    if mpicomm.get_backend() == "nccl":
        import cupy as xp
    else:
        xp = np
    mpicomm.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                      parameter_broadcast=True)

    (xtr, ytr), (xte, yte) = load_mnist(args.data_path) if args.data_path else load_digits(seed=args.seed)
    local_batch = local_batch_size(args.batch_size, n)
    dtype = np.dtype(args.dtype)
    xtr, ytr = xp.asarray(xtr, dtype=dtype), xp.asarray(ytr)
    xte_mine, yte_mine = xp.asarray(xte[rank::n], dtype=dtype), xp.asarray(yte[rank::n])
    sizes = [xtr.shape[1], *args.hidden, int(ytr.max()) + 1]

    # every rank draws its own initial model; the broadcast makes them all rank 0's
    params = init_params(sizes, args.seed + rank, xp, dtype)
    if mpicomm.get_auto_parallel_context("parameter_broadcast"):
        mpicomm.broadcast_parameters(params, root=0)
    reducer = mpicomm.DistributedGradReducer(params, bucket_cap_mb=args.bucket_cap_mb)
    grads = reducer.grad_views()
    opt = SGD(params, args.lr, args.momentum, xp)
    sampler = mpicomm.DistributedSampler(xtr.shape[0], shuffle=True, seed=args.seed)
    if rank == 0:
        print(f"mpicomm {mpicomm.get_backend()} backend, {n} rank(s); data {xtr.shape[0]} train / "
              f"{len(yte)} test, layers {sizes}, global batch {local_batch * n}, "
              f"{len(reducer.buckets)} gradient bucket(s)", flush=True)
    loss_buf = xp.zeros(1, dtype=np.float64)
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        idx = sampler.indices()
        steps = -(-len(idx) // local_batch)
        for step in range(1, steps + 1):
            b = xp.asarray(idx[(step - 1) * local_batch:step * local_batch])
            if args.no_overlap:
                loss = loss_and_grads(params, xtr[b], ytr[b], grads, xp)
                reducer.reduce_(grads)
            else:
                loss = loss_and_grads(params, xtr[b], ytr[b], grads, xp, ready=reducer.mark_ready)
                reducer.wait()
            opt.step(grads)
            if step % args.log_every == 0 or step == steps:
                loss_buf[0] = loss
                mpicomm.all_reduce(loss_buf, mpicomm.ReduceOp.AVG, out=loss_buf)
                if rank == 0:
                    print(f"epoch: {epoch} step: {step}, loss is {float(loss_buf[0]):.6f}", flush=True)
    elapsed = time.perf_counter() - t0
    counts = xp.asarray([correct_count(params, xte_mine, yte_mine, xp), len(yte_mine)], dtype=np.int64)
    mpicomm.all_reduce(counts, out=counts)
    counts = [int(c) for c in counts]
    return finish(counts[0], counts[1], elapsed, rank, args.min_accuracy)


if __name__ == "__main__":
    sys.exit(main())
