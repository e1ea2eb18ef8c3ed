#!/usr/bin/env bash
# The main job: the collective smoke test over N ranks (default 4), NCCL where each rank has a GPU of its own,
# MPI and NumPy otherwise. Sets up .venv on a fresh machine first.
#   scripts/smoke.sh            4 ranks, full
#   scripts/smoke.sh 2 --quick  N ranks, extra arguments go to mpicomm-smoke
set -euo pipefail
source "$(dirname "$0")/_env.sh"
n=${1:-4}
shift || true
# through mpicomm-run: it adds what this machine needs (root, oversubscribing a small one) and
# starts the job again where Open MPI's launcher failed on its own before starting any rank
exec "$PY" -m mpicomm.launch -n "$n" -m mpicomm.tools.smoke "$@"
