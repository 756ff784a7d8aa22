"""Builds the train / validation loaders a config asks for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from framework.config.schema import DataConfig, DataName
from framework.data.loader import GlobalBatchLoader
from framework.data.synthetic import SyntheticSource
from framework.errors import UserInputError


@dataclass
class DataBundle:
    train: GlobalBatchLoader
    valid: GlobalBatchLoader
    vocab_size: int
    tokenizer: Optional[Any] = None  # has encode(str) -> list[int] and decode(list[int]) -> str


def build_data(
    cfg: DataConfig,
    *,
    vocab_size: int,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    sample_kind: str = "tokens",
    num_labels: int = 2,
) -> DataBundle:
    """`sample_kind`/`num_labels`: what the model's task consumes (framework/data/synthetic.py)."""

    def loaders(train, valid):
        kw = dict(micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        return (
            GlobalBatchLoader(train, global_batch_size=global_batch_size, **kw),
            GlobalBatchLoader(valid, global_batch_size=global_batch_size, **kw),
        )

    if cfg.name == DataName.synthetic:
        if vocab_size <= 0:
            raise UserInputError("data=synthetic needs model.vocab_size > 0")
        kind = dict(kind=sample_kind, num_labels=num_labels)
        train = SyntheticSource(vocab_size, cfg.seq_len, seed, **kind)
        valid = SyntheticSource(vocab_size, cfg.seq_len, seed + 1, **kind)
        return DataBundle(*loaders(train, valid), vocab_size=vocab_size)
    if cfg.name == DataName.digits:
        if sample_kind != "image_label":
            raise UserInputError(
                "data=digits yields images and labels; use it with model=digits_cnn (experiment=digits_cnn)"
            )
        from framework.data.digits import build_digits_data

        return build_digits_data(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
    if sample_kind != "tokens":
        raise UserInputError(
            f"data={cfg.name.value} yields token sequences, but the model's task needs "
            f"{sample_kind} samples; use data=synthetic or a dataset made for that task"
        )
    return _build_indexed_data(cfg, loaders, vocab_size=vocab_size, seed=seed)


def _build_indexed_data(cfg: DataConfig, loaders, *, vocab_size: int, seed: int) -> DataBundle:
    """data=indexed (files named by data.paths) and data=stdlib (prepared once, then the same)."""
    import torch.distributed as dist

    from framework.data.indexed import MegatronTokenizerInfo, build_indexed, resolve_tokenizer

    distributed = dist.is_available() and dist.is_initialized()
    barrier = dist.barrier if distributed else (lambda: None)
    if cfg.name == DataName.stdlib:
        from framework.data.stdlib import ensure_stdlib

        is_main = not distributed or dist.get_rank() == 0
        paths, weights = (
            [ensure_stdlib(cfg.cache_dir, cfg.vocab_size, cfg.workers, is_main=is_main, barrier=barrier)],
            [],
        )
    else:
        paths, weights = list(cfg.paths), list(cfg.weights)
    tokenizer = resolve_tokenizer(cfg.tokenizer, paths)
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
        info = tokenizer
    elif vocab_size > 0:
        info = MegatronTokenizerInfo(vocab_size, eod=vocab_size - 1)
    else:
        raise UserInputError(
            f"data.tokenizer is empty and no {paths[0]}.tokenizer.json exists, so the vocabulary "
            "size is unknown: set data.tokenizer=<tokenizer.json> or model.vocab_size"
        )
    train, valid = build_indexed(
        paths, weights, split=cfg.split, seq_len=cfg.seq_len, seed=seed, tokenizer=info, cache_dir=cfg.cache_dir
    )
    return DataBundle(*loaders(train, valid), vocab_size=vocab_size, tokenizer=tokenizer)
