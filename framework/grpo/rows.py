"""A GRPO step's rows: each completion's sampling seed and its (ids, targets) after its prompt;
the stage (framework/grpo/stage.py) and its pipeline path (framework/grpo/pipeline.py) both use them."""

from __future__ import annotations

from typing import List

import torch

from framework.models.tasks import IGNORE_INDEX


def rollout_seed(seed: int, step: int, index: int, k: int) -> int:
    """[Note: the rollout seeds] (framework/grpo/stage.py): a 63-bit mix of the four numbers
    (splitmix64's finaliser)."""
    x = 0
    for part in (seed, step, index, k):
        x = (x ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def sequences(prompts: List[List[int]], completions: List[List[int]], pad_id: int):
    """(ids, targets) of shape (rows, longest - 1): each row its prompt then its completion, padded
    at the end; a target is IGNORE_INDEX everywhere but on the completion's tokens."""
    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows) - 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for j, (p, c) in enumerate(zip(prompts, completions)):
        row = p + c
        ids[j, : len(row) - 1] = torch.tensor(row[:-1])
        targets[j, len(p) - 1 : len(row) - 1] = torch.tensor(c)
    return ids, targets
