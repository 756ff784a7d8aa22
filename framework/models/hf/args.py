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


def _experts(cfg):
    """(number of routed experts, its key) that model.config or model.path's config.json states;
    (None, "") when it states none: a model without experts, or one using its config class's
    default, is then checked when it is built (framework/distributed/expert_parallel.py)."""
    import json
    import os

    data = cfg.config
    if not data and cfg.path and os.path.isfile(os.path.join(cfg.path, "config.json")):
        try:
            with open(os.path.join(cfg.path, "config.json")) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None, ""  # the build refuses an unreadable config.json by name
    for key in _EXPERT_KEYS:
        value = data.get(key) if hasattr(data, "get") else None
        if isinstance(value, int) and value > 0:
            return value, f"{key}={value}"
    return None, ""


def problems(cfg, tp: int, seq_len: int, data_vocab: int, ep: int = 1, cp: int = 1, pp: int = 1) -> List[str]:
    from framework.models.args import parse_args

    a = parse_args(HFArgs, cfg)
    if cp > 1:
        return [
            f"parallelism.cp={cp} with model=hf: a Hugging Face model's attention does not split its "
            "sequences yet (our Llama family's does); set parallelism.cp=1"
        ]
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
