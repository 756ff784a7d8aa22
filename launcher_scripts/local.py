"""This machine: torchrun directly, inside `docker run` / `podman run` / `apptainer exec`, or as
cluster.nodes torchrun agents that meet by c10d rendezvous on 127.0.0.1 (a multi-node job on one
machine, so rendezvous across nodes is exercised for real without a cluster). Each agent of a
multi-node GPU job gets its own slice of the GPUs (CUDA_VISIBLE_DEVICES). submit.sh holds a lock on
the job directory while it runs, so a second run of the same job refuses instead of training beside it.
"""

from __future__ import annotations

from typing import List

from framework.config import Config, Stage
from launcher_scripts.config import ContainerRuntime
from launcher_scripts.job import (
    Job,
    Raw,
    apptainer_command,
    arg_groups,
    derived_port,
    env_lines,
    env_names,
    join_lines,
    main_args,
    run_dir,
    script_header,
    shell_command,
    shell_line,
    stages_of,
    torchrun_options,
)

LOCK_NAME = "job.lock"


def container_prefix(cfg: Config, job: Job) -> List[str]:
    """The container runtime's command before the one it runs (empty for runtime=none)."""
    k = job.container
    mounts = list(job.mounts)
    if k.runtime in (ContainerRuntime.docker, ContainerRuntime.podman):
        # --user: the job directory belongs to whoever runs the launcher, not the image's uid 1000.
        args = [
            k.runtime.value,
            "run",
            "--rm",
            "--network=host",
            "--ipc=host",
            "--user",
            Raw('"$(id -u):$(id -g)"'),
            "--workdir",
            k.workdir,
        ]
        if cfg.cluster.gpus_per_node:
            docker = k.runtime == ContainerRuntime.docker
            args += ["--gpus", "all"] if docker else ["--device", "nvidia.com/gpu=all"]  # podman: CDI
        for mount in mounts:
            args += ["--volume", mount]
        for name in env_names(job):
            args += ["--env", name]  # the name only: the value is copied from this shell's environment
        return args + [k.image]
    if k.runtime == ContainerRuntime.apptainer:
        nv = ["--nv"] if cfg.cluster.gpus_per_node else []
        return apptainer_command(nv, mounts, k.workdir, k.image)
    return []


def gpu_slice(cfg: Config, node: int) -> str:
    """The GPUs of local "node" `node`: gpus_per_node consecutive devices."""
    g = cfg.cluster.gpus_per_node
    return ",".join(str(node * g + i) for i in range(g))


def _agent_groups(cfg: Config, job: Job, stage: Stage) -> List[List[List[str]]]:
    """Per torchrun agent (one per cluster.nodes), its command as groups of arguments."""
    prefix = container_prefix(cfg, job)
    args = arg_groups(main_args(job, stage))
    if stage == Stage.data_preparation:  # one plain process
        return [[prefix, [job.python], *args]]
    shape = cfg.cluster
    if shape.nodes == 1:
        # --standalone: a private c10d rendezvous on a free port; nothing else to agree on.
        torchrun = [
            job.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={shape.nproc_per_node}",
            *torchrun_options(cfg, job),
        ]
        return [[prefix, torchrun, *args]]
    port = job.cluster.rdzv_port or derived_port(job.name)
    agents = []
    for node in range(shape.nodes):
        devices = [["env", f"CUDA_VISIBLE_DEVICES={gpu_slice(cfg, node)}"]] if shape.gpus_per_node else []
        # Static rendezvous with the agent's own node rank: global rank 0 is always in agent 0, whose
        # output is this script's (c10d would number the agents in the order they join).
        torchrun = [
            job.python,
            "-m",
            "torch.distributed.run",
            f"--nnodes={shape.nodes}",
            f"--nproc-per-node={shape.nproc_per_node}",
            "--rdzv-backend=static",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            f"--node-rank={node}",
            *torchrun_options(cfg, job),
        ]
        agents.append([*devices, prefix, torchrun, *args])
    return agents


def render_local_commands(cfg: Config, job: Job, stage: Stage = Stage.training) -> List[List[str]]:
    """One argv per torchrun agent (one per cluster.nodes); data preparation is one plain process."""
    return [[a for group in groups for a in group] for groups in _agent_groups(cfg, job, stage)]


def render_local(cfg: Config, job: Job) -> str:
    """submit.sh for this machine: every stage in order, agents of a multi-node stage side by side."""
    lines = script_header(f"{job.name}: runs on this machine; agents 1.. of a multi-node run log to logs/.")
    lines += ["set -uo pipefail"]
    if job.container.runtime == ContainerRuntime.none:
        lines.append(f"cd {shell_line([job.repo_dir])} || exit 1")
    lock = f"{job.job_dir}/{LOCK_NAME}"
    lines += [
        "# One run of this job at a time: the lock goes with the process (never stale after a crash).",
        f"mkdir -p {shell_line([job.job_dir])}",
        f"exec 9>>{shell_line([lock])} || exit 1",
        "if ! flock -n 9; then",
        f"    echo {shell_line([f'error: this job is already running (lock {lock}); wait for it to end'])} >&2",
        "    exit 2",
        "fi",
        "",
    ]
    env = env_lines(job)
    if env:
        lines += ["# Environment (secrets by reference only).", *env, ""]
    for stage in stages_of(job, cfg):
        agents = _agent_groups(cfg, job, stage)
        lines.append(f"# Stage: {stage.value}")
        lines.append(f"mkdir -p {shell_line([run_dir(job, stage), job.job_dir + '/logs', *job.mkdirs])}")
        if len(agents) == 1:
            lines += [shell_command(*agents[0]), "status=$?"]
        else:
            lines.append("pids=()")
            # The agents start side by side; agent 0 writes to this script's output.
            for node in range(len(agents) - 1, -1, -1):
                log = f"{job.job_dir}/logs/{stage.value}-node{node}.log"
                redirect = f" \\\n    > {shell_line([log])} 2>&1 &" if node else " &"
                lines += [f"# agent {node} of {len(agents)}", shell_command(*agents[node]) + redirect, 'pids+=("$!")']
            # An agent that fails leaves the others waiting in the rendezvous: stop them.
            lines += [
                "status=0",
                'for _ in "${pids[@]}"; do',
                "    wait -n",
                "    rc=$?",
                '    if [ "$rc" != 0 ] && [ "$status" = 0 ]; then',
                "        status=$rc",
                '        echo "an agent failed ($rc); stopping the others" >&2',
                '        kill -TERM "${pids[@]}" 2>/dev/null',
                "    fi",
                "done",
            ]
        lines += [
            'if [ "$status" != 0 ]; then',
            f'    echo "stage {stage.value} failed ($status)" >&2',
            '    exit "$status"',
            "fi",
            "",
        ]
    return join_lines(lines)
