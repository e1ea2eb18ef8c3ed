#!/usr/bin/env python
"""OneFlow's DistributedDataParallel example (ddp_train.py), ported to mpicomm
(docs/PORTING.md).

    mpicomm-run -n 2 python scripts/port_oneflow_ddp.py

OneFlow's ``oneflow.nn.parallel.DistributedDataParallel`` follows PyTorch's DDP, and so
does ``mpicomm.torch.DistributedDataParallel``: the port is ``oneflow`` -> ``torch``,
``flow.env.get_rank()`` -> ``mpicomm.get_rank()``, the launcher -> ``mpicomm-run``.
The model is the tutorial's: y = x @ w, w of shape (2, 1) from zeros, MSELoss(reduction=
"sum"), SGD with lr 0.01, 500 iterations. Each rank has its own data, as ``train_x[rank]``
in the tutorial; here 4 random samples per rank with y = x @ [[2], [3]], so w ends at
[[2], [3]] as the tutorial prints it. The parameters are float64 (OneFlow's example uses
float32), so the test can compare with one process to 1e-9.

Every 50 iterations rank 0 prints ``I/500 loss:L``; every rank prints its w at the end.
``--save FILE`` writes rank 0's final w (.npy).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch                                                  # import oneflow as flow

try:
    import mpicomm
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mpicomm
from mpicomm.torch import DistributedDataParallel as ddp     # noqa: E402  (oneflow.nn.parallel)


def rank_data(rank, seed=0, n=4):
    """This rank's samples (train_x[rank], train_y[rank] in the tutorial)."""
    g = np.random.default_rng([seed, rank])
    x = g.standard_normal((n, 2))
    return torch.from_numpy(x), torch.from_numpy(x @ np.array([[2.0], [3.0]]))


class Model(torch.nn.Module):                                 # flow.nn.Module
    def __init__(self, iter_count=500):
        super().__init__()
        self.lr = 0.01
        self.iter_count = iter_count
        self.w = torch.nn.Parameter(torch.tensor([[0], [0]], dtype=torch.float64))

    def forward(self, x):
        return torch.matmul(x, self.w)                        # flow.matmul


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write rank 0's final w to this .npy file")
    args = p.parse_args(argv)

    mpicomm.init()               # OneFlow's launcher sets up its world; DDP would call init() too
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the tutorial's "cuda"; the CPU where there is none
    if device == "cuda":                                      # each rank its own GPU (OneFlow's launcher does it)
        torch.cuda.set_device(mpicomm.get_local_rank() % torch.cuda.device_count())
    m = Model(args.iters).to(device)                          # m = Model().to("cuda")
    m = ddp(m)                   # rank 0's parameters everywhere; gradients averaged during backward
    loss = torch.nn.MSELoss(reduction="sum")
    optimizer = torch.optim.SGD(m.parameters(), m.module.lr)  # m.lr: torch's DDP keeps the model in .module

    rank = mpicomm.get_rank()                                 # flow.env.get_rank()
    x, y = (t.to(device) for t in rank_data(rank, args.seed))
    for i in range(0, m.module.iter_count):
        y_pred = m(x)
        l = loss(y_pred, y)  # noqa: E741 (the tutorial's name)
        if (i + 1) % 50 == 0 and rank == 0:
            print(f"{i+1}/{m.module.iter_count} loss:{l}", flush=True)

        optimizer.zero_grad()
        l.backward()
        optimizer.step()

    w = m.module.w.detach().cpu().numpy().copy()
    print(f"\nrank {rank} w:{w.ravel()}", flush=True)
    if args.save and rank == 0:
        np.save(args.save, w)
    return w


if __name__ == "__main__":
    main()
    mpicomm.finalize()
