#!/usr/bin/env bash
# Shared body of launchers/{horovodrun,mpirun,srun}.sh: `hvdkit launch --launcher $1 ...`.
set -euo pipefail

launcher=$1
shift
declare -A example=(
    [horovodrun]='launchers/horovodrun.sh -np 8 -H host1:4,host2:4 -- hvdkit train --model resnet50'
    [mpirun]='launchers/mpirun.sh -np 8 --hostfile hosts.txt -- hvdkit train'
    [srun]='launchers/srun.sh -np $SLURM_NTASKS -- hvdkit train'
)
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    echo "usage: launchers/$launcher.sh -np N [-H host1:4,host2:4 | --hostfile FILE] [-x VAR[=VAL]] [--dry-run] -- COMMAND ..." >&2
    echo "  e.g. ${example[$launcher]}" >&2
    echo "  every option of 'hvdkit launch' works; see hvdkit launch --help" >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hvdkit=${HVDKIT:-$(command -v hvdkit || echo "$here/../.venv/bin/hvdkit")}
exec "$hvdkit" launch --launcher "$launcher" "$@"
