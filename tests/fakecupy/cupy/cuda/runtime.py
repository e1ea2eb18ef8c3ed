"""cupy.cuda.runtime of the double: device counts, event records, copies between host and
(registered) device memory, all synchronous."""
import ctypes

from . import Device, _current_device, _drain, _events, device_count

memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, memcpyDefault = 0, 1, 2, 3, 4


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount():
    return device_count()


def getDevice():
    return _current_device()


def setDevice(i):
    Device(i).use()


def eventRecord(event, stream):
    if not isinstance(event, int) or not isinstance(stream, int):
        raise CUDARuntimeError(f"eventRecord takes handles (ints), got {type(event).__name__}, "
                               f"{type(stream).__name__}")
    ev = _events.get(event)
    if ev is None:
        raise CUDARuntimeError(f"eventRecord: {event:#x} is not a live event")
    ev.record(stream)


def eventQuery(event):
    return 0 if _events[event].done else 600   # cudaErrorNotReady


def streamSynchronize(stream):
    from .. import synced

    _drain()
    synced(stream)


def deviceSynchronize():
    from .. import synced

    _drain()
    synced(None)


def memcpyAsync(dst, src, size, kind, stream):
    """A copy on ``stream``: device memory read or written there (the stream-order model)."""
    from .. import host_view, read, wrote

    if kind in (memcpyDeviceToHost, memcpyDeviceToDevice):
        host_view(src, size, "memcpy source")
        read(src, size, stream, "memcpy")
    if kind in (memcpyHostToDevice, memcpyDeviceToDevice):
        host_view(dst, size, "memcpy destination")
    if size:
        ctypes.memmove(dst, src, size)
    if kind in (memcpyHostToDevice, memcpyDeviceToDevice):
        wrote(dst, size, stream, "memcpy")


def memcpy(dst, src, size, kind):
    memcpyAsync(dst, src, size, kind, 0)
    streamSynchronize(0)
