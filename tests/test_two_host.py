"""A real two-host job: 2 network namespaces x 2 slots, ranks started over ssh.

scripts/netns_cluster.sh makes node1 and node2 (own addresses, host names and sshd);
mpicomm-run is started on node1 with the hostfile naming both, so the ranks on node2
get nothing but what is forwarded through ssh. Needs root, iproute2, util-linux and
openssh-server; skipped, with the reason, where they are missing (failed under
MPICOMM_TEST_STRICT=1, as in CI).
"""
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from launch_support import (ROOT, clean_mpi_env, have_mpirun, launcher_failing_first, netns_lock, netns_refused,
                            require, run_cli, spawns_mpirun, world_size_from_env)

SCRIPT = os.path.join(ROOT, "scripts", "netns_cluster.sh")
STATE = "/run/mpicomm-netns-test"
NODES = ["node1", "node2"]


def _why_not():
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (uid {os.geteuid()})"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"),
                          ("nsenter", "util-linux"), ("ssh", "openssh-client"),
                          ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            return f"no '{tool}' (apt-get install -y {package})"
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        return "no sshd (apt-get install -y openssh-server)"
    if not have_mpirun():
        return "no mpirun on PATH"
    return netns_refused()


WHY_NOT = _why_not() if world_size_from_env() == 1 else None

RANK_SCRIPT = r'''
import json, os, socket, sys
import numpy as np
import mpicomm

mpicomm.init(backend="mpi")
rank, size = mpicomm.get_rank(), mpicomm.get_group_size()
x = np.arange(6, dtype=np.float64) * (rank + 1) + rank
total = mpicomm.all_reduce(x)
name = np.frombuffer(socket.gethostname().encode().ljust(64, b" "), dtype=np.uint8)
names = mpicomm.all_gather(name.reshape(1, 64))
env = np.frombuffer(
    (os.environ.get("MPICOMM_TWOHOST_AUTO", "-") + "|" + os.environ.get("TWOHOST_X", "-"))
    .encode().ljust(64, b" "), dtype=np.uint8)
envs = mpicomm.all_gather(env.reshape(1, 64))
local = np.array([mpicomm.get_local_size(), mpicomm.get_local_rank()], dtype=np.int64)
locals_ = mpicomm.all_gather(local.reshape(1, 2))
if rank == 0:
    print("RESULT " + json.dumps({
        "size": size, "sum": total.tolist(),
        "hosts": [bytes(r).decode().strip() for r in names],
        "envs": [bytes(r).decode().strip() for r in envs],
        "local": locals_.tolist()}), flush=True)
mpicomm.finalize()
'''


def _cluster(*args, timeout=120):
    env = dict(os.environ, MPICOMM_NETNS_STATE=STATE)
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _on_node1(argv, env, timeout):
    """Run argv on node1 (its network, host name and /etc), as a user logged in there."""
    env = dict(env, MPICOMM_NETNS_STATE=STATE)
    return subprocess.run(["bash", SCRIPT, "exec", "node1", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def cluster():
    """node1 and node2 (2 slots each) for one test; its hostfile. The namespaces' names are
    fixed and test_launch.py makes them too: netns_lock keeps the two apart when the serial
    tests run in several processes (scripts/test.sh)."""
    require(WHY_NOT)
    with netns_lock():
        yield from _cluster_up_down()


def _cluster_up_down():
    try:
        up = _cluster("up")
        assert up.returncode == 0, up.stderr
        hostfile = up.stdout.strip().splitlines()[-1]
        assert hostfile == f"{STATE}/hostfile"
        yield hostfile
    finally:
        down = _cluster("down")
        assert down.returncode == 0, down.stderr
        assert not os.path.exists(STATE)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=30).stdout
        assert "mpicomm-" not in listed


@spawns_mpirun
@pytest.mark.timeout(600)
def test_two_host_job(tmp_path, cluster):
    hostfile = cluster
    script = tmp_path / "two_host.py"
    script.write_text(RANK_SCRIPT)
    env = clean_mpi_env({"MPICOMM_TWOHOST_AUTO": "auto-7", "MPICOMM_TRACE_DIR": str(tmp_path)})
    logs = tmp_path / "logs"
    proc = _on_node1(run_cli("--hostfile", hostfile, "-n", "4", "--timeout", "240",
                             "-x", "TWOHOST_X=given", "--log-dir", str(logs), str(script)),
                     env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0][len("RESULT "):])

    assert result["size"] == 4
    expected = sum(np.arange(6, dtype=np.float64) * (r + 1) + r for r in range(4))
    assert result["sum"] == expected.tolist()
    # Slots fill in hostfile order: ranks 0, 1 on node1 and 2, 3 on node2.
    assert result["hosts"] == ["node1", "node1", "node2", "node2"]
    assert len(set(result["hosts"])) == 2 and socket.gethostname() not in result["hosts"]
    # Forwarded through ssh: node2's ranks never saw the launcher's environment.
    assert result["envs"] == ["auto-7|given"] * 4
    assert result["local"] == [[2, 0], [2, 1], [2, 0], [2, 1]]
    assert sorted(os.listdir(logs)) == [f"rank.{r}" for r in range(4)]

    doc = _on_node1(run_cli("--hostfile", hostfile, "-n", "4", "--timeout", "240",
                            "-m", "mpicomm.tools.doctor", "--json"), env, timeout=300)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    report = json.loads(doc.stdout[doc.stdout.index("{"):])
    assert [r["host"] for r in report["ranks"]] == ["node1", "node1", "node2", "node2"]
    assert [r["local_rank"] for r in report["ranks"]] == [0, 1, 0, 1]
    assert report["problems"] == []

    if importlib.util.find_spec("mpicomm.tools.smoke") is not None:
        smoke = _on_node1(run_cli("--hostfile", hostfile, "-n", "4", "--timeout", "400",
                                  "-m", "mpicomm.tools.smoke", "--quick"), env, timeout=450)
        assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]


CROSS_HOST = r'''
import os, sys, time
import numpy as np
import mpicomm

slow = sys.argv[2] == "slow"
if slow and os.environ.get("OMPI_COMM_WORLD_RANK") == "2":   # node2's first member compares
    os.environ["MPICOMM_TIMING"] = "xhost_every=4"   # across hosts only every 4 s (a busy host): rank 0
    #                                                  finds the difference first and must wait for
    #                                                  rank 2's description
mpicomm.init(backend="mpi")
r = mpicomm.get_rank()
x = np.random.default_rng(r).standard_normal(4).astype(np.float32)
mpicomm.all_reduce(x)
# node2's ranks (2, 3) pass the same bytes as int32: MPI sees nothing wrong, and each host's
# ranks agree with each other; only the comparison across hosts can see it
mpicomm.all_reduce(x.view(np.int32) if r >= 2 else x)
print(f"rank {r}: returned", flush=True)
for _ in range(int(sys.argv[1])):   # go on calling (0: leave at once)
    mpicomm.all_reduce(x)
    time.sleep(0.05 if slow else 0.01)
print(f"rank {r}: done", flush=True)
'''


@spawns_mpirun
@pytest.mark.timeout(600)
@pytest.mark.parametrize("calls_after,peer", [(500, "fast"), (0, "fast"), (300, "slow")])
def test_calls_that_differ_between_hosts_end_the_job(tmp_path, cluster, calls_after, peer):
    """Ranks on two hosts that agree within each host but not across (float32 on node1,
    int32 of the same bytes on node2): the watchdog's comparison across hosts tells every
    rank, which raises it at its next call (uncaught here: the job ends within seconds),
    naming both calls; also when the script leaves right after the call (the comparison at
    exit ends the job), and when the other host's watchdog finds the difference seconds
    later than rank 0's (its description of its call comes late: the report waits for it)."""
    script = tmp_path / "cross.py"
    script.write_text(CROSS_HOST)
    t0 = time.monotonic()
    proc = _on_node1(run_cli("--hostfile", cluster, "-n", "4", "--timeout", "120", str(script), str(calls_after), peer),
                     clean_mpi_env({"MPICOMM_TRACE_DIR": str(tmp_path)}), timeout=300)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    print(out)   # the whole job's output, shown where the test fails
    assert proc.returncode != 0, out
    reports = [ln for ln in out.splitlines() if "CollectiveMismatchError:" in ln and "two hosts" in ln]
    assert reports, out[-4000:]
    text = "\n".join(reports)
    assert "float32" in text and "int32" in text and "all_reduce sequence 2" in text, text
    assert "rank 3: done" not in out or calls_after == 0, out[-3000:]   # ended before 5 s of calls
    assert took < 100, (took, out[-8000:])


@spawns_mpirun
@pytest.mark.timeout(300)
def test_mpirun_left_running_after_every_rank_ended_is_ended(tmp_path, cluster):
    """Open MPI 5's daemons now and then leave a two-host job's end unfinished after an
    MPI_Abort on both hosts at once: every rank's process is gone, and mpirun waits on. Here
    an mpirun that waits on after its job (a wrapper around the real one, which sleeps once
    the real mpirun has returned) stands for it: mpicomm-run sees every rank's connection
    close and ends it 15 s later with exit status 1, saying so, instead of at --timeout."""
    real = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\n"
                    f'case "$1" in --version|-V) exec {real} "$@";; esac\n'
                    f'{real} "$@"\n'
                    'echo "fake mpirun: the job has ended, waiting on" >&2\n'
                    "sleep 600\n")
    fake.chmod(0o755)
    script = tmp_path / "ends.py"
    script.write_text("import mpicomm\nmpicomm.init(backend='mpi')\nr = mpicomm.get_rank()\n"
                      "print(f'rank {r}: sum {int(mpicomm.all_reduce(__import__(\"numpy\").arange(3) + r).sum())}', "
                      "flush=True)\nmpicomm.finalize()\n")
    proc = _on_node1(run_cli("--hostfile", cluster, "-n", "4", "--timeout", "240", "--mpirun", str(fake), str(script)),
                     clean_mpi_env(), timeout=280)
    out = proc.stdout + proc.stderr
    want = sum(3 * r + 3 for r in range(4))   # sum over ranks of arange(3) + r
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")) == \
        [f"rank {r}: sum {want}" for r in range(4)], out
    assert "fake mpirun: the job has ended, waiting on" in proc.stderr, out
    assert proc.returncode == 1, out
    assert "every rank's process has ended, but mpirun was still running 15 s after the last one" in proc.stderr, out
    assert "the job ran longer than --timeout" not in proc.stderr, out


@spawns_mpirun
@pytest.mark.timeout(300)
def test_launcher_start_failure_on_two_hosts_is_tried_again(tmp_path, cluster):
    """Open MPI 5's launcher failing on its own before starting any rank ("The PMIx server's
    listener thread failed to start"), in a job on two hosts: mpicomm-run starts it again
    with a new start-up watch (the wrappers report to the new one), and every rank runs once."""
    fake, count = launcher_failing_first(tmp_path, 1, "The PMIx server's listener thread failed to start. We cannot")
    script = tmp_path / "s.py"
    script.write_text("import socket\nfrom mpi4py import MPI\n"
                      f"open({str(tmp_path)!r} + '/ran.%d.' % MPI.COMM_WORLD.rank + socket.gethostname(), 'x').close()\n")
    proc = _on_node1(run_cli("--hostfile", cluster, "-n", "4", "--timeout", "240", "--mpirun", str(fake), str(script)),
                     clean_mpi_env(), timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert len(count.read_text().splitlines()) == 2, out
    assert "starting the job again, try 2 of 3" in proc.stderr, out
    assert sorted(p.name for p in tmp_path.glob("ran.*")) == \
        ["ran.0.node1", "ran.1.node1", "ran.2.node2", "ran.3.node2"], out


CAUGHT = r'''
import numpy as np
import mpicomm

mpicomm.init(backend="mpi")
r = mpicomm.get_rank()
rng = np.random.default_rng(r)
x = rng.standard_normal(6)
for case, who in (("refused", 1), ("refused again", 3)):
    try:   # an out= of the wrong shape on one rank only: the others wait inside the call
        mpicomm.all_reduce(x, out=np.empty(5) if r == who else None)
        print(f"rank {r}: {case}: returned", flush=True)
    except mpicomm.CollectiveMismatchError as e:
        print(f"rank {r}: {case}: CollectiveMismatchError", flush=True)
    except mpicomm.InvalidArgumentError as e:
        print(f"rank {r}: {case}: InvalidArgumentError", flush=True)
want = sum(np.random.default_rng(q).standard_normal(6) for q in range(4))
for i in range(300):   # the group goes on, and its histories agree again across the hosts
    got = mpicomm.all_reduce(x)
    assert np.allclose(got, want), (i, got, want)
print(f"rank {r}: went on", flush=True)
'''


@spawns_mpirun
@pytest.mark.timeout(600)
def test_refusals_do_not_end_a_two_host_job(tmp_path, cluster):
    """A call refused on one rank (node1's rank 1, then node2's rank 3) while the others wait
    inside it is raised on every rank of both hosts; the job goes on with right results, and
    the comparison across hosts does not take the refused calls for a difference between
    the hosts (every rank's history records them alike)."""
    script = tmp_path / "caught.py"
    script.write_text(CAUGHT)
    proc = _on_node1(run_cli("--hostfile", cluster, "-n", "4", "--timeout", "120", str(script)),
                     clean_mpi_env({"MPICOMM_TRACE_DIR": str(tmp_path)}), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(4):
        for case, who in (("refused", 1), ("refused again", 3)):
            want = "InvalidArgumentError" if r == who else "CollectiveMismatchError"
            assert f"rank {r}: {case}: {want}" in out, out[-4000:]
        assert f"rank {r}: went on" in out, out[-4000:]
    assert "two hosts" not in out, out[-4000:]


CROSS_CAUGHT = r"""
import sys, time
import numpy as np
import mpicomm

fast = sys.argv[1] == "history"   # (then MPICOMM_TIMING=xhost_every=8: the test's)
mpicomm.init(backend="mpi")
r = mpicomm.get_rank()
x = np.random.default_rng(r).standard_normal(5).astype(np.float32)
want = sum(np.random.default_rng(q).standard_normal(5).astype(np.float32) for q in range(4))
mpicomm.all_reduce(x)
mpicomm.all_reduce(x.view(np.int32) if r >= 2 else x)   # differs between the hosts only
t0 = time.monotonic()
i = 0
while True:
    i += 1
    try:
        got = mpicomm.all_reduce(x)
    except mpicomm.CollectiveMismatchError as e:
        print(f"rank {r}: raised in call {i + 2} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        break
    assert np.allclose(got, want, rtol=1e-5), (i, got, want)   # the later calls agree
    if time.monotonic() - t0 > 150:
        print(f"rank {r}: never raised ({i} calls)", flush=True)
        break
    if not fast:
        time.sleep(0.005)
for i in range(200):   # the group goes on, with right results
    got = mpicomm.all_reduce(x)
    assert np.allclose(got, want, rtol=1e-5), (i, got, want)
print(f"rank {r}: went on", flush=True)
"""

REPORTED = {   # the report each rank raises: a call named by the rings, or calls by the histories
    "rings": r"all_reduce sequence 2 on group 'world': the ranks on two hosts called differently: rank 0: all_reduce "
             r"of 5 x float32, op sum; rank 2: all_reduce of 5 x int32, op sum; differs in dtype",
    "history": r"calls 1 to \d+ on group 'world': the ranks on two hosts called differently in at least one of them",
}


@spawns_mpirun
@pytest.mark.timeout(600)
@pytest.mark.parametrize("found_by", ["rings", "history"])
def test_calls_that_differ_between_hosts_raise_on_every_rank_and_the_group_goes_on(tmp_path, cluster, found_by):
    """The same difference caught by the script: every rank of both hosts raises
    CollectiveMismatchError, after the same call of the group, within seconds of the first
    comparison, naming both calls (found in the rings of the last 256 calls) or the calls
    between two checkpoints of the histories (the call had left the rings); the group goes
    on with right results and the job ends with status 0."""
    script = tmp_path / "cross_caught.py"
    script.write_text(CROSS_CAUGHT)
    # history: comparisons across hosts 8 s apart (0.25 s by default), through mpicomm-run to every
    # rank of both hosts: call 2 has left the 256-call rings by then, as in a loop faster than the
    # comparisons (these namespaces take about 12 ms a call, 31 ms would still do)
    env = clean_mpi_env({"MPICOMM_TRACE_DIR": str(tmp_path),   # (a failed job's flight records there)
                         **({"MPICOMM_TIMING": "xhost_every=8"} if found_by == "history" else {})})
    job_timeout = 240
    proc = _on_node1(run_cli("--hostfile", cluster, "-n", "4", "--timeout", str(job_timeout), str(script), found_by),
                     env, timeout=job_timeout + 60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    raised = {}
    for r in range(4):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"rank {r}: raised in call ")), None)
        assert line is not None, out[-4000:]
        call, secs = re.match(rf"rank {r}: raised in call (\d+) after ([\d.]+) s: ", line).groups()
        raised[r] = int(call)
        # rings: within seconds of the first comparison; history: once the calls reach a checkpoint
        # of the histories that both hosts have passed and two rounds of the comparison have
        # seen (each round reads, then compares at the next: four 8 s rounds, then the call the
        # report names), before the job's timeout
        assert float(secs) < (10 if found_by == "rings" else job_timeout), line
        assert re.search(REPORTED[found_by], line), line
        assert f"rank {r}: went on" in out, out[-4000:]
    assert len(set(raised.values())) == 1, raised   # all after the same call: the counts stay alike
    if found_by == "history":
        assert min(raised.values()) > 258, raised   # (the first checkpoint is call 256)
