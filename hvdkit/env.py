"""Who am I: rank, size and the launcher that started this process, read from its environment.

Each launcher announces ranks in its own variables: horovodrun (Gloo) sets HOROVOD_*, Open MPI's
mpirun sets OMPI_COMM_WORLD_*, MPICH/Hydra and Intel MPI set PMI_*, srun sets SLURM_* (and
PMI_*/PMIX_* with --mpi). Reading them needs no Horovod, so this works before hvd.init().
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

# Prefixes of the variables that say how a process was launched; shown by `hvdkit doctor`.
LAUNCH_PREFIXES = ("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_", "SLURM_")

# (launcher, rank, size, local rank, local size) variables, most specific launcher first:
# mpirun inside a Slurm allocation also carries SLURM_*, so MPI's variables win.
_LAUNCHERS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
    ("mpirun (MPICH/Hydra or Intel MPI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIx launcher", "PMIX_RANK", None, None, None),
)


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str
    rank: Optional[int] = None
    size: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    variables: dict = field(default_factory=dict)

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
        return f"{self.launcher}: {', '.join(parts)}"


def _int(environ: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    value = environ.get(name) if name else None
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def detect(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """The launcher and this process's place in the job, from the environment alone."""
    variables = {k: v for k, v in sorted(environ.items()) if k.startswith(LAUNCH_PREFIXES)}
    for launcher, rank, size, local_rank, local_size in _LAUNCHERS:
        if rank not in environ:
            continue
        # SLURM_PROCID is set in batch scripts too; only a step (srun) has ranks.
        if launcher == "srun" and "SLURM_STEP_ID" not in environ:
            continue
        return LaunchEnv(launcher, _int(environ, rank), _int(environ, size),
                         _int(environ, local_rank), _int(environ, local_size), variables)
    if "SLURM_JOB_ID" in environ:
        return LaunchEnv("Slurm allocation, not inside an srun step", variables=variables)
    return LaunchEnv("none (a single process, not started by a launcher)", variables=variables)
