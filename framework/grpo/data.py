"""The prompts of `stage=grpo`: records read through data=hf -> prompt token ids and answers.

A record holds a prompt (column data.hf.prompt_field) as a string, tokenized as is, or as chat
turns (a list of {role, content}), rendered by the tokenizer's chat template with its generation
prompt (refused without a template); and, when grpo.rewards has exact_match, an answer (column
grpo.answer_field, any scalar, compared as text). The loaders hand out rows {"index": i}: the
trainer keeps the prompts and reads the ones of its rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import List

import torch

from framework.config.schema import Config
from framework.data.loader import DataBundle, GlobalBatchLoader
from framework.errors import UserInputError
from framework.finetune.data import RowSource


@dataclass
class Prompt:
    ids: List[int]
    text: str  # the prompt as the model sees it (chat: the rendered template)
    answer: str  # "" when the records have no answer column


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def encode_prompt(record, tok, prompt_field: str, answer_field: str, need_answer: bool, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise UserInputError(f"{where}: not a record (an object of {prompt_field!r} and {answer_field!r})")
    prompt = record.get(prompt_field)
    if isinstance(prompt, str) and prompt:
        ids, text = tok.encode(prompt), prompt
    elif _is_messages(prompt):
        if not tok.has_chat_template:
            raise UserInputError(
                f"{where}: {prompt_field!r} holds chat turns but the tokenizer {tok.path or '(built in)'} has no "
                "chat template; give plain-text prompts or a tokenizer with a chat template (finetune.tokenizer)"
            )
        ids = tok.chat_ids([dict(m) for m in prompt], add_generation_prompt=True)
        text = tok.decode(ids)
    else:
        raise UserInputError(
            f"{where}: {prompt_field!r} must be a non-empty string or chat turns (a list of {{role, content}}); "
            f"the record's keys: {sorted(record)} (name the column with data.hf.prompt_field)"
        )
    if not ids:
        raise UserInputError(f"{where}: the prompt has no tokens")
    answer = record.get(answer_field)
    if need_answer and (answer is None or isinstance(answer, (list, dict))):
        raise UserInputError(
            f"{where}: grpo.rewards has exact_match but the record has no scalar {answer_field!r}; its keys: "
            f"{sorted(record)} (name the column with grpo.answer_field)"
        )
    return Prompt(list(ids), text, "" if answer is None else str(answer))


def read_prompts(cfg: Config, tok) -> List[Prompt]:
    from framework.data.hf_data import open_dataset

    h, g = cfg.data.hf, cfg.grpo
    need_answer = "exact_match" in g.rewards
    prompts = []
    for path in cfg.data.paths:
        ds = open_dataset(path, False, cfg.data.cache_dir)
        wanted = [h.prompt_field] + ([g.answer_field] if need_answer else [])
        missing = [c for c in wanted if c not in ds.column_names]
        if missing:
            raise UserInputError(
                f"data.paths: {path} has columns {list(ds.column_names)}, not {', '.join(map(repr, missing))}; "
                "name its columns with data.hf.prompt_field and grpo.answer_field"
            )
        for number, record in enumerate(ds, 1):
            prompts.append(
                encode_prompt(record, tok, h.prompt_field, g.answer_field, need_answer, f"{path}: record {number}")
            )
    return prompts


def build_grpo_data(cfg: Config, *, dp_rank: int, dp_size: int) -> DataBundle:
    """The loaders of a GRPO job: the first data.hf.valid_documents prompts are the validation set,
    the rest the training set in a seeded order (trainer.seed). `bundle.prompts`: (train, valid)."""
    import torch.distributed as dist

    from framework.finetune.build import resolve_tokenizer
    from framework.models.registry import family_of

    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    task = family_of(cfg.model).task(cfg.model).name
    if task != "causal_lm":
        raise UserInputError(f"stage=grpo needs a causal language model; model={cfg.model.name} has model.task={task}")
    tok = resolve_tokenizer(cfg, is_main=main, barrier=dist.barrier if distributed else (lambda: None))
    prompts = read_prompts(cfg, tok)
    held_out = cfg.data.hf.valid_documents
    if len(prompts) <= held_out:
        raise UserInputError(
            f"stage=grpo: {len(prompts)} prompts, no more than data.hf.valid_documents={held_out} (the validation "
            "prompts); give more records or lower data.hf.valid_documents"
        )
    valid, train = prompts[:held_out], prompts[held_out:]
    t = cfg.trainer
    if cfg.data.hf.shuffle:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(t.seed)).tolist()
        train = [train[i] for i in order]
    if main:
        print(
            f"grpo: {len(train)} training and {len(valid)} validation prompts, tokenizer {tok.path or '(built in)'} "
            f"({tok.vocab_size} ids)",
            file=sys.stderr,
            flush=True,
        )
    kw = {"micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size}
    kw.update(dp_rank=dp_rank, dp_size=dp_size)
    rows = lambda n: [{"index": torch.tensor(i)} for i in range(n)]  # noqa: E731
    bundle = DataBundle(
        GlobalBatchLoader(RowSource(rows(len(train))), **kw),
        GlobalBatchLoader(RowSource(rows(len(valid))), **kw),
        vocab_size=tok.vocab_size,
        tokenizer=tok,
    )
    bundle.prompts = (train, valid)
    return bundle
