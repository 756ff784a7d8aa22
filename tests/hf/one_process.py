"""The one-process reference the Hugging Face parity tests compare a layout with: the trainer's
data for one rank holding the whole global batch, and plain steps of the configured optimizer
(clip, step, scheduler) on a model built as each test needs."""

from __future__ import annotations

import torch


def whole_batch_data(cfg, family, task, batch: int = 4):
    """The job's data as one rank reads it when it holds the whole global batch (`batch` rows)."""
    from framework.data import build_data

    return build_data(
        cfg.data,
        vocab_size=family.vocab_size(cfg.model),
        micro_batch_size=batch,
        global_batch_size=batch,
        dp_rank=0,
        dp_size=1,
        seed=cfg.trainer.seed,
        sample_kind=task.sample_kind,
        num_labels=family.num_labels(cfg.model),
    )


def train_steps(model, task, data, cfg, steps: int):
    """`steps` steps of `cfg.optimizer` (its scheduler, its clip) on `model` over `data`'s batches:
    (losses, gradient norms before the clip)."""
    from framework.optim import build_optimizer, build_scheduler

    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, steps)
    losses, norms = [], []
    for _ in range(steps):
        loss = task.loss(model, data.train.next_batch())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms
