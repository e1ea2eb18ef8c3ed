#!/usr/bin/env bash
# The per-call cost at the smallest sizes: mpicomm-bench --compare for all_reduce,
# all_gather, reduce_scatter and broadcast, one element of float32 per rank (8 bytes for
# all_reduce and broadcast, as nccl-tests' smallest row), median of interleaved rounds.
#   scripts/bench_small.sh NRANKS [BACKEND] [ITERS]
# Prints one "added per call" line per collective (mpicomm minus raw, same run).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2}
backend=${2:-mpi}
iters=${3:-20000}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MPIRUN=${MPIRUN:-mpirun}
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
for c in all_reduce all_gather reduce_scatter broadcast; do
    case $c in all_gather|reduce_scatter) size=$((4 * n)) ;; *) size=8 ;; esac
    line=$("$MPIRUN" "${extra[@]}" --oversubscribe -n "$n" python -m mpicomm.tools.bench --backend "$backend" \
        --coll "$c" -b "$size" -e "$size" -n "$iters" -w $((iters / 20)) --rounds 10 --stat median --compare \
        2>&1 | grep -a "added per call" || true)
    printf '%-15s %s ranks  %s\n' "$c" "$n" "${line:-FAILED}"
done
