"""Reinforcement learning from rewards (`stage=grpo`): GRPO on data=hf prompts (docs/fine_tuning.md)."""
