"""Checkpoints in a data-parallel job: written once (on one rank), read once and given to
every rank, so that the ranks resume from the same state without all of them reading the
file (or racing to write it)."""
from __future__ import annotations

import os
import pickle

import numpy as np

from .. import broadcast_object
from .._ops import BROADCAST
from .._sizes import early
from .._state import get_group
from ..errors import InvalidArgumentError, TypeOf, invalid


def _path(path):
    if not isinstance(path, (str, os.PathLike)):
        raise invalid("path", path, "a file name (str or os.PathLike)")
    return os.fspath(path)


def _default_save(state, path):
    if path.endswith(".npz"):
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise invalid("state", TypeOf(state), "a dict with str keys for a .npz file (np.savez); "
                          "other objects: a path not ending in .npz (pickled), or save=torch.save")
        with open(path, "wb") as f:
            np.savez(f, **{k: np.asarray(v) for k, v in state.items()})
    else:
        with open(path, "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)


def _default_load(path):
    if path.endswith(".npz"):
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    with open(path, "rb") as f:
        return pickle.load(f)


def save_on_rank0(state, path, save=None, root=0, group=None):
    """Write ``state`` once, from group rank ``root`` (0), and return when it is written.

    state: root's checkpoint (the other ranks' is not used): a dict of arrays (a
        ``model.state_dict()``, NumPy arrays) or any object ``save`` can write.
    path: the file; root writes it (the other ranks need not see it, unless they load it).
    save: ``save(state, path)``, e.g. ``torch.save``; None: ``np.savez`` for a path ending
        in ``.npz`` (a dict of arrays), else pickle.

    Every rank waits until the file is complete (a barrier), and raises alike where
    root could not write it. Returns True on root, False elsewhere.
    """
    path = _path(path)
    g = _group_with_root(group, root)
    err = None
    if g.rank == root:
        try:
            (save or _default_save)(state, path)
        except Exception as e:  # noqa: BLE001 - told to every rank below
            err = f"{type(e).__name__}: {e}"
    err = broadcast_object(err, root=int(root), group=group)   # (also the barrier: after the write)
    if err is not None:
        raise InvalidArgumentError(f"save_on_rank0: rank {root} could not write {path!r}: {err}")
    return g.rank == root


def _group_with_root(group, root):
    """The group, where ``root`` is one of its ranks, else InvalidArgumentError naming it,
    raised on every rank: refused as the group's next call (the broadcast), so that the
    ranks whose root passed do not wait in it."""
    g = get_group(group)

    def check():
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < g.size:
            raise invalid("root", root, f"a rank of the group in 0..{g.size - 1}")
    early(g, BROADCAST, check)
    return g


def load_on_rank0(path, load=None, root=0, group=None):
    """Read a checkpoint once, on group rank ``root`` (0), and return it on every rank.

    load: ``load(path)``, e.g. ``torch.load`` (or ``functools.partial(torch.load,
        map_location="cpu")``); None: ``np.load`` for ``.npz`` (a dict of arrays), else pickle.

    Every rank gets its own copy of root's object (sent pickled, as broadcast_object does);
    then ``model.load_state_dict(state)`` on every rank resumes them alike. Raises
    InvalidArgumentError on every rank where root could not read the file.
    """
    path = _path(path)
    g = _group_with_root(group, root)
    msg = None
    if g.rank == root:
        try:
            msg = (True, (load or _default_load)(path))
        except Exception as e:  # noqa: BLE001 - told to every rank below
            msg = (False, f"{type(e).__name__}: {e}")
    ok, value = broadcast_object(msg, root=int(root), group=group)
    if not ok:
        raise InvalidArgumentError(f"load_on_rank0: rank {root} could not read {path!r}: {value}")
    return value


__all__ = ["save_on_rank0", "load_on_rank0"]
