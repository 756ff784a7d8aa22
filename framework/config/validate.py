"""Checks that span sections, run before any process group starts.

Each problem is one line naming the field and the fix; `main.py` prints them all and exits 2. The
model's own arguments (its sizes against the tensor-parallel degree and the sequence length) are
its family's to check: `framework.models.args.job_model_problems`, run beside this.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

from framework.config.degrees import ParallelDims, resolve_parallel_dims
from framework.config.deterministic import deterministic_problems
from framework.config.pipeline import job_problems as pipeline_job_problems
from framework.config.pipeline import microbatch_problems, pipeline_problems
from framework.config.schema import Config, DataName, Stage
from framework.errors import UserInputError

GENERATE_SEQUENCE_PARALLEL = (
    "stage=generate with parallelism.sequence_parallel=true: decoding feeds one token at a time, which "
    "cannot be split over the tp ranks; set parallelism.sequence_parallel=false (tp stays)"
)


def world_size_of(cfg: Config) -> int:
    """The world size the job will have: torchrun's if we are under it, else the cluster shape."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.cluster.nodes * cfg.cluster.nproc_per_node


def validate(cfg: Config, world_size: Optional[int] = None) -> List[str]:
    """Return every cross-field problem of `cfg` (empty when the job can start)."""
    if cfg.stage == Stage.data_preparation:
        # Only the data section matters to this stage (it creates the files training will check).
        return _validate_data_preparation(cfg)
    errors: List[str] = []
    world = world_size if world_size is not None else world_size_of(cfg)
    p, t = cfg.parallelism, cfg.trainer

    dims: Optional[ParallelDims] = None
    try:
        dims = parallel_dims_of(cfg, world)
    except UserInputError as exc:
        errors.append(str(exc))

    if p.tp > 1:
        if p.tp > cfg.cluster.nproc_per_node or (cfg.cluster.nodes > 1 and cfg.cluster.nproc_per_node % p.tp):
            _advise(
                f"parallelism.tp={p.tp} with cluster.nproc_per_node={cfg.cluster.nproc_per_node}: "
                "tensor-parallel groups span nodes, and their per-layer all-reduces over the "
                "inter-node network are slow; keep tp <= nproc_per_node (and dividing it)"
            )
    errors += pipeline_problems(p) + pipeline_job_problems(cfg)
    if p.sequence_parallel and p.tp == 1:
        errors.append("parallelism.sequence_parallel=true needs parallelism.tp > 1")
    if cfg.stage == Stage.generate and p.sequence_parallel and p.tp > 1:
        errors.append(GENERATE_SEQUENCE_PARALLEL)
    if (
        cfg.optimizer.name.value == "muon"
    ):  # whole matrices come from our engine's pieces: [Note: Muon on sharded matrices]
        if p.engine.value != "native":
            errors.append(
                "optimizer=muon with parallelism.engine=torch: Muon orthogonalizes whole matrices, which our "
                "engine's pieces provide; set parallelism.engine=native"
            )

    if dims is not None:
        t.fit_micro_batch(dims.dp)
        per_step = t.micro_batch_size * dims.dp
        if t.global_batch_size % per_step:
            errors.append(
                f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
                f"trainer.micro_batch_size ({t.micro_batch_size}) x data-parallel size "
                f"({dims.dp}) = {per_step}; make it a multiple of {per_step}"
            )
        elif dims.pp > 1 and not pipeline_problems(p):
            per_rank = t.global_batch_size // dims.dp
            errors += microbatch_problems(p, per_rank, per_rank // t.micro_batch_size)

    errors += deterministic_problems(cfg, dims)

    if cfg.data.name == DataName.indexed and not cfg.data.paths:
        errors.append(
            "data=indexed needs data.paths (prefixes of .bin/.idx files); prepare them with stage=data_preparation"
        )
    for prefix in cfg.data.paths:
        if cfg.data.name == DataName.indexed and not os.path.exists(prefix + ".idx"):
            errors.append(f"data.paths: {prefix}.idx does not exist; prepare it with stage=data_preparation")
        elif cfg.data.name == DataName.indexed and not os.path.isfile(prefix + ".idx"):
            errors.append(f"data.paths: {prefix}.idx is not a regular file (a FIFO, device or directory)")

    for path in cfg.data.paths if cfg.data.name == DataName.hf else []:
        if not os.path.exists(path):
            errors.append(_missing_hf_path(path))

    f = cfg.finetune
    if cfg.stage == Stage.fine_tuning and not f.dataset and not f.train_file:
        errors.append(
            'stage=fine_tuning needs finetune.train_file (a JSONL file of {"prompt", "response"} or '
            '{"messages": [...]} records) or finetune.dataset=stdlib_functions'
        )
    for name in ("train_file", "valid_file", "tokenizer"):
        path = getattr(f, name)
        if cfg.stage == Stage.fine_tuning and path and not os.path.exists(path):
            errors.append(f"finetune.{name}={path}: no such file; give an existing path")
        elif cfg.stage == Stage.fine_tuning and path and name != "tokenizer" and os.path.isdir(path):
            errors.append(
                f"finetune.{name}={path} is a directory; give a JSONL file of "
                '{"prompt", "response"} or {"messages": [...]} records'
            )
        elif cfg.stage == Stage.fine_tuning and path and not (os.path.isfile(path) or os.path.isdir(path)):
            errors.append(f"finetune.{name}={path} is not a regular file or directory (a FIFO, device or socket)")
    if cfg.stage == Stage.dpo:
        from framework.config.dpo import dpo_problems

        errors += dpo_problems(cfg)
    if cfg.stage == Stage.grpo:
        from framework.config.grpo import grpo_problems

        errors += grpo_problems(cfg)

    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none", "") and not os.path.exists(resume):
        errors.append(f"checkpoint.resume={resume}: no such checkpoint; give an existing path, 'auto' or 'none'")
    if cfg.checkpoint.init_from and not os.path.exists(cfg.checkpoint.init_from):
        errors.append(f"checkpoint.init_from={cfg.checkpoint.init_from}: no such directory")
    if os.path.isabs(cfg.checkpoint.dir) and os.path.isfile(cfg.checkpoint.dir):  # relative: checked at start
        errors.append(
            f"checkpoint.dir={cfg.checkpoint.dir} is a file, not a directory; name a directory "
            "(it is created if missing)"
        )
    if t.device == "cuda":
        try:
            import torch

            if not torch.cuda.is_available():
                errors.append("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto")
        except ImportError:  # the launcher's environment may lack torch; the job checks again
            pass
    return errors


def _missing_hf_path(path: str) -> str:
    """data=hf reads local files only: a name that is no file here (a hub dataset's name, most
    often) is refused before any rank starts, and nothing is downloaded."""
    hub_like = not path.startswith((".", "/", "~")) and path.count("/") <= 1 and not os.path.splitext(path)[1]
    hint = (
        "; nothing is downloaded: save the hub dataset elsewhere (`datasets.load_dataset(...).save_to_disk(dir)`) "
        "and give that directory"
        if hub_like
        else ""
    )
    return f"data.paths: {path}: no such file or directory{hint}"


def _advise(message: str) -> None:
    """A warning for a job that can start but may not be what the user wants (rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger("framework.config").warning(message)


def parallel_dims_of(cfg: Config, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    return resolve_parallel_dims(
        p.strategy.value,
        dp_replicate=p.dp_replicate,
        dp_shard=p.dp_shard,
        tp=p.tp,
        ep=p.ep,
        cp=p.cp,
        pp=p.pp,
        world_size=world_size,
        nproc_per_node=cfg.cluster.nproc_per_node,
    )


def _validate_data_preparation(cfg: Config) -> List[str]:
    errors = []
    if not cfg.data.raw_inputs:
        errors.append(
            "stage=data_preparation needs data.raw_inputs (text/JSONL files or directories), "
            "e.g. 'data.raw_inputs=[/data/raw]'"
        )
    if not cfg.data.output_prefix:
        errors.append("stage=data_preparation needs data.output_prefix (where <prefix>.bin/.idx go)")
    for path in cfg.data.raw_inputs:
        if not os.path.exists(path):
            errors.append(f"data.raw_inputs: {path} does not exist")
        elif not (os.path.isfile(path) or os.path.isdir(path)):
            errors.append(f"data.raw_inputs: {path} is not a regular file or directory (a FIFO, device or socket)")
    return errors


# [Note: snapshots need a restart]
# A memory snapshot is read only by a restarted rank of the same job (same creator: the torchrun
# agent that restarts its ranks, [Note: snapshot segments outlive the rank, not the job] in
# framework/checkpoint/shm_names.py). `python main.py` starts its ranks once and never restarts
# them, and torchrun with --max-restarts=0 neither: there the snapshots would cost their copies
# every memory_interval steps and be swept unread when the job ends. Restarting ranks in-process
# is not done: a rank that died (SIGKILL, the OOM killer, a lost GPU) takes its process group,
# CUDA context and store connection with it, and bringing them back is what torchrun's agent is.
# So such a job is refused before any rank starts, naming both settings.


def restarts_here(torchrun: bool) -> int:
    """How many times this job's ranks are restarted after a failure: torchrun's --max-restarts (its
    agent gives it to every rank as TORCHELASTIC_MAX_RESTARTS), none under `python main.py`."""
    raw = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") if torchrun else "0"
    return int(raw) if raw.strip().isdigit() else 0


def snapshots_without_restarts(memory_interval: int, restarts: int, restart_field: str = "") -> Optional[str]:
    """The refusal of memory snapshots that nothing would read ([Note: snapshots need a restart]);
    `restart_field`: the setting that gives the restarts (the launcher's `cluster.max_restarts`;
    empty: torchrun's --max-restarts)."""
    if not memory_interval or restarts > 0:
        return None
    if restart_field:
        has, fix = f"{restart_field}=0", f"{restart_field}=N (N > 0)"
    else:
        has = "no restarts (python main.py never restarts its ranks; nor does torchrun without --max-restarts)"
        fix = "torchrun --max-restarts=N (N > 0)"
    return (
        f"checkpoint.memory_interval={memory_interval}: memory snapshots are read only by restarted ranks, and "
        f"this job has {has}; run it with {fix}, or set checkpoint.memory_interval=0"
    )
