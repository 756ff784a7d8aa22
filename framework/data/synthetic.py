"""Synthetic samples that need no files and that a model can learn, for every task.

Each sample is built from an arithmetic progression modulo the vocabulary, with a start and
stride drawn from a generator seeded by (seed, index): deterministic, independent of rank and
world size, and learnable, so a test can watch the loss fall. What a sample holds depends on the
task's `sample_kind` (`framework/models/tasks.py`):

    tokens          seq_len + 1 ids (causal language modelling: inputs and shifted labels)
    seq2seq         {"input_ids": seq_len ids, "labels": seq_len // 2 ids}: the target is the
                    source's progression continued, so the decoder must read the encoder
    sequence_label  {"input_ids": seq_len ids, "labels": a class}: the class is the stride
                    modulo num_labels, readable from any two neighbouring tokens
    image_label     {"inputs": a 1 x 8 x 8 image, "labels": a class}: a bright row whose index
                    is the class
"""

from __future__ import annotations

import torch

SAMPLE_KINDS = ("tokens", "seq2seq", "sequence_label", "image_label")


class SyntheticSource:
    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int,
        size: int = 1 << 20,
        max_stride: int = 7,
        kind: str = "tokens",
        num_labels: int = 2,
    ):
        if kind not in SAMPLE_KINDS:
            raise ValueError(f"synthetic sample kind {kind!r}: choose one of {', '.join(SAMPLE_KINDS)}")
        self.vocab_size, self.seq_len, self.seed, self.size = vocab_size, seq_len, seed, size
        self.max_stride, self.kind, self.num_labels = max_stride, kind, num_labels

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, self.max_stride + 1, (1,), generator=gen))
        if self.kind == "image_label":
            label = int(torch.randint(self.num_labels, (1,), generator=gen))
            image = 0.1 * torch.randn(1, 8, 8, generator=gen)
            image[0, label % 8] += 1.0
            return {"inputs": image, "labels": torch.tensor(label)}
        target = self.seq_len // 2 if self.kind == "seq2seq" else 0
        ids = (start + stride * torch.arange(self.seq_len + 1 + target)) % self.vocab_size
        if self.kind == "tokens":
            return ids
        if self.kind == "seq2seq":
            return {"input_ids": ids[: self.seq_len], "labels": ids[self.seq_len + 1 :]}
        return {"input_ids": ids[: self.seq_len], "labels": torch.tensor(stride % self.num_labels)}
