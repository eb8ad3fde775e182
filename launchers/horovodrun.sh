#!/usr/bin/env bash
# Start a command on N ranks with horovodrun (Gloo or MPI as Horovod chooses; add --gloo or --mpi).
# A thin wrapper over `hvdkit launch --launcher horovodrun`: every option of hvdkit launch works here.
set -euo pipefail

usage() {
    echo "usage: launchers/horovodrun.sh -np N [-H host1:4,host2:4 | --hostfile FILE] [-x VAR[=VAL]] [--dry-run] -- COMMAND ..." >&2
    echo "  e.g. launchers/horovodrun.sh -np 8 -H host1:4,host2:4 -- hvdkit train --model resnet50" >&2
}
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hvdkit=${HVDKIT:-$(command -v hvdkit || echo "$here/../.venv/bin/hvdkit")}
exec "$hvdkit" launch --launcher horovodrun "$@"
