"""The timing values of the reliability machinery (mpicomm._timing) and MPICOMM_TIMING.

Serial: the object against the table of docs/RELIABILITY.md ("Timing values"), every field
read where mpicomm waits, MPICOMM_TIMING's parsing and its errors; and jobs of their own
(tests/reliability_worker.py, mode timing_env) for what needs a fresh init: the values set
on each rank, and a bad value raised by init() on every rank.
"""
import glob
import json
import os
import re

import numpy as np
import pytest

from conftest import ROOT, clean_mpi_env, mpirun_argv, run_job
from mpicomm._timing import TIMING, Timing, names, parse
from mpicomm.errors import InvalidArgumentError

WORKER = os.path.join(ROOT, "tests", "reliability_worker.py")
DOC = os.path.join(ROOT, "docs", "RELIABILITY.md")


def _documented():
    """[(field, default)] of the table in docs/RELIABILITY.md, "Timing values", in its order."""
    text = open(DOC, encoding="utf-8").read()
    head = "## Timing values (`MPICOMM_TIMING`)"
    assert head in text, f"no section {head!r} in {DOC}"
    section = text[text.index(head):].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([0-9.]+) \| [^|]+ \|$", section, re.M)
    assert rows, section
    return [(k, float(v)) for k, v in rows]


DOCUMENTED = _documented()
FIELDS = [k for k, _ in DOCUMENTED]
ALLOWED = ("expected comma-separated field=seconds entries, each value a finite number of seconds >= 0 "
           "(watch_every > 0); the fields: " + ", ".join(FIELDS))


def test_the_documented_table_is_every_field_with_its_default():
    assert names() == FIELDS
    fresh = Timing()
    assert [(k, getattr(fresh, k)) for k in names()] == DOCUMENTED


def test_a_field_that_does_not_exist_cannot_be_set():
    """slots: a misspelt field set by a test or a module fails instead of being ignored."""
    with pytest.raises(AttributeError):
        TIMING.destroy_wiat = 1.0


def _sources():
    for path in glob.glob(os.path.join(ROOT, "mpicomm", "**", "*.py"), recursive=True):
        if os.path.basename(path) != "_timing.py":
            yield path, open(path, encoding="utf-8").read()


def test_every_field_is_read_where_mpicomm_waits_and_never_copied_at_import():
    """Every field is read (``TIMING.field``) somewhere in mpicomm, at the wait: no module
    binds a value of it at import (a name, a default argument), where a change would not
    reach it."""
    sources = dict(_sources())
    unread = [k for k in names() if not any(f"TIMING.{k}" in text for text in sources.values())]
    assert unread == []
    copies = [f"{os.path.relpath(p, ROOT)}: {line}" for p, text in sources.items() for line in text.splitlines()
              if re.match(r"^\w+\s*(:[^=]+)?=.*\bTIMING\.\w+", line) or re.search(r"def \w+\(.*=\s*TIMING\.", line)]
    assert copies == []


def test_parse_takes_every_field_with_spaces_and_an_empty_entry():
    rng = np.random.default_rng(34)
    picked = [FIELDS[i] for i in rng.permutation(len(FIELDS))[:6]]
    values = {k: round(float(v), 3) for k, v in zip(picked, rng.uniform(0.001, 50, len(picked)))}
    text = " , ".join(f" {k} = {v}" for k, v in values.items()) + ","
    assert parse(text) == values
    assert parse("") == {} and parse(" , ") == {}
    assert parse("wait_check=0") == {"wait_check": 0.0}   # 0: no wait (all but watch_every)
    assert parse("grace=1e-1") == {"grace": 0.1}


@pytest.mark.parametrize("value,entry,why", [
    ("bogus=2", "bogus=2", "names no field ('bogus')"),
    ("grace=1,Grace=2", "Grace=2", "names no field ('Grace')"),
    ("grace=soon", "grace=soon", "is no number of seconds ('soon')"),
    ("grace", "grace", "is not field=seconds"),
    ("leave_wait=-2", "leave_wait=-2", "is below 0 ('-2')"),
    ("dump_wait=nan", "dump_wait=nan", "is no finite number of seconds ('nan')"),
    ("dump_wait=inf", "dump_wait=inf", "is no finite number of seconds ('inf')"),
    ("grace=1, grace=2", "grace=2", "sets grace a second time"),
    ("watch_every=0", "watch_every=0", "is 0 (watch_every must be above 0: the watchdog would never pause)"),
])
def test_parse_refuses_a_bad_entry_naming_it(value, entry, why):
    with pytest.raises(InvalidArgumentError) as e:
        parse(value, 3)
    assert str(e.value) == f"invalid MPICOMM_TIMING={value!r} (rank 3): the entry {entry!r} {why}; {ALLOWED}"


# ------------------------------------------------------------------ jobs of their own
def _job(n, env, limit=90):
    p, _ = run_job(mpirun_argv(n, WORKER, "timing_env"), clean_mpi_env({"MPICOMM_TIMEOUT": "60", **env}), limit)
    out = {}
    for m in re.finditer(r"^RESULT rank=(\d+) (.*)$", p.stdout, re.M):
        out.setdefault(int(m.group(1)), []).append(m.group(2))
    return p, out


def _timing_of(lines):
    """The values a rank printed after init ({field: seconds})."""
    line = next(ln for ln in lines if ln.startswith("timing "))
    return json.loads(line[len("timing "):])


def test_each_rank_gets_the_values_of_its_own_variable():
    """Each rank's MPICOMM_TIMING (different fields and values on each rank) is on its
    TIMING after init; the fields it does not name keep the documented defaults."""
    n = 2
    rng = np.random.default_rng(341)
    env, want = {}, {}
    for r in range(n):
        picked = [FIELDS[i] for i in rng.permutation(len(FIELDS))[:4]]
        values = {k: round(float(v), 3) for k, v in zip(picked, rng.uniform(0.05, 9, 4))}
        env[f"TIMING_GOOD_{r}"] = ",".join(f"{k}={v}" for k, v in values.items())
        want[r] = {**dict(DOCUMENTED), **values}
    p, res = _job(n, env)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(n):
        assert _timing_of(res[r]) == want[r], (r, res[r])
        assert res[r][-1] == "after ok", res[r]


@pytest.mark.parametrize("value,entry,why", [
    ("bogus=1", "bogus=1", "names no field ('bogus')"),
    ("grace=soon", "grace=soon", "is no number of seconds ('soon')"),
    # (the valid entry before the bad one is not applied either: the values stay the defaults)
    ("grace=0.5,leave_wait=-2", "leave_wait=-2", "is below 0 ('-2')"),
])
def test_a_bad_value_raises_on_every_rank(value, entry, why):
    p, res = _job(2, {"TIMING_BAD": value})
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert res[r][0] == (f"raised InvalidArgumentError | invalid MPICOMM_TIMING={value!r} (rank {r}): "
                             f"the entry {entry!r} {why}; {ALLOWED}"), p.stdout + p.stderr
        assert _timing_of(res[r]) == dict(DOCUMENTED), res[r]   # the failed init left nothing behind
        assert res[r][-1] == "after ok", res[r]


def test_a_bad_value_on_one_rank_raises_on_every_rank():
    p, res = _job(3, {"TIMING_BAD": "refusal_wait=3,xhost_every=-0.5", "TIMING_BAD_RANK": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    mine = (f"invalid MPICOMM_TIMING='refusal_wait=3,xhost_every=-0.5' (rank 1): the entry 'xhost_every=-0.5' "
            f"is below 0 ('-0.5'); {ALLOWED}")
    assert res[1][0] == f"raised InvalidArgumentError | {mine}", p.stdout + p.stderr
    for r in (0, 2):
        assert res[r][0] == (f"raised InvalidArgumentError | {mine}; MPICOMM_TIMING is invalid on rank 1, "
                             f"not on rank {r}"), p.stdout + p.stderr
    for r in range(3):
        assert _timing_of(res[r]) == dict(DOCUMENTED), res[r]
        assert res[r][-1] == "after ok", res[r]
