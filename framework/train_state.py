"""What a training run holds between steps: everything a checkpoint saves and restores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


@dataclass
class TrainState:
    model: nn.Module
    # None, None, None: a stage that trains nothing (generate, evaluate): a checkpoint's weights alone
    optimizer: Optional[torch.optim.Optimizer]
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    train_loader: Any  # framework.data.GlobalBatchLoader
    step: int = 0  # optimizer steps completed
