"""The start-up watch of a multi-host job: which hosts have started their ranks.

mpicomm-run listens on a TCP port of the launching host; each rank's wrapper
(``python -m mpicomm.launch.rankwrap --report ADDR``) connects once as it starts and
sends its host name and rank, then runs the program. When not every rank has reported
within ``--launch-timeout`` seconds, mpicomm-run names the hosts none of whose ranks
started (their ssh never completed: a host that does not answer, a firewall dropping
packets) and ends mpirun's whole process group, the ssh processes included.

Each rank keeps its connection open until its process ends (the wrapper passes the socket
on to the program it execs), so the watch also sees every rank leave: where mpirun is still
there well after the last rank has gone (Open MPI 5's daemons can leave a job's end
unfinished after an MPI_Abort on two hosts at once), mpicomm-run ends it.
"""
from __future__ import annotations

import os
import selectors
import shlex
import shutil
import socket
import subprocess
import threading
import time

PROBE_S = 5   # ssh ConnectTimeout of the probe that names the hosts that do not answer


AGENT_VARIABLES = ("OMPI_MCA_plm_rsh_agent", "PRTE_MCA_plm_ssh_agent", "OMPI_MCA_plm_ssh_agent",
                   "PRTE_MCA_plm_rsh_agent")


def rsh_agent(env=None):
    """The command Open MPI starts remote daemons with, as a list: the first of
    AGENT_VARIABLES that is set (its first alternative where it lists several, "ssh : rsh",
    the first one found on PATH as Open MPI takes it), else ["ssh"]."""
    env = os.environ if env is None else env
    for var in AGENT_VARIABLES:
        value = env.get(var, "").strip()
        if not value:
            continue
        alternatives = [shlex.split(a) for a in value.split(":") if a.strip()]
        for words in alternatives:
            if os.sep in words[0] or shutil.which(words[0], path=env.get("PATH")):
                return words
        if alternatives:
            return alternatives[0]
    return ["ssh"]


def _route_address(hosts):
    """This host's address on the route to the first remote host (what its ranks reach)."""
    for name in hosts:
        try:
            ip = socket.getaddrinfo(name, 22, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((ip, 9))   # UDP: picks the route, sends nothing
                return s.getsockname()[0]
        except OSError:
            continue
    return socket.gethostbyname(socket.gethostname())


class StartupWatch:
    """Collects the ranks' start reports on a listening socket."""

    def __init__(self, remote_hosts, expected_hosts, nprocs):
        self.nprocs = nprocs
        self.expected = list(expected_hosts)   # the hosts that get ranks, in order
        self.started = {}                      # rank -> host name it reported
        self.exited = set()                    # ranks whose connection has closed
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(256)
        self._sock.settimeout(0.2)
        self.address = f"{_route_address(remote_hosts)}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mpicomm-run-startup", daemon=True)
        self._thread.start()

    def _serve(self):
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.2):
                if key.data is None:   # a new connection
                    try:
                        conn, _ = self._sock.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ, [b"", None])
                    continue
                conn, state = key.fileobj, key.data
                try:
                    chunk = conn.recv(512)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk and state[1] is None:   # the start line: "HOST RANK\n"
                    state[0] += chunk
                    if state[0].endswith(b"\n") or len(state[0]) >= 512:
                        parts = state[0].decode("utf-8", "replace").split()
                        if len(parts) == 2 and parts[1].isdigit():
                            state[1] = int(parts[1])
                            with self._lock:
                                self.started[state[1]] = parts[0]
                        else:
                            state[1] = -1
                    continue
                if chunk:
                    continue
                sel.unregister(conn)   # closed: the rank's process has ended
                conn.close()
                if state[1] is not None and state[1] >= 0:
                    with self._lock:
                        self.exited.add(state[1])
        for key in list(sel.get_map().values()):
            if key.fileobj is not self._sock:
                key.fileobj.close()
        sel.close()

    def all_started(self):
        with self._lock:
            return len(self.started) >= self.nprocs

    def all_exited(self):
        """Every rank reported its start and its process has ended since."""
        with self._lock:
            return len(self.exited) >= self.nprocs

    def wait(self, proc, timeout):
        """Wait until every rank has started, ``proc`` (mpirun) has ended, or ``timeout``
        seconds have passed; True unless the timeout passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.all_started() or proc.poll() is not None:
                return True
            time.sleep(0.1)
        return self.all_started() or proc.poll() is not None

    def missing_hosts(self):
        """The expected hosts from which no rank has reported (compared by short name)."""
        with self._lock:
            seen = {h.split(".")[0] for h in self.started.values()}
        return [h for h in self.expected if h.split(".")[0] not in seen]

    def probe(self, hosts, agent=None):
        """{host: why} for the ``hosts`` whose ``AGENT HOST true`` fails or does not answer
        within PROBE_S + 3 s (run in parallel). Open MPI starts no rank before every host's
        daemon is up, so the ranks' reports alone cannot tell which host held them up.
        ``agent``: the command Open MPI starts remote daemons with (default: rsh_agent())."""
        out = {}
        agent = list(agent) if agent else rsh_agent()
        name = " ".join(agent)
        ssh = os.path.basename(agent[0]) == "ssh"

        def one(h):
            opts = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={PROBE_S}"] if ssh else []
            argv = [*agent, *opts, h, "true"]
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_S + 3,
                                   stdin=subprocess.DEVNULL, errors="replace")
            except subprocess.TimeoutExpired:
                out[h] = f"`{name} {h} true` gave no answer within {PROBE_S + 3} s"
                return
            except OSError as e:
                out[h] = f"cannot run {name}: {e.strerror}"
                return
            if p.returncode != 0:
                last = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
                out[h] = f"`{name} {h} true`: {last}"

        threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PROBE_S + 5)
        return out

    def summary(self):
        with self._lock:
            by_host = {}
            for h in self.started.values():
                by_host[h] = by_host.get(h, 0) + 1
        started = ", ".join(f"{h} ({n})" for h, n in sorted(by_host.items())) or "none"
        return f"{len(self.started)} of {self.nprocs} ranks started; by host: {started}"

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._sock.close()
        except OSError:
            pass


def report(address, rank, host=None):
    """Tell mpicomm-run at ``address`` (host:port) that ``rank`` has started; never raises.
    Returns the connected socket, to be held open for as long as the rank's process lives
    (its closing tells mpicomm-run the rank has ended), or None where it could not connect."""
    host = host or socket.gethostname()
    ip, _, port = address.rpartition(":")
    try:
        s = socket.create_connection((ip, int(port)), timeout=10)
    except (OSError, ValueError):
        return None
    try:
        s.sendall(f"{host} {rank}\n".encode())
    except OSError:
        s.close()
        return None
    return s
