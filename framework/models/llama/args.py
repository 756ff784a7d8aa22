"""Our Llama family's arguments (`model.args`), its preset names and its checks; no torch, so the
planner and the launcher read them on a machine without it."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, List

from framework.errors import UserInputError

# The conf/model presets (tests/unit/test_model.py checks that every preset file is registered).
NAMES = (
    "debug",
    "small",
    "llama_125m",
    "llama_350m",
    "llama_1b",
    "llama_7b",
    "llama_13b",
    "llama_70b",
    "llama3_1_8b",
    "llama3_1_70b",
    "llama3_1_405b",
    "mistral_7b",
    "moe_debug",
    "mixtral_8x7b",
)

AUX_LOSS_SCOPES = ("global_batch", "micro_batch")  # model.args.aux_loss_scope


@dataclass
class LlamaArgs:
    """The sizes of one Llama (each conf/model preset sets them all under `args:`; override one
    with e.g. `model.args.n_layers=4`). The defaults are the debug preset's."""

    vocab_size: int = 256  # -1: take it from the data's tokenizer
    dim: int = 64  # hidden size
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads must be a multiple
    ffn_dim: int = 176  # SwiGLU inner size
    max_seq_len: int = 128  # the longest sequence the rotary table covers
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # null, or Llama 3's scaling: {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (framework/models/llama/model.py: llama3_frequencies)
    rope_scaling: Any = None
    tie_embeddings: bool = False  # share the token embedding with the output head
    init_std: float = 0.02
    # Mixture of experts (framework/models/llama/moe.py): 0 experts is the dense SwiGLU block
    n_experts: int = 0  # experts per block; each token goes to top_k of them
    top_k: int = 2
    moe_ffn_dim: int = 0  # each expert's SwiGLU inner size; 0: ffn_dim
    n_shared_experts: int = 0  # experts every token also goes through (DeepSeek/Qwen-MoE style)
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes at most factor x its fair share
    aux_loss_coef: float = 0.01  # the load-balancing loss (Switch/Mixtral) added to the training loss
    # Whose expert loads that loss balances: "micro_batch", each micro-batch's own (the numbers
    # depend on the micro-batch size and the ranks), or "global_batch", the whole optimizer step's
    # (every micro-batch of every rank, found by a forward-only routing pass before the step: the
    # same numbers on any layout, one more forward per step, which stage=plan does not count yet)
    aux_loss_scope: str = "micro_batch"
    # DeepSeek-V3's aux-loss-free balancing: > 0 adds a per-expert bias to the router probabilities
    # when choosing experts, moved by this much after every step towards the global batch's mean
    # load (down for an expert above it, up below); 0: no bias. Outside the gradient; checkpointed.
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.vocab_size != -1 and self.vocab_size <= 0:
            raise UserInputError(f"model.args.vocab_size={self.vocab_size}: must be > 0, or -1 (the tokenizer's)")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise UserInputError(f"model.args.{name}={getattr(self, name)}: must be > 0")
        if self.dim % self.n_heads:
            raise UserInputError(f"model.args.dim={self.dim} is not divisible by model.args.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserInputError(
                f"model.args.n_heads={self.n_heads} is not a multiple of model.args.n_kv_heads={self.n_kv_heads}"
            )
        if self.n_experts < 0 or self.n_shared_experts < 0 or self.moe_ffn_dim < 0:
            raise UserInputError("model.args.n_experts, n_shared_experts and moe_ffn_dim must be >= 0")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise UserInputError(
                f"model.args.top_k={self.top_k}: must be between 1 and model.args.n_experts={self.n_experts}"
            )
        if self.capacity_factor < 0 or self.aux_loss_coef < 0:
            raise UserInputError("model.args.capacity_factor and aux_loss_coef must be >= 0")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise UserInputError(
                f"model.args.aux_loss_scope={self.aux_loss_scope!r}: choose one of {', '.join(AUX_LOSS_SCOPES)}"
            )
        if not 0 <= self.bias_update_rate < 1:
            raise UserInputError(
                f"model.args.bias_update_rate={self.bias_update_rate}: must be >= 0 (0: no bias) and < 1 "
                "(DeepSeek-V3 used 0.001)"
            )
        if (self.dim // self.n_heads) % 2:
            raise UserInputError(
                f"model.args.dim / model.args.n_heads = {self.dim // self.n_heads}: rotary embeddings need an "
                "even head size"
            )


def llama_args(cfg) -> LlamaArgs:
    """A ModelConfig's Llama arguments (refused in one line where a field is unknown or mistyped)."""
    from framework.models.args import parse_args

    return parse_args(LlamaArgs, cfg)


def with_vocab_size(cfg, vocab_size: int):
    """`cfg` with the vocabulary the data decided (model.args.vocab_size=-1)."""
    return dataclasses.replace(cfg, args={**dict(cfg.args or {}), "vocab_size": vocab_size})


def problems(cfg, tp: int, seq_len: int, data_vocab: int, ep: int = 1, cp: int = 1, pp: int = 1) -> List[str]:
    """The refusals of these arguments for a job with this tensor-parallel degree, expert-parallel
    degree, sequence length and pipeline degree (see framework/models/families.py); advice that does
    not stop the job is logged."""
    a = llama_args(cfg)
    out: List[str] = []
    if cp > 1:
        heads = a.n_heads // tp if a.n_heads % tp == 0 else a.n_heads
        if seq_len % cp:
            out.append(f"data.seq_len={seq_len} is not divisible by parallelism.cp={cp}; choose a cp that divides it")
        if heads % cp:
            out.append(
                f"parallelism.cp={cp} does not divide the {heads} attention heads per tensor-parallel rank "
                f"(model.args.n_heads={a.n_heads} / tp={tp}): each cp rank attends with 1/cp of them"
            )
        # Each cp rank routes its chunk of a sequence: the per-micro-batch shares and the capacity
        # would be the chunk's, not the sequence's ([Note: the layout of expert parallelism]).
        if a.n_experts and a.aux_loss_coef > 0 and a.aux_loss_scope != "global_batch":
            out.append(
                f"parallelism.cp={cp} with model.args.aux_loss_scope={a.aux_loss_scope}: each cp rank routes a "
                "chunk of every sequence, whose expert shares are not the micro-batch's; set "
                "model.args.aux_loss_scope=global_batch (or parallelism.cp=1)"
            )
        if a.n_experts and a.capacity_factor:
            out.append(
                f"parallelism.cp={cp} with model.args.capacity_factor={a.capacity_factor}: each cp rank would "
                "cap a chunk of every sequence, not the whole; set model.args.capacity_factor=0 (dropless) or "
                "parallelism.cp=1"
            )
    if ep > 1 and not a.n_experts:
        out.append(
            f"parallelism.ep={ep}: model.name={cfg.name} has no experts (model.args.n_experts=0); set parallelism.ep=1"
        )
    elif ep > 1 and a.n_experts % ep:
        out.append(
            f"parallelism.ep={ep} does not divide model.args.n_experts={a.n_experts}: every expert-parallel rank "
            "holds the same number of experts; choose an ep that divides n_experts"
        )
    if tp > 1:
        for name in ("n_heads", "n_kv_heads", "dim", "ffn_dim"):
            value = getattr(a, name)
            if value % tp:
                out.append(
                    f"model.args.{name}={value} is not divisible by parallelism.tp={tp}; choose a tp that divides it"
                )
        shared = (a.moe_ffn_dim or a.ffn_dim) * a.n_shared_experts if a.n_experts else 0
        if shared % tp:  # the shared experts are split as the dense feed-forward; the routed ones are whole
            out.append(
                f"the shared experts' inner size {shared} (model.args.moe_ffn_dim x n_shared_experts) is not "
                f"divisible by parallelism.tp={tp}; choose a tp that divides it"
            )
        vocab = a.vocab_size if a.vocab_size > 0 else data_vocab
        if vocab and vocab % tp:
            # Not refused: DTensor shards the embedding table and the output head unevenly
            # (torch.chunk sizes: ceil(vocab / tp) rows, the last rank fewer; its collectives pad
            # the short shard) and the numbers are exact (tests/tp). Said, because the work is
            # unbalanced and an even size is one config value away.
            per_rank = -(-vocab // tp)
            if os.environ.get("RANK", "0") == "0":
                logging.getLogger("framework.config").warning(
                    f"vocabulary size {vocab} is not divisible by parallelism.tp={tp}: the embedding and "
                    f"output head are split unevenly (at most {per_rank} rows per rank, the short shards "
                    f"padded in communication); for even shards pad model.args.vocab_size to {per_rank * tp}"
                )
    if seq_len > a.max_seq_len:
        out.append(
            f"data.seq_len={seq_len} is longer than model.args.max_seq_len={a.max_seq_len} of model={cfg.name}; "
            "lower data.seq_len"
        )
    return out


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(cfg) -> None:
    """model.args.rope_scaling: null or a complete Llama 3 scaling."""
    a = llama_args(cfg)
    scaling = a.rope_scaling
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if hasattr(scaling, "get") else None
    missing = [k for k in ROPE_SCALING_KEYS if not hasattr(scaling, "get") or k not in scaling]
    if kind != "llama3" or missing:
        raise UserInputError(
            f"model.args.rope_scaling={scaling!r}: only Llama 3's scaling is implemented; give "
            "{rope_type: llama3, factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
            "original_max_position_embeddings: 8192} or null"
        )


def check(cfg) -> None:
    """The family's own refusals of `model.args` (an unknown or mistyped field, rope_scaling), without torch."""
    check_rope_scaling(cfg)
