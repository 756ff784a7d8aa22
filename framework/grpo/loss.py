"""GRPO's advantages and its clipped-ratio objective.

[Note: the GRPO objective]
For a prompt's group of G completions with rewards r_1..r_G, each completion's advantage is
A_i = (r_i - mean(r)) / (std(r) + 1e-4), std with Bessel's correction (TRL's scale_rewards="group").
For a completion token t with the policy's log-probability logp_t, the rollout policy's old_t (taken
once per batch of rollouts, before its grpo.iterations optimizer steps) and the reference's ref_t
(all from the logits divided by grpo.temperature, as TRL):

    ratio_t = exp(logp_t - old_t)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                    (0 when beta = 0)
              times ratio_t with grpo.kl_bias_correction (TRL's default use_bias_correction_kl)
    loss_t  = -min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A) + beta kl_t

A completion's loss is the mean of loss_t over its tokens (its end-of-text included), the batch's
the mean over completions: TRL's loss_type="grpo". Every micro-batch holds the same number of
completions, so the mean of the micro-batches' means over the ranks is the global batch's mean.
A token counts as clipped when the clip changed its term: ratio < 1 - eps with A < 0, or
ratio > 1 + eps with A > 0 (TRL's clip_ratio/region_mean).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """(prompts * group,) rewards, a prompt's completions adjacent -> their advantages."""
    grouped = rewards.view(-1, group)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).flatten()


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float,
    beta: float,
    kl_bias_correction: bool = True,
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(the batch's loss, token sums of the statistics) by [Note: the GRPO objective]. logps,
    old_logps, ref_logps, mask: (completions, tokens); advantages: (completions,). The sums:
    `kl`, `clipped` over the completion tokens, and `tokens`, their count."""
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        assert ref_logps is not None, "grpo: beta > 0 needs the reference's log-probabilities"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    with torch.no_grad():
        clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon) & (adv > 0))
        stats = {
            "kl": (kl.detach() * mask).sum(),
            "clipped": (clipped.to(mask.dtype) * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, stats
