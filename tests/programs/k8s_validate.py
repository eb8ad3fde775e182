"""Validate a Kubernetes MPIJob the way the API server and the MPI operator would, with no cluster.

Three checks, each a list of one-line findings:
- the CRD's openAPIV3Schema (types, enums, required fields), as the API server validates a custom
  resource, by jsonschema;
- unknown fields, as `kubectl apply --validate=strict` rejects them (the server would otherwise
  drop them silently: a misspelled field is lost, not reported);
- the operator's own admission rules (kubeflow/mpi-operator pkg/apis/kubeflow/validation: one
  launcher, at least one worker, a container per pod, slotsPerWorker and sshAuthMountPath set).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

CRD = Path(__file__).parents[1] / "k8s" / "kubeflow.org_mpijobs.yaml"


@lru_cache(maxsize=None)
def schema(version: str = "v2beta1") -> dict:
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [entry] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return entry["schema"]["openAPIV3Schema"]


def _path(parts) -> str:
    return ".".join(str(part) for part in parts) or "(top)"


def schema_errors(manifest: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schema())
    return [f"{_path(error.absolute_path)}: {error.message}" for error in validator.iter_errors(manifest)]


def unknown_fields(value, node: dict, path: tuple = ()) -> list[str]:
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(value, dict):
        properties = node.get("properties")
        extra = node.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                found += unknown_fields(item, properties[key], (*path, key))
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, (*path, key))
            elif properties is not None:
                found.append(f"{_path((*path, key))}: unknown field")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(item, node["items"], (*path, index))
    return found


def operator_errors(manifest: dict) -> list[str]:
    spec = manifest.get("spec", {})
    replicas = spec.get("mpiReplicaSpecs", {})
    found = []
    if spec.get("slotsPerWorker") is None:
        found.append("spec.slotsPerWorker: must have number of slots per worker")
    if not spec.get("sshAuthMountPath"):
        found.append("spec.sshAuthMountPath: must have a mount path for SSH credentials")
    if not spec.get("runPolicy", {}).get("cleanPodPolicy"):
        found.append("spec.runPolicy.cleanPodPolicy: must have clean Pod policy")
    for kind, rule in (("Launcher", lambda n: n == 1), ("Worker", lambda n: n >= 1)):
        if kind not in replicas:
            found.append(f"spec.mpiReplicaSpecs.{kind}: must have {kind} replica spec")
            continue
        count = replicas[kind].get("replicas")
        if count is None:
            found.append(f"spec.mpiReplicaSpecs.{kind}.replicas: must define number of replicas")
        elif not rule(count):
            need = "must be 1" if kind == "Launcher" else "must be greater than or equal to 1"
            found.append(f"spec.mpiReplicaSpecs.{kind}.replicas: {count}: {need}")
        if not replicas[kind].get("template", {}).get("spec", {}).get("containers"):
            found.append(f"spec.mpiReplicaSpecs.{kind}.template.spec.containers: must define at least one container")
    return found


def problems(manifest: dict) -> list[str]:
    return [*schema_errors(manifest), *unknown_fields(manifest, schema()), *operator_errors(manifest)]
