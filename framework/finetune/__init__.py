"""Supervised fine-tuning (`stage=fine_tuning`): JSONL records, response-only loss, packing."""
