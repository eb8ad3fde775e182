"""The job as Kubernetes runs it: a Kubeflow MPIJob (kubeflow.org/v2beta1) for hvdkit's image.

The MPI operator starts the workers (each runs sshd as the non-root user and waits), writes the
hostfile to /etc/mpi/hostfile (``worker-i.svc slots=N``), mounts the keys it generated at
``sshAuthMountPath`` and, once every worker is ready (``launcherCreationPolicy``), starts the
launcher, which runs mpirun over ssh into the workers. The launcher's and workers' commands are
built once (hvdkit.container.pods): the multi-container job on this machine (hvdkit.container.podjob)
runs the same.

    hvdkit mpijob --workers 2 --gpus-per-worker 8 --image REGISTRY/hvdkit:0.1.0-cuda13 \\
        --claim checkpoints -- hvdkit train --model resnet50 > job.yaml
    kubectl apply -f job.yaml

Deleting a pod sends SIGTERM and, after the grace period, SIGKILL: the grace period given here is
longer than a checkpoint takes, so a preempted or deleted launcher leaves its step saved on the
claim, and the restarted launcher (``restartPolicy: OnFailure``) resumes from it.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from hvdkit import job
from hvdkit.args import OneLineParser
from hvdkit.container.pods import (
    DEFAULT_GRACE,
    SSH_AUTH,
    SSH_PORT,
    USER_ID,
    WORKSPACE,
    launcher_command,
    run_env,
    worker_command,
)

API_VERSION = "kubeflow.org/v2beta1"
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")


class RenderError(ValueError):
    """A bad argument to the renderer: one line."""


def render(*, name: str, image: str, workers: int, command: Sequence[str], slots_per_worker: int = 1,
           gpus_per_worker: int = 0, claim: Optional[str] = None, grace: int = DEFAULT_GRACE,
           backoff_limit: int = 3) -> dict:
    """The MPIJob as a dict (yaml.safe_dump writes the manifest)."""
    if not NAME_RE.match(name):
        raise RenderError(f"--name {name!r}: lower-case letters, digits and '-', starting with a letter, at most 40 "
                          f"(the pods' host names are built from it)")
    if workers < 1:
        raise RenderError(f"--workers {workers}: an MPIJob needs at least 1 worker")
    if slots_per_worker < 1:
        raise RenderError(f"--slots-per-worker {slots_per_worker}: at least 1")
    if gpus_per_worker < 0:
        raise RenderError(f"--gpus-per-worker {gpus_per_worker}: 0 or more")
    if gpus_per_worker and slots_per_worker != gpus_per_worker:
        raise RenderError(f"--slots-per-worker {slots_per_worker} with --gpus-per-worker {gpus_per_worker}: "
                          f"one rank per GPU, so they must be equal")
    if grace < 1:
        raise RenderError(f"--grace {grace}: seconds, at least 1")
    if not command:
        raise RenderError("no command after '--': what each rank runs, e.g. -- hvdkit train")
    if not image:
        raise RenderError("--image is required: the image every pod runs")

    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL and Open MPI's shared memory
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if claim:
        volumes.append({"name": "workspace", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "workspace", "mountPath": WORKSPACE})
    security = {"runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID, "runAsNonRoot": True}

    def pod(container: dict) -> dict:
        return {"spec": {"securityContext": security, "terminationGracePeriodSeconds": grace,
                         "containers": [{"name": container["name"], "image": image, "imagePullPolicy": "IfNotPresent",
                                         "workingDir": WORKSPACE, "volumeMounts": mounts, **container}],
                         "volumes": volumes}}

    env = [{"name": key, "value": value} for key, value in run_env(name).items()]
    worker = {"name": "worker", "command": worker_command(), "ports": [{"containerPort": SSH_PORT, "name": "ssh"}]}
    if gpus_per_worker:
        worker["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_worker}}
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {"name": name},
        "spec": {
            "slotsPerWorker": slots_per_worker,
            "launcherCreationPolicy": "WaitForWorkersReady",
            "sshAuthMountPath": SSH_AUTH,
            "mpiImplementation": "OpenMPI",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": backoff_limit},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "OnFailure",
                             "template": pod({"name": "launcher", "env": env,
                                              "command": launcher_command(workers * slots_per_worker, command)})},
                "Worker": {"replicas": workers, "restartPolicy": "OnFailure", "template": pod(worker)},
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Each pod's shared parts written out in full, not as YAML anchors and aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(manifest: dict) -> str:
    return yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _run_here(args: argparse.Namespace, command: Sequence[str]) -> int:
    from hvdkit.container import podjob
    from hvdkit.container.engine import EngineError, find_engine

    try:
        render(name=args.name, image=args.image, workers=args.workers, command=command,
               slots_per_worker=args.slots_per_worker or 1, grace=args.grace)
        if args.workspace is None:
            raise RenderError("--run needs --workspace DIR: the folder every container mounts at /workspace")
        pods = podjob.PodJob(engine=find_engine(args.engine), image=args.image, name=args.name, workers=args.workers,
                             command=command, workspace=args.workspace.resolve(), slots=args.slots_per_worker or 1,
                             grace=args.grace)
        return podjob.run(pods)
    except RenderError as exc:
        print(f"hvdkit mpijob: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    except EngineError as exc:
        print(f"hvdkit mpijob: {exc}", file=sys.stderr)
        return job.FAILED


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(prog="hvdkit mpijob", usage="hvdkit mpijob --workers N --image IMAGE [options] -- COMMAND",
                           description="Print a Kubeflow MPIJob (v2beta1) manifest that runs COMMAND on every rank "
                                       "in hvdkit's image (docs/containers.md).")
    parser.add_argument("--name", default="hvdkit", help="the MPIJob's name (default hvdkit)")
    parser.add_argument("--image", required=True, help="the image every pod runs (hvdkit image build)")
    parser.add_argument("--workers", type=int, required=True, help="worker pods")
    parser.add_argument("--slots-per-worker", type=int, default=None, help="ranks per worker (default: the GPUs, or 1)")
    parser.add_argument("--gpus-per-worker", type=int, default=0, help="GPUs per worker (nvidia.com/gpu)")
    parser.add_argument("--claim", help="a PersistentVolumeClaim mounted at /workspace for runs and checkpoints")
    parser.add_argument("--grace", type=int, default=DEFAULT_GRACE,
                        help=f"seconds between SIGTERM and SIGKILL when a pod is deleted (default {DEFAULT_GRACE})")
    parser.add_argument("--run", action="store_true",
                        help="run the job on this machine instead, containers as the pods (podman or docker)")
    parser.add_argument("--workspace", type=Path, help="with --run: the folder mounted at /workspace (the claim)")
    parser.add_argument("--engine", choices=("podman", "docker"), help="with --run: the container engine")
    args = parser.parse_args(own)
    if args.run:
        return _run_here(args, command)
    try:
        manifest = render(name=args.name, image=args.image, workers=args.workers, command=command,
                          slots_per_worker=args.slots_per_worker or max(args.gpus_per_worker, 1),
                          gpus_per_worker=args.gpus_per_worker, claim=args.claim, grace=args.grace)
    except RenderError as exc:
        print(f"hvdkit mpijob: {exc}", file=sys.stderr)
        return job.BAD_INPUT
    if not args.claim:
        print(f"hvdkit mpijob: no --claim: runs and checkpoints stay in each pod and are lost with it; "
              f"`{shlex.join(['--claim', 'NAME'])}` keeps them", file=sys.stderr)
    sys.stdout.write(dump(manifest))
    return job.OK
