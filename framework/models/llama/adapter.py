"""Our Llama's state-dict names <-> Hugging Face `LlamaForCausalLM` names, and its `config.json`.

The rotary layout (rotate halves) and the grouping of query heads per KV head (repeat_interleave)
are the same as Hugging Face Llama's, so the weights map one to one, without permutation.
"""

from __future__ import annotations

import json
import os
import re

import torch

from framework.config.schema import ModelConfig
from framework.errors import UserInputError
from framework.models.llama.args import ROPE_SCALING_KEYS, check_rope_scaling, llama_args  # noqa: F401

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

    def write_extras(self, out_dir: str, tokenizer, cfg: ModelConfig) -> None:
        write_extras(out_dir, tokenizer, cfg)


EOD_ID = 0  # our end-of-document token: the first special token of every tokenizer we train


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    a = llama_args(cfg)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.dim // a.n_heads,
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).replace("torch.", ""),
        "initializer_range": a.init_std,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": EOD_ID,
        "eos_token_id": EOD_ID,
        "pad_token_id": EOD_ID,
    }
    if a.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", **{k: a.rope_scaling[k] for k in ROPE_SCALING_KEYS}}
    return config


def _rope_of(hf: dict) -> tuple:
    """(rope_theta, scaling dict or None) from a config.json, old style (rope_theta, rope_scaling)
    or transformers 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in (hf.get("rope_scaling") or params).items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (None if kind == "default" else dict(scaling, rope_type=kind))


def check_hf_config(hf: dict, cfg: ModelConfig, where: str) -> None:
    """Refuse, in one line naming the field and the setting that matches, a config.json whose
    model computes differently from `cfg`: every field that changes the computation is compared."""
    a = llama_args(cfg)

    def refuse(message: str) -> None:
        raise UserInputError(f"{where}: its config.json has {message}")

    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        refuse(
            f"model_type={model_type!r}; our Llama reads Llama checkpoints only (use model=hf model.path=<dir> "
            "for other types)"
        )
    want = hf_config(cfg, torch.float32)
    for key, field in (
        ("vocab_size", "vocab_size"),
        ("hidden_size", "dim"),
        ("intermediate_size", "ffn_dim"),
        ("num_hidden_layers", "n_layers"),
        ("num_attention_heads", "n_heads"),
        ("num_key_value_heads", "n_kv_heads"),
        ("head_dim", None),
    ):
        if key in hf and hf[key] is not None and hf[key] != want[key]:
            fix = (
                f"set model.args.{field}={hf[key]}"
                if field
                else "this head size is not dim / n_heads, which our Llama needs"
            )
            refuse(f"{key}={hf[key]} but model={cfg.name} has {want[key]}; {fix} (or choose the matching preset)")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={hf['hidden_act']!r}; our Llama's feed-forward is SwiGLU (silu) only")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(f"{key}=true; our Llama has no bias tensors (a Qwen2-style model: use model=hf model.path=<dir>)")
    theta, scaling = _rope_of(hf)
    if abs(theta - a.rope_theta) > 1e-6 * theta:
        refuse(f"rope_theta={theta:g} but model.args.rope_theta={a.rope_theta:g}; set model.args.rope_theta={theta:g}")
    if scaling is not None and scaling["rope_type"] != "llama3":
        refuse(f"rope scaling of type {scaling['rope_type']!r}; only llama3 scaling is implemented")
    ours = {"rope_type": "llama3", **{k: a.rope_scaling[k] for k in ROPE_SCALING_KEYS}} if a.rope_scaling else None
    theirs = {"rope_type": "llama3", **{k: scaling.get(k) for k in ROPE_SCALING_KEYS}} if scaling else None
    if ours != theirs:
        shown = "{" + ", ".join(f"{k}: {v}" for k, v in theirs.items()) + "}" if theirs else "null"
        refuse(f"rope_scaling={theirs} but model.args.rope_scaling={ours}; set 'model.args.rope_scaling={shown}'")
    eps = hf.get("rms_norm_eps", a.norm_eps)
    if abs(eps - a.norm_eps) > 1e-12:
        refuse(f"rms_norm_eps={eps:g} but model.args.norm_eps={a.norm_eps:g}; set model.args.norm_eps={eps:g}")
    tied = bool(hf.get("tie_word_embeddings", False))  # transformers' LlamaConfig default
    if tied != a.tie_embeddings:
        refuse(
            f"tie_word_embeddings={str(tied).lower()} but model.args.tie_embeddings={str(a.tie_embeddings).lower()}; "
            f"set model.args.tie_embeddings={str(tied).lower()}"
        )


def write_extras(out_dir: str, tokenizer, cfg: ModelConfig) -> None:
    """What a transformers user needs besides the weights: the generation config (stop at our
    end-of-document token) and, when the job had one, the tokenizer."""
    from framework.fileio import copy_file, replace_file

    a = llama_args(cfg)
    eod = getattr(tokenizer, "eod", EOD_ID) if tokenizer is not None else EOD_ID
    with replace_file(os.path.join(out_dir, "generation_config.json")) as f:  # never through a planted link
        json.dump(
            {
                "bos_token_id": eod,
                "eos_token_id": eod,
                "pad_token_id": eod,
                "do_sample": True,
                "temperature": 0.8,
                "top_k": 20,
                "max_length": a.max_seq_len,
            },
            f,
            indent=2,
        )
    path = getattr(tokenizer, "path", None)
    if not path:
        return
    copy_file(path, os.path.join(out_dir, "tokenizer.json"))
    token = tokenizer.decode([eod]) if hasattr(tokenizer, "decode") else None
    with replace_file(os.path.join(out_dir, "tokenizer_config.json")) as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": token,
                "eos_token": token,
                "pad_token": token,
                "model_max_length": a.max_seq_len,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=2,
        )
