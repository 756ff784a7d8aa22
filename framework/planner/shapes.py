"""The parameters of a model as the sharded engine sees them: units of flat tensors, per tp rank.

Pure arithmetic over `ModelConfig` (no torch), mirroring `framework/models/llama/model.py` and the
Llama tensor-parallel plan (`framework/models/llama/parallelize.py`): `parallelize` makes one
sharding unit per transformer block and one for the root (embeddings, final norm, output head).
`tests/planner/test_planner.py` checks these counts against the built model, tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int  # elements on one tensor-parallel rank (the whole tensor when tp = 1)
    tp_split: bool  # split by the tensor-parallel plan (else replicated over tp ranks)


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` unit: its tensors in the order the engine lays them out."""

    name: str
    tensors: tuple[Tensor, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def _split(n: int, tp: int) -> int:
    """Rows tp rank 0 holds of n (torch.chunk semantics, as DTensor's Shard: rank 0 has the most)."""
    return -(-n // tp)


def block_tensors(m: ModelShape, tp: int = 1) -> tuple[Tensor, ...]:
    d, q, kv, f = m.dim, m.n_heads * m.head_dim, m.kv_dim, m.ffn_dim
    return (
        Tensor("attention_norm.weight", d, False),
        Tensor("attention.wq.weight", _split(q, tp) * d, tp > 1),
        Tensor("attention.wk.weight", _split(kv, tp) * d, tp > 1),
        Tensor("attention.wv.weight", _split(kv, tp) * d, tp > 1),
        Tensor("attention.wo.weight", d * _split(q, tp), tp > 1),
        Tensor("ffn_norm.weight", d, False),
        Tensor("feed_forward.w1.weight", _split(f, tp) * d, tp > 1),
        Tensor("feed_forward.w3.weight", _split(f, tp) * d, tp > 1),
        Tensor("feed_forward.w2.weight", d * _split(f, tp), tp > 1),
    )


def root_tensors(m: ModelShape, tp: int = 1) -> tuple[Tensor, ...]:
    rows = _split(m.vocab_size, tp)
    out = [Tensor("tok_embeddings.weight", rows * m.dim, tp > 1), Tensor("norm.weight", m.dim, False)]
    if not m.tie_embeddings:
        out.append(Tensor("output.weight", rows * m.dim, tp > 1))
    return tuple(out)


def units(m: ModelShape, tp: int = 1) -> list[Unit]:
    """Forward order: the root's first use (embeddings) comes before the blocks."""
    block = block_tensors(m, tp)
    return [Unit("root", root_tensors(m, tp))] + [Unit(f"layers.{i}", block) for i in range(m.n_layers)]


def param_count(m: ModelShape) -> int:
    return sum(u.numel for u in units(m, 1))


def non_embedding_params(m: ModelShape) -> int:
    return param_count(m) - m.vocab_size * m.dim


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, as the trainer counts them for MFU (6 N + attention)."""
    return 6.0 * non_embedding_params(m) + 12.0 * m.n_layers * m.dim * seq_len
