"""The NCCL transport's tagged point-to-point: the device side of mpicomm._backends.tagged.

``tag != 0`` on GPU arrays: the message is copied to host memory on the call's stream
(after the work already there), travels as one MPI message with the user's tag
(mpicomm._backends.tagged says why not over NCCL), and is copied into the receiver's
device array on its call's stream. A mixin of the NCCL transport: it uses the transport's
``_family``, ``_binder``, ``_streamer``, ``_empty``, ``cupy``, ``host``, ``tagged``,
``rank`` and ``size``.
"""
from __future__ import annotations

import numpy as np

from .._arrays import is_gpu_array
from .._ops import RECV
from ..errors import invalid


class StagedTags:
    """Tagged send / recv / sendrecv of GPU arrays, staged through host memory."""

    def _staged(self, x, arg, stream):
        """(device array, its pointer, dtype row, cudaStream_t) of GPU array ``x``, contiguous."""
        kind, row, _ = self._family(x, arg)
        xa, xp = self._binder(kind)(x, arg)
        p, _ = self._streamer(stream, kind)()
        return xa, xp, row, p

    def _to_host(self, x, stream):
        """A host copy of GPU array ``x``, taken after the work already on the call's stream."""
        xa, xp, row, p = self._staged(x, "x", stream)
        h = np.empty(tuple(xa.shape), row.dtype)
        rt = self.cupy.cuda.runtime
        if h.nbytes:
            rt.memcpyAsync(h.ctypes.data, xp, h.nbytes, rt.memcpyDeviceToHost, p)
        rt.streamSynchronize(p)
        return h

    def _lander(self, xp, p):
        """land(o): copy host array ``o`` into device memory at ``xp`` on stream ``p`` (work
        enqueued on ``p`` afterwards sees it; ``o`` may go once it returns)."""
        rt = self.cupy.cuda.runtime

        def land(o):
            if o.nbytes:
                rt.memcpyAsync(xp, o.ctypes.data, o.nbytes, rt.memcpyHostToDevice, p)
                rt.streamSynchronize(p)   # (o is pageable; the call returns with the data in place)
        return land

    def _tagged_p2p(self, code, x, peer, tag, async_op, stream):
        arg = "src" if code == RECV else "dst"
        peer = self.host._root(peer, arg)
        if peer == self.rank and not async_op:
            raise invalid(arg, peer, f"another rank of the group (0..{self.size - 1}, not this rank "
                          f"{self.rank}: a blocking {'recv from' if code == RECV else 'send to'} oneself "
                          "would never complete; use async_op=True)")
        if code != RECV:
            return self.tagged.send(self._to_host(x, stream), peer, tag, async_op)
        xa, xp, row, p = self._staged(x, "out", stream)
        if xa is not x:
            raise invalid("out", "a non-contiguous array", "a C-contiguous array")
        o = np.empty(tuple(xa.shape), row.dtype)
        return self.tagged.recv(o, peer, tag, async_op, self._lander(xp, p), x)

    def _tagged_sendrecv(self, x, dst, tag, async_op, stream, out, src):
        h = self._to_host(x, stream)
        if out is not None and not is_gpu_array(out):   # a host out=: received by MPI as it is
            return self.tagged.sendrecv(h, dst, tag, async_op, out, src, None, out)
        if out is None:
            kind, _, a = self._family(x)
            out = self._empty(kind, a, tuple(a.shape))()
        oa, op_, row, p = self._staged(out, "out", stream)
        if oa is not out:
            raise invalid("out", "a non-contiguous array", "a C-contiguous array")
        o = np.empty(tuple(oa.shape), row.dtype)
        return self.tagged.sendrecv(h, dst, tag, async_op, o, src, self._lander(op_, p), out)
