"""What a call is, in one vocabulary: the facts every rank of a group must agree on.

A :class:`CallSpec` is built once per prepared call (the dispatcher reuses it with the
prepared call) from the collective, the input and its ``arg``: the dtype, the element
count, the op, the root, the trailing shape of collectives that concatenate along axis 0,
and the per-rank sizes of an uneven call. It encodes to

* ``sig``: a 32-bit hash, published with the call's sequence number in one machine word
  (``seq << 32 | sig``) that the agreement check compares across ranks on every call;
* ``words()``: a few int64 words that a peer can read from this rank's progress window and
  turn back into a description (:func:`from_words`), and that a rank standing in for a
  refused call builds its stand-in from;
* ``describe()``: the call in words ("all_reduce of 4 x float32, op sum");
* ``diff(other)``: the fields that differ, in words.

Facts that differ between ranks by design are left out: the role of ``out=`` (in place or
not), the array's class (NumPy, CuPy, PyTorch), and, in uneven calls, each rank's own count.
"""
from __future__ import annotations

import zlib

from ._ops import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, GATHER, NAMES, REDUCE, REDUCE_SCATTER,
                   SCATTER, ReduceOp, Sized)

REFUSED = 0xFFFFFFFF        # the sig of a call this rank refused (an argument error, or a peer's report)
GPU = 0x100                 # in the first word: the call's arrays are GPU arrays
ASYNC = 0x200               # in the first word: started with async_op=True (a member that refuses
#                             the call does not stand in for a started one); in the signature of
#                             host calls: MPI never matches a nonblocking collective with a blocking one
SPEC_WORDS = 7              # code, dtype, count, op + 1, root + 1, tail hash, sizes hash
_OPS = tuple(ReduceOp)
_DTYPES = {}                # dtype id -> name (every name this process has seen, and the common ones)


def _crc(text):
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def dtype_name(dtype):
    """'float32' for NumPy's, CuPy's and PyTorch's float32 alike."""
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = str(dtype)
    return name.replace("torch.", "")


def dtype_id(name):
    i = _crc(name) + 1
    _DTYPES[i] = name
    return i


for _n in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
           "bfloat16", "float32", "float64", "complex64", "complex128"):
    dtype_id(_n)


def dtype_of_id(i):
    """The dtype name that id ``i`` stands for (a common one, or one this process has seen), or None."""
    return _DTYPES.get(i)


_IDS_OF = {}                # dtype object -> its id (the hot paths' cache)


def head_words(code, dtype, count, op=None, root=None):
    """The first five words of a CallSpec (collective, dtype, element count, op + 1, root + 1)
    without building one: the shared-memory path's handshake compares these."""
    i = _IDS_OF.get(dtype)
    if i is None:
        i = _IDS_OF[dtype] = dtype_id(dtype_name(dtype))
    return (code, i, count, _OPS.index(op) + 1 if op is not None else 0, root + 1 if root is not None else 0)


class CallSpec:
    """The agreed facts of one call (see the module docstring)."""

    __slots__ = ("code", "dtype", "count", "op", "root", "tail", "sizes", "gpu", "sig", "_words")

    def __init__(self, code, dtype="", count=0, op=None, root=None, tail=None, sizes=None, gpu=False):
        self.code = code
        self.dtype = dtype          # the dtype's name ('' for calls without an array)
        self.count = count          # elements every rank passes (0 where they differ by design)
        self.op = op                # a ReduceOp or None
        self.root = root            # a group rank or None
        self.tail = tail            # the trailing shape (x.shape[1:]) where it must agree, else None
        self.sizes = sizes          # per-rank sizes / splits of an uneven call, else None
        self.gpu = gpu              # a GPU array (NCCL), else host memory (MPI)
        w = self._words = (code | (GPU if gpu else 0), dtype_id(dtype) if dtype else 0, count,
                           _OPS.index(op) + 1 if op is not None else 0,
                           root + 1 if root is not None else 0,
                           _crc(repr(tail)) if tail is not None else 0,
                           _crc(repr(sizes)) if sizes is not None else 0)
        s = zlib.crc32(repr(w).encode())
        self.sig = s ^ 1 if s == REFUSED else s

    def words(self):
        return self._words

    def started_async(self):
        """This call is started with async_op=True: said in the words, and for host arrays in
        the signature too (MPI: a nonblocking collective never matches a blocking one, so the
        ranks must agree on it; NCCL runs both alike, in stream order)."""
        w = self._words = (self._words[0] | ASYNC,) + self._words[1:]
        if not self.gpu:
            s = zlib.crc32(repr(w).encode())
            self.sig = s ^ 1 if s == REFUSED else s

    @property
    def name(self):
        return NAMES.get(self.code, f"collective #{self.code}")

    def describe(self):
        text = self.name
        if self.dtype:
            text += f" of {self.count} x {self.dtype}" if self.count else f" of {self.dtype}"
        if self.tail is not None and len(self.tail):
            text += f", trailing shape {_shape(self.tail)}"
        if self.op is not None:
            text += f", op {self.op.value}"
        if self.root is not None:
            text += f", root {self.root}"
        if self.sizes is not None:
            text += f", sizes {_shape(self.sizes)}"
        if self._words[0] & ASYNC:
            text += ", async_op=True"
        return text + (" (GPU arrays)" if self.gpu else "")

    def diff(self, other):
        """The fields in which ``other`` (a CallSpec or a PeerSpec) differs, in words."""
        a, b = self.words(), other.words()
        a = (a[0] & 0xFF, a[0] & GPU, a[0] & ASYNC) + a[1:]
        b = (b[0] & 0xFF, b[0] & GPU, b[0] & ASYNC) + b[1:]
        names = ("collective", "GPU or host arrays", "async_op", "dtype", "element count", "op", "root",
                 "trailing shape", "sizes")
        return ", ".join(n for n, x, y in zip(names, a, b) if x != y) or "the call"


class PeerSpec:
    """Another rank's call, decoded from the words it published (hashes stay hashes)."""

    __slots__ = ("_words",)

    def __init__(self, words):
        self._words = tuple(int(v) for v in words)

    def words(self):
        return self._words

    @property
    def code(self):
        return self._words[0] & 0xFF

    @property
    def gpu(self):
        return bool(self._words[0] & GPU)

    @property
    def started(self):
        """The call was started with async_op=True."""
        return bool(self._words[0] & ASYNC)

    @property
    def name(self):
        return NAMES.get(self.code, f"collective #{self.code}")

    @property
    def dtype(self):
        return _DTYPES.get(self._words[1], "") if self._words[1] else ""

    @property
    def count(self):
        return self._words[2]

    @property
    def op(self):
        return _OPS[self._words[3] - 1] if 0 < self._words[3] <= len(_OPS) else None

    @property
    def root(self):
        return self._words[4] - 1 if self._words[4] else None

    @property
    def sized(self):
        return self._words[6] != 0

    def describe(self, mine=None):
        code, dt, count, op, root, tail, sizes = self._words
        text = self.name
        if dt:
            dname = _DTYPES.get(dt, f"dtype #{dt}")
            text += f" of {count} x {dname}" if count else f" of {dname}"
        if mine is not None and tail and tail != mine.words()[5]:
            text += ", another trailing shape"
        if op:
            text += f", op {self.op.value if self.op is not None else op}"
        if root:
            text += f", root {root - 1}"
        if mine is not None and sizes and sizes != mine.words()[6]:
            text += ", other sizes"
        elif sizes:
            text += ", per-rank sizes"
        if code & ASYNC:
            text += ", async_op=True"
        return text + (" (GPU arrays)" if self.gpu else "")


def same_bytes(a, b):
    """True when calls ``a`` and ``b`` (PeerSpec or CallSpec) differ only in what MPI does not
    see (an op, a dtype of the same size): every message of either is matched by the other's."""
    from ._dtypes import dtype_of

    wa, wb = a.words(), b.words()
    try:
        sa, sb = dtype_of(a.dtype).itemsize, dtype_of(b.dtype).itemsize
    except (TypeError, ValueError):   # a dtype this process cannot name
        return False
    return wa[0] == wb[0] and wa[2] == wb[2] and wa[4:] == wb[4:] and sa == sb


def standable(spec):
    """Whether a member can take part in call ``spec`` in another's place with scratch arrays:
    not where each rank brings its own sizes, nor for a call without arrays (an object
    collective, creating or destroying a group) other than a barrier."""
    return not spec.sized and spec.code != 0 and (spec.code == BARRIER or bool(spec.dtype))


def _shape(t):
    return "(" + ", ".join(map(str, t)) + ("," if len(t) == 1 else "") + ")"


def _count(x):
    n = 1
    for d in x.shape:
        n *= d
    return n


def spec_of(code, x, out, arg, size, rank):
    """The CallSpec of collective ``code`` on ``x`` with ``arg``, on group rank ``rank`` of a
    group of ``size`` ranks."""
    from ._arrays import is_gpu_array

    gpu = is_gpu_array(x) if x is not None else False
    shape = tuple(getattr(x, "shape", ()) or ())
    dt = dtype_name(getattr(x, "dtype", ""))
    count = _count(x) if hasattr(x, "shape") else 0
    tail = shape[1:] if shape else ()
    if arg.__class__ is Sized:
        base, sizes, out_sizes = arg
        if code == ALL_TO_ALL:   # in and out splits pair up between ranks: not one value
            return CallSpec(code, dt, 0, tail=tail, gpu=gpu)
        if code == REDUCE_SCATTER:
            return CallSpec(code, dt, count, op=base, sizes=sizes, gpu=gpu)
        if code == GATHER:
            return CallSpec(code, dt, 0 if sizes is not None else count, root=base, tail=tail, sizes=sizes, gpu=gpu)
        if code == SCATTER:
            if sizes is not None:
                return CallSpec(code, dt, 0, root=base, tail=tail, sizes=sizes, gpu=gpu)
            # x is the root's whole array there, this rank's part elsewhere
            return CallSpec(code, dt, count // size if rank == base and size else count, root=base, tail=tail, gpu=gpu)
        if code == ALL_GATHER:
            return CallSpec(code, dt, 0 if sizes is not None else count, tail=tail, sizes=sizes, gpu=gpu)
        return CallSpec(code, dt, count, sizes=sizes, gpu=gpu)
    if code == ALL_REDUCE or code == REDUCE_SCATTER:
        return CallSpec(code, dt, count, op=arg, gpu=gpu)
    if code == BROADCAST:
        return CallSpec(code, dt, count, root=arg, gpu=gpu)
    if code == REDUCE:
        return CallSpec(code, dt, count, op=arg[0], root=arg[1], gpu=gpu)
    if code == ALL_GATHER or code == ALL_TO_ALL:
        return CallSpec(code, dt, count, tail=tail, gpu=gpu)
    return CallSpec(code, dt, count, gpu=gpu)


_PLAIN = {}


def plain_spec(code, async_op=False):
    """The spec of a call without arrays (barrier, creating or destroying a group);
    ``async_op``: started with async_op=True (a barrier: MPI never matches ``Ibarrier`` with
    ``Barrier``, so the ranks must agree on it, as for host arrays' collectives)."""
    s = _PLAIN.get((code, async_op))
    if s is None:
        s = CallSpec(code)
        if async_op:
            s.started_async()
        _PLAIN[(code, async_op)] = s
    return s
