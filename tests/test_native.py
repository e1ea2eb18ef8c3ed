"""The compiled call path (mpicomm/_native): built where CI builds it, and alike with the Python
path it replaces, call for call.

Every other MPI test runs through the compiled path where it is built (the default); these
tests run the same calls through both ``Dispatcher.call`` (compiled) and
``Dispatcher.py_call`` (the Python it mirrors) and compare what each leaves behind: the
result (against NumPy), the sequence number, the progress words the watchdog reads, the
flight recorder's entry, the Work's description, and the refusal of a bad argument.
tests/test_callpath_parity.py does the same for the branches a disagreement, a refusal or a
member's report takes, and checks the compiled cache key against the Python one.
scripts/test.sh also runs the MPI tests once with ``MPICOMM_NATIVE=0``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mpicomm
from mpicomm import InvalidArgumentError, ReduceOp
from mpicomm import _native
from mpicomm._dispatch import Dispatcher
from mpicomm._ops import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER
from mpicomm._reliability.progress import (AT_CKPT, AT_DONE, AT_HIST, AT_RAISED, CK_LEVELS, CK_N, CK_SHIFT, CK_STEP,
                                           calls_base)
from launch_support import STRICT, require
from test_collectives import data, reduce_np

PATHS = ["compiled", "python"]


def test_built_where_ci_builds_it():
    """CI (MPICOMM_TEST_STRICT=1) installs with a C compiler: the compiled path must be in use."""
    need_compiled()
    assert isinstance(Dispatcher.__dict__["call"], type(str.join)), Dispatcher.__dict__["call"]
    assert Dispatcher.py_call.__module__ == "mpicomm._dispatch"


def need_compiled():
    """Skip where the Python path was asked for (MPICOMM_NATIVE=0: scripts/test.sh runs the MPI
    tests so once); elsewhere the compiled path is a prerequisite (CI builds it)."""
    if os.environ.get("MPICOMM_NATIVE", "").strip() == "0":
        pytest.skip("MPICOMM_NATIVE=0: the Python call path only")
    if not _native.active():
        require(f"the compiled call path is not in use: {_native.why_not}")


def caller(path):
    """(group, dispatcher, call) for the world through ``path``."""
    if path == "compiled":
        need_compiled()
    from mpicomm._state import CTX

    g = CTX.world
    d = g.disp
    return g, d, (d.call if path == "compiled" else (lambda *a: Dispatcher.py_call(d, *a)))


@pytest.mark.mpi
@pytest.mark.parametrize("path", PATHS)
def test_every_call_numbered_published_and_recorded(comm, path, request):
    g, d, call = caller(path)
    n, r = g.size, g.rank
    key = request.node.name
    xs = [data(q, key, (2 * n, 3), "float32") for q in range(n)]
    m, row = d.mem, d.row
    cases = [   # (code, x, out, arg, expected)
        (ALL_REDUCE, xs[r], None, ReduceOp.SUM, reduce_np(xs, ReduceOp.SUM)),
        (ALL_REDUCE, xs[r].copy(), "given", ReduceOp.MAX, reduce_np(xs, ReduceOp.MAX)),
        (ALL_REDUCE, xs[r].copy(), "same", ReduceOp.MIN, reduce_np(xs, ReduceOp.MIN)),
        (ALL_GATHER, xs[r], None, None, np.concatenate(xs)),
        (REDUCE_SCATTER, xs[r], None, ReduceOp.SUM, reduce_np(xs, ReduceOp.SUM)[2 * r:2 * r + 2]),
        (BROADCAST, xs[r].copy(), None, n - 1, xs[n - 1]),
        (REDUCE, xs[r], None, (ReduceOp.SUM, 0), reduce_np(xs, ReduceOp.SUM) if r == 0 else None),
    ]
    for rep in range(3):   # the first call of each prepares it; the next ones reuse it
        for code, x, out, arg, want in cases:
            o = None
            if out == "given":
                o = np.empty_like(want)
            elif out == "same":   # in place
                x = o = x.copy()
            seq = d.seq
            got = call(code, x, o, arg, False, None)
            assert d.seq == seq + 1
            v = (seq + 1) << 4 | code
            assert m[row] == v and m[row + AT_DONE] == v and m[row + AT_RAISED] != v
            if d.fr is not None:
                e = d.fr[(seq + 1) & d.fmask]
                assert e[:3] == (seq + 1, code, d.last[code]) and isinstance(e[3], int)
            if want is None:
                assert got is None
                continue
            np.testing.assert_array_equal(got, want)
            if o is not None:
                assert got is o


@pytest.mark.mpi
@pytest.mark.parametrize("path", PATHS)
def test_history_of_calls_and_its_checkpoints(comm, path, request):
    """Each call folds its ring word into the group's running hash (word by word as written
    out here), alike on every rank; at the calls that are multiples of 256 (4096, 65536) the
    hash is recorded with the call's number."""
    g, d, call = caller(path)
    n, r = g.size, g.rank
    m, row, cb = d.mem, d.row, calls_base(d.row)
    x = data(r, request.node.name, (3,), "float64")
    ring_at = {}
    for i in range(300):   # crosses a multiple of 256 (the suite's calls so far are any number)
        h0 = m[row + AT_HIST]
        call(ALL_REDUCE, x, None, ReduceOp.SUM, False, None) if i % 3 else \
            call(BROADCAST, x.copy(), None, i % n, False, None)
        seq = d.seq
        w = m[cb + (seq & 255)]
        assert w >> 32 == seq
        h = (h0 * 16777619 ^ w) % (1 << 32)   # (FNV-1's 32-bit step)
        assert m[row + AT_HIST] == h, (i, seq)
        ring_at[seq] = h
    hit = [s for s in ring_at if s % (1 << CK_SHIFT) == 0]
    assert hit
    for s in hit:
        for lv in range(CK_LEVELS):
            if s % (1 << (CK_SHIFT + CK_STEP * lv)):
                break
            i = row + AT_CKPT + 2 * (lv * CK_N + (s >> (CK_SHIFT + CK_STEP * lv)) % CK_N)
            assert (m[i], m[i + 1]) == (s, ring_at[s])
    hs = mpicomm.all_gather_object((d.seq, m[row + AT_HIST]))
    assert hs == [hs[0]] * n   # the same calls: the same history on every rank


@pytest.mark.mpi
@pytest.mark.parametrize("path", PATHS)
def test_async_work_and_reuse_with_new_arrays(comm, path, request):
    g, d, call = caller(path)
    n, r = g.size, g.rank
    for i in range(4):   # a new array every call: the prepared call is reused, the data is this call's
        xs = [data(q, f"{request.node.name}{i}", (5,), "int32") for q in range(n)]
        w = call(ALL_REDUCE, xs[r], None, ReduceOp.SUM, True, None)
        assert w._seq == d.seq and w._group is g
        np.testing.assert_array_equal(w.wait(), reduce_np(xs, ReduceOp.SUM))
    # a signature the last call did not have (another dtype), then the first again
    for dt in ("float64", "int32"):
        xs = [data(q, request.node.name + dt, (5,), dt) for q in range(n)]
        np.testing.assert_array_equal(call(ALL_REDUCE, xs[r], None, ReduceOp.SUM, False, None),
                                      reduce_np(xs, ReduceOp.SUM))


@pytest.mark.mpi
@pytest.mark.parametrize("path", PATHS)
def test_refusal_published_and_next_call_clean(comm, path, request):
    g, d, call = caller(path)
    n, r = g.size, g.rank
    x = data(r, request.node.name, (4,), "float32")
    call(ALL_REDUCE, x, np.empty(4, np.float32), ReduceOp.SUM, False, None)   # prepared with out=
    bad = np.empty(8, np.float32)[::2]   # the same signature, a non-contiguous out on every rank
    seq = d.seq
    with pytest.raises(InvalidArgumentError, match="out"):
        call(ALL_REDUCE, x, bad, ReduceOp.SUM, False, None)
    assert d.seq == seq + 1 and d.mem[d.row + AT_RAISED] == (seq + 1) << 4 | ALL_REDUCE
    xs = [data(q, request.node.name + "2", (4,), "float32") for q in range(n)]
    o = np.empty(4, np.float32)
    assert call(ALL_REDUCE, xs[r], o, ReduceOp.SUM, False, None) is o
    np.testing.assert_array_equal(o, reduce_np(xs, ReduceOp.SUM))


@pytest.mark.mpi
@pytest.mark.parametrize("path", PATHS)
def test_not_an_array_takes_the_validating_path(comm, path):
    g, d, call = caller(path)
    with pytest.raises(InvalidArgumentError, match="x"):
        call(ALL_REDUCE, [1.0, 2.0], None, ReduceOp.SUM, False, None)
    with pytest.raises(InvalidArgumentError, match="x"):   # twice: nothing kept from the first
        call(ALL_REDUCE, [1.0, 2.0], None, ReduceOp.SUM, False, None)


def run_py(code, env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "MPICOMM_"))}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)


def test_native_switch():
    """MPICOMM_NATIVE=0 keeps the Python path; a bad value is refused naming it."""
    r = run_py("import mpicomm._native as n, mpicomm._dispatch as d; print(n.active(), d.Dispatcher.call is d.Dispatcher.py_call)",
               {"MPICOMM_NATIVE": "0"})
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stderr
    r = run_py("import mpicomm", {"MPICOMM_NATIVE": "yes"})
    assert r.returncode != 0 and "MPICOMM_NATIVE='yes'" in r.stderr, r.stderr


def test_stale_build_is_not_used(monkeypatch):
    """A build of another version of the source is not loaded (the Python path runs); with
    MPICOMM_NATIVE=1 that is an error naming the rebuild command."""
    if _native.callpath is None and STRICT:
        pytest.fail(f"the compiled call path is not in use: {_native.why_not}")
    monkeypatch.setattr(_native, "source_hash", lambda: "another-version")
    monkeypatch.delenv("MPICOMM_NATIVE", raising=False)
    mod, why = _native._load()
    if _native.callpath is not None:
        assert mod is None and "another version" in why
    monkeypatch.setenv("MPICOMM_NATIVE", "1")
    with pytest.raises(ImportError, match="python -m mpicomm._native"):
        _native._load()


def test_a_tree_without_a_build_says_how_to_build_it(tmp_path):
    """A source tree where python -m mpicomm._native has not run (a fresh clone, or `pip install .`
    followed by a script run from the tree) says where the build is missing and how to make it,
    not Python's 'partially initialized module ... circular import'."""
    import shutil
    shutil.copytree(os.path.dirname(mpicomm.__file__), tmp_path / "mpicomm",
                    ignore=shutil.ignore_patterns("_callpath.*.so", "_callpath.*.pyd", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "MPICOMM_"))}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import mpicomm._native as n; print(n.active()); print(n.why_not)"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    here = tmp_path / "mpicomm" / "_native"
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "False", f"not built in {here} (python -m mpicomm._native in the source tree builds it)"], r.stderr
