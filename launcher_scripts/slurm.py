"""Slurm: one sbatch script per stage, and submit.sh that chains them with dependencies.

Training runs one torchrun agent per node (`srun --ntasks-per-node=1`), each starting
cluster.nproc_per_node ranks, with c10d rendezvous on the allocation's first node, on a port
derived from the job id (two jobs sharing a head node never join each other's store).

[Note: pre-emption]
Slurm signals the batch shell (`--signal=B:USR1@N`) N seconds before the time limit or on a
pre-emption warning. The script's trap forwards SIGTERM to the job steps (`scancel --signal=TERM`
without --batch: the steps, not this shell); srun hands it to torchrun, torchrun to every rank, and
the trainer saves a checkpoint and exits. torchrun waits `--shutdown-timeout` (N minus a margin,
not its default 30 s) before it kills ranks still saving. The script then requeues the job
(`scontrol requeue`, same job id), which restarts with checkpoint.resume=auto from the fixed run
directory. A pre-emption without the user signal sends SIGTERM to the batch shell and to every step
at once: the script's TERM trap only waits for the steps' save and requeues. Runs longer than one
time limit are also chained: cluster.chain more copies of the training job, each
`--dependency=afterany:<previous>,singleton` (the job name is the job directory's, unique: a copy,
or a second `submit.sh` of a live job, waits until no job of that name runs or is requeued).
"""

from __future__ import annotations

import re
from typing import List

from framework.config import Config, Stage
from launcher_scripts.config import ContainerRuntime, SlurmCluster
from launcher_scripts.job import (
    PORT_BASE,
    PORT_SPAN,
    Job,
    Raw,
    apptainer_command,
    arg_groups,
    env_lines,
    join_lines,
    main_args,
    run_dir,
    script_header,
    shell_command,
    shell_line,
    stages_of,
    torchrun_args,
)

SCRIPT_NAMES = {
    Stage.data_preparation: "data_preparation.sbatch",
    Stage.training: "training.sbatch",
    Stage.fine_tuning: "fine_tuning.sbatch",
}

# #SBATCH lines are not parsed by a shell: a path there must need no quoting.
SBATCH_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")
# The trainer's own stop (trainer.max_time_minutes, derived from cluster.time_limit) is a backstop
# for a lost warning: half the warning's lead before the limit, or this when there is no warning.
NO_WARNING_MARGIN_S = 300


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


def derived_max_time_minutes(c: SlurmCluster) -> float:
    """trainer.max_time_minutes from cluster.time_limit: the job stops and saves by itself before
    Slurm kills it, even if the warning signal never arrives."""
    limit = slurm_seconds(c.time_limit)
    margin = c.signal_seconds // 2 if (c.requeue and c.signal_seconds) else NO_WARNING_MARGIN_S
    return round(max(limit - margin, 60) / 60, 2)


def _cluster(job: Job) -> SlurmCluster:
    assert isinstance(job.cluster, SlurmCluster), type(job.cluster)
    return job.cluster


def exclusive(cfg: Config, c: SlurmCluster) -> bool:
    """Whole nodes: cluster.exclusive, or by default on GPU jobs (as NeMo's cluster config does)."""
    return bool(cfg.cluster.gpus_per_node) if c.exclusive is None else c.exclusive


def _sbatch_options(cfg: Config, job: Job, stage: Stage) -> List[str]:
    c, shape = _cluster(job), cfg.cluster
    prep = stage == Stage.data_preparation
    opts = [f"--job-name={job.name}"]  # unique per job directory: --dependency=singleton relies on it
    if not prep:
        # One task per node: torchrun, which starts nproc_per_node ranks itself.
        opts += [f"--nodes={shape.nodes}", "--ntasks-per-node=1"]
        if shape.gpus_per_node:
            opts.append(f"--gpus-per-node={shape.gpus_per_node}")
        if c.cpus_per_task:
            opts.append(f"--cpus-per-task={c.cpus_per_task}")
        mem = c.mem or ("0" if shape.gpus_per_node else "")
        if mem:
            opts.append(f"--mem={mem}")  # 0: all of the node's memory
        if exclusive(cfg, c):
            opts.append("--exclusive")
    else:
        # Data preparation: one CPU task, never the training's whole nodes or GPUs.
        opts += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cfg.data.workers}"]
    opts.append(f"--time={c.time_limit}")
    for flag, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos)):
        if value:
            opts.append(f"--{flag}={value}")
    opts += [
        f"--output={job.job_dir}/logs/%x-%j.out",
        f"--error={job.job_dir}/logs/%x-%j.err",
        "--open-mode=append",  # a requeued run appends to the same log
        "--kill-on-invalid-dep=yes",
    ]  # a failed stage before it cancels this one, not pending forever
    if not prep and c.requeue:
        if c.signal_seconds:
            opts.append(f"--signal=B:USR1@{c.signal_seconds}")  # see [Note: pre-emption]
        opts.append("--requeue")
    else:
        opts.append("--no-requeue")
    if not prep:
        opts += list(c.sbatch_extra)
    return [f"#SBATCH {o}" for o in opts]


def pyxis_image(ref: str) -> str:
    """An image reference in enroot's form, `REGISTRY#IMAGE[:TAG]`: a registry host (the first
    path part holds a '.' or ':' or is localhost, Docker's own rule) is separated by '#', since
    some enroot versions look `nvcr.io/org/train:1.0` up on Docker Hub. A reference already in
    that form, one without a registry, or a local squashfs file is left as it is."""
    if "#" in ref or ref.startswith(("/", "./", "../")) or ref.endswith(".sqsh"):
        return ref
    host, slash, rest = ref.partition("/")
    if slash and ("." in host or ":" in host or host == "localhost"):
        return f"{host}#{rest}"
    return ref


def container_args(cfg: Config, job: Job, stage: Stage = Stage.training) -> List[str]:
    """What goes between `srun <options>` and the command: the container runtime's flags."""
    k = job.container
    mounts = list(job.mounts)
    if k.runtime == ContainerRuntime.pyxis:
        return [
            f"--container-image={pyxis_image(k.image)}",
            f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={k.workdir}",
            "--no-container-mount-home",
        ]
    if k.runtime == ContainerRuntime.apptainer:
        nv = ["--nv"] if cfg.cluster.gpus_per_node and stage != Stage.data_preparation else []
        # --no-home --cleanenv: neither $HOME nor the host's environment leaks in; the job's own
        # variables come as APPTAINERENV_<NAME> (see env_lines).
        return apptainer_command(nv, mounts, k.workdir, k.image)
    return []


def rdzv_port_line(job: Job) -> str:
    port = job.cluster.rdzv_port
    if port:
        return f"rdzv_port={port}"
    return f"rdzv_port=$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"


def render_sbatch(cfg: Config, job: Job, stage: Stage = Stage.training) -> str:
    """The sbatch script for one stage of `job` (pure: same inputs, same text)."""
    c, shape = _cluster(job), cfg.cluster
    prep = stage == Stage.data_preparation
    lines = script_header(
        f"{job.name}: {stage.value} on Slurm", shebang="#!/bin/bash", directives=_sbatch_options(cfg, job, stage)
    )
    lines += ["set -uo pipefail", ""]
    if c.setup:
        lines += ["# Setup (cluster.setup, as given).", *c.setup, ""]
    env = env_lines(job)
    if env:
        lines += ["# Environment (secrets by reference only; srun passes it to every task).", *env, ""]
    runtime = job.container.runtime
    srun_opts: List[str] = ["srun"]
    if not prep:
        srun_opts += [f"--nodes={shape.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
        if c.cpus_per_task:
            srun_opts.append(f"--cpus-per-task={c.cpus_per_task}")  # srun no longer inherits it
        srun_opts += list(c.srun_extra)
    else:
        srun_opts += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cfg.data.workers}"]
    if runtime == ContainerRuntime.none:
        srun_opts.append(f"--chdir={job.repo_dir}")  # containers start in container.workdir
    lines.append(f"mkdir -p {shell_line([run_dir(job, stage), *job.mkdirs])}")
    if not prep:
        lines += [
            "# c10d rendezvous on the first node of the allocation; the job id names it and picks the port.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            rdzv_port_line(job),
            'echo "job ${SLURM_JOB_ID}: ${SLURM_JOB_NUM_NODES} node(s), rendezvous on ${head_node}:${rdzv_port}"',
            "",
        ]
        program = torchrun_args(cfg, job, Raw('"${head_node}:${rdzv_port}"'), Raw('"${SLURM_JOB_ID}"'))
    else:
        program = [job.python]
    step = shell_command(srun_opts, container_args(cfg, job, stage), program, *arg_groups(main_args(job, stage)))
    cleanup = [] if prep else _snapshot_cleanup(cfg, job, stage)
    if not prep and c.requeue:
        lines += [
            "# [Note: pre-emption] in launcher_scripts/slurm.py: save, then requeue with the same job id.",
            "preempted=0",
            "# shellcheck disable=SC2329  # invoked by the traps below",
            "on_warning() {",
            "    preempted=1",
            '    echo "pre-emption warning: asking every rank to save a checkpoint" >&2',
            '    scancel --signal=TERM "$SLURM_JOB_ID"',
            "}",
            "# shellcheck disable=SC2329",
            "on_term() {",
            "    preempted=1",
            '    echo "terminated: Slurm stops every step too; waiting for the ranks to save" >&2',
            "}",
            "trap 'on_warning' USR1",
            "trap 'on_term' TERM",
            "",
            step + " &",
            "step_pid=$!",
            'wait "$step_pid"',
            "status=$?",
            'if [ "$preempted" = 1 ]; then',
            "    # A trap cut `wait` short (status > 128); wait until the step itself has ended. Bash keeps",
            "    # an ended step's status, so the last `wait` returns it even if the step ended meanwhile.",
            '    while kill -0 "$step_pid" 2>/dev/null; do',
            '        wait "$step_pid"',
            "    done",
            '    wait "$step_pid"',
            "    status=$?",
            "fi",
            'if [ "$preempted" = 1 ]; then',
            "    # No sweep step here: Slurm is ending the job; the requeued job's start sweeps.",
            '    echo "requeueing job ${SLURM_JOB_ID}; it resumes from the latest checkpoint" >&2',
            '    scontrol requeue "$SLURM_JOB_ID"',
            *(["else", *("    " + line.replace("\n", "\n    ") for line in cleanup)] if cleanup else []),
            "fi",
            'exit "$status"',
        ]
    elif cleanup:
        lines += [step, "status=$?", *cleanup, 'exit "$status"']
    else:
        lines += [step]
    return join_lines(lines)


def _snapshot_cleanup(cfg: Config, job: Job, stage: Stage) -> List[str]:
    """Lines that remove, on every node, the memory snapshots of ranks killed with their sweeper
    (a node's processes killed whole): [Note: snapshot segments outlive the rank, not the job] in
    framework/checkpoint/shm_names.py. A job cancelled whole (scancel) ends this script too; the
    next job's start on the node removes them then."""
    shape = cfg.cluster
    dirs = ["/dev/shm"] + ([cfg.checkpoint.memory_dir] if cfg.checkpoint.memory_dir else [])
    srun = ["srun", f"--nodes={shape.nodes}", "--ntasks-per-node=1"]
    if job.container.runtime == ContainerRuntime.none:
        srun.append(f"--chdir={job.repo_dir}")
    sweep = [job.python, f"{job.repo_dir}/framework/checkpoint/shm_names.py", "--sweep", *dirs]
    return [
        "# On every node, the memory snapshots of ranks killed with their sweeper removed.",
        shell_command(srun, container_args(cfg, job, stage), sweep) + " || true",
    ]


def render_submit(cfg: Config, job: Job, script_dir: str) -> str:
    """submit.sh: every stage and chained copy, each depending on the one before; every job also
    `singleton` on the job's unique name, so a second run of this script queues behind a live job
    instead of training beside it. Job ids are appended to job_ids (kept across re-submissions).

    `script_dir` is where the sbatch scripts are as the submitting machine sees them.
    """
    lines = script_header(f"{job.name}: submits the job's stages to Slurm; the job ids go to job_ids.")
    lines += ["set -euo pipefail", f"ids={shell_line([f'{script_dir}/job_ids'])}", ""]
    entries = []
    for stage in stages_of(job, cfg):
        entries.append((stage, "afterok", stage.value))
        if stage != Stage.data_preparation:
            for i in range(_cluster(job).chain):
                entries.append((stage, "afterany", f"{stage.value} (chained {i + 1}/{_cluster(job).chain})"))
    for i, (stage, kind, label) in enumerate(entries):
        dep = f'--dependency="{kind}:${{id}},singleton"' if i else "--dependency=singleton"
        lines += [
            f"id=$(sbatch --parsable {dep} {shell_line([f'{script_dir}/{SCRIPT_NAMES[stage]}'])})",
            "id=${id%%;*}",
            f'echo "{label}: ${{id}}"',
            'echo "$id" >> "$ids"',
        ]
    return join_lines(lines)


def render_files(cfg: Config, job: Job, script_dir: str) -> dict:
    """Every file of a Slurm job, by name: the sbatch scripts and submit.sh."""
    files = {SCRIPT_NAMES[s]: render_sbatch(cfg, job, s) for s in stages_of(job, cfg)}
    files["submit.sh"] = render_submit(cfg, job, script_dir)
    return files
