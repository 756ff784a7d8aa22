"""Preference losses on summed reply log-probabilities: DPO (sigmoid), IPO and SimPO.

[Note: the preference losses]
For a pair, pi_c and pi_r are the policy's log-probabilities of the chosen and the rejected reply
given the prompt (summed over the reply's tokens), ref_c and ref_r the reference model's, n_c and
n_r the replies' token counts, beta = dpo.beta, eps = dpo.label_smoothing, gamma = dpo.simpo_gamma:

    sigmoid (DPO):  z = beta ((pi_c - ref_c) - (pi_r - ref_r))
                    loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)
    ipo:            loss = ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2
    simpo:          z = beta (pi_c / n_c - pi_r / n_r) - gamma          (no reference model)
                    loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)

The step's loss is the mean over its pairs. IPO's log-ratios are per token, as TRL's `ipo` (its
authors' normalisation). The rewards logged are beta (pi - ref) per reply (SimPO: beta pi / n); a
pair is counted accurate when the chosen reward is strictly larger. With the policy equal to the
reference, z = 0 and the DPO loss is ln 2 whatever eps is.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F

from framework.config.dpo import DPOConfig, PreferenceLoss
from framework.finetune.reference import summed_logps

# The per-pair numbers a step sums over its pairs and logs as their mean (names as TRL's).
STAT_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logratios/chosen",
    "logratios/rejected",
)


class PairLogps(NamedTuple):
    chosen: torch.Tensor  # (pairs,) summed log-probabilities of the chosen replies
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # (pairs,) the replies' token counts
    rejected_tokens: torch.Tensor


def pair_logps(model, input_ids: torch.Tensor, labels: torch.Tensor, gather=lambda t: t) -> PairLogps:
    """One forward of the pairs' 2 x pairs sequences (chosen ones first): each reply's summed
    log-probability. input_ids, labels: (pairs, 2, seq). `gather` makes a tensor-parallel
    (vocabulary-sharded) result whole. Under context parallelism each rank forwards its chunk of
    every sequence and the chunks' sums are added over the cp ranks (`summed_logps`)."""
    pairs = input_ids.shape[0]
    ids = torch.cat([input_ids[:, 0], input_ids[:, 1]])
    targets = torch.cat([labels[:, 0], labels[:, 1]])
    sums, counts = summed_logps(model, ids, targets, gather)
    return PairLogps(sums[:pairs], sums[pairs:], counts[:pairs], counts[pairs:])


def preference_loss(
    cfg: DPOConfig, policy: PairLogps, reference: Optional[PairLogps]
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(per-pair losses, per-pair statistics named as STAT_NAMES) by [Note: the preference losses]."""
    beta, eps = cfg.beta, cfg.label_smoothing
    stats: Dict[str, torch.Tensor] = {
        "logps/chosen": policy.chosen.detach(),
        "logps/rejected": policy.rejected.detach(),
    }
    if cfg.loss == PreferenceLoss.simpo:
        chosen = policy.chosen / policy.chosen_tokens.clamp(min=1)
        rejected = policy.rejected / policy.rejected_tokens.clamp(min=1)
        z = beta * (chosen - rejected) - cfg.simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        chosen_reward, rejected_reward = beta * chosen.detach(), beta * rejected.detach()
    else:
        assert reference is not None, "dpo: the sigmoid and ipo losses need the reference's log-probabilities"
        chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        if cfg.loss == PreferenceLoss.ipo:
            delta = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(
                min=1
            )
            losses = (delta - 1 / (2 * beta)) ** 2
        else:
            z = beta * (chosen_ratio - rejected_ratio)
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        stats["logratios/chosen"], stats["logratios/rejected"] = chosen_ratio.detach(), rejected_ratio.detach()
        chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats["rewards/chosen"], stats["rewards/rejected"] = chosen_reward, rejected_reward
    stats["rewards/margins"] = chosen_reward - rejected_reward
    stats["rewards/accuracies"] = (chosen_reward > rejected_reward).float()
    return losses, stats
