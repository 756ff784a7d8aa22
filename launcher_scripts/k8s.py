"""Kubernetes: a Kubeflow PyTorchJob (one Master pod, nodes - 1 Worker pods), applied with kubectl.

Every pod runs one torchrun agent with cluster.nproc_per_node ranks; they meet by c10d rendezvous
at the Master's service, which the training operator names in MASTER_ADDR / MASTER_PORT (the port
is the container port called `pytorchjob-port`). Kubernetes expands `$(VAR)` in a container's
command, so `$(` in a user's override is escaped as `$$(` and reaches main.py unchanged.
The run directory lives on the checkpoint volume when one is given, so a restarted pod
(restartPolicy OnFailure) resumes from the latest checkpoint.
"""
from __future__ import annotations

from typing import Any, Dict, List

from framework.config import Config
from launcher_scripts.job import (Job, join_lines, main_args, script_header, shell_line, stages_of,
                                  torchrun_args)

API_VERSION = "kubeflow.org/v1"
DATA_MOUNT = "/data"
CHECKPOINT_MOUNT = "/checkpoints"
PORT_NAME = "pytorchjob-port"  # the operator reads MASTER_PORT from the port with this name


def k8s_job_dir(cfg: Config, name: str) -> str:
    """Where a job's run directory is inside its pods: on the checkpoint volume when there is one."""
    if cfg.cluster.checkpoint_volume:
        return f"{CHECKPOINT_MOUNT}/{name}"
    return f"{cfg.container.workdir}/jobs/{name}"


def _escape(arg: str) -> str:
    return arg.replace("$(", "$$(")


def _env(cfg: Config) -> List[Dict[str, Any]]:
    c = cfg.cluster
    env: List[Dict[str, Any]] = [{"name": k, "value": str(v)}
                                 for k, v in sorted(c.nccl_env.items()) + sorted(c.env.items())]
    for key, ref in sorted(c.secret_env.items()):
        secret, _, secret_key = ref.partition("/")
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": secret_key or key}}})
    return env


def _pod_template(cfg: Config, job: Job, role: str) -> Dict[str, Any]:
    c, k = cfg.cluster, cfg.container
    command = torchrun_args(cfg, job, "$(MASTER_ADDR):$(MASTER_PORT)", job.name)
    command += [_escape(a) for a in main_args(cfg, job, stages_of(cfg)[0])]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: List[Dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c.shm_size}}]
    for name, claim, path in (("data", c.data_volume, DATA_MOUNT),
                              ("checkpoints", c.checkpoint_volume, CHECKPOINT_MOUNT)):
        if claim:
            mounts.append({"name": name, "mountPath": path})
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
    container: Dict[str, Any] = {
        "name": "pytorch",  # the training operator looks for this name
        "image": k.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "workingDir": k.workdir,
        "ports": [{"name": PORT_NAME, "containerPort": c.rdzv_port}],
        "volumeMounts": mounts,
    }
    env = _env(cfg)
    if env:
        container["env"] = env
    if c.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": c.gpus_per_node}}
    # fsGroup: the volumes are writable by the image's user (uid/gid 1000 in our Dockerfile).
    spec: Dict[str, Any] = {"containers": [container], "volumes": volumes,
                            "securityContext": {"fsGroup": 1000}}
    if c.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in c.image_pull_secrets]
    labels = {"app.kubernetes.io/name": c.job_name, "app.kubernetes.io/instance": job.name,
              "app.kubernetes.io/component": role.lower()}
    return {"metadata": {"labels": labels}, "spec": spec}


def render_pytorchjob(cfg: Config, job: Job) -> Dict[str, Any]:
    """The PyTorchJob manifest as a dict (pure: same inputs, same dict)."""
    c = cfg.cluster
    replicas: Dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "OnFailure",
                   "template": _pod_template(cfg, job, "Master")},
    }
    if c.nodes > 1:
        replicas["Worker"] = {"replicas": c.nodes - 1, "restartPolicy": "OnFailure",
                              "template": _pod_template(cfg, job, "Worker")}
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": job.name, "namespace": c.namespace,
                     "labels": {"app.kubernetes.io/name": c.job_name,
                                "app.kubernetes.io/managed-by": "launcher_scripts"}},
        "spec": {"runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 3},
                 "pytorchReplicaSpecs": replicas},
    }


def pod_documents(manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each replica's pod template as a `v1 Pod` document, for schema validation."""
    docs = []
    for role, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
        template = spec["template"]
        docs.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{manifest['metadata']['name']}-{role.lower()}-0",
                                  **template["metadata"]},
                     "spec": {**template["spec"], "restartPolicy": spec["restartPolicy"]}})
    return docs


def render_submit(manifest_path: str) -> str:
    lines = script_header("Applies this job's PyTorchJob manifest to the current kubectl context.")
    lines += ["set -euo pipefail", shell_line(["kubectl", "apply", "-f", manifest_path])]
    return join_lines(lines)
