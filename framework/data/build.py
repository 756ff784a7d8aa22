"""Builds the train / validation loaders a config asks for, through one registry of data sources.

    bundle = build_data(cfg.data, vocab_size=..., micro_batch_size=..., ...)

`data.name` names one `DataSource` in `SOURCES`; a source says which samples it yields (tokens,
images with labels, ...) and builds the bundle. Adding a source is one `register_source(...)` call
here (or in the source's own module, imported below) and one choice in the config's `DataName`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from framework.config.schema import DataConfig, DataName
from framework.data.loader import DataBundle, GlobalBatchLoader
from framework.data.synthetic import SyntheticSource
from framework.errors import UserInputError


@dataclass(frozen=True)
class DataRequest:
    """What the job asks of a data source: the model's vocabulary and task, the batch and this
    rank's place among the data-parallel ranks."""

    vocab_size: int
    micro_batch_size: int
    global_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int
    sample_kind: str = "tokens"  # what the model's task consumes (framework/data/synthetic.py)
    num_labels: int = 2
    # a Hugging Face model directory (model=hf): its tokenizer (data=hf reads with it, data=stdlib is
    # prepared with it), and its vocabulary (vocab_size), which the data's ids must fit
    model_path: str = ""

    def loaders(self, train, valid) -> tuple:
        kw = dict(micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)
        return (
            GlobalBatchLoader(train, global_batch_size=self.global_batch_size, **kw),
            GlobalBatchLoader(valid, global_batch_size=self.global_batch_size, **kw),
        )


@dataclass(frozen=True)
class DataSource:
    name: str  # the data.name value
    build: Callable[[DataConfig, DataRequest], DataBundle]
    sample_kinds: tuple = ("tokens",)  # the samples it can yield; None: any the task asks for
    hint: str = "use data=synthetic or a dataset made for that task"  # when the task needs another kind


SOURCES: dict[str, DataSource] = {}


def register_source(source: DataSource) -> DataSource:
    SOURCES[source.name] = source
    return source


def build_data(cfg: DataConfig, **request) -> DataBundle:
    """The loaders of `data.name` for this rank (keyword arguments: the fields of DataRequest)."""
    req = DataRequest(**request)
    name = getattr(cfg.name, "value", cfg.name)
    source = SOURCES[name]
    if source.sample_kinds is not None and req.sample_kind not in source.sample_kinds:
        raise UserInputError(
            f"data={name} yields {' or '.join(source.sample_kinds)} samples, but the model's task needs "
            f"{req.sample_kind} samples; {source.hint}"
        )
    return source.build(cfg, req)


def _synthetic(cfg: DataConfig, req: DataRequest) -> DataBundle:
    if req.vocab_size <= 0:
        raise UserInputError("data=synthetic needs a model vocabulary > 0 (model.args.vocab_size)")
    kind = dict(kind=req.sample_kind, num_labels=req.num_labels)
    train = SyntheticSource(req.vocab_size, cfg.seq_len, req.seed, **kind)
    valid = SyntheticSource(req.vocab_size, cfg.seq_len, req.seed + 1, **kind)
    return DataBundle(*req.loaders(train, valid), vocab_size=req.vocab_size)


def _digits(cfg: DataConfig, req: DataRequest) -> DataBundle:
    from framework.data.digits import build_digits_data

    return build_digits_data(
        micro_batch_size=req.micro_batch_size,
        global_batch_size=req.global_batch_size,
        dp_rank=req.dp_rank,
        dp_size=req.dp_size,
        seed=req.seed,
    )


def _stdlib_paths(cfg: DataConfig, shared: bool, barrier, tokenizer: str = "") -> tuple:
    """The embedded corpus, prepared with `tokenizer` (a tokenizer.json) or a BPE trained on it."""
    from framework.data.shared_cache import prepares_here
    from framework.data.stdlib import ensure_stdlib

    is_main = prepares_here(shared)  # see [Note: a cache per node or one for the job]
    prefix = ensure_stdlib(
        cfg.cache_dir, cfg.vocab_size, cfg.workers, is_main=is_main, barrier=barrier, tokenizer=tokenizer
    )
    return [prefix], []


def _indexed(cfg: DataConfig, req: DataRequest) -> DataBundle:
    """data=indexed (files named by data.paths) and data=stdlib (prepared once, then the same)."""
    import torch.distributed as dist

    from framework.data.indexed import MegatronTokenizerInfo, build_indexed, resolve_tokenizer
    from framework.data.shared_cache import cache_is_shared
    from framework.data.tokenizer import model_tokenizer

    distributed = dist.is_available() and dist.is_initialized()
    barrier = dist.barrier if distributed else (lambda: None)
    shared = cache_is_shared(cfg.cache_dir)
    if cfg.name == DataName.stdlib:
        # data.tokenizer, else model.path's own ([Note: the data's tokenizer against the model's])
        own = model_tokenizer(req.model_path)
        tokenizer = cfg.tokenizer or (own if own.endswith(".json") else "")
        paths, weights = _stdlib_paths(cfg, shared, barrier, tokenizer)
    else:
        paths, weights = list(cfg.paths), list(cfg.weights)
    tokenizer = resolve_tokenizer(cfg.tokenizer, paths)
    vocab_size = req.vocab_size
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
        info = tokenizer
    elif vocab_size > 0:
        info = MegatronTokenizerInfo(vocab_size, eod=vocab_size - 1)
    else:
        raise UserInputError(
            f"data.tokenizer is empty and no {paths[0]}.tokenizer.json exists, so the vocabulary "
            "size is unknown: set data.tokenizer=<tokenizer.json> or model.args.vocab_size"
        )
    train, valid = build_indexed(
        paths,
        weights,
        split=cfg.split,
        seq_len=cfg.seq_len,
        seed=req.seed,
        tokenizer=info,
        cache_dir=cfg.cache_dir,
        per_node_cache=not shared,
        # a model read from model.path has the vocabulary of its config.json, whatever the data's
        model=(f"model.path={req.model_path}", req.vocab_size) if _own_vocab(req) else None,
    )
    return DataBundle(*req.loaders(train, valid), vocab_size=vocab_size, tokenizer=tokenizer)


def _own_vocab(req: DataRequest) -> bool:
    """The model was read from model.path (model=hf): its vocabulary is its config.json's."""
    return bool(req.model_path) and os.path.isdir(req.model_path) and req.vocab_size > 0


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def _hf(cfg: DataConfig, req: DataRequest) -> DataBundle:
    """data=hf: Hugging Face datasets from local files (framework/data/hf_data.py), with
    data.tokenizer, else model.path's tokenizer, else the embedded corpus's BPE."""
    import sys

    import torch.distributed as dist

    from framework.data.hf_data import build_hf
    from framework.data.tokenizer import load_tokenizer

    model_dir = req.model_path if req.model_path and os.path.isdir(req.model_path) else ""
    if cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer, "data.tokenizer")
    elif model_dir and _has_tokenizer(model_dir):
        tok = load_tokenizer(model_dir, "model.path")
    else:
        from framework.data.prepare import default_tokenizer_for
        from framework.data.shared_cache import cache_is_shared

        distributed = dist.is_available() and dist.is_initialized()
        barrier = dist.barrier if distributed else (lambda: None)
        (prefix,), _ = _stdlib_paths(cfg, cache_is_shared(cfg.cache_dir), barrier)
        tok = load_tokenizer(default_tokenizer_for(prefix), "data.tokenizer")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"data=hf: tokenizer {tok.path or req.model_path} ({tok.vocab_size} ids)", file=sys.stderr, flush=True)
    train, valid = build_hf(cfg, req, tok)
    return DataBundle(*req.loaders(train, valid), vocab_size=tok.vocab_size, tokenizer=tok)


for _source in (
    DataSource("synthetic", _synthetic, sample_kinds=None),
    DataSource(
        "digits",
        _digits,
        sample_kinds=("image_label",),
        hint="use it with model=digits_cnn (experiment=digits_cnn)",
    ),
    DataSource("stdlib", _indexed),
    DataSource("indexed", _indexed),
    DataSource("hf", _hf),
):
    register_source(_source)
