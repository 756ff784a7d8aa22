"""Shared by the launcher tests: the rendered cases, fake cluster commands, running the launcher."""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launcher_scripts.plan import Plan, make_job, plan, render_job  # noqa: E402
from tests.conftest import free_port, pinned_tool  # noqa: E402,F401  (re-exported for the launcher tests)

GOLDEN = REPO / "tests" / "golden" / "launcher"
# Fixed paths for golden files: what the job would see, never this machine's.
JOB_DIR = "/shared/jobs/train-golden"
REPO_DIR = "/opt/repo"
PYTHON = "/opt/venv/bin/python"
# A Hydra-quoted string that would run commands if it were ever unquoted in a shell.
INJECTION = "checkpoint.dir='x; rm -rf ~; touch PWNED $(touch PWNED2) `touch PWNED3`'"
INJECTED_VALUE = "x; rm -rf ~; touch PWNED $(touch PWNED2) `touch PWNED3`"
TINY = [
    "model=debug",
    "data=synthetic",
    "trainer.progress_bar=false",
    "logging.tensorboard=false",
    "trainer.sample_tokens=0",
]

# name -> the launcher command line. Each is rendered with the fixed paths above and compared with
# tests/golden/launcher/<name>/<file> (config.yaml and launcher.yaml excluded: checked by loading them instead).
CASES: Dict[str, List[str]] = {
    # GPU nodes: --exclusive and --mem=0 by default; escape hatches; data and checkpoints on the
    # cluster's file system (not here), mounted into the container at their own paths.
    "slurm_pyxis": [
        "cluster=slurm",
        "cluster.nodes=4",
        "cluster.gpus_per_node=8",
        "model=llama_7b",
        "parallelism.tp=2",
        "cluster.derive_mesh=true",
        "container.runtime=pyxis",
        "container.image=registry.example/org/train:1.0",
        "container.mounts=[/lustre/data:/data:ro]",
        "cluster.partition=batch",
        "cluster.account=llm",
        "cluster.chain=2",
        "cluster.time_limit=04:00:00",
        "data=indexed",
        "data.paths=[/lustre/corpus/text_document]",
        "checkpoint.init_from=/lustre/models/llama-7b",
        "trainer.global_batch_size=128",
        "trainer.micro_batch_size=1",
        "data.seq_len=128",
        "cluster.sbatch_extra=['--constraint=h100']",
        "cluster.srun_extra=['--mpi=pmix']",
        "cluster.setup=['module load cuda/12.8']",
        "+cluster.nccl_env.NCCL_DEBUG=WARN",
        "+cluster.nccl_env.NCCL_IB_HCA=mlx5",
        "+cluster.secret_env.WANDB_API_KEY=WANDB_API_KEY",
        INJECTION,
    ],
    # A pipeline of 8 stages over 64 nodes (Llama 3.1 405B as stage=plan proposes it): each stage
    # 8 nodes, tp=8 inside a node, sharded over the stage's 8 nodes.
    "slurm_pp": [
        "cluster=slurm",
        "cluster.nodes=64",
        "cluster.gpus_per_node=8",
        "model=llama3_1_405b",
        "parallelism.tp=8",
        "parallelism.pp=8",
        "parallelism.dp_shard=8",
        "parallelism.pp_microbatches=64",
        "parallelism.activation_checkpointing=full",
        "parallelism.param_dtype=bfloat16",
        "container.runtime=pyxis",
        "container.image=registry.example/org/train:1.0",
        "data=indexed",
        "data.paths=[/lustre/corpus/text_document]",
        "data.seq_len=4096",
        "trainer.global_batch_size=512",
        "trainer.micro_batch_size=1",
    ],
    "slurm_apptainer": [
        "cluster=slurm",
        "cluster.nodes=2",
        "cluster.gpus_per_node=8",
        "model=llama_1b",
        "container.runtime=apptainer",
        "container.image=/shared/images/train.sif",
        "cluster.stages=[data_preparation,training]",
        "data=indexed",
        "data.paths=[/shared/data/corpus_text_document]",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=2",
        "data.seq_len=128",
        "cluster.qos=high",
        "cluster.signal_seconds=300",
        "cluster.mem=500G",
        "cluster.cpus_per_task=32",
        "cluster.rank_logs=true",
        "checkpoint.dir=/shared/ckpt/llama-1b",
        "+cluster.env.HF_HOME=/shared/hf",
        "+cluster.secret_env.HF_TOKEN=MY_HF_TOKEN",
    ],
    "slurm_none": [
        "cluster=slurm",
        "cluster.nodes=1",
        "cluster.nproc_per_node=2",
        "cluster.gpus_per_node=0",
        "cluster.cpus_per_task=2",
        "cluster.requeue=false",
        *TINY,
        "trainer.max_steps=4",
        "cluster.time_limit=30",
        INJECTION,
    ],
    "k8s": [
        "cluster=k8s",
        "cluster.nodes=3",
        "model=llama_1b",
        "container.image=registry.example/org/train:1.0",
        "cluster.image_pull_secrets=[regcred]",
        "cluster.data_volume=datasets",
        "cluster.checkpoint_volume=checkpoints",
        "cluster.namespace=research",
        "trainer.global_batch_size=96",
        "trainer.micro_batch_size=4",
        "data.seq_len=128",
        "+cluster.nccl_env.NCCL_DEBUG=WARN",
        "+cluster.env.GREETING='$(HOME)-$$x'",
        "data=indexed",
        "data.paths=[/data/corpus_text_document]",
        "+cluster.secret_env.HF_TOKEN=hf-credentials/token",
        "checkpoint.dir='$(HOME)/ckpt; rm -rf ~'",
        "cluster.node_selector={nvidia.com/gpu.product: H100}",
        "cluster.cpus_per_task=64",
        "cluster.mem=900Gi",
        "cluster.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        "cluster.gang_scheduling=true",
        "cluster.scheduler_name=volcano",
        "cluster.queue=training",
        "cluster.priority_class=high-priority",
        "cluster.service_account=trainer",
        "+cluster.annotations.team=llm",
        "cluster.ttl_seconds_after_finished=3600",
        "cluster.ib_resources={rdma/ib: 1}",
        "cluster.image_pull_policy=Always",
    ],
    "k8s_8gpu": [
        "cluster=k8s",
        "cluster.nodes=2",
        "cluster.gpus_per_node=8",
        "cluster.nproc_per_node=8",
        "model=llama_1b",
        "container.image=registry.example/org/train:1.0",
        "cluster.checkpoint_volume=checkpoints",
        "trainer.global_batch_size=128",
        "trainer.micro_batch_size=4",
        "data.seq_len=128",
        "cluster.labels={kueue.x-k8s.io/queue-name: team-a}",
        "cluster.annotations={scheduling.k8s.io/group-name: llm}",
        "cluster.host_network=true",
    ],
    "local": ["cluster=local", *TINY, "trainer.max_steps=4", INJECTION],
    "local_two_node": [
        "cluster=local",
        "cluster.nodes=2",
        "cluster.nproc_per_node=1",
        *TINY,
        "trainer.max_steps=4",
        "cluster.rdzv_port=29400",
    ],
    # Two local "nodes" of 2 GPUs each: each agent sees its own 2 GPUs; the port comes from the job name.
    "local_two_node_gpu": [
        "cluster=local",
        "cluster.nodes=2",
        "cluster.nproc_per_node=2",
        "cluster.gpus_per_node=2",
        "model=debug",
        "data=synthetic",
        "trainer.max_steps=4",
        "trainer.global_batch_size=32",
    ],
    "local_stages": [
        "cluster=local",
        "cluster.stages=[data_preparation,training]",
        "data=indexed",
        "data.paths=[/shared/data/corpus_text_document]",
        "data.raw_inputs=[/shared/raw]",
        "data.output_prefix=/shared/data/corpus",
        "model=debug",
        "data.seq_len=64",
        "trainer.max_steps=4",
    ],
    "local_docker": [
        "cluster=local",
        "container.runtime=docker",
        "container.image=registry.example/org/train:1.0",
        "cluster.gpus_per_node=2",
        "container.mounts=[/data:/data]",
        "+cluster.secret_env.HF_TOKEN=MY_HF_TOKEN",
        *TINY,
    ],
}


def plan_of(overrides: List[str]) -> Plan:
    return plan(overrides)


def render_case(name: str, job_dir: str = JOB_DIR, repo_dir: str = REPO_DIR, python: str = PYTHON) -> Dict[str, str]:
    """The files of a case, rendered with fixed paths (config.yaml and launcher.yaml left out).

    Rendering is pure, so each case is rendered once per test session (`render_case_fresh` renders
    again, for the test that checks the purity itself)."""
    return dict(_render_once(name, job_dir, repo_dir, python))


@functools.lru_cache(maxsize=None)
def _render_once(name: str, job_dir: str, repo_dir: str, python: str) -> Tuple[Tuple[str, str], ...]:
    return tuple(render_case_fresh(name, job_dir, repo_dir, python).items())


def render_case_fresh(
    name: str, job_dir: str = JOB_DIR, repo_dir: str = REPO_DIR, python: str = PYTHON
) -> Dict[str, str]:
    p = plan(CASES[name])
    job = make_job(p, job_dir, repo_dir, python)
    files = render_job(p, job, job_dir)
    files.pop("config.yaml")
    files.pop("launcher.yaml")
    return files


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# A stand-in for a program: records its argv (one JSON list per line) in $FAKE_LOG/<name>.jsonl.
RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.path.join(os.environ["FAKE_LOG"], os.path.basename(sys.argv[0]) + ".jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def run_launcher(
    args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python launcher_scripts/main.py args...` as a user runs it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(REPO / "launcher_scripts" / "main.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
