"""Preference optimization (`stage=dpo`): DPO, IPO and SimPO on data=hf pairs (docs/fine_tuning.md)."""
