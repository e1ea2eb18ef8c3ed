"""cupy.cuda.nccl of the double: an ``NcclCommunicator`` whose calls take raw device
pointers, counts, NCCL type and op codes and a stream handle, exactly like CuPy's, and
move the bytes between the ranks through MPI (mpi4py), on a communicator of their own.

- Every pointer must lie, with its count, inside one live allocation of the double on the
  communicator's device (else NcclError naming the call, the buffer and the range); the
  in-place forms are NCCL's (send == recv; allGather's send at rank * count in recv;
  reduceScatter's recv at rank * recvcount in send); any other overlap is refused.
- Between ``groupStart()`` and the outermost ``groupEnd()`` calls are only checked and
  queued; at ``groupEnd`` they start together (nonblocking MPI) and complete together, so
  sends and receives in a group may come in any order, to oneself included. A receive or
  send buffer of a group overlapping a receive buffer of another call of the group is
  refused (NCCL runs them concurrently). A receive must get exactly its count.
- Outside a group a collective or a receive completes before the call returns; a send
  starts (from a copy of its data) and completes at the next synchronisation of a
  stream, event or device, so two ranks that each send and then receive do not deadlock
  (as on a GPU, where the host only enqueues). A send to or receive from oneself outside a
  group is refused (NCCL would never complete it).
- Reductions are computed in NumPy on the NCCL element type (complex travels as pairs of
  floats, so only SUM and AVG make sense for it, as on NCCL).

``history`` keeps the last calls as (group number or None, call name, bytes) for tests
that check how calls were grouped.
"""
import collections
import itertools
import os
import struct
import threading
import time

import numpy as np

from . import _current_device

(NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32,
 NCCL_FLOAT64, NCCL_BFLOAT16) = range(10)
NCCL_CHAR, NCCL_INT, NCCL_HALF, NCCL_FLOAT, NCCL_DOUBLE = NCCL_INT8, NCCL_INT32, NCCL_FLOAT16, NCCL_FLOAT32, \
    NCCL_FLOAT64
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_TYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
          NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32,
          NCCL_FLOAT64: np.float64, NCCL_BFLOAT16: _bf16}
_OPS = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}
_MAGIC = b"FAKENCCL"


class NcclError(RuntimeError):
    pass


def get_version():
    return 22000


def get_build_version():
    return 22000


# ----------------------------------------------------------------- the MPI side
_world = None
_serial = itertools.count(1)
_lock = threading.Lock()
_pending = []          # (serial, request, data kept alive) of sends started outside a group
_send_serial = itertools.count(1)
_depth = 0             # groupStart nesting
_queued = []           # (communicator, call name, regions, post) queued in the open group
_groups = itertools.count(1)
history = collections.deque(maxlen=4096)


def _mpi():
    from mpi4py import MPI

    return MPI


def _world_comm(n):
    """The double's own duplicate of COMM_WORLD, made by the first communicator (mpicomm's
    world: every rank makes it at once)."""
    global _world
    if _world is None:
        w = _mpi().COMM_WORLD
        if n != w.Get_size():
            raise NcclError(f"the first NcclCommunicator of the double must span COMM_WORLD ({w.Get_size()} "
                            f"ranks), got {n}: it duplicates COMM_WORLD, collectively")
        _world = w.Dup()
    return _world


def get_unique_id():
    """128 signed chars, as CuPy gives: a marker, this process's world rank and a random tag."""
    w = _mpi().COMM_WORLD.Get_rank()
    raw = _MAGIC + struct.pack("<iI", w, next(_serial)) + os.urandom(112)
    return tuple(b - 256 if b > 127 else b for b in raw)


def _pending_now():
    with _lock:
        return max((s for s, _, _ in _pending), default=None)


def _test_pending(upto):
    """True when every pending send numbered up to ``upto`` (None: all) has completed."""
    with _lock:
        left = [it for it in _pending if not ((upto is None or it[0] <= upto) and it[1].Test())]
        _pending[:] = left
        return all(upto is not None and s > upto for s, _, _ in left)


def _wait_pending(upto):
    pause = 2e-5
    while not _test_pending(upto):
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _waitall(reqs):
    """Wait for MPI requests without holding the GIL in a blocking call forever (the
    watchdog thread keeps running); their statuses."""
    MPI = _mpi()
    sts = [MPI.Status() for _ in reqs]
    pause = 2e-5
    try:
        while not MPI.Request.Testall(reqs, sts):
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
    except MPI.Exception as e:
        raise NcclError(f"MPI failed under the NCCL double ({e}): a send larger than its receive?") from None
    return sts


def groupStart():
    global _depth
    _depth += 1


def groupEnd():
    """At the outermost end: start every queued call, then complete them all."""
    global _depth
    if _depth == 0:
        raise NcclError("groupEnd without groupStart")
    _depth -= 1
    if _depth:
        return
    calls, _queued[:] = list(_queued), []
    if not calls:
        return
    gid = next(_groups)
    _check_group(calls)
    started = []
    for comm, name, regions, post in calls:
        history.append((gid, name, sum(nb for _, _, nb in regions)))
        started.extend(post())
    sts = _waitall([r for r, _ in started])
    for (r, done), st in zip(started, sts):
        if done is not None:
            done(st)


def _check_group(calls):
    """Refuse a group in which a call's receive buffer overlaps another call's buffer."""
    regs = [(i, kind, p, nb) for i, (_, _, regions, _) in enumerate(calls) for kind, p, nb in regions if nb]
    for i, kind, p, nb in regs:
        if kind != "recv":
            continue
        for j, k2, q, mb in regs:
            if j != i and p < q + mb and q < p + nb:
                raise NcclError(f"group: {calls[i][1]}'s receive buffer [{p:#x}, +{nb} B) overlaps the {k2} "
                                f"buffer [{q:#x}, +{mb} B) of {calls[j][1]} in the same group (they run "
                                "concurrently on NCCL)")


def _reduce(stack, op, dt):
    with np.errstate(all="ignore"):
        if op == NCCL_SUM:
            return np.add.reduce(stack, axis=0, dtype=dt)
        if op == NCCL_PROD:
            return np.multiply.reduce(stack, axis=0, dtype=dt)
        if op == NCCL_MAX:
            return np.maximum.reduce(stack, axis=0)
        if op == NCCL_MIN:
            return np.minimum.reduce(stack, axis=0)
        s = np.add.reduce(stack, axis=0, dtype=np.float64 if dt.kind in "fV" else np.int64)
        return (s / len(stack)).astype(dt) if dt.kind in "fV" else (s // len(stack)).astype(dt)


# ----------------------------------------------------------------- the communicator
class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        raw = bytes((int(v) & 0xFF) for v in commId)
        if len(raw) != 128 or not raw.startswith(_MAGIC):
            raise NcclError(f"commId is not a unique id of the double (got {len(raw)} bytes)")
        if not (isinstance(ndev, int) and ndev >= 1 and isinstance(rank, int) and 0 <= rank < ndev):
            raise NcclError(f"NcclCommunicator(ndev={ndev!r}, rank={rank!r}): rank out of range")
        root, _ = struct.unpack("<iI", raw[8:16])
        tag = 1 + int.from_bytes(raw[16:20], "little") % 30000
        w = _world_comm(ndev)
        me = w.Get_rank()
        if ndev == 1:
            members = [me]
        elif rank == 0:
            if me != root:
                raise NcclError(f"rank 0 of the communicator is world rank {me}, not the maker of its id ({root})")
            members = [None] * ndev
            members[0] = me
            for _ in range(ndev - 1):
                r, wr = w.recv(source=_mpi().ANY_SOURCE, tag=tag)
                if members[r] is not None:
                    raise NcclError(f"two processes claim rank {r} of one communicator")
                members[r] = wr
            for r in range(1, ndev):
                w.send(members, dest=members[r], tag=tag)
        else:
            w.send((rank, me), dest=root, tag=tag)
            members = w.recv(source=root, tag=tag)
        grp = w.Get_group().Incl(members)
        self._comm = w.Create_group(grp, tag)
        grp.Free()
        self._rank, self._size, self._dev = rank, ndev, _current_device()
        self._state = None   # "aborted" / "destroyed"

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def device_id(self):
        return self._dev

    def destroy(self):
        if self._state is None:
            _wait_pending(None)
            self._comm.Free()
        self._state = "destroyed"

    def abort(self):
        self._state = self._state or "aborted"

    # ------------------------------------------------------------- argument checks
    def _live(self, name):
        if self._state is not None:
            raise NcclError(f"{name} on a communicator that was {self._state}")

    def _type(self, name, datatype, count, stream):
        self._live(name)
        dt = _TYPES.get(datatype) if isinstance(datatype, int) else None
        if dt is None:
            raise NcclError(f"{name}: datatype {datatype!r} is not an ncclDataType_t (0..9)")
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 0:
            raise NcclError(f"{name}: count {count!r} is not a non-negative int")
        if not isinstance(stream, int) or isinstance(stream, bool):
            raise NcclError(f"{name}: stream {stream!r} is not a cudaStream_t (an int)")
        self._stream = stream
        return np.dtype(dt() if callable(dt) and not isinstance(dt, type) else dt)

    def _peer(self, name, what, v):
        if not isinstance(v, int) or not 0 <= v < self._size:
            raise NcclError(f"{name}: {what} {v!r} is not a rank of this communicator (0..{self._size - 1})")
        return v

    def _buf(self, name, what, ptr, nbytes):
        from .. import host_view, lookup, read, wrote

        if not isinstance(ptr, int) or isinstance(ptr, bool):
            raise NcclError(f"{name}: {what} {ptr!r} is not a device pointer (an int)")
        try:
            v = host_view(ptr, nbytes, f"{name}: {what}")
        except ValueError as e:
            raise NcclError(str(e)) from None
        hit = lookup(ptr, nbytes) if nbytes else None
        if hit is not None and hit[2] != self._dev:
            raise NcclError(f"{name}: {what} is on device {hit[2]}, the communicator on device {self._dev}")
        # the stream-order model: NCCL reads sendbuff and writes recvbuff on the call's stream
        (read if what == "sendbuff" else wrote)(ptr, nbytes, self._stream, f"NCCL {name}")
        return v

    @staticmethod
    def _inplace(name, s, snb, r, rnb, ok):
        """Refuse overlapping send and receive buffers unless r - s is NCCL's in-place offset ``ok``."""
        if snb and rnb and s < r + rnb and r < s + snb and r - s != ok:
            raise NcclError(f"{name}: sendbuff [{s:#x}, +{snb} B) and recvbuff [{r:#x}, +{rnb} B) overlap, "
                            f"and not in NCCL's in-place form (recvbuff - sendbuff == {ok})")

    def _submit(self, name, regions, post, replay=False):
        from . import _capturing

        if not replay and self._stream in _capturing:   # captured: run by the graph's launch()
            if _depth:
                raise NcclError(f"{name}: a group in a stream capture is not modelled by the double")
            _capturing[self._stream].append((self, name, regions, post))
            return
        self._live(name)
        if _depth:
            _queued.append((self, name, regions, post))
            return
        history.append((None, name, sum(nb for _, _, nb in regions)))
        started = post()
        sts = _waitall([r for r, _ in started])
        for (r, done), st in zip(started, sts):
            if done is not None:
                done(st)

    def _gathered(self, name, sv, into):
        """Post an allgather of ``sv``'s bytes; ``into(stack)`` gets them as (ranks, bytes)."""
        n, MPI = self._size, _mpi()
        tmp = np.empty(n * sv.nbytes, np.uint8)

        def post():
            req = self._comm.Iallgather([sv, MPI.BYTE], [tmp, MPI.BYTE])
            return [(req, lambda st: into(tmp.reshape(n, -1)))]
        return post

    # ------------------------------------------------------------- collectives
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        name = "allReduce"
        dt = self._type(name, datatype, count, stream)
        op = self._op(name, op)
        nb = count * dt.itemsize
        sv, rv = self._buf(name, "sendbuff", sendbuf, nb), self._buf(name, "recvbuff", recvbuf, nb)
        self._inplace(name, sendbuf, nb, recvbuf, nb, 0)

        def into(stack):
            rv[:] = _reduce(stack.view(dt), op, dt).view(np.uint8)
        self._submit(name, [("send", sendbuf, nb), ("recv", recvbuf, nb)], self._gathered(name, sv, into))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        name = "reduce"
        dt = self._type(name, datatype, count, stream)
        op, root = self._op(name, op), self._peer(name, "root", root)
        nb = count * dt.itemsize
        sv = self._buf(name, "sendbuff", sendbuf, nb)
        mine = self._rank == root
        rv = self._buf(name, "recvbuff", recvbuf, nb) if mine else None   # read on the root only
        if mine:
            self._inplace(name, sendbuf, nb, recvbuf, nb, 0)

        def into(stack):
            if mine:
                rv[:] = _reduce(stack.view(dt), op, dt).view(np.uint8)
        regions = [("send", sendbuf, nb)] + ([("recv", recvbuf, nb)] if mine else [])
        self._submit(name, regions, self._gathered(name, sv, into))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        name = "reduceScatter"
        dt = self._type(name, datatype, recvcount, stream)
        op = self._op(name, op)
        rnb = recvcount * dt.itemsize
        snb = rnb * self._size
        sv, rv = self._buf(name, "sendbuff", sendbuf, snb), self._buf(name, "recvbuff", recvbuf, rnb)
        self._inplace(name, sendbuf, snb, recvbuf, rnb, self._rank * rnb)
        lo = self._rank * rnb

        def into(stack):
            rv[:] = _reduce(stack[:, lo:lo + rnb].view(dt), op, dt).view(np.uint8)
        self._submit(name, [("send", sendbuf, snb), ("recv", recvbuf, rnb)], self._gathered(name, sv, into))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        name = "allGather"
        dt = self._type(name, datatype, count, stream)
        snb = count * dt.itemsize
        sv, rv = self._buf(name, "sendbuff", sendbuf, snb), self._buf(name, "recvbuff", recvbuf, snb * self._size)
        self._inplace(name, sendbuf, snb, recvbuf, snb * self._size, -self._rank * snb)

        def into(stack):
            rv[:] = stack.reshape(-1)
        regions = [("send", sendbuf, snb), ("recv", recvbuf, snb * self._size)]
        self._submit(name, regions, self._gathered(name, sv, into))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        name = "broadcast"
        dt = self._type(name, datatype, count, stream)
        root = self._peer(name, "root", root)
        nb = count * dt.itemsize
        mine = self._rank == root
        sv = self._buf(name, "sendbuff", sendbuf, nb) if mine else None   # read on the root only
        rv = self._buf(name, "recvbuff", recvbuf, nb)
        if mine:
            self._inplace(name, sendbuf, nb, recvbuf, nb, 0)
        MPI = _mpi()

        def post():
            tmp = sv.copy() if mine else np.empty(nb, np.uint8)
            req = self._comm.Ibcast([tmp, MPI.BYTE], root)
            return [(req, lambda st: rv.__setitem__(slice(None), tmp))]
        regions = ([("send", sendbuf, nb)] if mine else []) + [("recv", recvbuf, nb)]
        self._submit(name, regions, post)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    # ------------------------------------------------------------- point to point
    def send(self, sendbuf, count, datatype, peer, stream):
        name = "send"
        dt = self._type(name, datatype, count, stream)
        peer = self._peer(name, "peer", peer)
        nb = count * dt.itemsize
        sv = self._buf(name, "sendbuff", sendbuf, nb)
        MPI = _mpi()
        if not _depth:
            if peer == self._rank:
                raise NcclError("send to oneself outside a group: NCCL would never complete it")
            history.append((None, name, nb))
            data = sv.copy()   # started now, completed at the next synchronisation
            req = self._comm.Isend([data, MPI.BYTE], peer, 0)
            with _lock:
                _pending.append((next(_send_serial), req, data))
            return
        self._submit(name, [("send", sendbuf, nb)],
                     lambda: [(self._comm.Isend([sv, MPI.BYTE], peer, 0), None)])

    def recv(self, recvbuf, count, datatype, peer, stream):
        name = "recv"
        dt = self._type(name, datatype, count, stream)
        peer = self._peer(name, "peer", peer)
        nb = count * dt.itemsize
        rv = self._buf(name, "recvbuff", recvbuf, nb)
        if not _depth and peer == self._rank:
            raise NcclError("recv from oneself outside a group: NCCL would never complete it")
        MPI = _mpi()

        def check(st):
            got = st.Get_count(MPI.BYTE)
            if got != nb:
                raise NcclError(f"recv of {count} elements ({nb} B) from rank {peer} got a send of {got} B "
                                "(NCCL needs the counts of a send and its recv to agree)")
        self._submit(name, [("recv", recvbuf, nb)], lambda: [(self._comm.Irecv([rv, MPI.BYTE], peer, 0), check)])

    def _op(self, name, op):
        if op not in _OPS:
            raise NcclError(f"{name}: op {op!r} is not an ncclRedOp_t (0..4)")
        return op
