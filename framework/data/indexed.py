"""Training samples from Megatron indexed datasets through megatron-core's GPTDataset and
BlendedMegatronDatasetBuilder: weighted blends, train/valid/test splits and shuffled index files
cached under data.cache_dir, the same as NeMo and Megatron-LM build them from the same files.

[Note: indexed dataset sizes]
A weighted blend needs a sample count per split. `build_data` does not know the run's length, so
we ask for one pass over the corpus: (tokens in all paths) // seq_len samples, divided by
data.split. GPTDataset repeats (re-shuffled) epochs of a path as its weight requires, and
GlobalBatchLoader wraps around past the end; the order is fixed by the files, seq_len, split and
seed, never by the world size.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import framework.data.megatron_quiet  # noqa: F401  (before any megatron.core import)

import numpy
import torch

from framework.data.index_cache import no_pickle_in_megatron_indices
from framework.errors import UserInputError


class MegatronSource:
    """A megatron-core dataset as a SampleSource: seq_len + 1 token ids per sample."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        item = self.dataset[index]
        return torch.cat([item["tokens"], item["labels"][-1:]])


def _check_splits(prefixes: Sequence[str], parts: List[float], split: str, tokenizer=None) -> int:
    """Total tokens of `prefixes`; refuses a split that would get no document of some path
    (megatron-core would loop forever on an empty split)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    total, bounds, acc = 0, [], 0.0
    for p in parts:
        bounds.append((acc / sum(parts), (acc + p) / sum(parts)))
        acc += p
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)  # keep it alive: its arrays view the mapped index file
        _check_bin_size(prefix, dataset)
        _check_token_ids(prefix, dataset, tokenizer)
        total += int(dataset.sequence_lengths.sum())
        n_docs = len(dataset)
        del dataset
        for name, part, (lo, hi) in zip(("train", "valid", "test"), parts, bounds):
            if part > 0 and int(round(hi * n_docs)) - int(round(lo * n_docs)) == 0:
                raise UserInputError(
                    f"data.split={split!r} gives the {name} split none of the {n_docs} documents "
                    f"of {prefix}; give it a larger share (or 0 for test), or more documents"
                )
    return total


def _check_bin_size(prefix: str, dataset) -> None:
    """The .bin holds every token the .idx points at (a truncated copy is refused at load, not
    found by a read far into training)."""
    lengths, pointers = dataset.index.sequence_lengths, dataset.index.sequence_pointers
    if not len(lengths):
        return
    itemsize = numpy.dtype(dataset.index.dtype).itemsize
    needed = int(pointers[-1]) + int(lengths[-1]) * itemsize
    have = os.path.getsize(prefix + ".bin")
    if have < needed:
        raise UserInputError(
            f"data.paths: {prefix}.bin has {have} bytes but {prefix}.idx describes {needed}: "
            "the .bin is truncated (an interrupted copy?); copy or prepare it again"
        )


_ID_SAMPLE = 1 << 24  # token ids read from each end of a .bin to check them against the vocabulary


def _check_token_ids(prefix: str, dataset, tokenizer) -> None:
    """Refuse data whose token ids do not fit the tokenizer (data prepared with another one),
    instead of an index error deep in the model's embedding. The first and last _ID_SAMPLE ids of
    the .bin are checked (all of them in files up to 2 x 2^24 tokens)."""
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    if vocab <= 0 or not len(dataset.index.sequence_lengths):
        return
    ids = numpy.memmap(prefix + ".bin", dtype=dataset.index.dtype, mode="r")
    largest = max(int(ids[:_ID_SAMPLE].max()), int(ids[-_ID_SAMPLE:].max()))
    del ids
    if largest >= vocab:
        where = (
            f"the tokenizer {tokenizer.path}" if getattr(tokenizer, "path", None) else f"model.args.vocab_size={vocab}"
        )
        raise UserInputError(
            f"data.paths: {prefix}.bin holds token id {largest}, but {where} has only {vocab} ids: "
            "the data was prepared with another tokenizer; give that one with "
            "data.tokenizer=<its tokenizer.json> (or prepare the data again)"
        )


def _split_sizes(total: int, split: str) -> List[int]:
    parts = [float(x) for x in split.replace("/", ",").split(",")]
    parts += [0.0] * (3 - len(parts))
    norm = sum(parts)
    return [max(1, int(total * p / norm)) if p > 0 else 0 for p in parts[:3]]


def build_indexed(
    paths: Sequence[str], weights: Sequence[float], *, split: str, seq_len: int, seed: int, tokenizer, cache_dir: str
) -> Tuple[MegatronSource, MegatronSource]:
    """(train, valid) sources of a blend of `paths`. Every rank calls it (megatron builds the index
    caches on rank 0 first, then the others read them)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    for prefix in paths:
        if not os.path.isfile(prefix + ".idx") or not os.path.isfile(prefix + ".bin"):
            raise UserInputError(f"data.paths: {prefix}.bin/.idx not found; prepare it with stage=data_preparation")
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:  # noqa: PLR2004
        raise UserInputError(
            f"data.split={split!r}: give three train,valid,test proportions with train and valid > 0, e.g. 98,1,1"
        )
    samples = max(1, _check_splits(paths, parts, split, tokenizer) // seq_len)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=(list(paths), list(weights) or None),
        split=split,
        path_to_cache=os.path.abspath(os.path.join(cache_dir, "index")),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    sizes = _split_sizes(samples, split)  # see [Note: indexed dataset sizes]
    no_pickle_in_megatron_indices()  # its index cache may be shared: never unpickle it
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    if train is None or len(train) == 0 or valid is None or len(valid) == 0:
        raise UserInputError(
            f"data.split={split!r} leaves the {'train' if not train else 'valid'} split of "
            f"{list(paths)} empty (too few documents); give it a larger share or more data"
        )
    return MegatronSource(train), MegatronSource(valid)


class MegatronTokenizerInfo:
    """What GPTDataset needs of a tokenizer when none is known (data prepared elsewhere)."""

    def __init__(self, vocab_size: int, eod: int):
        from collections import OrderedDict

        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = OrderedDict(cls="MegatronTokenizerInfo", vocab_size=vocab_size, eod=eod)


def resolve_tokenizer(tokenizer_path: str, paths: Sequence[str]) -> Optional[object]:
    """data.tokenizer, else the tokenizer.json data preparation wrote next to the first path."""
    from framework.data.prepare import default_tokenizer_for
    from framework.data.tokenizer import BPETokenizer

    path = tokenizer_path or (default_tokenizer_for(paths[0]) if paths else None)
    return BPETokenizer(path) if path else None
