"""Applies parallelism to a plain model after construction, in a fixed order:
tensor parallel plan, activation checkpointing, compile, then sharding per block and at the root.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.config.schema import ActivationCheckpointing, ParallelismConfig, Strategy
from framework.distributed.engines import engine_of
from framework.distributed.parallel_dims import ParallelDims
from framework.recompute import recompute_contexts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dp_mesh_of(mesh, dims: ParallelDims):
    """1-D shard mesh for full/grad_op, 2-D (replicate, shard) for hybrid and no_shard; under
    context parallelism the shard dim is dp_shard x cp flattened (the cp ranks are data-parallel
    ranks for the weights)."""
    if dims.cp > 1:
        from framework.distributed.groups import flatten, replicate_and_flat

        if dims.dp_replicate > 1:
            return replicate_and_flat(mesh, "dp_replicate", ("dp_shard", "cp"), "dp_shard_cp")
        return flatten(mesh["dp_shard", "cp"], "dp_shard_cp")
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def apply_activation_checkpointing(blocks, mode: ActivationCheckpointing) -> None:
    """Recompute blocks in backward. The block's own forward is wrapped, so parameter names (and
    therefore checkpoints) are the same with and without it."""
    for index, block in enumerate(blocks):
        if mode == ActivationCheckpointing.selective and index % 2:
            continue
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=recompute_contexts)


def shard_kwargs(mesh, dims: ParallelDims, cfg: ParallelismConfig) -> tuple:
    """(fully_shard, its keyword arguments) of `parallelism.engine`, configured, for every unit."""
    engine = engine_of(cfg.engine)
    engine.configure(cfg)
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy = engine.api()
    precision = {"param_dtype": _DTYPES[cfg.param_dtype], "reduce_dtype": _DTYPES[cfg.reduce_dtype]}
    if cfg.quantized_comm:  # our engine only; the config refuses it with engine=torch
        precision["quantized_comm"] = True
    kwargs = {"mesh": dp_mesh_of(mesh, dims), "mp_policy": MixedPrecisionPolicy(**precision)}
    if cfg.shard_boundary.value != "anywhere":  # our engine only; the config refuses it with engine=torch
        kwargs["shard_boundary"] = cfg.shard_boundary.value
    if cfg.float8:
        from framework.distributed.float8 import all_gather_in_float8, is_float8_linear

        if all_gather_in_float8(cfg):
            kwargs.update(engine.float8_gather_kwargs(is_float8_linear))
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return fully_shard, kwargs


def parallelize(model: nn.Module, dims: ParallelDims, mesh, cfg: ParallelismConfig, family) -> nn.Module:
    """`family` is the model's registry record (`framework/models/registry.py`): its `blocks`
    (the sharding units), `tp_plan` and activation-checkpoint targets; this module knows no model."""
    engine = engine_of(cfg.engine)
    if cfg.float8:  # see [Note: float8 training]; before the tp plan: [Note: float8 under tensor parallelism]
        from framework.distributed.float8 import apply_float8

        apply_float8(model, cfg, mesh.device_type, torchao_gathers=engine.float8_gather_by_torchao)
    if dims.tp_enabled:
        from framework.distributed.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], cfg, family.tp_plan)
    expert_mesh = None
    if dims.ep > 1:  # see [Note: the layout of expert parallelism]
        from framework.distributed.expert_parallel import apply_expert_parallel

        _, expert_mesh = apply_expert_parallel(
            model, dims.ep, dims.efsdp, mesh.device_type, dp_replicate=dims.dp_replicate, cp=dims.cp, tp=dims.tp
        )
    if dims.cp > 1:  # see [Note: context parallelism by all-to-all]
        from framework.distributed.context_parallel import apply_context_parallel

        if family.context_parallel is not None:  # a model whose attention is not ours (model=hf)
            family.context_parallel(model, dims.cp)
        apply_context_parallel(model, mesh["cp"])
    blocks = family.blocks(model)
    if cfg.activation_checkpointing != ActivationCheckpointing.none:
        apply_activation_checkpointing(family.activation_checkpoint_targets(model), cfg.activation_checkpointing)
    if cfg.compile:
        for block in blocks:
            block.compile()

    fully_shard, kwargs = shard_kwargs(mesh, dims, cfg)
    reshard = cfg.strategy != Strategy.grad_op
    for block in blocks:
        if expert_mesh is not None:
            from framework.distributed.expert_parallel import expert_groups

            for experts in expert_groups(block):  # their own unit, over the ranks holding them
                fully_shard(experts, reshard_after_forward=reshard, **{**kwargs, "mesh": expert_mesh})
                experts.set_gradient_divide_factor(dims.dp * dims.cp)
                if dims.tp > 1:  # [Note: experts under tensor parallelism]: whole on every tp rank
                    experts.set_norm_copies(dims.tp)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root keeps its parameters (embeddings, final norm, head) unsharded after forward:
    # backward needs them first, so resharding them would only gather them again at once.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model
