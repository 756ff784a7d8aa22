"""Slurm: one sbatch script per stage, and submit.sh that chains them with dependencies.

Training runs one torchrun agent per node (`srun --ntasks-per-node=1`), each starting
cluster.nproc_per_node ranks, with c10d rendezvous on the allocation's first node.

[Note: pre-emption]
Slurm signals the batch shell (`--signal=B:USR1@N`) N seconds before the time limit or on
pre-emption warning. The script's trap forwards SIGTERM to the job steps (`scancel --signal=TERM`
without --batch: the steps, not this shell); srun hands it to torchrun, torchrun to every rank, and
the trainer saves a checkpoint and exits. The script then requeues the job (`scontrol requeue`, same
job id), which restarts with checkpoint.resume=auto from the fixed run directory. Runs longer than
one time limit are also chained: cluster.chain more copies of the training job, each
`--dependency=afterany` on the one before, resume where it stopped.
"""
from __future__ import annotations

from typing import List

from framework.config import Config, ContainerRuntime, Stage
from launcher_scripts.job import (Job, Raw, arg_groups, env_lines, join_lines, main_args, run_dir,
                                  script_header, shell_command, shell_line, stages_of, torchrun_args)

SCRIPT_NAMES = {Stage.data_preparation: "data_preparation.sbatch", Stage.training: "training.sbatch"}


def _sbatch_options(cfg: Config, job: Job, stage: Stage) -> List[str]:
    c = cfg.cluster
    training = stage == Stage.training
    name = c.job_name if training else f"{c.job_name}-{stage.value}"
    opts = [f"--job-name={name}"]
    if training:
        # One task per node: torchrun, which starts nproc_per_node ranks itself.
        opts += [f"--nodes={c.nodes}", "--ntasks-per-node=1"]
        if c.gpus_per_node:
            opts.append(f"--gpus-per-node={c.gpus_per_node}")
    else:
        opts += ["--nodes=1", "--ntasks=1"]
    if c.cpus_per_task:
        opts.append(f"--cpus-per-task={c.cpus_per_task}")
    opts.append(f"--time={c.time_limit}")
    for flag, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos)):
        if value:
            opts.append(f"--{flag}={value}")
    if c.exclusive:
        opts.append("--exclusive")
    opts += [f"--output={job.job_dir}/logs/%x-%j.out", f"--error={job.job_dir}/logs/%x-%j.err",
             "--open-mode=append"]  # a requeued run appends to the same log
    if training and c.requeue:
        if c.signal_seconds:
            opts.append(f"--signal=B:USR1@{c.signal_seconds}")  # see [Note: pre-emption]
        opts.append("--requeue")
    else:
        opts.append("--no-requeue")
    return [f"#SBATCH {o}" for o in opts]


def container_args(cfg: Config, job: Job) -> List[str]:
    """What goes between `srun <options>` and the command: the container runtime's flags."""
    k = cfg.container
    mounts = [f"{job.job_dir}:{job.job_dir}", *k.mounts]  # the job dir at the same path inside
    if k.runtime == ContainerRuntime.pyxis:
        return [f"--container-image={k.image}", f"--container-mounts={','.join(mounts)}",
                f"--container-workdir={k.workdir}", "--no-container-mount-home"]
    if k.runtime == ContainerRuntime.apptainer:
        nv = ["--nv"] if cfg.cluster.gpus_per_node else []
        return ["apptainer", "exec", *nv, "--bind", ",".join(mounts), "--pwd", k.workdir, k.image]
    return []


def render_sbatch(cfg: Config, job: Job, stage: Stage = Stage.training) -> str:
    """The sbatch script for one stage of `job` (pure: same inputs, same text)."""
    c = cfg.cluster
    training = stage == Stage.training
    lines = script_header(f"{job.name}: {stage.value} on Slurm")
    lines[0] = "#!/bin/bash"
    lines[5:5] = _sbatch_options(cfg, job, stage) + [""]
    lines += ["set -uo pipefail", ""]
    env = env_lines(cfg)
    if env:
        lines += ["# Environment (secrets by reference only; srun passes it to every task).", *env, ""]
    runtime = cfg.container.runtime
    srun_opts: List[str] = ["srun"]
    if training:
        srun_opts += [f"--nodes={c.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    else:
        srun_opts += ["--nodes=1", "--ntasks=1"]
    if c.cpus_per_task:
        srun_opts.append(f"--cpus-per-task={c.cpus_per_task}")  # srun no longer inherits it
    if runtime == ContainerRuntime.none:
        srun_opts.append(f"--chdir={job.repo_dir}")  # containers start in container.workdir
    lines.append(f"mkdir -p {shell_line([run_dir(job, stage)])}")
    if training:
        lines += [
            "# c10d rendezvous on the first node of the allocation; the job id names it.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'echo "job ${SLURM_JOB_ID}: ${SLURM_JOB_NUM_NODES} node(s), rendezvous on '
            f'${{head_node}}:{c.rdzv_port}"',
            "",
        ]
        program = torchrun_args(cfg, job, Raw(f'"${{head_node}}:{c.rdzv_port}"'), Raw('"${SLURM_JOB_ID}"'))
    else:
        program = [job.python]
    step = shell_command(srun_opts, container_args(cfg, job), program,
                         *arg_groups(main_args(cfg, job, stage)))
    if training and c.requeue:
        lines += [
            "# [Note: pre-emption] in launcher_scripts/slurm.py: save, then requeue with the same job id.",
            "preempted=0",
            "# shellcheck disable=SC2329  # invoked by the USR1 trap below",
            "on_preempt() {",
            "    preempted=1",
            '    echo "pre-emption warning: asking every rank to save a checkpoint" >&2',
            '    scancel --signal=TERM "$SLURM_JOB_ID"',
            "}",
            "trap 'on_preempt' USR1",
            "",
            step + " &",
            "step_pid=$!",
            'wait "$step_pid"',
            "status=$?",
            'if [ "$preempted" = 1 ]; then',
            "    # The trap cut `wait` short (status 138); wait until the step itself has ended. Bash keeps",
            "    # an ended step's status, so the last `wait` returns it even if the step ended meanwhile.",
            '    while kill -0 "$step_pid" 2>/dev/null; do',
            '        wait "$step_pid"',
            "    done",
            '    wait "$step_pid"',
            "    status=$?",
            '    echo "requeueing job ${SLURM_JOB_ID}; it resumes from the latest checkpoint" >&2',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "fi",
            'exit "$status"',
        ]
    else:
        lines += [step]
    return join_lines(lines)


def render_submit(cfg: Config, job: Job, script_dir: str) -> str:
    """submit.sh: every stage and chained copy, each depending on the one before.

    `script_dir` is where the sbatch scripts are as the submitting machine sees them.
    """
    lines = script_header(f"{job.name}: submits the job's stages to Slurm; the job ids go to job_ids.")
    lines += ["set -euo pipefail", f"ids={shell_line([f'{script_dir}/job_ids'])}", ': > "$ids"', "dep=()", ""]
    stages = stages_of(cfg)
    entries = []
    for stage in stages:
        entries.append((stage, "afterok", stage.value))
        if stage == Stage.training:
            for i in range(cfg.cluster.chain):
                entries.append((stage, "afterany", f"training (chained {i + 1}/{cfg.cluster.chain})"))
    for i, (stage, kind, label) in enumerate(entries):
        if i:
            lines.append(f'dep=(--dependency="{kind}:${{id}}")')
        lines += [
            f'id=$(sbatch --parsable "${{dep[@]}}" {shell_line([f"{script_dir}/{SCRIPT_NAMES[stage]}"])})',
            'id=${id%%;*}',
            f'echo "{label}: ${{id}}"',
            'echo "$id" >> "$ids"',
        ]
    return join_lines(lines)


def render_files(cfg: Config, job: Job, script_dir: str) -> dict:
    """Every file of a Slurm job, by name: the sbatch scripts and submit.sh."""
    files = {SCRIPT_NAMES[s]: render_sbatch(cfg, job, s) for s in stages_of(cfg)}
    files["submit.sh"] = render_submit(cfg, job, script_dir)
    return files
