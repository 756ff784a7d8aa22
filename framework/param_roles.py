"""What each parameter of a model is, for the optimizer: the weight-decay groups and Muon's matrices.
One rule, read by the optimizer builder (framework/optim/builder.py) on the model as built and by
the planner (framework/planner/estimate.py) through each family's shapes: our Llama's are pure
arithmetic and call the torch-free core below (`is_muon_matrix`, `is_output_head`) with what they
know of each tensor; Hugging Face's build the model on the meta device and call
`hidden_matrix_names` itself. Importing this module imports no torch (the launcher plans on a
machine without it); the functions that read a module tree import it when called.

[Note: what weight decay leaves alone]
Weight decay pulls weights towards zero; it is not applied to a norm's scale and shift, to an
embedding table, to biases, or to any other parameter of fewer than 2 dimensions (a gain, a
scalar), as most language-model recipes do. What a parameter *is* decides, not its name: a name
marker ("norm", "bias", "embeddings") misses GPT-2's `ln_1`, BERT's `LayerNorm`, Llama's
`embed_tokens` and NeoX's `embed_in`. So the decision reads the module tree: the parameters of a
module that is a norm (torch's norm classes, or any class whose name ends in "Norm": RMSNorm,
T5LayerNorm, GemmaRMSNorm ...) or an embedding (`nn.Embedding` and its subclasses), every
parameter registered as `bias`, and every parameter whose shape has fewer than 2 dims. It is taken
on the model as built, before parallelism: the engine shards a matrix into 1-D pieces (so `ndim`
there says nothing) and tensor parallel turns parameters into DTensors, while names stay the same
(`build_optimizer` checks that they did). A parameter shared by two modules (a head tied to the
embedding) is left undecayed if either module says so.
"""

from __future__ import annotations

import re
from typing import Collection, Set

_BLOCK_INDEX = re.compile(r"\.\d+\.")  # a module inside a ModuleList of blocks: layers.3.mlp


def is_output_head(module_name: str, out_features: int, vocab_sizes: Collection[int]) -> bool:
    """A linear layer named `module_name` is an output head: outside the repeated blocks (no layer
    index in its name) with as many outputs as an embedding table has rows (`vocab_sizes`: every
    embedding's). A block's projection of vocabulary width (a tiny config's) is not one."""
    return out_features in vocab_sizes and not _BLOCK_INDEX.search(f".{module_name}.")


def is_muon_matrix(ndim: int, undecayed: bool, head: bool) -> bool:
    """Muon steps it ([Note: Muon on sharded matrices]): a parameter of 2 or more dimensions (as
    built; stacked experts, 3-D, are each expert's matrix) that weight decay does not leave alone
    (`undecayed`: no embedding, norm or bias, [Note: what weight decay leaves alone]) and that is
    not an output head (`head`: `is_output_head`; a head tied to the embedding is the embedding).
    Everything else AdamW steps."""
    return ndim >= 2 and not undecayed and not head


def _torch_norms() -> tuple:
    """torch's own norm layers (BatchNorm's and InstanceNorm's class names end in "Norm1d" etc.)."""
    from torch import nn

    return (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.RMSNorm,
        nn.LocalResponseNorm,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
    )


def _undecayed_module(module, norms: tuple) -> bool:
    """A norm or an embedding: see [Note: what weight decay leaves alone]."""
    from torch import nn

    norm = isinstance(module, norms) or type(module).__name__.endswith("Norm")
    return norm or isinstance(module, (nn.Embedding, nn.EmbeddingBag))


def no_decay_names(model) -> Set[str]:
    """Every name (tied parameters have several) of the parameters of `model` that weight decay
    leaves alone ([Note: what weight decay leaves alone]). Call it on the model as built, before
    parallelism changes its parameters' shapes."""
    norms = _torch_norms()
    names_of: dict = {}
    undecayed: set = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        by_module = _undecayed_module(module, norms)
        for short, param in module.named_parameters(recurse=False):
            names_of.setdefault(id(param), set()).add(f"{prefix}.{short}" if prefix else short)
            if by_module or short == "bias" or param.dim() < 2:
                undecayed.add(id(param))
    return {name for key in undecayed for name in names_of[key]}


def hidden_matrix_names(model) -> Set[str]:
    """The names (tied parameters have several) of the matrices Muon steps: `is_muon_matrix` of
    each parameter of `model`. Call it on the model as built."""
    from torch import nn

    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {
        id(m.weight)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and is_output_head(name, m.out_features, vocab)
    }
    undecayed = no_decay_names(model)
    return {
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if is_muon_matrix(p.dim(), name in undecayed, id(p) in heads)
    }
