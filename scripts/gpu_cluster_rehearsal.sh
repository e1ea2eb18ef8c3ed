#!/usr/bin/env bash
# A two-host GPU job rehearsed on one machine: two "hosts" in network + UTS namespaces,
# each with its own host name, address and half of the GPUs, ranks started on the second
# host through Open MPI's rsh agent (no ssh, no `ip` needed), NCCL between the hosts over
# TCP sockets on a veth pair, as between two machines without InfiniBand.
#
#   scripts/gpu_cluster_rehearsal.sh [run]        up, every step below, down (logs in $OUT)
#   scripts/gpu_cluster_rehearsal.sh up           make the hosts; prints the hostfile path
#   scripts/gpu_cluster_rehearsal.sh exec HOST CMD [ARGS...]
#                                                 run CMD "on" HOST with the job's variables
#   scripts/gpu_cluster_rehearsal.sh down         remove everything "up" made (safe to repeat)
#
# The hosts: gpuhost1 (10.78.0.1) and gpuhost2 (10.78.0.2), each a process ("holder")
# that sleeps in its own network, UTS and mount namespaces (an /etc/hosts naming both;
# where no mount namespace can be made, the hostfile names them by address); a veth pair
# named mpc0 on both ends joins them (made through netlink by scripts/netns_link.py).
# mpicomm-run starts on gpuhost1 with the hostfile naming both; Open MPI starts the ranks
# on gpuhost2 through the agent $STATE/rsh_agent, which enters gpuhost2's namespaces with
# nsenter where ssh would log in. Each host sees its own GPUs only: the rank wrapper
# $STATE/host_gpus sets CUDA_VISIBLE_DEVICES from the host name (gpuhost1: the first
# half, gpuhost2: the second), as each machine of a real cluster sees its own GPUs; with
# no GPU, every step runs on the MPI backend instead (that is how it is tested on CPUs).
#
# NCCL tells hosts apart by a hash of the host name, so ranks on different hosts talk
# through its network transport (NET/Socket on mpc0), never through NVLink, PCIe P2P or
# shared memory; within a host NCCL may use NVLink as on one machine. Needs root, unshare
# and nsenter (util-linux), python3. Variables: OUT (logs, default ./out), PY (python3),
# MPICOMM_REHEARSAL_STATE (default /run/mpicomm-rehearsal), MPICOMM_REHEARSAL_PREFIX
# (10.78.0), QUICK=1 (smaller sizes everywhere), BUDGET_S (540: later steps are skipped),
# MPICOMM_REHEARSAL_GPU (auto: the GPU steps where 2 or more GPUs and CuPy are; 1 or 0 to choose),
# NGPU (how many GPUs to split between the hosts; which: CUDA_VISIBLE_DEVICES where set,
# else nvidia-smi's), MPICOMM_REHEARSAL_MOUNT=0 (no mount namespace),
# TCP_ITERS (200: round trips of the plain-TCP probe).
#
# Before the doctor's MPI/NCCL matrix, the run prints what decides the veth's speed (cores,
# CPU quota, MTU, offloads) and plain TCP between the hosts (scripts/tcp_probe.py): blocking,
# busy-polling, and busy-polling with both ends on one CPU. Every job is launched with
# --bind-to none: each host's Open MPI daemon would bind its first rank to core 0, the same
# core for both hosts on this one machine.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SELF=$ROOT/scripts/gpu_cluster_rehearsal.sh
STATE=${MPICOMM_REHEARSAL_STATE:-/run/mpicomm-rehearsal}
PREFIX=${MPICOMM_REHEARSAL_PREFIX:-10.78.0}
IFNAME=mpc0
HOSTS=(gpuhost1 gpuhost2)
PY=${PY:-python3}
# By path: the ranks' PATH is not this shell's (Debian's mpirun puts its own prefix, /usr/bin,
# first), and a bare python3 there can be another interpreter without mpi4py.
PY=$(command -v "$PY") || { echo "gpu_cluster_rehearsal.sh: PY=${PY}: no such interpreter" >&2; exit 1; }

die() { echo "gpu_cluster_rehearsal.sh: $*" >&2; exit 1; }

holder_pid() {  # the pid of HOST's holder if it is alive, else nothing
    local f="$STATE/$1.pid" pid
    [[ -r $f ]] || return 0
    pid=$(cat "$f")
    [[ -n $pid && -r /proc/$pid/ns/net ]] && [[ $(readlink "/proc/$pid/ns/net") != "$(readlink /proc/self/ns/net)" ]] \
        && echo "$pid"
}

cmd_down() {
    local host pid ns p
    for host in "${HOSTS[@]}"; do
        pid=$(holder_pid "$host")
        [[ -n $pid ]] || continue
        ns=$(readlink "/proc/$pid/ns/net")
        # Everything still inside the host (ranks, orted/prted) goes with it.
        for p in /proc/[0-9]*; do
            [[ $(readlink "$p/ns/net" 2>/dev/null) == "$ns" ]] && kill -9 "${p#/proc/}" 2>/dev/null
        done
    done
    rm -rf "$STATE"
    return 0
}

start_holders() {  # start_holders mount|plain: one holder per host; fails if any did not come up
    local mode=$1 host pid ok=0
    for host in "${HOSTS[@]}"; do
        pid=$(holder_pid "$host"); [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null
        # The holder keeps the namespaces alive: its host name is the host's, and (mount)
        # in its mount namespace /etc/hosts names both hosts; the machine's file is untouched.
        if [[ $mode == mount ]]; then
            unshare --net --uts --mount --propagation private -- sh -c \
                'mount --bind "$2" /etc/hosts && hostname "$1" && exec sleep infinity' sh "$host" "$STATE/hosts" \
                </dev/null >"$STATE/$host.holder.log" 2>&1 &
        else
            unshare --net --uts -- sh -c 'hostname "$1" && exec sleep infinity' sh "$host" \
                </dev/null >"$STATE/$host.holder.log" 2>&1 &
        fi
        echo $! >"$STATE/$host.pid"
        disown $!
    done
    for host in "${HOSTS[@]}"; do
        for _ in $(seq 50); do
            pid=$(holder_pid "$host")
            [[ -n $pid && $(nsenter -t "$pid" -u hostname 2>/dev/null) == "$host" ]] && break
            [[ -d /proc/$(cat "$STATE/$host.pid") ]] || break   # it died: the log says why
            sleep 0.1
        done
        pid=$(holder_pid "$host")
        if [[ -z $pid || $(nsenter -t "$pid" -u hostname 2>/dev/null) != "$host" ]]; then
            sed "s/^/    $host: /" "$STATE/$host.holder.log" >&2
            ok=1
        fi
    done
    if ((ok)); then
        for host in "${HOSTS[@]}"; do pid=$(holder_pid "$host"); [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null; done
    fi
    return $ok
}

gpu_list() {  # the GPUs to split, comma-separated: CUDA_VISIBLE_DEVICES where set, else nvidia-smi's
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        echo "${CUDA_VISIBLE_DEVICES// /}"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        local n; n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
        ((n > 0)) && seq -s, 0 $((n - 1))
    fi
    return 0
}

gpu_count() {
    local list; list=$(gpu_list)
    [[ -n $list ]] && echo "$list" | tr ',' '\n' | grep -c . || echo 0
}

host_half() {  # host_half 0|1 NGPU: the GPUs of gpuhost1 (0) or gpuhost2 (1), comma-separated
    local -a all
    IFS=, read -r -a all <<<"$(gpu_list)"
    ((${#all[@]} >= $2)) || all=($(seq 0 $(($2 - 1))))   # NGPU given without a list
    local half=$(($2 / 2))
    local IFS=,
    echo "${all[*]:$(($1 * half)):$half}"
}

cmd_up() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (it creates network namespaces); uid is $(id -u)"
    command -v unshare >/dev/null || die "'unshare' not found (util-linux)"
    command -v nsenter >/dev/null || die "'nsenter' not found (util-linux)"
    "$PY" -c 'import socket' 2>/dev/null || die "no Python at PY=$PY"
    cmd_down
    mkdir -p "$STATE" && chmod 700 "$STATE"
    local i host pid
    {
        printf '127.0.0.1\tlocalhost\n'
        for i in "${!HOSTS[@]}"; do printf '%s\t%s\n' "$PREFIX.$((i + 1))" "${HOSTS[$i]}"; done
    } >"$STATE/hosts"
    # Hosts with their own /etc/hosts (mount namespace) where the machine allows it, else
    # without: then the hostfile names the hosts by address.
    local mode=mount
    [[ ${MPICOMM_REHEARSAL_MOUNT:-1} == 0 ]] && mode=plain
    if ! start_holders "$mode"; then
        [[ $mode == mount ]] || { cmd_down; die "could not create the hosts' namespaces (unshare --net --uts)"; }
        echo "gpu_cluster_rehearsal.sh: no mount namespace with its own /etc/hosts here; the hostfile names the hosts by address" >&2
        mode=plain
        start_holders plain || { cmd_down; die "could not create the hosts' namespaces (unshare --net --uts)"; }
    fi
    local nsflags="-n -u"
    [[ $mode == mount ]] && nsflags="-n -u -m"
    echo "$nsflags" >"$STATE/nsflags"
    "$PY" scripts/netns_link.py veth "$IFNAME" "$(holder_pid "${HOSTS[0]}")" "$(holder_pid "${HOSTS[1]}")" \
        || { cmd_down; die "could not make the veth pair"; }
    for i in "${!HOSTS[@]}"; do
        nsenter -t "$(holder_pid "${HOSTS[$i]}")" -n -- "$PY" scripts/netns_link.py addr "$IFNAME" "$PREFIX.$((i + 1))/24" \
            || { cmd_down; die "could not give ${HOSTS[$i]} its address"; }
    done

    # Open MPI's rsh agent: "AGENT [options] HOST COMMAND..." runs COMMAND on HOST, as
    # ssh would (through a shell). Here: inside HOST's namespaces.
    cat >"$STATE/rsh_agent" <<EOF
#!/bin/bash
while [[ \${1:-} == -* ]]; do shift; done
host=\$1; shift
name=\$(awk -v h="\$host" '\$1 == h {print \$2}' "$STATE/hosts")   # an address: its host
pidfile="$STATE/\${name:-\$host}.pid"
[[ -r \$pidfile ]] || { echo "rsh_agent: unknown host '\$host' (no \$pidfile)" >&2; exit 255; }
# As ssh does, first reach the host over the network (from the caller's namespace): a host
# whose link is down fails here, as an unreachable machine would.
addr=\$(awk -v n="\${name:-\$host}" '\$2 == n {print \$1}' "$STATE/hosts")
"$PY" -c "import socket, sys
s = socket.socket(); s.settimeout(5)
try:
    s.connect(('\${addr:-\$host}', 9))
except ConnectionRefusedError:
    pass
except OSError as e:
    sys.exit('rsh_agent: connect to host \$host: ' + (e.strerror or 'timed out'))" || exit 255
exec nsenter -t "\$(cat "\$pidfile")" \$(cat "$STATE/nsflags") --wd="\$HOME" -- /bin/bash -c "\$*"
EOF
    # Each host sees its half of the GPUs, chosen by its host name.
    local ngpu half
    ngpu=${NGPU:-$(gpu_count)}
    half=$((ngpu / 2))
    {
        echo '#!/bin/bash'
        echo '# Rank wrapper: CUDA_VISIBLE_DEVICES of the host this rank runs on, then the command.'
        if ((${HIDE_GPUS:-0})); then
            echo 'export CUDA_VISIBLE_DEVICES=   # the MPI steps: no rank sees a GPU'
        elif ((half > 0)); then
            echo 'case $(hostname) in'
            echo "    ${HOSTS[0]}) export CUDA_VISIBLE_DEVICES=$(host_half 0 "$ngpu") ;;"
            echo "    ${HOSTS[1]}) export CUDA_VISIBLE_DEVICES=$(host_half 1 "$ngpu") ;;"
            echo 'esac'
        fi
        echo 'exec "$@"'
    } >"$STATE/host_gpus"
    chmod 755 "$STATE/rsh_agent" "$STATE/host_gpus"
    {
        local per=${PER_HOST:-2}
        echo "# written by scripts/gpu_cluster_rehearsal.sh: 2 hosts x $per ranks"
        for i in "${!HOSTS[@]}"; do
            if [[ $mode == mount ]]; then echo "${HOSTS[$i]} slots=$per"; else echo "$PREFIX.$((i + 1)) slots=$per"; fi
        done
    } >"$STATE/hostfile"
    # What every command on the hosts runs with (cmd_exec sources it).
    cat >"$STATE/env.sh" <<EOF
# Open MPI 4: start remote daemons through the agent (this overrides an OMPI_MCA_plm=isolated).
export OMPI_MCA_plm=rsh OMPI_MCA_plm_rsh_agent=$STATE/rsh_agent OMPI_MCA_plm_rsh_no_tree_spawn=1
# Open MPI 5 (PRRTE) names the same things plm ssh.
export PRTE_MCA_plm=ssh PRTE_MCA_plm_ssh_agent=$STATE/rsh_agent PRTE_MCA_plm_ssh_no_tree_spawn=1
# MPI between hosts over TCP on the veth, as between machines without InfiniBand.
export OMPI_MCA_pml=ob1 OMPI_MCA_btl_tcp_if_include=$IFNAME OMPI_MCA_oob_tcp_if_include=$IFNAME
export PRTE_MCA_oob_tcp_if_include=$IFNAME
# NCCL between hosts: TCP sockets on the veth; no InfiniBand, no multi-node NVLink, no NVLS.
export NCCL_SOCKET_IFNAME=$IFNAME NCCL_IB_DISABLE=1 NCCL_MNNVL_ENABLE=0 NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=\${NCCL_DEBUG:-WARN}   # NCCL's warnings go to the log
# A machine-wide setting of these would contradict the above or make the hosts one to NCCL.
unset OMPI_MCA_btl_tcp_if_exclude OMPI_MCA_oob_tcp_if_exclude PRTE_MCA_oob_tcp_if_exclude NCCL_HOSTID
# NVLink multicast stays off everywhere on shared GPU machines (NCCL above, PyTorch, NVSHMEM).
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 SHELL=/bin/bash
export PYTHONPATH=$ROOT\${PYTHONPATH:+:\$PYTHONPATH}
# Each host's GPUs come from host_gpus on that host; a value here would go to every rank.
unset CUDA_VISIBLE_DEVICES
EOF
    # Each host must reach the other before we say "up".
    local from to
    for from in 0 1; do
        to=$((1 - from))
        nsenter -t "$(holder_pid "${HOSTS[$from]}")" -n -- "$PY" -c "import socket, sys
s = socket.socket(); s.settimeout(5)
try:
    s.connect(('$PREFIX.$((to + 1))', 9))
except ConnectionRefusedError:
    pass  # the host answered: nothing listens on that port
except OSError as e:
    sys.exit(f'{e}')" || { cmd_down; die "${HOSTS[$from]} cannot reach ${HOSTS[$to]} at $PREFIX.$((to + 1))"; }
    done
    echo "$STATE/hostfile"
}

cmd_exec() {
    local host=$1; shift
    [[ $# -gt 0 ]] || die "exec: give a command, e.g. exec ${HOSTS[0]} hostname"
    local pid
    pid=$(holder_pid "$host")
    [[ -n $pid ]] || die "exec: $host is not up; run: $0 up"
    # shellcheck disable=SC2046
    nsenter -t "$pid" $(cat "$STATE/nsflags") --wd="$PWD" -- /bin/bash -c 'source "$1"; shift; exec "$@"' bash "$STATE/env.sh" "$@"
}

# ----------------------------------------------------------------------------- run
budget_limit() {  # budget_limit NAME LIMIT_S: the step's limit within what is left of BUDGET_S, or fail
    local left=$((BUDGET_S - SECONDS))
    if ((left < 20)); then
        printf '%-30s skipped: the run is at its %ss budget (BUDGET_S)\n' "$1" "$BUDGET_S" | tee -a "$SUM" >&2
        return 1
    fi
    echo $(($2 < left ? $2 : left))
}

step() {  # step NAME LIMIT_S CMD...: a line in the summary, everything in the log
    local name=$1 limit; limit=$(budget_limit "$1" "$2") || return 1; shift 2
    local t0=$SECONDS rc
    echo "======== $name (limit ${limit}s): $*" >>"$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    printf '%-30s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUM"
    return $rc
}

expect_failure() {  # expect_failure NAME LIMIT_S PATTERN CMD...: must fail; its message into the summary
    local name=$1 limit pattern=$3; limit=$(budget_limit "$1" "$2") || return 1; shift 3
    local t0=$SECONDS rc out
    out=$(mktemp)
    echo "======== $name (limit ${limit}s, expected to fail): $*" >>"$LOG"
    timeout -k 10 "$limit" "$@" >"$out" 2>&1
    rc=$?
    cat "$out" >>"$LOG"
    local note="(expected to fail)"
    ((rc)) || note="UNEXPECTED: it was expected to fail"
    printf '%-30s rc=%-3s %4ss %s\n' "$name" "$rc" "$((SECONDS - t0))" "$note" | tee -a "$SUM"
    grep -a -E -m 4 "$pattern" "$out" | cut -c1-300 | sed 's/^/    /' | tee -a "$SUM"
    rm -f "$out"
    [[ $rc != 0 ]]
}

tcp_probe() {  # plain TCP between the hosts: gpuhost1 -> gpuhost2 over the veth, into the summary
    local limit; limit=$(budget_limit "tcp-probe" 90) || return 1
    local t0=$SECONDS rc port=18517 out
    out=$(mktemp)
    echo "======== tcp-probe (limit ${limit}s)" >>"$LOG"
    cmd_exec "${HOSTS[1]}" "$PY" scripts/tcp_probe.py serve "$PREFIX.2" "$port" --timeout "$limit" >>"$LOG" 2>&1 &
    local server=$!
    # Blocking sockets, then busy-polling (as MPI and NCCL progress), then busy-polling with
    # both ends on the first CPU this machine lets us use (where Open MPI's default binding
    # would put both hosts' first rank).
    local cpu; cpu=$("$PY" -c 'import os; print(min(os.sched_getaffinity(0)))')
    timeout -k 5 "$limit" bash "$SELF" exec "${HOSTS[0]}" "$PY" scripts/tcp_probe.py client "$PREFIX.2" "$port" \
        --iters "${TCP_ITERS:-200}" --poll --pin "$cpu" >"$out" 2>&1
    rc=$?
    wait "$server" || ((rc)) || rc=1
    cat "$out" >>"$LOG"
    printf '%-30s rc=%-3s %4ss\n' "tcp-probe" "$rc" "$((SECONDS - t0))" | tee -a "$SUM"
    sed 's/^/    /' "$out" | tee -a "$SUM"
    rm -f "$out"
    return $rc
}

cmd_run() {
    OUT=${OUT:-$ROOT/out}
    BUDGET_S=${BUDGET_S:-540}   # steps that would start later are skipped (the lent machine's limit)
    export PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    LOG=$OUT/cluster_log.txt SUM=$OUT/cluster_summary.txt
    local res=$OUT/cluster_res
    mkdir -p "$res"
    : >"$LOG"; : >"$SUM"
    trap 'cmd_down' EXIT
    trap 'exit 130' INT TERM
    # Test plugins missing on the machine come as wheels in .whl/ (as in gpu_suite.sh).
    if ! "$PY" -c "import pytest_mpi, pytest_timeout" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            $(ls .whl/pytest_mpi-*.whl .whl/pytest_timeout-*.whl .whl/ml_dtypes-*.whl 2>/dev/null) >/dev/null 2>&1
        export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
    fi
    local ngpu; ngpu=${NGPU:-$(gpu_count)}
    {
        echo "date: $(date -u +%FT%TZ)  machine: $(nproc) cores, $ngpu GPU(s)"
        nvidia-smi -L 2>/dev/null
        "$PY" -c "import sys, mpi4py; from mpi4py import MPI
print('python', sys.version.split()[0], 'mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().replace(chr(0), '').splitlines()[0])
try:
    import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())
except Exception as e: print('no cupy/nccl:', type(e).__name__, e)"
    } >>"$SUM" 2>&1
    local gpu=0 backend=mpi
    case ${MPICOMM_REHEARSAL_GPU:-auto} in
        auto)
            if ((ngpu < 2)); then
                echo "GPU steps: need 2 GPUs or more (one per host), found $ngpu: running the MPI steps" | tee -a "$SUM"
            elif ! "$PY" -c "import cupy" 2>/dev/null; then
                echo "GPU steps: $ngpu GPUs but no CuPy for $PY: running the MPI steps" | tee -a "$SUM"
            else
                gpu=1
            fi ;;
        1) gpu=1 ;;
        0) gpu=0 ;;
        *) die "MPICOMM_REHEARSAL_GPU=${MPICOMM_REHEARSAL_GPU}: expected auto, 1 (GPU steps) or 0 (MPI steps)" ;;
    esac
    ((gpu)) && backend=nccl
    # Ranks per host: one per GPU of its half (2 GPUs: one per host; 8: four), else 2 (the
    # MPI steps). Fewer than 2 GPUs, or the MPI steps chosen: no rank sees a GPU.
    local hide=0 per=2
    ((!gpu && ngpu > 0)) && hide=1
    ((gpu)) && per=$((ngpu / 2))
    ((per >= 1)) || die "the GPU steps need 2 GPUs or more (NGPU=$ngpu)"
    local np=$((2 * per))
    local t_up=$SECONDS
    NGPU=$ngpu HIDE_GPUS=$hide PER_HOST=$per cmd_up >>"$LOG" 2>&1 || { echo "up failed; see $LOG" | tee -a "$SUM"; tail -5 "$LOG"; return 1; }
    echo "hosts up in $((SECONDS - t_up))s: ${HOSTS[0]} $PREFIX.1, ${HOSTS[1]} $PREFIX.2 (veth $IFNAME); GPUs: $(grep -o '[a-z0-9]*) export CUDA_VISIBLE_DEVICES=[0-9,]*' "$STATE/host_gpus" | tr '\n' ' ')$( ((hide)) && echo "none (hidden: the MPI steps)")" | tee -a "$SUM"

    # mpicomm-run on the first host, the hostfile naming both; every rank starts through
    # host_gpus (its host's GPUs), then Python under mpi4py (an exception ends the job).
    # --bind-to none: each host's Open MPI daemon takes itself for a whole machine and binds
    # its first rank to core 0 (at 2 ranks Open MPI binds to cores), so the two hosts' ranks
    # would share one core of this machine; busy-polling there, every message waits for the
    # scheduler (4 ms per 8-byte message measured; the probe below shows it with plain TCP).
    local -a RUN=(bash "$SELF" exec "${HOSTS[0]}" "$PY" -m mpicomm.launch --hostfile "$STATE/hostfile" -n "$np"
                  --bind-to none -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED)
    local -a PYR=("$STATE/host_gpus" "$PY" -m mpi4py)
    local -a PYT=(-m pytest -q -p no:cacheprovider --color=no --with-mpi -m mpi -x)
    local q=${QUICK:-0}

    # What decides the speed of the veth path, then plain TCP over it (no MPI, no NCCL), then
    # the doctor's MPI/NCCL matrix over the same pair: compare the cross-host rows.
    {
        echo "ranks: $np ($per per host), launched with --bind-to none; cores: $(nproc)"
        cmd_exec "${HOSTS[0]}" "$PY" scripts/tcp_probe.py facts "$IFNAME" 2>&1
    } | tee -a "$SUM"
    tcp_probe
    step "doctor-net" 150 "${RUN[@]}" --timeout 140 "${PYR[@]}" -m mpicomm.tools.doctor --net
    grep -a -A6 '^network: ' "$LOG" | grep -a -E '^(network|host a|gpuhost)' | tail -5 | tee -a "$SUM"
    if ((gpu)); then
        step "gpu-tests-np$np" 240 "${RUN[@]}" --timeout 230 "${PYR[@]}" "${PYT[@]}" tests/test_gpu.py
    else
        step "mpi-tests-np$np" 300 "${RUN[@]}" --timeout 290 "${PYR[@]}" "${PYT[@]}" tests/test_collectives.py
    fi
    step "train-np$np" 150 "${RUN[@]}" --timeout 140 "${PYR[@]}" scripts/train_data_parallel.py --min-accuracy 0.9
    local top=1G f=8 reps=(-w 2 --rounds 2)
    ((gpu)) || top=4M
    ((q)) && top=1M
    local c
    for c in all_reduce all_gather reduce_scatter broadcast; do
        step "bench-$c" 120 "${RUN[@]}" --timeout 110 "${PYR[@]}" -m mpicomm.tools.bench --backend "$backend" \
            --compare --coll "$c" -b 8 -e "$top" -f "$f" -n 0 --target-time 0.2 "${reps[@]}" --json "$res/bench_$c.json"
    done
    local bn=(-n 5 -w 2 --rounds 2)
    if ((!gpu)); then  # CPUs: the first 60 ResNet-50 tensors (5.6 MB), not all 102 MB
        head -n 60 mpicomm/tools/bench/data/resnet50_grad_shapes.txt >"$STATE/shapes_cpu.txt"
        bn=(-n 2 -w 1 --rounds 1 --shapes "$STATE/shapes_cpu.txt")
    fi
    step "bench-buckets" 150 "${RUN[@]}" --timeout 140 "${PYR[@]}" -m mpicomm.tools.bench --backend "$backend" \
        --compare --coll buckets "${bn[@]}" --json "$res/bench_buckets.json"

    # The whole smoke test after the benchmarks: where it is slow, it cannot crowd them out.
    if ((gpu)); then
        step "smoke-nccl-np$np" 150 "${RUN[@]}" --timeout 140 "${PYR[@]}" -m mpicomm.tools.smoke --backend nccl
    else
        step "smoke-mpi-np$np" 150 "${RUN[@]}" --timeout 140 "${PYR[@]}" -m mpicomm.tools.smoke --quick
    fi

    # The likely failures, on purpose, so that their messages are on record.
    if ((gpu)); then
        expect_failure "fail-wrong-ifname" 90 "NCCL WARN|NcclError|NCCL error|no socket interface|not every rank" "${RUN[@]}" --timeout 45 \
            -x NCCL_SOCKET_IFNAME=eth9 "${PYR[@]}" -m mpicomm.tools.smoke --backend nccl --quick --collectives all_reduce
        printf '#!/bin/bash\ncase $(hostname) in %s) export CUDA_VISIBLE_DEVICES= ;; *) export CUDA_VISIBLE_DEVICES=%s ;; esac\nexec "$@"\n' \
            "${HOSTS[1]}" "$(host_half 0 "$ngpu")" >"$STATE/host_gpus_none"
        chmod 755 "$STATE/host_gpus_none"
        expect_failure "fail-no-gpus-on-host2" 90 "PROBLEM" "${RUN[@]}" --timeout 45 \
            "$STATE/host_gpus_none" "$PY" -m mpi4py -m mpicomm.tools.doctor
        expect_failure "fail-no-gpus-nccl" 90 "BackendUnavailableError|sees none|rror:" "${RUN[@]}" --timeout 45 \
            "$STATE/host_gpus_none" "$PY" -m mpi4py -m mpicomm.tools.smoke --backend nccl --quick --collectives all_reduce
    else
        expect_failure "fail-wrong-btl-if" 90 "invalid value was given|Unknown interface|unable to reach each other|not every rank" "${RUN[@]}" --timeout 45 \
            -x OMPI_MCA_btl_tcp_if_include=eth9 "${PYR[@]}" -m mpicomm.tools.smoke --quick --collectives all_reduce
    fi
    cmd_exec "${HOSTS[1]}" "$PY" scripts/netns_link.py down "$IFNAME"
    expect_failure "fail-host2-unreachable" 100 "failed to report back|Remote host|unable to reliably start|did not start|not every rank|ran longer" "${RUN[@]}" --timeout 60 \
        --launch-timeout 20 "${PYR[@]}" -m mpicomm.tools.doctor
    cmd_exec "${HOSTS[1]}" "$PY" scripts/netns_link.py up "$IFNAME"

    tar -czf "$OUT/cluster_results.tgz" -C "$OUT" cluster_res && rm -rf "$res"
    local failed
    failed=$(grep -a -v '(expected to fail)' "$SUM" | grep -a -c 'rc=[1-9]\|skipped: the run\|UNEXPECTED')
    echo "done in ${SECONDS}s: $failed step(s) failed; summary $SUM, log $LOG, JSON in $OUT/cluster_results.tgz" | tee -a "$SUM"
    [[ $failed == 0 ]]
}

# All code is in functions, read before any of it runs: editing this file while it runs
# cannot change the run.
main() {
    case ${1:-run} in
        up) cmd_up ;;
        down) cmd_down ;;
        exec)
            shift
            [[ $# -ge 1 ]] || die "exec: give a host (${HOSTS[*]}) and a command"
            [[ " ${HOSTS[*]} " == *" $1 "* ]] || die "exec: unknown host '$1' (known: ${HOSTS[*]})"
            cmd_exec "$@" ;;
        run) cmd_run ;;
        *) echo "usage: $0 [run|up|down|exec HOST CMD [ARGS...]]" >&2; exit 2 ;;
    esac
}

main "$@"; exit $?
