"""Any array -> what a transport needs, and checks of ``out=`` arrays.

Host arrays (NumPy, anything with the buffer protocol or CPU DLPack, PyTorch CPU
tensors) go to MPI as contiguous NumPy arrays; GPU arrays (CuPy, PyTorch CUDA tensors,
``__cuda_array_interface__``, CUDA DLPack) go to NCCL zero-copy, or are staged through
the host on the MPI backend.

Non-contiguous *input* is copied to a contiguous array (one extra copy, documented);
an ``out=`` array must be C-contiguous, writable, of the right shape and dtype, and
must not overlap the input unless it is the input (in place), or the call raises
:class:`InvalidArgumentError` naming what is wrong.
"""
from __future__ import annotations

import numpy as np

from ._dtypes import BFLOAT16, of_numpy
from .errors import TypeOf, invalid

_DL_GPU = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def list_hint(x):
    """What to write instead, where a list or tuple was given as one array (the list forms of
    torch.distributed and Paddle)."""
    if not isinstance(x, (list, tuple)):
        return ""
    return ("; a list of arrays is not one array: torch's and Paddle's all_gather(tensor_list, tensor) "
            "is tensor_list = list(mpicomm.all_gather(tensor).reshape(n, *tensor.shape)) (every rank's "
            "array, concatenated along axis 0), and reduce_scatter(output, input_list) is "
            "output = mpicomm.reduce_scatter(concatenated input_list)")


def is_gpu_array(x):
    """True for arrays that live on a GPU (CuPy, CUDA torch tensors, CAI, CUDA DLPack)."""
    if x.__class__ is np.ndarray:
        return False
    mod = type(x).__module__
    if mod.startswith("cupy"):
        return True
    if mod.startswith("torch"):
        return bool(getattr(x, "is_cuda", False))
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in _DL_GPU
        except Exception:
            return False
    return False


def offsets(counts):
    """Where each of parts of ``counts`` laid end to end starts: [0, c0, c0 + c1, ...]."""
    r, acc = [], 0
    for c in counts:
        r.append(acc)
        acc += c
    return r


def is_torch(x):
    return type(x).__module__.startswith("torch")


def torch_host_view(t, arg="x"):
    """A NumPy view of a CPU tensor's memory (bfloat16 through its bits; no copy). A tensor
    with its conjugate or negative bit set (``x.conj()`` of a complex tensor, ``.imag`` of
    one) is resolved into a copy of its values, as non-contiguous input is. A tensor NumPy
    cannot view (sparse, on the meta device, of a dtype mpicomm has no row for) raises
    InvalidArgumentError naming ``arg``."""
    import torch

    t = t.detach()
    try:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype is torch.bfloat16:
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()
    except (TypeError, RuntimeError, NotImplementedError) as e:
        if t.layout is torch.strided and t.device.type == "cpu" and (t.is_conj() or t.is_neg()):
            return torch_host_view(t.resolve_conj().resolve_neg(), arg)
        raise _tensor_refused(t, arg, e) from None


def _tensor_refused(t, arg, e):
    """InvalidArgumentError for a tensor NumPy cannot view, naming what about it is refused."""
    import torch

    from ._dtypes import SUPPORTED

    if t.layout is not torch.strided:
        return invalid(arg, f"a {str(t.layout).replace('torch.', '')} tensor",
                       "a dense (torch.strided) tensor (x.to_dense() gives one)")
    if t.device.type != "cpu":
        return invalid(arg, f"a tensor on device {t.device}", "a CPU tensor, or a CUDA tensor on the NCCL backend")
    return invalid(arg, f"a tensor of dtype {str(t.dtype).replace('torch.', '')} ({type(e).__name__}: {e})",
                   f"a tensor of one of the dtypes {SUPPORTED}")


def _torch_back(x, gpu):
    import torch

    if gpu:
        dev = x.device
        return lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev) if a is not None else None
    if x.dtype is torch.bfloat16:
        return lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a is not None else None
    return lambda a: torch.from_numpy(a) if a is not None else None


def to_host(x, arg="x"):
    """``(ndarray, back)``: a contiguous host view or copy of ``x``, and a function that turns
    a host result into the caller's array type (None for NumPy results)."""
    if x.__class__ is np.ndarray:
        return (x if x.flags.c_contiguous else np.ascontiguousarray(x)), None
    if isinstance(x, np.ndarray):  # a subclass (memmap, matrix): its memory as a plain ndarray
        a = x.view(np.ndarray)
        return (a if a.flags.c_contiguous else np.ascontiguousarray(a)), None
    if is_gpu_array(x):
        import cupy

        g = cupy.from_dlpack(x) if is_torch(x) else cupy.asarray(x)
        back = _torch_back(x, True) if is_torch(x) else (lambda a: cupy.asarray(a) if a is not None else None)
        return cupy.asnumpy(g), back
    if is_torch(x):
        return torch_host_view(x, arg), _torch_back(x, False)
    if hasattr(x, "__dlpack__"):
        try:
            a = np.from_dlpack(x)
        except Exception as e:
            raise invalid(arg, TypeOf(x), f"a host array (DLPack export failed: {e})") from None
        if not a.flags.writeable:   # DLPack exports are often read-only views of writable memory:
            try:                    # writable, an in-place result lands in x itself
                a.flags.writeable = True
            except ValueError:
                pass
        return _contiguous(a), None
    try:
        a = np.asarray(memoryview(x))
    except TypeError:
        raise invalid(arg, TypeOf(x), "a NumPy array, an object with the buffer protocol or DLPack, or a GPU "
                      "array (CuPy, PyTorch CUDA tensor) on the NCCL backend" + list_hint(x)) from None
    return _contiguous(a), None


def _contiguous(a):
    """``a`` where it is C-contiguous (a 0-d array, a NumPy scalar's, keeps its shape ()),
    else a C-contiguous copy (np.ascontiguousarray would make a 0-d array 1-d)."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def check_out(o, shape, dtype, x=None, arg="out"):
    """Validate a host ``out`` array: shape, dtype, C-contiguous, writable, no overlap with ``x``."""
    if o.shape != shape:
        raise invalid(f"{arg}.shape", o.shape, f"shape {shape}")
    if o.dtype != dtype:
        raise invalid(f"{arg}.dtype", str(o.dtype), f"dtype {dtype} (the input's)")
    if not o.flags.c_contiguous:
        raise invalid(arg, f"non-contiguous array (shape {o.shape}, strides {o.strides})",
                      "a C-contiguous array (use np.ascontiguousarray or omit out=)")
    if not o.flags.writeable:
        raise invalid(arg, "read-only array", "a writable array")
    if x is not None and o is not x and np.may_share_memory(o, x) and not same_memory(o, x):
        raise overlap_error(arg)
    return o


def overlap_error(arg="out"):
    return invalid(arg, "an array that overlaps x", "x itself or a view of exactly x's memory (in place), "
                   "or an array that shares no memory with x")


def same_memory(a, b):
    """True when ``a`` and ``b`` are the same bytes (``out=x.view()`` counts as in place)."""
    ia, ib = a.__array_interface__, b.__array_interface__
    return ia["data"][0] == ib["data"][0] and a.nbytes == b.nbytes and a.dtype == b.dtype


def host_out(out, shape, dtype, x=None, arg="out"):
    """``(ndarray, writeback)`` for a user ``out`` of any host or GPU type.

    ``writeback(result)`` copies the host result into ``out`` where ``out`` is not a
    NumPy array (a GPU array on the MPI backend) and returns ``out``; None for NumPy.
    """
    if isinstance(out, np.ndarray):
        o = out if out.__class__ is np.ndarray else out.view(np.ndarray)
        return check_out(o, shape, dtype, x, arg), None
    if is_gpu_array(out):
        import cupy

        g = cupy.from_dlpack(out) if is_torch(out) else cupy.asarray(out)
        if tuple(g.shape) != tuple(shape):
            raise invalid(f"{arg}.shape", tuple(g.shape), f"shape {shape}")
        if g.dtype != dtype:
            raise invalid(f"{arg}.dtype", str(g.dtype), f"dtype {dtype} (the input's)")
        if not g.flags.c_contiguous:
            raise invalid(arg, "non-contiguous GPU array", "a C-contiguous array")
        tmp = np.empty(shape, dtype)

        def writeback(res):
            g.set(res)
            return out

        return tmp, writeback
    try:
        if is_torch(out):
            if not out.is_contiguous():
                raise invalid(arg, "non-contiguous tensor", "a contiguous tensor")
            if out.is_conj() or out.is_neg():   # (NumPy would see a resolved copy, not out's memory)
                raise invalid(arg, f"a tensor with its {'conjugate' if out.is_conj() else 'negative'} bit set",
                              "a tensor whose memory holds its values (out.resolve_conj() / resolve_neg())")
            a = torch_host_view(out, arg)
        elif hasattr(out, "__dlpack__"):
            a = np.from_dlpack(out)
        else:
            a = np.asarray(memoryview(out))
    except (TypeError, BufferError, RuntimeError):
        raise invalid(arg, TypeOf(out), "a writable NumPy array or CPU tensor") from None
    if not a.flags.writeable:  # DLPack exports are read-only views of writable memory
        try:
            a.flags.writeable = True
        except ValueError:
            raise invalid(arg, f"read-only {type(out).__name__}", "a writable array") from None
    check_out(a, shape, dtype, x, arg)
    return a, (lambda res: out)


def row_of(a, arg="x"):
    """The dtype row of host array ``a``."""
    return of_numpy(a.dtype, arg)


def write_back(x, h):
    """Write host result ``h`` into the caller's array ``x`` (in place on a copy or a staged
    GPU array) and return ``x``; nothing to do where ``h`` is ``x``'s own memory."""
    if h is x:
        return x
    if isinstance(x, np.ndarray):
        if not np.shares_memory(x, h):
            x[...] = h.reshape(x.shape)
        return x
    if is_torch(x):
        import torch

        if x.is_cuda:
            x.copy_(torch.from_numpy(np.ascontiguousarray(h).view(np.int16)).view(torch.bfloat16)
                    if x.dtype is torch.bfloat16 else torch.from_numpy(np.ascontiguousarray(h)))
        elif not np.shares_memory(torch_host_view(x), h):
            src = torch.from_numpy(h.view(np.int16)).view(torch.bfloat16) if x.dtype is torch.bfloat16 \
                else torch.from_numpy(h)
            x.copy_(src.reshape(x.shape))
        return x
    if is_gpu_array(x):
        import cupy

        cupy.asarray(x).set(h.reshape(cupy.asarray(x).shape))
        return x
    if hasattr(x, "__dlpack__") and not hasattr(x, "__buffer__"):
        a = np.from_dlpack(x)
        if a.size and not np.shares_memory(a, h):   # h is a copy (x's export was read-only): write it back
            try:                                    # (zero elements: nothing to write)
                if not a.flags.writeable:
                    a.flags.writeable = True
            except ValueError:
                raise invalid("x", f"read-only {type(x).__name__}", "a writable array "
                              "(the result is written into it)") from None
            a[...] = h.reshape(a.shape)
        return x
    return x  # buffer-protocol objects: h is a view of their memory


def check_writable(x, arg="x", why="the result is written into it"):
    """Raise, naming ``arg``, when the caller's ``x`` cannot receive a result in place."""
    if isinstance(x, np.ndarray):
        ro = not x.flags.writeable
    elif is_torch(x) or is_gpu_array(x):
        ro = False
    elif hasattr(x, "__dlpack__"):   # a host DLPack export: writable unless its memory is read-only
        try:
            a = np.from_dlpack(x)
            if a.size and not a.flags.writeable:   # (zero elements: nothing is written)
                a.flags.writeable = True
            ro = False
        except ValueError:
            ro = True
        except Exception:
            ro = False
    else:
        try:
            ro = memoryview(x).readonly
        except TypeError:
            ro = False
    if ro:
        kind = "array" if isinstance(x, np.ndarray) else type(x).__name__
        raise invalid(arg, f"read-only {kind}", f"a writable array ({why})")
    if _self_overlapping(x):
        raise invalid(arg, f"a {'tensor' if is_torch(x) else 'view'} whose elements share memory (stride 0 along an "
                      f"axis of length > 1, as torch's expand() or NumPy's as_strided make: shape "
                      f"{tuple(x.shape)}, strides {_strides(x)})",
                      f"an array with one memory location per element ({why}; .clone() or .copy() it first)")


def _strides(x):
    return tuple(x.stride()) if is_torch(x) else tuple(x.strides)


def _self_overlapping(x):
    """True for a host NumPy array or CPU tensor with a stride-0 axis of length > 1 (torch's
    expand(), NumPy's writable as_strided): writing a result into it would keep one of the
    values per memory location (NumPy, silently) or fail after the call (torch)."""
    if isinstance(x, np.ndarray):
        shape, strides = x.shape, x.strides
    elif is_torch(x) and not getattr(x, "is_cuda", False):
        shape, strides = tuple(x.shape), x.stride()
    else:
        return False
    if 0 in shape:
        return False
    return any(st == 0 and d > 1 for d, st in zip(shape, strides))
