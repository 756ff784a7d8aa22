"""From the command line to a checked plan: split, compose both configs, derive, validate.

Nothing here writes or submits; `main.py` does both with what `plan()` returns. Every check of a job
before it is written happens in `job_problems` (one place: the planner's fit check belongs there).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from framework.config import Config, Stage, register_schema, to_config, validate
from framework.config.compose import CONF_DIR as TRAINING_CONF_DIR
from framework.config.validate import snapshots_without_restarts
from launcher_scripts.backends import backend_of, secret_env_problems
from launcher_scripts.config import (
    Backend,
    ContainerRuntime,
    LauncherConfig,
    compose_launcher,
    field_hint,
    override_key,
    split_overrides,
    to_launcher_config,
)
from launcher_scripts.job import Job, stages_of
from launcher_scripts.slurm import slurm_seconds  # noqa: F401  (re-exported)

# Keys the launcher sets itself; the user's value is dropped (with a warning).
DROPPED_KEYS = ("hydra.run.dir",)
MESH_KEYS = ("parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.strategy")
# A validation problem about a file the job reads: only meaningful where the job sees this file system.
PATH_PROBLEM = re.compile(r"does not exist|no such (file|checkpoint|directory)")


class Refused(Exception):
    """The job cannot start; `problems` are one line each, naming the field and the fix."""

    def __init__(self, problems: List[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = [" ".join(p.split()) for p in problems]


@dataclass
class Plan:
    cfg: Config  # the training config, typed and validated (what main.py will build)
    launch: LauncherConfig  # the launcher's own config (never passed to main.py)
    resolved: DictConfig  # the training config main.py gets (config.yaml)
    launcher_resolved: DictConfig  # the launcher's config (launcher.yaml)
    overrides: List[str]  # what main.py gets: the user's training overrides unchanged, then the launcher's
    training_only: List[str]  # what the training stage gets after those (checkpoint.resume=auto, ...)


def derive_mesh(cfg: DictConfig, user_keys: Sequence[str]) -> List[str]:
    """cluster.derive_mesh: dp_replicate = nodes (/ pp), dp_shard = ranks per node / tp (hybrid across
    nodes); pipeline stages, the outermost dimension, take whole nodes."""
    c, p = cfg.cluster, cfg.parallelism
    clash = [k for k in MESH_KEYS[:2] if k in user_keys]
    if clash:
        raise Refused(
            [
                f"cluster.derive_mesh=true sets {' and '.join(clash)} from the cluster shape; "
                "drop that override or set cluster.derive_mesh=false"
            ]
        )
    tp = int(p.tp)
    if tp < 1 or c.nproc_per_node % tp:
        raise Refused(
            [
                f"cluster.derive_mesh: cluster.nproc_per_node={c.nproc_per_node} is not divisible by "
                f"parallelism.tp={tp}; choose a tp that divides the ranks per node"
            ]
        )
    pp = int(p.get("pp", 1))  # pipeline stages span nodes (the outermost mesh dimension)
    if pp > 1 and c.nodes % pp:
        raise Refused(
            [
                f"cluster.derive_mesh: parallelism.pp={pp} does not divide cluster.nodes={c.nodes}; the stages "
                "are whole nodes' worth of ranks: choose a pp that divides the nodes"
            ]
        )
    replicas = c.nodes // pp if pp > 1 else c.nodes
    derived = [f"parallelism.dp_replicate={replicas}", f"parallelism.dp_shard={c.nproc_per_node // tp}"]
    if replicas > 1:
        derived.append("parallelism.strategy=hybrid")  # shard within a node, replicate across nodes
    return derived


def sees_local_files(launch: LauncherConfig) -> bool:
    """Whether the job reads the same files as this machine (so paths can be checked here)."""
    return backend_of(launch.cluster.type).files_here and launch.container.runtime == ContainerRuntime.none


def launcher_problems(cfg: Config, launch: LauncherConfig) -> List[str]:
    """What the backend and the container runtime need, beyond each config's own checks."""
    k = launch.container
    problems: List[str] = []
    if k.runtime != ContainerRuntime.none and not k.image:
        problems.append(
            f"container.runtime={k.runtime.value} needs container.image "
            "(e.g. container.image=registry.example/org/train:1.0)"
        )
    problems += backend_of(launch.cluster.type).problems(cfg, launch, stages_of_launch(cfg, launch))
    # torchrun restarts the ranks cluster.max_restarts times: [Note: snapshots need a restart]
    restarts = snapshots_without_restarts(
        cfg.checkpoint.memory_interval, launch.cluster.max_restarts, "cluster.max_restarts"
    )
    return problems + ([restarts] if restarts else []) + secret_env_problems(launch)


def stages_of_launch(cfg: Config, launch: LauncherConfig) -> List[Stage]:
    return [Stage(s) for s in launch.cluster.stages] or [cfg.stage]


def job_problems(cfg: Config, launch: LauncherConfig) -> List[str]:
    """Every reason the job cannot start, one line each: the training config's checks with the job's
    world size, then the backend's. The one place a job is checked before it is written."""
    stages = stages_of_launch(cfg, launch)
    checked = cfg
    if not backend_of(launch.cluster.type).devices_here:  # the job's machines have the GPUs; it checks again
        checked = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, device="auto"))
    problems = validate(checked, cfg.cluster.nodes * cfg.cluster.nproc_per_node)
    if Stage.data_preparation not in stages or len(stages) > 1:
        from framework.models.families import job_model_problems  # torch-free (framework/models/families.py)

        problems += job_model_problems(cfg)
    if not sees_local_files(launch):
        # The job's files are on the cluster (a volume, a container mount), not here: the job checks
        # them itself and refuses in one line.
        problems = [p for p in problems if not PATH_PROBLEM.search(p)]
    if Stage.data_preparation in stages:  # this job writes the datasets the check looks for
        problems = [p for p in problems if "prepare it with stage=data_preparation" not in p]
    problems = problems + launcher_problems(cfg, launch)
    if not problems and Stage.training in stages and not launch.cluster.force:
        # Will it fit? Arithmetic only, no torch (framework/planner, docs/planner.md).
        from framework.planner import fit_problems

        problems += fit_problems(checked, cfg.cluster.nodes * cfg.cluster.nproc_per_node)
    return problems


def advice(cfg: Config, launch: LauncherConfig, keys: Sequence[str] = ()) -> List[str]:
    """Jobs that can start but may not be what the user wants (printed as warnings)."""
    notes = []
    if "hydra.run.dir" in keys:
        notes.append("hydra.run.dir is the launcher's: the job writes to <job dir>/run; your value is ignored")
    return notes + backend_of(launch.cluster.type).advice(cfg, launch)


def _compose_training(overrides: List[str]) -> Tuple[DictConfig, str]:
    """The training config main.py will compose, and the `cluster` group it chose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=TRAINING_CONF_DIR, version_base="1.3"):
        composed = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    choice = str(composed.hydra.runtime.choices.get("cluster") or "local")
    with open_dict(composed):
        del composed["hydra"]  # main.py never sees it either
    return composed, choice


def plan(argv: Sequence[str]) -> Plan:
    """Compose and check the job the command line describes; raises `Refused` when it cannot start."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user = list(argv)
    keys = [override_key(o) for o in user]
    kept = [o for o, k in zip(user, keys, strict=True) if k not in DROPPED_KEYS]
    training_argv, launcher_argv = split_overrides(kept)
    try:
        composed, backend = _compose_training(training_argv)
    except (HydraException, OmegaConfBaseException) as exc:
        raise Refused([str(exc)]) from None
    if backend not in {b.value for b in Backend}:
        raise Refused([f"cluster={backend}: the launcher runs cluster=local, slurm or k8s"])
    try:
        launch_composed = compose_launcher(backend, launcher_argv)
        launch = to_launcher_config(launch_composed)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        hints = [h for h in (field_hint(override_key(o), backend) for o in launcher_argv) if h]
        raise Refused(hints or [str(exc)]) from None

    # The container runtime an image alone means: the backend's usual one (k8s always runs the image).
    runtime_chosen = any(k == "container.runtime" or k == "container" for k in keys)
    if launch.container.image and launch.container.runtime == ContainerRuntime.none and not runtime_chosen:
        default = backend_of(launch.cluster.type).image_runtime
        if default:
            logging.getLogger("launcher").warning(
                f"container.image given without container.runtime: running it with {default.value} "
                "(set container.runtime to choose apptainer, podman or none)"
            )
            launch.container.runtime = default
            launch_composed.container.runtime = default.value

    extra: List[str] = derive_mesh(composed, keys) if launch.cluster.derive_mesh else []
    training_only: List[str] = []
    stages = list(launch.cluster.stages) or [str(composed.stage)]
    if any(s != Stage.data_preparation.value for s in stages):
        # A requeued, chained, restarted or re-submitted job picks up where it stopped; on a first
        # start there is nothing to resume and training begins at step 0. An explicit choice is kept.
        if "checkpoint.resume" not in keys and composed.checkpoint.resume == "none":
            training_only.append("checkpoint.resume=auto")
        training_only += backend_of(launch.cluster.type).training_overrides(composed, launch, keys)
    # The values main.py will get, so validation sees the job's own config.
    for override in extra + training_only:
        key, value = override.split("=", 1)
        OmegaConf.update(composed, key, yaml.safe_load(value), merge=False)
    try:
        cfg = to_config(composed)
    except (ValueError, NotImplementedError, OmegaConfBaseException) as exc:
        raise Refused([str(exc)]) from None

    problems = job_problems(cfg, launch)
    if problems:
        raise Refused(problems)
    for note in advice(cfg, launch, keys):
        logging.getLogger("launcher").warning(note)
    return Plan(
        cfg=cfg,
        launch=launch,
        resolved=composed,
        launcher_resolved=launch_composed,
        overrides=training_argv + extra,
        training_only=training_only,
    )


def auto_mounts(cfg: Config, launch: LauncherConfig, stages: Sequence[Stage]) -> Tuple[List[str], List[str]]:
    """(folders to mount at their own path, folders to create first): the absolute host paths the
    config names (data, checkpoints, the model to start from) that no mount covers yet."""
    if launch.container.runtime == ContainerRuntime.none or not launch.container.auto_mounts:
        return [], []
    d, ck = cfg.data, cfg.checkpoint
    wanted: List[str] = [posixpath.dirname(p) for p in d.paths if p.startswith("/")]
    wanted += [p for p in (d.cache_dir, ck.init_from) if p.startswith("/")]
    wanted += [posixpath.dirname(d.tokenizer)] if d.tokenizer.startswith("/") else []
    if ck.resume.startswith("/"):
        wanted.append(posixpath.dirname(ck.resume.rstrip("/")))
    create = [ck.dir] if ck.dir.startswith("/") else []
    if Stage.data_preparation in stages:
        wanted += [p.rstrip("/") for p in d.raw_inputs if p.startswith("/")]
        if d.output_prefix.startswith("/"):
            create.append(posixpath.dirname(d.output_prefix))
    covered = [m.split(":")[0].rstrip("/") for m in launch.container.mounts]
    folders: List[str] = []
    for path in sorted(set(posixpath.normpath(p) for p in wanted + create)):
        if not any(path == c or path.startswith(c + "/") for c in covered + folders):
            folders.append(path)
    return folders, sorted(set(posixpath.normpath(p) for p in create))


def make_job(p: Plan, job_dir: str, repo_dir: str, python: str) -> Job:
    """The job's names and paths as the job sees them: inside a container, the image's workdir and python."""
    name = os.path.basename(job_dir)
    launch = p.launch
    common = dict(
        name=name,
        overrides=tuple(p.overrides),
        training_only=tuple(p.training_only),
        cluster=launch.cluster,
        container=launch.container,
    )
    elsewhere = backend_of(launch.cluster.type).job_location(launch, job_dir, name)
    if elsewhere is not None:
        return Job(**elsewhere, **common)
    if launch.container.runtime != ContainerRuntime.none:
        repo_dir, python = launch.container.workdir, "python"
    folders, create = auto_mounts(p.cfg, launch, stages_of_launch(p.cfg, launch))
    mounts = (f"{job_dir}:{job_dir}", *launch.container.mounts, *(f"{f}:{f}" for f in folders))
    return Job(job_dir=job_dir, repo_dir=repo_dir, python=python, mounts=mounts, mkdirs=tuple(create), **common)


def render_job(p: Plan, job: Job, script_dir: str) -> Dict[str, str]:
    """Every file of the job by name; `script_dir` is the job directory on the submitting machine."""
    cfg = p.cfg
    files = {
        "config.yaml": OmegaConf.to_yaml(p.resolved, resolve=True),
        "launcher.yaml": OmegaConf.to_yaml(p.launcher_resolved, resolve=True),
    }
    files.update(backend_of(p.launch.cluster.type).render(cfg, job, script_dir))
    return files


__all__ = [
    "Plan",
    "Refused",
    "plan",
    "make_job",
    "render_job",
    "job_problems",
    "launcher_problems",
    "derive_mesh",
    "stages_of",
]
