"""Sequence parallelism for Hugging Face decoders, on top of transformers' tensor-parallel plan.

As for our Llama (framework/models/llama/parallelize.py): between the tensor-parallel regions of
the decoder layers the residual stream and the norms hold 1/tp of the tokens (sharded on the
sequence dim), gathered before the column-wise projections and reduce-scattered after the
row-wise ones.

[Note: where a Hugging Face decoder's sequence is cut]
transformers' decoder computes the positions, the rotary table and the causal mask from the
length of the hidden states it is given (`inputs_embeds.shape[1]`), before its layers. So the
embedding's output stays whole (all-reduced, as without sequence parallelism), the stream is cut
at the first decoder layer's input (each rank keeps its part: no communication) and gathered at
the last layer's output, before the final norm. The layers receive the whole sequence's
positions, rotary table and mask as keyword arguments, which the attention uses on the whole
sequence it gathers. The price against our Llama: the embedding all-reduces instead of
reduce-scattering, and the final norm runs on every token on each rank. A pipeline stage (its
layers under their whole-model indices) cuts and gathers the same way, so what passes between
stages stays whole. The stream is kept as a DTensor between the layers (each op's output stays
one), so a sequence whose length tp does not divide is cut unevenly and gathered back whole.

Laid out as transformers' Llama is each decoder layer must be (Llama, Mistral, Qwen2/3: children
`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`), with one row-wise projection
in the attention and one in the MLP; other layouts (extra norms around the MLP: Gemma 2; parallel
attention and MLP: Cohere) are refused by name.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from framework.errors import UserInputError

_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class GatherStream(ParallelStyle):
    """The stream gathered whole at a module's input, however the layer passes it: its first
    positional argument, else `hidden_states=` (transformers' attentions take it by keyword, its
    MLPs by position). The stream must arrive as a DTensor (the layer's norm made it one): a plain
    tensor here would be one rank's part taken for the whole sequence."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def whole(mod, x):
            if not isinstance(x, DTensor):
                raise RuntimeError(f"{type(mod).__name__}: the sequence-parallel stream arrived as a plain tensor")
            return x.redistribute(placements=(Replicate(),)).to_local()

        def gather(mod, args, kwargs):
            if args:
                return (whole(mod, args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": whole(mod, kwargs["hidden_states"])}

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


def _refuse(kind: str, why: str) -> UserInputError:
    return UserInputError(
        f"parallelism.sequence_parallel=true with model=hf model_type={kind}: {why}; "
        "set parallelism.sequence_parallel=false"
    )


def sequence_parallel_plan(
    base: nn.Module, prefix: str, plan: dict[str, ParallelStyle], kind: str
) -> dict[str, ParallelStyle]:
    """`plan` (transformers' plan as hf_tp_plan applies it: module name under the whole model ->
    style) with the decoder layers' stream sharded on the sequence; `base` is the base model (the
    one holding `layers`), `prefix` its name in the whole model."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)) or not len(layers):
        raise _refuse(kind, "its base model holds no `layers` list of decoder layers")
    stream = Shard(1)
    out = dict(plan)
    names = [name for name, _ in layers.named_children()]
    for index, layer in layers.named_children():
        at = f"{prefix}layers.{index}"
        children = tuple(name for name, _ in layer.named_children())
        if sorted(children) != sorted(_LAYER):
            raise _refuse(
                kind,
                f"its decoder layer holds {', '.join(children)}, not laid out as transformers' Llama's "
                f"({', '.join(_LAYER)})",
            )
        for part in ("self_attn", "mlp"):
            rowwise = [n for n, s in plan.items() if n.startswith(f"{at}.{part}.") and isinstance(s, RowwiseParallel)]
            if len(rowwise) != 1:
                raise _refuse(kind, f"its plan splits {len(rowwise)} row-wise projections in {at}.{part}, not one")
            # The partial sums reduce-scattered onto the stream's layout instead of all-reduced.
            out[rowwise[0]] = RowwiseParallel(output_layouts=stream, use_local_output=False)
        out[f"{at}.input_layernorm"] = SequenceParallel()
        out[f"{at}.post_attention_layernorm"] = SequenceParallel()
        out[f"{at}.self_attn"] = GatherStream()
        out[f"{at}.mlp"] = GatherStream()
    # [Note: where a Hugging Face decoder's sequence is cut]
    first, last = f"{prefix}layers.{names[0]}", f"{prefix}layers.{names[-1]}"
    cut = {"input_layouts": (Replicate(),), "desired_input_layouts": (stream,)}
    gather = {"output_layouts": (stream,), "desired_output_layouts": (Replicate(),), "use_local_output": True}
    if first == last:
        out[first] = PrepareModuleInputOutput(**cut, use_local_input=False, **gather)
    else:
        out[first] = PrepareModuleInput(**cut, use_local_output=False)
        out[last] = PrepareModuleOutput(**gather)
    return out
