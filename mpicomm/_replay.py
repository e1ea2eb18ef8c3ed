"""mpicomm.capture and mpicomm.replay: CUDA graphs of collectives, watched when replayed.

A replay runs the graph's captured collectives with no host code of mpicomm's (that is its
point), so the watchdog sees none of them. ``capture`` makes the graph (``torch.cuda.graph``
or a CuPy stream capture) and notes which of mpicomm's collectives it captured: the calls
that each group's dispatcher issued during the capture, read from its sequence number and
its flight-recorder ring at the end (nothing is added to a call's own path). ``replay``
counts this rank's replays in its progress window (REPLAYS) with the graph's key
(REPLAY_KEY, a hash of its collectives), tells the watchdog before it launches the graph,
and hands it a CUDA event recorded after it: a replay that has not completed within the
timeout is reported with the graph's collectives and every rank's count of replays, and a
rank whose peers have replayed more graphs than it for the timeout reports the collective
they wait in (the graph of that key); then the job ends, as for a collective that hangs on
the GPU.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Any, Iterator

from ._ops import NAMES
from ._state import CTX, require_init
from .errors import CommunicationError, TypeOf, invalid


class _Record:
    """What is kept of a graph made by capture (never the graph itself: NCCL waits at
    finalize for every graph that captured one of its calls to be destroyed): its
    collectives, key and replays on this rank, and a weak reference to it where its type
    allows one."""

    __slots__ = ("collectives", "members", "key", "replays", "ref")

    def __init__(self) -> None:
        self.collectives: list[str] = []
        self.members: frozenset[int] = frozenset()   # the world ranks of the groups of those collectives
        self.key = 0
        self.replays = 0   # mpicomm.replay calls of the graph on this rank
        self.ref: Any = None

    def describe(self) -> str:
        """The collectives in one line (for a report)."""
        if not self.collectives:
            return "no collective of mpicomm's"
        return "; ".join(self.collectives)


class Captured:
    """What ``mpicomm.capture`` made: ``graph`` (the CuPy ``cupy.cuda.Graph`` once the block
    has ended, or the ``torch.cuda.CUDAGraph`` given), ``collectives`` (one line for each of
    mpicomm's collectives the graph captured, in the order they were issued) and ``key``
    (a hash of those lines, the same on every rank that captured the same calls; 0: none)."""

    __slots__ = ("graph", "_rec")

    def __init__(self) -> None:
        self.graph: Any = None
        self._rec = _Record()

    @property
    def collectives(self) -> list[str]:
        return list(self._rec.collectives)

    @property
    def key(self) -> int:
        return self._rec.key

    def describe(self) -> str:
        """The collectives in one line (for a report)."""
        return self._rec.describe()


class _LaunchFailed:
    """The event of a replay whose launch raised: done (the watchdog drops it)."""
    done = True


_LAUNCH_FAILED = _LaunchFailed()

# id(graph) -> its _Record, for the graphs made by capture() (dropped when the graph goes,
# where it takes weak references)
_GRAPHS: dict[int, _Record] = {}


def _groups_seq() -> dict:
    """{group: its dispatcher's sequence number} for every group this rank is in."""
    out = {}
    for g in CTX.reliability.watchdog.groups():
        d = getattr(g, "disp", None)
        if d is not None:
            out[g] = d.seq
    return out


def _captured_lines(before: dict, members: set) -> list[str]:
    """The collectives issued on each group since ``before`` (from _groups_seq), one line each;
    their groups' world ranks are added to ``members``."""
    lines = []
    for g, seq in _groups_seq().items():
        d = g.disp
        first = before.get(g, 0) + 1
        if first <= d.seq:
            members.update(g.ranks)
        ring = d.fr
        for s in range(first, d.seq + 1):
            e = ring[s & (len(ring) - 1)] if ring else None
            if e is not None and e[0] == s:
                p = e[2]
                desc = p.describe() if hasattr(p, "describe") else "?"
                lines.append(f"{NAMES.get(e[1], '?')} sequence {s} on group '{g.name}' ({desc})")
            else:   # the flight recorder is off (MPICOMM_FLIGHT_RECORDER=0) or the ring has moved on
                lines.append(f"a collective, sequence {s} on group '{g.name}'")
    return lines


def _forget(gid: int) -> None:
    _GRAPHS.pop(gid, None)


def _remember(cap: Captured) -> None:
    import weakref

    rec, gid = cap._rec, id(cap.graph)
    try:
        rec.ref = weakref.ref(cap.graph)
        weakref.finalize(cap.graph, _forget, gid)
    except TypeError:   # (a graph type without weak references: kept until a graph of the same id replaces it)
        rec.ref = None
    _GRAPHS[gid] = rec
    if rec.key:
        CTX.reliability.watchdog.graphs[rec.key] = rec


@contextlib.contextmanager
def capture(graph: Any = None, stream: Any = None, **torch_graph_kwargs: Any) -> Iterator[Captured]:
    """Capture a CUDA graph of the block, noting which of mpicomm's collectives it captured.

    Args:
        graph: a ``torch.cuda.CUDAGraph`` to capture into (as ``torch.cuda.graph(graph,
            stream=stream, **torch_graph_kwargs)`` does); None: a CuPy capture on ``stream``.
        stream: the capturing stream: a ``torch.cuda.Stream`` (optional) for a PyTorch graph,
            a ``cupy.cuda.Stream`` (required; not the null stream) for a CuPy graph, which is
            ``Captured.graph`` after the block.

    Yields a :class:`Captured`. Replay the graph with :func:`mpicomm.replay`: a replay that
    does not complete within the timeout is then reported with these collectives named.
    Capture on every rank alike, as the collectives themselves. Raises
    InvalidArgumentError for a graph or stream of another kind (before anything starts).
    """
    require_init("mpicomm.capture()")
    if CTX.backend_name != "nccl":
        raise invalid("graph", TypeOf(graph), "a capture on the NCCL backend (this job runs the "
                      f"{CTX.backend_name} backend, whose calls are not captured)")
    cap = Captured()
    if graph is not None:
        if not (hasattr(graph, "replay") and hasattr(graph, "capture_begin")):
            raise invalid("graph", TypeOf(graph), "a torch.cuda.CUDAGraph, or None for a CuPy capture "
                          "on stream=")
        import torch

        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise invalid("stream", TypeOf(stream), "a torch.cuda.Stream for a PyTorch graph, or None")
        cap.graph = graph
        before = _groups_seq()
        with torch.cuda.graph(graph, stream=stream, **torch_graph_kwargs):
            yield cap
    else:
        if torch_graph_kwargs:
            raise invalid(next(iter(torch_graph_kwargs)), "given", "only with a torch.cuda.CUDAGraph (graph=)")
        import cupy

        if not isinstance(stream, cupy.cuda.Stream) or stream.ptr == 0:
            raise invalid("stream", TypeOf(stream) if stream is None or not isinstance(stream, cupy.cuda.Stream)
                          else "the null stream", "a cupy.cuda.Stream other than the null stream, for a CuPy "
                          "capture (or graph=, a torch.cuda.CUDAGraph)")
        before = _groups_seq()
        with stream:
            stream.begin_capture()
            try:
                yield cap
            finally:
                cap.graph = stream.end_capture()
    rec = cap._rec
    members: set = set()
    rec.collectives = _captured_lines(before, members)
    rec.members = frozenset(members)
    if rec.collectives:
        rec.key = 1 + (zlib.crc32(rec.describe().encode()) & 0x3FFFFFFF)
    _remember(cap)


def replay(graph: Any, stream: Any = None) -> None:
    """Replay ``graph`` (a ``torch.cuda.CUDAGraph``, or a CuPy ``cupy.cuda.Graph``) on ``stream``
    (None: the current stream; PyTorch's for a PyTorch graph), watched: a replay that does not
    complete within the timeout ends the job with a report naming the ranks that replayed fewer
    graphs, and the graph's collectives when it was made by :func:`mpicomm.capture`. Call it on
    every rank alike, as ``graph.replay()`` (``graph.launch()``) would be."""
    require_init("mpicomm.replay()")
    if CTX.backend_name != "nccl":
        raise invalid("graph", TypeOf(graph), "a CUDA graph replayed on the NCCL backend (this job "
                      f"runs the {CTX.backend_name} backend, whose calls are not captured)")
    torch_graph = hasattr(graph, "replay") and hasattr(graph, "capture_begin")
    if not torch_graph and not callable(getattr(graph, "launch", None)):
        raise invalid("graph", TypeOf(graph), "a torch.cuda.CUDAGraph or a CuPy cupy.cuda.Graph "
                      "(made by Stream.end_capture())")
    rel = CTX.reliability
    if rel.watchdog.fired:   # the NCCL communicators are aborted: a graph still holds them
        raise CommunicationError("mpicomm.replay(): a collective timed out or a rank failed, and the job is being "
                                 "aborted (see the report above): the graph's NCCL communicator is gone")
    import cupy

    if torch_graph:
        import torch

        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise invalid("stream", TypeOf(stream), "a torch.cuda.Stream for a PyTorch graph, or None")
    elif stream is not None and not isinstance(stream, cupy.cuda.Stream):
        raise invalid("stream", TypeOf(stream), "a cupy.cuda.Stream for a CuPy graph, or None")
    cap = _GRAPHS.get(id(graph))
    if cap is not None and cap.ref is not None and cap.ref() is not graph:
        cap = None
    from ._reliability.progress import REPLAY_KEY, REPLAYS

    m = rel.progress.m
    m[REPLAY_KEY] = cap.key if cap is not None else 0
    n = m[REPLAYS] = m[REPLAYS] + 1
    if cap is not None:
        cap.replays += 1
    # watched from before the launch: a launch that itself waits (on the host) is reported too
    slot = rel.watchdog.watch_replay(n, cap)
    try:
        if torch_graph:
            if stream is None:
                graph.replay()
                ptr = torch.cuda.current_stream().cuda_stream
            else:
                with torch.cuda.stream(stream):
                    graph.replay()
                ptr = stream.cuda_stream
        else:
            graph.launch(stream)
            ptr = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
    except BaseException:   # nothing was launched: not a replay to watch, nor to count
        slot[0] = _LAUNCH_FAILED
        m[REPLAYS] = n - 1
        if cap is not None:
            cap.replays -= 1
        raise
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    cupy.cuda.runtime.eventRecord(ev.ptr, ptr)
    slot[0] = ev
