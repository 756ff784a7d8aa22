"""A written job's lifecycle from its directory: `status`, `logs`, `cancel`.

    python launcher_scripts/main.py status <job dir>

The commands are rendered by a pure function (`lifecycle_commands`: squeue/sacct/scancel on Slurm,
kubectl on Kubernetes, the lock and the logs on this machine) and then run; a job's backend, name
and namespace come from its `launcher.yaml`, its Slurm ids from `job_ids` (every submission's).
"""

from __future__ import annotations

import glob
import os
from typing import List, Sequence

import yaml

ACTIONS = ("status", "logs", "cancel")
LOG_LINES = 100


def lifecycle_commands(
    action: str, backend: str, name: str, job_dir: str, ids: Sequence[str], namespace: str = "default"
) -> List[List[str]]:
    """The commands that carry out `action` for the job (pure: same inputs, same commands)."""
    if backend == "slurm":
        jobs = f"--jobs={','.join(ids)}"
        if action == "status":
            return [
                ["squeue", jobs, "--states=all", "--format=%.12i %.10T %.10M %.12l %.6D %R"],
                ["sacct", jobs, "--allocations", "--format=JobID,JobName%40,State,Elapsed,ExitCode"],
            ]
        if action == "logs":
            last = ids[-1] if ids else "*"
            return [["tail", "-n", str(LOG_LINES), f"{job_dir}/logs/{name}-{last}.{ext}"] for ext in ("out", "err")]
        return [["scancel", *ids]]
    if backend == "k8s":
        ns = f"--namespace={namespace}"
        if action == "status":
            return [
                ["kubectl", "get", "pytorchjob", name, ns, "-o", "wide"],
                ["kubectl", "get", "pods", ns, f"--selector=app.kubernetes.io/instance={name}"],
            ]
        if action == "logs":
            return [["kubectl", "logs", ns, f"{name}-master-0", f"--tail={LOG_LINES}"]]
        return [["kubectl", "delete", "pytorchjob", name, ns]]
    if action == "status":  # this machine: the lock says whether it runs; the metrics say how far
        return [
            ["flock", "--nonblock", "--conflict-exit-code", "3", f"{job_dir}/job.lock", "true"],
            ["tail", "-n", "1", f"{job_dir}/run/metrics.jsonl"],
        ]
    if action == "logs":
        return [["tail", "-n", str(LOG_LINES), path] for path in sorted(glob.glob(f"{job_dir}/logs/*.log"))]
    return []


def read_job(job_dir: str) -> dict:
    """What a written job directory says about itself: backend, name, namespace, Slurm ids."""
    with open(os.path.join(job_dir, "launcher.yaml")) as f:
        launch = yaml.safe_load(f)
    ids_path = os.path.join(job_dir, "job_ids")
    ids = open(ids_path).read().split() if os.path.exists(ids_path) else []
    cluster = launch.get("cluster", {})
    return {
        "backend": cluster.get("type", "local"),
        "name": os.path.basename(os.path.normpath(job_dir)),
        "job_dir": os.path.abspath(job_dir),
        "ids": ids,
        "namespace": cluster.get("namespace", "default"),
    }
