#!/usr/bin/env bash
# Start a command on N ranks with srun inside a Slurm allocation (salloc/sbatch), with --mpi=pmix.
# A thin wrapper over `hvdkit launch --launcher srun`: every option of hvdkit launch works here.
set -euo pipefail

usage() {
    echo "usage: launchers/srun.sh -np N [-H host1:4,host2:4 | --hostfile FILE] [-x VAR[=VAL]] [--dry-run] -- COMMAND ..." >&2
    echo "  e.g. launchers/srun.sh -np \$SLURM_NTASKS -- hvdkit train" >&2
}
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hvdkit=${HVDKIT:-$(command -v hvdkit || echo "$here/../.venv/bin/hvdkit")}
exec "$hvdkit" launch --launcher srun "$@"
