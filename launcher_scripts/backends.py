"""One object per cluster backend: everything the launcher does differently for it, in one place.

    backend = backend_of(launch.cluster.type)     # "local", "slurm", "k8s"
    backend.problems(cfg, launch)                 # its refusals, one line each
    backend.render(cfg, job, script_dir)          # every file of the job by name (pure)
    backend.lifecycle("status", name, job_dir, ids, namespace)   # the commands, then run

Adding a backend is one subclass here, its typed settings (a dataclass in `config.py`, named in
`config.BACKENDS`, with `conf/cluster/<name>.yaml`) and its renderer module; nothing else compares
backend names.
"""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional, Sequence

import yaml

from framework.config import Config
from launcher_scripts import k8s, local, slurm
from launcher_scripts.config import ENV_NAME, Backend, ContainerRuntime, LauncherConfig
from launcher_scripts.job import Job

LOG_LINES = 100


class ClusterBackend:
    """What differs between backends; the defaults are the plain machine's."""

    type: Backend
    submit_tool: Optional[str] = None  # what submit.sh runs; its absence here is reported
    missing_tool_status: int = 0  # the launcher's status when the submit tool is missing
    image_runtime: Optional[ContainerRuntime] = None  # the runtime an image alone means
    files_here: bool = True  # without a container, the job reads this machine's files
    devices_here: bool = False  # the job's devices are this machine's (else the job checks them)
    secrets_by_reference: bool = True  # cluster.secret_env names variables of the submitting shell

    def problems(self, cfg: Config, launch: LauncherConfig, stages: Sequence) -> List[str]:
        """Refusals of this backend, beyond each config's own checks."""
        return []

    def advice(self, cfg: Config, launch: LauncherConfig) -> List[str]:
        """Jobs that can start but may not be what the user wants (printed as warnings)."""
        return []

    def training_overrides(self, composed, launch: LauncherConfig, keys: Sequence[str]) -> List[str]:
        """Training overrides the backend derives for the job (the user's own keys win)."""
        return []

    def job_location(self, launch: LauncherConfig, job_dir: str, name: str) -> Optional[Dict[str, str]]:
        """Where the job sees itself (job_dir, repo_dir, python) when that is not this machine's
        paths; None: the submitting machine's (or the container's workdir)."""
        return None

    def render(self, cfg: Config, job: Job, script_dir: str) -> Dict[str, str]:
        raise NotImplementedError

    def lifecycle(self, action: str, name: str, job_dir: str, ids: Sequence[str], namespace: str) -> List[List[str]]:
        """The commands that carry out `action` (status, logs, cancel) for the job (pure)."""
        raise NotImplementedError


class LocalBackend(ClusterBackend):
    type = Backend.local
    devices_here = True

    def problems(self, cfg, launch, stages):
        k, shape, out = launch.container, cfg.cluster, []
        if k.runtime == ContainerRuntime.pyxis:
            out.append(
                "container.runtime=pyxis needs srun; with cluster=local choose docker, podman, apptainer or none"
            )
        if shape.nodes > 1 and k.runtime != ContainerRuntime.none:
            out.append(
                f"cluster.nodes={shape.nodes} with cluster=local runs the agents side by side "
                f"without a container; set container.runtime=none or cluster.nodes=1"
            )
        return out

    image_runtime = ContainerRuntime.docker

    def render(self, cfg, job, script_dir):
        return {"submit.sh": local.render_local(cfg, job)}

    def lifecycle(self, action, name, job_dir, ids, namespace):
        if action == "status":  # the lock says whether it runs; the metrics say how far
            return [
                ["flock", "--nonblock", "--conflict-exit-code", "3", f"{job_dir}/job.lock", "true"],
                ["tail", "-n", "1", f"{job_dir}/run/metrics.jsonl"],
            ]
        if action == "logs":
            return [["tail", "-n", str(LOG_LINES), path] for path in sorted(glob.glob(f"{job_dir}/logs/*.log"))]
        return []  # cancel: the job runs in the foreground of its submit.sh


class SlurmBackend(ClusterBackend):
    type = Backend.slurm
    submit_tool = "sbatch"
    missing_tool_status = 1

    image_runtime = ContainerRuntime.pyxis

    def problems(self, cfg, launch, stages):
        c, k, out = launch.cluster, launch.container, []
        limit = slurm.slurm_seconds(c.time_limit)
        if c.requeue and c.signal_seconds and limit <= c.signal_seconds:
            out.append(
                f"cluster.signal_seconds={c.signal_seconds} is not shorter than "
                f"cluster.time_limit={c.time_limit} ({limit}s); lower signal_seconds or raise "
                "the time limit"
            )
        if k.runtime in (ContainerRuntime.docker, ContainerRuntime.podman):
            out.append(
                f"container.runtime={k.runtime.value} runs containers on this machine only; with "
                "cluster=slurm choose container.runtime=pyxis, apptainer or none"
            )
        jobs_dir = os.path.abspath(c.jobs_dir)
        if not slurm.SBATCH_SAFE_PATH.fullmatch(jobs_dir):
            out.append(
                f"cluster.jobs_dir={jobs_dir!r}: #SBATCH lines cannot quote a path; choose one "
                "of letters, digits and . _ + - /"
            )
        return out

    def advice(self, cfg, launch):
        c = launch.cluster
        if not c.cpus_per_task and not slurm.exclusive(cfg, c) and cfg.cluster.nproc_per_node > 1:
            return [
                f"cluster.cpus_per_task=0: each node's torchrun and its {cfg.cluster.nproc_per_node} "
                "ranks share the CPUs Slurm gives one task (often 1); set cluster.cpus_per_task or "
                "cluster.exclusive=true"
            ]
        return []

    def training_overrides(self, composed, launch, keys):
        if "trainer.max_time_minutes" in keys or composed.trainer.max_time_minutes:
            return []
        return [f"trainer.max_time_minutes={slurm.derived_max_time_minutes(launch.cluster)}"]

    def render(self, cfg, job, script_dir):
        return slurm.render_files(cfg, job, script_dir)

    def lifecycle(self, action, name, job_dir, ids, namespace):
        jobs = f"--jobs={','.join(ids)}"
        if action == "status":
            return [
                ["squeue", jobs, "--states=all", "--format=%.12i %.10T %.10M %.12l %.6D %R"],
                ["sacct", jobs, "--allocations", "--format=JobID,JobName%40,State,Elapsed,ExitCode"],
            ]
        if action == "logs":
            # The running copy: of the submissions (a requeue chain queues copies that have not
            # started), the one whose log was written last; the first one while none has started.
            logs = f"{job_dir}/logs"
            bases = [f"{logs}/{name}-{i}" for i in ids] or sorted(p[:-4] for p in glob.glob(f"{logs}/{name}-*.out"))
            if not bases:
                return [["ls", "-l", logs]]
            started = [b for b in bases if os.path.exists(f"{b}.out")]
            base = max(started, key=lambda b: os.path.getmtime(f"{b}.out")) if started else bases[0]
            return [["tail", "-n", str(LOG_LINES), f"{base}.{ext}"] for ext in ("out", "err")]
        return [["scancel", *ids]]


class K8sBackend(ClusterBackend):
    type = Backend.k8s
    submit_tool = "kubectl"
    files_here = False  # the pods' files are on volumes and in the image
    secrets_by_reference = False  # Kubernetes secrets, checked by the config itself

    def problems(self, cfg, launch, stages):
        c, k, shape, out = launch.cluster, launch.container, cfg.cluster, []
        if not k.image:
            out.append("cluster=k8s needs container.image (the image every pod runs)")
        if len(stages) > 1:
            out.append(
                "cluster.stages with cluster=k8s: submit one stage per job "
                "(stage=data_preparation, then stage=training)"
            )
        if shape.nodes > 1 and not c.checkpoint_volume:
            out.append(
                f"cluster.nodes={shape.nodes} with cluster=k8s needs cluster.checkpoint_volume: "
                "every pod writes its checkpoint shards and verifies the others', so give a "
                "PersistentVolumeClaim with accessModes ReadWriteMany"
            )
        if k.runtime != ContainerRuntime.none:
            out.append(
                f"container.runtime={k.runtime.value} with cluster=k8s: the pods run container.image "
                "themselves; drop container.runtime"
            )
        return out

    def advice(self, cfg, launch):
        # One pod without a checkpoint volume keeps its run directory in the container's own
        # layer: a restart (restartPolicy OnFailure) gets a fresh container, and resume=auto
        # silently starts over. Multi-node jobs are refused for it (problems); one pod is warned.
        checkpoints = cfg.checkpoint.interval > 0 or cfg.checkpoint.save_final
        if cfg.cluster.nodes == 1 and not launch.cluster.checkpoint_volume and checkpoints:
            return [
                "cluster=k8s without cluster.checkpoint_volume: the run directory lives in the container, so "
                "a restarted pod starts over and its checkpoints are lost; give cluster.checkpoint_volume "
                "(a PersistentVolumeClaim) to keep them"
            ]
        return []

    def job_location(self, launch, job_dir, name):
        workdir = launch.container.workdir
        return {"job_dir": k8s.k8s_job_dir(launch.cluster, workdir, name), "repo_dir": workdir, "python": "python"}

    def render(self, cfg, job, script_dir):
        manifest = k8s.render_pytorchjob(cfg, job)
        return {
            "pytorchjob.yaml": yaml.safe_dump(manifest, sort_keys=False),
            "submit.sh": k8s.render_submit(f"{script_dir}/pytorchjob.yaml"),
        }

    def lifecycle(self, action, name, job_dir, ids, namespace):
        ns = f"--namespace={namespace}"
        if action == "status":
            return [
                ["kubectl", "get", "pytorchjob", name, ns, "-o", "wide"],
                ["kubectl", "get", "pods", ns, f"--selector=app.kubernetes.io/instance={name}"],
            ]
        if action == "logs":
            return [["kubectl", "logs", ns, f"{name}-master-0", f"--tail={LOG_LINES}"]]
        return [["kubectl", "delete", "pytorchjob", name, ns]]


BACKEND_OBJECTS: Dict[Backend, ClusterBackend] = {b.type: b for b in (LocalBackend(), SlurmBackend(), K8sBackend())}


def backend_of(name) -> ClusterBackend:
    """The backend `cluster=<name>` chose (a `Backend` or its string value)."""
    return BACKEND_OBJECTS[Backend(getattr(name, "value", name))]


def secret_env_problems(launch: LauncherConfig) -> List[str]:
    c = launch.cluster
    if not backend_of(c.type).secrets_by_reference:
        return []
    return [
        f"cluster.secret_env.{key}={ref!r}: with cluster={c.type.value} give the name of a variable in the "
        "environment you submit from (or leave it empty for the same name)"
        for key, ref in sorted(c.secret_env.items())
        if ref and not ENV_NAME.fullmatch(ref)
    ]
