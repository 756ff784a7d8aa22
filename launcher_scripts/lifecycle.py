"""A written job's lifecycle from its directory: `status`, `logs`, `cancel`.

    python launcher_scripts/main.py status <job dir>

The commands are rendered by a pure function (`lifecycle_commands`: squeue/sacct/scancel on Slurm,
kubectl on Kubernetes, the lock and the logs on this machine) and then run; a job's backend, name
and namespace come from its `launcher.yaml`, its Slurm ids from `job_ids` (every submission's).
"""

from __future__ import annotations

import os
from typing import List, Sequence

import yaml

from launcher_scripts.backends import backend_of

ACTIONS = ("status", "logs", "cancel")


def lifecycle_commands(
    action: str, backend: str, name: str, job_dir: str, ids: Sequence[str], namespace: str = "default"
) -> List[List[str]]:
    """The commands that carry out `action` for the job (pure: same inputs, same commands)."""
    return backend_of(backend).lifecycle(action, name, job_dir, ids, namespace)


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
