#!/usr/bin/env bash
# Start a command on N ranks with horovodrun (Gloo or MPI as Horovod chooses; add --gloo or --mpi).
exec "$(dirname "${BASH_SOURCE[0]}")/_launch.sh" horovodrun "$@"
