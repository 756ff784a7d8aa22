"""Parameter-efficient fine-tuning: LoRA adapters on a frozen, sharded base model."""

from framework.peft.lora import (  # noqa: F401
    adapter_state,
    apply_lora,
    is_adapter,
    merge_lora_,
    merged_state,
    reset_lora,
    trainable_summary,
)
