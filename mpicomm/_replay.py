"""mpicomm.replay: a captured CUDA graph replayed under the watchdog.

A replay runs the graph's captured collectives with no host code of mpicomm's (that is its
point), so the watchdog sees none of them. ``replay`` counts this rank's replays in its
progress window (REPLAYS), launches the graph, and hands the watchdog a CUDA event recorded
after it: a replay that has not completed within the timeout is reported, with every rank's
count of replays (a rank that replayed fewer graphs is the one the others wait for), and the
job ends, as for a collective that hangs on the GPU.
"""
from __future__ import annotations

from typing import Any

from ._state import CTX, require_init
from .errors import CommunicationError, invalid


def replay(graph: Any, stream: Any = None) -> None:
    """Replay ``graph`` (a ``torch.cuda.CUDAGraph``, or a CuPy ``cupy.cuda.Graph``) on ``stream``
    (None: the current stream; PyTorch's for a PyTorch graph), watched: a replay that does not
    complete within the timeout ends the job with a report naming the ranks that replayed fewer
    graphs. Call it on every rank alike, as ``graph.replay()`` (``graph.launch()``) would be."""
    require_init("mpicomm.replay()")
    if CTX.backend_name != "nccl":
        raise invalid("graph", type(graph).__name__, "a CUDA graph replayed on the NCCL backend (this job "
                      f"runs the {CTX.backend_name} backend, whose calls are not captured)")
    torch_graph = hasattr(graph, "replay") and hasattr(graph, "capture_begin")
    if not torch_graph and not callable(getattr(graph, "launch", None)):
        raise invalid("graph", type(graph).__name__, "a torch.cuda.CUDAGraph or a CuPy cupy.cuda.Graph "
                      "(made by Stream.end_capture())")
    rel = CTX.reliability
    if rel.watchdog.fired:   # the NCCL communicators are aborted: a graph still holds them
        raise CommunicationError("mpicomm.replay(): a collective timed out or a rank failed, and the job is being "
                                 "aborted (see the report above): the graph's NCCL communicator is gone")
    import cupy

    if torch_graph:
        import torch

        if stream is None:
            graph.replay()
            ptr = torch.cuda.current_stream().cuda_stream
        else:
            if not isinstance(stream, torch.cuda.Stream):
                raise invalid("stream", type(stream).__name__, "a torch.cuda.Stream for a PyTorch graph, or None")
            with torch.cuda.stream(stream):
                graph.replay()
            ptr = stream.cuda_stream
    else:
        if stream is not None and not isinstance(stream, cupy.cuda.Stream):
            raise invalid("stream", type(stream).__name__, "a cupy.cuda.Stream for a CuPy graph, or None")
        graph.launch(stream)
        ptr = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
    m = rel.progress.m
    from ._reliability.progress import REPLAYS

    n = m[REPLAYS] = m[REPLAYS] + 1
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    cupy.cuda.runtime.eventRecord(ev.ptr, ptr)
    rel.watchdog.watch_replay(ev, n)
