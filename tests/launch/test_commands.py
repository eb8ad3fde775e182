"""The launch line of each launcher and MPI implementation, golden: hvdkit.launch.commands builds
every command `hvdkit launch`, the sbatch templates and the benchmarks run."""

import pytest

from hvdkit.launch import commands
from hvdkit.launch.commands import LaunchSpec
from hvdkit.launch.hostfile import Host, LaunchError

WORKER = ["python", "train.py"]


def test_openmpi_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], forward=["NCCL_DEBUG", "PATH"],
                      set_env={"OMP_NUM_THREADS": "4"}, as_root=True)
    assert commands.openmpi_command(spec) == [
        "mpirun", "-np", "8", "-H", "h1:4,h2:4", "-bind-to", "none", "-map-by", "slot", "--tag-output",
        "--allow-run-as-root",
        "-x", "NCCL_DEBUG", "-x", "PATH", "-x", "OMP_NUM_THREADS=4",
        "-mca", "pml", "ob1", "-mca", "btl", "^openib", "python", "train.py"]


def test_openmpi_golden_hostfile_oversubscribed_not_root():
    spec = LaunchSpec(np=4, command=WORKER, hostfile="hosts.txt", hosts=[Host("h1", 2)], oversubscribe=True)
    assert commands.openmpi_command(spec) == [
        "mpirun", "-np", "4", "--hostfile", "hosts.txt", "-bind-to", "none", "-map-by", "slot", "--tag-output",
        "--oversubscribe", "-mca", "pml", "ob1", "-mca", "btl", "^openib", "python", "train.py"]


def test_launcher_flags_pass_through_after_hvdkit_defaults_they_replace():
    own = ["--bind-to", "core", "-mca", "btl", "tcp,self", "--report-bindings"]
    spec = LaunchSpec(np=2, command=WORKER, launcher_args=own)
    assert commands.openmpi_command(spec) == [
        "mpirun", "-np", "2", "-map-by", "slot", "--tag-output", "-mca", "pml", "ob1", *own, *WORKER]
    for builder in (commands.horovodrun_command, commands.hydra_command, commands.intel_command, commands.srun_command):
        assert builder(LaunchSpec(np=2, command=WORKER, launcher_args=["--x-flag", "v"]))[-4:] == [
            "--x-flag", "v", *WORKER]


def test_mpich_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], forward=["NCCL_DEBUG", "PATH"],
                      set_env={"OMP_NUM_THREADS": "4"}, as_root=True)
    assert commands.hydra_command(spec) == [
        "mpirun", "-np", "8", "-hosts", "h1:4,h2:4", "-genvlist", "NCCL_DEBUG,PATH",
        "-genv", "OMP_NUM_THREADS", "4", "python", "train.py"]


def test_intel_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], forward=["PATH"],
                      set_env={"I_MPI_DEBUG": "5"})
    assert commands.intel_command(spec) == [
        "mpirun", "-n", "8", "-hosts", "h1,h2", "-ppn", "4", "-genvlist", "PATH",
        "-genv", "I_MPI_DEBUG", "5", "python", "train.py"]
    with pytest.raises(LaunchError, match="different slot counts need --hostfile"):
        commands.intel_command(LaunchSpec(np=3, command=WORKER, hosts=[Host("h1", 2), Host("h2", 1)]))


def test_horovodrun_and_srun_golden():
    spec = LaunchSpec(np=8, command=WORKER, hosts=[Host("h1", 4), Host("h2", 4)], controller="gloo",
                      set_env={"NCCL_DEBUG": "INFO"})
    assert commands.horovodrun_command(spec) == ["horovodrun", "-np", "8", "-H", "h1:4,h2:4", "--gloo", *WORKER]
    assert commands.srun_command(spec) == ["srun", "--ntasks=8", "--mpi=pmix", "--kill-on-bad-exit=1", "--label",
                                         "--export=ALL,NCCL_DEBUG=INFO",
                                         "--nodelist=h1,h2", *WORKER]
