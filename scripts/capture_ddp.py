#!/usr/bin/env python3
"""A data-parallel training step captured in one CUDA graph with mpicomm's DDP wrapper.

    mpicomm-run -n 2 python scripts/capture_ddp.py [--steps 20] [--bucket-cap-mb 0.05]

A small MLP is wrapped in ``mpicomm.torch.DistributedDataParallel``; after warm-up steps on
a side stream (PyTorch's recipe for capturing a whole step), forward, backward (with the
wrapper's bucketed all_reduces) and the optimizer step are captured once with
``torch.cuda.graph`` and replayed on new data every step. Every rank also trains a plain
copy of the model, one process on the global batch (every rank's data, which each rank
can make from the ranks' seeds), and the script checks after every replay that the
replayed model's parameters match it (rtol 1e-4). Prints one line per check and exits
non-zero on a mismatch or an error (which it names).
"""
from __future__ import annotations

import argparse
import copy
import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mpicomm  # noqa: E402


def batch(rank, step, n_in, per_rank, dev):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(per_rank, n_in, generator=g)
    y = torch.randint(0, 10, (per_rank,), generator=g)
    return x.to(dev), y.to(dev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.05, help="small: several buckets")
    ap.add_argument("--keep-graph", action="store_true",
                    help="finalize with the graph still alive (NCCL cannot destroy the communicator then: "
                         "finalize says so after mpicomm's wait and goes on)")
    a = ap.parse_args()
    mpicomm.init(backend="nccl")
    import torch
    import torch.nn.functional as F
    from torch import nn

    import mpicomm.torch as mt

    rank, n = mpicomm.get_rank(), mpicomm.get_group_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    n_in, per = 64, 16
    net = nn.Sequential(nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
    ref = copy.deepcopy(net)
    ddp = mt.DistributedDataParallel(net, bucket_cap_mb=a.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)

    def ref_step(step):
        xs, ys = zip(*(batch(r, step, n_in, per, dev) for r in range(n)))
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()

    static_x, static_y = batch(rank, 0, n_in, per, dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    step = 0
    with torch.cuda.stream(side):   # warm-up, eager, on a side stream
        for _ in range(a.warmup):
            x, y = batch(rank, step, n_in, per, dev)
            static_x.copy_(x)
            static_y.copy_(y)
            opt.zero_grad(set_to_none=False)   # (the gradients are views of the wrapper's buckets)
            F.cross_entropy(ddp(static_x), static_y).backward()
            opt.step()
            ref_step(step)
            step += 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    try:
        with torch.cuda.graph(graph):
            static_loss = F.cross_entropy(ddp(static_x), static_y)
            static_loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    except Exception as e:
        print(f"[rank {rank}] capture failed: {type(e).__name__}: {e}", flush=True)
        raise
    if rank == 0:
        print(f"# capture_ddp: {n} ranks, captured one step (forward, backward with the wrapper's "
              f"{len(ddp.buckets)} buckets, SGD step); replaying {a.steps} steps", flush=True)
    worst = 0.0
    for _ in range(a.steps):
        x, y = batch(rank, step, n_in, per, dev)
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        ref_step(step)
        step += 1
        torch.cuda.synchronize()
        for p, q in zip(net.parameters(), ref.parameters()):
            err = ((p - q).abs().max() / (q.abs().max() + 1e-12)).item()
            worst = max(worst, err)
    ok = worst < 1e-4
    flag = torch.tensor([0 if ok else 1], device=dev)
    flag = mpicomm.all_reduce(flag)
    if rank == 0:
        print(f"# replayed {a.steps} steps; parameters against one process on the global batch: "
              f"worst relative difference {worst:.2e} on rank 0: {'OK' if flag.item() == 0 else 'MISMATCH'}",
              flush=True)
    ok = flag.item() == 0
    # a hang from here on names itself: every thread's stack after 60 s
    faulthandler.dump_traceback_later(90, exit=True)
    keep = graph if a.keep_graph else None   # noqa: F841 (alive through finalize)
    del graph                  # the captured NCCL calls go before the communicator does
    torch.cuda.synchronize()
    mpicomm.finalize()
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        print("# finalized", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
