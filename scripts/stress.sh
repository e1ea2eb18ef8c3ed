#!/usr/bin/env bash
# Runs the MPI tests N times in a row and says how many runs passed: a test that passes once
# is not a test that passes.
#   scripts/stress.sh N [TEST FILE...] [-- PYTEST ARGS...]
# Without GPUs: the MPI test files (all of tests/ by default, or the files named) under
# `mpirun -n 4` (MPICOMM_STRESS_RANKS), with one core kept busy by a spinning process the
# whole time (MPICOMM_STRESS_BUSY=0: none), N times.
# With GPUs (nvidia-smi lists some): the GPU test files with the host-array agreement, tag,
# reducer and bucket tests, in one `mpirun -n G` per run (G: every GPU, at most 4;
# CUDA_VISIBLE_DEVICES limits it), N times.
# Prints one line per run, then "passes: K of N", and for the first failed run the failures
# pytest printed on rank 0 and the end of every other rank's output. Exits 0 only when every
# run passed. Each run is limited to MPICOMM_STRESS_TIMEOUT seconds (default 900).
# Each rank prints a failure the moment it happens (MPICOMM_TEST_REPORT_NOW=1), so a rank whose
# job another rank aborted still says why; MPICOMM_STRESS_KEEP=DIR keeps every rank's whole
# output of the first failed run in DIR.
# Environment: as scripts/test.sh (.venv set up on a fresh machine; MPICOMM_NO_INSTALL=1 uses
# the current python3, e.g. on a GPU machine without a package registry).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/stress.sh N [TEST FILE...] [-- PYTEST ARGS...]}
shift
files=()
while [ "$#" -gt 0 ] && [ "$1" != -- ]; do files+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
extra=("$@")
source scripts/_env.sh
limit=${MPICOMM_STRESS_TIMEOUT:-900}
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L | wc -l)
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        gpus=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    fi
fi
busy_pid=
if [ "$gpus" -gt 0 ]; then
    ranks=$((gpus < 4 ? gpus : 4))
    if [ "${#files[@]}" = 0 ]; then
        files=(tests/test_gpu*.py tests/test_agreement.py tests/test_p2p_tags.py tests/test_fused_reducer.py
               tests/test_buckets.py)
    fi
    what="the GPU test files on $ranks GPUs"
    export NCCL_NVLS_ENABLE=0
    flags=(-x NCCL_NVLS_ENABLE -x PYTHONPATH -x PYTHONUNBUFFERED -x MPICOMM_TEST_REPORT_NOW)
else
    ranks=${MPICOMM_STRESS_RANKS:-4}
    [ "${#files[@]}" = 0 ] && files=(tests)
    what="the MPI tests at $ranks ranks"
    flags=()
    if [ "${MPICOMM_STRESS_BUSY:-1}" != 0 ]; then
        "$PY" -c "while True: pass" &
        busy_pid=$!
        what="$what, one core kept busy"
    fi
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/mpicomm-stress.XXXXXX")
trap '[ -n "$busy_pid" ] && kill "$busy_pid" 2>/dev/null; rm -rf "$work"' EXIT
export MPICOMM_TEST_REPORT_NOW=1
per_rank='r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
          exec "$@" --basetemp="$0/tmp.$r" > "$0/rank.$r.log" 2>&1'
echo "== stress: $what, $n runs (${files[*]})"
passes=0
first_fail=
for i in $(seq 1 "$n"); do
    d=$work/run$i
    mkdir -p "$d"
    t0=$SECONDS
    rc=0
    timeout -k 20 "$limit" "$MPIRUN" "${MPIRUN_FLAGS[@]}" "${flags[@]}" -n "$ranks" bash -c "$per_rank" "$d" \
        "$PY" -m pytest -q --color=no -p no:cacheprovider -rfE --with-mpi -m mpi "${extra[@]}" "${files[@]}" \
        >"$d/mpirun.log" 2>&1 || rc=$?
    counts=$(grep -aE '^=*[ ]*[0-9]+ [a-z]+.* in [0-9.]+s' "$d/rank.0.log" 2>/dev/null | tail -n 1 | sed -E 's/ in [0-9.]+s.*//; s/^=* *//' || true)
    if [ "$rc" = 0 ]; then
        passes=$((passes + 1))
        verdict="passed ($counts)"
        rm -rf "$d"
    else
        verdict="FAILED (exit $rc${counts:+: $counts})"
        [ "$rc" = 124 ] && verdict="FAILED (timed out after ${limit}s${counts:+: $counts})"
        [ -z "$first_fail" ] && first_fail=$d
        [ "$d" != "$first_fail" ] && rm -rf "$d"
    fi
    printf 'run %3d of %d: %s in %ss\n' "$i" "$n" "$verdict" "$((SECONDS - t0))"
done
echo "== passes: $passes of $n ($what)"
if [ -n "$first_fail" ]; then
    echo "== the first failed run (${first_fail##*/}):"
    if [ -n "${MPICOMM_STRESS_KEEP:-}" ]; then
        mkdir -p "$MPICOMM_STRESS_KEEP" && cp "$first_fail"/*.log "$MPICOMM_STRESS_KEEP"/
        echo "(every rank's whole output: $MPICOMM_STRESS_KEEP)"
    fi
    for f in "$first_fail"/rank.*.log; do   # each rank: pytest's failures, else those it printed
        if grep -aqE '^=+ (FAILURES|ERRORS) =+$' "$f"; then   # at once, else the end of its output
            echo "---- ${f##*/}: pytest's failures"
            sed -n '/^=\+ \(FAILURES\|ERRORS\) =\+$/,$p' "$f" | head -n 300
        elif grep -aq '^==== FAILED NOW' "$f"; then
            echo "---- ${f##*/}: its failures"
            sed -n '/^==== FAILED NOW/,$p' "$f" | head -n 200
        else
            echo "---- ${f##*/} (tail)"
            tail -n 60 "$f"
        fi
    done
    echo "---- mpirun (tail)"
    tail -n 30 "$first_fail/mpirun.log"
fi
[ "$passes" = "$n" ]
