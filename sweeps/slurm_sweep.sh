#!/usr/bin/env bash
# Run a sweep of sweeps/ on a Slurm cluster: this job is the sweep's driver (a small CPU job that
# validates every point, then submits the points as one Slurm array through the submitit launcher,
# conf/hydra/launcher/slurm.yaml, and waits for them). From the repository root:
#   PARTITION=gpu sbatch sweeps/slurm_sweep.sh <sweep name> [overrides...]
#   PARTITION=gpu sbatch sweeps/slurm_sweep.sh clip_higher seed=0,1 hydra.launcher.account=my-account
# The sweep folder is results/multirun/<sweep name> (SWEEP_DIR=... to change it), the same for every
# launch, so submitting again after a failure or a time-out runs only the points that did not finish.
#SBATCH --job-name=rlbench-sweep
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=3-00:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail
sweep=${1:?usage: PARTITION=<partition> sbatch sweeps/slurm_sweep.sh <sweep name> [overrides...]}
shift
exec rlbench -m "sweep=$sweep" hydra/launcher=slurm "hydra.launcher.partition=${PARTITION:?set PARTITION to the cluster partition}" \
  "hydra.sweep.dir=${SWEEP_DIR:-results/multirun/$sweep}" "$@"
