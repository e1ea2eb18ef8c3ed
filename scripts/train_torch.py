#!/usr/bin/env python
"""Data-parallel training of a small PyTorch convolutional network with mpicomm.torch.

    mpicomm-run -n 2 python scripts/train_torch.py                  # scikit-learn's 8x8 digits
    mpicomm-run -n 4 python scripts/train_torch.py --min-accuracy 0.95

CPU tensors over MPI, or CUDA tensors over NCCL where PyTorch and CuPy see GPUs (rank r
uses GPU ``local rank % GPUs``). The model is wrapped in
``mpicomm.torch.DistributedDataParallel``: every rank starts from rank 0's weights, and
each gradient bucket's all_reduce starts during backward. Each rank trains on its shard
of every global batch (``mpicomm.DistributedSampler``). Rank 0 prints
``epoch: E step: S, loss is L`` and the held-out accuracy (about 0.98 after 15 epochs).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

# datasets.py sits next to this script (and finds mpicomm in a checkout that is not installed)
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from datasets import finish, load_digits, local_batch_size, training_parser  # noqa: E402

import mpicomm  # noqa: E402
# mpicomm.torch before torch: without PyTorch, it says how to install it
import mpicomm.torch as mt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def parse_args(argv=None):
    return training_parser(__doc__.split("\n\n")[0]).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    mpicomm.init()
    rank, n = mpicomm.get_rank(), mpicomm.get_group_size()
    if mpicomm.get_backend() == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", mpicomm.get_local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, mpicomm.get_local_size())))
    local_batch = local_batch_size(args.batch_size, n)
    (xtr, ytr), (xte, yte) = load_digits(seed=args.seed)
    xtr = torch.tensor(xtr, dtype=torch.float32).view(-1, 1, 8, 8).to(device)
    ytr = torch.tensor(ytr).to(device)
    xte = torch.tensor(xte[rank::n], dtype=torch.float32).view(-1, 1, 8, 8).to(device)
    yte = torch.tensor(yte[rank::n]).to(device)

    torch.manual_seed(args.seed + rank)  # every rank draws its own model; the wrapper takes rank 0's
    model = mt.DistributedDataParallel(make_model().to(device), bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = mpicomm.DistributedSampler(len(ytr), shuffle=True, seed=args.seed)
    if rank == 0:
        print(f"mpicomm {mpicomm.get_backend()} backend, {n} rank(s) on {device.type}; digits {len(ytr)} train / "
              f"{len(yte) * n} test (about), global batch {local_batch * n}, {len(model.buckets)} bucket(s)",
              flush=True)
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        idx = torch.as_tensor(np.asarray(sampler.indices()), device=device)
        steps = -(-len(idx) // local_batch)
        model.train()
        for step in range(1, steps + 1):
            b = idx[(step - 1) * local_batch:step * local_batch]
            opt.zero_grad()
            loss = loss_fn(model(xtr[b]), ytr[b])
            loss.backward()  # the gradients are averaged over the ranks when this returns
            opt.step()
            if step % args.log_every == 0 or step == steps:
                avg = mpicomm.all_reduce(loss.detach().reshape(1), mpicomm.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch: {epoch} step: {step}, loss is {float(avg[0]):.6f}", flush=True)
    elapsed = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        correct = int((model(xte).argmax(1) == yte).sum())
    counts = mpicomm.all_reduce(np.array([correct, len(yte)], np.int64))
    return finish(counts[0], counts[1], elapsed, rank, args.min_accuracy)


if __name__ == "__main__":
    sys.exit(main())
