"""Optimizer and schedule construction.

Weight-decay groups are chosen by parameter *name*, not by `ndim`: with the sharded engine a
rank's piece of a matrix may be 1-D, so shape says nothing about what a parameter is.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch
from torch import nn

from framework.config.schema import OptimizerConfig, OptimizerName, Schedule

_NO_DECAY_MARKERS = ("norm", "bias", "embeddings")


def no_decay(name: str) -> bool:
    """Norm weights, biases and embedding tables are not decayed."""
    return any(marker in name for marker in _NO_DECAY_MARKERS)


def _param_groups(named: Iterable[Tuple[str, nn.Parameter]], weight_decay: float) -> List[dict]:
    decay, plain, seen = [], [], set()
    for name, param in named:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (plain if no_decay(name) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = _param_groups(model.named_parameters(), cfg.weight_decay)
    if cfg.name == OptimizerName.adamw:
        # foreach=False: one kernel per parameter. The multi-tensor path groups tensors by
        # device and dtype and is no faster on CPU; on a GPU torch picks foreach itself.
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            foreach=None if torch.cuda.is_available() else False,
        )
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def lr_at(step: int, cfg: OptimizerConfig, max_steps: int) -> float:
    """The multiplier of `cfg.lr` after `step` optimizer steps: linear warmup, then the schedule
    down to `min_lr_ratio` at `max_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == Schedule.constant:
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.schedule == Schedule.linear:
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, max_steps))
