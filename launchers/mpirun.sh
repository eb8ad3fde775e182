#!/usr/bin/env bash
# Start a command on N ranks with mpirun with the flags of the MPI found (Open MPI, MPICH, Intel MPI).
# A thin wrapper over `hvdkit launch --launcher mpirun`: every option of hvdkit launch works here.
set -euo pipefail

usage() {
    echo "usage: launchers/mpirun.sh -np N [-H host1:4,host2:4 | --hostfile FILE] [-x VAR[=VAL]] [--dry-run] -- COMMAND ..." >&2
    echo "  e.g. launchers/mpirun.sh -np 8 --hostfile hosts.txt -- hvdkit train" >&2
}
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hvdkit=${HVDKIT:-$(command -v hvdkit || echo "$here/../.venv/bin/hvdkit")}
exec "$hvdkit" launch --launcher mpirun "$@"
