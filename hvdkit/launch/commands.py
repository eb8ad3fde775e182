"""Launcher commands as data: each launcher's argument list, built once, by a small pure function
of a ``LaunchSpec``.

The flags for every MPI implementation are golden-tested without that MPI installed, and
`hvdkit launch --dry-run` prints exactly what would run; `hvdkit launch`, `doctor --selftest`
and the tests all run commands built here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from hvdkit.launch.hostfile import Host, LaunchError, host_list
from hvdkit.launch.network import Network
from hvdkit.system.launchers import HOROVODRUN, MPIRUN, SRUN

FORWARD_PREFIXES = ("NCCL_", "HOROVOD_", "HVDKIT_")  # HVDKIT_: config keys job scripts hand over
# OMP_NUM_THREADS: a rank reads it for torch's threads (hvdkit.rank.start.startup); without it a rank
# alone on another host would compute with more threads than the ranks here, and differently.
FORWARD_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "OMP_NUM_THREADS")


TCP_INCLUDE = ("btl_tcp_if_include", "oob_tcp_if_include")
TCP_CHOICE = (*TCP_INCLUDE, "btl_tcp_if_exclude", "oob_tcp_if_exclude")


def network_chosen(environ: Mapping[str, str], launcher_args: Sequence[str]) -> bool:
    """Whether the user already chose Open MPI's interfaces (variables or -mca flags)."""
    given = {launcher_args[i + 1] for i, arg in enumerate(launcher_args[:-1]) if arg in ("-mca", "--mca")}
    return bool(given & set(TCP_CHOICE)) or any(f"OMPI_MCA_{name}" in environ for name in TCP_CHOICE)


@dataclass
class LaunchSpec:
    np: int
    command: list
    hosts: Optional[list] = None  # None: this machine only (or srun's allocation)
    hostfile: Optional[str] = None  # passed to the launcher as a file; hosts holds what it lists
    controller: Optional[str] = None  # gloo, mpi or None (the launcher's default)
    forward: list = field(default_factory=list)  # names whose values pass through
    set_env: dict = field(default_factory=dict)  # NAME=VALUE to set in every rank
    oversubscribe: bool = False
    as_root: bool = False
    srun_mpi: str = "pmix"
    program: str = ""  # path of the launcher itself; its name by default
    launcher_args: list = field(default_factory=list)  # the user's own flags for the launcher, passed as given
    network: Optional[Network] = None  # the interface to pin MPI's traffic to, across hosts
    restarts: bool = False  # hvdkit launch --max-restarts: its line to the ranks ends them and passes stops


def elastic(launcher_args: Sequence[str]) -> bool:
    """horovodrun's elastic mode: its hosts come from a discovery script, and change."""
    return any(arg == "--host-discovery-script" or arg.startswith("--host-discovery-script=")
               for arg in launcher_args)


def horovodrun_command(spec: LaunchSpec) -> list[str]:
    """horovodrun forwards the environment itself; set_env is applied to its own environment.
    An elastic job's hosts are its discovery script's."""
    cmd = [spec.program or HOROVODRUN.name, "-np", str(spec.np)]
    if spec.hostfile:
        cmd += ["--hostfile", spec.hostfile]
    elif not elastic(spec.launcher_args):
        cmd += ["-H", host_list(spec.hosts or [Host("localhost", spec.np)])]
    if spec.controller:
        cmd.append(f"--{spec.controller}")
    return cmd + spec.launcher_args + list(spec.command)


def openmpi_command(spec: LaunchSpec) -> list[str]:
    cmd = [spec.program or MPIRUN.name, "-np", str(spec.np)]
    if spec.hostfile:
        cmd += ["--hostfile", spec.hostfile]
    elif spec.hosts:
        cmd += ["-H", host_list(spec.hosts)]
    for flag, value in (("bind-to", "none"), ("map-by", "slot")):  # unless the user's flags say otherwise
        if not {f"-{flag}", f"--{flag}"} & set(spec.launcher_args):
            cmd += [f"-{flag}", value]
    cmd.append("--tag-output")
    if spec.oversubscribe:
        cmd.append("--oversubscribe")
    if spec.as_root:
        cmd.append("--allow-run-as-root")
    for name in spec.forward:
        cmd += ["-x", name]
    for name, value in spec.set_env.items():
        cmd += ["-x", f"{name}={value}"]
    given = {spec.launcher_args[i + 1] for i, arg in enumerate(spec.launcher_args[:-1]) if arg in ("-mca", "--mca")}
    # The ranks left after one died are ended on hvdkit launch's line (hvdkit.launch.links), which
    # also passes them a stop: mpirun's pause before its SIGKILL, on every host, only delays the restart.
    kill_at_once = (("odls_base_sigkill_timeout", "0"),) if spec.restarts else ()
    for name, value in (("pml", "ob1"), ("btl", "^openib"), *kill_at_once):  # Open MPI refuses a parameter twice
        if name not in given:
            cmd += ["-mca", name, value]
    for name in TCP_INCLUDE if spec.network else ():
        cmd += ["-mca", name, spec.network.cidr]
    return cmd + spec.launcher_args + list(spec.command)


def hydra_command(spec: LaunchSpec) -> list[str]:
    """MPICH's Hydra: -hosts host:N and -genv/-genvlist."""
    cmd = [spec.program or MPIRUN.name, "-np", str(spec.np)]
    if spec.hostfile:
        cmd += ["-f", spec.hostfile]
    elif spec.hosts:
        cmd += ["-hosts", host_list(spec.hosts)]
    if spec.network:
        cmd += ["-iface", spec.network.interface]
    return cmd + _hydra_env(spec) + spec.launcher_args + list(spec.command)


def _hydra_env(spec: LaunchSpec) -> list[str]:
    """Hydra (MPICH, Intel MPI) forwards names with -genvlist and sets values with -genv."""
    args = ["-genvlist", ",".join(spec.forward)] if spec.forward else []
    for name, value in spec.set_env.items():
        args += ["-genv", name, value]
    return args


def intel_command(spec: LaunchSpec) -> list[str]:
    """Intel MPI (also Hydra), which takes plain host names and -ppn for ranks per host."""
    cmd = [spec.program or MPIRUN.name, "-n", str(spec.np)]
    if spec.hostfile:
        cmd += ["-machinefile", spec.hostfile]
    elif spec.hosts:
        slots = {h.slots for h in spec.hosts}
        if len(slots) != 1:
            raise LaunchError("Intel MPI: hosts with different slot counts need --hostfile (host:N lines)")
        cmd += ["-hosts", ",".join(h.name for h in spec.hosts), "-ppn", str(slots.pop())]
    return cmd + _hydra_env(spec) + spec.launcher_args + list(spec.command)


def srun_command(spec: LaunchSpec) -> list[str]:
    """srun exports the whole environment; set_env is added to --export. --kill-on-bad-exit
    ends every task when one fails, where srun would otherwise wait for the rest."""
    export = ",".join(["ALL", *(f"{k}={v}" for k, v in spec.set_env.items())])
    cmd = [spec.program or SRUN.name, f"--ntasks={spec.np}", f"--mpi={spec.srun_mpi}", "--kill-on-bad-exit=1",
           "--label", f"--export={export}"]
    if spec.hosts:
        cmd.append(f"--nodelist={','.join(h.name for h in spec.hosts)}")
    return cmd + spec.launcher_args + list(spec.command)


MPIRUN_BUILDERS = {"openmpi": openmpi_command, "mpich": hydra_command, "intel": intel_command}


def forwarded_names(environ: Mapping[str, str], extra: Sequence[str]) -> list[str]:
    """NCCL_*, HOROVOD_*, HVDKIT_*, PYTHONPATH, PATH, LD_LIBRARY_PATH where set, then the -x names."""
    names = [k for k in sorted(environ) if k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES]
    return names + [n for n in extra if n not in names]
