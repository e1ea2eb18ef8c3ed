"""The extensions (training/, torch/, tools/, launch/) use the core through its public seams:
none touches a group's ``.mpi_comm`` or ``.transport``, a private attribute of an object it
does not own (``x._name`` where ``x`` is not ``self``, ``cls`` or ``super()``), or imports a
private name (``from .. import _collectives``) from outside its own package. Read with
``ast``; nothing is imported or run.

What the core offers instead: the public functions and the object collectives
(``all_gather_object``, ``broadcast_object``; for a per-step exchange of a few numbers,
``_objects.all_gather_small``: all watched like every collective) for host exchanges; DistributedGradReducer's step API (``pending``, ``launched``, ``ready_from``,
``replan``, ``side_stream``, ``direct_overlap``) for the torch wrapper; the array families'
``lib()``; ``_reliability.agreement.set_checking(on, group)`` for the bench.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = ("mpicomm/training", "mpicomm/torch", "mpicomm/tools", "mpicomm/launch")
CORE_HANDLES = ("mpi_comm", "transport")
SELF = ("self", "cls")

# (file, what): why it stays, for now. Every entry must still be needed (checked below).
ALLOWED = {
    # init_process_group works before mpicomm.init() (on COMM_WORLD) and needs an MPI
    # communicator (Split_type for the local ranks, the rendezvous broadcast); where init ran
    # it uses mpicomm's world communicator instead.
    ("mpicomm/torch/_dist.py", ".mpi_comm"): "torch.distributed's rendezvous, also without mpicomm.init()",
    # PyTorch's own private attributes, not mpicomm's: no public equivalent in PyTorch.
    ("mpicomm/torch/_ddp.py", "torch.autograd.Variable._execution_engine"): "PyTorch: queue_callback",
    ("mpicomm/training/families.py", "cls.lib()._C._nn"): "PyTorch: flatten_dense_tensors' C helpers",
    ("mpicomm/training/families.py", "cls.lib()._C"): "PyTorch: flatten_dense_tensors' C helpers",
    ("mpicomm/training/results.py", "torch._C"): "PyTorch: the storage use count",
    ("mpicomm/training/results.py", "flat.untyped_storage()._cdata"): "PyTorch: the storage use count",
}


def _package(rel: str) -> str:
    """'mpicomm/training/reducer.py' -> 'mpicomm.training'; a package's __init__ -> itself."""
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1])


def _resolve(rel: str, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <module> import ...`` in file ``rel``."""
    if not node.level:
        return node.module or ""
    base = _package(rel).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes."""
    if isinstance(value, ast.Name):
        return value.id in SELF
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def violations(rel: str, source: str) -> list[tuple[int, str]]:
    """(line, what) of every reach around the core's public seams in one extension module."""
    found = []
    pkg = _package(rel)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in CORE_HANDLES:
                found.append((node.lineno, "." + node.attr))
            elif _private(node.attr) and not _own(node.value):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(rel, node)
            for alias in node.names:
                # a private name from another package: a module (from .. import _state) or
                # a name of one (from ..families import _x, outside training/)
                if _private(alias.name) and module != pkg and not module.startswith(pkg + "."):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "mpicomm" and any(_private(p) for p in parts[1:]) \
                        and not alias.name.startswith(pkg + "."):
                    found.append((node.lineno, f"import {alias.name}"))
    return found


def _extension_files():
    for d in EXTENSIONS:
        for p in sorted((ROOT / d).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), p.read_text()


def test_extensions_use_public_seams():
    bad, used = [], set()
    for rel, src in _extension_files():
        for line, what in violations(rel, src):
            if (rel, what) in ALLOWED:
                used.add((rel, what))
            else:
                bad.append(f"{rel}:{line}: {what}")
    assert not bad, ("modules outside the core reach around its public seams (use a public function, "
                     "the object collectives, or give the core a documented seam):\n  " + "\n  ".join(bad))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries no longer needed (remove them): {stale}"


def test_the_check_sees_what_it_forbids():
    src = ("from .. import _collectives\nfrom ..training.families import _family\nfrom .streams import _Null\n"
           "import mpicomm._state\n"
           "def f(g, red):\n    g.mpi_comm.allgather(1)\n    g.transport.group_start()\n    red._ready\n"
           "    self._ok\n    super()._ok()\n    g.__class__\n")
    got = sorted(what for _, what in violations("mpicomm/torch/_x.py", src))
    # (the same package's private names, self's, super()'s and dunders are fine)
    assert got == sorted(["from mpicomm import _collectives", "from mpicomm.training.families import _family",
                          "import mpicomm._state", ".mpi_comm", ".transport", "red._ready"])
