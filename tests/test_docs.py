"""Every command that README.md and docs/*.md show is run here, as written, on the CPU.

Commands are the lines of the documents' shell blocks whose first word is a program of
this project or of MPI (``mpirun``, ``mpicomm-*``, ``python``, ``scripts/...``), after an
optional ``$ `` prompt and ``VAR=value`` settings; ``[...]`` marks optional arguments and
runs without them. Each command is either run (and must exit 0) or excluded by a rule
below that says why (it needs GPUs, other hosts, or data that is not here); a command
that matches neither fails the test, so a new or renamed command in the docs is covered.

The commands run in a temporary folder holding README's ``hello.py``, in the environment
of a fresh user, root where the test runs as root: this Python's environment first on
PATH (what ``source .venv/bin/activate`` gives; ``mpicomm-run`` is there), this checkout
on PYTHONPATH (what installing it gives), ``MPICOMM_TIMEOUT=300`` (a hang fails within
the limit), and nothing that lets Open MPI run as root, oversubscribe the cores or skip
its UCX component. What a command needs beyond that must be in the document: an
``export`` line runs before the later commands of its block, as when a user pastes the
block. So a bare ``mpirun -n 2 ...`` left in a document fails here as it fails for a
user in a container; ``mpicomm-run`` adds what Open MPI needs.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PROGRAMS = ("mpirun", "mpicomm-run", "mpicomm-bench", "mpicomm-smoke", "mpicomm-doctor", "mpicomm-trace",
            "python", "python3", "scripts/", "source", "export")
LIMIT = 420  # seconds per command

# (pattern, reason): commands not run here, and why
EXCLUDED = [
    (r"^scripts/test\.sh", "the test suite itself: CI runs it"),
    (r"--backend nccl|--array cupy|gpu_suite|bench_ddp\.py --rounds 5|bench_capture\.py|profile_percall\.py --array"
     r"|capture_ddp\.py", "needs GPUs"),
    (r"--hostfile hosts", "needs other hosts"),
    (r"netns_cluster\.sh", "makes two hosts in network namespaces: needs openssh-server and iproute2 "
                           "(tests/test_two_host.py runs it where they are)"),
    (r"SLURM_NTASKS", "needs a Slurm allocation"),
    (r"^DATA_PATH=~/mnist", "needs the MNIST files"),
    (r"^scripts/smoke\.sh$", "the README's main job: .ci/run runs it as written, as its own stage after the "
                             "test command (test_smoke runs the smoke test at 1, 2 and 4 ranks here)"),
    (r"^mpicomm-run -n 4 mpicomm-smoke$", "the README's main job, scripts/smoke.sh (run by .ci/run as written), "
                                         "runs this smoke test over 4 ranks"),
]


def _commands():
    """[(file, line number, command, the block's environment lines before it)] of every document."""
    out = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if block.group(1) not in ("", "bash", "sh", "shell", "console"):
                continue
            first = text[:block.start(2)].count("\n") + 1
            lines = block.group(2).split("\n")
            before = []
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                cmd = _strip(line)
                if cmd:
                    out.append((doc, first + start, cmd, tuple(before)))
                    if _environment_line(cmd):
                        before.append(cmd)
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


def _environment_line(cmd):
    return cmd.split()[0] in ("source", "export")


COMMANDS = _commands()


def _excluded(cmd):
    for pattern, reason in EXCLUDED:
        if re.search(pattern, cmd):
            return reason
    return None


RUN = [(d, n, c, b) for d, n, c, b in COMMANDS if _excluded(c) is None and not _environment_line(c)]


def test_the_documents_show_the_quick_start_and_own_script_commands():
    cmds = [c for _, _, c, _ in COMMANDS]
    assert "scripts/smoke.sh" in cmds and "scripts/test.sh" in cmds
    assert "mpicomm-run -n 4 python hello.py" in cmds
    assert len(RUN) >= 12, RUN


def test_every_command_not_run_has_a_reason():
    """What is not run here is few and named: GPUs, other hosts, data that is not here."""
    skipped = [(d, n, c, _excluded(c)) for d, n, c, _ in COMMANDS if _excluded(c) is not None]
    assert all(reason for *_, reason in skipped)
    assert len(skipped) <= len(COMMANDS) // 2, skipped


def test_environment_lines_are_what_the_test_runs_with():
    """``source .venv/bin/activate`` is what the test's PATH gives; an ``export`` runs before
    the later commands of its block."""
    for doc, line, cmd, _ in COMMANDS:
        if not _environment_line(cmd):
            continue
        words = shlex.split(cmd)
        if words[0] == "source":
            assert words[1] == ".venv/bin/activate", f"{doc}:{line}: {cmd}"
        else:
            assert len(words) == 2 and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[1]), f"{doc}:{line}: {cmd}"


def test_the_environment_is_a_fresh_users():
    """Nothing in it lets Open MPI run as root or oversubscribe: a bare mpirun fails here as in a
    fresh container, and mpicomm-run, which adds what Open MPI needs, is on PATH."""
    env = _env()
    assert shutil.which("mpicomm-run", path=env["PATH"]), env["PATH"]
    assert not [k for k in env if k.startswith("OMPI_ALLOW_RUN_AS_ROOT") or k == "OMPI_MCA_osc"
                or (k.startswith(_MPI_PREFIXES) and "oversubscribe" in (k + env[k]).lower())]
    if os.geteuid() != 0:
        pytest.skip("not root: Open MPI's refusal of root cannot be shown")
    p = subprocess.run(["bash", "-c", "mpirun -n 1 python -c pass"], env=env, capture_output=True, text=True,
                       timeout=120, errors="replace")
    assert p.returncode != 0 and "as root" in p.stdout + p.stderr, (p.stdout, p.stderr)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"Save this as `hello.py`:\n\n```python\n(.*?)```", readme, re.S)
    assert m, "README.md shows hello.py"
    (d / "hello.py").write_text(m.group(1))
    return d


_MPI_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "MPI_LOCALRANKID")
_MACHINE_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_")   # the machine's MCA settings (e.g. plm=isolated)


def _env():
    """A fresh user's environment (root where the test runs as root): no inherited MPI job, the
    machine's own MCA settings kept, but not the ones a user would have to set for a bare
    ``mpirun`` (root allowed, oversubscription, no UCX osc), which the test suite itself sets."""
    env = {}
    for k, v in os.environ.items():
        if k.startswith(_MPI_PREFIXES) and not k.startswith(_MACHINE_PREFIXES):
            continue                       # a job's variables, or OMPI_ALLOW_RUN_AS_ROOT*
        if k == "OMPI_MCA_osc" or (k.startswith(_MPI_PREFIXES) and "oversubscribe" in (k + v).lower()):
            continue
        env[k] = v
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["MPICOMM_TIMEOUT"] = "300"
    # mpicomm-bench's trial run: the documented benchmark commands run as written, at sizes up
    # to 64 KiB and one round (what they measure is in BENCHMARKS.md; here: that they run)
    env["MPICOMM_BENCH_TRIAL"] = "1"
    return env


@pytest.mark.parametrize("doc,line,cmd,before", RUN, ids=[f"{d}:{n}" for d, n, _, _ in RUN])
def test_documented_command_runs(doc, line, cmd, before, workdir):
    """Run as written, after the export lines above it in its block: from the repository for
    scripts/ commands, else beside hello.py."""
    cwd = ROOT if "scripts/" in cmd else workdir
    script = "".join(b + "\n" for b in before if b.startswith("export ")) + cmd
    p = subprocess.run(["bash", "-c", script], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=LIMIT, errors="replace")
    assert p.returncode == 0, f"{doc}:{line}: {cmd}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


def test_ci_runs_the_readme_commands_word_for_word():
    """.ci/run runs both Quick start commands (the test suite, then the main job) exactly as the
    README writes them (no extra flags): what CI proves green is what a newcomer runs."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = [ln.split("#", 1)[0].strip() for ln in quick.splitlines() if ln.split("#", 1)[0].strip()]
    assert len(cmds) == 2, cmds   # the main job and the test suite, nothing else
    test_cmd = next(c for c in cmds if "test" in c)
    main_job = next(c for c in cmds if c != test_cmd)
    ci = [ln.strip() for ln in open(os.path.join(ROOT, ".ci", "run")) if ln.strip() and not ln.lstrip().startswith("#")]
    assert test_cmd in ci, (test_cmd, ci)
    assert main_job in ci, (main_job, ci)
    assert ci.index(test_cmd) < ci.index(main_job)
    # and before any other test stage: the README's command comes first
    assert ci.index(test_cmd) < min(i for i, ln in enumerate(ci) if "test.sh" in ln and ln != test_cmd)


# The documents as a newcomer reads them (issue 35): no clock times or session residue, every doc
# linked from the README, one way to install, BENCHMARKS.md a results page.

def _read(doc):
    return open(os.path.join(ROOT, doc), encoding="utf-8").read()


def test_no_clock_times_in_the_documents():
    """Dates say when a figure was measured; a time of day ("18:26 UTC", "(08:24)") is a session's
    residue. The same pattern as ``grep -E '[0-9]{2}:[0-9]{2}' docs/*.md README.md``."""
    found = [f"{doc}:{n}: {line.strip()}" for doc in DOCS
             for n, line in enumerate(_read(doc).splitlines(), 1) if re.search(r"[0-9]{2}:[0-9]{2}", line)]
    assert not found, "\n".join(found)


def test_no_session_residue_in_the_documents():
    """History belongs in commits: the documents say what works, how to run it and what it measured."""
    residue = re.compile(r"rows4|a third 4 x H200|the current code|the current defaults|we measured|not measured on 4 GPUs yet",
                         re.I)
    found = [f"{doc}:{n}: {line.strip()}" for doc in DOCS
             for n, line in enumerate(_read(doc).splitlines(), 1) if residue.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc,limit", [("docs/BENCHMARKS.md", 450), ("docs/RELIABILITY.md", 535)])
def test_document_length(doc, limit):
    """BENCHMARKS.md is a results page (each figure once, with machine, date and command), not a log."""
    n = len(_read(doc).splitlines())
    assert n <= limit, f"{doc} has {n} lines, more than {limit}"


def test_readme_links_every_doc_and_names_whom_it_is_for():
    readme = _read("README.md")
    for doc in DOCS[1:]:
        assert f"]({doc})" in readme or f"]({doc}#" in readme, f"README.md does not link {doc}"
    first_screen = readme.split("## Install", 1)[0]
    for name in ("MindSpore", "OneFlow", "Paddle", "PyTorch", "MPI"):
        assert name in first_screen, f"README's first screen does not name {name}"
    layout = readme.split("## Layout", 1)[1]
    line = next(ln for ln in layout.splitlines() if ln.startswith("docs/"))
    for doc in DOCS[1:]:
        assert os.path.basename(doc)[:-3] in line, f"README's layout leaves {doc} out: {line}"


def test_install_comes_first_and_once_from_the_source_tree():
    """Installation is explained before an example uses it, from the source tree; no document
    installs ``mpicomm[...]`` as if from a package index."""
    readme = _read("README.md")
    assert readme.index("## Install") < readme.index("## Quick start") < readme.index("hello.py")
    for doc in DOCS:
        assert not re.search(r"pip install ['\"]?mpicomm\[", _read(doc)), f"{doc}: pip install mpicomm[...]"
    extras = re.search(r"\[options\.extras_require\]\n(.*?)\n\[", open(os.path.join(ROOT, "setup.cfg")).read(), re.S)
    names = re.findall(r"^(\w+) =", extras.group(1), re.M)
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    for name in names:
        assert f"`{name}`" in install or f"[{name}]" in install, f"README's Install does not name the {name} extra"


def test_python_version_agrees_with_setup_cfg():
    required = re.search(r"python_requires\s*=\s*>=\s*([0-9.]+)", open(os.path.join(ROOT, "setup.cfg")).read()).group(1)
    assert f"Python >= {required}" in _read("README.md")


def test_readme_gpu_section_shows_the_per_rank_device_line():
    gpu = _read("README.md").split("## GPU notes", 1)[1].split("\n## ", 1)[0]
    assert "torch.cuda.set_device(mpicomm.get_local_rank())" in gpu
    assert "cupy.cuda.Device(mpicomm.get_local_rank()).use()" in gpu
