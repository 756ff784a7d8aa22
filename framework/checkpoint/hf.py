"""Hugging Face style export (`model.safetensors` + `config.json`, Llama key names) and import.

[Note: streamed export]
The file is written one tensor at a time: the header (names, dtypes, shapes, offsets) is known
from the sharded state dict's global shapes before any data is gathered, so rank 0 writes it
first; then each parameter is gathered (`DTensor.full_tensor()`, a collective every rank joins),
appended by rank 0 and dropped. No rank ever holds more than one full tensor. Import is the
reverse without any communication: every rank opens the file lazily (`safe_open`) and cuts its
own shard out of each tensor.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Dict, Optional, Tuple

import torch

from framework.config.schema import ModelConfig

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# Our parameter names -> Hugging Face LlamaForCausalLM names. The rotary layout (rotate halves)
# and the grouping of query heads per KV head (repeat_interleave) are the same as HF Llama's, so
# the weights map one to one, without permutation.
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


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "torch_dtype": str(dtype).replace("torch.", ""),
        "initializer_range": cfg.init_std, "attention_bias": False,
    }


def _exported_names(model_sd: Dict[str, torch.Tensor], tied: bool):
    return [n for n in model_sd if not (tied and n == "output.weight")]


def export_safetensors(model_sd: Dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str,
                       rank: int) -> Optional[str]:
    """Write `out_dir/model.safetensors` and `config.json`; every rank must call it (the gathers
    are collectives). See [Note: streamed export]. Returns the file's path on rank 0."""
    names = _exported_names(model_sd, model_cfg.tie_embeddings)
    header, offset = {}, 0
    for name in names:
        t = model_sd[name]
        if t.dtype not in _DTYPES:
            raise NotImplementedError(f"export of {name}: dtype {t.dtype} is not supported")
        nbytes = t.numel() * t.element_size()
        header[to_hf_name(name)] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                                    "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    path = os.path.join(out_dir, "model.safetensors")
    f = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        f = open(path + ".tmp", "wb")
        f.write(struct.pack("<Q", len(raw)) + raw)
    try:
        for name in names:
            t = model_sd[name]
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            if f is not None:
                f.write(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            del full
    finally:
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            f.close()
    if rank == 0:
        os.replace(path + ".tmp", path)
        dtype = next(iter(model_sd.values())).dtype
        with open(os.path.join(out_dir, "config.json"), "w") as cf:
            json.dump(hf_config(model_cfg, dtype), cf, indent=2)
        return path
    return None


def _local_piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full`, laid out like the sharded tensor `like`."""
    if not hasattr(like, "device_mesh"):
        return full.to(like.dtype)
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank already has the full tensor; cut locally, communicate nothing.
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def check_config(directory: str, model_cfg: ModelConfig) -> None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        hf = json.load(f)
    want = hf_config(model_cfg, torch.float32)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads"):
        if key in hf and hf[key] != want[key]:
            raise ValueError(f"checkpoint.init_from={directory}: its config.json has {key}={hf[key]} but "
                             f"model={model_cfg.name} has {want[key]}; choose the matching model preset")


def import_safetensors(directory: str, model_sd: Dict[str, torch.Tensor],
                       model_cfg: ModelConfig) -> Tuple[Dict[str, torch.Tensor], int]:
    """A state dict shaped like `model_sd` (sharded) with values read from `directory`."""
    from safetensors import safe_open

    check_config(directory, model_cfg)
    path = os.path.join(directory, "model.safetensors")
    out = {}
    with safe_open(path, framework="pt") as f:
        present = set(f.keys())
        for name, like in model_sd.items():
            key = to_hf_name(name)
            if key not in present and name == "output.weight" and model_cfg.tie_embeddings:
                key = to_hf_name("tok_embeddings.weight")
            if key not in present:
                raise ValueError(f"checkpoint.init_from={directory}: model.safetensors has no {key} "
                                 f"(our {name}); it is not an export of model={model_cfg.name}")
            full = f.get_tensor(key)
            if tuple(full.shape) != tuple(like.shape):
                raise ValueError(f"checkpoint.init_from={directory}: {key} has shape {tuple(full.shape)}, "
                                 f"model={model_cfg.name} needs {tuple(like.shape)}")
            out[name] = _local_piece(full, like)
            del full
    return out, len(out)
