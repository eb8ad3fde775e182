"""Who am I: rank, size and the launcher that started this process, read from its environment.

Each launcher announces ranks in its own variables: horovodrun (Gloo) sets HOROVOD_*, Open MPI's
mpirun sets OMPI_COMM_WORLD_*, MPICH/Hydra and Intel MPI set PMI_*, srun sets SLURM_* (and
PMI_*/PMIX_* with --mpi). Reading them needs no Horovod, so this works before hvd.init().
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from hvdkit import slurm
from hvdkit.system.launchers import READ_ORDER, SRUN

# Prefixes of the variables that say how a process was launched; shown by `hvdkit doctor`.
LAUNCH_PREFIXES = ("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_", "SLURM_")

# The variables that only a launcher's ranks carry, which tell a rank's process from others: not
# those that need another beside them (SLURM_PROCID, which a batch script and what it starts carry).
RANK_VARIABLES = tuple(told.rank for told in READ_ORDER if told.only_with is None)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str
    rank: Optional[int] = None
    size: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    node_rank: Optional[int] = None
    variables: dict = field(default_factory=dict)

    @property
    def spans_hosts(self) -> bool:
        """More ranks in the job than on this host: the job runs on several hosts."""
        return self.size is not None and self.local_size is not None and self.size > self.local_size

    def describe(self) -> str:
        if self.rank is None:
            return self.launcher
        parts = [f"rank {self.rank}"]
        if self.size is not None:
            parts[0] += f" of {self.size}"
        if self.local_rank is not None:
            local = f"local rank {self.local_rank}"
            if self.local_size is not None:
                local += f" of {self.local_size}"
            parts.append(local)
        if self.node_rank is not None:
            parts.append(f"node {self.node_rank}")
        return f"{self.launcher}: {', '.join(parts)}"


def _int(environ: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    value = environ.get(name) if name else None
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _srun_local_size(environ: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node, from SLURM_TASKS_PER_NODE ('2(x3),1') and SLURM_NODEID."""
    node = _int(environ, "SLURM_NODEID")
    try:
        counts = slurm.expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE")
                                             or environ.get("SLURM_TASKS_PER_NODE", ""))
    except slurm.SlurmFormatError:
        return None
    return counts[node] if node is not None and node < len(counts) else None


def detect(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """The launcher and this process's place in the job, from the environment alone."""
    variables = {k: v for k, v in sorted(environ.items()) if k.startswith(LAUNCH_PREFIXES)}
    for told in READ_ORDER:
        if told.rank not in environ or (told.only_with and told.only_with not in environ):
            continue
        local_size = _srun_local_size(environ) if told in SRUN.variables else _int(environ, told.local_size)
        return LaunchEnv(told.said_as, _int(environ, told.rank), _int(environ, told.size),
                         _int(environ, told.local_rank), local_size, _int(environ, told.node_rank), variables)
    if "SLURM_JOB_ID" in environ:
        return LaunchEnv("Slurm allocation, not inside an srun step", variables=variables)
    return LaunchEnv("none (a single process, not started by a launcher)", variables=variables)


def disagreement(launch: LaunchEnv, rank: int, size: int, local_rank: int) -> Optional[str]:
    """What is wrong when Horovod's view of the job differs from the launcher's, else None."""
    if launch.rank is None:
        return None
    if launch.size and launch.size > 1 and size == 1:
        fix = ("srun needs --mpi=pmix (or pmi2) for MPI to see the other tasks" if launch.launcher == SRUN.name
               else "Horovod's MPI is not the launcher's MPI; rebuild with the launcher's MPI on PATH")
        return (f"{launch.launcher} started {launch.size} processes, but Horovod sees a world of 1: "
                f"every process trains alone as rank 0. {fix}")
    if (launch.rank, launch.size) != (rank, size):
        return (f"{launch.launcher} says rank {launch.rank} of {launch.size}, "
                f"Horovod says rank {rank} of {size}")
    if launch.local_rank is not None and launch.local_rank != local_rank:
        return (f"{launch.launcher} says local rank {launch.local_rank}, Horovod says {local_rank}: "
                f"GPUs would be bound to the wrong ranks")
    return None
