"""The Hugging Face family's own arguments (`model.args`) and checks; no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

NAMES = ("hf",)


@dataclass
class HFArgs:
    # the longest data.seq_len accepted; the model's own position limit still applies
    max_seq_len: int = 1024


# config.json's name for the number of routed experts, by family (transformers' own keys)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


# Model types whose attention context parallelism splits (framework/models/hf/context.py), each
# tested against one process; the family's attention call is transformers' shared one. The
# mixture-of-experts ones (Mixtral, Qwen3-MoE, DeepSeek-V3's MLA, gpt-oss's sinks) with or without
# parallelism.ep.
CONTEXT_PARALLEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _stated(cfg) -> dict:
    """model.config, or model.path's config.json ({} when unreadable: the build refuses it by name)."""
    import json
    import os

    data = cfg.config
    if not data and cfg.path and os.path.isfile(os.path.join(cfg.path, "config.json")):
        try:
            with open(os.path.join(cfg.path, "config.json")) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
    return data if hasattr(data, "get") else {}


def _experts(cfg):
    """(number of routed experts, its key) that model.config or model.path's config.json states;
    (None, "") when it states none: a model without experts, or one using its config class's
    default, is then checked when it is built (framework/distributed/expert_parallel.py)."""
    data = _stated(cfg)
    for key in _EXPERT_KEYS:
        value = data.get(key)
        if isinstance(value, int) and value > 0:
            return value, f"{key}={value}"
    return None, ""


def problems(cfg, tp: int, seq_len: int, data_vocab: int, ep: int = 1, cp: int = 1, pp: int = 1) -> List[str]:
    from framework.models.args import parse_args

    a = parse_args(HFArgs, cfg)
    if cp > 1:
        out = _context_parallel_problems(cfg, cp, tp, seq_len)
        if out:
            return out
    if ep > 1:
        n, key = _experts(cfg)
        if n is not None and n % ep:
            return [
                f"parallelism.ep={ep} does not divide the {n} experts of model=hf ({key}); "
                "choose an ep that divides them"
            ]
    if seq_len > a.max_seq_len:
        return [
            f"data.seq_len={seq_len} is longer than model.args.max_seq_len={a.max_seq_len} of model=hf; "
            "lower data.seq_len or raise model.args.max_seq_len"
        ]
    return []


def _context_parallel_problems(cfg, cp: int, tp: int, seq_len: int) -> List[str]:
    """What context parallelism needs of the model: an attention it splits, a sequence and heads (per
    tensor-parallel rank) that cp divides; values the config leaves to its class's defaults are
    checked when the model is built."""
    data = _stated(cfg)
    kind = data.get("model_type")
    if kind is not None and kind not in CONTEXT_PARALLEL_TYPES:
        return [
            f"parallelism.cp={cp} with model=hf model_type={kind}: only {', '.join(CONTEXT_PARALLEL_TYPES)} "
            "attention is split over the sequence here (each tested against one process); set parallelism.cp=1"
        ]
    if seq_len % cp:
        return [f"data.seq_len={seq_len} is not divisible by parallelism.cp={cp}; choose a cp that divides it"]
    heads = data.get("num_attention_heads")
    if isinstance(heads, int) and tp > 0 and heads % tp == 0 and (heads // tp) % cp:
        return [
            f"parallelism.cp={cp} does not divide the {heads // tp} attention heads per tensor-parallel rank "
            f"of model=hf (num_attention_heads={heads}, tp={tp}); choose a cp that divides them"
        ]
    return []
