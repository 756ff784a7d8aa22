"""The prompts of `stage=grpo`: records read through data=hf -> prompt token ids and answers.

A record holds a prompt (column data.hf.prompt_field) as a string, tokenized as `tokenizer(prompt)`
tokenizes it (the tokenizer's BOS first where it adds one, as TRL's GRPOTrainer does), or as chat
turns (a list of {role, content}), rendered by the tokenizer's chat template with its generation
prompt (refused without a template); and, when grpo.rewards has exact_match, an answer (column
grpo.answer_field, any scalar, compared as text). The loaders hand out rows {"index": i}: the
trainer keeps the prompts and reads the ones of its rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List

import torch

from framework.config.schema import Config
from framework.data.loader import DataBundle
from framework.errors import UserInputError


@dataclass
class Prompt:
    ids: List[int]
    text: str  # the prompt as the model sees it (chat: the rendered template)
    answer: str  # "" when the records have no answer column
    record: dict = field(default_factory=dict)  # the record's columns (a reward function of the user's gets them)


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def encode_prompt(record, tok, prompt_field: str, answer_field: str, need_answer: bool, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise UserInputError(f"{where}: not a record (an object of {prompt_field!r} and {answer_field!r})")
    prompt = record.get(prompt_field)
    if isinstance(prompt, str) and prompt:
        ids, text = tok.encode(prompt, specials=True), prompt  # as tokenizer(prompt): its BOS first
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
            prompt = encode_prompt(record, tok, h.prompt_field, g.answer_field, need_answer, f"{path}: record {number}")
            if g.reward_module:  # its function gets the record's columns, as TRL passes them
                prompt.record = dict(record)
            prompts.append(prompt)
    return prompts


def build_grpo_data(cfg: Config, *, dp_rank: int, dp_size: int) -> DataBundle:
    """The loaders of a GRPO job: the first data.hf.valid_documents prompts are the validation set,
    the rest the training set in a seeded order (trainer.seed). `bundle.prompts`: (train, valid)."""
    from framework.finetune.build import global_loaders, held_out_split, post_training_tokenizer

    tok, main = post_training_tokenizer(cfg, "grpo")
    prompts = read_prompts(cfg, tok)
    refusal = (
        f"stage=grpo: {len(prompts)} prompts, no more than data.hf.valid_documents={cfg.data.hf.valid_documents} "
        "(the validation prompts); give more records or lower data.hf.valid_documents"
    )
    train, valid = held_out_split(prompts, cfg, refusal)
    if main:
        print(
            f"grpo: {len(train)} training and {len(valid)} validation prompts, tokenizer {tok.path or '(built in)'} "
            f"({tok.vocab_size} ids)",
            file=sys.stderr,
            flush=True,
        )
    rows = lambda n: [{"index": torch.tensor(i)} for i in range(n)]  # noqa: E731
    loaders = global_loaders(cfg, rows(len(train)), rows(len(valid)), dp_rank=dp_rank, dp_size=dp_size)
    bundle = DataBundle(*loaders, vocab_size=tok.vocab_size, tokenizer=tok)
    bundle.prompts = (train, valid)
    return bundle
