"""Our Llama's state-dict names <-> Hugging Face `LlamaForCausalLM` names, and its `config.json`.

The rotary layout (rotate halves) and the grouping of query heads per KV head (repeat_interleave)
are the same as Hugging Face Llama's, so the weights map one to one, without permutation.
"""
from __future__ import annotations

import re

import torch

from framework.config.schema import ModelConfig
from framework.errors import UserInputError

_TO_HF = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
]


def to_hf_name(name: str) -> str:
    for pattern, replacement in _TO_HF:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise KeyError(f"parameter {name} has no Hugging Face Llama name; extend _TO_HF in {__file__}")


class LlamaAdapter:
    def __init__(self, tied: bool = False):
        self.tied = tied

    def to_hf(self, name: str) -> str | None:
        return None if self.tied and name == "output.weight" else to_hf_name(name)

    def from_hf_fallback(self, name: str) -> str | None:
        return to_hf_name("tok_embeddings.weight") if self.tied and name == "output.weight" else None

    def hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict:
        return hf_config(cfg, dtype)

    def check_hf_config(self, hf: dict, cfg: ModelConfig, where: str) -> None:
        check_hf_config(hf, cfg, where)


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "torch_dtype": str(dtype).replace("torch.", ""),
        "initializer_range": cfg.init_std, "attention_bias": False, "mlp_bias": False,
    }


def check_hf_config(hf: dict, cfg: ModelConfig, where: str) -> None:
    """Refuse a config.json whose model computes differently from `cfg`, naming the field."""
    want = hf_config(cfg, torch.float32)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads"):
        if key in hf and hf[key] != want[key]:
            raise UserInputError(f"{where}: its config.json has {key}={hf[key]} but model={cfg.name} has "
                                 f"{want[key]}; choose the matching model preset")
