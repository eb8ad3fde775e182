"""What every benchmark prints beside its figures: versions, threads and the knobs that were set."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from typing import Optional

from hvdkit.launch.planner import local_slots

KNOB_PREFIXES = ("HOROVOD_", "NCCL_", "GLOO_", "OMPI_MCA_mpi_", "OMPI_MCA_btl", "OMPI_MCA_pml", "OMPI_MCA_coll",
                 "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def version_of(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def knobs(environ=os.environ) -> dict:
    """The Horovod, NCCL, Gloo, MPI and thread settings in force."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(KNOB_PREFIXES)}


def environment(**seen) -> dict:
    import torch

    facts = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
             "torchvision": version_of("torchvision"), "horovod": version_of("horovod"), "mpi4py": version_of("mpi4py"),
             "hvdkit": version_of("hvdkit"), "cpus": local_slots(), "torch_threads": torch.get_num_threads(),
             "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    return {**facts, **seen, "knobs": knobs()}


def print_environment(facts: dict) -> None:
    print("# environment")
    for key, value in facts.items():
        if key != "knobs":
            print(f"#   {key}: {value}")
    print("#   knobs: " + (" ".join(f"{k}={v}" for k, v in facts["knobs"].items()) or "(none set)"), flush=True)
