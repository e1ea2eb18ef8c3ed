"""What DistributedGradReducer checks about the gradients handed to it: the family, shape,
dtype and device of each against its parameter's, raising InvalidArgumentError that names
the first that differs. Where every gradient is a CuPy array (or every one a PyTorch
tensor), one pass compares them all and reads their pointers for the copy kernel.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError, TypeOf, invalid
from .families import CUPY, TORCH, _family


class _GradChecks:
    """The checks of the gradients for parameters of ``specs`` ((family, shape, dtype,
    device, nbytes) each); ``views``: the gradients' views in the buckets, which pass."""

    __slots__ = ("specs", "cupy", "torch", "torch_lists")

    def __init__(self, specs):
        self.specs = specs
        # CuPy gradients: what one pass over them compares (shape, dtype, device, C strides)
        self.cupy = None
        if specs and all(sp[0] is CUPY for sp in specs):
            self.cupy = [(tuple(sh), dt, int(dev.split(":")[1]),
                          tuple(int(np.prod(sh[k + 1:], dtype=np.int64)) * dt.itemsize for k in range(len(sh))))
                         for _, sh, dt, dev, _ in specs]
        # PyTorch gradients: shape, dtype and device index (-1: CPU), compared in one pass
        self.torch = self.torch_lists = None
        if specs and all(sp[0] is TORCH for sp in specs):
            tsize = TORCH.lib().Size
            self.torch = [(tsize(sh), dt, int(dev.split(":")[1]) if ":" in dev else (-1 if dev == "cpu" else None))
                          for _, sh, dt, dev, _ in specs]
            self.torch_lists = tuple(list(c) for c in zip(*self.torch))

    def grad(self, i, g, arg, v):
        """Check gradient ``i``, ``g``, named ``arg`` in errors; ``v``, its view in its bucket,
        passes as it is."""
        fam, shape, dt, dev, _ = self.specs[i]
        if g is v:
            return
        if type(g) is not type(v):  # (the same type as the view is the same family)
            try:
                gfam = _family(g, arg)
            except InvalidArgumentError:
                raise invalid(arg, TypeOf(g), f"a {fam.name} array like parameters[{i}]") from None
            if gfam is not fam:
                raise invalid(arg, TypeOf(g), f"a {fam.name} array like parameters[{i}]")
        gshape, gdt, gdev, _ = fam.spec(g)
        if gshape != shape:
            raise invalid(f"{arg}.shape", gshape, f"{shape}, the shape of parameters[{i}]")
        if gdt != dt:
            raise invalid(f"{arg}.dtype", fam.dtype_name(gdt), f"{fam.dtype_name(dt)}, the dtype of parameters[{i}]")
        if gdev != dev:
            raise invalid(f"{arg}.device", gdev, f"{dev}, the device of parameters[{i}]")

    def cupy_pointers(self, grads, views):
        """One pass over CuPy gradients: grad()'s checks and each one's device pointer
        (None where it is not C-contiguous). Raises as grad() does."""
        import cupy

        nd = cupy.ndarray
        out = [None] * len(grads)
        for i, (g, sp) in enumerate(zip(grads, self.cupy)):
            if type(g) is not nd or g.shape != sp[0] or g.dtype != sp[1] or g.data.device_id != sp[2]:
                self.grad(i, g, f"grads[{i}]", views[i])  # raises naming what is wrong (subclasses pass)
            if g.strides == sp[3]:
                out[i] = g.data.ptr
        return out

    def torch_check(self, grads, views):
        """grads() for PyTorch gradients: shapes, dtypes and devices compared list to
        list (about 0.2 us a gradient where grad()'s full comparison costs several);
        on a difference or a non-tensor, grad() names it."""
        sh, dt, dv = self.torch_lists
        try:
            if [g.shape for g in grads] == sh and [g.dtype for g in grads] == dt \
                    and [g.get_device() for g in grads] == dv:
                return
        except AttributeError:
            pass
        for i, (g, sp) in enumerate(zip(grads, self.torch)):
            try:
                ok = g.shape == sp[0] and g.dtype is sp[1] and g.get_device() == sp[2]
            except Exception:  # not a tensor: grad() names what it is
                ok = False
            if not ok:
                self.grad(i, g, f"grads[{i}]", views[i])

    def torch_pointers(self, grads, views):
        """torch_check, and each CUDA tensor's data pointer (None where not contiguous)."""
        self.torch_check(grads, views)
        return [g.data_ptr() if g.is_contiguous() else None for g in grads]

    def grads(self, grads, views):
        """Check every gradient of ``grads``, a list or tuple of one per parameter."""
        if not isinstance(grads, (list, tuple)):
            raise invalid("grads", TypeOf(grads), f"a list or tuple of {len(self.specs)} arrays, "
                          "one per parameter, in the parameters' order")
        if len(grads) != len(self.specs):
            raise invalid("grads", f"a {type(grads).__name__} of {len(grads)} arrays",
                          f"{len(self.specs)} arrays, one per parameter, in the parameters' order")
        for i, g in enumerate(grads):
            self.grad(i, g, f"grads[{i}]", views[i])
