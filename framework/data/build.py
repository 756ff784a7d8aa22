"""Builds the train / validation loaders a config asks for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from framework.config.schema import DataConfig, DataName
from framework.data.loader import GlobalBatchLoader
from framework.data.synthetic import SyntheticSource


@dataclass
class DataBundle:
    train: GlobalBatchLoader
    valid: GlobalBatchLoader
    vocab_size: int
    tokenizer: Optional[Any] = None  # has encode(str) -> list[int] and decode(list[int]) -> str


def build_data(cfg: DataConfig, *, vocab_size: int, micro_batch_size: int, global_batch_size: int,
               dp_rank: int, dp_size: int, seed: int) -> DataBundle:
    def loaders(train, valid):
        kw = dict(micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        return (GlobalBatchLoader(train, global_batch_size=global_batch_size, **kw),
                GlobalBatchLoader(valid, global_batch_size=global_batch_size, **kw))

    if cfg.name == DataName.synthetic:
        if vocab_size <= 0:
            raise ValueError("data=synthetic needs model.vocab_size > 0")
        train = SyntheticSource(vocab_size, cfg.seq_len, seed)
        valid = SyntheticSource(vocab_size, cfg.seq_len, seed + 1)
        return DataBundle(*loaders(train, valid), vocab_size=vocab_size)
    raise NotImplementedError(f"data={cfg.name.value} is not available in this build")
