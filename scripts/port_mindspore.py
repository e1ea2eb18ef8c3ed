#!/usr/bin/env python
"""MindSpore's data-parallel tutorial, ported to mpicomm (docs/PORTING.md).

    mpicomm-run -n 2 python scripts/port_mindspore.py
    mpicomm-run -n 8 python scripts/port_mindspore.py --backend nccl    # init("nccl"), on GPUs

The tutorial's steps, one for one: the auto-parallel context (data parallel, averaged
gradients, parameters broadcast from rank 0), init(), the data set sharded with
num_shards/shard_id, a Dense-ReLU-Dense network, value_and_grad, the gradient reducer
between the backward pass and the optimizer, and the loss printed every 10 steps.
MindSpore's tensors and autograd are stood in for by NumPy and a hand-written backward
pass; the data set is synthetic (96 samples, 16 features, 4 classes), the same on
every rank, as every rank reads the same files in the tutorial.

Rank 0 prints ``epoch: E, step: S, loss is L`` (its own shard's loss, as MindSpore
prints each rank's); ``--save FILE`` writes rank 0's final parameters (.npz).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

try:
    import mpicomm as ms                                     # import mindspore as ms
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mpicomm as ms
from mpicomm import (DistributedGradReducer, DistributedSampler, GlobalComm, ParallelMode,  # noqa: E402
                     get_group_size, get_rank, init)

SIZES = (16, 32, 4)   # features, hidden units, classes


def create_dataset(seed=0, n=96):
    """The whole data set, the same on every rank: x (n, 16) float64, labels in 0..3 from a
    random linear teacher (so there is something to learn)."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, SIZES[0]))
    y = (x @ g.standard_normal((SIZES[0], SIZES[-1]))).argmax(axis=1)
    return x, y


def batches(sampler, batch_size):
    """dataset.batch(batch_size) of this rank's shard (the last batch may be short, as
    MindSpore's drop_remainder=False)."""
    idx = sampler.indices()
    return [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]


def init_params(seed):
    """Network(): [W1, b1, W2, b2] of Dense(16, 32) and Dense(32, 4); normal weights, zero biases."""
    g = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        params += [g.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in), np.zeros(fan_out)]
    return params


def grad_fn(params, x, y):
    """value_and_grad(forward_fn): the mean cross-entropy loss and its gradients."""
    w1, b1, w2, b2 = params
    z1 = x @ w1 + b1
    h = np.maximum(z1, 0)
    logits = h @ w2 + b2
    z = logits - logits.max(axis=1, keepdims=True)
    ez = np.exp(z)
    s = ez.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float((np.log(s[:, 0]) - z[rows, y]).mean())
    d = ez / s
    d[rows, y] -= 1
    d /= len(y)
    dh = (d @ w2.T) * (z1 > 0)
    return loss, [x.T @ dh, dh.sum(axis=0), h.T @ d, d.sum(axis=0)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None, help='init(BACKEND): "nccl" as the GPU tutorial, "mpi", '
                   "or unset (NCCL where there is a GPU, else MPI)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="per rank, as dataset.batch()")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write rank 0's final parameters to this .npz file")
    args = p.parse_args(argv)

    # ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=True)
    init(args.backend)                                       # init() / init("nccl")

    rank_id = get_rank()
    rank_size = get_group_size()
    x, y = create_dataset(args.seed)
    # ds.MnistDataset(dataset_path, num_shards=rank_size, shard_id=rank_id)
    sampler = DistributedSampler(len(x), num_shards=rank_size, shard_id=rank_id, shuffle=True, seed=args.seed)

    # The tutorial calls ms.set_seed(1) so that every rank draws the same weights; here each
    # rank draws its own, and parameter_broadcast=True makes them all rank 0's when the
    # reducer is made.
    params = init_params(args.seed + rank_id)
    grad_reducer = DistributedGradReducer(params)            # nn.DistributedGradReducer(optimizer.parameters)
    lr = args.lr                                             # nn.SGD(net.trainable_params(), lr)
    if rank_id == 0:
        print(f"mpicomm {GlobalComm.BACKEND}, {rank_size} rank(s); {len(x)} samples, "
              f"{args.batch_size} per rank and step", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(batches(sampler, args.batch_size)):
            loss, grads = grad_fn(params, x[batch], y[batch])
            grads = grad_reducer(grads)                      # the mean over all ranks
            for w, g in zip(params, grads):                  # optimizer(grads)
                w -= lr * g
            if i % 10 == 0 and rank_id == 0:
                print("epoch: %s, step: %s, loss is %s" % (epoch, i, loss), flush=True)
    if args.save and rank_id == 0:
        np.savez(args.save, *params)
    return params


if __name__ == "__main__":
    main()
    ms.finalize()
