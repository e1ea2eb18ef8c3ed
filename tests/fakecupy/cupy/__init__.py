"""A test double of CuPy for mpicomm's NCCL transport (tests only; see tests/test_nccl_double.py).

"Device" memory is host memory: each ``ndarray`` wraps a NumPy view of an allocation that
this module registers, so a raw pointer the transport hands to ``cupy.cuda.nccl`` can be
checked (it must lie inside one live allocation, with room for its count) and read or
written. ``cupy.cuda.nccl.NcclCommunicator`` moves the bytes between the ranks through
real MPI (mpi4py). Like CuPy, an ndarray refuses implicit conversion to NumPy (``.get()``
or ``cupy.asnumpy`` copy to the host).

Streams run their work eagerly, in the calling thread (an NCCL call outside a group
returns with its data in place; sends aside: they complete at the next synchronisation),
but their order is modelled: a read on a stream of memory last written on another stream
that nothing orders after it is recorded in ``cupy.hazards`` (read-after-write only; see
"stream order" below). What it does not model: asynchrony itself (an event is complete
once the sends before it are), kernels, CUDA graphs beyond NCCL calls (a stream capture
records and replays those only: cupy.cuda),
bfloat16 arrays (as CuPy), DLPack, and array methods mpicomm and its tests do not use. This package is put on ``sys.path``
by tests/test_nccl_double.py only, and is not installed with mpicomm.
"""
import bisect
import threading
import weakref

import numpy as np

__version__ = "0.0-fake"
FAKE = True   # tells the double from a real CuPy

# ----------------------------------------------------------------- the allocation registry
_lock = threading.Lock()
_starts = []       # sorted start addresses of live allocations
_allocs = {}       # start -> (nbytes, device id)
_freed = []        # starts of allocations whose memory went (appended by their finalizers)


def _sweep():
    """Drop freed allocations (under _lock). A finalizer only appends to _freed: it may run
    inside any allocation, the registry's own included, so it never takes the lock."""
    while _freed:
        start = _freed.pop()
        if _allocs.pop(start, None) is not None:
            del _starts[bisect.bisect_left(_starts, start)]


def _allocate(shape, dtype):
    """A new registered allocation of ``shape``/``dtype`` on the current device (a NumPy view)."""
    from .cuda import Device

    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        raise TypeError("CuPy has no bfloat16 arrays (the fake neither)")
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    dev = Device().id
    base = np.empty(max(n, 1), np.uint8)   # never 0 bytes: every allocation has its own address
    start = base.ctypes.data
    with _lock:
        _sweep()
        _allocs[start] = (base.nbytes, dev)
        bisect.insort(_starts, start)
    weakref.finalize(base, _freed.append, start)
    return base[:n].view(dtype).reshape(shape)


def lookup(ptr, nbytes):
    """(start, size, device) of the live allocation holding [ptr, ptr + nbytes), else None."""
    with _lock:
        _sweep()
        i = bisect.bisect_right(_starts, ptr) - 1
        if i < 0:
            return None
        start = _starts[i]
        size, dev = _allocs[start]
    if ptr + nbytes <= start + size:
        return start, size, dev
    return None


def host_view(ptr, nbytes, what="buffer"):
    """A writable uint8 NumPy view of device memory [ptr, ptr + nbytes); ValueError naming
    ``what`` when that range is not inside one live allocation of this double."""
    import ctypes

    if nbytes == 0:
        return np.empty(0, np.uint8)
    if lookup(ptr, nbytes) is None:
        near = lookup(ptr, 1)
        where = (f"it starts inside the allocation [{near[0]:#x}, +{near[1]} B), which it overruns"
                 if near else "no device allocation holds its start (a host pointer, or freed memory?)")
        raise ValueError(f"{what} [{ptr:#x}, +{nbytes} B) is not device memory: {where}")
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), np.uint8)


# ----------------------------------------------------------------- stream order
# Work runs eagerly, but the double remembers, per allocation, the stream of its last write
# not yet known complete; a read on a stream that nothing orders after that one is a race on
# a GPU and is recorded in ``hazards`` (not raised: a raise inside a collective on one rank
# would leave the others inside it; every rank records the same race alike). Ordered: the same stream, or the legacy null stream
# (handle 0) and a blocking stream. A synchronisation of a stream (or the device) clears its
# writes; an event's synchronize and a stream's wait_event clear those of the event's stream
# (lenient: also writes after its record). Only read-after-write is modelled.
_dirty = {}            # allocation start -> (stream handle, what wrote it)
_nonblocking = set()   # handles of non-blocking streams


hazards = []          # the races seen (descriptions), for the tests to check and clear


def _current():
    from .cuda import get_current_stream

    return get_current_stream().ptr


def _ordered(q, s):
    return q == s or (q == 0 and s not in _nonblocking) or (s == 0 and q not in _nonblocking)


def wrote(ptr, nbytes, stream, what):
    hit = lookup(ptr, nbytes) if nbytes else None
    if hit is not None:
        _dirty[hit[0]] = (stream, what)


def read(ptr, nbytes, stream, what):
    hit = lookup(ptr, nbytes) if nbytes else None
    d = _dirty.get(hit[0]) if hit is not None else None
    if d is not None and not _ordered(d[0], stream):
        hazards.append(f"{what} reads [{ptr:#x}, +{nbytes} B) on stream {stream:#x}, last written by "
                       f"{d[1]} on stream {d[0]:#x}, and nothing orders the two (a race on a GPU)")


def synced(stream=None):
    """Writes of ``stream`` (None: every stream) are complete."""
    for k in [k for k, (q, _) in _dirty.items() if stream is None or q == stream]:
        _dirty.pop(k, None)


def _rd(a, what):
    if a.size:
        read(a.__array_interface__["data"][0], a.nbytes if a.flags.c_contiguous else 1, _current(), what)


def _wr(a, what):
    if a.size:
        wrote(a.__array_interface__["data"][0], a.nbytes if a.flags.c_contiguous else 1, _current(), what)


# ----------------------------------------------------------------- arrays
class MemoryPointer:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id


def _dev_of(a):
    hit = lookup(a.__array_interface__["data"][0], 1) if a.size else None
    if hit is None:
        from .cuda import Device

        return Device().id
    return hit[2]


class ndarray:
    """A device array of the double: a NumPy view of registered memory."""

    __slots__ = ("_a", "_dev", "__weakref__")

    def __init__(self, a, dev=None):
        self._a = a
        self._dev = _dev_of(a) if dev is None else dev

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    _c_contiguous = property(lambda self: self._a.flags.c_contiguous)
    data = property(lambda self: MemoryPointer(self._a.__array_interface__["data"][0], self._dev))
    device = property(lambda self: __import__("cupy.cuda", fromlist=["Device"]).Device(self._dev))

    @property
    def __cuda_array_interface__(self):
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (self.data.ptr, False), "version": 3,
                "strides": None if a.flags.c_contiguous else a.strides, "descr": a.dtype.descr}

    def __array__(self, *args, **kw):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"fakecupy.ndarray({self._a!r}, device={self._dev})"

    def __getitem__(self, idx):
        return ndarray(self._a[idx], self._dev)

    def __setitem__(self, idx, value):
        if isinstance(value, ndarray):
            _rd(value._a, "an array copy (x[...] = y)")
        self._a[idx] = value._a if isinstance(value, ndarray) else value
        _wr(self._a, "an array copy (x[...] = y)")

    def copy(self):
        _rd(self._a, "x.copy()")
        return _wrap_copy(self._a, self._dev)

    def astype(self, dtype):
        _rd(self._a, "x.astype()")
        return _wrap_copy(self._a.astype(dtype), self._dev)

    def reshape(self, *shape):
        return ndarray(self._a.reshape(*shape), self._dev)

    def ravel(self):
        return ndarray(self._a.ravel(), self._dev) if self._c_contiguous else self.copy().ravel()

    def view(self, dtype=None):
        return ndarray(self._a.view() if dtype is None else self._a.view(dtype), self._dev)

    def fill(self, v):
        self._a.fill(v)
        _wr(self._a, "x.fill()")

    def get(self, stream=None):
        """A host copy (like CuPy, after the stream's work: here, pending sends drained)."""
        from .cuda import _drain

        _drain()
        _rd(self._a, "x.get()")   # (on the current stream, which it then synchronises)
        synced(_current())
        return self._a.copy()

    def set(self, h, stream=None):
        h = np.asarray(h)
        if h.shape != self._a.shape or h.dtype != self._a.dtype:
            raise ValueError(f"set: shape/dtype {h.shape}/{h.dtype} differ from {self._a.shape}/{self._a.dtype}")
        self._a[...] = h
        _wr(self._a, "x.set()")


def _wrap_copy(a, dev=None):
    from .cuda import Device

    if dev is None:
        dev = Device().id
    with Device(dev):
        o = _allocate(a.shape, a.dtype)
    o[...] = a
    _wr(o, "a copy into a new array")
    return ndarray(o, dev)


def empty(shape, dtype=float, order="C"):
    return ndarray(_allocate(shape, dtype))


def zeros(shape, dtype=float):
    o = empty(shape, dtype)
    o.fill(0)
    return o


def asarray(a, dtype=None):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:   # another library's device array: a view of the same memory
        shape, dt = tuple(cai["shape"]), np.dtype(cai["typestr"])
        strides = cai.get("strides") or None
        n = int(np.prod(shape, dtype=np.int64))
        if strides and any(st < 0 for st in strides):
            raise ValueError("the CuPy double takes no negative strides")
        span = 0 if n == 0 else (dt.itemsize + sum((s - 1) * st for s, st in zip(shape, strides))
                                 if strides else n * dt.itemsize)
        mem = host_view(cai["data"][0], span, "__cuda_array_interface__ data")
        v = np.ndarray(shape, dt, buffer=mem, strides=strides)
        r = ndarray(v)
        return r if dtype is None else asarray(r, dtype)
    return _wrap_copy(np.asarray(a, dtype))


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    return a if a._c_contiguous else a.copy()


def asnumpy(a, stream=None):
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def from_dlpack(x):
    raise TypeError(f"the CuPy double has no DLPack import ({type(x).__name__})")


from . import cuda  # noqa: E402,F401
