"""From the command line to a checked plan: compose, derive the mesh, validate, choose the files.

Nothing here writes or submits; `main.py` does both with what `plan()` returns.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf

from framework.config import (ClusterType, Config, ContainerRuntime, Stage, compose_config, to_config,
                              validate)
from launcher_scripts import k8s, local, slurm
from launcher_scripts.job import Job, stages_of

# Keys the launcher consumes or sets itself; every other override reaches main.py unchanged.
LAUNCHER_KEYS = ("dry_run", "hydra.run.dir")
MESH_KEYS = ("parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.strategy")
# #SBATCH lines are not parsed by a shell: a path there must need no quoting.
SBATCH_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")
K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
K8S_SECRET_REF = re.compile(r"[a-z0-9]([-.a-z0-9]*[a-z0-9])?(/[-._A-Za-z0-9]+)?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Refused(Exception):
    """The job cannot start; `problems` are one line each, naming the field and the fix."""

    def __init__(self, problems: List[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass
class Plan:
    cfg: Config  # typed and validated
    resolved: DictConfig  # the composed config after the launcher's own settings (config.yaml)
    overrides: List[str]  # what main.py gets: the user's overrides unchanged, then the launcher's
    training_only: List[str]  # what the training stage gets after those (checkpoint.resume=auto)


def override_key(override: str) -> str:
    return override.lstrip("~+").split("=", 1)[0].strip()


def derive_mesh(cfg: DictConfig, user_keys: Sequence[str]) -> List[str]:
    """cluster.derive_mesh: dp_replicate = nodes, dp_shard = ranks per node / tp (hybrid across nodes)."""
    c, p = cfg.cluster, cfg.parallelism
    clash = [k for k in MESH_KEYS[:2] if k in user_keys]
    if clash:
        raise Refused([f"cluster.derive_mesh=true sets {' and '.join(clash)} from the cluster shape; "
                       "drop that override or set cluster.derive_mesh=false"])
    tp = int(p.tp)
    if tp < 1 or c.nproc_per_node % tp:
        raise Refused([f"cluster.derive_mesh: cluster.nproc_per_node={c.nproc_per_node} is not divisible by "
                       f"parallelism.tp={tp}; choose a tp that divides the ranks per node"])
    derived = [f"parallelism.dp_replicate={c.nodes}", f"parallelism.dp_shard={c.nproc_per_node // tp}"]
    if c.nodes > 1:
        derived.append("parallelism.strategy=hybrid")  # shard within a node, replicate across nodes
    return derived


def launcher_problems(cfg: Config) -> List[str]:
    """What the cluster type and container runtime need, beyond the training config's own checks."""
    c, k = cfg.cluster, cfg.container
    problems: List[str] = []
    runtime = k.runtime.value
    if k.runtime != ContainerRuntime.none and not k.image:
        problems.append(f"container.runtime={runtime} needs container.image "
                        "(e.g. container.image=registry.example/org/train:1.0)")
    if c.type == ClusterType.slurm:
        limit = slurm_seconds(c.time_limit)
        if c.requeue and c.signal_seconds and limit <= c.signal_seconds:
            problems.append(f"cluster.signal_seconds={c.signal_seconds} is not shorter than "
                            f"cluster.time_limit={c.time_limit} ({limit}s); lower signal_seconds or raise "
                            "the time limit")
        if k.runtime in (ContainerRuntime.docker, ContainerRuntime.podman):
            problems.append(f"container.runtime={runtime} runs containers on this machine only; with "
                            "cluster=slurm choose container.runtime=pyxis, apptainer or none")
        jobs_dir = os.path.abspath(c.jobs_dir)
        if not SBATCH_SAFE_PATH.fullmatch(jobs_dir):
            problems.append(f"cluster.jobs_dir={jobs_dir!r}: #SBATCH lines cannot quote a path; choose one "
                            "of letters, digits and . _ + - /")
    elif c.type == ClusterType.local:
        if k.runtime == ContainerRuntime.pyxis:
            problems.append("container.runtime=pyxis needs srun; with cluster=local choose docker, podman, "
                            "apptainer or none")
        if c.nodes > 1 and k.runtime != ContainerRuntime.none:
            problems.append(f"cluster.nodes={c.nodes} with cluster=local runs the agents side by side "
                            f"without a container; set container.runtime=none or cluster.nodes=1")
    else:
        if not k.image:
            problems.append("cluster=k8s needs container.image (the image every pod runs)")
        if len(stages_of(cfg)) > 1:
            problems.append("cluster.stages with cluster=k8s: submit one stage per job "
                            "(stage=data_preparation, then stage=training)")
        # <job_name>-YYYYmmdd-HHMMSS[-n]-worker-<i> names a pod's service: at most 63 characters.
        if not K8S_NAME.fullmatch(c.job_name) or len(c.job_name) > 30:
            problems.append(f"cluster.job_name={c.job_name!r}: Kubernetes names are lowercase letters, "
                            "digits and '-', at most 30 characters here")
    for key, ref in sorted(c.secret_env.items()):
        if c.type == ClusterType.k8s and not K8S_SECRET_REF.fullmatch(ref):
            problems.append(f"cluster.secret_env.{key}={ref!r}: with cluster=k8s give a Secret as "
                            "'secret-name/key' (or 'secret-name' for the key named like the variable)")
        if c.type != ClusterType.k8s and ref and not ENV_NAME.fullmatch(ref):
            problems.append(f"cluster.secret_env.{key}={ref!r}: with cluster={c.type.value} give the name "
                            "of a variable in the environment you submit from (or leave it empty for the "
                            "same name)")
    if c.type != ClusterType.slurm and c.chain:
        problems.append(f"cluster.chain={c.chain} chains Slurm jobs; set cluster.chain=0 with "
                        f"cluster={c.type.value}")
    return problems


def slurm_seconds(limit: str) -> int:
    """Slurm's time formats in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = limit.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def advice(cfg: Config, keys: Sequence[str] = ()) -> List[str]:
    """Jobs that can start but may not be what the user wants (printed as warnings)."""
    c = cfg.cluster
    notes = []
    if "hydra.run.dir" in keys:
        notes.append("hydra.run.dir is the launcher's: the job writes to <job dir>/run; "
                     "your value is ignored")
    if c.type == ClusterType.slurm and not c.cpus_per_task and not c.exclusive and c.nproc_per_node > 1:
        notes.append(f"cluster.cpus_per_task=0: each node's torchrun and its {c.nproc_per_node} ranks "
                     "share the CPUs Slurm gives one task (often 1); set cluster.cpus_per_task or "
                     "cluster.exclusive=true")
    return notes


def launcher_overrides(composed: DictConfig, keys: Sequence[str]) -> Tuple[List[str], List[str]]:
    """What the launcher adds after the user's overrides (see the table in README.md): for every
    stage, and for the training stage alone."""
    extra: List[str] = []
    if composed.cluster.derive_mesh:
        extra += derive_mesh(composed, keys)
    runtime_chosen = "container.runtime" in keys or "container" in keys
    if composed.container.image and composed.container.runtime == "none" and not runtime_chosen:
        # An image without a runtime: run it the usual way for the cluster (k8s always runs the image).
        default = {"slurm": "pyxis", "local": "docker"}.get(str(composed.cluster.type.value))
        if default:
            logging.getLogger("launcher").warning(
                f"container.image given without container.runtime: running it with {default} "
                "(set container.runtime to choose apptainer, podman or none)")
            extra.append(f"container.runtime={default}")
    # A requeued, chained, restarted or re-submitted job picks up where it stopped; on a first start
    # there is nothing to resume and training begins at step 0. An explicit choice is kept.
    stages = list(composed.cluster.stages) or [composed.stage]
    training: List[str] = []
    if "training" in stages and "checkpoint.resume" not in keys and composed.checkpoint.resume == "none":
        training.append("checkpoint.resume=auto")
    return extra, training


def plan(argv: Sequence[str]) -> Plan:
    """Compose and check the job the command line describes; raises `Refused` when it cannot start."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user = list(argv)
    keys = [override_key(o) for o in user]
    try:
        composed = compose_config(user)
    except (HydraException, OmegaConfBaseException) as exc:
        raise Refused([" ".join(str(exc).split())]) from None
    extra, training_only = launcher_overrides(composed, keys)
    # The values main.py will get, so validation sees the job's own config.
    for override in extra + training_only:
        key, value = override.split("=", 1)
        OmegaConf.update(composed, key, yaml.safe_load(value), merge=False)
    try:
        cfg = to_config(composed)
    except (ValueError, NotImplementedError, OmegaConfBaseException) as exc:
        raise Refused([" ".join(str(exc).split())]) from None

    checked = cfg
    if cfg.cluster.type != ClusterType.local:  # the job's machines have the GPUs; the job checks again
        checked = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, device="auto"))
    problems = validate(checked, cfg.cluster.nodes * cfg.cluster.nproc_per_node)
    if Stage.data_preparation in stages_of(cfg):  # this job writes the datasets the check looks for
        problems = [p for p in problems if "does not exist; prepare it with stage=data_preparation" not in p]
    problems += launcher_problems(cfg)
    if problems:
        raise Refused([" ".join(p.split()) for p in problems])  # one line each
    for note in advice(cfg, keys):
        logging.getLogger("launcher").warning(note)
    dropped = set(LAUNCHER_KEYS) | ({"stage"} if cfg.cluster.stages else set())
    passthrough = [o for o, k in zip(user, keys) if k not in dropped]
    return Plan(cfg=cfg, resolved=composed, overrides=passthrough + extra, training_only=training_only)


def make_job(p: Plan, job_dir: str, repo_dir: str, python: str) -> Job:
    """The job's names and paths as the job sees them: inside a container, the image's workdir and python."""
    name = os.path.basename(job_dir)
    cfg = p.cfg
    if cfg.cluster.type == ClusterType.k8s:
        return Job(name=name, job_dir=k8s.k8s_job_dir(cfg, name), repo_dir=cfg.container.workdir,
                   python="python", overrides=tuple(p.overrides), training_only=tuple(p.training_only))
    if cfg.container.runtime != ContainerRuntime.none:
        repo_dir, python = cfg.container.workdir, "python"
    return Job(name=name, job_dir=job_dir, repo_dir=repo_dir, python=python, overrides=tuple(p.overrides),
               training_only=tuple(p.training_only))


def render_job(p: Plan, job: Job, script_dir: str) -> Dict[str, str]:
    """Every file of the job by name; `script_dir` is the job directory on the submitting machine."""
    cfg = p.cfg
    resolved = OmegaConf.masked_copy(p.resolved, [k for k in p.resolved.keys() if k != "hydra"])
    files = {"config.yaml": OmegaConf.to_yaml(resolved, resolve=True)}
    if cfg.cluster.type == ClusterType.slurm:
        files.update(slurm.render_files(cfg, job, script_dir))
    elif cfg.cluster.type == ClusterType.k8s:
        manifest = k8s.render_pytorchjob(cfg, job)
        files["pytorchjob.yaml"] = yaml.safe_dump(manifest, sort_keys=False)
        files["submit.sh"] = k8s.render_submit(f"{script_dir}/pytorchjob.yaml")
    else:
        files["submit.sh"] = local.render_local(cfg, job)
    return files


__all__ = ["Plan", "Refused", "plan", "make_job", "render_job", "launcher_problems", "launcher_overrides",
           "derive_mesh"]
