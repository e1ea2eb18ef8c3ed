"""The raw baselines of ``--compare``: mpi4py and CuPy NCCL calls on communicators of their own.

Each method takes one set of buffers (the library's own arrays: NumPy for mpi4py, CuPy
for NCCL) and returns the callables a user would write for it: ``(out-of-place,
in-place)`` where mpicomm has both forms, else the one callable; None where the library
has no such call for this dtype (MPI has no float16/bfloat16 reductions).
"""
from __future__ import annotations

import functools

import numpy as np

from ..._arrays import offsets

# ncclDataType_t (nccl.h, stable since NCCL 2.10); complex travels as 2 floats
NCCL_TYPES = {"int8": (0, 1), "uint8": (1, 1), "int32": (2, 1), "uint32": (3, 1), "int64": (4, 1),
              "uint64": (5, 1), "float16": (6, 1), "float32": (7, 1), "float64": (8, 1), "bfloat16": (9, 1),
              "complex64": (7, 2), "complex128": (8, 2)}
# ncclRedOp_t; avg is ncclAvg (NCCL >= 2.10)
NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


class RawMPI:
    """The collectives with mpi4py, as a user would write them. AVG is Allreduce(SUM) and
    an in-place divide. float16/bfloat16 move as 16-bit words; MPI cannot reduce them."""

    def __init__(self, comm, dt, op, root, n, rank):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.half = dt.itemsize == 2 and dt.kind in "fV"
        self.reduce_ok = not self.half
        self.mop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX, "avg": MPI.SUM}[op]
        self.avg = op == "avg"
        self.root, self.n, self.rank = root, n, rank

    def _b(self, a):
        return a.view(np.uint16) if self.half else a

    def _then_divide(self, f, result, on_root_only=False):
        """``f``, and for AVG the division of ``result`` by n (on the root only for reduce)."""
        if not self.avg or (on_root_only and self.rank != self.root):
            return f
        n, divide = self.n, np.divide

        def avg():
            f()
            divide(result, n, out=result)

        return avg

    def all_reduce(self, send, recv, c):
        if not self.reduce_ok:
            return None, None
        p, comm, mop = functools.partial, self.comm, self.mop
        return (self._then_divide(p(comm.Allreduce, send, recv, mop), recv),
                self._then_divide(p(comm.Allreduce, self.MPI.IN_PLACE, recv, mop), recv))

    def all_gather(self, send, recv, c):
        """(out of place, in place: the input already in this rank's part of recv)."""
        p, comm = functools.partial, self.comm
        return p(comm.Allgather, self._b(send), self._b(recv)), p(comm.Allgather, self.MPI.IN_PLACE, self._b(recv))

    def reduce_scatter(self, send, recv, c):
        """(out of place, in place: MPI's form, the input in send and the result at its start)."""
        if not self.reduce_ok:
            return None, None
        p, comm, mop = functools.partial, self.comm, self.mop
        return (self._then_divide(p(comm.Reduce_scatter_block, send, recv, mop), recv),
                self._then_divide(p(comm.Reduce_scatter_block, self.MPI.IN_PLACE, send, mop), send[:c]))

    def broadcast(self, buf, c):
        return functools.partial(self.comm.Bcast, self._b(buf), self.root)

    def reduce(self, send, recv, c):
        if not self.reduce_ok:
            return None, None
        p, comm, mop, root = functools.partial, self.comm, self.mop, self.root
        # in place: the root reduces into recv, the others send it
        ip = p(comm.Reduce, self.MPI.IN_PLACE, recv, mop, root) if self.rank == root else \
            p(comm.Reduce, recv, None, mop, root)
        return self._then_divide(p(comm.Reduce, send, recv, mop, root), recv, on_root_only=True), \
            self._then_divide(ip, recv, on_root_only=True)

    def all_to_all(self, send, recv, c):
        return functools.partial(self.comm.Alltoall, self._b(send), self._b(recv))

    # per-rank sizes, gather, scatter, sendrecv: out of place only
    def all_gatherv(self, send, recv, counts):
        rb = [self._b(recv), (list(counts), offsets(counts))]
        return functools.partial(self.comm.Allgatherv, self._b(send), rb)

    def all_to_allv(self, send, recv, sc, rc):
        return functools.partial(self.comm.Alltoallv, [self._b(send), (list(sc), offsets(sc))],
                                 [self._b(recv), (list(rc), offsets(rc))])

    def gather(self, send, recv, c):
        return functools.partial(self.comm.Gather, self._b(send), self._b(recv) if self.rank == self.root else None,
                                 self.root)

    def scatter(self, send, recv, c):
        return functools.partial(self.comm.Scatter, self._b(send) if self.rank == self.root else None,
                                 self._b(recv), self.root)

    def sendrecv(self, send, recv, dst, src):
        return functools.partial(self.comm.Sendrecv, self._b(send), dst, 0, self._b(recv), src, 0)


class RawNCCL:
    """The collectives as direct CuPy ``NcclCommunicator`` calls on a communicator of its own,
    on the bench's stream.

    ``fresh``: each call reads the pointers of its arrays (``x.data.ptr``), as a loop over
    new arrays must; otherwise they are read once, as a loop over the same arrays may.
    """

    def __init__(self, mpi_comm, dt, op, root, n, rank, device_id, stream_ptr, fresh=False):
        import cupy
        from cupy.cuda import nccl

        uid = nccl.get_unique_id() if rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        with cupy.cuda.Device(device_id):
            self.comm = nccl.NcclCommunicator(n, uid, rank)
        self.nccl = nccl
        self.dt, self.scale = NCCL_TYPES[str(dt)]
        self.item = dt.itemsize
        self.op = NCCL_OPS[op]
        self.root, self.n, self.rank, self.s = root, n, rank, stream_ptr
        self.fresh = fresh

    def close(self):
        self.comm.destroy()

    def bind(self, method, a, b, *rest):
        """``method(ptr(a), ptr(b), *rest)``, the pointers read per call if fresh."""
        if not self.fresh:
            return functools.partial(method, a.data.ptr, b.data.ptr, *rest)

        def call():
            method(a.data.ptr, b.data.ptr, *rest)

        return call

    def all_reduce(self, send, recv, c):
        f, cnt = self.comm.allReduce, c * self.scale
        return self.bind(f, send, recv, cnt, self.dt, self.op, self.s), \
            self.bind(f, recv, recv, cnt, self.dt, self.op, self.s)

    def offset(self, method, a, off_a, b, off_b, *rest):
        """``method(ptr(a) + off_a, ptr(b) + off_b, *rest)``, the pointers read per call if fresh."""
        if not self.fresh:
            return functools.partial(method, a.data.ptr + off_a, b.data.ptr + off_b, *rest)

        def call():
            method(a.data.ptr + off_a, b.data.ptr + off_b, *rest)

        return call

    def all_gather(self, send, recv, c):
        """(out of place, in place: the input is this rank's part of recv)."""
        f, cnt, part = self.comm.allGather, c * self.scale, self.rank * c * self.item
        return self.bind(f, send, recv, cnt, self.dt, self.s), \
            self.offset(f, recv, part, recv, 0, cnt, self.dt, self.s)

    def reduce_scatter(self, send, recv, c):
        """(out of place, in place: the output is this rank's part of send)."""
        f, cnt, part = self.comm.reduceScatter, c * self.scale, self.rank * c * self.item
        return self.bind(f, send, recv, cnt, self.dt, self.op, self.s), \
            self.offset(f, send, 0, send, part, cnt, self.dt, self.op, self.s)

    def broadcast(self, buf, c):
        return self.bind(self.comm.broadcast, buf, buf, c * self.scale, self.dt, self.root, self.s)

    def reduce(self, send, recv, c):
        f, cnt = self.comm.reduce, c * self.scale
        return self.bind(f, send, recv, cnt, self.dt, self.op, self.root, self.s), \
            self.bind(f, recv, recv, cnt, self.dt, self.op, self.root, self.s)

    def all_to_all(self, send, recv, c):
        cm, nccl, n, dt, s = self.comm, self.nccl, self.n, self.dt, self.s
        cnt, nb, fresh = c * self.scale, c * self.item, self.fresh
        ptrs = (send.data.ptr, recv.data.ptr)

        def a2a():
            sp, rp = (send.data.ptr, recv.data.ptr) if fresh else ptrs
            nccl.groupStart()
            for j in range(n):
                cm.send(sp + j * nb, cnt, dt, j, s)
                cm.recv(rp + j * nb, cnt, dt, j, s)
            nccl.groupEnd()

        return a2a

    def _grouped(self, send, recv, sends, recvs):
        """One NCCL group of sends ``(peer, element offset, count)`` from ``send`` and receives
        into ``recv``, as a user writes an uneven collective with CuPy's NCCL."""
        cm, nccl, dt, s, sc, item, fresh = self.comm, self.nccl, self.dt, self.s, self.scale, self.item, self.fresh
        sends = [(j, o * item, k * sc) for j, o, k in sends if k]
        recvs = [(j, o * item, k * sc) for j, o, k in recvs if k]
        ptrs = (send.data.ptr if send is not None else 0, recv.data.ptr if recv is not None else 0)

        def grouped():
            sp, rp = ((send.data.ptr if send is not None else 0, recv.data.ptr if recv is not None else 0)
                      if fresh else ptrs)
            nccl.groupStart()
            for j, o, k in sends:
                cm.send(sp + o, k, dt, j, s)
            for j, o, k in recvs:
                cm.recv(rp + o, k, dt, j, s)
            nccl.groupEnd()

        return grouped

    def all_gatherv(self, send, recv, counts):
        n, me, d = self.n, self.rank, offsets(counts)
        return self._grouped(send, recv, [(j, 0, counts[me]) for j in range(n)],
                             [(j, d[j], counts[j]) for j in range(n)])

    def all_to_allv(self, send, recv, sc, rc):
        n, sd, rd = self.n, offsets(sc), offsets(rc)
        return self._grouped(send, recv, [(j, sd[j], sc[j]) for j in range(n)],
                             [(j, rd[j], rc[j]) for j in range(n)])

    def gather(self, send, recv, c):
        n, root = self.n, self.root
        return self._grouped(send, recv, [(root, 0, c)],
                             [(j, j * c, c) for j in range(n)] if self.rank == root else [])

    def scatter(self, send, recv, c):
        n, root = self.n, self.root
        return self._grouped(send, recv, [(j, j * c, c) for j in range(n)] if self.rank == root else [],
                             [(root, 0, c)])

    def sendrecv(self, send, recv, dst, src):
        c = recv.size
        return self._grouped(send, recv, [(dst, 0, c)], [(src, 0, c)])
