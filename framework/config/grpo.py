"""The `grpo` section (`stage=grpo`, framework/grpo/) and the checks of a GRPO job that span sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from framework.errors import UserInputError

# The built-in rewards (framework/grpo/rewards.py): each scores one completion.
BUILTIN_REWARDS = ("exact_match", "format", "length")

# grpo.scale_rewards: TRL's values, and its booleans (true: group, false: none)
SCALE_REWARDS = ("group", "batch", "none")


class GRPOLoss(str, Enum):
    """How the token terms of [Note: the GRPO objective] (framework/grpo/loss.py) are averaged:
    TRL's loss_type values of the same names."""

    grpo = "grpo"  # each completion's token mean, then the mean over completions
    dapo = "dapo"  # the sum over the global batch's completion tokens / their count
    dr_grpo = "dr_grpo"  # the sum over a micro-batch's tokens / (its completions x grpo.max_new_tokens)
    bnpo = "bnpo"  # the sum over a micro-batch's tokens / their count (depends on the micro-batch size)


@dataclass
class GRPOConfig:
    """stage=grpo: reinforcement learning from rewards on data=hf prompts (framework/grpo/;
    docs/fine_tuning.md "stage=grpo")."""

    num_generations: int = 4  # G: completions sampled per prompt (its group)
    max_new_tokens: int = 16  # the longest completion
    temperature: float = 1.0  # sampling temperature; the log-probabilities use the same one (as TRL)
    top_k: int = 0  # 0: the whole vocabulary
    top_p: float = 1.0
    epsilon: float = 0.2  # the ratio's clip range [1 - epsilon, 1 + epsilon_high]
    epsilon_high: Optional[float] = None  # the clip range's upper side; None: epsilon (TRL's default)
    # The KL penalty to the frozen reference; 0 (TRL's default): no reference model is built at all
    beta: float = 0.0
    loss_type: GRPOLoss = GRPOLoss.dapo  # TRL's default
    # The advantages' divisor: group (the group's reward std, TRL's default), batch (the global
    # batch's), none (no division: Dr. GRPO); true and false are TRL's group and none
    scale_rewards: str = "group"
    # The KL term times the ratio (importance-sampled to the current policy; TRL's default
    # use_bias_correction_kl=True); false: the plain estimate
    kl_bias_correction: bool = True
    iterations: int = 1  # optimizer steps on each batch of rollouts (old log-probs taken once per batch)
    # Built-in rewards summed into a completion's reward (BUILTIN_REWARDS), each times its weight.
    rewards: List[str] = field(default_factory=lambda: ["exact_match"])
    reward_weights: List[float] = field(default_factory=list)  # one per reward (then the user's); empty: all 1
    answer_field: str = "answer"  # the record's column exact_match compares with
    # exact_match: the first group of this regular expression in the completion is the answer
    # (no group: the whole match); no match scores 0
    answer_regex: str = r"(-?\d+)"
    format_regex: str = r"^ ?-?\d+$"  # format: 1 when the completion's text matches (re.search), else 0
    length_target: int = 8  # length: 1 - |tokens - target| / target, at least 0
    # A reward function of the user's own: "module.path:function" or "<path>.py:function", called as
    # TRL's GRPOTrainer calls one: fn(prompts=, completions=, completion_ids=, **columns) -> list of
    # floats ([Note: the GRPO rewards] in framework/grpo/rewards.py). It runs the user's code in every
    # rank, so it is loaded only with trust_reward_code=true.
    reward_module: str = ""
    trust_reward_code: bool = False  # true: import and run reward_module's code
    disable_dropout: bool = True

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise UserInputError(
                f"grpo.num_generations={self.num_generations}: give 2 or more (advantages compare a group)"
            )
        if self.max_new_tokens < 1:
            raise UserInputError(f"grpo.max_new_tokens={self.max_new_tokens}: give 1 or more")
        if not 0 < self.temperature < math.inf:
            raise UserInputError(f"grpo.temperature={self.temperature}: must be > 0 (sampling) and finite")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserInputError(f"grpo.top_p={self.top_p}, grpo.top_k={self.top_k}: top_p in (0, 1], top_k >= 0")
        if not 0 < self.epsilon < 1:
            raise UserInputError(f"grpo.epsilon={self.epsilon}: must be in (0, 1)")
        if self.epsilon_high is not None and not 0 < self.epsilon_high < math.inf:
            raise UserInputError(f"grpo.epsilon_high={self.epsilon_high}: must be > 0 and finite (unset: grpo.epsilon)")
        self.loss_type = GRPOLoss(self.loss_type)
        scale = {"true": "group", "false": "none"}.get(str(self.scale_rewards).lower(), str(self.scale_rewards))
        if scale not in SCALE_REWARDS:
            raise UserInputError(
                f"grpo.scale_rewards={self.scale_rewards!r}: choose from {', '.join(SCALE_REWARDS)} (or true: group, "
                "false: none)"
            )
        self.scale_rewards = scale
        if not 0 <= self.beta < math.inf:
            raise UserInputError(f"grpo.beta={self.beta}: must be >= 0 and finite (0: no reference model)")
        if self.iterations < 1:
            raise UserInputError(f"grpo.iterations={self.iterations}: give 1 or more")
        self.rewards = list(self.rewards)
        for name in self.rewards:
            if name not in BUILTIN_REWARDS:
                raise UserInputError(f"grpo.rewards: {name!r} is unknown; choose from {', '.join(BUILTIN_REWARDS)}")
        if not self.rewards and not self.reward_module:
            raise UserInputError("grpo.rewards is empty and grpo.reward_module unset: give at least one reward")
        self.reward_weights = [float(w) for w in self.reward_weights]
        count = len(self.rewards) + bool(self.reward_module)
        if self.reward_weights and len(self.reward_weights) != count:
            raise UserInputError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for {count} rewards "
                "(grpo.rewards, then grpo.reward_module); give one each or none"
            )
        if self.length_target < 1:
            raise UserInputError(f"grpo.length_target={self.length_target}: give 1 or more")
        if self.reward_module and ":" not in self.reward_module:
            raise UserInputError(
                f"grpo.reward_module={self.reward_module!r}: give 'module.path:function' or '<path>.py:function'"
            )


def grpo_problems(cfg) -> List[str]:
    """What a stage=grpo job refuses before any rank starts: its data, its reward code, its layouts."""
    import re

    problems = []
    g, p, d = cfg.grpo, cfg.parallelism, cfg.data
    if d.name != "hf" or not d.paths:  # DataName.hf (schema.py imports this file)
        problems.append(
            "stage=grpo reads its prompts through data=hf: set data=hf data.paths=[<JSONL or parquet files "
            "of prompt and answer>]"
        )
    if d.weights:
        problems.append("stage=grpo reads every path's records once, in turn: remove data.weights")
    if d.hf.streaming:
        problems.append("stage=grpo holds its prompts in memory: set data.hf.streaming=false")
    if g.reward_module and not g.trust_reward_code:
        problems.append(
            f"grpo.reward_module={g.reward_module!r} runs your own code in every rank: set "
            "grpo.trust_reward_code=true to allow it"
        )
    for name in ("answer_regex", "format_regex"):
        try:
            re.compile(getattr(g, name))
        except re.error as exc:
            problems.append(f"grpo.{name}={getattr(g, name)!r} is not a regular expression: {exc}")
    if p.tp > 1 and p.sequence_parallel:
        problems.append(
            "stage=grpo with parallelism.sequence_parallel=true: generation takes one token at a time; "
            "set parallelism.sequence_parallel=false"
        )
    return problems
