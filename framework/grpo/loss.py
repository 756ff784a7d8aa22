"""GRPO's advantages and its clipped-ratio objective.

[Note: the GRPO objective]
For a prompt's group of G completions with rewards r_1..r_G, each completion's advantage is
A_i = (r_i - mean(r)) / (s + 1e-4), with s by grpo.scale_rewards (TRL's, of the same name): group,
the group's std; batch, the std of the global batch's rewards; none, no division (A_i = r_i - mean(r)).
Each std takes Bessel's correction. For a completion token t with the policy's log-probability
logp_t, the rollout policy's old_t (taken once per batch of rollouts, before its grpo.iterations
optimizer steps) and the reference's ref_t (all from the logits divided by grpo.temperature, as TRL):

    ratio_t = exp(logp_t - old_t)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                    (0 when beta = 0)
              times ratio_t with grpo.kl_bias_correction (TRL's default use_bias_correction_kl)
    loss_t  = -min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps_high) A) + beta kl_t

eps_high is grpo.epsilon_high (unset: grpo.epsilon). The token terms are averaged by grpo.loss_type
(TRL's loss_type, the same formulas):
- grpo: each completion's mean of loss_t over its tokens (its end-of-text included), then the mean
  over completions;
- dapo: the sum of loss_t over every completion token of the global batch (all ranks, all
  micro-batches) divided by their count;
- dr_grpo: a micro-batch's sum divided by its completions x grpo.max_new_tokens (TRL's
  max_completion_length);
- bnpo: a micro-batch's sum divided by its completion tokens (so it depends on
  trainer.micro_batch_size, as TRL's on per_device_train_batch_size).
Every micro-batch holds the same number of completions and the trainer averages the micro-batches'
losses over the micro-batches and the ranks; for dapo a micro-batch's loss is its sum divided by
the global batch's token count over (micro-batches x data-parallel ranks), so that average is the
global token mean. A token counts as clipped when the clip changed its term: ratio < 1 - eps with
A < 0, or ratio > 1 + eps_high with A > 0 (TRL's clip_ratio/region_mean).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group", batch_std=None) -> torch.Tensor:
    """(prompts * group,) rewards, a prompt's completions adjacent -> their advantages, divided by
    grpo.scale_rewards' std (`batch_std`: the global batch's, for "batch"). A NaN reward (every
    reward function returned None) is left out of its group's mean and std; its advantage is 0."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)  # NaN: a completion with no reward, left out
    if scale == "group":
        centred = centred / (nan_std(grouped, dim=1) + 1e-4)
    elif scale == "batch":
        centred = centred / (batch_std + 1e-4)
    return torch.nan_to_num(centred.flatten(), nan=0.0)  # no reward: no advantage (as TRL)


def nan_std(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The std (Bessel's) along `dim` of the values that are not NaN (kept dim)."""
    present = ~torch.isnan(values)
    count = present.sum(dim=dim, keepdim=True).to(values.dtype)
    deviations = torch.where(present, values - values.nanmean(dim=dim, keepdim=True), 0.0)
    return ((deviations * deviations).sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)).sqrt()


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    beta: float,
    kl_bias_correction: bool = True,
    *,
    loss_type: str = "grpo",
    epsilon_high: Optional[float] = None,
    max_completion_length: Optional[int] = None,
    tokens_per_micro_batch: Optional[float] = None,
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(the micro-batch's loss, token sums of the statistics) by [Note: the GRPO objective]. logps,
    old_logps, ref_logps, mask: (completions, tokens); advantages: (completions,). dr_grpo needs
    `max_completion_length`; dapo `tokens_per_micro_batch`, the global batch's completion tokens
    over (micro-batches x data-parallel ranks). The sums: `kl`, `clipped` over the completion
    tokens, and `tokens`, their count."""
    high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        assert ref_logps is not None, "grpo: beta > 0 needs the reference's log-probabilities"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    total = per_token * mask
    loss_type = getattr(loss_type, "value", loss_type)
    if loss_type == "grpo":
        loss = (total.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = total.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        assert max_completion_length, "grpo: dr_grpo divides by the longest completion (max_completion_length)"
        loss = total.sum() / (total.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        assert tokens_per_micro_batch is not None, "grpo: dapo divides by the global batch's tokens"
        loss = total.sum() / max(float(tokens_per_micro_batch), 1.0)
    else:
        raise AssertionError(f"grpo: unknown loss_type {loss_type!r}")
    with torch.no_grad():
        clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        stats = {
            "kl": (kl.detach() * mask).sum(),
            "clipped": (clipped.to(mask.dtype) * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, stats
