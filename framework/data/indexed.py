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

import contextlib
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


def _check_splits(prefixes: Sequence[str], parts: List[float], split: str, tokenizer=None, model=None) -> int:
    """Total tokens of `prefixes`; refuses a split that would get no document of some path
    (megatron-core would loop forever on an empty split), and ids that do not fit the tokenizer or
    the model (`model`: (its name, its vocabulary) when the model's vocabulary is its own)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    total, bounds, acc = 0, [], 0.0
    for p in parts:
        bounds.append((acc / sum(parts), (acc + p) / sum(parts)))
        acc += p
    for prefix in prefixes:
        check_index(prefix)
        dataset = IndexedDataset(prefix)  # keep it alive: its arrays view the mapped index file
        _check_token_ids(prefix, dataset, tokenizer, model)
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


# [Note: checking an index before megatron reads it]
# megatron-core trusts a `.idx`: a lying count, dtype code or header is an assertion or a numpy
# error deep inside it, and a negative length or a pointer past the `.bin` trains on garbage (or
# reads past the end far into training). `check_index` reads the header and the three arrays itself
# and refuses, in one line naming the file and the field, anything a writer could not have made:
# the header and version, a dtype code that is not an integer token type, a size that does not
# match the counts, lengths < 0, pointers that do not follow from the lengths or leave the `.bin`
# (a truncated copy), document indices that do not run from 0 to the sequence count.
_HEADER = b"MMIDIDX\x00\x00"
_TOKEN_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 8: numpy.uint16}


def _regular_size(path: str, field: str) -> int:
    """The size of the regular file `path`; a FIFO, device or directory is refused by name."""
    import stat

    try:
        info = os.stat(path)
    except OSError:
        raise UserInputError(f"{field}: {path} not found; prepare it with stage=data_preparation") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserInputError(f"{field}: {path} is not a regular file (a FIFO, device or directory); give the file")
    return info.st_size


def check_index(prefix: str) -> None:
    """Refuse a `.idx`/`.bin` pair megatron-core would misread (see the Note above)."""
    import struct

    idx, field = prefix + ".idx", "data.paths"
    idx_size, bin_size = _regular_size(idx, field), _regular_size(prefix + ".bin", field)

    def bad(what: str) -> UserInputError:
        return UserInputError(f"{field}: {idx} {what}; it is not an index data preparation writes: prepare it again")

    with open(idx, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != _HEADER:  # noqa: PLR2004 - the header's fixed size
        raise bad("does not start with the Megatron index header")
    version, code, count, docs = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise bad(f"has format version {version}, not 1")
    if code not in _TOKEN_DTYPES:
        raise bad(f"has dtype code {code}, not an integer token type (1-5 or 8)")
    if 34 + 12 * count + 8 * docs != idx_size:  # noqa: PLR2004
        raise bad(f"has {idx_size} bytes, not what its {count} sequences and {docs} document entries take")
    itemsize = numpy.dtype(_TOKEN_DTYPES[code]).itemsize
    mapped = numpy.memmap(idx, mode="r", dtype=numpy.uint8)
    lengths = numpy.frombuffer(mapped, dtype=numpy.int32, count=count, offset=34).astype(numpy.int64)
    pointers = numpy.frombuffer(mapped, dtype=numpy.int64, count=count, offset=34 + 4 * count)
    documents = numpy.frombuffer(mapped, dtype=numpy.int64, count=docs, offset=34 + 12 * count)
    if count and int(lengths.min()) < 0:
        raise bad(f"gives sequence {int(numpy.argmin(lengths))} a negative length")
    expected = numpy.concatenate([[0], numpy.cumsum(lengths[:-1] * itemsize)]) if count else lengths
    if count and not numpy.array_equal(pointers, expected):
        raise bad(f"points sequence {int(numpy.argmax(pointers != expected))} elsewhere than after the one before")
    end = int(pointers[-1]) + int(lengths[-1]) * itemsize if count else 0
    if end > bin_size:
        raise UserInputError(
            f"{field}: {prefix}.bin has {bin_size} bytes but {idx} describes {end}: "
            "the .bin is truncated (an interrupted copy?); copy or prepare it again"
        )
    if docs < 1 or int(documents[0]) != 0 or int(documents[-1]) != count or numpy.any(numpy.diff(documents) < 0):
        raise bad(f"has document indices that do not run from 0 up to its {count} sequences")
    del mapped


_ID_SAMPLE = 1 << 24  # token ids read from each end of a .bin to check them against the vocabulary


def _check_token_ids(prefix: str, dataset, tokenizer, model=None) -> None:
    """Refuse data whose token ids do not fit the tokenizer (data prepared with another one), or the
    model (`model`: its name and vocabulary, when it has its own: model=hf), instead of an index
    error deep in the model's embedding. The first and last _ID_SAMPLE ids of the .bin are checked
    (all of them in files up to 2 x 2^24 tokens)."""
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    if (vocab <= 0 and model is None) or not len(dataset.index.sequence_lengths):
        return
    ids = numpy.memmap(prefix + ".bin", dtype=dataset.index.dtype, mode="r")
    largest = max(int(ids[:_ID_SAMPLE].max()), int(ids[-_ID_SAMPLE:].max()))
    del ids
    if model is not None and largest >= model[1]:
        raise UserInputError(
            f"data: {prefix}.bin holds token id {largest}, but {model[0]} has only {model[1]} ids: the data "
            "was prepared with another tokenizer than the model's; prepare it with the model's "
            "(data.tokenizer=<its tokenizer.json>)"
        )
    if vocab > 0 and largest >= vocab:
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
    paths: Sequence[str],
    weights: Sequence[float],
    *,
    split: str,
    seq_len: int,
    seed: int,
    tokenizer,
    cache_dir: str,
    per_node_cache: bool = False,
    model: Optional[Tuple[str, int]] = None,
) -> Tuple[MegatronSource, MegatronSource]:
    """(train, valid) sources of a blend of `paths`. Every rank calls it: the rank that writes the
    index caches builds (or loads and checks) them first, then the others load them (see
    [Note: index caches built in turn, refusals agreed]). `per_node_cache`: `cache_dir` is each
    node's own, so each node's local rank 0 writes its caches (see
    [Note: a cache per node or one for the job] in framework/data/shared_cache.py). `model`: the
    model's name and vocabulary when it has its own (model=hf): the ids must fit it too."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:  # noqa: PLR2004
        raise UserInputError(
            f"data.split={split!r}: give three train,valid,test proportions with train and valid > 0, e.g. 98,1,1"
        )
    samples = max(1, _check_splits(paths, parts, split, tokenizer, model) // seq_len)
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
    train, valid, _ = _build_in_turn(
        lambda: BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build(), per_node_cache
    )
    if train is None or len(train) == 0 or valid is None or len(valid) == 0:
        raise UserInputError(
            f"data.split={split!r} leaves the {'train' if not train else 'valid'} split of "
            f"{list(paths)} empty (too few documents); give it a larger share or more data"
        )
    return MegatronSource(train), MegatronSource(valid)


# [Note: index caches built in turn, refusals agreed]
# megatron-core's builder sequences the ranks itself: global rank 0 builds (or loads) the index
# caches, a barrier, then the others load them. A refusal on rank 0 (a pickled or out-of-range
# cache file) left the others in that barrier, and they ended with "Connection closed by peer"
# tracebacks beside the one refusal line. So the ranks take turns outside megatron's sequencing:
# the rank that writes this cache (global rank 0 of a shared cache, each node's local rank 0 of a
# per-node one: see [Note: a cache per node or one for the job]) runs the builder as if it were the
# only process and checks what it built or loaded (`check_indices`); the ranks agree on its
# refusal (one all_gather, which is also the barrier), then the others load the cache the same
# way, and agree once more. A refusal is raised on every rank: one line, status 2, no traceback.


# [Note: megatron alone, torch untouched]
# megatron-core's dataset modules ask `torch.distributed` (is_initialized, get_rank) before each
# rank-0 decision: build or load a cache, wait in a barrier. To run its builder as the only process
# (the Note above), only those modules are shown a `torch` whose `distributed` says "not
# initialised, rank 0 of 1", for the duration of the build: their module attribute `torch` is
# swapped for a stand-in that hands out everything else from the real torch, and put back after.
# torch itself is never changed, so every other thread and caller (the heartbeat, an async save,
# a user's code) sees the real process group throughout.
_MEGATRON_DATASET_MODULES = ("blended_dataset", "blended_megatron_dataset_builder", "gpt_dataset")


class _AloneDistributed:
    """torch.distributed as a single process sees it; everything else is the real module's."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    @staticmethod
    def is_initialized() -> bool:
        return False

    @staticmethod
    def get_rank(group=None) -> int:
        return 0

    @staticmethod
    def get_world_size(group=None) -> int:
        return 1


class _AloneTorch:
    """The real torch with `distributed` replaced by `_AloneDistributed`."""

    distributed = _AloneDistributed()

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)


@contextlib.contextmanager
def megatron_alone():
    """megatron's dataset builder as the only process ([Note: megatron alone, torch untouched])."""
    import importlib

    modules = [importlib.import_module(f"megatron.core.datasets.{m}") for m in _MEGATRON_DATASET_MODULES]
    real = [module.torch for module in modules]
    for module in modules:
        module.torch = _AloneTorch()
    try:
        yield
    finally:
        for module, torch_module in zip(modules, real):
            module.torch = torch_module


def _build_in_turn(build, per_node_cache: bool):
    """`build()` (megatron's builder) on every rank, the cache's writer first; see the Note above."""
    import torch.distributed as dist

    from framework.data.index_cache import check_indices
    from framework.data.shared_cache import prepares_here

    def alone(check: bool):
        try:
            with megatron_alone():
                datasets = build()
            if check:
                for dataset in datasets:
                    if dataset is not None:
                        check_indices(dataset)
            return datasets, None
        except UserInputError as exc:
            return None, str(exc)

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        datasets, problem = alone(check=True)
        if problem:
            raise UserInputError(problem)
        return datasets
    writer = prepares_here(shared=not per_node_cache)
    datasets, problem = alone(check=True) if writer else (None, None)
    _agree(problem)
    if not writer:
        datasets, problem = alone(check=False)  # the writer checked these files
    _agree(problem)
    return datasets


def _agree(problem) -> None:
    """Collective: raise the first rank's refusal (if any rank has one) on every rank."""
    import torch.distributed as dist

    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise UserInputError(first)


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
