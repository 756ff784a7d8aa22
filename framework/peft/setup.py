"""LoRA from the config: which layers, how their names are spelled, and what the job prints."""

from __future__ import annotations

from torch import nn

from framework.peft.lora import apply_lora, trainable_summary


def _alias_of(family, model_cfg):
    """Module name -> its Hugging Face spelling, from the family's state-dict adapter (our Llama's
    `layers.0.attention.wq` answers to `q_proj`); None when the family has no adapter."""
    if family.adapter is None:
        return None
    adapter = family.adapter(model_cfg)

    def alias(name: str) -> str:
        try:
            hf = adapter.to_hf(name + ".weight")
        except (KeyError, ValueError):
            return ""
        return hf[: -len(".weight")] if hf else ""

    return alias


def add_lora(model: nn.Module, lora_cfg, family, model_cfg, *, seed: int, rank0: bool = True) -> None:
    names = apply_lora(
        model,
        rank=lora_cfg.rank,
        alpha=lora_cfg.alpha,
        targets=list(lora_cfg.targets),
        dropout=lora_cfg.dropout,
        alias=_alias_of(family, model_cfg),
        seed=seed,
    )
    if rank0:
        print(
            f"LoRA rank {lora_cfg.rank} on {len(names)} layers ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}): {trainable_summary(model)}",
            flush=True,
        )
