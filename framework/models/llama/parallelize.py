"""The Llama family's tensor-parallel plan: which module is split how, as a dictionary.

Kept next to the model (the model file itself stays free of parallel code) and applied by the
generic `framework.distributed.tensor_parallel.apply_tensor_parallel`.

Megatron-style layout, with t = the tp degree:

    tok_embeddings   vocabulary-parallel (rows of the table split; each rank looks up the tokens
                     it owns, the partial results are summed)
    attention        wq/wk/wv column-wise (each rank owns n_heads/t query heads and n_kv_heads/t
                     KV heads), wo row-wise (partial sums reduced at its output)
    feed_forward     w1/w3 column-wise, w2 row-wise
    output           column-wise with the logits left sharded on the vocabulary dim; the loss is
                     computed on the shards (`loss_parallel`), never gathering (batch, seq, vocab)

[Note: experts under tensor parallelism]
A mixture-of-experts block's shared expert is split as the dense feed-forward; the router and
the routed experts are not split: every tp rank routes the whole (replicated) tokens the same
way and computes its experts whole. Under expert parallelism the experts are split by expert over
the dp_shard ranks of each tp rank (and sharded over efsdp), not over tp: an expert's matmuls are
small (moe_ffn_dim), so splitting each by tp (Megatron's expert-tensor-parallel degree > 1) would
add two collectives per expert for little memory, and an ep group spanning tp ranks would need
the tp ranks to route different tokens, which the replicated stream between the blocks does not
give. The price is tp-fold redundant expert compute; the memory per rank is the experts / ep /
efsdp, as without tp. The experts' gradients come out whole and equal on every tp rank (their
inputs' gradients are summed over tp by the next column-wise layer), so no tp reduction is needed.

With sequence parallelism the activations between the blocks' matmuls (the residual stream,
the norms) are sharded on the sequence dim instead of replicated: the row-wise outputs become
reduce-scatters, the column-wise inputs all-gathers, and the norms compute on 1/t of the tokens.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)


def tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """{fully qualified module name: style} for a `framework.models.llama.Transformer`."""
    # Layout of the residual stream between the blocks' tensor-parallel regions.
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # use_local_output=False: the logits stay a DTensor sharded on the vocabulary, which the
        # parallel cross-entropy consumes (and sampling gathers with `full_tensor()`).
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    # A pipeline stage (framework/models/llama/pipeline.py) holds some of the blocks, under their
    # indices in the whole model, and the embedding or the head only where it runs them.
    plan = {name: style for name, style in plan.items() if getattr(model, name, None) is not None}
    for index, layer in model.layers.named_children():
        prefix = f"layers.{index}"
        block = {
            # The rotary table (second argument) is a plain tensor every rank holds whole.
            "attention": PrepareModuleInput(input_layouts=(stream, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if hasattr(layer.feed_forward, "router"):  # [Note: experts under tensor parallelism]
            for name in ("feed_forward", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
                del block[name]
            block["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(stream,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(stream,),
                use_local_output=True,
            )
            if layer.feed_forward.shared is not None:
                block["feed_forward.shared.w1"] = ColwiseParallel()
                block["feed_forward.shared.w3"] = ColwiseParallel()
                block["feed_forward.shared.w2"] = RowwiseParallel()
        if sequence_parallel:
            block["attention_norm"] = SequenceParallel()
            block["ffn_norm"] = SequenceParallel()
        plan.update({f"{prefix}.{name}": style for name, style in block.items()})
    return plan
