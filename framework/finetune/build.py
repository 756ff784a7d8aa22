"""The data of `stage=fine_tuning`: tokenizer, records, rows and loaders, from the config."""

from __future__ import annotations

import os
import sys

import torch

from framework.config.schema import Config
from framework.data.loader import DataBundle, GlobalBatchLoader
from framework.errors import UserInputError
from framework.finetune.data import (
    RowSource,
    SFTTokenizer,
    build_rows,
    load_tokenizer,
    read_records,
    seq2seq_rows,
    split_records,
)


def resolve_tokenizer(cfg: Config, *, is_main: bool = True, barrier=lambda: None) -> SFTTokenizer:
    """finetune.tokenizer; else the tokenizer in checkpoint.init_from's directory, or model.path's;
    else data.tokenizer; else the stdlib corpus's tokenizer (the main job's pre-training data)."""
    if cfg.finetune.tokenizer:
        return load_tokenizer(cfg.finetune.tokenizer)
    for init in (cfg.checkpoint.init_from, cfg.model.path):  # the weights' own tokenizer, if they came with one
        if init and os.path.isdir(init):
            if os.path.isfile(os.path.join(init, "tokenizer_config.json")):
                return load_tokenizer(init)
            if os.path.isfile(os.path.join(init, "tokenizer.json")):
                return load_tokenizer(os.path.join(init, "tokenizer.json"))
    if cfg.data.tokenizer:
        return load_tokenizer(cfg.data.tokenizer)
    from framework.data.prepare import default_tokenizer_for
    from framework.data.shared_cache import cache_is_shared, prepares_here
    from framework.data.stdlib import ensure_stdlib

    is_main = prepares_here(cache_is_shared(cfg.data.cache_dir))  # see [Note: a cache per node or one for the job]
    prefix = ensure_stdlib(cfg.data.cache_dir, cfg.data.vocab_size, cfg.data.workers, is_main=is_main, barrier=barrier)
    return load_tokenizer(default_tokenizer_for(prefix))


def build_finetune_data(cfg: Config, *, dp_rank: int, dp_size: int) -> DataBundle:
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    tok = resolve_tokenizer(
        cfg, is_main=not distributed or dist.get_rank() == 0, barrier=dist.barrier if distributed else (lambda: None)
    )
    f, t = cfg.finetune, cfg.trainer
    train_file = f.train_file
    if f.dataset:
        from framework.finetune.stdlib_tasks import ensure_dataset

        if not distributed or dist.get_rank() == 0:
            train_file = ensure_dataset(f.dataset, cfg.data.cache_dir)
        if distributed:
            dist.barrier()
        train_file = ensure_dataset(f.dataset, cfg.data.cache_dir)  # written by now: only its path
    if not train_file:
        raise UserInputError(
            "stage=fine_tuning needs finetune.train_file (a JSONL file of records) or finetune.dataset=stdlib_functions"
        )
    from framework.models.registry import family_of

    task = family_of(cfg.model).task(cfg.model).name
    if f.packing and cfg.model.name == "hf" and task != "seq2seq":
        raise UserInputError(
            "finetune.packing=true needs a model that takes per-document positions (our "
            "Llama); with model=hf set finetune.packing=false (padded rows)"
        )
    records = read_records(train_file)
    if f.valid_file:
        train, valid = records, read_records(f.valid_file)
    else:
        train, valid = split_records(records, f.valid_fraction, t.seed)
    seq_len = cfg.data.seq_len
    if task == "seq2seq":  # source -> target, target a quarter as long
        train_rows, valid_rows = (seq2seq_rows(r, tok, seq_len, max(1, seq_len // 4)) for r in (train, valid))
    else:
        train_rows, valid_rows = (build_rows(r, tok, seq_len, f.packing) for r in (train, valid))
    if not train_rows or not valid_rows:
        raise UserInputError(
            f"finetune: no {'training' if not train_rows else 'validation'} record has a "
            f"response token within data.seq_len={seq_len}; raise data.seq_len"
        )
    _check_ids_fit(cfg, tok, train_rows + valid_rows)
    if not distributed or dist.get_rank() == 0:
        print(f"fine-tuning with the tokenizer {tok.path or '(built in)'} ({tok.vocab_size} ids)", file=sys.stderr)
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(t.seed)).tolist()
    train_rows = [train_rows[i] for i in order]
    kw = {
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
    }
    return DataBundle(
        GlobalBatchLoader(RowSource(train_rows), **kw),
        GlobalBatchLoader(RowSource(valid_rows), **kw),
        vocab_size=tok.vocab_size,
        tokenizer=tok,
    )


def _check_ids_fit(cfg: Config, tok: SFTTokenizer, rows: list) -> None:
    """Every token id of the rows is one the model has (checked before the first step: an id past
    the embedding is an index error deep in the model, or silently wrong with a larger one)."""
    from framework.models.registry import family_of

    family = family_of(cfg.model)
    vocab = int(family.vocab_size(family.with_vocab_size(cfg.model, tok.vocab_size)) or 0)  # as the trainer builds it
    if vocab <= 0:
        return  # the model takes the tokenizer's size
    ids = [row[k] for row in rows for k in ("input_ids", "labels") if k in row]
    largest = max((int(t.max()) for t in ids if t.numel()), default=-1)
    if largest >= vocab:
        where = f"model.path={cfg.model.path}" if cfg.model.path else f"model={cfg.model.name}"
        raise UserInputError(
            f"finetune: the tokenizer {tok.path or '(built in)'} gives token id {largest}, but {where} has "
            f"only {vocab} ids; use the model's own tokenizer (finetune.tokenizer=<its directory>) "
            "or a model whose vocabulary covers this one"
        )


def post_training_tokenizer(cfg: Config, stage: str):
    """(tokenizer, whether this rank prints) for a post-training stage (stage=dpo, stage=grpo): the
    model must be a causal language model; the tokenizer as fine-tuning resolves it."""
    import torch.distributed as dist

    from framework.models.registry import family_of

    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    task = family_of(cfg.model).task(cfg.model).name
    if task != "causal_lm":
        raise UserInputError(
            f"stage={stage} needs a causal language model; model={cfg.model.name} has model.task={task}"
        )
    return resolve_tokenizer(cfg, is_main=main, barrier=dist.barrier if distributed else (lambda: None)), main


def held_out_split(items: list, cfg: Config, refusal: str) -> tuple:
    """(train, valid): the first data.hf.valid_documents items validate, the rest train in a seeded
    order (trainer.seed) when data.hf.shuffle. `refusal`: the error when nothing is left to train."""
    held_out = cfg.data.hf.valid_documents
    if len(items) <= held_out:
        raise UserInputError(refusal)
    valid, train = items[:held_out], items[held_out:]
    if cfg.data.hf.shuffle:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.trainer.seed)).tolist()
        train = [train[i] for i in order]
    return train, valid


def global_loaders(cfg: Config, train_rows: list, valid_rows: list, *, dp_rank: int, dp_size: int) -> tuple:
    """(train, validation) loaders of the trainer's global batch over row lists."""
    t = cfg.trainer
    kw = {"micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size}
    return (
        GlobalBatchLoader(RowSource(train_rows), dp_rank=dp_rank, dp_size=dp_size, **kw),
        GlobalBatchLoader(RowSource(valid_rows), dp_rank=dp_rank, dp_size=dp_size, **kw),
    )
