#!/usr/bin/env python
"""Paddle's fleet quick start for collective data parallelism, ported to mpicomm
(docs/PORTING.md).

    mpicomm-run -n 2 python scripts/port_paddle.py

The tutorial's five steps, one for one:

    fleet.init(is_collective=True)                 mpicomm.init()
    model = fleet.distributed_model(model)         broadcast_parameters(params) and a
                                                   DistributedGradReducer(params, mean=True)
                                                   fed during the backward pass
    opt = fleet.distributed_optimizer(opt)         the optimizer as it is
    DistributedBatchSampler(ds, 32, shuffle=True,  mpicomm.DistributedBatchSampler(ds, 32,
                            drop_last=True)            shuffle=True, drop_last=True): Paddle's

NumPy arrays stand in for Paddle tensors (PaddlePaddle is about 720 MB installed; the
guide shows the same calls on Paddle tensors through DLPack). The network is MyNet's
head (Linear, ReLU, Linear) on a synthetic data set (16 features, 4 classes, 96
training and 48 validation samples), trained with Adam, as the tutorial's.

Rank 0 prints ``epoch: E, batch_id: B, loss is: L`` and the validation accuracy and
loss over all ranks' shards; ``--save FILE`` writes rank 0's final parameters (.npz).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

try:
    import mpicomm
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mpicomm
from mpicomm import DistributedBatchSampler, DistributedGradReducer, ReduceOp  # noqa: E402

SIZES = (16, 64, 4)   # in_features, hidden, num_classes


def create_datasets(seed=0, n_train=96, n_val=48):
    """(x, y) for training and validation, the same on every rank (paddle.vision.datasets)."""
    g = np.random.default_rng(seed)
    teacher = g.standard_normal((SIZES[0], SIZES[-1]))
    x = g.standard_normal((n_train + n_val, SIZES[0]))
    y = (x @ teacher).argmax(axis=1)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def init_params(seed):
    """MyNet's linear1 and linear2: [W1, b1, W2, b2] (this rank's own draw)."""
    g = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        bound = 1 / np.sqrt(fan_in)
        params += [g.uniform(-bound, bound, (fan_in, fan_out)), np.zeros(fan_out)]
    return params


def forward(params, x):
    w1, b1, w2, b2 = params
    z1 = x @ w1 + b1
    return np.maximum(z1, 0) @ w2 + b2, z1


def cross_entropy(logits, y):
    """F.cross_entropy (mean) and the softmax, for the backward pass."""
    z = logits - logits.max(axis=1, keepdims=True)
    ez = np.exp(z)
    s = ez.sum(axis=1, keepdims=True)
    return float((np.log(s[:, 0]) - z[np.arange(len(y)), y]).mean()), ez / s


def loss_backward(params, x, y, grads, ready):
    """forward, loss and loss.backward(): writes the gradients into ``grads`` last layer
    first and calls ready(i) as each is final (what distributed_model's hooks do: the
    reduction of the last layer starts while the first is still being differentiated)."""
    w1, b1, w2, b2 = params
    logits, z1 = forward(params, x)
    h = np.maximum(z1, 0)
    loss, p = cross_entropy(logits, y)
    d = p
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    np.sum(d, axis=0, out=grads[3])
    ready(3)
    np.matmul(h.T, d, out=grads[2])
    ready(2)
    dh = (d @ w2.T) * (z1 > 0)
    np.sum(dh, axis=0, out=grads[1])
    ready(1)
    np.matmul(x.T, dh, out=grads[0])
    ready(0)
    return loss


class Adam:
    """paddle.optimizer.Adam(learning_rate, parameters): beta1 0.9, beta2 0.999, epsilon 1e-8."""

    def __init__(self, learning_rate, parameters, beta1=0.9, beta2=0.999, epsilon=1e-8):
        self.lr, self.params, self.b1, self.b2, self.eps = learning_rate, parameters, beta1, beta2, epsilon
        self.m = [np.zeros_like(p) for p in parameters]
        self.v = [np.zeros_like(p) for p in parameters]
        self.t = 0

    def step(self, grads):
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for p, m, v, g in zip(self.params, self.m, self.v, grads):
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            p -= self.lr * (m / c1) / (np.sqrt(v / c2) + self.eps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank, as DistributedBatchSampler's")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save", default=None, help="write rank 0's final parameters to this .npz file")
    args = ap.parse_args(argv)

    mpicomm.init()                                               # fleet.init(is_collective=True)
    rank = mpicomm.get_rank()

    params = init_params(args.seed + mpicomm.get_rank())         # model = MyNet(num_classes=4)
    # model = fleet.distributed_model(model): the same start everywhere, gradients averaged
    mpicomm.broadcast_parameters(params, root=0)
    reducer = DistributedGradReducer(params, mean=True)
    grads = reducer.grad_views()
    opt = Adam(learning_rate=args.lr, parameters=params)         # fleet.distributed_optimizer(opt): as it is

    (xtr, ytr), (xva, yva) = create_datasets(args.seed)
    b = args.batch_size
    train_sampler = DistributedBatchSampler(xtr, b, shuffle=True, drop_last=True)
    valid_sampler = DistributedBatchSampler(xva, b)              # Paddle's defaults: in order, no drop

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch_id, s in enumerate(train_sampler):             # this rank's batches of indices
            loss = loss_backward(params, xtr[s], ytr[s], grads, ready=reducer.mark_ready)
            reducer.wait()                                       # grads: the mean over all ranks
            opt.step(grads)                                      # opt.step(); opt.clear_grad()
            if batch_id % args.log_every == 0 and rank == 0:
                print("epoch: {}, batch_id: {}, loss is: {}".format(epoch, batch_id, loss), flush=True)

        # validation: this rank's batches, then the counts and loss sums of all ranks
        tot = np.zeros(3)
        for s in valid_sampler:
            logits, _ = forward(params, xva[s])
            vloss, _ = cross_entropy(logits, yva[s])
            tot += [float((logits.argmax(axis=1) == yva[s]).sum()), vloss * len(s), len(s)]
        mpicomm.all_reduce(tot, ReduceOp.SUM, out=tot)
        if rank == 0:
            print("[validation] accuracy/loss: {}/{}".format(tot[0] / tot[2], tot[1] / tot[2]), flush=True)
    if args.save and rank == 0:
        np.savez(args.save, *params)
    return params


if __name__ == "__main__":
    main()
    mpicomm.finalize()
