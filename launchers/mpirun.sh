#!/usr/bin/env bash
# Start a command on N ranks with mpirun, using the flags of the MPI found (Open MPI, MPICH, Intel MPI).
exec "$(dirname "${BASH_SOURCE[0]}")/_launch.sh" mpirun "$@"
