"""The flight recorder (mpicomm._reliability.flight) and mpicomm-trace (mpicomm.tools.trace).

MPI tests (run under mpirun at 1, 2 and 4 ranks) make calls on the world and on a
sub-group, write every rank's record and check it against the calls made. Serial tests
start their own mpirun for what needs a fresh init (MPICOMM_FLIGHT_RECORDER values), and
check mpicomm-trace on made-up files. The timeout case is in tests/test_faults.py.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from conftest import ROOT, clean_mpi_env, mpirun_argv, run_job

WORKER = os.path.join(ROOT, "tests", "reliability_worker.py")
ALLOWED = "expected an integer >= 0: the calls kept per group (default 64; 0 turns the flight recorder off)"


# ------------------------------------------------------------------ MPI: records of real calls
@pytest.fixture
def shared_dir(comm, monkeypatch):
    """One temporary directory, the same on every rank, as MPICOMM_TRACE_DIR."""
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    d = w.bcast(tempfile.mkdtemp(prefix="mpicomm-flight-") if w.Get_rank() == 0 else None, root=0)
    monkeypatch.setenv("MPICOMM_TRACE_DIR", d)
    yield d
    w.Barrier()
    if w.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


def _recorder():
    from mpicomm._state import CTX

    return CTX.reliability.flight


def _read(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.mpi
def test_record_matches_the_calls(comm, rng, shared_dir):
    from mpi4py import MPI

    from mpicomm._state import CTX

    n, r = comm.get_group_size(), comm.get_rank()
    if _recorder().size < 10:
        pytest.skip("MPICOMM_FLIGHT_RECORDER keeps fewer than the 10 calls this test makes")
    members = list(range(n))[::-1][:max(1, n // 2)]       # world ranks n-1, n-2, ...
    name = f"flight-sub-{n}"
    # every rank's calls in a group of their own (W, all ranks): the world's numbers may
    # already differ between ranks, after earlier tests' calls refused on some ranks only
    W = f"flight-all-{n}"
    t_before = time.time_ns()
    world_before = CTX.world.disp.seq
    comm.create_group(W, list(range(n)))   # W's call 1 (creating groups: not counted on the world)
    base = 1
    comm.create_group(name, members)       # sub 1 on the members
    comm.all_reduce(rng.standard_normal((3, 4)).astype(np.float32), op="max", group=W)   # base+1
    comm.broadcast(rng.integers(0, 9, 5), root=n - 1, group=W)                           # base+2 (int64)
    comm.barrier(group=W)                                                                # base+3
    with pytest.raises(comm.InvalidArgumentError):                                       # base+4: its
        comm.all_reduce(np.arange(3, dtype=np.int32), op="avg", group=W)                 # preparation raised
    comm.all_gather(rng.standard_normal(2), async_op=True, group=W).wait()               # base+5 (float64)
    comm.reduce(rng.integers(0, 9, 6).astype(np.int32), op="min", root=0, group=W)      # base+6
    if r in members:
        k = len(members)
        comm.all_reduce(rng.standard_normal(7), group=name)                              # sub 2
        comm.all_to_all(rng.standard_normal(2 * k).astype(np.float32), group=name)        # sub 3
        comm.reduce_scatter(rng.standard_normal(3 * k).astype(np.float32), op="avg", group=name)  # sub 4
    comm.all_reduce(np.arange(4, dtype=np.uint8) + r, group=W)                           # base+7
    t_after = time.time_ns()
    assert CTX.world.disp.seq == world_before
    path = comm.dump_flight_record()
    assert path == os.path.join(shared_dir, f"mpicomm-trace.rank{r}.json")

    rec = _read(path)
    assert (rec["format"], rec["rank"], rec["world_size"], rec["pid"], rec["host"]) == \
        ("mpicomm-flight-record", r, n, os.getpid(), socket.gethostname())
    want = [(W, 1, "create_group", None, None, None, None, False)]
    want += [(name, 1, "create_group", None, None, None, None, False)] if r in members else []
    want += [(W, base + 1, "all_reduce", [3, 4], "float32", "max", None, False),
             (W, base + 2, "broadcast", [5], "int64", None, n - 1, False),
             (W, base + 3, "barrier", None, None, None, None, False),
             (W, base + 5, "all_gather", [2], "float64", None, None, True),
             (W, base + 6, "reduce", [6], "int32", "min", 0, False)]
    if r in members:
        k = len(members)
        want += [(name, 2, "all_reduce", [7], "float64", "sum", None, False),
                 (name, 3, "all_to_all", [2 * k], "float32", None, None, False),
                 (name, 4, "reduce_scatter", [3 * k], "float32", "avg", None, False)]
    want += [(W, base + 7, "all_reduce", [4], "uint8", "sum", None, False)]
    mine = [c for c in rec["calls"] if c["group"] in (name, W)]
    got = [(c["group"], c["seq"], c["collective"], c["shape"], c["dtype"], c["op"], c["root"], c["async_op"])
           for c in mine]
    assert got == want
    assert all(c["done"] for c in mine)
    starts = [c["start_ns"] for c in mine]
    assert starts == sorted(starts)
    # the clock origin is taken at init: allow for the wall clock being slewed since
    assert t_before - 10**9 <= starts[0] and starts[-1] <= t_after + 10**9
    assert rec["groups"][W] == {"ranks": list(range(n)), "rank": r, "last_seq": base + 7, "done_seq": base + 7}
    if r in members:
        assert rec["groups"][name] == {"ranks": members, "rank": members.index(r), "last_seq": 4, "done_seq": 4}
    else:
        assert name not in rec["groups"]

    # mpicomm-trace on the ranks' files: every rank entered every world call, none pending
    MPI.COMM_WORLD.Barrier()
    if r == 0:
        from mpicomm.tools import trace

        merged = trace.merge(trace.load_all(sorted(os.path.join(shared_dir, f) for f in os.listdir(shared_dir))))
        rows = {c["seq"]: c for c in merged[W]["calls"] if c["seq"] > base}
        assert sorted(rows) == [base + s for s in (1, 2, 3, 5, 6, 7)]
        for c in rows.values():
            assert c["missing"] == [] and all(v.startswith("+") and "pending" not in v for v in c["cells"].values())
        sub = merged[name]
        assert sub["members"] == sorted(members) and [c["seq"] for c in sub["calls"]] == [1, 2, 3, 4]
        assert all(sub["calls"][0]["cells"][q] == "n/a" for q in range(n) if q not in members)
    comm.destroy_group(name)
    comm.destroy_group(W)


@pytest.mark.mpi
def test_ring_keeps_the_last_n_calls(comm, shared_dir):
    N = _recorder().size
    if N == 0:
        pytest.skip("the flight recorder is off (MPICOMM_FLIGHT_RECORDER=0)")
    n, r = comm.get_group_size(), comm.get_rank()
    name = f"flight-ring-{n}"
    comm.create_group(name, list(range(n)))
    total = N + 7
    for i in range(total):   # create_group was the group's call 1
        comm.all_reduce(np.arange(i + 1, dtype=np.float32), group=name)   # seq i + 2, shape (i + 1,)
    path = comm.dump_flight_record(os.path.join(shared_dir, "ring", f"r{r}.json"))
    assert path == os.path.join(shared_dir, "ring", f"r{r}.json")
    calls = [c for c in _read(path)["calls"] if c["group"] == name]
    assert [c["seq"] for c in calls] == list(range(9, total + 2))
    assert [c["shape"] for c in calls] == [[s] for s in range(8, total + 1)]
    comm.destroy_group(name)


@pytest.mark.mpi
def test_dump_flight_record_refuses_a_bad_path(comm):
    with pytest.raises(comm.InvalidArgumentError, match=r"invalid path=3: expected a file path"):
        comm.dump_flight_record(3)


# ------------------------------------------------------------------ serial: fresh jobs
def _job(n, mode, env, limit=90):
    p, _ = run_job(mpirun_argv(n, WORKER, mode), clean_mpi_env({"MPICOMM_TIMEOUT": "60", **env}), limit)
    out = {}
    for m in re.finditer(r"^RESULT rank=(\d+) (.*)$", p.stdout, re.M):
        out.setdefault(int(m.group(1)), []).append(m.group(2))
    return p, out


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "1e3"])
def test_bad_flight_recorder_value_raises_on_every_rank(value):
    p, res = _job(2, "flight_bad_env", {"FLIGHT_BAD_VALUE": value})
    assert p.returncode == 0, p.stderr
    for r in (0, 1):
        assert res[r] == [f"raised InvalidArgumentError | invalid MPICOMM_FLIGHT_RECORDER={value!r} (rank {r}): "
                          f"{ALLOWED}", "after True 2.0"], p.stdout + p.stderr


def test_bad_flight_recorder_value_on_one_rank_raises_on_every_rank():
    p, res = _job(2, "flight_bad_env", {"FLIGHT_BAD_VALUE": "many", "FLIGHT_BAD_RANK": "1"})
    assert p.returncode == 0, p.stderr
    mine = f"invalid MPICOMM_FLIGHT_RECORDER='many' (rank 1): {ALLOWED}"
    assert res[1] == [f"raised InvalidArgumentError | {mine}", "after True 2.0"], p.stdout + p.stderr
    assert res[0] == [f"raised InvalidArgumentError | {mine}; set MPICOMM_FLIGHT_RECORDER alike on every rank "
                      "(invalid on rank 1, not on rank 0)", "after True 2.0"], p.stdout + p.stderr


@pytest.mark.parametrize("size", [5, 0])
def test_ring_of_a_size_that_is_no_power_of_two_and_off(tmp_path, size):
    """12 calls of shapes (1,)..(12,): N=5 keeps exactly seq 8..12; N=0 keeps nothing."""
    p, res = _job(2, "flight_ring", {"MPICOMM_FLIGHT_RECORDER": str(size), "MPICOMM_TRACE_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    for r in (0, 1):
        path = str(tmp_path / f"mpicomm-trace.rank{r}.json")
        assert res[r] == [f"dumped {path}"]
        rec = _read(path)
        assert rec["recorder_size"] == size
        assert rec["groups"]["world"]["last_seq"] == 12
        want = list(range(8, 13)) if size else []
        assert [c["seq"] for c in rec["calls"]] == want
        assert [c["shape"] for c in rec["calls"]] == [[s] for s in want]
        assert all(c["collective"] == "all_reduce" and c["dtype"] == "float64" and c["done"] for c in rec["calls"])


@pytest.mark.parametrize("value,want", [("", 64), ("0", 0), ("7", 7), (" 128 ", 128)])
def test_size_from_env(monkeypatch, value, want):
    from mpicomm._reliability.flight import size_from_env

    monkeypatch.setenv("MPICOMM_FLIGHT_RECORDER", value)
    assert size_from_env() == want


# ------------------------------------------------------------------ mpicomm-trace on made-up files
T0 = 1_700_000_000_000_000_000     # a wall-clock time in ns


def _rec(rank, calls, groups, dumped, world_size=3):
    cs = [{"group": g, "seq": s, "collective": coll, "shape": [4], "dtype": "float32", "op": "sum", "root": None,
           "async_op": False, "start_ns": T0 + t, "done": done} for g, s, coll, t, done in calls]
    return {"format": "mpicomm-flight-record", "version": 1, "rank": rank, "world_size": world_size,
            "host": "h", "pid": 100 + rank, "reason": "timeout", "recorder_size": 64,
            "clock_origin_ns": T0 - 10**9, "dumped_ns": T0 + dumped, "groups": groups, "calls": cs}


WORLD3 = {"ranks": [0, 1, 2], "rank": 0}


def _made_up(tmp_path):
    """Rank 1 enters world seq 1 and 2 last and never enters seq 3; ranks 0 and 2 wait in seq 3.
    Group 'pair' (ranks 0 and 2): rank 2 enters its seq 1 2.5 ms after rank 0."""
    recs = {
        0: _rec(0, [("world", 1, "all_reduce", 1000, True), ("world", 2, "all_reduce", 5000, True),
                    ("pair", 1, "all_reduce", 7000, True), ("world", 3, "all_reduce", 20000, False)],
                {"world": {**WORLD3, "last_seq": 3}, "pair": {"ranks": [0, 2], "rank": 0, "last_seq": 1}}, 50000),
        1: _rec(1, [("world", 1, "all_reduce", 1500, True), ("world", 2, "all_reduce", 9000, True)],
                {"world": {**WORLD3, "last_seq": 2}}, 40000),
        2: _rec(2, [("world", 1, "all_reduce", 1200, True), ("world", 2, "all_reduce", 5100, True),
                    ("pair", 1, "all_reduce", 2_507_000, True), ("world", 3, "all_reduce", 2_520_300, False)],
                {"world": {**WORLD3, "last_seq": 3}, "pair": {"ranks": [0, 2], "rank": 1, "last_seq": 1}},
                3_000_000),
    }
    paths = []
    for r, rec in recs.items():
        p = tmp_path / f"mpicomm-trace.rank{r}.json"
        p.write_text(json.dumps(rec))
        paths.append(str(p))
    return recs, paths


def _rows(text, group):
    """{seq: [cells]} of one group's table in mpicomm-trace's output (columns split on 2+ spaces)."""
    block = text.split(f"group {group!r}")[1].split("\n\n")[0].splitlines()[3:]
    return {int(line.split()[0]): re.split(r"\s{2,}", line.strip()) for line in block if re.match(r"\d", line)}


def test_trace_names_the_straggler_and_marks_pending(tmp_path, capsys):
    from mpicomm.tools import trace

    _, paths = _made_up(tmp_path)
    assert trace.main(paths) == 0
    out = capsys.readouterr().out
    world = _rows(out, "world")
    #           seq  collective         shape dtype     rank 0        rank 1    rank 2        last to enter
    assert world[1] == ["1", "all_reduce(sum)", "(4,) float32", "+0", "+500ns", "+200ns", "rank 1 +500ns"]
    assert world[2] == ["2", "all_reduce(sum)", "(4,) float32", "+0", "+4.0us", "+100ns", "rank 1 +4.0us"]
    assert world[3] == ["3", "all_reduce(sum)", "(4,) float32", "+0 (pending)", "-", "+2.50ms (pending)",
                        "rank 1 (not entered)"]
    assert "rank 1 did not enter seq 3 all_reduce(sum), nor any later call of the group" in out
    assert "last to enter most often: rank 1 (2 of 3 calls, by +2.2us on average)" in out
    pair = _rows(out, "pair")
    assert pair[1] == ["1", "all_reduce(sum)", "(4,) float32", "+0", "n/a", "+2.50ms", "rank 2 +2.50ms"]
    # a directory gives the same
    assert trace.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == out


def test_trace_last_k(tmp_path, capsys):
    from mpicomm.tools import trace

    _, paths = _made_up(tmp_path)
    assert trace.main(["--last", "1", *paths]) == 0
    out = capsys.readouterr().out
    assert sorted(_rows(out, "world")) == [3]
    assert "group 'world' (world ranks 0, 1, 2): last 1 of 3 recorded calls" in out


def test_trace_chrome_json(tmp_path, capsys):
    from mpicomm.tools import trace

    recs, paths = _made_up(tmp_path)
    out = tmp_path / "chrome.json"
    assert trace.main([*paths, "--chrome", str(out)]) == 0
    ev = json.loads(out.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "rank 0 (h)", 1: "rank 1 (h)", 2: "rank 2 (h)"}
    assert {e["pid"] for e in ev} == {0}
    xs = [e for e in ev if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == {0, 1, 2}
    assert len(xs) == sum(len(rec["calls"]) for rec in recs.values())
    # per rank: ts from the earliest start of all (T0 + 1000 ns), dur until its next call or its dump
    for r, rec in recs.items():
        starts = sorted(c["start_ns"] - T0 for c in rec["calls"])
        ends = starts[1:] + [rec["dumped_ns"] - T0]
        mine = sorted((e for e in xs if e["tid"] == r), key=lambda e: e["ts"])
        assert [e["ts"] for e in mine] == pytest.approx([(s - 1000) / 1e3 for s in starts])
        assert [e["dur"] for e in mine] == pytest.approx([(e - s) / 1e3 for s, e in zip(starts, ends)])
    pending = [(e["tid"], e["args"]["seq"]) for e in xs if not e["args"]["done"]]
    assert sorted(pending) == [(0, 3), (2, 3)]


@pytest.mark.parametrize("case", ["missing", "not-json", "not-a-record", "bad-field", "duplicate", "empty-dir"])
def test_trace_errors_name_the_file(tmp_path, capsys, case):
    from mpicomm.tools import trace

    recs, paths = _made_up(tmp_path)
    bad = tmp_path / "bad.json"
    if case == "missing":
        args, want = [paths[0], str(tmp_path / "nope.json")], f"{tmp_path / 'nope.json'}: no such file"
    elif case == "not-json":
        bad.write_text('{"format": ')
        args, want = [str(bad)], f"{bad}: not valid JSON (Expecting value at line 1 column 12)"
    elif case == "not-a-record":
        bad.write_text("[1, 2]")
        args, want = [str(bad)], f"{bad}: not an mpicomm flight record"
    elif case == "bad-field":
        rec = recs[0]
        rec["calls"][1]["seq"] = "two"
        bad.write_text(json.dumps(rec))
        args, want = [str(bad)], f"{bad}: invalid flight record: calls[1].seq is 'two', expected an integer"
    elif case == "duplicate":
        shutil.copy(paths[1], bad)
        args, want = [paths[1], str(bad)], f"{bad}: a second record of rank 1 (the first is {paths[1]})"
    else:
        (tmp_path / "empty").mkdir()
        args, want = [str(tmp_path / "empty")], f"{tmp_path / 'empty'}: no mpicomm-trace.rank*.json files"
    assert trace.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpicomm-trace: " + want), err


def test_trace_command_line(tmp_path):
    """``python -m mpicomm.tools.trace``: exit status 0, and 2 for a missing file."""
    _, paths = _made_up(tmp_path)
    p = subprocess.run([sys.executable, "-m", "mpicomm.tools.trace", *paths], capture_output=True, text=True,
                       timeout=60, env=clean_mpi_env())
    assert p.returncode == 0, p.stderr
    assert "rank 1 (not entered)" in p.stdout
    p = subprocess.run([sys.executable, "-m", "mpicomm.tools.trace", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=60, env=clean_mpi_env())
    assert p.returncode == 2 and f"{tmp_path / 'x.json'}: no such file" in p.stderr
