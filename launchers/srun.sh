#!/usr/bin/env bash
# Start a command on N ranks with srun (--mpi=pmix) inside a Slurm allocation (salloc or sbatch).
exec "$(dirname "${BASH_SOURCE[0]}")/_launch.sh" srun "$@"
