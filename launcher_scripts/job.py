"""What every cluster type shares: the job's paths, the training command line, shell quoting.

Renderers are pure: they take the typed training config, a `Job` (the launcher's settings, names
and paths as the job will see them, the training overrides) and return text or a dict. Nothing here
reads the clock, the environment or the disk, so the same inputs give byte-identical output (golden
files).
"""

from __future__ import annotations

import shlex
import zlib
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

from framework.config import Config, Stage
from launcher_scripts.config import ClusterBase, ContainerConfig, ContainerRuntime

# torchrun's --shutdown-timeout is the stop signal's lead time minus this: the batch script still
# has to requeue the job, and srun/kubelet tear the step down, after the ranks have saved.
SHUTDOWN_MARGIN_S = 20
# Derived rendezvous ports: 15000..29999, below Linux's ephemeral range (32768..), so a derived
# port is never taken by some outgoing connection.
PORT_BASE, PORT_SPAN = 15000, 15000


@dataclass(frozen=True)
class Job:
    name: str  # the job directory's basename: Slurm job name (unique), rendezvous id, Kubernetes name
    job_dir: str  # the job directory, absolute, as the job sees it (logs, run dir)
    repo_dir: str  # where main.py lives, as the job sees it (the image's workdir in a container)
    python: str  # the interpreter that runs main.py, as the job sees it
    overrides: Tuple[str, ...]  # the user's training overrides, unchanged, then the launcher's
    cluster: ClusterBase  # the launcher's settings for this backend (never passed to main.py)
    container: ContainerConfig
    training_only: Tuple[str, ...] = ()  # the launcher's overrides for the training stage alone
    mounts: Tuple[str, ...] = ()  # host:container[:flags], the job directory first
    mkdirs: Tuple[str, ...] = ()  # host folders a mount needs before the container starts


class Raw(str):
    """A fragment written into a shell script as it is (a variable expansion we wrote ourselves).

    Only the renderers create these, from constants; a value from the config never is one.
    """


def quote(arg: str) -> str:
    return arg if isinstance(arg, Raw) else shlex.quote(arg)


def shell_line(args: Sequence[str]) -> str:
    """One command on one line, every argument quoted."""
    return " ".join(quote(a) for a in args)


def shell_command(*groups: Sequence[str], indent: str = "    ") -> str:
    """One command over continuation lines: a line per group (the program and its options, the
    container, torchrun, main.py) and a line per main.py override, every argument quoted."""
    lines = [shell_line(g) for g in groups if g]
    return f" \\\n{indent}".join(lines)


def stages_of(job: Job, cfg: Config) -> List[Stage]:
    """The stages this job runs, in order: cluster.stages, or the one `stage`."""
    return [Stage(s) for s in job.cluster.stages] or [cfg.stage]


def apptainer_command(nv: List[str], mounts: Sequence[str], workdir: str, image: str) -> List[str]:
    """`apptainer exec` for a job: no $HOME and no host environment inside (--no-home --cleanenv;
    the job's variables come as APPTAINERENV_<NAME>), the mounts bound, the image's workdir."""
    return ["apptainer", "exec", *nv, "--no-home", "--cleanenv", "--bind", ",".join(mounts), "--pwd", workdir, image]


def run_dir(job: Job, stage: Stage) -> str:
    """Where main.py writes (hydra.run.dir): fixed per job, so every rank and every requeue shares it.
    Training writes to `run/`; data preparation and fine-tuning to a folder named after the stage,
    so a fine-tuning stage never resumes the training stage's checkpoints."""
    return f"{job.job_dir}/run" if stage == Stage.training else f"{job.job_dir}/{stage.value}"


def training_export(job: Job) -> str:
    """The training stage's Hugging Face-layout export, which a following fine-tuning stage starts from."""
    return f"{run_dir(job, Stage.training)}/checkpoints/export"


def _sets(job: Job, key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in job.overrides)


def main_args(job: Job, stage: Stage) -> List[str]:
    """`main.py` and its overrides: the user's unchanged, then the launcher's own.

    With `cluster.stages=[training, fine_tuning]`, training also exports its weights
    (`checkpoint.export_safetensors=true`) and fine-tuning starts from that export
    (`checkpoint.init_from`), unless the user set either."""
    args = [f"{job.repo_dir}/main.py", *job.overrides]
    if stage != Stage.data_preparation:
        args += job.training_only
    stages = [Stage(s) for s in job.cluster.stages]
    chained = (
        Stage.training in stages
        and Stage.fine_tuning in stages
        and stages.index(Stage.training) < stages.index(Stage.fine_tuning)
    )
    if chained and stage == Stage.training and not _sets(job, "checkpoint.export_safetensors"):
        args.append("checkpoint.export_safetensors=true")
    if chained and stage == Stage.fine_tuning and not _sets(job, "checkpoint.init_from"):
        args.append(f"checkpoint.init_from={training_export(job)}")
    if job.cluster.stages:
        args.append(f"stage={stage.value}")
    args.append(f"hydra.run.dir={run_dir(job, stage)}")
    return args


def arg_groups(args: Sequence[str]) -> List[List[str]]:
    """main.py's arguments for `shell_command`: the script, then one override per line."""
    return [[a] for a in args]


def derived_port(key: str) -> int:
    """A rendezvous port from a job's name (pure: the same name, the same port)."""
    return PORT_BASE + zlib.crc32(key.encode()) % PORT_SPAN


def shutdown_timeout(job: Job) -> Optional[int]:
    """torchrun's --shutdown-timeout: the ranks' time to save after the stop signal (None: torchrun's 30 s)."""
    lead = job.cluster.signal_seconds
    return max(lead - SHUTDOWN_MARGIN_S, 10) if lead else None


def torchrun_options(cfg: Config, job: Job) -> List[str]:
    """torchrun's options after the rendezvous: restarts, the save's grace, per-rank logs."""
    c = job.cluster
    opts = [f"--max-restarts={c.max_restarts}"]
    grace = shutdown_timeout(job)
    if grace:
        opts.append(f"--shutdown-timeout={grace}")
    if c.rank_logs:
        opts += [f"--log-dir={job.job_dir}/logs/ranks", "--tee=3"]
    if c.local_ranks_filter:
        opts.append(f"--local-ranks-filter={c.local_ranks_filter}")
    return opts


def torchrun_args(cfg: Config, job: Job, endpoint: str, rdzv_id: str) -> List[str]:
    """torchrun (as `python -m torch.distributed.run`, which needs no PATH entry) with c10d rendezvous.

    `endpoint` and `rdzv_id` may be `Raw` shell expansions (Slurm's head node and job id)."""

    def option(name: str, value: str) -> str:
        return Raw(f"--{name}={value}") if isinstance(value, Raw) else f"--{name}={value}"

    return [
        job.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cfg.cluster.nodes}",
        f"--nproc-per-node={cfg.cluster.nproc_per_node}",
        "--rdzv-backend=c10d",
        option("rdzv-endpoint", endpoint),
        option("rdzv-id", rdzv_id),
        f"--rdzv-conf=join_timeout={job.cluster.rdzv_join_timeout_s}",
        *torchrun_options(cfg, job),
    ]


def env_lines(job: Job) -> List[str]:
    """`export` lines for cluster.nccl_env and cluster.env; secrets by reference only.

    A secret is never written: `secret_env.VAR=SRC` becomes `export VAR="${SRC:?...}"`, so the value
    comes from the submitting environment at run time (Slurm copies it into the job). Apptainer runs
    with --cleanenv: each variable is handed in as APPTAINERENV_<NAME>, by reference too.
    """
    c = job.cluster
    lines: List[str] = []
    for key, value in sorted(c.nccl_env.items()) + sorted(c.env.items()):
        lines.append(f"export {key}={shlex.quote(str(value))}")
    for key, source in sorted(c.secret_env.items()):
        ref = source or key  # plan.py checked it is a variable name
        message = f"set {ref} in the environment you submit from"
        if ref == key:
            lines.append(f': "${{{key}:?{message}}}"')
            lines.append(f"export {key}")
        else:
            lines.append(f'export {key}="${{{ref}:?{message}}}"')
    if job.container.runtime == ContainerRuntime.apptainer:
        lines += [f'export APPTAINERENV_{name}="${{{name}}}"' for name in env_names(job)]
    return lines


def env_names(job: Job) -> List[str]:
    """Every variable the job sets (for `docker run -e NAME`, which copies the value, never writes it)."""
    c = job.cluster
    return sorted(c.nccl_env) + sorted(c.env) + sorted(c.secret_env)


def script_header(what: str, shebang: str = "#!/usr/bin/env bash", directives: Sequence[str] = ()) -> List[str]:
    """A generated script's first lines: the interpreter, what it is, and `directives` (e.g. the
    #SBATCH lines, which sbatch reads only before the first command) after the comments."""
    # SC2016: a `$(...)` inside a user's value is single-quoted on purpose; it must never expand.
    lines = [
        shebang,
        "# shellcheck disable=SC2016",
        f"# {what}",
        "# Written by launcher_scripts/main.py; re-run the launcher rather than editing it.",
    ]
    return lines + [""] + ([*directives, ""] if directives else [])


def join_lines(lines: Iterable[str]) -> str:
    return "\n".join(lines).rstrip("\n") + "\n"
