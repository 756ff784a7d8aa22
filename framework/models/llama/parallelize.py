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
    for index, _ in model.layers.named_children():
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
        if sequence_parallel:
            block["attention_norm"] = SequenceParallel()
            block["ffn_norm"] = SequenceParallel()
        plan.update({f"{prefix}.{name}": style for name, style in block.items()})
    return plan
