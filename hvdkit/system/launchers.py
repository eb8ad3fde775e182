"""The launchers hvdkit starts ranks with and finds above them: one record each, the one place
their facts are kept. The launch side reads it to choose one (hvdkit.launch.planner), to pass it
a signal (hvdkit.launch.supervise) and to start a restart ahead (hvdkit.launch.cli); the rank
side to find its launcher among its ancestors (hvdkit.rank.liveness.orphan) and to read its
variables (hvdkit.env). Each launcher's command is built in hvdkit.launch.commands.

Adding a launcher: its record here and in LAUNCHERS, its command builder and plan
(hvdkit.launch.commands, hvdkit.launch.planner), its rank variables (hvdkit.env), and its golden
command (tests/launch/test_commands.py). No other module compares a launcher's name as a string
(tests/test_layout.py)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class RankVariables:
    """The variables in which a launcher tells each rank its place (None: not told); ``said_as``
    names the launcher in lines; ``only_with``: a variable without which these are no rank's (a
    batch script carries SLURM_PROCID too; only an srun step has ranks)."""
    said_as: str
    rank: str
    size: Optional[str] = None
    local_rank: Optional[str] = None
    local_size: Optional[str] = None
    node_rank: Optional[str] = None
    only_with: Optional[str] = None


@dataclass(frozen=True)
class Launcher:
    """A launcher's facts. ``name``: as --launcher takes it and as its program is named;
    ``programs``: the names its processes run as; ``daemons``: what it starts on each host, the
    ranks' parents; ``forwards_signals``: it passes a signal on to the ranks on every host;
    ``interrupt``: what to send it in place of a SIGINT; ``starts_ahead``: a restart's ranks may
    start while the attempt before still runs; ``gloo``, ``elastic``: whether it starts Gloo and
    elastic jobs; ``in_allocation``: it runs only inside a Slurm allocation; ``ends_its_ranks``:
    its ranks end when it goes, so a rank need not watch it (hvdkit.rank.liveness.orphan);
    ``install``: what to do where it is not on PATH; ``variables``: what its ranks are told
    (hvdkit.env)."""
    name: str
    programs: tuple[str, ...]
    install: str
    variables: tuple[RankVariables, ...]
    daemons: tuple[str, ...] = ()
    forwards_signals: bool = False
    interrupt: int = signal.SIGINT
    starts_ahead: bool = True
    gloo: bool = False
    elastic: bool = False
    in_allocation: bool = False
    ends_its_ranks: bool = False


HOROVODRUN = Launcher("horovodrun", ("horovodrun",), install="activate the environment where Horovod is installed",
                      variables=(RankVariables("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                                               "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK"),),
                      gloo=True, elastic=True)
MPIRUN = Launcher("mpirun", ("mpirun", "mpiexec", "orterun", "prterun"),
                  install="install Open MPI (apt-get install openmpi-bin) or `module load` an MPI",
                  variables=(RankVariables("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                           "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                             RankVariables("mpirun (MPICH/Hydra or Intel MPI)", "PMI_RANK", "PMI_SIZE",
                                           "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                             RankVariables("PMIx launcher", "PMIX_RANK")),
                  daemons=("orted", "prted", "hydra_pmi_proxy"), forwards_signals=True)
# srun shows its tasks' status on a single SIGINT instead of passing it on; a second step would wait
# for the allocation the running one holds, so no restart starts ahead of its attempt's end.
SRUN = Launcher("srun", ("srun",), install="srun runs only where Slurm is installed",
                variables=(RankVariables("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                         node_rank="SLURM_NODEID", only_with="SLURM_STEP_ID"),),
                forwards_signals=True, interrupt=signal.SIGTERM, starts_ahead=False, in_allocation=True,
                ends_its_ranks=True)
LAUNCHERS = (HOROVODRUN, MPIRUN, SRUN)
BY_NAME = {launcher.name: launcher for launcher in LAUNCHERS}
CHOICES = ("auto", *BY_NAME)  # --launcher's
# The order a rank reads them in, most specific first: mpirun inside a Slurm allocation carries
# SLURM_* too, so MPI's win; srun with --mpi=pmi2 sets PMI_* too, so Slurm's win over Hydra's.
READ_ORDER = (HOROVODRUN.variables[0], MPIRUN.variables[0], SRUN.variables[0], *MPIRUN.variables[1:])


def running_as(program: str) -> Optional[Launcher]:
    """The launcher a process named ``program`` belongs to (it, or one of its daemons), or None."""
    for launcher in LAUNCHERS:
        if program in launcher.programs or program in launcher.daemons:
            return launcher
    return None


def programs(among: Iterable[Launcher] = LAUNCHERS, daemons: bool = True) -> tuple[str, ...]:
    """The process names of the launchers ``among``, with their daemons unless ``daemons`` is False."""
    return tuple(name for launcher in among for name in (*launcher.programs, *(launcher.daemons if daemons else ())))
