#!/usr/bin/env bash
# Host discovery for elastic Horovod: prints the hosts available now, one "host:slots" a line.
#   horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script launchers/discover_hosts.sh ...
# Hosts come from $HVDKIT_HOSTS_FILE (a hostfile in any format hvdkit reads; edit it to add
# or remove workers while the job runs), else from the Slurm allocation. An installed hvdkit
# puts the same on PATH as `hvdkit-discover-hosts`.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${HVDKIT_DISCOVER_HOSTS:-$(command -v hvdkit-discover-hosts || echo "$here/../.venv/bin/hvdkit-discover-hosts")}"
