"""A job: everything a stage runs on, built once from the config. `build_job(cfg, rt, data)` makes
the mesh, the model family and its task, the stage's data, the model on its layout (sharded,
tensor/context/expert parallel, or cut into pipeline stages) and its step runner
(framework/steps.py); every stage uses it: training and fine-tuning through the trainer
(framework/trainer.py), generate and evaluate directly (no optimizer), and stage=dpo's and
stage=grpo's reference model (`build_job(cfg, rt, reference_of=policy)`: the policy's mesh and
data, the same layout, frozen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from framework.config.schema import Config
from framework.config.validate import parallel_dims_of
from framework.data import build_data
from framework.distributed.engines import ShardingEngine, engine_of
from framework.distributed.parallel_dims import build_mesh
from framework.distributed.parallelize import parallelize
from framework.errors import UserInputError
from framework.models import family_of
from framework.runtime import Runtime

# (cfg, *, dp_rank, dp_size) -> DataBundle: a stage's data (framework/stages.py)
DataBuilder = Callable[..., Any]


@dataclass
class Job:
    cfg: Config
    rt: Runtime
    dims: Any  # ParallelDims
    mesh: Any  # the named DeviceMesh
    dp_rank: int  # among the data-parallel ranks (replicate-major, as the mesh is laid out)
    family: Any  # framework/models/registry.py
    task: Any  # how a batch becomes a loss (framework/models/tasks.py)
    data: Any  # DataBundle: the stage's loaders, vocabulary and tokenizer
    model: nn.Module  # on its layout: this rank's shards (a pipeline: this rank's stages)
    engine: ShardingEngine  # clipping, counters, state dicts (framework/distributed/engines.py)
    num_params: int  # the whole model's
    flops_per_token: float
    undecayed: set  # [Note: what weight decay leaves alone], this rank's names
    hidden: set  # Muon's matrices ([Note: Muon on sharded matrices]), this rank's names
    runner: Any = None  # the step runner (framework/steps.py): the plain loop or the pipeline's schedule


def language_model_data(cfg: Config, *, dp_rank: int, dp_size: int):
    """The data section's loaders (data=indexed, stdlib, hf, ...): pre-training's and the stages
    that read the data section as it is (generate, evaluate)."""
    t, family = cfg.trainer, family_of(cfg.model)
    task = family.task(cfg.model)
    return build_data(
        cfg.data,
        vocab_size=family.vocab_size(cfg.model),
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=t.seed,
        sample_kind=task.sample_kind,
        num_labels=family.num_labels(cfg.model),
        model_path=cfg.model.path,
    )


def build_job(
    cfg: Config, rt: Runtime, data: Optional[DataBuilder] = None, *, reference_of: Optional[Job] = None
) -> Job:
    """The job of `cfg` on this rank. `data`: the stage's data builder (None: the data section's).
    `reference_of`: a frozen copy of that job's model layout instead, on its mesh and data, in
    eval mode, dropout off, weights left for the caller to copy in ([Note: the reference model] in
    framework/dpo/stage.py)."""
    t = cfg.trainer
    if reference_of is not None:
        like = reference_of
        dims, mesh, dp_rank, family, task = like.dims, like.mesh, like.dp_rank, like.family, like.task
        bundle = like.data
    else:
        dims = parallel_dims_of(cfg, rt.world_size)
        cfg.trainer.fit_micro_batch(dims.dp)  # null: chosen for this world (validation did it too)
        mesh = build_mesh(dims, rt.device.type)
        dp_rank = mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")
        torch.manual_seed(t.seed)
        family = family_of(cfg.model)
        task = family.task(cfg.model)
        if dims.cp > 1 and task.summed_loss is None:
            raise UserInputError(
                f"parallelism.cp={dims.cp} with model.task={task.name}: only causal language "
                "modelling splits its sequences; set parallelism.cp=1"
            )
        bundle = (data or language_model_data)(cfg, dp_rank=dp_rank, dp_size=dims.dp)
    model_cfg = family.with_vocab_size(cfg.model, bundle.vocab_size)
    # Small models are materialised identically on every rank (same seed, then sharded), so a
    # run's numbers do not depend on its layout; large ones are built on the meta device and
    # initialised shard by shard after sharding, never whole on one rank.
    num_params = like.num_params if reference_of is not None else family.num_params(family.build(model_cfg, "meta"))
    meta = cfg.model.meta_init if cfg.model.meta_init is not None else 4 * num_params > 4 * 2**30  # fp32 bytes
    model = family.build(model_cfg, "meta" if meta else "cpu")
    if reference_of is not None:
        for param in model.parameters():
            param.requires_grad_(False)
    else:
        if not meta:
            family.init_weights(model, t.seed)
        if cfg.peft.lora.enabled:  # frozen base, trained adapters (framework/peft/)
            from framework.peft.setup import add_lora

            add_lora(model, cfg.peft.lora, family, model_cfg, seed=t.seed, rank0=rt.is_main)
    engine = engine_of(cfg.parallelism.engine)
    undecayed, hidden = _no_decay(model), _hidden(model)
    from framework.steps import schedule_for  # None: the plain loop; else the layout's schedule over its stages

    runner = schedule_for(model, dims, mesh, cfg, family, rt.device, bundle.train.accum_steps, task)
    if runner is not None:  # this rank's stages, materialised by the schedule itself
        placed = runner.model
        kept = {name for name, _ in placed.named_parameters(remove_duplicate=False)}  # this rank's stages'
        undecayed, hidden = undecayed & kept, hidden & kept
    else:
        placed = parallelize(model, dims, mesh, cfg.parallelism, family)
        if meta:
            placed.to_empty(device=rt.device)
    if meta and reference_of is None:
        torch.manual_seed(t.seed + rt.rank)  # each rank draws its own shards' values
        # a schedule: the whole model's init, which reaches this rank's stages (the rest stays meta)
        family.init_weights(placed if runner is None else model, None)
        if cfg.peft.lora.enabled:
            from framework.peft import reset_lora

            reset_lora(placed)
        torch.manual_seed(t.seed)
    elif not meta and rt.device.type != "cpu":
        placed.to(rt.device)
    if reference_of is not None:
        from framework.finetune.reference import disable_dropout

        disable_dropout(placed)
        placed.eval()
    if runner is None:
        from framework.steps import PlainSteps

        runner = PlainSteps(placed, dims, mesh)
    return Job(
        cfg=cfg,
        rt=rt,
        dims=dims,
        mesh=mesh,
        dp_rank=dp_rank,
        family=family,
        task=task,
        data=bundle,
        model=placed,
        engine=engine,
        num_params=num_params,
        flops_per_token=family.flops_per_token(model, cfg.data.seq_len),
        undecayed=undecayed,
        hidden=hidden,
        runner=runner,
    )


def _no_decay(model: nn.Module) -> set:
    from framework.optim import no_decay_names

    return no_decay_names(model)  # from the model as built: [Note: what weight decay leaves alone]


def _hidden(model: nn.Module) -> set:
    from framework.optim import hidden_matrix_names

    return hidden_matrix_names(model)  # Muon's matrices, likewise: [Note: Muon on sharded matrices]


def checkpoints_of(job: Job):
    """The job's CheckpointManager when anything reads or writes checkpoints or weights, else None."""
    cfg, c = job.cfg, job.cfg.checkpoint
    if not (
        c.save_final
        or c.interval
        or c.resume != "none"
        or c.init_from
        or c.export_safetensors
        or job.family.weights_dir(cfg.model)
    ):
        return None
    from framework.checkpoint import CheckpointManager

    ckpt = CheckpointManager(cfg, cfg.run_dir, job.rt)
    ckpt.tokenizer = job.data.tokenizer
    return ckpt


def load_trained_weights(job: Job, stage: str) -> int:
    """Every rank, for a stage that uses a trained model (generate, evaluate): the weights of
    checkpoint.resume or the import into `job.model`, with no optimizer; the checkpoint's step
    (0 for an import). The checkpoint manager is closed before returning."""
    cfg, c = job.cfg, job.cfg.checkpoint
    ckpt = checkpoints_of(job)
    imported = c.init_from or job.family.weights_dir(cfg.model)
    if ckpt is None or (c.resume in ("none", "") and not imported):
        raise UserInputError(
            f"stage={stage} needs weights: checkpoint.resume=<a step_N directory or auto> or "
            "checkpoint.init_from=<an export directory> (or model.path with weights)"
        )
    from framework.train_state import TrainState

    try:
        return ckpt.resume(TrainState(job.model, None, None, None))
    finally:
        ckpt.close()
