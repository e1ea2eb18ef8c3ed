#!/usr/bin/env bash
# Two "hosts" on one Linux machine, for testing multi-host MPI jobs over ssh.
#
#   scripts/netns_cluster.sh up        make node1 and node2, print the hostfile path
#   scripts/netns_cluster.sh down      remove everything that "up" made (safe to repeat)
#   scripts/netns_cluster.sh status    show what is up and whether ssh works
#   scripts/netns_cluster.sh exec NODE CMD [ARGS...]
#                                      run CMD "on" NODE (its network, host name and /etc)
#
# Each node is a network namespace with its own address (10.77.0.1/24, 10.77.0.2/24 by
# default: a private range used only inside these namespaces), joined through a bridge
# that lives in a third namespace, so the machine's own network is never touched. Each
# node runs its own sshd in a UTS namespace whose host name is the node's name, so
# `hostname` and socket.gethostname() differ between ranks on node1 and node2. A fresh
# ed25519 key pair allows password-less root login between the nodes; host keys are
# pinned in a known_hosts file, so `ssh node2` works non-interactively from either node.
#
# Per-node files live in /etc/netns/<namespace>/ (`ip netns exec` and the sshd started
# from it see them as /etc/hosts and /etc/ssh), the rest in $MPICOMM_NETNS_STATE
# (default /run/mpicomm-netns). Needs root, iproute2, util-linux and openssh-server.
set -euo pipefail

STATE=${MPICOMM_NETNS_STATE:-/run/mpicomm-netns}
PREFIX=${MPICOMM_NETNS_PREFIX:-10.77.0}
SLOTS=${MPICOMM_NETNS_SLOTS:-2}
NODES=(node1 node2)
NS_PREFIX=mpicomm-
SWITCH_NS=${NS_PREFIX}switch
SSHD=${SSHD:-$(command -v sshd || echo /usr/sbin/sshd)}

die() { echo "netns_cluster.sh: $*" >&2; exit 1; }

node_ns() { echo "${NS_PREFIX}$1"; }
node_addr() { echo "${PREFIX}.$(( $2 + 1 ))"; }   # $1 name, $2 index (0-based)

sshd_pid() {
    # Prints the pid of NODE's sshd if it is running, else nothing.
    local pidfile="$STATE/sshd-$1.pid" pid
    [[ -r $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    if [[ -n $pid && -d /proc/$pid ]] && grep -q sshd "/proc/$pid/comm" 2>/dev/null; then
        echo "$pid"
    fi
}

check_requirements() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it creates network namespaces); uid is $(id -u)"
    command -v ip >/dev/null || die "'ip' not found: apt-get install -y iproute2"
    command -v unshare >/dev/null || die "'unshare' not found: apt-get install -y util-linux"
    command -v nsenter >/dev/null || die "'nsenter' not found: apt-get install -y util-linux"
    [[ -x $SSHD ]] || die "sshd not found (looked for $SSHD): apt-get install -y openssh-server"
    command -v ssh >/dev/null || die "'ssh' not found: apt-get install -y openssh-client"
    command -v ssh-keygen >/dev/null || die "'ssh-keygen' not found: apt-get install -y openssh-client"
}

cmd_down() {
    local node pid ns
    for node in "${NODES[@]}"; do
        pid=$(sshd_pid "$node")
        if [[ -n $pid ]]; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do [[ -d /proc/$pid ]] || break; sleep 0.1; done
            [[ -d /proc/$pid ]] && kill -9 "$pid" 2>/dev/null || true
        fi
    done
    for node in "${NODES[@]}"; do
        ns=$(node_ns "$node")
        # Processes still inside the namespace (ranks, prted) would keep it alive.
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    ip netns del "$SWITCH_NS" 2>/dev/null || true
    rmdir /etc/netns 2>/dev/null || true
    if [[ -f $STATE/created-run-sshd ]]; then rmdir /run/sshd 2>/dev/null || true; fi
    rm -rf "$STATE"
}

cmd_up() {
    check_requirements
    cmd_down
    trap 'echo "netns_cluster.sh: up failed; cleaning up" >&2; cmd_down' ERR
    mkdir -p "$STATE"
    chmod 700 "$STATE"
    if [[ ! -d /run/sshd ]]; then   # sshd's privilege-separation directory
        mkdir -p /run/sshd && chmod 755 /run/sshd && touch "$STATE/created-run-sshd"
    fi

    ssh-keygen -q -t ed25519 -N '' -C mpicomm-netns -f "$STATE/id_ed25519"

    ip netns add "$SWITCH_NS"
    ip -n "$SWITCH_NS" link add br0 type bridge
    ip -n "$SWITCH_NS" link set br0 up
    ip -n "$SWITCH_NS" link set lo up

    local i node ns addr hosts_lines="" known=""
    hosts_lines=$'127.0.0.1\tlocalhost\n'
    for i in "${!NODES[@]}"; do
        hosts_lines+="$(node_addr "${NODES[$i]}" "$i")"$'\t'"${NODES[$i]}"$'\n'
    done

    for i in "${!NODES[@]}"; do
        node=${NODES[$i]}; ns=$(node_ns "$node"); addr=$(node_addr "$node" "$i")
        ip netns add "$ns"
        ip -n "$SWITCH_NS" link add "veth-$node" type veth peer name eth0 netns "$ns"
        ip -n "$SWITCH_NS" link set "veth-$node" master br0 up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up

        # What the node sees as /etc/hosts and /etc/ssh (bind-mounted by `ip netns exec`).
        mkdir -p "/etc/netns/$ns/ssh"
        printf '%s' "$hosts_lines" > "/etc/netns/$ns/hosts"
        ssh-keygen -q -t ed25519 -N '' -C "$node" -f "/etc/netns/$ns/ssh/ssh_host_ed25519_key"
        cp "$STATE/id_ed25519.pub" "/etc/netns/$ns/ssh/authorized_keys"
        chmod 600 "/etc/netns/$ns/ssh/authorized_keys"
        known+="$node,$addr $(cut -d' ' -f1,2 "/etc/netns/$ns/ssh/ssh_host_ed25519_key.pub")"$'\n'
        cat > "/etc/netns/$ns/ssh/sshd_config" <<EOF
ListenAddress $addr
Port 22
HostKey /etc/ssh/ssh_host_ed25519_key
AuthorizedKeysFile /etc/ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
PidFile $STATE/sshd-$node.pid
MaxStartups 100:30:200
MaxSessions 100
EOF
        cat > "/etc/netns/$ns/ssh/ssh_config" <<EOF
Host ${NODES[*]}
    User root
    IdentityFile $STATE/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
EOF
    done
    printf '%s' "$known" > "$STATE/known_hosts"

    for node in "${NODES[@]}"; do
        ns=$(node_ns "$node")
        # sshd daemonizes inside a UTS namespace named after the node: everything it
        # starts (prted, the ranks) reports that host name.
        ip netns exec "$ns" unshare --uts -- sh -c \
            'hostname "$1" && exec "$2" -f /etc/ssh/sshd_config -E "$3"' \
            sh "$node" "$SSHD" "$STATE/sshd-$node.log"
    done
    for node in "${NODES[@]}"; do
        for _ in $(seq 50); do [[ -n $(sshd_pid "$node") ]] && break; sleep 0.1; done
        [[ -n $(sshd_pid "$node") ]] || die "sshd on $node did not start; see $STATE/sshd-$node.log"
    done

    {
        echo "# written by scripts/netns_cluster.sh: ${#NODES[@]} hosts x $SLOTS slots"
        for node in "${NODES[@]}"; do echo "$node slots=$SLOTS"; done
    } > "$STATE/hostfile"

    # Every node must reach every other one over ssh before we say "up".
    local from to out
    for from in "${NODES[@]}"; do
        for to in "${NODES[@]}"; do
            out=$(cmd_exec "$from" ssh "$to" hostname 2>&1) \
                || die "ssh from $from to $to failed: $out"
            [[ $out == "$to" ]] || die "ssh from $from to $to reached host '$out'"
        done
    done
    trap - ERR
    echo "$STATE/hostfile"
}

cmd_exec() {
    local node=$1; shift
    [[ $# -gt 0 ]] || die "exec: give a command to run, e.g. exec node1 hostname"
    local pid
    pid=$(sshd_pid "$node")
    [[ -n $pid ]] || die "exec: $node is not up (no sshd); run: $0 up"
    # The sshd's namespaces are the node: network, host name, and the /etc it sees.
    exec_wd=$PWD
    nsenter -t "$pid" -n -u -m --wd="$exec_wd" -- "$@"
}

cmd_status() {
    local node pid rc=0
    for node in "${NODES[@]}"; do
        pid=$(sshd_pid "$node")
        if [[ -z $pid ]]; then echo "$node: down"; rc=1; continue; fi
        if out=$(cmd_exec "$node" ssh "${NODES[0]}" hostname 2>&1); then
            echo "$node: up (sshd pid $pid, ssh to ${NODES[0]} ok: $out)"
        else
            echo "$node: sshd pid $pid, but ssh to ${NODES[0]} failed: $out"; rc=1
        fi
    done
    [[ -f $STATE/hostfile ]] && echo "hostfile: $STATE/hostfile"
    return $rc
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    exec)
        shift
        [[ $# -ge 1 ]] || die "exec: give a node (${NODES[*]}) and a command"
        [[ " ${NODES[*]} " == *" $1 "* ]] || die "exec: unknown node '$1' (known: ${NODES[*]})"
        cmd_exec "$@" ;;
    *) echo "usage: $0 up|down|status|exec NODE CMD [ARGS...]" >&2; exit 2 ;;
esac
