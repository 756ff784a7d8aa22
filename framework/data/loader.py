"""Deterministic, resumable batching over an indexable source of samples.

[Note: global sample order]
Step s consumes the global samples [s*G, (s+1)*G) of the shuffled order (G = global batch).
Micro-step a of data-parallel rank r takes the M samples starting at s*G + (a*D + r)*M (D ranks,
M micro-batch). The set of samples a step sees therefore does not depend on D, and the loader's
whole state is one number, the global samples consumed: a resume at another data-parallel size
neither repeats nor skips a sample, and the step's mean loss is the same mean over the same samples.
With `rank_major` (trainer.deterministic) rank r instead takes the G/D consecutive samples from
s*G + r*G/D, micro-step a the M of them from a*M: a rank's samples are then one run of the global
order ([Note: one summation tree, whatever the layout] in framework/distributed/fsdp/canonical.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import torch

from framework.errors import UserInputError


class SampleSource(Protocol):
    """Anything indexable that returns seq_len + 1 token ids per sample."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor: ...


class GlobalBatchLoader:
    def __init__(
        self, source: SampleSource, *, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int
    ):
        if global_batch_size % (micro_batch_size * dp_size):
            raise UserInputError(
                f"trainer.global_batch_size={global_batch_size} is not divisible by "
                f"micro_batch_size x dp = {micro_batch_size * dp_size}"
            )
        self.source = source
        self.micro = micro_batch_size
        self.global_batch = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accum_steps = global_batch_size // (micro_batch_size * dp_size)
        self.consumed = 0  # global samples consumed by completed steps
        self._micro_step = 0
        self.rank_major = False  # see [Note: global sample order]

    def _start(self) -> int:
        if self.rank_major:
            return self.consumed + self.dp_rank * (self.global_batch // self.dp_size) + self._micro_step * self.micro
        return self.consumed + (self._micro_step * self.dp_size + self.dp_rank) * self.micro

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch of this rank: (inputs, labels), each (micro, seq_len)."""
        start = self._start()
        samples = [self.source[(start + i) % len(self.source)] for i in range(self.micro)]
        self._micro_step += 1
        if self._micro_step == self.accum_steps:
            self._micro_step = 0
            self.consumed += self.global_batch
        if isinstance(samples[0], dict):  # a task's named tensors (framework/models/tasks.py)
            return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        rows = torch.stack(samples)
        return rows[:, :-1].long(), rows[:, 1:].long()

    def sample_indices(self) -> list:
        """The global indices this rank's next micro-batch will read (for tests)."""
        start = self._start()
        return [(start + i) % len(self.source) for i in range(self.micro)]

    def state_dict(self) -> dict:
        """The global samples consumed; a streamed source adds where its stream stands then
        (framework/data/hf_data.py), the same on every rank."""
        assert self._micro_step == 0, "loader state is saved between steps only"
        state = {"consumed_samples": self.consumed}
        if hasattr(self.source, "position_at"):
            state["stream"] = self.source.position_at(self.consumed)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed_samples"])
        self._micro_step = 0
        if hasattr(self.source, "seek"):
            if "stream" not in state:
                raise UserInputError(
                    "the checkpoint was not saved from data=hf: resume with the data it was trained on"
                )
            self.source.seek(state["stream"], self.consumed)


@dataclass
class DataBundle:
    """What a data source builds for one rank: its two loaders, the vocabulary and the tokenizer."""

    train: GlobalBatchLoader
    valid: GlobalBatchLoader
    vocab_size: int
    tokenizer: Optional[Any] = None  # has encode(str) -> list[int] and decode(list[int]) -> str
