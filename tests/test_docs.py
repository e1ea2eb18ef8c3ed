"""Every command that README.md and docs/*.md show is run here, as written, on the CPU.

Commands are the lines of the documents' shell blocks whose first word is a program of
this project or of MPI (``mpirun``, ``mpicomm-*``, ``python``, ``scripts/...``), after an
optional ``$ `` prompt and ``VAR=value`` settings; ``[...]`` marks optional arguments and
runs without them. Each command is either run (and must exit 0) or excluded by a rule
below that says why (it needs GPUs, other hosts, or data that is not here); a command
that matches neither fails the test, so a new or renamed command in the docs is covered.

The commands run in a temporary folder holding README's ``hello.py``, with this Python's
environment first on PATH (what ``source .venv/bin/activate`` gives) and what the README
says a plain ``mpirun`` needs here: root allowed, more ranks than cores allowed,
``OMPI_MCA_osc=^ucx``.
"""
import glob
import os
import re
import shlex
import subprocess

import pytest

from conftest import ROOT, clean_mpi_env

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PROGRAMS = ("mpirun", "mpicomm-run", "mpicomm-bench", "mpicomm-smoke", "mpicomm-doctor", "mpicomm-trace",
            "python", "python3", "scripts/", "source", "export")
LIMIT = 420  # seconds per command

# (pattern, reason): commands not run here, and why
EXCLUDED = [
    (r"^scripts/test\.sh", "the test suite itself: CI runs it"),
    (r"--backend nccl|--array cupy|gpu_suite|bench_ddp\.py --rounds 5", "needs GPUs"),
    (r"--hostfile hosts|netns_cluster\.sh", "needs other hosts"),
    (r"SLURM_NTASKS", "needs a Slurm allocation"),
    (r"^DATA_PATH=~/mnist", "needs the MNIST files"),
]


def _commands():
    """[(file, line number, command)] of every document."""
    out = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if block.group(1) not in ("", "bash", "sh", "shell", "console"):
                continue
            first = text[:block.start(2)].count("\n") + 1
            lines = block.group(2).split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                cmd = _strip(line)
                if cmd:
                    out.append((doc, first + start, cmd))
    return out


def _strip(line):
    """The command of a document line, or None for output, file contents and comments."""
    s = line.strip()
    if s.startswith("$ "):
        s = s[2:]
    s = re.sub(r"\s+#\s.*$", "", s)          # a trailing comment
    s = re.sub(r"\s*\[[^\]]*\]", "", s)       # optional arguments
    words = s.split()
    k = 0
    while k < len(words) and re.match(r"^[A-Z_][A-Z0-9_]*=", words[k]):
        k += 1                                 # VAR=value settings
    if k == len(words):
        return None
    w = words[k]
    if w in PROGRAMS or (w.startswith("scripts/") and len(w) > len("scripts/")):
        return s
    return None


COMMANDS = _commands()


def _excluded(cmd):
    for pattern, reason in EXCLUDED:
        if re.search(pattern, cmd):
            return reason
    return None


def _environment_line(cmd):
    return cmd.split()[0] in ("source", "export")


RUN = [(d, n, c) for d, n, c in COMMANDS if _excluded(c) is None and not _environment_line(c)]


def test_the_documents_show_the_quick_start_and_own_script_commands():
    cmds = [c for _, _, c in COMMANDS]
    assert "scripts/smoke.sh" in cmds and "scripts/test.sh" in cmds
    assert "mpicomm-run -n 4 python hello.py" in cmds
    assert len(RUN) >= 12, RUN


def test_every_command_not_run_has_a_reason():
    """What is not run here is few and named: GPUs, other hosts, data that is not here."""
    skipped = [(d, n, c, _excluded(c)) for d, n, c in COMMANDS if _excluded(c) is not None]
    assert all(reason for *_, reason in skipped)
    assert len(skipped) <= len(COMMANDS) // 2, skipped


def test_environment_lines_are_what_the_test_runs_with():
    for doc, line, cmd in COMMANDS:
        if not _environment_line(cmd):
            continue
        words = shlex.split(cmd)
        if words[0] == "source":
            assert words[1] == ".venv/bin/activate", f"{doc}:{line}: {cmd}"
        else:
            k, _, v = words[1].partition("=")
            assert _env().get(k) == v, f"{doc}:{line}: {cmd}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"Save this as `hello.py`:\n\n```python\n(.*?)```", readme, re.S)
    assert m, "README.md shows hello.py"
    (d / "hello.py").write_text(m.group(1))
    return d


def _env():
    return clean_mpi_env({"OMPI_MCA_osc": "^ucx", "MPICOMM_TIMEOUT": "300"})


@pytest.mark.parametrize("doc,line,cmd", RUN, ids=[f"{d}:{n}" for d, n, _ in RUN])
def test_documented_command_runs(doc, line, cmd, workdir):
    """Run as written: from the repository for scripts/ commands, else beside hello.py."""
    cwd = ROOT if "scripts/" in cmd else workdir
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=LIMIT,
                       errors="replace")
    assert p.returncode == 0, f"{doc}:{line}: {cmd}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
