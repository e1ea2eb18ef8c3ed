"""mpicomm-trace and a rank that never reached the call (issue 24).

Such a rank prints no report and writes no flight record. The ranks that time out write
theirs, with where each peer was (its last entered and completed sequence number per
group, read from the progress window by the timeout report): mpicomm-trace gives the
missing rank a column, marks it "missing (no record)" or with what the others read, and
names it, not one of the ranks that waited, as the one that did not enter the call.

The first test starts its own mpirun (3 ranks; rank 2 skips the third all_reduce) as
tests/test_faults.py does; the others run mpicomm-trace on made-up files.
"""
import json
import re
import subprocess
import sys

import pytest

from conftest import clean_mpi_env, mpirun_argv, run_job

TIMEOUT = 5   # seconds, init(timeout=...) of the job

# Every rank makes two all_reduce calls on the world; rank 2 then sleeps instead of making
# the third, which ranks 0 and 1 enter and wait in until the timeout.
WORKER = f"""
import sys, time
import numpy as np
import mpicomm

mpicomm.init(backend="mpi", timeout={TIMEOUT})
r = mpicomm.get_rank()
x = np.ones(4, np.float32)
for i in range(3):
    if i == 2 and r == 2:
        print(f"RESULT rank={{r}} skipping", flush=True)
        time.sleep(120)
        continue
    mpicomm.all_reduce(x)
print(f"RESULT rank={{r}} finished", flush=True)
"""


def _run(n, script, env, limit):
    argv = mpirun_argv(n, script)
    return run_job(argv, clean_mpi_env(env), limit)


def _table(text, group):
    """(header cells, {seq: [cells]}) of one group's table (columns split on 2+ spaces)."""
    block = text.split(f"group {group!r}")[1].split("\n\n")[0].splitlines()
    header = re.split(r"\s{2,}", block[1].strip())
    rows = {int(line.split()[0]): re.split(r"\s{2,}", line.strip()) for line in block[3:] if re.match(r"\d", line)}
    return header, rows


def _trace(*args):
    return subprocess.run([sys.executable, "-m", "mpicomm.tools.trace", *args], capture_output=True, text=True,
                          timeout=60, env=clean_mpi_env())


def test_rank_that_never_reached_the_call_is_named_missing(tmp_path):
    d = tmp_path / "traces"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    p, took = _run(3, str(script), {"MPICOMM_TRACE_DIR": str(d), "MPICOMM_FLIGHT_RECORDER": "64",
                                    "MPICOMM_TIMEOUT": str(TIMEOUT)}, limit=TIMEOUT + 60)
    assert p.returncode != 0 and took < TIMEOUT + 30, (took, p.stdout, p.stderr)
    assert "RESULT rank=2 skipping" in p.stdout and "finished" not in p.stdout, p.stdout
    assert re.search(r"^\[mpicomm rank [01]\] CollectiveTimeoutError: .*all_reduce sequence 3 on group 'world'",
                     p.stderr, re.M), p.stderr
    files = sorted(d.glob("mpicomm-trace.rank*.json"))
    names = [f.name for f in files]
    # rank 2 was in no call: it reported nothing and wrote nothing; of ranks 0 and 1, one
    # may be ended by the other's abort before it writes
    assert "mpicomm-trace.rank2.json" not in names, names
    assert names and set(names) <= {"mpicomm-trace.rank0.json", "mpicomm-trace.rank1.json"}, p.stderr
    for f in files:
        rec = json.loads(f.read_text())
        me = rec["rank"]
        assert rec["reason"] == "timeout"
        w = rec["groups"]["world"]
        assert w["ranks"] == [0, 1, 2] and w["last_seq"] == 3
        # what its report read of the peers: rank 2 entered and completed world call 2 only;
        # the other waiter entered call 3 (it may have been read before it entered it)
        assert w["peers"]["2"] == {"entered": 2, "collective": "all_reduce", "done": 2, "exited": False}, w
        other = w["peers"][str(1 - me)]
        assert other["entered"] in (2, 3) and other["done"] == 2, w
        assert str(me) not in w["peers"]

    t = _trace(str(d))
    assert t.returncode == 0, t.stderr
    out = t.stdout
    header, rows = _table(out, "world")
    # a column for every rank of the group, rank 2 included
    assert header[3:6] == ["rank 0", "rank 1", "rank 2"] and header[-1] == "last to enter", out
    assert sorted(rows) == [1, 2, 3], out
    col = {r: 3 + r for r in range(3)}
    for seq in (1, 2):
        assert rows[seq][col[2]] == "entered (no record)", out
    assert rows[3][col[2]] == "not entered (no record)", out
    for r in range(2):
        want = r"\+.* \(pending\)" if f"mpicomm-trace.rank{r}.json" in names else r"(pending|entered) \(no record\)"
        assert re.fullmatch(want, rows[3][col[r]]), out
    # the rank named for call 3 is rank 2, not a rank that waited in it
    assert rows[3][-1] == "rank 2 (not entered; no record)", out
    assert "rank 2 did not enter seq 3 all_reduce(sum), nor any later call of the group" in out
    assert re.search(r"^  rank 2: missing \(no record\); at rank [01]'s report its last call on group 'world' "
                     r"was seq 2 all_reduce, completed$", out, re.M), out
    assert "no file for rank 2 (not written, or not given): missing (no record)" in out


# ------------------------------------------------------------------ made-up files
T0 = 1_700_000_000_000_000_000


def _rec(rank, calls, last_seq, peers=None, world=(0, 1, 2)):
    cs = [{"group": "world", "seq": s, "collective": "all_reduce", "shape": [4], "dtype": "float32", "op": "sum",
           "root": None, "async_op": False, "start_ns": T0 + t, "done": done} for s, t, done in calls]
    g = {"ranks": list(world), "rank": rank, "last_seq": last_seq, "done_seq": last_seq - 1}
    if peers is not None:
        g["peers"] = peers
    return {"format": "mpicomm-flight-record", "version": 1, "rank": rank, "world_size": len(world), "host": "h",
            "pid": 100 + rank, "reason": "timeout", "recorder_size": 64, "clock_origin_ns": T0 - 10**9,
            "dumped_ns": T0 + 10**6, "groups": {"world": g}, "calls": cs}


def _write(tmp_path, recs):
    paths = []
    for r, rec in recs.items():
        p = tmp_path / f"mpicomm-trace.rank{r}.json"
        p.write_text(json.dumps(rec))
        paths.append(str(p))
    return paths


CALLS0 = [(1, 1000, True), (2, 5000, True), (3, 20000, False)]
CALLS1 = [(1, 1300, True), (2, 5200, True), (3, 20500, False)]


def test_missing_rank_without_what_the_peers_read(tmp_path, capsys):
    """Records of ranks 0 and 1 only, without peers (dump_flight_record(), or an older
    mpicomm): rank 2 gets a column "missing (no record)", and call 3, pending on every rank
    seen, names rank 2 as the rank missing, not rank 1 (which entered it last of the two)."""
    from mpicomm.tools import trace

    paths = _write(tmp_path, {0: _rec(0, CALLS0, 3), 1: _rec(1, CALLS1, 3)})
    assert trace.main(paths) == 0
    out = capsys.readouterr().out
    header, rows = _table(out, "world")
    assert header[3:6] == ["rank 0", "rank 1", "rank 2"], out
    assert rows[1][3:] == ["+0", "+300ns", "missing (no record)", "rank 1 +300ns (rank 2: no record)"]
    assert rows[3][3:] == ["+0 (pending)", "+500ns (pending)", "missing (no record)", "rank 2 (missing: no record)"]
    assert ("rank 2 wrote no record, and no other rank's record says where it was: every other member entered "
            "seq 3 all_reduce(sum), pending on ranks 0, 1") in out
    assert "  rank 2: missing (no record); no other rank's record read its progress" in out
    # a straggler among the ranks seen is not counted while rank 2's times are unknown
    assert "last to enter most often" not in out


def test_missing_rank_read_by_a_peer(tmp_path, capsys):
    """Rank 0's report read rank 2 at call 1 and rank 1 in call 3; only rank 0's file is
    given: rank 1 is 'pending', rank 2 'not entered' from call 2 on and named for both."""
    from mpicomm.tools import trace

    peers = {"1": {"entered": 3, "collective": "all_reduce", "done": 2, "exited": False},
             "2": {"entered": 1, "collective": "all_reduce", "done": 1, "exited": True}}
    paths = _write(tmp_path, {0: _rec(0, CALLS0, 3, peers)})
    assert trace.main(paths) == 0
    out = capsys.readouterr().out
    _, rows = _table(out, "world")
    assert rows[1][3:] == ["+0", "entered (no record)", "entered (no record)"]
    assert rows[2][3:] == ["+0", "entered (no record)", "not entered (no record)", "rank 2 (not entered; no record)"]
    assert rows[3][3:] == ["+0 (pending)", "pending (no record)", "not entered (no record)",
                           "rank 2 (not entered; no record)"]
    assert "rank 2 did not enter seq 2 all_reduce(sum), nor any later call of the group" in out
    assert ("  rank 2: missing (no record); at rank 0's report its last call on group 'world' was seq 1 "
            "all_reduce, completed; it had left its script") in out
    assert ("  rank 1: missing (no record); at rank 0's report its last call on group 'world' was seq 3 "
            "all_reduce, not completed (last completed: seq 2)") in out


def test_two_readers_and_a_rank_with_a_file(tmp_path, capsys):
    """Ranks 0 and 1 both read rank 2 (at different times: the later read counts); a rank
    with a file that did not enter (rank 1 here, after its dump) is named with rank 2."""
    from mpicomm.tools import trace

    p0 = {"1": {"entered": 2, "collective": "all_reduce", "done": 2, "exited": False},
          "2": {"entered": 1, "collective": "all_reduce", "done": 1, "exited": False}}
    p1 = {"0": {"entered": 2, "collective": "all_reduce", "done": 2, "exited": False},
          "2": {"entered": 2, "collective": "all_reduce", "done": 2, "exited": False}}
    paths = _write(tmp_path, {0: _rec(0, CALLS0, 3, p0), 1: _rec(1, CALLS1[:2], 2, p1)})
    assert trace.main(paths) == 0
    out = capsys.readouterr().out
    _, rows = _table(out, "world")
    assert rows[2][3:] == ["+0", "+200ns", "entered (no record)", "rank 1 +200ns (rank 2: no record)"]
    assert rows[3][3:] == ["+0 (pending)", "-", "not entered (no record)",
                           "ranks 1, 2 (not entered; no record of rank 2)"]
    assert "ranks 1, 2 did not enter seq 3 all_reduce(sum), nor any later call of the group" in out
    assert "  rank 2: missing (no record); at rank 1's report its last call on group 'world' was seq 2" in out


def test_peer_not_answering(tmp_path, capsys):
    """A peer whose window could not be read (null): still missing, said so."""
    from mpicomm.tools import trace

    paths = _write(tmp_path, {0: _rec(0, CALLS0, 3, {"1": None, "2": None})})
    assert trace.main(paths) == 0
    out = capsys.readouterr().out
    _, rows = _table(out, "world")
    assert rows[3][3:] == ["+0 (pending)", "missing (no record)", "missing (no record)",
                           "ranks 1, 2 (missing: no record)"]
    assert ("  ranks 1, 2: missing (no record); rank 0 could not read its progress at its report (no answer: "
            "the process may have died)") in out


@pytest.mark.parametrize("peers", [[1, 2], {"x": None}, {"2": {"entered": "two", "done": 1}}, {"2": {"done": 1}}])
def test_bad_peers_name_the_file(tmp_path, capsys, peers):
    from mpicomm.tools import trace

    paths = _write(tmp_path, {0: _rec(0, CALLS0, 3, peers)})
    assert trace.main(paths) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpicomm-trace: {paths[0]}: invalid flight record: groups['world'].peers"), err
