"""The `dpo` section (`stage=dpo`, framework/dpo/) and the checks of a DPO job that span sections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import List

from framework.errors import UserInputError


class PreferenceLoss(str, Enum):
    sigmoid = "sigmoid"  # DPO: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))
    ipo = "ipo"  # IPO: (per-token log-ratio difference - 1 / (2 beta))^2
    simpo = "simpo"  # SimPO: reference-free, -log sigmoid(beta * (mean logp chosen - mean logp rejected) - gamma)


@dataclass
class DPOConfig:
    """stage=dpo: preference optimization on data=hf records of a prompt, a chosen and a rejected
    reply (framework/dpo/; docs/fine_tuning.md "stage=dpo")."""

    loss: PreferenceLoss = PreferenceLoss.sigmoid
    beta: float = 0.1  # the strength of the implicit KL penalty (sigmoid, ipo); SimPO's reward scale
    # sigmoid and simpo: the fraction of pairs taken to be mislabelled (conservative DPO); 0: none
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    # The record's columns; the prompt's is data.hf.prompt_field. Each a string (plain text) or a
    # list of {role, content} (the tokenizer's chat template); without a prompt column, chosen and
    # rejected conversations share their leading turns as the prompt.
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    disable_dropout: bool = True  # dropout off in the policy and the reference (as TRL does)

    def __post_init__(self) -> None:
        try:
            self.loss = PreferenceLoss(self.loss)
        except ValueError:
            choices = ", ".join(e.value for e in PreferenceLoss)
            raise UserInputError(f"dpo.loss={self.loss!r}: unknown; choose one of {choices}") from None
        if not 0 < self.beta < math.inf:
            raise UserInputError(f"dpo.beta={self.beta}: must be > 0 and finite")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserInputError(f"dpo.label_smoothing={self.label_smoothing}: must be in [0, 0.5)")
        if self.label_smoothing and self.loss == PreferenceLoss.ipo:
            raise UserInputError(
                "dpo.label_smoothing applies to dpo.loss=sigmoid or simpo, not ipo; set dpo.label_smoothing=0"
            )
        if not -math.inf < self.simpo_gamma < math.inf:
            raise UserInputError(f"dpo.simpo_gamma={self.simpo_gamma}: must be finite")
        for name in ("chosen_field", "rejected_field"):
            if not getattr(self, name).strip():
                raise UserInputError(f"dpo.{name} is empty: name the record's column")


def dpo_problems(cfg) -> List[str]:
    """What a stage=dpo job refuses before any rank starts: its data (every layout runs it)."""
    problems = []
    d = cfg.data
    if d.name != "hf" or not d.paths:  # DataName.hf (schema.py imports this file)
        problems.append(
            "stage=dpo reads preference records through data=hf: set data=hf data.paths=[<JSONL or parquet "
            "files of prompt, chosen and rejected>]"
        )
    if d.weights:
        problems.append("stage=dpo reads every path's records once, in turn: remove data.weights")
    if d.hf.streaming:
        problems.append("stage=dpo holds its preference records in memory: set data.hf.streaming=false")
    if cfg.dpo.chosen_field == cfg.dpo.rejected_field:
        problems.append(f"dpo.chosen_field and dpo.rejected_field are both {cfg.dpo.chosen_field!r}: name two columns")
    return problems
