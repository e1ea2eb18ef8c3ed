"""cupy.cuda of the double: devices (numbers only), streams and events (work runs eagerly,
so an event is complete once the sends recorded before it have completed), and stream
capture of the double's NCCL calls: between ``Stream.begin_capture()`` and
``end_capture()`` an NCCL call on that stream is checked and recorded instead of run, and
the returned ``Graph``'s ``launch()`` runs the recorded calls again, in order, on the
arrays' current contents (as a replayed CUDA graph does). Only NCCL calls are captured:
copies and array arithmetic still run at once, so a test captures collectives only.
The CUDA driver is never asked (mpicomm's own capture checks see no capture here)."""
import itertools
import os
import threading
import weakref

_tls = threading.local()
_ptrs = itertools.count(0x7E570000, 0x100)   # handles of streams and events (never real ones)
_events = weakref.WeakValueDictionary()      # event handle -> Event, for runtime.eventRecord
_capturing = {}                              # stream handle -> the NCCL calls its capture recorded


def device_count():
    return int(os.environ.get("FAKECUPY_DEVICES", "8"))


def _current_device():
    return getattr(_tls, "device", 0)


def _registry():
    import cupy

    return cupy


def _drain():
    """Complete every send still pending (what synchronising a stream or device waits for)."""
    nccl._wait_pending(None)


class Device:
    def __init__(self, device=None):
        self.id = _current_device() if device is None else int(device)
        if not 0 <= self.id < device_count():
            raise ValueError(f"device {self.id} does not exist (the double has {device_count()})")
        self._prev = []

    def use(self):
        _tls.device = self.id

    def __enter__(self):
        self._prev.append(_current_device())
        self.use()
        return self

    def __exit__(self, *exc):
        _tls.device = self._prev.pop()
        return False

    def synchronize(self):
        _drain()
        _registry().synced(None)

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id} (fake)>"


class Stream:
    """A stream: ``ptr`` is its handle (0 for the null stream); its work has run eagerly."""

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = 0 if null else next(_ptrs)
        self.device_id = _current_device()
        if non_blocking:
            _registry()._nonblocking.add(self.ptr)
        self._prev = []

    def use(self):
        _tls.stream = self
        return self

    def __enter__(self):
        self._prev.append(get_current_stream())
        return self.use()

    def __exit__(self, *exc):
        _tls.stream = self._prev.pop()
        return False

    def synchronize(self):
        _drain()
        _registry().synced(self.ptr)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        if event._stream is not None:
            _registry().synced(event._stream)

    @property
    def done(self):
        return nccl._test_pending(None)

    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise RuntimeError("cannot capture the null stream (as CUDA)")
        if self.ptr in _capturing:
            raise RuntimeError("the stream is capturing already")
        _capturing[self.ptr] = []

    def is_capturing(self):
        return self.ptr in _capturing

    def end_capture(self):
        if self.ptr not in _capturing:
            raise RuntimeError("the stream is not capturing")
        return Graph(_capturing.pop(self.ptr))


class Graph:
    """A captured graph of the double: the NCCL calls recorded during its capture."""

    def __init__(self, calls):
        self._calls = calls

    def launch(self, stream=None):
        for comm, name, regions, post in self._calls:
            comm._submit(name, regions, post, replay=True)

    def upload(self, stream=None):
        pass


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    """A stream made elsewhere, known by its handle: the same stream as any other with ``ptr``."""

    def __init__(self, ptr, device_id=-1):
        self.ptr = int(ptr)
        self.device_id = _current_device() if device_id < 0 else device_id
        self._prev = []


def get_current_stream(device_id=None):
    s = getattr(_tls, "stream", None)
    return Stream.null if s is None else s


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr = next(_ptrs)
        self._after = None   # the last pending send its record waits for (None: none)
        self._stream = None  # the handle of the stream it was recorded on
        _events[self.ptr] = self

    def record(self, stream=None):
        self._after = nccl._pending_now()
        self._stream = get_current_stream().ptr if stream is None else getattr(stream, "ptr", stream)

    @property
    def done(self):
        return self._after is None or nccl._test_pending(self._after)

    def synchronize(self):
        if self._after is not None:
            nccl._wait_pending(self._after)
        if self._stream is not None:
            _registry().synced(self._stream)


from . import nccl, runtime  # noqa: E402,F401  (cupy.cuda.nccl, cupy.cuda.runtime)
