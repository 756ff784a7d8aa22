"""What the planner needs to know of a model, asked of its family: sharding units of tensors per
tensor-parallel rank, the widths its memory and FLOP arithmetic use, and nothing that needs torch.

Each family folder may hold a `shapes.py` with `plan_shape(cfg, vocab_size) -> ModelShape`, which
its spec names (`framework/models/families.py`, where `plan_shape` asks the family of
`model.name`; a family from outside, `model.family_module`, may define `NAMES` and `plan_shape`
in that module). A family without one is refused by `stage=plan` in one line. Our Llama's is
pure arithmetic (the launcher plans on a login node without torch); Hugging Face's builds the
model on the meta device to count its tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int  # elements on one tensor-parallel rank (the whole tensor when tp = 1)
    tp_split: bool  # split by the tensor-parallel plan (else replicated over tp ranks)
    experts: int = 0  # stacked experts on dim 0 (split by expert parallelism), 0: not an expert tensor
    row: int = 1  # elements of one dim-0 slice on one tensor-parallel rank (1 for a 1-D tensor)
    # optimizer=muon steps it with Muon (else AdamW): framework/param_roles.py's rule, which the
    # optimizer builder applies too; None: a family that does not say (a block's tensor with row > 1)
    muon: bool | None = None
    # the matrix Muon orthogonalizes, whole over tensor parallel (one expert's of stacked experts);
    # (): this tensor's numel / row x row (what its work costs: framework/distributed/whole_owners.py)
    matrix: tuple = ()


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` unit: its tensors in the order the engine lays them out."""

    name: str
    tensors: tuple[Tensor, ...]
    shard: str = "dp_shard"  # the ranks it is sharded over: dp_shard, or efsdp for split experts

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it. The widths feed the activation and FLOP estimates (for a
    family other than a Llama-style decoder they are its nearest equivalents, said by its
    `shapes.py`); `layout(shape, tp)` gives the units, root first, as the family shards them."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    layout: Callable[["ModelShape", int], list[Unit]]
    tie_embeddings: bool = False
    embedding_numel: int = -1  # parameters of the token embedding; -1: vocab_size x dim
    tensor_parallel: bool = True  # the family has a tensor-parallel plan (else tp stays 1)
    # Parameters a token does not use: the experts it is not routed to (mixture of experts)
    inactive_params: int = 0
    context_parallel: bool = False  # its attention can split sequences (parallelism.cp)
    n_experts: int = 0  # per mixture-of-experts block (0: dense)
    top_k: int = 0  # experts each token is routed to
    # Bytes of the module's buffers (a rotary table): whole on every rank, never sharded; part of
    # what an in-memory snapshot holds (framework/planner/snapshots.py). 0: a family that does not say
    buffer_bytes: int = 0
    # Its family cuts it into pipeline stages (its pipeline.py's `check_pipeline` accepts it): the
    # planner proposes parallelism.pp only then (framework/planner/pipeline.py)
    pipeline: bool = True
    # ... and splits its experts by expert inside the stages (parallelism.ep with pp)
    pipeline_experts: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def units(m: ModelShape, tp: int = 1, ep: int = 1) -> list[Unit]:
    """Forward order: the root's first use (embeddings) comes before the blocks. With expert
    parallelism each block's expert tensors are a unit of their own after it, 1/ep of each, sharded
    over the efsdp ranks (framework/distributed/expert_parallel.py)."""
    out = m.layout(m, tp)
    if ep == 1:
        return out
    split = []
    for u in out:
        experts = tuple(replace(t, numel=t.numel // ep) for t in u.tensors if t.experts)
        split.append(Unit(u.name, tuple(t for t in u.tensors if not t.experts)))
        if experts:  # named as the module holding them: layers.3.feed_forward.experts
            split.append(Unit(f"{u.name}.{experts[0].name.rpartition('.')[0]}", experts, shard="efsdp"))
    return split


def param_count(m: ModelShape) -> int:
    return sum(u.numel for u in units(m, 1))


def non_embedding_params(m: ModelShape) -> int:
    emb = m.embedding_numel if m.embedding_numel >= 0 else m.vocab_size * m.dim
    return param_count(m) - emb


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, as the trainer counts them for MFU (6 N + attention)."""
    return 6.0 * (non_embedding_params(m) - m.inactive_params) + 12.0 * m.n_layers * m.dim * seq_len
