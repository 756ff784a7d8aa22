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
    (vocabulary-sharded) result whole. Under context parallelism (`model`'s sequences split, inside
    `context_parallel.active`) each rank takes its chunk of every row and the chunks' values are
    gathered whole on every cp rank ([Note: sums over the chunks of a row])."""
    from framework.distributed.context_parallel import gather_chunks, split_of

    exchange = split_of(model)
    if exchange is None:
        return _logps(model, ids, targets, gather, temperature)
    part_ids, part_targets = _chunk(exchange, ids, targets)
    whole = gather_chunks(_logps(model, part_ids, part_targets, gather, temperature), exchange)
    return whole[:, : ids.shape[1]]


def summed_logps(model, ids: torch.Tensor, targets: torch.Tensor, gather=lambda t: t):
    """(the log-probabilities of each row's labelled targets summed, their count), each (rows,).
    Under context parallelism each rank sums its chunk of every row and the shares are added over
    the cp ranks ([Note: sums over the chunks of a row])."""
    from framework.distributed.context_parallel import split_of, sum_over_chunks

    counts = (targets != IGNORE_INDEX).sum(-1)
    exchange = split_of(model)
    if exchange is None:
        return _logps(model, ids, targets, gather).sum(-1), counts
    part_ids, part_targets = _chunk(exchange, ids, targets)
    return sum_over_chunks(_logps(model, part_ids, part_targets, gather).sum(-1), exchange), counts


def _chunk(exchange, ids: torch.Tensor, targets: torch.Tensor):
    """This cp rank's chunk of every row of (ids, targets), the rows first padded at the end to a
    multiple of cp (an unlabelled pad: causal attention keeps it out of the earlier tokens). The
    targets are the next tokens already, so a chunk's last target is the next chunk's first token."""
    from framework.distributed.context_parallel import split_batch

    pad = -ids.shape[1] % exchange.size
    if pad:
        ids = F.pad(ids, (0, pad), value=0)
        targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
    (part_ids, part_targets), _ = split_batch((ids, targets), exchange.rank, exchange.size, IGNORE_INDEX)
    return part_ids, part_targets


def _logps(model, ids: torch.Tensor, targets: torch.Tensor, gather, temperature: float = 1.0) -> torch.Tensor:
    return logits_logps(logits_of(model(ids)), targets, gather, temperature)


def logits_logps(logits: torch.Tensor, targets: torch.Tensor, gather=lambda t: t, temperature: float = 1.0):
    """`token_logps` from the logits already computed (a pipeline's last stage has them; the whole
    sequence's, so no chunks to gather)."""
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
