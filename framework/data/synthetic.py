"""Synthetic token sequences that need no files and that a model can learn.

Each sample is an arithmetic progression modulo the vocabulary, with a start and stride drawn
from a generator seeded by (seed, index): deterministic, independent of rank and world size,
and learnable, so a test can watch the loss fall.
"""
from __future__ import annotations

import torch


class SyntheticSource:
    def __init__(self, vocab_size: int, seq_len: int, seed: int, size: int = 1 << 20,
                 max_stride: int = 7):
        self.vocab_size, self.seq_len, self.seed, self.size = vocab_size, seq_len, seed, size
        self.max_stride = max_stride

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, self.max_stride + 1, (1,), generator=gen))
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
