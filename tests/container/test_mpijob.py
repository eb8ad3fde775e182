"""`hvdkit mpijob`: the rendered Kubeflow MPIJob matches its golden file, validates against the
MPI operator's CRD (tests/k8s) as strictly as `kubectl apply --validate=strict` and the operator's
admission rules would, and planted errors are caught. Bad requests: one line, exit 2.

After changing the renderer, regenerate the golden files with `python tests/container/test_mpijob.py`."""

import copy
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from hvdkit.container import mpijob, pods
from programs.k8s_validate import problems

GOLDEN = REPO / "tests" / "golden"
CASES = {
    "mpijob-2x8-gpus.yaml": dict(name="resnet50", image="registry.example.com/hvdkit:0.1.0-cuda13", workers=2,
                                 gpus_per_worker=8, slots_per_worker=8, claim="checkpoints",
                                 command=["hvdkit", "train", "--model", "resnet50", "--epochs", "90"]),
    "mpijob-3-cpu-own-script.yaml": dict(name="own-script", image="localhost/hvdkit:0.1.0-cpu", workers=3,
                                         command=["python", "train.py", "--lr", "3e-4"], grace=300),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rendered_manifest_matches_golden_and_validates(name):
    text = mpijob.dump(mpijob.render(**CASES[name]))
    assert text == (GOLDEN / name).read_text()
    assert problems(yaml.safe_load(text)) == []


def test_the_launcher_runs_the_ranks_over_the_operators_hostfile_and_workers_run_sshd():
    manifest = mpijob.render(**CASES["mpijob-2x8-gpus.yaml"])
    replicas = manifest["spec"]["mpiReplicaSpecs"]
    [launcher] = replicas["Launcher"]["template"]["spec"]["containers"]
    [worker] = replicas["Worker"]["template"]["spec"]["containers"]
    assert launcher["command"] == pods.launcher_command(16, CASES["mpijob-2x8-gpus.yaml"]["command"])
    assert launcher["command"][:7] == ["hvdkit", "launch", "--launcher", "mpirun", "--hostfile", "/etc/mpi/hostfile",
                                       "-np"]
    assert worker["command"] == pods.worker_command()
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == pods.USER_ID
        assert pod["terminationGracePeriodSeconds"] == pods.DEFAULT_GRACE
        assert {"name": "workspace", "persistentVolumeClaim": {"claimName": "checkpoints"}} in pod["volumes"]
    assert manifest["spec"]["sshAuthMountPath"] == "/home/hvdkit/.ssh"
    assert manifest["spec"]["launcherCreationPolicy"] == "WaitForWorkersReady"


def _planted(change):
    manifest = copy.deepcopy(mpijob.render(**CASES["mpijob-2x8-gpus.yaml"]))
    change(manifest)
    return problems(manifest)


@pytest.mark.parametrize("change, finding", [
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"].update(replcas=2),
     "spec.mpiReplicaSpecs.Worker.replcas: unknown field"),
    (lambda m: m["spec"].update(slotPerWorker=m["spec"].pop("slotsPerWorker")), "spec.slotPerWorker: unknown field"),
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].update(imagePullPolicy=3),
     "spec.mpiReplicaSpecs.Worker.template.spec.containers.0.imagePullPolicy: 3 is not of type 'string'"),
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"].update(replicas=-1),
     "spec.mpiReplicaSpecs.Worker.replicas: -1: must be greater than or equal to 1"),
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Launcher"].update(replicas=2),
     "spec.mpiReplicaSpecs.Launcher.replicas: 2: must be 1"),
    (lambda m: m["spec"].update(mpiImplementation="OpenMP"), "spec.mpiImplementation: 'OpenMP' is not one of"),
    (lambda m: m["spec"]["runPolicy"].pop("cleanPodPolicy"),
     "spec.runPolicy.cleanPodPolicy: must have clean Pod policy"),
    (lambda m: m["spec"].pop("mpiReplicaSpecs"), "'mpiReplicaSpecs' is a required property"),
])
def test_a_planted_error_is_caught(change, finding):
    found = _planted(change)
    assert any(finding in line for line in found), found


@pytest.mark.parametrize("flags, line", [
    (["--workers", "0", "--image", "x"], "hvdkit mpijob: --workers 0: an MPIJob needs at least 1 worker"),
    (["--workers", "2", "--image", "x", "--gpus-per-worker", "4", "--slots-per-worker", "2"],
     "hvdkit mpijob: --slots-per-worker 2 with --gpus-per-worker 4: one rank per GPU, so they must be equal"),
    (["--workers", "2", "--image", "x", "--name", "My_Job"], "hvdkit mpijob: --name 'My_Job': lower-case letters"),
    (["--workers", "2"], "hvdkit mpijob: error: the following arguments are required: --image"),
])
def test_bad_requests_are_one_line_and_exit_2(flags, line):
    done = subprocess.run([sys.executable, "-m", "hvdkit", "mpijob", *flags, "--", "hvdkit", "train"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(line), done.stderr


if __name__ == "__main__":
    for name, case in CASES.items():
        (GOLDEN / name).write_text(mpijob.dump(mpijob.render(**case)))
        print(f"wrote {GOLDEN / name}")
