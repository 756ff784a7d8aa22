"""What the stages that compare a policy with a frozen reference share (stage=dpo, stage=grpo):
per-token log-probabilities of labelled tokens, and the reference's weights (the reference itself
is built by framework/job.py's `build_job(cfg, rt, reference_of=policy)`).

See [Note: the reference model] in framework/dpo/stage.py for what the reference is and when
none is built (LoRA's base with the adapters switched off; SimPO; GRPO's beta=0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from framework.models.tasks import IGNORE_INDEX, logits_of


def token_logps(model, ids: torch.Tensor, targets: torch.Tensor, gather=lambda t: t, temperature: float = 1.0):
    """(rows, seq) log-probabilities of `targets` given `ids` (0 where a target is IGNORE_INDEX),
    from the logits divided by `temperature`, in at least fp32. `gather` makes a tensor-parallel
    (vocabulary-sharded) result whole."""
    return logits_logps(logits_of(model(ids)), targets, gather, temperature)


def logits_logps(logits: torch.Tensor, targets: torch.Tensor, gather=lambda t: t, temperature: float = 1.0):
    """`token_logps` from the logits already computed (a pipeline's last stage has them)."""
    logits = logits.flatten(0, -2)  # a float64 model's stay float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    per_token = -F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return gather(per_token).view(targets.shape)


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


@torch.no_grad()
def copy_policy_into(policy: nn.Module, reference: nn.Module) -> None:
    """Every parameter and buffer of `policy` copied into `reference` (the same layout: each rank
    copies its own pieces)."""
    mine = dict(policy.named_parameters())
    theirs = dict(reference.named_parameters())
    assert mine.keys() == theirs.keys(), f"the reference's parameters differ: {sorted(mine ^ theirs)}"
    for name, param in mine.items():
        theirs[name].detach().copy_(param.detach())
    ref_buffers = dict(reference.named_buffers())
    for name, buffer in policy.named_buffers():
        ref_buffers[name].copy_(buffer)


def load_starting_weights(trainer) -> None:
    """The weights the run started from read into the policy before any resume (the other stage's
    checkpoint it started from, checkpoint.init_from, model.path; none: the seeded initialisation
    stays), so a reference copied now is the starting model, not the resumed policy."""
    if trainer.ckpt is not None:  # none: no resume, no import, so the policy is the seeded initialisation
        trainer.ckpt.load_starting_weights(trainer.state)
