"""scripts/slurm_job.sh, the Slurm batch script: its syntax, its #SBATCH lines, that what
it runs is in the package, and that it runs as sbatch runs it (on the allocation's first
host, here with a one-host allocation of this machine in the environment)."""
import configparser
import os
import re
import shutil
import socket
import subprocess

import pytest

from launch_support import ROOT, clean_mpi_env, spawns_mpirun

JOB = os.path.join(ROOT, "scripts", "slurm_job.sh")


def _text():
    return open(JOB, encoding="utf-8").read()


def test_syntax_and_shebang():
    assert _text().startswith("#!/bin/bash\n")
    assert os.access(JOB, os.X_OK)
    p = subprocess.run(["bash", "-n", JOB], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


def test_sbatch_lines_come_first_and_are_sbatch_options():
    lines = _text().splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    sbatch = [ln for ln in lines if ln.startswith("#SBATCH")]
    # sbatch stops reading #SBATCH lines at the first command
    assert sbatch and all(lines.index(ln) < first_command for ln in sbatch)
    known = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output"}
    opts = dict(re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", ln).groups() for ln in sbatch)
    assert set(opts) <= known, opts
    assert int(opts["nodes"]) >= 1 and int(opts["ntasks-per-node"]) >= 1
    assert int(opts["gpus-per-node"]) == int(opts["ntasks-per-node"])   # one rank per GPU


def test_what_it_runs_is_in_the_package():
    text = _text()
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    scripts = cfg["options.entry_points"]["console_scripts"]
    assert "mpicomm-run = " in scripts
    assert 'mpicomm-run -n "$SLURM_NTASKS" python -m mpicomm.tools.doctor' in text
    assert os.path.exists(os.path.join(ROOT, "mpicomm", "tools", "doctor.py"))
    default = re.search(r"script=\$\{1:-(\S+)\}", text).group(1)
    assert os.path.exists(os.path.join(ROOT, default)), default


@spawns_mpirun
@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_runs_as_sbatch_would_in_a_one_host_allocation(tmp_path):
    host = socket.gethostname()
    env = clean_mpi_env({"SLURM_JOB_NODELIST": host, "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS": "2",
                         "SLURM_SUBMIT_DIR": ROOT, "MPICOMM_BACKEND": "mpi"})
    p = subprocess.run(["bash", JOB, "scripts/port_mindspore.py", "--epochs", "1"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout + p.stderr   # (mpicomm-run says where the hosts came from on stderr)
    assert out.count(f"hosts from the Slurm allocation (SLURM_JOB_NODELIST={host}, SLURM_TASKS_PER_NODE=2)") == 2
    assert "mpicomm-doctor: 2 rank(s) on 1 host(s)" in out and "ok: no problems found" in out
    assert "mpicomm mpi, 2 rank(s)" in out and "epoch: 0, step: 0, loss is " in out
