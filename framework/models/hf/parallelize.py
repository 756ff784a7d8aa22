"""Tensor parallelism for Hugging Face models: transformers' own plan, applied with DTensor.

transformers ships a plan with many configs (`config.base_model_tp_plan`: {"layers.*.self_attn.q_proj":
"colwise", ...}, names inside the base model). We apply it as our Llama's plan is applied
(framework/distributed/tensor_parallel.py), then compose it with our sharding on the 2-D mesh:

    layers.*.<proj>: "colwise"   ColwiseParallel (output features split: each rank owns heads/tp
                                 of the attention, a slice of the MLP's inner width)
    layers.*.<proj>: "rowwise"   RowwiseParallel (input features split, partial sums all-reduced)
    layers.*.<norm>: "replicated_with_grad_allreduce"
                                 a norm over each head's features (Qwen3's q_norm / k_norm) on the
                                 local heads of a colwise projection: its weight replicated on the tp
                                 ranks, its input marked as split on the heads dim, so the weight's
                                 gradient (a sum over every head) is reduced over the tp ranks
    embed_tokens                 vocabulary-parallel (RowwiseParallel on the table)
    lm_head                      ColwiseParallel with the logits left sharded on the vocabulary,
                                 for the parallel cross-entropy ([Note: the logits stay sharded
                                 on the vocabulary])

The attention reshapes the projections with `view(..., -1, head_dim)`, so a rank's local heads
need no change in the model's code. A mixture-of-experts block's stacked experts are left out of
the plan (kept whole on every tp rank, split by expert under `parallelism.ep`: [Note: experts
under tensor parallelism]); its router and shared experts follow their own entries. Other styles
(packed or gathered outputs) are refused by name with the family, as is a model type that ships
no plan. With parallelism.sequence_parallel the decoder layers' stream is sharded on the sequence
(framework/models/hf/sequence_parallel.py).
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from framework.errors import UserInputError
from framework.models.hf.sequence_parallel import sequence_parallel_plan


def _per_head_norm() -> ParallelStyle:
    # (batch, seq, heads, head_dim) in, split on the heads (dim 2) by the colwise projection before
    return SequenceParallel(sequence_dim=2, use_local_output=True)


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "replicated_with_grad_allreduce": _per_head_norm}


def _base(model: nn.Module):
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    return (f"{prefix}.", base) if isinstance(base, nn.Module) else ("", model)


def _without_experts(plan: dict, base: nn.Module) -> dict:
    """`plan` less its entries for a block's stacked experts (the module and its tensors): they are
    kept whole on every tp rank ([Note: experts under tensor parallelism] in
    framework/models/llama/parallelize.py), split by expert over the data-parallel ranks instead."""
    from framework.models.hf.moe import is_hf_experts

    experts = [name for name, module in base.named_modules() if is_hf_experts(module)]
    if not experts:
        return plan

    def names_experts(pattern: str) -> bool:
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        parent = pattern.rpartition(".")[0]
        parent_regex = re.compile("^" + re.escape(parent).replace(r"\*", r"\d+") + "$")
        return any(regex.match(n) or parent_regex.match(n) for n in experts)

    return {pattern: style for pattern, style in plan.items() if not names_experts(pattern)}


def hf_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """{module name: style} from the model config's `base_model_tp_plan`; the tp degree (to check
    the widths) is the one apply_tensor_parallel marks the model with."""
    tp = getattr(model, "_framework_tp_degree", 0)
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix, base = _base(model)
    whole = _without_experts(plan, base)
    sparse, plan = len(whole) < len(plan), whole
    if not plan:
        raise UserInputError(
            f"parallelism.tp > 1 with model=hf model_type={kind}: transformers ships no tensor-parallel plan "
            "for it (config.base_model_tp_plan); set parallelism.tp=1"
        )
    unsupported = sorted({style for style in plan.values() if style not in STYLES})
    if unsupported:
        raise UserInputError(
            f"parallelism.tp > 1 with model=hf model_type={kind}: its plan uses {', '.join(unsupported)}, "
            f"which this engine does not apply (only {', '.join(STYLES)}); set parallelism.tp=1"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if tp:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_size"):
            value = getattr(text, name, None)
            if isinstance(value, int) and value % tp:
                raise UserInputError(
                    f"parallelism.tp={tp} does not divide {name}={value} of model_type={kind}; "
                    "choose a tp that divides it"
                )
    out: dict[str, ParallelStyle] = {}
    names = [name for name, _ in base.named_modules()]
    for pattern, style in plan.items():
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        matched = [n for n in names if regex.match(n)]
        if not matched and sparse:  # a dense block's entry in a model whose blocks are all sparse
            continue
        if not matched:
            raise UserInputError(f"model=hf model_type={kind}: its tp plan names {pattern}, which the model lacks")
        for name in matched:
            out[prefix + name] = STYLES[style]()
    embeddings = model.get_input_embeddings()
    head = model.get_output_embeddings()
    by_module = {id(m): n for n, m in model.named_modules()}
    if embeddings is not None:
        out[by_module[id(embeddings)]] = RowwiseParallel(input_layouts=Replicate())
    if head is not None:
        out[by_module[id(head)]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if sequence_parallel:
        return sequence_parallel_plan(base, prefix, out, kind)
    return out
