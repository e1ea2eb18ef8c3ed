"""Shared-memory collectives for groups whose ranks all share one host (MPI backend).

Open MPI moves large messages between processes of one host through small shared
fragments and reaches a fraction of the memory bandwidth (docs/BENCHMARKS.md). Here
every rank of the group maps every peer's segment of one MPI-3 shared window
(``MPI.Win.Allocate_shared`` + ``Win.Shared_query``) and NumPy reads the peers'
memory directly:

- all_reduce is a reduce-scatter then an all-gather: rank r copies chunk j of its
  input into slot j of its segment (j != r); barrier; rank r reduces chunk r over
  ranks 0, 1, ..., n-1 in that order (its own operand straight from its input) into
  slot r of its segment; barrier; every rank copies slot j of rank j's segment into
  chunk j of its output.
- reduce_scatter is the first half of that, reducing into the caller's output.
- all_gather: each rank copies its input into its segment; barrier; each copies the
  peers' segments into its output.
- broadcast: root copies into its segment; barrier; the others copy out.

Messages larger than a piece (bytes of one segment buffer) are done piece by piece,
alternating between two buffers in every segment. all_reduce picks the piece, 2 or 8
MiB, by timing its calls (ShmGroup._tune; MPICOMM_SHM_PIECE fixes it): 2 MiB pieces
keep the working set in the caches and are the fastest most of the time, but on the
2-core VM they turn 2-3x slower for seconds at a time (cause not found; the phases that
write the window slow down), and then 8 MiB pieces are faster (docs/BENCHMARKS.md).
Every piece has at least one barrier, and a piece reads peers' buffer b only after its
own barrier, so piece k+2 (same buffer) may overwrite it only after every peer has
passed piece k+1's barrier, that is, finished reading piece k. The piece counter runs
on across calls and collectives alike, so the same holds from one collective to the
next.

Every call carries its signature (the first five words of its CallSpec,
mpicomm._callspec: collective, dtype, element count, op, root) into a table in rank 0's segment before its first barrier (the tuner's Open MPI choice, which
has no barrier of its own, gets one), and every rank compares the table after that
barrier: calls that differ raise CollectiveMismatchError on every rank, with each rank's
call, instead of returning a different answer on each. The table has two halves, by the
parity of the call, so call c + 2 writes the half of call c only after every rank has
passed call c + 1's first barrier, that is, has read it. This costs one row written and
one n-row table read per call (docs/BENCHMARKS.md gives the measured cost). A mismatch
in the whole-message mode (MPICOMM_SHM_PIECE=0), where the window may grow differently
on different ranks, is found by one small allgather before the window grows.

Synchronisation is ``Win.Sync`` (memory barrier; the window is in a passive-target
epoch from ``Lock_all``) around a barrier of the window's own communicator, so it
never matches mpicomm's other traffic on the group. With a core per rank that is
``Barrier`` (Open MPI spins: the fastest wake-up). When the ranks outnumber their cores
("crowded": e.g. 4 ranks on 2 cores) every barrier needs every rank scheduled, so a
spinning waiter only delays the rank it waits for: there the barrier is ``Ibarrier``
polled with ``Test`` and ``os.sched_yield()`` in between (docs/BENCHMARKS.md).

Results: integers exactly as the ordinary path (wrap-around arithmetic is
associative). Floats are reduced in the fixed order rank 0, 1, ..., n-1, once per
element, and copied to every rank: the same on every rank and from run to run
(at 2 ranks also bit-identical to Open MPI's, since a + b == b + a). float16 and
bfloat16 are reduced in float32 and rounded once, as on the ordinary path. MIN/MAX
propagate NaN (np.minimum/np.maximum).

This module is the window and the collectives through it (ShmGroup); which messages take
the path, and in pieces of what size, is in shm_config.py; the MPI transport reaches it
through ShmPath (shm_path.py).
"""
from __future__ import annotations

import os
from time import perf_counter

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveMismatchError
from .._callspec import PeerSpec, head_words
from .._ops import UFUNC as _UFUNC, ReduceOp, mpi_table, wire_op
from .shm_config import AUTO_PIECES, COLLECTIVES, WHOLE, piece_bytes

# the tuner (ShmGroup._tune)
EXPLORE = 16              # tuned calls after which the piece not in use is timed again
                          # (4x as many when it was > 1.25x slower than the best)
ORDINARY = 0              # the tuner's third choice for all_reduce: Open MPI's own path
_MAX_ORDINARY = 2 ** 31 - 1  # elements: Open MPI's count is a C int
# the window
_TUNER = 16               # bytes after the two buffers of rank 0's segment: the tuner's two slots,
_SIGW = 8                 # then the signature table: 2 halves x n rows of _SIGW int64 (a cache line)
_ALIGN = 64               # slot alignment: a cache line, so ranks never share one
_F32 = np.dtype(np.float32)


def signature(code, x, op=None, root=None):
    """The call's handshake words: the first five of its CallSpec (mpicomm._callspec:
    collective, dtype, element count, op, root)."""
    return head_words(code, x.dtype, x.size, op, root)


def describe(sig):
    return PeerSpec(tuple(sig[:5]) + (0, 0)).describe()


def mismatch_error(rows, where):
    """CollectiveMismatchError listing each rank's call (the same text on every rank)."""
    calls = "; ".join(f"rank {j}: {describe(s)}" for j, s in enumerate(rows))
    return CollectiveMismatchError(
        f"the ranks of the group called different collectives {where}: {calls}. Every rank must "
        "make the same call (collective, element count, dtype, op or root); rerun with "
        "MPICOMM_DEBUG=1 to check every call's arguments across ranks.")


def _round(v, a=_ALIGN):
    return -(-v // a) * a


class ShmGroup:
    """The shared window of one group, and the collectives done through it."""

    def __init__(self, node, piece, crowded=False):
        self.comm = node                  # the group's ranks, in group order; own context
        self.rank = node.Get_rank()
        self.size = node.Get_size()
        self.crowded = crowded            # more ranks than cores: barriers yield the core
        self.set_piece(piece)             # self.piece: cap on the bytes of one buffer;
        #                                   self.ordinary: the tuner chose Open MPI's path
        self.hdr = None                   # rank 0's two tuner slots (int64), in the window
        self.sigs = None                  # sigs[c & 1][j*_SIGW:]: rank j's signature of call c (int64)
        self.nsig = 0                     # calls run so far (same on every rank)
        self.tc = 0                       # tuned all_reduce calls so far (same on all ranks)
        self._stats = {}                  # rank 0: size class -> {piece: [s/byte, tc]}
        self.win = None
        self.seg = 0                      # bytes of one buffer of one rank's segment
        self.bufs = None                  # bufs[b][j]: buffer b of rank j's segment (uint8)
        self.k = 0                        # pieces done so far; piece k uses buffer k & 1
        self.calls = dict.fromkeys(COLLECTIVES, 0)   # collectives that took this path
        self.grows = 0                    # window (re)allocations
        self._acc = np.empty(0, _F32)     # float32 accumulator for float16 / bfloat16

    # ----------------------------------------------------------- setup
    @classmethod
    def open(cls, comm, piece=None):
        """A ShmGroup over MPI communicator ``comm`` when all its ranks share a host and
        shared windows work, else None (the same answer on every rank). Collective."""
        try:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        except MPI.Exception:
            node = MPI.COMM_NULL
        mine = node != MPI.COMM_NULL and node.Get_size() == comm.Get_size() \
            and node.Get_rank() == comm.Get_rank()
        # one host <=> every rank's node is the whole group; agree anyway (cheap, once)
        if not comm.allreduce(bool(mine), op=MPI.LAND):
            if node != MPI.COMM_NULL:
                node.Free()
            return None
        # crowded: the ranks outnumber the cores they may run on, all together (each
        # rank's affinity: a rank bound to one core still shares it)
        try:
            cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = set(range(os.cpu_count() or 1))
        crowded = comm.Get_size() > len(set().union(*node.allgather(cpus)))
        # the window is allocated at the first collective (a failure there is agreed on
        # and turns the path off, as here)
        return cls(node, piece, crowded)

    def set_piece(self, piece=None, env=os.environ):
        """Fix the piece (bytes), or with None the default: MPICOMM_SHM_PIECE if set, else
        tuned among AUTO_PIECES by all_reduce. Call it alike on every rank."""
        self.ordinary = False
        if piece is None and not env.get("MPICOMM_SHM_PIECE", "").strip():
            self.cands, self.piece = AUTO_PIECES, AUTO_PIECES[0]
        else:
            self.cands = None
            self.piece = piece_bytes(env) if piece is None else piece

    def _grow(self, need):
        """Make every buffer at least ``need`` bytes (collective; all ranks pass the
        same ``need``). False, on every rank, if the window cannot be allocated."""
        if need <= self.seg:
            return True
        # pipelined: one allocation of a whole piece (every collective's need fits it);
        # one piece per message: grow by at least 2x
        target = self.piece if self.piece < WHOLE else 2 * self.seg
        if self.cands:
            target = max(self.cands)      # any candidate fits, whichever the tuner picks
        seg = _round(max(need, target), 4096)
        hdr = _round(_TUNER + 2 * self.size * _SIGW * 8)
        self._free_win()
        win, err = None, None
        try:
            win = MPI.Win.Allocate_shared(2 * seg + hdr, 1, MPI.INFO_NULL, self.comm)
        except MPI.Exception as e:
            err = e
        if not self.comm.allreduce(err is None, op=MPI.LAND):
            if win is not None:
                win.Free()
            return False
        win.Lock_all(MPI.MODE_NOCHECK)
        views = []
        for j in range(self.size):
            buf, _ = win.Shared_query(j)
            views.append(np.frombuffer(buf, np.uint8, 2 * seg + hdr))
        self.bufs = [[v[:seg] for v in views], [v[seg:2 * seg] for v in views]]
        self.hdr = views[0][2 * seg:2 * seg + _TUNER].view(np.int64)
        t = views[0][2 * seg + _TUNER:2 * seg + _TUNER + 2 * self.size * _SIGW * 8].view(np.int64)
        h = self.size * _SIGW   # memoryviews: item stores and tolist() cost less than NumPy's
        self.sigs = (memoryview(t[:h]), memoryview(t[h:]))
        self.win, self.seg = win, seg
        self.grows += 1
        return True

    def _free_win(self):
        if self.win is not None:
            self.bufs = self.hdr = self.sigs = None
            self.win.Unlock_all()
            self.win.Free()            # collective, and a barrier: no peer reads it after
            self.win, self.seg = None, 0

    def close(self):
        self._free_win()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    # ----------------------------------------------------------- driving
    def run(self, name, gen, sig):
        """Run collective generator ``gen`` to the end (it yields at every barrier), blocking.

        ``sig`` is the call's signature (:func:`signature`): written into this rank's row
        of the table before the first barrier, compared with every rank's after it.
        """
        self.calls[name] += 1
        win = self.win
        c = self.nsig
        self.nsig = c + 1
        tab = self.sigs[c & 1]
        b = self.rank * _SIGW
        tab[b] = sig[0]
        tab[b + 1] = sig[1]
        tab[b + 2] = sig[2]
        tab[b + 3] = sig[3]
        tab[b + 4] = sig[4]
        tab[b + 5] = self.k
        first = True
        if self.crowded:
            ibar, yld = self.comm.Ibarrier, os.sched_yield
            for _ in gen:
                win.Sync()
                req = ibar()
                while not req.Test():
                    yld()
                win.Sync()
                if first:
                    first = False
                    self._check(tab, gen, sig)
        else:
            bar = self.comm.Barrier
            for _ in gen:
                win.Sync()
                bar()
                win.Sync()
                if first:
                    first = False
                    self._check(tab, gen, sig)

    def _check(self, tab, gen, sig):
        """After the call's first barrier: raise on every rank alike if the ranks' signatures
        differ. The calls stop there, before anyone reads a peer's buffer; the piece counter
        is set alike on every rank (their calls may have started different numbers of pieces)."""
        t = tab.tolist()
        n = self.size
        if t[0::_SIGW].count(sig[0]) != n or t[1::_SIGW].count(sig[1]) != n \
                or t[2::_SIGW].count(sig[2]) != n or t[3::_SIGW].count(sig[3]) != n \
                or t[4::_SIGW].count(sig[4]) != n:
            rows = [t[j * _SIGW:j * _SIGW + 6] for j in range(n)]
            gen.close()
            self.k = max(row[5] for row in rows) + 1
            raise mismatch_error(rows, "on the shared-memory path")

    # ----------------------------------------------------------- collectives
    def all_reduce(self, x, o, info, op):
        n, isz = self.size, x.itemsize
        # Open MPI's own all_reduce is a third choice of the tuner where its result is the
        # same bits as this path's: two ranks (a + b == b + a) or integers (exact), and no
        # float32 detour for float16/bfloat16. Every rank computes this alike. Messages of
        # more than one piece are tuned (the piece matters), and so are those of one piece
        # where Open MPI is a choice (in place, it often wins below a few MiB).
        ordinary_ok = self.cands is not None and not info.upcast and x.size <= _MAX_ORDINARY \
            and (n == 2 or info.dtype.kind in "iub")
        tuned = self.cands is not None and (x.nbytes > self.cands[0] or ordinary_ok)
        if tuned and self.ordinary and ordinary_ok:
            return self._tune(self._ordinary(x, o, info, op), x.nbytes, ORDINARY, ordinary_ok, o is x)
        a = _ALIGN // isz if isz <= _ALIGN else 1
        pe = max(n * a, (self.piece // isz) // (n * a) * (n * a))   # elements of a piece
        c = x.size
        q = _round(-(-min(pe, c) // n), a)                           # elements of a slot
        if not self._grow(n * q * isz):
            return None
        gen = self._all_reduce(x.reshape(-1), o.reshape(-1), info, op, pe, isz)
        if tuned:
            return self._tune(gen, x.nbytes, self.piece, ordinary_ok, o is x)
        return gen

    def _ordinary(self, x, o, info, op):
        """Open MPI's all_reduce over the group (a generator with one barrier before it, where
        the signatures are compared)."""
        yield
        mop = mpi_table(info)[op]   # the MPI ops whose results are this path's (NaN, bool, wrap-around)
        if o is x:
            self.comm.Allreduce(MPI.IN_PLACE, [o, info.mpi], mop)
        else:
            self.comm.Allreduce([x, info.mpi], [o, info.mpi], mop)
        if op is ReduceOp.AVG:
            np.divide(o, self.size, out=o)

    # ----------------------------------------------------------- piece tuner
    def _tune(self, gen, nbytes, used, ordinary_ok, inplace):
        """Run all_reduce generator ``gen`` and agree on the choice of the next tuned call.

        The choices are the pieces of AUTO_PIECES and, where ``ordinary_ok``, Open MPI's
        own all_reduce (ORDINARY). Rank 0 times every tuned call per size class (power of
        two, in place or not) and choice, and picks the choice of the next tuned call: the
        one with the lower recent time per byte, or another when it has not been timed for
        EXPLORE calls (4 * EXPLORE if it was > 1.25x slower). It writes that choice into
        slot (tc + 1) & 1 of its header before its first barrier of call tc (before the
        Allreduce of an ordinary call); every rank reads it after that barrier (after the
        Allreduce, which no rank completes before rank 0 has entered it) and uses it from
        call tc + 1 on. Rank 0 writes that slot again at call tc + 2, after call tc + 1's
        first synchronisation, which every rank reaches only after reading. No choice
        changes results: each element is reduced over ranks 0..n-1 in that order
        whatever the piece, and Open MPI is a choice only where its result is the same.
        """
        t0 = perf_counter()
        cls_ = (nbytes.bit_length(), inplace)
        cands = self.cands + (ORDINARY,) if ordinary_ok else self.cands
        slot = (self.tc + 1) & 1
        hdr = self.hdr
        if self.rank == 0:
            hdr[slot] = self._decide(cls_, cands)
        nxt = None
        for _ in gen:
            yield
            if nxt is None:
                nxt = int(hdr[slot])
        if nxt is None:  # (every choice has a barrier: not reached)
            self.win.Sync()
            nxt = int(hdr[slot])
        if self.rank == 0:
            self._record(cls_, used, (perf_counter() - t0) / nbytes)
        self.tc += 1
        if nxt == ORDINARY:
            self.ordinary = True
        elif nxt in self.cands:
            self.ordinary = False
            self.piece = nxt

    def _decide(self, cls_, cands):
        """Rank 0: the choice for tuned call tc + 1 (stats of calls up to tc - 1)."""
        st = self._stats.setdefault(cls_, {})   # choice -> [s/byte, call, to be replaced]
        best = min((st[p][0] for p in cands if p in st), default=0.0)
        for p in cands:
            e = st.get(p)
            # a choice last timed much slower than the best is timed again 4x less often
            if e is None or self.tc - e[1] >= (EXPLORE if e[0] <= 1.25 * best else 4 * EXPLORE):
                # never timed, or not lately: time it at call tc + 1
                st[p] = [e[0] if e else float("inf"), self.tc + 1, True]
                return p
        return min(cands, key=lambda p: st[p][0])

    def _record(self, cls_, used, t):
        st = self._stats.setdefault(cls_, {})
        e = st.get(used)
        if e is not None and not e[2] and self.tc - e[1] <= 2:
            t = 0.5 * (e[0] + t)          # smooth a run of calls; a stale time is replaced
        st[used] = [t, self.tc, False]

    def _all_reduce(self, xf, of, info, op, pe, isz):
        n, r = self.size, self.rank
        dt = xf.dtype
        ufunc = _UFUNC[wire_op(op, info)]   # bool: np.maximum (OR) or np.minimum (AND)
        c = xf.size
        a = _ALIGN // isz if isz <= _ALIGN else 1
        for start in range(0, c, pe):
            stop = min(start + pe, c)
            q = _round(-(-(stop - start) // n), a)
            qb = q * isz
            b = self.k & 1
            self.k += 1
            bufs = self.bufs[b]
            mine = bufs[r]
            lo = [min(start + j * q, stop) for j in range(n + 1)]
            for j in range(n):
                if j != r and lo[j + 1] > lo[j]:
                    mine[j * qb:j * qb + (lo[j + 1] - lo[j]) * isz].view(dt)[...] = xf[lo[j]:lo[j + 1]]
            yield
            m = lo[r + 1] - lo[r]
            if m:
                dst = mine[r * qb:r * qb + m * isz].view(dt)
                ops = [xf[lo[r]:lo[r + 1]] if j == r else bufs[j][r * qb:r * qb + m * isz].view(dt)
                       for j in range(n)]
                self._reduce(ops, dst, op, ufunc, info.upcast, m)
            yield
            for j in range(n):
                if lo[j + 1] > lo[j]:
                    of[lo[j]:lo[j + 1]] = bufs[j][j * qb:j * qb + (lo[j + 1] - lo[j]) * isz].view(dt)

    def _reduce(self, ops, dst, op, ufunc, upcast, m):
        """dst = ops[0] op ops[1] op ... (left to right); AVG divides by n. Overflow to
        inf is silent, as on the ordinary path (MPI does not warn)."""
        with np.errstate(over="ignore", invalid="ignore"):
            self._reduce_into(ops, dst, op, ufunc, upcast, m)

    def _reduce_into(self, ops, dst, op, ufunc, upcast, m):
        n = len(ops)
        if upcast:
            if self._acc.size < m:
                self._acc = np.empty(m, _F32)
            acc = self._acc[:m]
            ufunc(ops[0], ops[1], out=acc, dtype=_F32)
            for v in ops[2:]:
                ufunc(acc, v, out=acc, dtype=_F32)
            if op is ReduceOp.AVG:
                np.divide(acc, n, out=acc)
            dst[...] = acc
            return
        ufunc(ops[0], ops[1], out=dst)
        for v in ops[2:]:
            ufunc(dst, v, out=dst)
        if op is ReduceOp.AVG:
            np.divide(dst, n, out=dst)

    def reduce_scatter(self, x, o, info, op):
        n, isz = self.size, x.itemsize
        a = _ALIGN // isz if isz <= _ALIGN else 1
        cc = x.size // n
        pe = max(a, (self.piece // isz) // (n * a) * a)               # elements of a slot
        q = _round(min(pe, cc), a)
        if not self._grow(n * q * isz):
            return None
        return self._reduce_scatter(x.reshape(-1), o.reshape(-1), info, op, pe, isz)

    def _reduce_scatter(self, xf, of, info, op, pe, isz):
        n, r = self.size, self.rank
        dt = xf.dtype
        ufunc = _UFUNC[wire_op(op, info)]   # bool: np.maximum (OR) or np.minimum (AND)
        cc = xf.size // n
        a = _ALIGN // isz if isz <= _ALIGN else 1
        for start in range(0, cc, pe):
            stop = min(start + pe, cc)
            m = stop - start
            qb = _round(m, a) * isz
            b = self.k & 1
            self.k += 1
            bufs = self.bufs[b]
            mine = bufs[r]
            for j in range(n):
                if j != r:
                    mine[j * qb:j * qb + m * isz].view(dt)[...] = xf[j * cc + start:j * cc + stop]
            yield
            ops = [xf[r * cc + start:r * cc + stop] if j == r else bufs[j][r * qb:r * qb + m * isz].view(dt)
                   for j in range(n)]
            self._reduce(ops, of[start:stop], op, ufunc, info.upcast, m)

    def all_gather(self, x, o):
        need = min(x.nbytes, self.piece)
        if not self._grow(need):
            return None
        return self._all_gather(x.reshape(-1).view(np.uint8), o.reshape(-1).view(np.uint8))

    def _all_gather(self, xb, ob):
        n, r = self.size, self.rank
        mb = xb.size
        ob[r * mb:(r + 1) * mb] = xb            # own part straight, before the first barrier
        p = min(self.seg, self.piece)
        for start in range(0, mb, p):
            stop = min(start + p, mb)
            b = self.k & 1
            self.k += 1
            bufs = self.bufs[b]
            bufs[r][:stop - start] = xb[start:stop]
            yield
            for j in range(n):
                if j != r:
                    ob[j * mb + start:j * mb + stop] = bufs[j][:stop - start]

    def broadcast(self, h, root):
        need = min(h.nbytes, self.piece)
        if not self._grow(need):
            return None
        return self._broadcast(h.reshape(-1).view(np.uint8), root)

    def _broadcast(self, hb, root):
        is_root = self.rank == root
        mb = hb.size
        p = min(self.seg, self.piece)
        for start in range(0, mb, p):
            stop = min(start + p, mb)
            b = self.k & 1
            self.k += 1
            src = self.bufs[b][root]
            if is_root:
                src[:stop - start] = hb[start:stop]
            yield
            if not is_root:
                hb[start:stop] = src[:stop - start]
